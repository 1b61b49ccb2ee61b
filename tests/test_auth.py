"""The bearer token, swept over every route of every central server: darl_server.py,
fedmom_server.py (with and without --private-page) and blobstore.py run as real
processes with --token-file and --credentials; the routes come from each server's own route
table, so a route added later is swept too. Without the token, or with a wrong one (a site
credential's key with a wrong secret, a key no one has), every route but the public ones is a
401 that reveals nothing; the public ones answer without it."""
import http.client
import json
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

import numpy as np

import blobstore
import block_space
import darl_server
import fedmom_server
import fedmom_state
import httpc
import tensorio
from testbed.harness import listening_url

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKEN = "sweep-token-0123456789abcdef"
AGG_TOKEN = "aggregator-token-fedcba9876543210"
WRONG = (None, "wrong", TOKEN[:-1], TOKEN + "x", TOKEN.upper())


def request(url, method, path, token):
    """(status, reply bytes) of one request, with a small body on PUT/POST."""
    _, host, port, _ = httpc.split_url(url)
    conn = http.client.HTTPConnection(host, port, timeout=60)
    try:
        body = b"{}" if method in ("POST", "PUT") else None
        headers = httpc.auth_headers(token)
        if body is not None:
            headers.update({"Content-Length": str(len(body)), "Content-Type": "application/json",
                            "X-Content-Sha256": "0" * 64, "X-Delta-Meta": "{}"})
        conn.request(method, path, body=body, headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


class AuthSweepTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.mkdtemp(prefix="auth-sweep-")
        cls.addClassCleanup(shutil.rmtree, cls.dir, True)    # class cleanups run even if this fails
        cls.token_file, cls.agg_token_file = os.path.join(cls.dir, "token"), os.path.join(cls.dir, "agg-token")
        for path, tok in ((cls.token_file, TOKEN), (cls.agg_token_file, AGG_TOKEN)):
            with open(path, "w") as f:
                f.write(tok + "\n")
        cls.init = os.path.join(cls.dir, "init.safetensors")
        with tensorio.TensorWriter(cls.init, [("w", "F32", (2, 3))]) as w:
            w.write("w", np.zeros((2, 3), np.float32))
        cls.routes = cls.route_tables()
        # per-site credentials on too: a site's key with a wrong secret, or a key no one has, is a 401 as well
        creds = cls.path("credentials.json")
        subprocess.run([sys.executable, "httpd.py", "site", "--file", creds, "add", "sweep", "--out", cls.path("sites")],
                       cwd=ROOT, check=True, capture_output=True)
        with open(cls.path("sites/sweep.token")) as f:
            real = f.read().strip()
        cls.wrong = WRONG + (real[:-1] + ("0" if real[-1] != "0" else "1"), "pww1.00000000." + "0" * 64, real + "0")
        common = ["--port", "0", "--token-file", cls.token_file, "--credentials", creds]
        cls.urls = {
            "darl": cls.start("darl_server.py", "--num-samples", "10", "--state-dir", cls.path("darl"), *common),
            "fedmom": cls.start("fedmom_server.py", "--state-dir", cls.path("fedmom"), "--init", cls.init, *common),
            "fedmom-private": cls.start("fedmom_server.py", "--state-dir", cls.path("fedmom-private"),
                                        "--init", cls.init, "--private-page", *common),
            "blob": cls.start("blobstore.py", "--root", cls.path("blob"), *common),
            "darl-agg": cls.start("darl_server.py", "--num-samples", "10", "--state-dir", cls.path("darl-agg"),
                                  "--aggregator-token-file", cls.agg_token_file, *common)}

    @classmethod
    def path(cls, name):
        return os.path.join(cls.dir, name)

    @classmethod
    def start(cls, script, *args):
        env = {k: v for k, v in os.environ.items() if k not in ("PWW_TOKEN", "PWW_TOKEN_FILE")}
        proc = subprocess.Popen([sys.executable, script, *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        cls.addClassCleanup(lambda: proc.poll() is None and (proc.kill(), proc.wait(30)))
        return listening_url(proc, timeout=120)[0]

    @classmethod
    def route_tables(cls):
        """{server: [(method, path)]} from each server's make_routes on a throwaway state."""
        coord = darl_server.Coordinator(block_space.BlockSpace(10, 1, 0))
        fed = fedmom_state.FedMomState(fedmom_state.ServerConfig(cls.path("tables-fedmom"), cls.init).validate())
        store = blobstore.BlobStore(cls.path("tables-blob"), 1 << 20, 1 << 20)
        tables = {"darl": darl_server.make_routes(coord), "fedmom": fedmom_server.make_routes(fed),
                  "blob": blobstore.make_routes(store)}
        tables["fedmom-private"] = tables["fedmom"]
        tables["darl-agg"] = tables["darl"]
        return {name: sorted((m, p.replace("/*", "/some-id")) for m, p in t) for name, t in tables.items()}

    PUBLIC = {"darl": {"/health"}, "fedmom": {"/health", "/"}, "fedmom-private": {"/health"}, "blob": {"/health"},
              "darl-agg": {"/health"}}

    def test_darls_custody_routes_take_the_aggregators_credential_alone(self):
        """With --aggregator-token-file the sites' token (which every site holds) can neither
        fence the aggregator nor abort or commit its custody nor retire it; the aggregator's
        token opens those routes and no other."""
        url = self.urls["darl-agg"]
        custody = [(m, p) for m, p in self.routes["darl-agg"] if p.split("?")[0] in darl_server.CUSTODY_PATHS]
        self.assertEqual({p for _, p in custody}, set(darl_server.CUSTODY_PATHS))
        for method, path in self.routes["darl-agg"]:
            if path in self.PUBLIC["darl-agg"]:
                continue
            is_custody = (method, path) in custody
            with self.subTest(route=f"{method} {path}"):
                site, agg = request(url, method, path, TOKEN)[0], request(url, method, path, AGG_TOKEN)[0]
                self.assertEqual(site == 401, is_custody, f"sites' token: {site}")
                self.assertEqual(agg == 401, not is_custody, f"aggregator's token: {agg}")
        reply = httpc.call(url, "POST", "/fence", {"aggregator": "fedmom-x", "last_epoch": 0, "claim": "c"},
                           token=AGG_TOKEN)
        self.assertEqual(reply["epoch"], 1)
        for body, path in (({"aggregator": "fedmom-x", "last_epoch": 10**18, "claim": "d"}, "/fence"),
                           ({"aggregator": "fedmom-x", "reason": "hostile"}, "/custody/abort_orphaned"),
                           ({"aggregator": "fedmom-x", "epoch": 1, "delta": "d1"}, "/custody/abort")):
            with self.assertRaises(httpc.CallError) as cm:
                httpc.call(url, "POST", path, body, token=TOKEN)
            self.assertEqual(cm.exception.status, 401)
        self.assertEqual(httpc.call(url, "GET", "/status", token=TOKEN)["aggregators"][0]["retired"], None)

    def test_every_route_needs_the_token_but_the_public_ones(self):
        swept = 0
        for server, routes in self.routes.items():
            url = self.urls[server]
            if server == "darl-agg":
                continue                     # its custody routes take another token: the next test
            self.assertGreaterEqual(len(routes), 6, server)
            for method, path in routes + [("GET", "/no-such-route"), ("POST", "/no-such-route")]:
                public = path in self.PUBLIC[server]
                for token in self.wrong:
                    with self.subTest(server=server, route=f"{method} {path}", token=token):
                        status, body = request(url, method, path, token)
                        if public:
                            self.assertNotEqual(status, 401, body)
                            continue
                        self.assertEqual(status, 401, body)
                        if method != "HEAD":
                            self.assertEqual(set(json.loads(body)), {"error"})     # nothing else leaks
                            self.assertIn("bearer token", json.loads(body)["error"])
                        swept += 1
                with self.subTest(server=server, route=f"{method} {path}", token="right"):
                    self.assertNotEqual(request(url, method, path, TOKEN)[0], 401)
        self.assertGreater(swept, 100)

    def test_the_public_routes_are_only_what_each_server_promises(self):
        self.assertIn(b"<html", request(self.urls["fedmom"], "GET", "/", None)[1])
        self.assertEqual(request(self.urls["fedmom-private"], "GET", "/", None)[0], 401)
        for server, url in self.urls.items():
            status, body = request(url, "GET", "/health", None)
            self.assertEqual(status, 200, server)
            self.assertTrue(json.loads(body)["ok"], server)
            self.assertNotIn(TOKEN.encode(), body)


if __name__ == "__main__":
    sys.exit("run with: .venv/bin/python tests/run.py test_auth")
