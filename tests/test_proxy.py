"""The route to the central VM through a site's proxy (httpc.route, httpc.connect).

RouteRulesTest: the rules table (curl's variables and precedence, no_proxy's suffixes,
CIDR and `*`, the --proxy / $PWW_PROXY override, loopback always direct), no credentials in
any description; no network. Cross-checked against real curl (CurlAgreesTest): candidate
proxies are listeners in a network namespace and the one curl connects to is the one
httpc.route names.

ThroughProxiesTest: a "compute node" in netns pxA-node (10.201.1.2) whose only neighbour is
the proxy host pxA-px (10.201.1.1 / 10.201.2.1: Debian's Squid on 3128, the same Squid with
basic auth on 3129, microsocks on 1080 and, with user/password, 1081), and the central VM in
pxA-vm (10.201.2.2: blobstore.py on 443, darl_server.py on 29510, TLS for vm.pxa.test and
10.201.2.2). The node has no route to 10.201.2.0/24 and cannot resolve vm.pxa.test; the proxy
host can (its /etc/netns hosts file). Squid keeps the stock `http_access deny CONNECT
!SSL_ports` (SSL_ports 443). The project's own commands run in the node netns; each failure
must be one line naming the route and the fix, exit 1, no traceback, no password.

Needs root (network namespaces) and squid + microsocks (`make netpeers`); else skipped."""
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import unittest

import certs
import httpc
import tokenize_corpus as tc
from tests import fixtures
from tests.fixtures import PROXY_VARS, in_ns, sh

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable
NODE, PX, VM = "pxA-node", "pxA-px", "pxA-vm"
PX_IP, VM_IP, VM_NAME = "10.201.1.1", "10.201.2.2", "vm.pxa.test"
SQUID, SQUID_AUTH, SOCKS, SOCKS_AUTH, DEAD = (f"{PX_IP}:{p}" for p in (3128, 3129, 1080, 1081, 3999))
TOKEN = "proxy-test-token-0123456789"
PASSWORD = "s3cr:t@pw"                       # ':' and '@' percent-encoded in the URL
PASSWORD_URL = "s3cr%3At%40pw"


clean_env = fixtures.proxy_free_env
# gone.pxa.test: the proxy host's own address, where nothing listens on 443 (Squid's 503)
NET = fixtures.ProxyNet("pxA", "10.201", VM_NAME, px_hosts="10.201.2.1 gone.pxa.test\n")


