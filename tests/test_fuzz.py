"""tests/test_fuzz.py - the fast, seeded subset of bench/http_fuzz.py against the three real
servers over TLS on 127.0.0.1: 0 crashes, 0 5xx, 0 hung requests, /health afterwards,
and a legitimate epoch that keeps every invariant (bench/faults.py sends 10,000 per
server; this sends FUZZ_COUNT). Also: the fuzzer itself sees a 5xx when one is there.
Run: .venv/bin/python tests/run.py test_fuzz
"""
import os
import subprocess
import sys
import tempfile
import threading
import time
import unittest

import numpy as np

import certs
import httpd
import tensorio

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the fuzzer is a bench tool; appended, not prepended: bench/fedmom_merge.py must not
# shadow the real fedmom_merge.py
sys.path.append(os.path.join(ROOT, "bench"))
import http_fuzz  # noqa: E402

FUZZ_COUNT = 400
TOKEN = "fuzz-token-0123"


def start(tmp, name, args):
    """A server as a subprocess on a free port; -> (Popen, url, log path)."""
    log = os.path.join(tmp, f"{name}.log")
    out = open(log, "wb")
    proc = subprocess.Popen([sys.executable, *map(str, args), "--port", "0"], cwd=ROOT, stdout=out,
                            stderr=subprocess.STDOUT)
    out.close()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with open(log, errors="replace") as f:
            for line in f:
                if " listening on " in line:
                    return proc, line.split()[-1], log
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    proc.kill()
    with open(log, errors="replace") as f:
        raise AssertionError(f"{name} did not start:\n{f.read()[-2000:]}")


class FuzzTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory(prefix="fuzz-")
        t = cls.tmp.name
        cls.ca, cert, key = certs.make_tls(t)
        token = os.path.join(t, "token")
        with open(token, "w") as f:
            f.write(TOKEN + "\n")
        init = os.path.join(t, "init.safetensors")
        with tensorio.TensorWriter(init, [("w", "F32", (64, 32)), ("b", "F32", (32,))]) as w:
            w.write("w", np.ones((64, 32), np.float32))
            w.write("b", np.zeros(32, np.float32))
        # per-site credentials on too (one site made): every hostile bearer meets the keyring as well
        creds = os.path.join(t, "credentials.json")
        subprocess.run([sys.executable, "httpd.py", "site", "--file", creds, "add", "fuzzsite", "--out",
                        os.path.join(t, "sites")], cwd=ROOT, check=True, capture_output=True)
        common = ["--token-file", token, "--credentials", creds, "--tls-cert", cert, "--tls-key", key,
                  "--header-timeout-s", 1]
        cls.servers = {
            "darl": start(t, "darl", ["darl_server.py", "--num-samples", 300, "--state-dir", os.path.join(t, "c"),
                                      "--min-ttl", 1, "--max-ttl", 2, "--default-ttl", 2, *common]),
            "fedmom": start(t, "fedmom", ["fedmom_server.py", "--state-dir", os.path.join(t, "fedmom"), "--init", init,
                                          "--member-timeout-s", 3, "--round-deadline-s", 5, *common]),
            "blob": start(t, "blob", ["blobstore.py", "--root", os.path.join(t, "blobs"), *common])}

    @classmethod
    def tearDownClass(cls):
        for proc, _, _ in cls.servers.values():
            proc.kill()
            proc.wait()
        cls.tmp.cleanup()

    def fuzz(self, name):
        proc, url, log = self.servers[name]
        self.assertTrue(url.startswith("https://"))
        out = http_fuzz.run(name, url, TOKEN, self.ca, count=FUZZ_COUNT, seed=7, workers=8, timeout=20,
                            slow_wait_s=20, workdir=self.tmp.name)
        self.assertIsNone(proc.poll(), f"{name} crashed")
        with open(log, errors="replace") as f:
            self.assertNotIn("Traceback", f.read(), f"{name} logged a traceback")
        self.assertTrue(out["ok"], http_fuzz.format_report(out))
        kinds = set(out["by_kind"])
        self.assertGreaterEqual(len(kinds), 12, kinds)        # every family of hostile input was sent
        return out

    def test_darl(self):
        self.fuzz("darl")

    def test_fedmom(self):
        self.fuzz("fedmom")

    def test_blob(self):
        self.fuzz("blob")


class FuzzerSeesFailuresTest(unittest.TestCase):
    """The fuzzer's verdict can fail: a server that answers 500 and one that hangs are caught."""

    def test_a_5xx_and_a_hang_are_reported(self):
        def broken(req):
            raise RuntimeError("a deliberate bug")

        def stuck(req):
            time.sleep(3)             # longer than the fuzzer waits (2 s): a hung request
            return {}
        routes = {("GET", "/health"): lambda r: {"ok": True, "digest": "d"}, ("GET", "/status"): broken,
                  ("POST", "/register"): stuck}
        server = httpd.make_server(routes, token=TOKEN, limits=httpd.Limits(workers=32, header_timeout_s=0.5))
        threading.Thread(target=server.serve_forever, daemon=True).start()
        self.addCleanup(server.server_close)
        ctx = http_fuzz.Ctx("darl", "127.0.0.1", server.server_address[1], TOKEN, digest="d")
        out = http_fuzz.fuzz(ctx, 150, seed=3, workers=8, timeout=2, slow_wait_s=10)
        outcomes = {o for _, _, o, _ in out["bad"]}
        self.assertIn("5xx", outcomes)
        self.assertIn("timeout", outcomes)
        self.assertEqual(http_fuzz._statuses(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 3"
                                             b"\r\n\r\n{}\nHTTP/1.1 503 x\r\nContent-Length: 0\r\n\r\n"), [200, 503])


if __name__ == "__main__":
    unittest.main()
