"""The whole WAN path with real parts: compute nodes whose only way out is the site's proxy,
the central VM behind central.sh's front on 443.

Namespaces (tests/fixtures.ProxyNet, 10.204.0.0/16): pxE-node (10.204.1.2, both sites'
compute node: no route to the VM, no name for it), pxE-px (the proxy host: Debian's Squid
with the stock `deny CONNECT !SSL_ports` rule on 3128 and the same with basic auth on 3129,
microsocks on 1080; the only one whose hosts file names vm.pxe.test) and pxE-vm (10.204.2.2:
`central.sh start` bound there with PWW_PUBLIC_HOST=vm.pxe.test, TLS, the token, the front on
443). The sites get only what `central.sh url` prints, the token and the CA.

FederationTest: site alpha (inline deltas) through Squid with a password in https_proxy,
site beta (blob deltas) through socks5h://microsocks, both testbed/fault_site.py, until
DARL's corpus is done, then `central.sh audit` PASS; Squid's log has the CONNECTs to :443,
microsocks' log the VM's name; the direct ports are refused by Squid in one line naming 443
(a site given them exits at once: one 403 in Squid's log, never repeated); the password is
in no log, record or output. CutTunnelTest: a 2 GiB blob up and down through Squid, Squid
killed (-9) and started again mid-transfer: it resumes, the sha256 matches, it exists once,
and the bytes sent again are at most those in flight at the cut.

Needs root, squid, microsocks and nginx (`make netpeers`); else skipped. About 40 s.
"""
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
import unittest

import numpy as np

import blob_client
from tests import fixtures
from tests.fixtures import in_ns
from testbed import fault_site

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable
VM_NAME = "vm.pxe.test"
NET = fixtures.ProxyNet("pxE", "10.204", VM_NAME)
SQUID, SQUID_AUTH, SOCKS = (f"{NET.px_ip}:{p}" for p in (3128, 3129, 1080))
USER, PASSWORD = "alice", "s3cret"
BIG = 2 << 30                      # the cut transfers: 2 GiB
SITE_S = 300                       # a fake site's whole run, at most (5 s measured)
WATCHDOG_S = 900                   # tests/run.py's budget per test here


def lab():
    return Lab.the