class RouteRulesTest(unittest.TestCase):
    def setUp(self):
        saved = {k: os.environ.pop(k) for k in PROXY_VARS if k in os.environ}
        self.addCleanup(os.environ.update, saved)
        self.addCleanup(lambda: [os.environ.pop(k, None) for k in PROXY_VARS])
        self.addCleanup(httpc.set_proxy, None)

    def route(self, url, **env):
        for k in PROXY_VARS:
            os.environ.pop(k, None)
        os.environ.update(env)
        return httpc.route(url).describe()

    def test_curls_variables_and_their_order(self):
        r = self.route
        self.assertEqual(r("https://vm.example"), "direct")
        self.assertEqual(r("https://vm.example", https_proxy="p1:3128", HTTPS_PROXY="p2:3128", all_proxy="p3:1"),
                         "proxy http://p1:3128 (from $https_proxy)")
        self.assertEqual(r("https://vm.example", HTTPS_PROXY="p2:3128", all_proxy="p3:1"),
                         "proxy http://p2:3128 (from $HTTPS_PROXY)")
        self.assertEqual(r("https://vm.example", https_proxy="", all_proxy="socks5h://p3"),
                         "proxy socks5h://p3:1080 (from $all_proxy)")          # empty = unset; curl's port 1080
        self.assertEqual(r("https://vm.example", ALL_PROXY="socks5://p4:9"), "proxy socks5://p4:9 (from $ALL_PROXY)")
        self.assertEqual(r("http://vm.example", HTTP_PROXY="p5:8080"), "direct")   # never the uppercase one
        self.assertEqual(r("http://vm.example", http_proxy="p5:8080", https_proxy="p1:1"),
                         "proxy http://p5:8080 (from $http_proxy)")
        self.assertEqual(r("https://vm.example", http_proxy="p5:8080"), "direct")

    def test_no_proxy_hosts_suffixes_addresses_and_star(self):
        cases = [("vm.example", "vm.example", True), ("vm.example", ".example", True), ("a.vm.example", "example", True),
                 ("VM.Example", "vm.EXAMPLE", True), ("notexample", "example", False), ("vm.example", "other, x", False),
                 ("vm.example", "x other vm.example", True), ("vm.example", "x,,vm.example", True),
                 ("10.1.2.3", "10.0.0.0/8", True), ("11.1.2.3", "10.0.0.0/8", False), ("10.1.2.3", "10.1.2.3", True),
                 ("fd00::5", "fd00::/64", True), ("fd00::5", "[fd00::5]", True), ("10.1.2.3", "example", False),
                 ("vm.example", "10.0.0.0/8", False), ("vm.example", "*", True), ("vm.example", " * ", True)]
        for host, value, want in cases:
            with self.subTest(host=host, no_proxy=value):
                self.assertEqual(httpc.no_proxy_match(host, value), want)
                url = f"https://[{host}]:443" if ":" in host else f"https://{host}"
                got = self.route(url, https_proxy="p:3128", no_proxy=value)
                self.assertEqual(got, "direct ($no_proxy)" if want else "proxy http://p:3128 (from $https_proxy)")
        self.assertEqual(self.route("https://vm.example", https_proxy="p:1", NO_PROXY="example"), "direct ($NO_PROXY)")
        # curl reads NO_PROXY only when no_proxy is unset
        self.assertEqual(self.route("https://vm.example", https_proxy="p:1", no_proxy="other", NO_PROXY="example"),
                         "proxy http://p:1 (from $https_proxy)")

    def test_the_override_beats_the_environment_and_loopback_is_always_direct(self):
        env = dict(https_proxy="p1:3128", no_proxy="vm.example")
        self.assertEqual(self.route("https://vm.example", PWW_PROXY="socks5h://s:1080", **env),
                         "proxy socks5h://s:1080 (from $PWW_PROXY)")
        self.assertEqual(self.route("https://other", PWW_PROXY="None", **env), "direct ($PWW_PROXY=none)")
        httpc.set_proxy("http://q:8080")
        self.assertEqual(self.route("https://other", PWW_PROXY="none", **env), "proxy http://q:8080 (from --proxy)")
        httpc.set_proxy("none")
        self.assertEqual(self.route("https://other", **env), "direct (--proxy none)")
        for url in ("https://127.0.0.1:29510", "http://127.9.9.9", "https://[::1]:1", "https://LOCALHOST:29512"):
            with self.subTest(url=url):
                self.assertEqual(self.route(url, PWW_PROXY="http://q:1", all_proxy="q:2"), "direct (loopback)")
        httpc.set_proxy(None)
        self.assertEqual(self.route("https://other", **env), "proxy http://p1:3128 (from $https_proxy)")

    def test_credentials_never_show_and_a_bad_proxy_url_is_one_line(self):
        r = httpc.route
        os.environ["https_proxy"] = f"http://alice:{PASSWORD_URL}@p:3128"
        way = r("https://vm.example")
        for text in (way.describe(), repr(way), str(vars(way).get("source"))):
            self.assertNotIn(PASSWORD_URL, text)
            self.assertNotIn("alice", text)
        self.assertEqual(way._password, PASSWORD)                              # percent-decoded
        for bad, says in ((f"ftp://u:{PASSWORD_URL}@p:21", "ftp:// proxy is not supported"),
                          (f"https://u:{PASSWORD_URL}@p:443", "https:// proxy is not supported"),
                          (f"http://u:{PASSWORD_URL}@p:port", "not a proxy URL")):
            with self.subTest(bad=bad.split(":")[0]):
                os.environ["https_proxy"] = bad
                with self.assertRaises(httpc.RouteError) as cm:
                    r("https://vm.example")
                self.assertIn(says, str(cm.exception))
                self.assertIn("$https_proxy", str(cm.exception))
                self.assertNotIn(PASSWORD_URL, str(cm.exception))
                self.assertFalse(httpc.repeatable(cm.exception))
        with self.assertRaises(httpc.RouteError):
            httpc.set_proxy("gopher://x:1")


class ThroughProxiesTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        fixtures.need_root_and("squid", "microsocks", "curl")
        cls.dir = tempfile.mkdtemp(prefix="proxy-test-")
        os.chmod(cls.dir, 0o755)
        cls.addClassCleanup(shutil.rmtree, cls.dir, True)
        cls.procs = fixtures.NsProcs(cls.dir, clean_env())
        cls.start = cls.procs.start
        cls.addClassCleanup(cls.procs.stop_all)        # class cleanups run even when setUpClass fails
        cls.addClassCleanup(NET.remove)
        try:
            cls.build()
        except BaseException:
            print(cls.procs.logs(), file=sys.stderr)
            raise

    @classmethod
    def build(cls):
        NET.make()
        cls.make_certs()
        squid = cls.start_squid()
        socks = cls.start(PX, "microsocks", "-i", PX_IP, "-p", "1080")
        socks_auth = cls.start(PX, "microsocks", "-i", PX_IP, "-p", "1081", "-u", "puser", "-P", PASSWORD)
        cls.token, agg_token = cls.p("token"), cls.p("aggregator-token")
        for path, tok in ((cls.token, TOKEN), (agg_token, TOKEN[::-1])):
            with open(path, "w") as f:
                f.write(tok + "\n")
        tls = ("--token-file", cls.token, "--tls-cert", cls.cert, "--tls-key", cls.key, "--host", VM_IP)
        blob = cls.start(VM, PY, "blobstore.py", "--root", cls.p("blobs"), "--port", "443", *tls)
        darl = cls.start(VM, PY, "darl_server.py", "--num-samples", "10", "--state-dir", cls.p("darl"),
                         "--port", "29510", "--aggregator-token-file", agg_token, *tls)
        for ns, host, port, proc in ((PX, PX_IP, 3128, squid), (PX, PX_IP, 3129, squid), (PX, PX_IP, 1080, socks),
                                     (PX, PX_IP, 1081, socks_auth), (VM, VM_IP, 443, blob), (VM, VM_IP, 29510, darl)):
            fixtures.wait_port(ns, host, port, proc)

    @classmethod
    def p(cls, *names):
        return os.path.join(cls.dir, *names)

    @classmethod
    def make_certs(cls):
        """tests/certs.py's CA, and a server certificate for the VM's name and address."""
        cls.ca, _, _ = certs.make_tls(cls.dir)
        cls.cert, cls.key, csr, ext = cls.p("vm.pem"), cls.p("vm.key"), cls.p("vm.csr"), cls.p("vm.ext")
        with open(ext, "w") as f:
            f.write(f"subjectAltName=DNS:{VM_NAME},IP:{VM_IP}\nextendedKeyUsage=serverAuth\n")
        sh("openssl", "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
           "-subj", f"/CN={VM_NAME}", "-keyout", cls.key, "-out", csr)
        sh("openssl", "x509", "-req", "-in", csr, "-CA", cls.ca, "-CAkey", cls.p("ca.key"), "-CAcreateserial",
           "-days", "2", "-out", cls.cert, "-extfile", ext)

    @classmethod
    def start_squid(cls):
        d = cls.p("squid")
        cls.access_log = os.path.join(d, "access.log")
        return cls.start(PX, *fixtures.squid_dir(d, NET, "alice", PASSWORD))

    # -- the node's side: the project's own commands
    def node(self, *args, **env):
        """Run the project's `args` (a script and its flags, or -c CODE) in the node netns."""
        return subprocess.run(in_ns(NODE, PY, *args), cwd=ROOT, capture_output=True, text=True, timeout=120,
                              env=clean_env(PWW_CA_FILE=self.ca, PWW_TOKEN_FILE=self.token, **env))

    def status(self, url, *flags, **env):
        script = "blobstore.py" if url.endswith(":443") else "darl_server.py"
        return self.node(script, "status", "--url", url, *flags, **env)

    def one_line_failure(self, p, *says):
        self.assertEqual(p.returncode, 1, p.stdout + p.stderr)
        self.assertNotIn("Traceback", p.stderr)
        self.assertEqual(len(p.stderr.strip().splitlines()), 1, p.stderr)
        for s in says:
            self.assertIn(s, p.stderr)
        self.assertNotIn(PASSWORD, p.stderr)
        self.assertNotIn(PASSWORD_URL, p.stderr)
        return p.stderr

    def squid_log(self):
        with open(self.access_log) as f:
            return f.read()

    def test_the_node_has_no_direct_route(self):
        self.one_line_failure(self.status(f"https://{VM_IP}:443"), f"https://{VM_IP}:443 direct:",
                              "Network is unreachable", "set https_proxy to the site's proxy")
        self.one_line_failure(self.status(f"https://{VM_NAME}:29510"), "cannot resolve vm.pxa.test")

    def test_squid_to_443_carries_status_and_a_blob_both_ways(self):
        url = f"https://{VM_IP}:443"
        p = self.status(url, https_proxy=f"http://{SQUID}")
        self.assertEqual(p.returncode, 0, p.stderr)
        code = textwrap.dedent(f"""
            import os, blob_client, httpc
            src, dst = {self.p('src')!r}, {self.p('dst')!r}
            with open(src, "wb") as f: f.write(os.urandom(3 << 20))
            tok = httpc.load_token({self.token!r})
            put = blob_client.put_file({url!r}, "via-squid", src, token=tok, ca_file={self.ca!r}, progress=False)
            got = blob_client.get_file({url!r}, "via-squid", dst, token=tok, ca_file={self.ca!r}, progress=False)
            print(put["sha256"] == got == blob_client.sha256_file(src))""")
        p = self.node("-c", code, https_proxy=f"http://{SQUID}")
        self.assertEqual((p.returncode, p.stdout.strip()), (0, "True"), p.stderr)
        self.assertIn(f"CONNECT {VM_IP}:443", self.squid_log())

    def test_squid_refuses_another_port_in_one_line_naming_443(self):
        err = self.one_line_failure(self.status(f"https://{VM_IP}:29510", https_proxy=f"http://{SQUID}"),
                                    f"via proxy http://{SQUID} (from $https_proxy)", "403",
                                    "serve the central VM on 443")
        self.assertIn("refused CONNECT to port 29510", err)
        self.assertIn("TCP_DENIED/403", self.squid_log())

    def test_socks5h_reaches_a_name_only_the_proxy_resolves(self):
        url = f"https://{VM_NAME}:29510"
        p = self.status(url, all_proxy=f"socks5h://{SOCKS}")
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertIn("blocks", p.stdout)
        p = self.status(url, https_proxy=f"socks5h://puser:{PASSWORD_URL}@{SOCKS_AUTH}")
        self.assertEqual(p.returncode, 0, p.stderr)
        self.one_line_failure(self.status(url, https_proxy=f"socks5h://puser:wrong{PASSWORD_URL}@{SOCKS_AUTH}"),
                              "refused the credentials", "$https_proxy")
        self.one_line_failure(self.status(url, https_proxy=f"socks5h://{SOCKS_AUTH}"), "wants credentials")
        self.one_line_failure(self.status(url, https_proxy=f"socks5://{SOCKS}"), "cannot resolve vm.pxa.test",
                              "use socks5h://")

    def test_the_proxy_flag_beats_the_environment(self):
        p = self.status(f"https://{VM_NAME}:29510", "--proxy", f"socks5h://{SOCKS}", https_proxy=f"http://{DEAD}")
        self.assertEqual(p.returncode, 0, p.stderr)
        self.one_line_failure(self.status(f"https://{VM_IP}:443", "--proxy", "none", https_proxy=f"http://{SQUID}"),
                              "direct (--proxy none)", "Network is unreachable", "drop it")
        p = self.status(f"https://{VM_IP}:443", "--proxy", f"ftp://u:{PASSWORD_URL}@x:1")
        self.assertEqual(p.returncode, 2)
        self.assertIn("ftp:// proxy is not supported", p.stderr)
        self.assertNotIn(PASSWORD_URL, p.stderr)

    def test_pww_proxy_none_and_no_proxy_go_direct(self):
        via = dict(https_proxy=f"http://{SQUID}")
        self.one_line_failure(self.status(f"https://{VM_IP}:443", PWW_PROXY="none", **via),
                              "direct ($PWW_PROXY=none)", "Network is unreachable")
        self.one_line_failure(self.status(f"https://{VM_IP}:443", no_proxy="10.201.2.0/24", **via),
                              "direct ($no_proxy)", "take it out")
        self.one_line_failure(self.status(f"https://{VM_NAME}:443", NO_PROXY=".pxa.test", **via),
                              "direct ($NO_PROXY)", "cannot resolve vm.pxa.test")
        p = self.status(f"https://{VM_IP}:443", PWW_PROXY=f"http://{SQUID}", no_proxy="*")
        self.assertEqual(p.returncode, 0, p.stderr)

    def test_a_proxy_that_is_down_is_named_with_its_variable(self):
        self.one_line_failure(self.status(f"https://{VM_IP}:443", HTTPS_PROXY=f"http://{DEAD}"),
                              f"via proxy http://{DEAD} (from $HTTPS_PROXY)", "Connection refused",
                              "check $HTTPS_PROXY")

    def test_407_names_the_variable_and_never_the_password(self):
        url = f"https://{VM_IP}:443"
        self.one_line_failure(self.status(url, https_proxy=f"http://{SQUID_AUTH}"), "407", "none were given",
                              "put them in $https_proxy")
        self.one_line_failure(self.status(url, https_proxy=f"http://alice:x{PASSWORD_URL}@{SQUID_AUTH}"),
                              "407", "its credentials were refused")
        p = self.status(url, https_proxy=f"http://alice:{PASSWORD_URL}@{SQUID_AUTH}")
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertRegex(self.squid_log(), rf"TCP_TUNNEL/200 \d+ CONNECT {re.escape(VM_IP)}:443 alice ")

    def test_train_py_names_its_route_and_stops_in_one_line(self):
        """A federated site (rank 0's first call, DARL status) behind a proxy that refuses the
        port: one line, exit 1, no traceback; its log names the route first."""
        tc.tokenize(tc.TokenizeConfig(inputs=[], out=self.p("tok"), seq_len=32, max_files=2, max_bytes=8000,
                                      heldout_windows=8, progress=False))
        run = ["train.py", "--device", "cpu", "--model", "qwen3-tiny", "--data", self.p("tok", "manifest.json"),
               "--federation", f"https://{VM_IP}:443", "--darl-url", f"https://{VM_IP}:29510", "--site", "lumi",
               "--eval-windows", "8", "--runs-dir", self.p("runs")]
        p = self.node(*run, https_proxy=f"http://{SQUID}")
        self.assertEqual(p.returncode, 1, p.stdout + p.stderr)
        self.assertIn(f"central VM route: proxy http://{SQUID} (from $https_proxy)", p.stdout + p.stderr)
        errors = [line for line in p.stderr.splitlines() if line.startswith("train.py: error:")]
        self.assertEqual(len(errors), 1, p.stderr)
        self.assertIn("serve the central VM on 443", errors[0])
        self.assertNotIn("Traceback", p.stderr)
        p = self.node(*run, "--proxy", f"ftp://u:{PASSWORD_URL}@x:1")
        self.assertEqual(p.returncode, 2, p.stdout + p.stderr)
        self.assertIn("--proxy: a ftp:// proxy is not supported", p.stderr)
        self.assertNotIn(PASSWORD_URL, p.stdout + p.stderr)

    def test_what_a_retry_may_fix_is_repeated_and_what_it_cannot_is_not(self):
        """Each error of connect() through the proxies, from the node: its class, whether
        httpc.repeatable() repeats it, and a GaveUp under a short Deadline names the route."""
        code = textwrap.dedent(f"""
            import json, os, httpc
            cases = {{"403": ("http://{SQUID}", "https://{VM_IP}:29510"),
                     "503": ("http://{SQUID}", "https://gone.pxa.test:443"),
                     "407": ("http://{SQUID_AUTH}", "https://{VM_IP}:443"),
                     "socks-unreachable": ("socks5h://{SOCKS}", "https://{VM_IP}:1"),
                     "down": ("http://{DEAD}", "https://{VM_IP}:443")}}
            out = {{}}
            for name, (proxy, url) in cases.items():
                os.environ["https_proxy"] = proxy
                try:
                    httpc.connect(url, 30, {self.ca!r})
                except Exception as e:
                    out[name] = [type(e).__name__, httpc.repeatable(e), str(e)]
            d = httpc.Deadline(0.5, what="GET /status", log=httpc.quiet)
            try:
                httpc.retry("GET /status", lambda: httpc.connect("https://{VM_IP}:443", d.timeout(5), {self.ca!r}), d)
            except httpc.GaveUp as e:
                out["gaveup"] = [type(e).__name__, e.attempts >= 1, str(e)]
            print(json.dumps(out))""")
        p = self.node("-c", code)
        self.assertEqual(p.returncode, 0, p.stderr)
        out = json.loads(p.stdout)
        self.assertEqual(out["403"][:2], ["RouteError", False])
        self.assertEqual(out["407"][:2], ["RouteError", False])
        self.assertEqual(out["503"][:2], ["ConnectionError", True])
        self.assertIn("the proxy could not reach gone.pxa.test:443 (503", out["503"][2])
        self.assertEqual(out["socks-unreachable"][:2], ["ConnectionError", True])
        self.assertIn("the SOCKS proxy could not reach", out["socks-unreachable"][2])
        self.assertEqual(out["down"][:2], ["ConnectionRefusedError", True])
        self.assertEqual(out["gaveup"][:2], ["GaveUp", True])
        self.assertIn(f"via proxy http://{DEAD} (from $https_proxy)", out["gaveup"][2])


