"""tests/test_front.py - the front: the three central services on one HTTPS port (nginx),
started, checked and stopped by central.sh, used by the real clients.

    .venv/bin/python -m unittest tests.test_front -v

FrontTest: `central.sh start` (real daemons + Debian's nginx on a free port) once, then through
the front: each service's /health and status command, 401 for every unauthenticated route, a
300 MB blob PUT + GET with blob_client (same sha256), a Range GET, a PUT cut off mid-body and
resumed, the status page under /fedmom/, the direct ports beside it, and a short federation of
two fake sites (testbed/fault_site.py, one inline, one through the blob store) given only the
front's URLs, to an audit PASS. LifecycleTest: url, status and stop (no nginx process left).
DefaultPortTest: inside a network namespace of its own (frC-*, loopback only) the default port
443; the same start without CAP_NET_BIND_SERVICE refused in one line naming the fix; without
nginx the direct ports and the line saying how to get the front.
Needs nginx (`make netpeers`); DefaultPortTest needs root (network namespaces).
"""
import hashlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT]

import blob_client  # noqa: E402
import httpc  # noqa: E402
from tests.test_shell import bash  # noqa: E402
from testbed import fault_site  # noqa: E402
from testbed.harness import free_port  # noqa: E402

NGINX = shutil.which("nginx") or "/usr/sbin/nginx"
BIG = 300 * 10**6               # "a few hundred MB" through the front


def need_nginx():
    if not os.access(NGINX, os.X_OK):
        raise unittest.SkipTest("nginx is missing: make netpeers")


