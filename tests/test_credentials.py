"""Per-site credentials (httpd.py site; FEDERATION_GUIDE.md, "Identity") against the three
central servers run as real processes with --token-file, --credentials and DARL's own
aggregator token, on loopback. The routes come from each server's own route table, so a route
added later must be placed in one of the classes below or this test fails.

A site's credential acts only as its cluster ids on every route that names one, never on an
operator route; a revocation is refused by all three servers with no restart while the other
site goes on; a rotation keeps the old credential for its grace; a read credential reads
/status only; the shared token stops acting as a site at `shared off`; /status says which
credential acted last and counts refusals; no secret reaches a log, /status or the page."""
import http.client
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import unittest

import numpy as np

import blob_client
import blobstore
import darl_client
import block_space
import darl_server
import durable
import fedmom_client
import fedmom_server
import fedmom_state
import httpc
import httpd
import tensorio
from testbed.harness import listening_url, wait_for

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED, AGG = "shared-token-0123456789abcdef", "aggregator-token-fedcba9876543210"

# Every route of every server, by what a site credential may do there.
NAMES_CLUSTER = {"darl": {"/register", "/acquire", "/heartbeat", "/commit", "/release"},
                 "fedmom": {"/join", "/heartbeat", "/leave", "/delta_check", "/delta", "/delta_blob"},
                 "blob": {"/blobs/*"}}
OPERATOR = {"darl": set(darl_server.CUSTODY_PATHS), "fedmom": set(), "blob": {"/blobs", "/status"}}
ANY_SITE = {"darl": {"/status", "/health"},
            "fedmom": {"/status", "/health", "/", "/round", "/theta", "/theta_blob", "/theta_update",
                       "/theta_update_blob", "/theta_update_next"},
            "blob": {"/health"}}


def request(url, method, path, token, body=None, headers=None):
    """(status, decoded JSON reply or {}) of one request."""
    _, host, port, _ = httpc.split_url(url)
    conn = http.client.HTTPConnection(host, port, timeout=60)
    try:
        data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
        h = {**httpc.auth_headers(token), **(headers or {})}
        if data is not None:
            h["Content-Length"] = str(len(data))
        conn.request(method, path, body=data, headers=h)
        resp = conn.getresponse()
        raw = resp.read()
        try:
            return resp.status, json.loads(raw) if raw else {}
        except ValueError:
            return resp.status, {"raw": raw[:200].decode("utf-8", "replace")}
    finally:
        conn.close()


class CredentialsTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.mkdtemp(prefix="credentials-")
        cls.addClassCleanup(shutil.rmtree, cls.dir, True)
        cls.creds, cls.out = cls.path("credentials.json"), cls.path("sites")
        for name, tok in (("token", SHARED), ("agg-token", AGG)):
            with open(cls.path(name), "w") as f:
                f.write(tok + "\n")
        cls.site("add", "lumi", "--clusters", "lumi,lumi-b", "--out", cls.out)
        cls.site("add", "snellius", "--out", cls.out)
        cls.site("read", "alice", "--out", cls.out)
        cls.init = cls.path("init.safetensors")
        with tensorio.TensorWriter(cls.init, [("w", "F32", (2, 3))]) as w:
            w.write("w", np.zeros((2, 3), np.float32))
        common = ["--port", "0", "--token-file", cls.path("token"), "--credentials", cls.creds]
        cls.procs, cls.logs = {}, {}
        cls.urls = {"darl": cls.start("darl", "darl_server.py", "--num-samples", "10", "--state-dir", cls.path("darl"),
                                      "--aggregator-token-file", cls.path("agg-token"), *common),
                    "blob": cls.start("blob", "blobstore.py", "--root", cls.path("blob"), "--aggregator-token-file",
                                      cls.path("agg-token"), *common)}
        cls.urls["fedmom"] = cls.start("fedmom", "fedmom_server.py", "--state-dir", cls.path("fedmom"), "--init",
                                       cls.init, "--darl", cls.urls["darl"], "--darl-token-file", cls.path("agg-token"),
                                       "--blob-url", cls.urls["blob"], "--blob-token-file", cls.path("agg-token"),
                                       "--member-timeout-s", "600", *common)
        cls.routes = cls.route_tables()

    @classmethod
    def path(cls, name):
        return os.path.join(cls.dir, name)

    @classmethod
    def site(cls, *args):
        """`python httpd.py site --file CREDS ARGS` -> its output (the operator's command)."""
        out = subprocess.run([sys.executable, "httpd.py", "site", "--file", cls.creds, *args], cwd=ROOT,
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr + out.stdout
        return out.stdout

    @classmethod
    def start(cls, name, script, *args):
        env = {k: v for k, v in os.environ.items() if not k.startswith("PWW_")}
        proc = subprocess.Popen([sys.executable, script, *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        cls.addClassCleanup(lambda: proc.poll() is None and (proc.kill(), proc.wait(30)))
        url, cls.logs[name] = listening_url(proc, timeout=120)
        cls.procs[name] = proc
        return url

    @classmethod
    def route_tables(cls):
        coord = darl_server.Coordinator(block_space.BlockSpace(10, 1, 0))
        fed = fedmom_state.FedMomState(fedmom_state.ServerConfig(cls.path("tables-fedmom"), cls.init).validate())
        store = blobstore.BlobStore(cls.path("tables-blob"), 1 << 20, 1 << 20)
        blob = blobstore.make_routes(store)
        blob[("GET", "/status")] = blob[("GET", "/blobs")]        # as blobstore.serve adds it
        return {"darl": darl_server.make_routes(coord), "fedmom": fedmom_server.make_routes(fed), "blob": blob}

    def token(self, name):
        with open(os.path.join(self.out, f"{name}.token")) as f:
            return f.read().strip()

    def tokens(self):
        return [self.token(n) for n in ("lumi", "snellius", "alice")]

    # -- the probe: a site credential on every route that names a cluster
    def test_every_route_is_placed_in_one_class(self):
        for server, table in self.routes.items():
            paths = {p for _, p in table}
            with self.subTest(server):
                self.assertEqual(paths, NAMES_CLUSTER[server] | OPERATOR[server] | ANY_SITE[server])

    def cross_site_requests(self, other):
        """(server, method, path, body, headers) acting as cluster `other` on every route that names one."""
        ident = {"cluster": other, "incarnation": "probe"}
        meta = {**ident, "base_round": 0, "tokens": 1, "leases": []}
        out = [("darl", "POST", p, {**ident, "digest": "d", "lease": 1, "leases": []}, None)
               for p in sorted(NAMES_CLUSTER["darl"])]
        out += [("fedmom", "POST", p, {**meta, "blob": f"delta.{other}.x", "sha256": "0" * 64}, None)
                for p in ("/join", "/heartbeat", "/leave", "/delta_check", "/delta_blob")]
        out.append(("fedmom", "PUT", "/delta", b"x", {"X-Delta-Meta": json.dumps(meta), "X-Content-Sha256": "0" * 64}))
        for method in ("PUT", "GET", "HEAD", "DELETE"):
            for blob in (f"delta.{other}.r0", f"check.{other}.x", f"delta-{other}-r0"):
                body = b"abc" if method == "PUT" else None
                out.append(("blob", method, f"/blobs/{blob}", body, {"X-Content-Sha256": "0" * 64}))
        return out

    def test_a_site_credential_never_acts_as_another_site(self):
        lumi = self.token("lumi")
        tried, accepted = 0, []
        for server, method, path, body, headers in self.cross_site_requests("snellius"):
            status, reply = request(self.urls[server], method, path, lumi, body, headers)
            tried += 1
            with self.subTest(route=f"{server} {method} {path}"):
                self.assertEqual(status, 403, reply)
                if method != "HEAD":
                    self.assertIn("'lumi'", reply["error"])
                    self.assertNotIn(lumi.split(".")[-1], json.dumps(reply))
            if status < 300:
                accepted.append(f"{server} {method} {path}")
        # its own blob id names its cluster; a delta it sends must name its own blob
        status, reply = request(self.urls["fedmom"], "POST", "/delta_blob", lumi,
                                {"cluster": "lumi", "incarnation": "p", "blob": "delta.snellius.x", "sha256": "0" * 64,
                                 "base_round": 0, "tokens": 1, "leases": []})
        self.assertEqual(status, 403, reply)
        for server in ("darl", "blob"):
            for p in OPERATOR[server]:
                method = "GET" if p in ("/blobs", "/status", "/custody") else "POST"
                with self.subTest(route=f"{server} {method} {p}"):
                    self.assertEqual(request(self.urls[server], method, p, lumi, {} if method == "POST" else None)[0],
                                     403)
        self.assertEqual(accepted, [])
        self.assertGreaterEqual(tried, 23)

    def test_a_site_credential_acts_as_its_own_clusters(self):
        lumi = self.token("lumi")
        for cluster in ("lumi", "lumi-b"):
            with self.subTest(cluster):
                status, reply = request(self.urls["fedmom"], "POST", "/join", lumi,
                                        {"cluster": cluster, "incarnation": f"{cluster}-own"})
                self.assertEqual(status, 200, reply)
                request(self.urls["fedmom"], "POST", "/leave", lumi, {"cluster": cluster, "incarnation": f"{cluster}-own"})
        path = self.path("up.bin")
        with open(path, "wb") as f:
            f.write(b"lumi's bytes")
        blob_client.put_file(self.urls["blob"], "delta.lumi-b.r0", path, token=lumi, progress=False)
        self.assertEqual(blob_client.head(self.urls["blob"], "delta.lumi-b.r0", lumi)["size"], 12)
        status, _ = request(self.urls["blob"], "GET", "/blobs/delta.lumi-b.r0", self.token("snellius"))
        self.assertEqual(status, 403)                      # another site's delta is not snellius's to read
        self.assertEqual(request(self.urls["blob"], "DELETE", "/blobs/delta.lumi-b.r0", lumi)[0], 200)
        status, reply = request(self.urls["fedmom"], "GET", "/theta", lumi)
        self.assertEqual(status, 200)

    # -- revocation, rotation, read-only, the shared token
    def test_a_revoked_credential_is_refused_by_every_server_without_a_restart(self):
        self.site("add", "cscs", "--out", self.out)
        cscs, snellius = self.token("cscs"), self.token("snellius")
        pids = {n: p.pid for n, p in self.procs.items()}
        probes = {"darl": ("POST", "/heartbeat", {"cluster": "cscs", "incarnation": "c1"}),
                  "fedmom": ("POST", "/join", {"cluster": "cscs", "incarnation": "c1"}),
                  "blob": ("HEAD", "/blobs/delta.cscs.x", None)}
        wait_for(lambda: all(request(self.urls[s], *probes[s][:2], cscs, probes[s][2])[0] != 403 for s in probes), 30)
        self.site("revoke", "cscs")
        for server, (method, path, body) in probes.items():
            with self.subTest(server):
                self.assertTrue(wait_for(lambda: request(self.urls[server], method, path, cscs, body)[0] == 403, 60))
                status, reply = request(self.urls[server], "GET", "/status", cscs)
                self.assertEqual(status, 403)
                self.assertIn("'cscs'", reply["error"])
                self.assertIn("revoked", reply["error"])
        # the other site goes on, and no server was restarted
        status, reply = request(self.urls["fedmom"], "POST", "/join", snellius,
                                {"cluster": "snellius", "incarnation": "s-after"})
        self.assertEqual(status, 200, reply)
        request(self.urls["fedmom"], "POST", "/leave", snellius, {"cluster": "snellius", "incarnation": "s-after"})
        self.assertEqual({n: p.pid for n, p in self.procs.items()}, pids)
        self.assertTrue(all(p.poll() is None for p in self.procs.values()))

    def test_a_rotated_credential_keeps_working_for_its_grace_only(self):
        self.site("add", "jsc", "--out", self.out)
        first = self.token("jsc")
        self.site("rotate", "jsc", "--grace-s", "3600", "--out", self.out)
        second = self.token("jsc")
        self.assertNotEqual(first, second)
        body = {"cluster": "jsc", "incarnation": "j1"}
        for tok in (first, second):
            self.assertTrue(wait_for(lambda: request(self.urls["fedmom"], "POST", "/join", tok, body)[0] == 200, 30))
        self.site("rotate", "jsc", "--grace-s", "0", "--out", self.out)     # both earlier ones end now
        third = self.token("jsc")
        for tok in (first, second):
            self.assertTrue(wait_for(lambda: request(self.urls["fedmom"], "POST", "/join", tok, body)[0] == 403, 60))
            self.assertIn("replaced", request(self.urls["darl"], "POST", "/heartbeat", tok, body)[1]["error"])
        self.assertEqual(request(self.urls["fedmom"], "POST", "/join", third, body)[0], 200)

    def test_a_read_credential_reads_status_and_nothing_else(self):
        alice = self.token("alice")
        for server in ("darl", "fedmom", "blob"):
            with self.subTest(server):
                self.assertEqual(request(self.urls[server], "GET", "/status", alice)[0], 200)
        self.assertEqual(request(self.urls["blob"], "GET", "/blobs", alice)[0], 200)
        for server, method, path in (("fedmom", "GET", "/theta"), ("fedmom", "POST", "/join"),
                                     ("darl", "POST", "/register"), ("blob", "GET", "/blobs/x.theta-0"),
                                     ("darl", "GET", "/custody")):
            with self.subTest(f"{server} {method} {path}"):
                status, reply = request(self.urls[server], method, path, alice, {} if method == "POST" else None)
                self.assertEqual(status, 403, reply)
        st = fedmom_server.print_status(self.urls["fedmom"], alice)          # the status command, read-only
        self.assertIn(st, (0, 1, None))

    def test_the_shared_token_stops_acting_as_a_site_at_shared_off(self):
        # an aggregator of its own: the members the other tests joined would hold its rounds open
        fed = self.start("fedmom-own", "fedmom_server.py", "--state-dir", self.path("fedmom-own"), "--init", self.init,
                         "--darl", self.urls["darl"], "--darl-token-file", self.path("agg-token"), "--blob-url",
                         self.urls["blob"], "--blob-token-file", self.path("agg-token"), "--port", "0", "--token-file", self.path("token"), "--credentials", self.creds)
        body = {"cluster": "shared-site", "incarnation": "x"}
        self.assertEqual(request(fed, "POST", "/join", SHARED, body)[0], 200)
        self.assertEqual(request(fed, "POST", "/leave", SHARED, body)[0], 200)
        self.site("shared", "off")
        try:
            for url, path in ((fed, "/heartbeat"), (self.urls["darl"], "/heartbeat")):     # no member made meanwhile
                with self.subTest(path):
                    self.assertTrue(wait_for(lambda: request(url, "POST", path, SHARED, body)[0] == 403, 60))
                    self.assertIn("shared token", request(url, "POST", path, SHARED, body)[1]["error"])
            self.assertEqual(request(fed, "GET", "/status", SHARED)[0], 200)
            # nor does it reach a site's blob any more (the aggregator has its own token there)
            lumi = self.token("lumi")
            self.assertEqual(request(self.urls["blob"], "PUT", "/blobs/delta.lumi.kept", lumi, b"abc",
                                     {"X-Content-Sha256": "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"})[0],
                             201)
            self.assertTrue(wait_for(lambda: request(self.urls["blob"], "GET", "/blobs/delta.lumi.kept", SHARED)[0] == 403,
                                     60))
            for method, body in (("PUT", b"xyz"), ("DELETE", None), ("HEAD", None)):
                with self.subTest(f"shared {method} a site's blob"):
                    self.assertEqual(request(self.urls["blob"], method, "/blobs/delta.lumi.kept", SHARED, body,
                                             {"X-Content-Sha256": "0" * 64})[0], 403)
            self.assertEqual(request(self.urls["blob"], "GET", "/blobs/delta.lumi.kept", lumi)[0], 200)
            # a site with its own credential sends a delta, merged by the aggregator (which still
            # reaches the blob store and DARL with its own tokens)
            snellius = self.token("snellius")
            darl = darl_client.LeaseClient(self.urls["darl"], token=snellius)
            darl.register("snellius", "s-delta", httpc.call(self.urls["darl"], "GET", "/status", token=snellius)["digest"])
            lease = darl.acquire("snellius", "s-delta", blocks=2)["lease"]
            c = fedmom_client.FedMomClient(fed, "snellius", "s-delta", token=snellius,
                                           blob_url=self.urls["blob"])
            c.join()
            rnd = c.current_round()
            d = self.path("delta.safetensors")
            with tensorio.TensorWriter(d, [("w", "F32", (2, 3))]) as w:
                w.write("w", np.full((2, 3), 0.5, np.float32))
            c.send_delta(d, rnd, 7, [{"id": lease["id"], "start": lease["start"], "end": lease["end"]}], {},
                         transport="blob")
            self.assertTrue(wait_for(lambda: c.current_round() > rnd, 60), self.logs["fedmom-own"].text()[-3000:])
            st = httpc.call(self.urls["darl"], "GET", "/status", token=snellius)       # committed by the aggregator
            self.assertTrue(wait_for(lambda: httpc.call(self.urls["darl"], "GET", "/status",
                                                        token=snellius)["committed"] >= 2, 60), st)
            c.leave()
            darl.close()
        finally:
            self.site("shared", "on")

    def page(self, token):
        _, host, port, _ = httpc.split_url(self.urls["fedmom"])
        conn = http.client.HTTPConnection(host, port, timeout=60)
        conn.request("GET", "/", headers=httpc.auth_headers(token))
        page = conn.getresponse().read().decode()
        conn.close()
        return page

    def test_a_site_credential_on_a_custody_route_is_refused_under_its_own_key(self):
        self.site("add", "ichec", "--out", self.out)
        ichec = self.token("ichec")
        self.assertTrue(wait_for(lambda: request(self.urls["darl"], "POST", "/fence", ichec, {})[0] == 403, 30))
        st = httpc.call(self.urls["darl"], "GET", "/status", token=SHARED)
        self.assertEqual(next(r for r in st["auth"]["refused"] if r["name"] == "ichec")["route"], "POST /fence")

    def test_cluster_ids_with_a_dot_are_refused_where_credentials_are_on(self):
        status, reply = request(self.urls["fedmom"], "POST", "/join", SHARED, {"cluster": "lumi.b", "incarnation": "x"})
        self.assertEqual(status, 400, reply)
        self.assertIn("no '.'", reply["error"])

    def test_a_name_is_one_holders(self):
        out = subprocess.run([sys.executable, "httpd.py", "site", "--file", self.creds, "read", "lumi", "--out",
                              self.out], cwd=ROOT, capture_output=True, text=True, timeout=60)
        self.assertNotEqual(out.returncode, 0)
        self.assertIn("already has a live credential", out.stderr)

    def test_a_bad_edit_of_the_credentials_file_keeps_the_last_good_one(self):
        """Missing, not JSON, or an entry of a role no server knows: every server keeps what
        the file said last (a site still works, no door opens) and says why on /status."""
        with open(self.creds) as f:
            good = f.read()
        lumi, body = self.token("lumi"), {"cluster": "lumi", "incarnation": "l-edit"}
        doc = json.loads(good)
        forged = dict(doc, credentials=doc["credentials"] + [dict(doc["credentials"][0], key="0badc0de",
                                                                     role="operator")])
        try:
            for what, text in (("missing", None), ("not JSON", "{"), ("an unknown role", json.dumps(forged))):
                with self.subTest(what):
                    durable.unlink(self.creds)
                    if text is not None:
                        with open(self.creds, "w") as f:
                            f.write(text)
                    for server in ("darl", "fedmom", "blob"):
                        self.assertTrue(wait_for(lambda: httpc.call(self.urls[server], "GET", "/status",
                                                                    token=SHARED)["auth"]["file_error"], 60))
                    self.assertEqual(request(self.urls["fedmom"], "POST", "/join", lumi, body)[0], 200)
                    request(self.urls["fedmom"], "POST", "/leave", lumi, body)
                    if text is not None:       # the operator's command says so in one line, changes nothing
                        out = subprocess.run([sys.executable, "httpd.py", "site", "--file", self.creds, "revoke",
                                              "lumi"], cwd=ROOT, capture_output=True, text=True, timeout=60)
                        self.assertNotEqual(out.returncode, 0)
                        self.assertIn("not a credentials file", out.stderr)
                        self.assertNotIn("Traceback", out.stderr)
                    self.assertEqual(request(self.urls["darl"], "POST", "/heartbeat", self.token("snellius"),
                                             {"cluster": "lumi", "incarnation": "x"})[0], 403)
        finally:
            with open(self.creds + ".new", "w") as f:
                f.write(good)
            os.replace(self.creds + ".new", self.creds)
        for server in ("darl", "fedmom", "blob"):
            self.assertTrue(wait_for(lambda: httpc.call(self.urls[server], "GET", "/status",
                                                        token=SHARED)["auth"]["file_error"] is None, 60))

    # -- visible, and no secret anywhere
    def test_status_names_who_acted_and_counts_refusals_and_never_shows_a_secret(self):
        self.site("add", "cineca", "--out", self.out)
        cineca = self.token("cineca")
        body = {"cluster": "cineca", "incarnation": "ci"}
        self.assertTrue(wait_for(lambda: request(self.urls["fedmom"], "POST", "/join", cineca, body)[0] == 200, 30))
        for _ in range(httpd.ALARM_REFUSALS):
            request(self.urls["fedmom"], "POST", "/join", cineca, {"cluster": "lumi", "incarnation": "x"})
        st = httpc.call(self.urls["fedmom"], "GET", "/status", token=SHARED)
        row = next(c for c in st["auth"]["credentials"] if c["name"] == "cineca")
        # its last act is the join it did, not the refused ones after it
        self.assertEqual((row["last_act"]["route"], row["last_act"]["as"], row["state"]), ("POST /join", "cineca", "live"))
        refused = next(r for r in st["auth"]["refused"] if r["name"] == "cineca")
        self.assertEqual(refused["count"], httpd.ALARM_REFUSALS)
        alarms = fedmom_server.alarm_lines(st)
        self.assertTrue(any("'cineca'" in a and "refused" in a for a in alarms), alarms)
        page, anonymous = self.page(SHARED), self.page(None)
        self.assertIn("Credentials", page)
        self.assertIn("cineca", page)
        self.assertNotIn("DARL status unavailable", page)     # the page reaches DARL with the shared token
        # the list of credentials is not for an anonymous reader of the page, nor for a site
        key = next(c["key"] for c in st["auth"]["credentials"] if c["name"] == "cineca")
        self.assertIn(key, page)
        self.assertTrue("<html" in anonymous and "Credentials" not in anonymous and key not in anonymous)
        self.assertNotIn("auth", httpc.call(self.urls["fedmom"], "GET", "/status", token=cineca))
        self.assertIn("auth", httpc.call(self.urls["darl"], "GET", "/status", token=self.token("alice")))
        secrets_ = [t.split(".")[-1] for t in self.tokens() + [cineca]] + [SHARED, AGG]
        texts = {"page": page, **{f"{s} status": json.dumps(httpc.call(self.urls[s], "GET", "/status", token=SHARED))
                                  for s in self.urls}}
        with open(self.creds) as f:
            texts["credentials file"] = f.read()
        for name, out in self.logs.items():
            texts[f"{name} log"] = out.text()
        for what, text in texts.items():
            for s in secrets_:
                with self.subTest(what):
                    self.assertNotIn(s, text)


if __name__ == "__main__":
    unittest.main()