CURL_CASES = [  # (environment, URL); the candidate proxies' ports: p1 .. p5
    ({"https_proxy": "p1", "HTTPS_PROXY": "p2", "all_proxy": "p3"}, "https://vm.example/"),
    ({"HTTPS_PROXY": "p2", "all_proxy": "p3", "ALL_PROXY": "p4"}, "https://vm.example/"),
    ({"ALL_PROXY": "p4"}, "https://vm.example/"),
    ({"https_proxy": "", "all_proxy": "p3"}, "https://vm.example/"),
    ({"http_proxy": "p5", "HTTP_PROXY": "p1", "https_proxy": "p2"}, "http://vm.example/"),
    ({"HTTP_PROXY": "p1", "all_proxy": "p3"}, "http://vm.example/"),
    ({"https_proxy": "p1", "no_proxy": "example"}, "https://vm.example/"),
    ({"https_proxy": "p1", "no_proxy": ".EXAMPLE"}, "https://vm.example/"),
    ({"https_proxy": "p1", "no_proxy": "xample"}, "https://vm.example/"),
    ({"https_proxy": "p1", "no_proxy": "other,vm.example"}, "https://vm.example/"),
    ({"https_proxy": "p1", "no_proxy": "*"}, "https://vm.example/"),
    ({"https_proxy": "p1", "no_proxy": "10.201.0.0/16"}, "https://10.201.9.9/"),
    ({"https_proxy": "p1", "no_proxy": "10.202.0.0/16"}, "https://10.201.9.9/"),
    ({"https_proxy": "p1", "NO_PROXY": "vm.example"}, "https://vm.example/"),
    ({"https_proxy": "p1", "no_proxy": "other", "NO_PROXY": "vm.example"}, "https://vm.example/"),
]