class Lab:
    """The namespaces, the proxies and the central VM, once for the module."""
    the = None

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="pww-wan-")
        os.chmod(self.dir, 0o755)                      # Squid and nginx's workers drop root
        self.state, self.site = self.p("central"), self.p("site")
        os.makedirs(self.p("procs"))
        os.makedirs(self.site)
        self.procs = fixtures.NsProcs(self.p("procs"), fixtures.proxy_free_env())
        self.outputs = []                              # every output a command here printed

    def p(self, *names):
        return os.path.join(self.dir, *names)

    def build(self):
        NET.make()
        self.squid_cmd = fixtures.squid_dir(self.p("squid"), NET, USER, PASSWORD)
        self.squid = self.procs.start(NET.px, *self.squid_cmd)
        self.socks = self.procs.start(NET.px, "microsocks", "-i", NET.px_ip, "-p", "1080")
        for port, proc in ((3128, self.squid), (3129, self.squid), (1080, self.socks)):
            fixtures.wait_port(NET.px, NET.px_ip, port, proc)
        init = self.p("init.safetensors")
        rng = np.random.default_rng(0)
        fault_site.write_tensors(init, {k: rng.standard_normal(s).astype(np.float32)
                                        for k, s in fault_site.SHAPES.items()})
        self.central("start", NUM_SAMPLES="16", BLOCK_SIZE="1", INIT=init,
                     FEDMOM_ARGS="--round-deadline-s 20 --member-timeout-s 10")
        self.urls = dict(re.findall(r"^export (\w+)=(.*)$", self.central("url").stdout, re.M))
        self.direct = re.findall(r"https://\S+:2951\d", self.central("url").stdout)
        # the files a site copies (RUNBOOK section 5): where `url` told it to keep them
        shutil.copy(os.path.join(self.state, "token"), self.urls["PWW_TOKEN_FILE"])
        shutil.copy(os.path.join(self.state, "tls", "ca.pem"), self.urls["PWW_CA_FILE"])

    def central(self, cmd, check=True, **env):
        p = subprocess.run(in_ns(NET.vm, "./central.sh", cmd, "--state-dir", self.state), cwd=ROOT, timeout=300,
                           capture_output=True, text=True, env=fixtures.proxy_free_env(
                               PWW_CENTRAL_HOST=NET.vm_ip, PWW_PUBLIC_HOST=VM_NAME,
                               PWW_SITE_TOKEN_FILE=os.path.join(self.site, "central.token"),
                               PWW_SITE_CA_FILE=os.path.join(self.site, "central-ca.pem"), **env))
        self.outputs.append(p.stdout + p.stderr)
        if check and p.returncode != 0:
            raise AssertionError(f"central.sh {cmd}: exit {p.returncode}: {p.stdout}{p.stderr}")
        return p

    def site_env(self, proxy, **extra):
        """A compute node's environment: central.env's lines, the site's proxy, its CA trusted
        (fault_site takes no --ca-file: SSL_CERT_FILE is what it reads)."""
        return fixtures.proxy_free_env(https_proxy=proxy, SSL_CERT_FILE=self.urls["PWW_CA_FILE"],
                                       **{k: v for k, v in self.urls.items()}, **extra)

    def node(self, *args, proxy="", timeout=120, **env):
        """The project's `args` run on the compute node -> CompletedProcess (output kept)."""
        p = subprocess.run(in_ns(NET.node, PY, *args), cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                           env=self.site_env(proxy, **env))
        self.outputs.append(p.stdout + p.stderr)
        return p

    def vm_py(self, code, timeout=600):
        """Python on the VM (the blob store's view, on its direct port) -> its stdout."""
        p = subprocess.run(in_ns(NET.vm, PY, "-c", textwrap.dedent(code)), cwd=ROOT, capture_output=True,
                           text=True, timeout=timeout, env=fixtures.proxy_free_env())
        if p.returncode != 0:
            raise AssertionError(f"on the VM: {p.stderr}")
        return p.stdout

    def squid_log(self):
        with open(self.p("squid", "access.log")) as f:
            return f.read()

    def cut_squid(self):
        """Squid killed (-9: its tunnels cut), its namespace's last connection gone (an event)."""
        self.squid.kill()
        self.squid.wait()
        until(lambda: not fixtures.sh(*in_ns(NET.node, "ss", "-Htn", "state", "established")).stdout.strip(),
              "the node's connections to be closed")

    def restart_squid(self):
        if self.squid.poll() is None:                  # never cut (a failure before it)
            return
        self.squid = self.procs.start(NET.px, *self.squid_cmd)
        fixtures.wait_port(NET.px, NET.px_ip, 3128, self.squid)

    def close(self):
        if os.path.isdir(self.state):
            self.central("stop", check=False)
        self.procs.stop_all()


def until(cond, what, timeout_s=120):
    """Wait for an event `cond()` (polled), at most timeout_s."""
    end = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"gave up waiting for {what} after {timeout_s} s")
        time.sleep(0.05)


def setUpModule():
    fixtures.need_root_and("squid", "microsocks", "nginx", "openssl")
    Lab.the = the = Lab()
    unittest.addModuleCleanup(shutil.rmtree, the.dir, True)
    unittest.addModuleCleanup(NET.remove)              # cleanups run last first: processes, then namespaces
    unittest.addModuleCleanup(the.close)
    try:
        the.build()
    except BaseException:
        print(the.procs.logs(), file=sys.stderr)
        raise