def write_file(path, size, seed=1):
    """`size` bytes of a seeded pattern (not zeros: a sha256 that proves every byte)."""
    block = hashlib.sha256(str(seed).encode()).digest() * (1 << 15)      # 1 MiB
    with open(path, "wb") as f:
        for _ in range(size // len(block)):
            f.write(block)
        f.write(block[:size % len(block)])
    return blob_client.sha256_file(path)


def make_init(path):
    import numpy as np
    rng = np.random.default_rng(0)
    fault_site.write_tensors(path, {k: rng.standard_normal(s).astype(np.float32) for k, s in fault_site.SHAPES.items()})
    return path


def procs_naming(text):
    """Pids of live processes whose command line names `text` (nginx's master names its config)."""
    out = []
    for d in os.listdir("/proc"):
        try:
            if d.isdigit() and text in pathlib.Path(f"/proc/{d}/cmdline").read_bytes().decode(errors="replace") \
                    and pathlib.Path(f"/proc/{d}/stat").read_text().split()[2] != "Z":
                out.append(int(d))
        except OSError:
            pass
    return out


def children(pid):
    try:
        return [int(p) for p in pathlib.Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def alive(pid):
    try:
        return pathlib.Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


class Central:
    """One central.sh state dir with its own ports; run(cmd) runs central.sh there."""

    def __init__(self, front=True, **env):
        self.state = tempfile.mkdtemp(prefix="pww-front-")
        self.env = {"DARL_PORT": str(free_port()), "FEDMOM_PORT": str(free_port()), "BLOB_PORT": str(free_port()),
                    **({"PWW_PUBLIC_PORT": str(free_port())} if front else {}), **env}
        self.ca = os.path.join(self.state, "tls", "ca.pem")

    def run(self, cmd, env=None, check=True, prefix=""):
        return bash(f"{prefix}./central.sh {cmd} --state-dir {self.state}", {**self.env, **(env or {})},
                    check=check, timeout=300)

    def start(self, **env):
        return self.run("start", {"NUM_SAMPLES": "16", "BLOCK_SIZE": "1",
                                  "INIT": make_init(os.path.join(self.state, "init.safetensors")), **env})

    @property
    def token(self):
        return pathlib.Path(self.state, "token").read_text().strip()

    def front(self, name):
        return f"https://127.0.0.1:{self.env['PWW_PUBLIC_PORT']}/{name}"

    def direct(self, name):
        return f"https://127.0.0.1:{self.env[name.upper() + '_PORT']}"

    def close(self):
        self.run("stop", check=False)
        try:                                   # what nginx said went wrong, for a failed test's reader
            errors = [x for x in pathlib.Path(self.state, "front", "error.log").read_text().splitlines()
                      if "[error]" in x or "[crit]" in x]
        except OSError:
            errors = []
        if errors:
            sys.stderr.write("front error.log:\n" + "\n".join(errors[-10:]) + "\n")
        shutil.rmtree(self.state, ignore_errors=True)


class FrontTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        need_nginx()
        cls.c = Central(FEDMOM_ARGS="--round-deadline-s 20 --member-timeout-s 10")
        cls.started = cls.c.start()
        cls.tmp = tempfile.mkdtemp(prefix="pww-front-files-")

    @classmethod
    def tearDownClass(cls):
        cls.c.close()
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def call(self, url, path, token=None, method="GET", body=None):
        return httpc.call(url, method, path, body, token=token, timeout=30, ca_file=self.c.ca)

    def test_each_service_answers_through_the_front_with_its_prefix_stripped(self):
        self.assertIn("front started", self.started.stdout)
        for name, service in (("darl", "darl"), ("blob", "blobstore")):
            self.assertEqual(self.call(self.c.front(name), "/health")["service"], service)
        self.assertIn("round", self.call(self.c.front("fedmom"), "/health"))
        self.assertEqual(self.call(self.c.front("darl"), "/status", self.c.token)["num_blocks"], 16)
        self.assertIn("round", self.call(self.c.front("fedmom"), "/status", self.c.token))
        self.assertIn("blobs", self.call(self.c.front("blob"), "/blobs", self.c.token))
        # each daemon's own status command, given the front's URL
        for script, name in (("darl_server.py", "darl"), ("fedmom_server.py", "fedmom"), ("blobstore.py", "blob")):
            r = subprocess.run([sys.executable, script, "status", "--url", self.c.front(name), "--token-file",
                                os.path.join(self.c.state, "token"), "--ca-file", self.c.ca],
                               cwd=ROOT, capture_output=True, text=True, timeout=60)
            self.assertEqual(r.returncode, 0, f"{script} status: {r.stdout}{r.stderr}")
        # the front's own answers are JSON a client reads as one line
        with self.assertRaises(httpc.CallError) as e:
            self.call(f"https://127.0.0.1:{self.c.env['PWW_PUBLIC_PORT']}", "/nothing")
        self.assertEqual(e.exception.status, 404)
        self.assertIn("/darl/", e.exception.reply["error"])

    def test_no_unauthenticated_request_is_accepted_on_any_route(self):
        routes = [("darl", "GET", "/status"), ("darl", "POST", "/acquire"), ("darl", "GET", "/custody"),
                  ("fedmom", "GET", "/status"), ("fedmom", "GET", "/round"), ("fedmom", "POST", "/join"),
                  ("fedmom", "GET", "/theta"), ("blob", "GET", "/blobs"), ("blob", "GET", "/blobs/x"),
                  ("blob", "DELETE", "/blobs/x")]
        accepted = []
        for token in (None, "wrong-" + self.c.token):
            for name, method, path in routes:
                try:
                    self.call(self.c.front(name), path, token, method, {} if method == "POST" else None)
                    accepted.append((token, name, method, path))
                except httpc.CallError as e:
                    self.assertEqual(e.status, 401, (name, method, path, e.reply))
            # a PUT of a body: refused before the store keeps a byte
            with self.assertRaises(httpc.CallError) as e:
                blob_client.put_file(self.c.front("blob"), "unauth", __file__, token=token, ca_file=self.c.ca)
            self.assertEqual(e.exception.status, 401)
        self.assertEqual(accepted, [])
        self.assertNotIn("unauth", json.dumps(self.call(self.c.front("blob"), "/blobs", self.c.token)))

    def test_a_big_blob_goes_up_and_down_through_the_front_with_the_same_sha(self):
        src, dst = os.path.join(self.tmp, "big.bin"), os.path.join(self.tmp, "big.out")
        sha = write_file(src, BIG)
        info = blob_client.put_file(self.c.front("blob"), "big", src, token=self.c.token, ca_file=self.c.ca)
        self.assertEqual((info["size"], info["sha256"], info["sent"]), (BIG, sha, BIG))
        # the headers the store answers with come through (Content-Length, X-Content-Sha256, X-Upload-*)
        self.assertEqual(blob_client.head(self.c.front("blob"), "big", token=self.c.token, ca_file=self.c.ca),
                         {"complete": True, "size": BIG, "total": BIG, "sha256": sha})
        self.assertEqual(blob_client.get_file(self.c.front("blob"), "big", dst, token=self.c.token,
                                              ca_file=self.c.ca), sha)
        self.assertEqual(blob_client.sha256_file(dst), sha)
        # a Range request: the store's 206 and Content-Range, the bytes of that range
        conn = httpc.connect(self.c.front("blob"), 30, self.c.ca)
        try:
            conn.request("GET", "/blob/blobs/big", headers={**httpc.auth_headers(self.c.token),
                                                            "Range": "bytes=1000000-1000999"})
            resp = conn.getresponse()
            body = resp.read()
        finally:
            conn.close()
        self.assertEqual((resp.status, resp.getheader("Content-Range")), (206, f"bytes 1000000-1000999/{BIG}"))
        with open(src, "rb") as f:
            f.seek(1000000)
            self.assertEqual(body, f.read(1000))
        # a download resumed by blob_client (Range from what its temp file holds)
        part = f"{dst}2.part-{sha[:16]}"
        with open(src, "rb") as f, open(part, "wb") as out:
            out.write(f.read(BIG // 3))
        self.assertEqual(blob_client.get_file(self.c.front("blob"), "big", dst + "2", token=self.c.token,
                                              ca_file=self.c.ca), sha)
        # the direct port still serves the same blob
        self.assertEqual(blob_client.head(self.c.direct("blob"), "big", token=self.c.token,
                                          ca_file=self.c.ca)["sha256"], sha)

    def test_a_put_cut_off_mid_body_resumes_through_the_front(self):
        size = 64 << 20
        src = os.path.join(self.tmp, "cut.bin")
        sha = write_file(src, size, seed=2)
        conn = httpc.connect(self.c.front("blob"), 30, self.c.ca)
        conn.putrequest("PUT", "/blob/blobs/cut", skip_accept_encoding=True)
        for k, v in {"Content-Length": str(size), "X-Content-Sha256": sha,
                     "Content-Type": "application/octet-stream", **httpc.auth_headers(self.c.token)}.items():
            conn.putheader(k, v)
        conn.endheaders()
        with open(src, "rb") as f:
            conn.sock.sendall(f.read(size // 2))
        conn.close()                                    # the connection drops half way
        part = None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:              # until the store has let go of the upload
            ups = self.call(self.c.front("blob"), "/blobs", self.c.token)["uploads"]
            part = next((u for u in ups if u["id"] == "cut" and not u["uploading"]), None)
            if part:
                break
            time.sleep(0.1)
        self.assertIsNotNone(part, "the cut upload never showed as unfinished")
        self.assertGreater(part["offset"], 0)
        info = blob_client.put_file(self.c.front("blob"), "cut", src, token=self.c.token, ca_file=self.c.ca,
                                    deadline=httpc.Deadline(60, log=httpc.quiet))
        self.assertEqual((info["sha256"], info["sent"]), (sha, size - part["offset"]))
        self.assertEqual(blob_client.get_file(self.c.front("blob"), "cut", src + ".out", token=self.c.token,
                                              ca_file=self.c.ca), sha)

    def test_the_central_check_a_user_runs_from_a_compute_node_passes_and_fails_as_the_job_would(self):
        """sites/siteinfo.sh --central, as RUNBOOK section 1 says: central.env from `central.sh url`,
        read as a job reads it, then fedsite.py check in the site's runtime (local: .venv)."""
        env_file = os.path.join(self.tmp, "central.env")
        with open(env_file, "w") as f:
            f.write(self.c.run("url").stdout)
        env = {"PWW_SITE": "local", "PWW_CENTRAL_ENV": env_file, "PWW_TOKEN_FILE": os.path.join(self.c.state, "token"),
               "PWW_CA_FILE": self.c.ca}
        r = bash("sites/siteinfo.sh --central --mib 4", env, check=False, timeout=300)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        for name in ("darl", "fedmom", "blob"):
            self.assertIn(self.c.front(name), r.stdout)
        self.assertEqual(r.stdout.count("route     direct (loopback)"), 3, r.stdout)
        self.assertEqual(r.stdout.count("TLS       ok: TLSv1.3"), 3, r.stdout)
        self.assertEqual(r.stdout.count("auth      ok"), 3, r.stdout)
        self.assertRegex(r.stdout, r"4 MiB +up \d+ MB/s, down \d+ MB/s \(checksums match\)")
        self.assertIn("PASS", r.stdout.splitlines()[-1])
        self.assertNotIn("check.", json.dumps(self.call(self.c.front("blob"), "/blobs", self.c.token)))
        # a wrong token: every service says so in one line with the fix, exit 1, no traceback
        wrong = os.path.join(self.tmp, "wrong.token")
        with open(wrong, "w") as f:
            f.write("not-the-token\n")
        r = bash("sites/siteinfo.sh --central --mib 4", {**env, "PWW_TOKEN_FILE": wrong}, check=False, timeout=300)
        self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
        self.assertEqual(r.stdout.count("auth      FAILED: HTTP 401"), 3, r.stdout)
        self.assertIn("central.sh url names it", r.stdout)
        self.assertTrue(r.stdout.splitlines()[-1].startswith("FAIL: DARL (auth), FedMom (auth), blob store (auth)"))
        self.assertNotIn("Traceback", r.stdout + r.stderr)

    def test_the_status_page_under_fedmom(self):
        conn = httpc.connect(self.c.front("fedmom"), 30, self.c.ca)
        try:
            conn.request("GET", "/fedmom")              # no slash: sent to /fedmom/ on the same host and port
            resp = conn.getresponse()
            resp.read()
            self.assertEqual((resp.status, resp.getheader("Location")), (301, "/fedmom/"))
            conn.request("GET", "/fedmom/?saved=1")
            resp = conn.getresponse()
            page = resp.read().decode()
        finally:
            conn.close()
        self.assertEqual(resp.status, 200)
        self.assertIn("pww central VM: round", page)
        self.assertNotIn(' href="/', page)             # no link that would leave /fedmom/
        self.assertNotIn(' src="/', page)

    def test_a_federation_given_only_the_front_urls_passes_the_audit(self):
        records = os.path.join(self.tmp, "records")
        os.makedirs(records)
        env = {**os.environ, "SSL_CERT_FILE": self.c.ca, "PYTHONPATH": ROOT}   # the sites trust central.sh's CA
        sites = []
        for name, transport in (("alpha", "inline"), ("beta", "blob")):
            log = open(os.path.join(records, f"{name}.log"), "wb")
            self.addCleanup(log.close)
            p = subprocess.Popen([sys.executable, "-m", "testbed.fault_site", "--cluster", name,
                                  "--darl", self.c.front("darl"), "--fedmom", self.c.front("fedmom"),
                                  "--blob", self.c.front("blob"), "--token-file", os.path.join(self.c.state, "token"),
                                  "--records", records, "--seed", "7", "--span", "2", "--transport", transport],
                                 cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
            self.addCleanup(lambda p=p: p.poll() is None and p.kill())
            sites.append((name, p))
        for name, p in sites:
            try:
                rc = p.wait(timeout=240)
            except subprocess.TimeoutExpired:
                rc = "still running after 240 s"
            self.assertEqual(rc, 0, f"site {name}: " + pathlib.Path(records, f"{name}.log").read_text()[-2000:])
        audit = None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:              # until the aggregator's last commits reached DARL
            audit = self.c.run("audit", check=False)
            if audit.returncode == 0:
                break
            time.sleep(0.5)
        self.assertEqual(audit.returncode, 0, audit.stdout + audit.stderr)
        self.assertIn("PASS", audit.stdout)
        log = pathlib.Path(self.c.state, "front", "access.log").read_text()
        for route in ("POST /darl/acquire", "PUT /fedmom/delta", "PUT /blob/blobs/delta.beta"):
            self.assertIn(route, log)


class LifecycleTest(unittest.TestCase):
    def setUp(self):
        need_nginx()
        self.c = Central()
        self.addCleanup(self.c.close)

    def test_url_status_restart_and_stop_leave_no_process(self):
        self.c.start()
        port = self.c.env["PWW_PUBLIC_PORT"]
        url = self.c.run("url").stdout.splitlines()
        for name in ("darl", "fedmom", "blob"):
            self.assertIn(f"export PWW_{name.upper()}_URL=https://127.0.0.1:{port}/{name}", url)
        self.assertTrue(any(self.c.direct("darl") in line for line in url if line.startswith("#")), url)
        st = self.c.run("status")
        master = int(pathlib.Path(self.c.state, "front", "nginx.pid").read_text())
        self.assertIn(f"front: pid {master}, https://127.0.0.1:{port} /darl ok /fedmom ok /blob ok", st.stdout)
        workers = children(master)
        self.assertGreaterEqual(len(workers), 1)
        if os.geteuid() == 0:                           # nginx's workers never run as root
            uids = {pathlib.Path(f"/proc/{w}/status").read_text().split("Uid:")[1].split()[0] for w in workers}
            self.assertNotIn("0", uids)
        # a second start re-reads the config, keeps the same nginx
        self.assertIn(f"front already running (pid {master})", self.c.start().stdout)
        pids = procs_naming(self.c.state)
        self.assertIn(master, pids)
        self.c.run("stop")
        self.assertEqual(procs_naming(self.c.state), [])
        self.assertEqual([p for p in [master, *workers] if alive(p)], [])
        st = self.c.run("status", check=False)
        self.assertNotEqual(st.returncode, 0)
        self.assertIn("front: NOT RUNNING", st.stdout)
        with self.assertRaises(OSError):                # nothing listens on the front's port
            httpc.call(self.c.front("darl"), "GET", "/health", timeout=5, ca_file=self.c.ca)

    def test_a_port_taken_stops_the_start_before_any_daemon_with_one_line(self):
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            s.listen()
            r = self.c.run("start", {"NUM_SAMPLES": "16", "INIT": make_init(os.path.join(self.c.state, "i.st")),
                                     "PWW_PUBLIC_PORT": str(s.getsockname()[1])}, check=False)
        self.assertEqual(r.returncode, 1)
        self.assertEqual(len(r.stderr.strip().splitlines()), 1, r.stderr)
        self.assertIn("PWW_PUBLIC_PORT=", r.stderr)
        self.assertEqual(procs_naming(self.c.state), [])


class DefaultPortTest(unittest.TestCase):
    """Inside a network namespace of our own (loopback only): root binds 443 there."""

    def setUp(self):
        need_nginx()
        if os.geteuid() != 0:
            raise unittest.SkipTest("needs root (a network namespace)")
        self.ns = f"frC-{os.getpid()}"
        subprocess.run(["ip", "netns", "add", self.ns], check=True)
        self.addCleanup(subprocess.run, ["ip", "netns", "del", self.ns])
        subprocess.run(["ip", "netns", "exec", self.ns, "ip", "link", "set", "lo", "up"], check=True)
        self.c = Central(front=False)
        self.addCleanup(self.c.close)
        self.addCleanup(self.c.run, "stop", check=False, prefix=f"ip netns exec {self.ns} ")   # before the ns goes

    def in_ns(self, code):
        r = subprocess.run(["ip", "netns", "exec", self.ns, sys.executable, "-c", code], cwd=ROOT,
                           capture_output=True, text=True, timeout=60)
        self.assertEqual(r.returncode, 0, r.stderr)
        return r.stdout.strip()

    def test_443_by_default_and_a_refusal_that_names_the_fix(self):
        ns = f"ip netns exec {self.ns} "
        # without CAP_NET_BIND_SERVICE (what a non-root user lacks): one line, nothing started
        r = self.c.run("start", {"NUM_SAMPLES": "16", "INIT": make_init(os.path.join(self.c.state, "i.st"))},
                       check=False, prefix=ns + "setpriv --bounding-set -net_bind_service ")
        self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
        self.assertEqual(len(r.stderr.strip().splitlines()), 1, r.stderr)
        for words in ("port 443", "setcap cap_net_bind_service=+ep", "PWW_PUBLIC_PORT="):
            self.assertIn(words, r.stderr)
        self.assertEqual(procs_naming(self.c.state), [])
        # as root: port 443, and the URLs carry no port
        self.c.run("start", {"NUM_SAMPLES": "16", "INIT": os.path.join(self.c.state, "i.st")}, prefix=ns)
        url = self.c.run("url", prefix=ns).stdout.splitlines()
        self.assertIn("export PWW_DARL_URL=https://127.0.0.1/darl", url)
        self.assertIn("export PWW_BLOB_URL=https://127.0.0.1/blob", url)
        got = self.in_ns(f"import httpc; print(httpc.call('https://127.0.0.1/darl', 'GET', '/status', "
                         f"token={self.c.token!r}, ca_file={self.c.ca!r})['num_blocks'])")
        self.assertEqual(got, "16")
        self.c.run("stop", prefix=ns)
        self.assertEqual(procs_naming(self.c.state), [])

    def test_without_nginx_the_direct_ports_and_one_line_on_how_to_get_the_front(self):
        ns = f"ip netns exec {self.ns} "
        r = self.c.run("start", {"NUM_SAMPLES": "16", "INIT": make_init(os.path.join(self.c.state, "i.st")),
                                 "NGINX": "/nonexistent/nginx"}, prefix=ns)
        lines = [x for x in r.stdout.splitlines() if x.startswith("no front")]
        self.assertEqual(len(lines), 1, r.stdout)
        self.assertIn("apt-get install nginx", lines[0])
        url = self.c.run("url", prefix=ns).stdout.splitlines()
        self.assertIn(f"export PWW_DARL_URL={self.c.direct('darl')}", url)
        st = self.c.run("status", {"NGINX": "/nonexistent/nginx"}, prefix=ns)
        self.assertIn("front: none", st.stdout)
        self.assertEqual(self.in_ns(f"import httpc; print(httpc.call({self.c.direct('blob')!r}, 'GET', '/health', "
                                    f"ca_file={self.c.ca!r})['service'])"), "blobstore")
        r = self.c.run("start", {"NGINX": "/nonexistent/nginx", "PWW_FRONT": "on"}, check=False, prefix=ns)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("apt-get install nginx", r.stderr)


if __name__ == "__main__":
    unittest.main()