class CurlAgreesTest(unittest.TestCase):
    """For each CURL_CASES row, curl (in a netns with listeners for p1..p5 and no route out)
    connects to the proxy httpc.route names, or to none when httpc says direct."""

    @classmethod
    def setUpClass(cls):
        fixtures.need_root_and("squid", "microsocks", "curl")
        sh("ip", "netns", "del", "pxA-curl", check=False)
        cls.addClassCleanup(sh, "ip", "netns", "del", "pxA-curl", check=False)
        sh("ip", "netns", "add", "pxA-curl")
        sh("ip", "-n", "pxA-curl", "link", "set", "lo", "up")

    def test_curl_and_httpc_pick_the_same_proxy(self):
        code = textwrap.dedent(f"""
            import json, os, socket, subprocess, threading, httpc
            listeners, hit = {{}}, []
            def serve(name, s):
                while True:
                    c, _ = s.accept(); hit.append(name)
                    c.recv(4096); c.sendall(b"HTTP/1.1 403 Forbidden\\r\\nContent-Length: 0\\r\\n\\r\\n"); c.close()
            for i in range(1, 6):
                s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen(8)
                listeners[f"p{{i}}"] = s.getsockname()[1]
                threading.Thread(target=serve, args=(f"p{{i}}", s), daemon=True).start()
            out = []
            for env, url in {CURL_CASES!r}:
                env = {{k: (f"http://127.0.0.1:{{listeners[v]}}" if v in listeners else v) for k, v in env.items()}}
                for k in {PROXY_VARS!r}:
                    os.environ.pop(k, None)
                os.environ.update(env)
                del hit[:]
                subprocess.run(["curl", "-s", "-o", "/dev/null", "--connect-timeout", "5", url])
                route = httpc.route(url)
                ours = next((n for n, p in listeners.items() if route.port == p), None)
                out.append([url, sorted(env), hit[:1] or [None], ours])
            print(json.dumps(out))""")
        p = subprocess.run(in_ns("pxA-curl", PY, "-c", code), cwd=ROOT, capture_output=True, text=True,
                           timeout=300, env=clean_env())
        self.assertEqual(p.returncode, 0, p.stderr)
        rows = json.loads(p.stdout)
        self.assertEqual(len(rows), len(CURL_CASES))
        for url, env, (curl,), ours in rows:
            with self.subTest(url=url, env=env):
                self.assertEqual(ours, curl)


if __name__ == "__main__":
    unittest.main()