class FederationTest(unittest.TestCase):
    def test_two_sites_through_squid_and_socks5h_to_an_audit_pass(self):
        L = lab()
        self.assertEqual(L.urls["PWW_DARL_URL"], f"https://{VM_NAME}/darl")     # the front, on 443
        records = L.p("site", "records")
        os.makedirs(records)
        sites = {"alpha": (f"http://{USER}:{PASSWORD}@{SQUID_AUTH}", "inline"),
                 "beta": (f"socks5h://{SOCKS}", "blob")}
        procs = {}
        for name, (proxy, transport) in sites.items():
            with open(os.path.join(records, f"{name}.log"), "wb") as log:
                procs[name] = subprocess.Popen(
                    in_ns(NET.node, PY, "-m", "testbed.fault_site", "--cluster", name, "--darl",
                          L.urls["PWW_DARL_URL"], "--fedmom", L.urls["PWW_FEDMOM_URL"], "--blob",
                          L.urls["PWW_BLOB_URL"], "--token-file", L.urls["PWW_TOKEN_FILE"], "--records", records,
                          "--seed", "7", "--span", "2", "--transport", transport),
                    cwd=ROOT, env=L.site_env(proxy), stdout=log, stderr=subprocess.STDOUT)
        for name, p in procs.items():
            try:
                rc = p.wait(timeout=SITE_S)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
                rc = f"still running after {SITE_S} s"
            with open(os.path.join(records, f"{name}.log")) as f:
                self.assertEqual(rc, 0, f"site {name}: {f.read()[-3000:]}")
        audit = None
        end = time.monotonic() + 60
        while time.monotonic() < end:                   # until the aggregator's last commits reached DARL
            audit = L.central("audit", check=False)
            if audit.returncode == 0:
                break
            time.sleep(0.5)
        self.assertEqual(audit.returncode, 0, audit.stdout + audit.stderr)
        self.assertIn("PASS", audit.stdout)
        for name in sites:                              # each site had deltas merged over its own route
            merged = [r for f in os.listdir(records) if f.startswith(name + "-") and f.endswith(".jsonl")
                      for r in read_jsonl(os.path.join(records, f)) if r["event"] == "merged"]
            self.assertGreater(len(merged), 0, f"site {name} had no delta merged")
        self.assertRegex(L.squid_log(), rf"TCP_TUNNEL/200 \d+ CONNECT {re.escape(VM_NAME)}:443 {USER} ")
        self.assertNotRegex(L.squid_log(), r"CONNECT \S+:2951\d .*TCP_TUNNEL")
        with open(os.path.join(L.p("procs"), next(n for n in os.listdir(L.p("procs")) if "microsocks" in n))) as f:
            self.assertIn(f"connected to {VM_NAME}:443", f.read())
        # beta has no other way: without microsocks the node cannot even name the VM
        p = L.node("darl_server.py", "status", "--url", L.urls["PWW_DARL_URL"])
        self.assertEqual(p.returncode, 1, p.stdout + p.stderr)
        self.assertIn(f"cannot resolve {VM_NAME}", p.stderr)
        self.assert_no_password(records)

    def test_the_direct_ports_are_refused_through_squid_in_one_line_naming_443(self):
        L = lab()
        proxy = f"http://{USER}:{PASSWORD}@{SQUID_AUTH}"
        self.assertEqual(len(L.direct), 3, L.direct)
        for url, script in zip(L.direct, ("darl_server.py", "fedmom_server.py", "blobstore.py")):
            with self.subTest(url=url):
                p = L.node(script, "status", "--url", url, proxy=proxy)
                self.assertEqual(p.returncode, 1, p.stdout + p.stderr)
                self.assertEqual(len(p.stderr.strip().splitlines()), 1, p.stderr)
                self.assertIn(f"refused CONNECT to port {url.rsplit(':', 1)[1]} (403", p.stderr)
                self.assertIn("443", p.stderr.split("(403", 1)[1])
        # the same site given the direct ports stops at once: Squid saw one CONNECT to :29510
        denied = L.squid_log().count(f"CONNECT {VM_NAME}:29510")
        records = L.p("site", "records-direct")
        os.makedirs(records)
        p = L.node("-m", "testbed.fault_site", "--cluster", "alpha", "--darl", L.direct[0], "--fedmom", L.direct[1],
                   "--blob", L.direct[2], "--token-file", L.urls["PWW_TOKEN_FILE"], "--records", records, "--seed",
                   "7", "--span", "2", "--transport", "inline", proxy=proxy, timeout=60)
        self.assertNotEqual(p.returncode, 0, p.stdout + p.stderr)
        last = p.stderr.strip().splitlines()[-1]
        self.assertIn("refused CONNECT to port 29510 (403", last)
        self.assertIn("serve the central VM on 443", last)
        self.assertEqual(L.squid_log().count(f"CONNECT {VM_NAME}:29510") - denied, 1, "the refusal was repeated")
        self.assert_no_password(records)

    def assert_no_password(self, *dirs):
        """The proxy's password: in no file of the sites' and the VM's, nor any output here."""
        L = lab()
        found = [f"output of command {i}" for i, out in enumerate(L.outputs) if PASSWORD in out]
        for top in (L.site, L.state, L.p("procs"), L.p("squid"), *dirs):
            for d, _, files in os.walk(top):
                found += [os.path.join(d, n) for n in files if holds(os.path.join(d, n), PASSWORD.encode())]
        self.assertEqual(found, [])


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def holds(path, word):
    """`word` is somewhere in the file (read in 16 MiB steps: the store's blobs are large)."""
    tail = b""
    with open(path, "rb") as f:
        while True:
            block = f.read(16 << 20)
            if not block:
                return False
            if word in tail + block:
                return True
            tail = block[-len(word):]


UPLOAD = """
import json, sys, blob_client, httpc
log = lambda what, err, left: print("retry", what, type(err).__name__, file=sys.stderr, flush=True)
info = blob_client.put_file({url!r}, "wan-big", {src!r}, token=httpc.load_token({token!r}), progress=True,
                            sha256={sha!r}, ca_file={ca!r}, deadline=httpc.Deadline(300, max_wait_s=0.5, log=log))
print(json.dumps(info))
"""
DOWNLOAD = """
import sys, blob_client, httpc
log = lambda what, err, left: print("retry", what, type(err).__name__, file=sys.stderr, flush=True)
print(blob_client.get_file({url!r}, "wan-big", {dst!r}, token=httpc.load_token({token!r}), progress=False,
                           ca_file={ca!r}, deadline=httpc.Deadline(300, max_wait_s=0.5, log=log)))
"""
STORE = """
import json, blob_client, httpc
url, tok, ca = "https://{ip}:29512", httpc.load_token({token!r}), {ca!r}
def landed():
    h = blob_client.head(url, "wan-big", token=tok, ca_file=ca) or {{"complete": False, "offset": 0}}
    return {size} if h["complete"] else sum(b - a for a, b in h["ranges"]) if "ranges" in h else h["offset"]
print(json.dumps({{"landed": landed(), "listing": httpc.call(url, "GET", "/blobs", token=tok, ca_file=ca)}}))
"""

DELETE = """
import httpc
try:
    httpc.call("https://{ip}:29512", "DELETE", "/blobs/wan-big", token=httpc.load_token({token!r}), ca_file={ca!r})
except httpc.CallError:
    pass
"""


def tcp_buffers():
    """The largest TCP send + receive buffer any of the namespaces allows (tcp_wmem, tcp_rmem max)."""
    most = 0
    for ns in (NET.node, NET.px, NET.vm):
        out = fixtures.sh(*in_ns(ns, "cat", "/proc/sys/net/ipv4/tcp_wmem", "/proc/sys/net/ipv4/tcp_rmem")).stdout
        w, r = (int(line.split()[2]) for line in out.splitlines())
        most = max(most, w + r)
    return most


class CutTunnelTest(unittest.TestCase):
    """Squid killed mid-transfer and started again on the same address: the transfer resumes."""

    @classmethod
    def setUpClass(cls):
        cls.L = L = lab()
        cls.src = L.p("big.bin")
        cls.addClassCleanup(lambda: [os.remove(p) for p in (cls.src, L.p("big.out")) if os.path.exists(p)])
        cls.addClassCleanup(L.vm_py, DELETE.format(ip=NET.vm_ip, token=L.urls["PWW_TOKEN_FILE"],
                                                   ca=L.urls["PWW_CA_FILE"]))
        h = hashlib.sha256()
        with open(cls.src, "wb") as f:                 # random bytes: a piece put at the wrong offset shows
            for _ in range(BIG >> 22):
                block = os.urandom(4 << 20)
                h.update(block)
                f.write(block)
        cls.sha = h.hexdigest()
        cls.fmt = dict(url=L.urls["PWW_BLOB_URL"], src=cls.src, dst=L.p("big.out"), token=L.urls["PWW_TOKEN_FILE"],
                       ca=L.urls["PWW_CA_FILE"], sha=cls.sha, ip=NET.vm_ip, size=BIG)

    def store(self, wait_for):
        return json.loads(self.L.vm_py(STORE.format(wait_for=wait_for, **self.fmt)))

    def node_child(self, code):
        return subprocess.Popen(in_ns(NET.node, PY, "-c", textwrap.dedent(code.format(**self.fmt))), cwd=ROOT,
                                env=self.L.site_env(f"http://{SQUID}"), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)

    def finish(self, child):
        try:
            out, err = child.communicate(timeout=600)
        finally:
            if child.poll() is None:
                child.kill()
                child.communicate()
        self.L.outputs.append(out + err)
        self.assertEqual(child.returncode, 0, err[-3000:])
        self.assertIn("retry ", err)                    # it was cut, and went on
        return out

    def test_1_upload_resumes_after_squid_is_killed(self):
        L = self.L
        child = self.node_child(UPLOAD)
        try:
            # the event: the uploader's progress line (once a second) says half is sent. Read
            # here as it comes: polls that start a process each (HEAD, ip -s link) came seconds
            # late on 2 loaded cores, after the last byte; the store's log of landed pieces
            # trails its fdatasyncs (a third of 2 GiB logged when the last byte arrived)
            for line in child.stderr:
                m = re.match(r"put wan-big: ([\d.]+)/", line)
                if m and float(m.group(1)) * 2**20 >= BIG // 2:
                    break
            self.assertIsNone(child.poll(), "the upload ended before the cut")
            L.cut_squid()
            at_cut = self.store("now")["landed"]
        finally:
            L.restart_squid()
        info = json.loads(self.finish(child))
        self.assertLess(at_cut, BIG, "the upload ended before the cut")
        self.assertEqual((info["size"], info["sha256"]), (BIG, self.sha))
        # sent = what went out before the cut + the resume, which sends what the store lacks:
        # the bytes sent twice are those in flight at the cut, sent but never landed
        resent = info["sent"] - BIG
        bound = self.in_flight_bound()
        self.assertGreaterEqual(resent, 0)
        self.assertLessEqual(resent, bound)
        print(f"\nupload: cut with {at_cut} of {BIG} bytes landed, {resent} sent twice (bound {bound})",
              file=sys.stderr)
        listing = self.store("now")["listing"]
        self.assertEqual([b for b in listing["blobs"] if b["id"] == "wan-big"],
                         [{"id": "wan-big", "size": BIG, "sha256": self.sha}])
        self.assertEqual([u for u in listing["uploads"] if u["id"] == "wan-big"], [])

    def in_flight_bound(self):
        """What a cut may lose, per stream at most: a socket send buffer and the next hop's
        receive buffer on each of the three hops (node -> Squid -> the front -> the store,
        tcp_wmem + tcp_rmem's largest), the relays' buffers (Squid's, nginx's 1 MiB body
        buffer) and the program's own (256 KiB): 2 MiB covers those. Less than the half of the
        blob a transfer that started over would move again (checked)."""
        streams = blob_client.pick_streams(BIG)
        bound = streams * (3 * tcp_buffers() + (2 << 20))
        self.assertLess(bound, BIG // 2, "this machine's TCP buffers would hide a transfer that starts over")
        return bound

    def test_2_download_resumes_after_squid_is_killed(self):
        L = self.L
        self.assertEqual(self.store("done")["landed"], BIG, "test_1 put the blob")
        streams = blob_client.pick_streams(BIG)
        side = f"{L.p('big.out')}.part-{self.sha[:16]}.ranges"

        def half():                                     # the client's own record of what it holds
            try:
                with open(side) as f:
                    return sum(b - a for a, b in json.load(f)["ranges"]) >= BIG // 2
            except (OSError, ValueError):
                return False
        child = self.node_child(DOWNLOAD)
        try:
            until(lambda: half() or child.poll() is not None, "half the download", 300)
            self.assertIsNone(child.poll(), "the download ended before the cut")
            L.cut_squid()
        finally:
            L.restart_squid()
        self.assertEqual(self.finish(child).strip(), self.sha)
        self.assertEqual(blob_client.sha256_file(L.p("big.out")), self.sha)
        self.assertEqual(sorted(n for n in os.listdir(L.dir) if n.startswith("big.out")), ["big.out"])
        # what the front sent of it, all attempts: the blob once, plus what was in flight when
        # the tunnels broke (in_flight_bound)
        with open(os.path.join(L.state, "front", "access.log")) as f:
            sent = sum(int(n) for n in re.findall(r'"GET /blob/blobs/wan-big HTTP/1.1" \d+ (\d+)', f.read()))
        bound = self.in_flight_bound()
        self.assertGreaterEqual(sent, BIG)
        self.assertLessEqual(sent - BIG, bound)
        print(f"\ndownload: {streams} streams, {sent - BIG} bytes fetched twice (bound {bound})", file=sys.stderr)


if __name__ == "__main__":
    unittest.main()
