"""tests/test_exposure.py - the central servers as the internet meets them: TLS, the
protocol's edges, what idle, half-open and slow connections cost, and refused binds.

Everything runs through real sockets on 127.0.0.1: an httpd server in a thread (with
a certificate tests/certs.py makes with openssl, as central.sh does) and, for the bind
policy, the three real servers as subprocesses.
Run: .venv/bin/python tests/run.py test_exposure
"""
import errno
import http.client
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import unittest

import numpy as np

import blob_client
import blobstore
import certs
import durable
import httpc
import httpd
import tensorio

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKEN = "s3cret-token"
BOUND_S = 30          # generous bound on what must happen "soon" (never a sleep that must be long enough)


def echo(req):
    return {"got": req.json()}


def number(req):
    return {"x": httpd.field(req.json(), "x", (int, float))}


def full_disk(req):
    raise OSError(errno.ENOSPC, "No space left on device")


ROUTES = {("GET", "/health"): lambda r: {"ok": True}, ("POST", "/echo"): echo, ("POST", "/number"): number,
          ("POST", "/full"): full_disk, ("GET", "/slow"): lambda r: time.sleep(0.2) or {"slow": True}}


def serve(routes=ROUTES, **kw):
    """An httpd server in a thread; returns it (stopped at cleanup by the caller)."""
    server = httpd.make_server(routes, token=TOKEN, **kw)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def until(cond, what, timeout=BOUND_S):
    deadline = time.monotonic() + timeout
    while not (got := cond()):
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s")
        time.sleep(0.02)
    return got


def raw(port, data, read=True):
    """Send raw bytes, return the server's whole answer (it closes) or the socket."""
    s = socket.create_connection(("127.0.0.1", port), timeout=BOUND_S)
    s.sendall(data)
    if not read:
        return s
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    s.close()
    return out


def status_and_json(answer):
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body), head.decode("latin-1")


class Served(unittest.TestCase):
    server_kw = {}

    def setUp(self):
        self.server = serve(**self.server_kw)
        self.addCleanup(self.server.server_close)
        self.addCleanup(self.server.shutdown)
        self.port = self.server.server_address[1]

    def call(self, method, path, body=None, token=TOKEN, **kw):
        return httpc.call(self.server.url, method, path, body, token=token, **kw)


class TLSTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        cls.ca, cls.cert, cls.key = certs.make_tls(cls.tmp.name)

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def setUp(self):
        self.root = tempfile.mkdtemp(dir=self.tmp.name)
        store = blobstore.BlobStore(self.root, 1 << 30, 1 << 30, chunk=1 << 20)
        self.server = serve({**ROUTES, **blobstore.make_routes(store)}, tls=httpd.server_tls(self.cert, self.key))
        self.addCleanup(self.server.server_close)
        self.addCleanup(self.server.shutdown)
        self.url = self.server.url

    def test_json_calls_over_https_with_the_ca(self):
        self.assertTrue(self.url.startswith("https://127.0.0.1:"))
        conn = httpc.connect(self.url, ca_file=self.ca)
        for i in range(20):                     # keep-alive across requests, through the poller
            self.assertEqual(httpc.call(self.url, "POST", "/echo", {"i": i}, token=TOKEN, conn=conn),
                             {"got": {"i": i}})
        conn.close()

    def test_blob_put_and_get_stream_over_tls(self):
        src, dst = os.path.join(self.root, "src"), os.path.join(self.root, "dst")
        with open(src, "wb") as f:
            f.write(np.random.default_rng(0).bytes(3 << 20))
        out = blob_client.put_file(self.url, "d1", src, token=TOKEN, ca_file=self.ca)
        self.assertEqual(blob_client.get_file(self.url, "d1", dst, token=TOKEN, ca_file=self.ca), out["sha256"])
        with open(src, "rb") as a, open(dst, "rb") as b:
            self.assertEqual(a.read(), b.read())

    def test_an_unknown_ca_is_a_clear_error_not_a_retry(self):
        with self.assertRaises(httpc.TLSConfigError) as cm:
            httpc.call(self.url, "GET", "/health")           # the system CAs do not know ours
        self.assertNotIsInstance(cm.exception, OSError)      # callers retry OSErrors; this would never pass
        self.assertIn("--ca-file", str(cm.exception))

    def test_plain_http_on_the_tls_port_is_told_to_use_https(self):
        with self.assertRaises(httpc.CallError) as cm:
            httpc.call(self.url.replace("https://", "http://"), "GET", "/health")
        self.assertEqual(cm.exception.status, 400)
        self.assertIn("https://", cm.exception.reply["error"])

    def test_a_tls_client_on_a_plain_port_is_hung_up_on_at_once(self):
        plain = serve()
        self.addCleanup(plain.server_close)
        self.addCleanup(plain.shutdown)
        with self.assertRaises(OSError):        # the server hangs up on the ClientHello at once
            httpc.call(plain.url.replace("http://", "https://"), "GET", "/health", ca_file=self.ca, timeout=BOUND_S)
        self.assertEqual(plain.stats()["tls_on_plain_port"], 1)


class ProtocolEdgesTest(Served):
    def test_the_bearer_scheme_is_case_insensitive(self):
        for auth in ("Bearer", "bearer", "BEARER", "  bEaReR  "):
            answer = raw(self.port, f"POST /echo HTTP/1.1\r\nAuthorization: {auth} {TOKEN}\r\n"
                                    f"Content-Length: 2\r\nConnection: close\r\n\r\n{{}}".encode())
            self.assertEqual(status_and_json(answer)[0], 200, auth)
        for auth in (f"Basic {TOKEN}", TOKEN, f"Bearer {TOKEN}x", "Bearer"):
            answer = raw(self.port, f"POST /echo HTTP/1.1\r\nAuthorization: {auth}\r\n"
                                    f"Content-Length: 2\r\nConnection: close\r\n\r\n{{}}".encode())
            self.assertEqual(status_and_json(answer)[0], 401, auth)

    def test_every_refusal_is_json_even_the_stdlibs_own(self):
        auth = b"Authorization: Bearer " + TOKEN.encode() + b"\r\nConnection: close\r\n"
        cases = {b"FOO /echo HTTP/1.1\r\n" + auth: 405, b"PATCH /nowhere HTTP/1.1\r\n" + auth: 405,
                 b"GET /echo HTTP/1.1\r\n" + auth: 405, b"garbage\r\n": 400, b"GET / HTTP/2.0\r\n": 400,
                 b"GET / HTTP/1.1\r\n" + b"X: y\r\n" * 120: 431, b"GET /nowhere HTTP/1.1\r\n" + auth: 404,
                 b"GET /nowhere HTTP/1.1\r\nConnection: close\r\n": 401}
        for request, want in cases.items():
            status, reply, head = status_and_json(raw(self.port, request + b"\r\n"))
            self.assertEqual(status, want, request[:40])
            self.assertIsInstance(reply["error"], str)
            self.assertIn("Content-Type: application/json", head)
        status, reply, head = status_and_json(raw(self.port, b"DELETE /echo HTTP/1.1\r\n" + auth + b"\r\n"))
        self.assertIn("Allow: POST", head)

    def test_bodies_whose_length_is_uncertain_end_the_connection(self):
        for framing, want in ((b"Transfer-Encoding: chunked\r\n", 411),
                              (b"Content-Length: 5\r\nContent-Length: 7\r\n", 400),
                              (b"Content-Length: -5\r\n", 400), (b"Content-Length: +5\r\n", 400),
                              (b"Content-Length: 5_0\r\n", 400)):
            # a second request follows on the same connection: it must never be read out of the body
            answer = raw(self.port, b"POST /echo HTTP/1.1\r\nAuthorization: Bearer " + TOKEN.encode() + b"\r\n"
                         + framing + b"\r\n5\r\n{}\r\n0\r\n\r\nGET /health HTTP/1.1\r\n\r\n")
            self.assertEqual(int(answer.split()[1]), want, framing)
            self.assertIn(b"Connection: close", answer)
            self.assertEqual(answer.count(b"HTTP/1.1 "), 1, "the connection was closed after the refusal")

    def test_nan_and_infinity_literals_are_refused_by_field(self):
        for body in (b'{"x": NaN}', b'{"x": Infinity}', b'{"x": -Infinity}', b'{"x": 1e999}'):
            conn = httpc.connect(self.server.url)
            conn.request("POST", "/number", body=body, headers=httpc.auth_headers(TOKEN))
            resp = conn.getresponse()
            self.assertEqual(resp.status, 400, body)
            self.assertIn("finite", json.loads(resp.read())["error"])
            conn.close()
        self.assertEqual(self.call("POST", "/number", {"x": 1.5}), {"x": 1.5})

    def test_a_full_disk_is_a_507_naming_the_disk_with_retry_after(self):
        conn = httpc.connect(self.server.url)
        conn.request("POST", "/full", body=b"{}", headers=httpc.auth_headers(TOKEN))
        resp = conn.getresponse()
        reply = json.loads(resp.read())
        self.assertEqual(resp.status, 507)
        self.assertEqual(reply["code"], "disk_full")
        self.assertIn("mount", reply["error"])
        self.assertEqual(resp.getheader("Retry-After"), str(httpd.DISK_FULL_RETRY_S))
        conn.close()
        self.assertEqual(self.call("GET", "/health"), {"ok": True})


class ConnectionCostTest(Served):
    server_kw = {"limits": httpd.Limits(workers=4, max_connections=1000, header_timeout_s=600)}

    def test_idle_and_half_open_connections_take_no_thread(self):
        until(lambda: self.call("GET", "/health"), "the server answers")
        threads = threading.active_count()
        socks = [socket.create_connection(("127.0.0.1", self.port)) for _ in range(200)]       # idle
        for _ in range(200):                                                                    # half-open
            socks.append(raw(self.port, b"POST /echo HTTP/1.1\r\nContent-Length: 10\r\n", read=False))
        self.addCleanup(lambda: [s.close() for s in socks])
        until(lambda: self.server.stats()["open"] >= 400, "400 connections held")
        self.assertEqual(threading.active_count(), threads, "an idle connection cost a thread")
        self.assertEqual(self.server.stats()["busy"], 0)
        for i in range(10):          # a legitimate client is served while they sit there
            self.assertEqual(self.call("POST", "/echo", {"i": i}), {"got": {"i": i}})


class SlowClientTest(Served):
    server_kw = {"limits": httpd.Limits(workers=2, max_connections=100, header_timeout_s=0.3,
                                        idle_timeout_s=0.3)}

    def closed_by_server(self, sock):
        sock.settimeout(BOUND_S)
        try:
            while sock.recv(65536):
                pass
        except ConnectionResetError:
            pass
        return True

    def test_a_slowloris_is_cut_off_at_the_header_timeout(self):
        s = raw(self.port, b"GET /health HTTP/1.1\r\nX-Slow: ", read=False)
        self.addCleanup(s.close)
        self.assertTrue(self.closed_by_server(s))
        self.assertGreaterEqual(self.server.stats()["timed_out_headers"], 1)

    def test_a_json_body_trickled_in_is_cut_off_and_frees_its_worker(self):
        socks = [raw(self.port, b"POST /echo HTTP/1.1\r\nAuthorization: Bearer " + TOKEN.encode()
                     + b"\r\nContent-Length: 100\r\n\r\n{", read=False) for _ in range(4)]   # 2 workers
        for s in socks:
            self.addCleanup(s.close)
            self.assertTrue(self.closed_by_server(s))
        self.assertEqual(self.call("GET", "/health"), {"ok": True})

    def test_an_idle_keep_alive_connection_is_closed(self):
        s = raw(self.port, b"GET /health HTTP/1.1\r\n\r\n", read=False)
        self.addCleanup(s.close)
        self.assertTrue(self.closed_by_server(s))
        self.assertGreaterEqual(self.server.stats()["timed_out_idle"], 1)


class ConnectionCapTest(Served):
    server_kw = {"limits": httpd.Limits(workers=2, max_connections=20, header_timeout_s=600)}

    def test_beyond_the_cap_the_longest_idle_connection_goes(self):
        socks = []
        for i in range(30):
            socks.append(socket.create_connection(("127.0.0.1", self.port)))
            until(lambda: self.server.stats()["accepted"] >= i + 1, "accepted")
        self.addCleanup(lambda: [s.close() for s in socks])
        self.assertLessEqual(self.server.stats()["open"], 20)
        self.assertGreaterEqual(self.server.stats()["evicted_at_cap"], 10)
        socks[0].settimeout(BOUND_S)
        self.assertEqual(socks[0].recv(1), b"", "the oldest idle connection was closed")
        self.assertEqual(self.call("GET", "/health"), {"ok": True})     # a newcomer is served


class RefusedBindTest(unittest.TestCase):
    """A public bind without TLS is refused before anything is written to the state dir."""

    def test_each_server_refuses_and_creates_nothing(self):
        with tempfile.TemporaryDirectory() as tmp:
            token, init = os.path.join(tmp, "token"), os.path.join(tmp, "init.safetensors")
            with open(token, "w") as f:
                f.write("t0k3n\n")
            with tensorio.TensorWriter(init, [("w", "F32", (2,))]) as w:
                w.write("w", np.zeros(2, np.float32))
            cmds = {"darl": ["darl_server.py", "--num-samples", "10", "--state-dir", os.path.join(tmp, "darl")],
                    "fedmom": ["fedmom_server.py", "--state-dir", os.path.join(tmp, "fedmom"), "--init", init],
                    "blob": ["blobstore.py", "--root", os.path.join(tmp, "blob")]}
            for name, cmd in cmds.items():
                r = subprocess.run([sys.executable, *cmd, "--host", "0.0.0.0", "--port", "0", "--token-file", token],
                                   cwd=ROOT, capture_output=True, text=True, timeout=120)
                self.assertNotEqual(r.returncode, 0, name)
                self.assertIn("--tls-cert", r.stderr, name)
                self.assertEqual(sorted(os.listdir(tmp)), ["init.safetensors", "token"], f"{name} wrote state")

    def test_darl_on_a_public_address_needs_the_aggregators_own_token(self):
        """With the sites' token alone any site could fence the aggregator: refused before any state."""
        with tempfile.TemporaryDirectory() as tmp:
            token = os.path.join(tmp, "token")
            with open(token, "w") as f:
                f.write("t0k3n\n")
            ca, cert, key = certs.make_tls(tmp)
            state = os.path.join(tmp, "darl")
            r = subprocess.run([sys.executable, "darl_server.py", "--num-samples", "10", "--state-dir", state,
                                "--host", "0.0.0.0", "--port", "0", "--token-file", token, "--tls-cert", cert,
                                "--tls-key", key], cwd=ROOT, capture_output=True, text=True, timeout=120)
            self.assertNotEqual(r.returncode, 0)
            self.assertIn("--aggregator-token-file", r.stderr)
            self.assertEqual(len(r.stderr.strip().splitlines()), 1, r.stderr)
            self.assertFalse(os.path.exists(state), "the refused start wrote state")

# ---------------------------------------------------------------- a full disk

def mount_tmpfs(path, size):
    """A real size-capped filesystem (CI runs as root); None with the reason if impossible."""
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path], capture_output=True, text=True)
    return None if r.returncode == 0 else (r.stderr.strip() or f"mount exited {r.returncode}")


def fill(directory, leave):
    """Write a filler file so that only about `leave` bytes stay free; returns its path."""
    st = os.statvfs(directory)
    path = os.path.join(directory, "filler")
    with open(path, "wb") as f:
        f.write(b"\0" * max(0, st.f_bavail * st.f_frsize - leave))
    return path


class DiskFullTest(unittest.TestCase):
    """ENOSPC on a real 16 MiB tmpfs: a clean 507 naming the disk, nothing half-applied,
    partial files reclaimed, and the service back once space returns."""
    SHAPES = {"w": (512, 256), "b": (256,)}          # 0.5 MiB of fp32: theta, momentum, deltas fit twice

    def setUp(self):
        self.tmp = tempfile.mkdtemp()
        self.addCleanup(lambda: subprocess.run(["rm", "-rf", self.tmp]))
        self.disk = os.path.join(self.tmp, "disk")
        os.makedirs(self.disk)
        why = mount_tmpfs(self.disk, "16m")
        if why:
            self.skipTest(f"cannot mount a 16 MiB tmpfs to fill ({why}); run as root")
        self.addCleanup(subprocess.run, ["umount", "-l", self.disk])
        self.rng = np.random.default_rng(3)

    def tensors(self, path, scale, dtype="F32"):
        with tensorio.TensorWriter(path, [(k, dtype, sh) for k, sh in self.SHAPES.items()], fsync=False) as w:
            for k, sh in self.SHAPES.items():
                w.write(k, (scale * self.rng.standard_normal(sh)).astype(np.float32))
        return path

    def files(self, root):
        return sorted(os.path.relpath(os.path.join(b, f), root) for b, _, fs in os.walk(root) for f in fs)

    def test_a_blob_upload_on_a_full_disk(self):
        store = blobstore.BlobStore(os.path.join(self.disk, "blobs"), 1 << 40, 1 << 40, chunk=1 << 20)
        server = serve(blobstore.make_routes(store), disk=store.root)
        self.addCleanup(server.server_close)
        self.addCleanup(server.shutdown)
        src = os.path.join(self.tmp, "src")
        with open(src, "wb") as f:
            f.write(self.rng.bytes(6 << 20))
        filler = fill(self.disk, 3 << 20)
        with self.assertRaises(httpc.CallError) as cm:
            blob_client.put_file(server.url, "delta", src, token=TOKEN)
        self.assertEqual((cm.exception.status, cm.exception.reply["code"]), (507, "disk_full"))
        self.assertIn(self.disk, cm.exception.reply["error"])
        self.assertEqual(self.files(store.root), [], "the unfinished upload gave its space back")
        os.unlink(filler)                                   # space returns: the same call succeeds
        out = blob_client.put_file(server.url, "delta", src, token=TOKEN)
        self.assertEqual(out["size"], 6 << 20)

    def fedmom(self, **kw):
        import fedmom_server
        import fedmom_state
        init = self.tensors(os.path.join(self.tmp, "init.safetensors"), 1.0)
        clock = [1000.0]
        cfg = fedmom_state.ServerConfig(os.path.join(self.disk, "fedmom"), init=init, **kw).validate()
        st = fedmom_state.FedMomState(cfg, clock=lambda: clock[0])
        server = serve(fedmom_server.make_routes(st), disk=cfg.state_dir)
        self.addCleanup(server.server_close)
        self.addCleanup(server.shutdown)
        return st, server.url, clock

    def send(self, url, cluster, path, base_round=0):
        import fedmom_client
        c = fedmom_client.FedMomClient(url, cluster, f"{cluster}-inc", token=TOKEN)
        return c.send_delta(path, base_round, 10, [], {}, transport="inline")

    def test_a_delta_spool_a_merge_and_a_join_on_a_full_disk(self):
        import fedmom_state
        st, url, clock = self.fedmom()
        for c in ("a", "b"):
            httpc.call(url, "POST", "/join", {"cluster": c, "incarnation": f"{c}-inc"}, token=TOKEN)
        da, db = (self.tensors(os.path.join(self.tmp, f"d{c}"), 0.01) for c in "ab")
        before = self.files(st.dir)
        # 1. the spool: a 507, no part file, nothing pending
        filler = fill(self.disk, 256 << 10)
        with self.assertRaises(httpc.CallError) as cm:
            self.send(url, "a", da)
        self.assertEqual((cm.exception.status, cm.exception.reply["code"]), (507, "disk_full"))
        self.assertEqual(self.files(st.dir), before)
        self.assertEqual(st.status()["pending"], [])
        # 2. a join that cannot be made durable is no join
        os.unlink(filler)
        filler = fill(self.disk, 0)
        with self.assertRaises(httpc.CallError) as cm:
            httpc.call(url, "POST", "/join", {"cluster": "c", "incarnation": "c-inc"}, token=TOKEN)
        self.assertEqual(cm.exception.status, 507)
        self.assertEqual([m["cluster"] for m in st.status()["members"]], ["a", "b"])
        os.unlink(filler)
        # 3. the merge: it fails cleanly, says why, leaves no temp file, and runs once space returns
        self.send(url, "a", da)
        self.send(url, "b", db)
        spooled = self.files(st.dir)
        filler = fill(self.disk, 0)             # a merge writes state.json only (no --down-wire): no room at all
        self.assertIsNone(st.tick())
        self.assertIn("No space left", st.status()["merge_error"])
        import fedmom_server                    # the status CLI and the page say it in red
        self.assertTrue(any(l.startswith("!!! the merge of round 0 failed") and "No space left" in l
                            for l in fedmom_server.alarm_lines(st.status())), fedmom_server.alarm_lines(st.status()))
        self.assertEqual((st.round, self.files(st.dir)), (0, spooled), "nothing half-applied, no temp files")
        os.unlink(filler)
        self.assertIsNone(st.tick(), "the retry waits 30 s")
        clock[0] += 31
        rec = st.tick()
        self.assertEqual((rec["round"], sorted(rec["clusters"])), (1, ["a", "b"]))
        self.assertIsNone(st.status()["merge_error"])
        self.assertEqual(durable.read_jsonl(st.rounds_path)[-1]["round"], 1)
        # 4. rounds.jsonl cannot be appended after the round is durable (a real OSError: a
        #    directory stands in its place): the record is owed and appended on the next tick
        self.send(url, "a", da, 1)
        self.send(url, "b", db, 1)
        os.rename(st.rounds_path, st.rounds_path + ".aside")
        os.mkdir(st.rounds_path)
        self.assertEqual(st.tick()["round"], 2)
        self.assertEqual(st.round, 2, "the round stands: state.json holds it")
        os.rmdir(st.rounds_path)
        os.rename(st.rounds_path + ".aside", st.rounds_path)
        self.assertEqual([r["round"] for r in durable.read_jsonl(st.rounds_path)], [1])
        st.tick()
        self.assertEqual([r["round"] for r in durable.read_jsonl(st.rounds_path)], [1, 2])

    # ---- DARL: the log append and the snapshot

    def darl(self, **kw):
        import block_space
        import darl_server
        import darl_table
        space = block_space.BlockSpace(100_000, 1, 0)
        state = os.path.join(self.disk, "central")
        coord = darl_server.Coordinator(space, darl_table.TableConfig(), state, **kw)
        server = serve(darl_server.make_routes(coord), disk=state)
        self.addCleanup(server.server_close)
        self.addCleanup(server.shutdown)
        httpc.call(server.url, "POST", "/register", {"cluster": "a", "incarnation": "i", "digest": space.digest()},
                   token=TOKEN)
        return coord, server.url, state

    def cycle(self, url):
        """acquire + commit of one block; -> the commit's reply."""
        lease = httpc.call(url, "POST", "/acquire", {"cluster": "a", "incarnation": "i", "blocks": 1},
                           token=TOKEN)["lease"]
        return httpc.call(url, "POST", "/commit", {"cluster": "a", "incarnation": "i", "lease": lease["id"]},
                          token=TOKEN)

    def test_darl_refuses_a_change_while_its_disk_is_full(self):
        import darl_server
        coord, url, state = self.darl()
        self.cycle(url)
        before = (coord.seq, os.path.getsize(os.path.join(state, "darl", "wal.jsonl")), coord.table.to_dict())
        filler = fill(self.disk, 16 << 10)                  # under darl_server.DISK_MARGIN
        with self.assertRaises(httpc.CallError) as cm:
            self.cycle(url)
        self.assertEqual((cm.exception.status, cm.exception.reply["code"]), (507, "disk_full"))
        self.assertIn(self.disk, cm.exception.reply["error"])
        self.assertEqual((coord.seq, os.path.getsize(os.path.join(state, "darl", "wal.jsonl")),
                          coord.table.to_dict()), before, "a refused change left a trace")
        self.assertEqual(httpc.call(url, "GET", "/status", token=TOKEN)["committed"], 1, "reads still served")
        os.unlink(filler)
        self.cycle(url)
        self.assertEqual(darl_server.load_state(state).table.to_dict(), coord.table.to_dict())

    def test_darl_log_append_and_snapshot_failing_mid_write(self):
        """No margin: the disk fills up inside the log's last page. Snapshots fail first (a new
        file): every change still answers 200. Then an append fails, maybe after part of its
        line went in: 507, the part cut away, the table rebuilt from the log."""
        import darl_server
        coord, url, state = self.darl(snapshot_every=3, disk_margin=0)
        filler, ok, snapshot_errors = fill(self.disk, 0), 0, set()
        for _ in range(2000):                               # bounds the loop: a page holds ~30 records
            try:
                self.cycle(url)
            except httpc.CallError as e:
                refused = e
                break
            ok += 1
            snapshot_errors.add(coord.status()["snapshot_error"])
        else:
            self.fail("the full disk never refused an append")
        self.assertEqual((refused.status, refused.reply["code"]), (507, "disk_full"))
        self.assertTrue(any(e and "No space left" in e for e in snapshot_errors), snapshot_errors)
        said = darl_server.format_status({**coord.status(), "snapshot_error": next(e for e in snapshot_errors if e)})
        self.assertIn("!!! SNAPSHOT FAILED: ", said)            # darl_server.py status says it
        wal = os.path.join(state, "darl", "wal.jsonl")
        self.assertEqual(darl_server.WriteAheadLog.read(wal).torn_bytes, 0, "a torn line was left in the log")
        on_disk = darl_server.load_state(state)
        self.assertEqual((on_disk.seq, on_disk.table.to_dict()), (coord.seq, coord.table.to_dict()),
                         "memory ran ahead of the log")
        self.assertGreaterEqual(on_disk.table.status(coord.clock())["committed"], ok,
                                "a change answered 200 is not in the log")
        os.unlink(filler)                                   # space returns: changes and snapshots go on
        for _ in range(4):
            self.cycle(url)
        self.assertIsNone(coord.status()["snapshot_error"])
        self.assertTrue(os.path.exists(os.path.join(state, "darl", "snapshot.json")))
        again = darl_server.load_state(state)               # what a restart rebuilds
        self.assertEqual(again.table.to_dict(), coord.table.to_dict())

# ---------------------------------------------------------------- long transfers

class StalledPeer:
    """A loopback server that answers GET with headers and a little of a large body, then
    holds the connection silent; and reads nothing of a PUT's body."""

    def __init__(self):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.release, self.socks = threading.Event(), []
        threading.Thread(target=self.run, daemon=True).start()

    def run(self):
        while True:
            try:
                s, _ = self.listener.accept()
            except OSError:
                return
            self.socks.append(s)
            head = b""
            while b"\r\n\r\n" not in head:
                head += s.recv(65536)
            if head.startswith(b"GET"):
                s.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 10000000\r\nX-Round: 3\r\n\r\n" + b"\0" * 1000)

    def close(self):
        self.listener.close()
        for s in self.socks:
            s.close()


class StallTest(unittest.TestCase):
    """A stalled aggregator costs the site a retry, not a dead job: transfers end after
    stall_s without progress, and train.py keeps the other ranks polling meanwhile."""

    def setUp(self):
        self.peer = StalledPeer()
        self.addCleanup(self.peer.close)
        self.tmp = tempfile.mkdtemp()
        self.addCleanup(lambda: subprocess.run(["rm", "-rf", self.tmp]))

    def test_a_stalled_theta_download_ends_and_leaves_no_file(self):
        import fedmom_client
        c = fedmom_client.FedMomClient(self.peer.url, "a", "a-1", stall_s=0.5)
        path = os.path.join(self.tmp, "theta.safetensors")
        with self.assertRaises(OSError):
            c.download_theta(path)
        self.assertEqual(os.listdir(self.tmp), [])

    def test_a_stalled_delta_upload_ends(self):
        import fedmom_client
        c = fedmom_client.FedMomClient(self.peer.url, "a", "a-1", stall_s=0.5)
        path = os.path.join(self.tmp, "delta")
        with open(path, "wb") as f:
            f.truncate(64 << 20)               # more than the socket buffers take without a reader
        with self.assertRaises(OSError):
            c._send_inline(path, {"cluster": "a"})

    def test_train_reads_the_token_and_ca_files_the_runbook_exports(self):
        import train
        env = {"PWW_TOKEN_FILE": "/site/central.token", "PWW_CA_FILE": "/site/central-ca.pem"}
        old = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            site = ["--model", "qwen3-tiny", "--federation", "https://c:29511", "--darl-url", "https://c:29510"]
            cfg = train.parse_config(site)
            flags = train.parse_config(site + ["--token-file", "/t", "--ca-file", "/c"])
        finally:
            for k, v in old.items():
                os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
        self.assertEqual((cfg.token_file, cfg.ca_file), ("/site/central.token", "/site/central-ca.pem"))
        self.assertEqual((flags.token_file, flags.ca_file), ("/t", "/c"))       # flags win

    def test_the_other_ranks_keep_polling_while_a_transfer_runs(self):
        import fedsite
        done = threading.Event()
        gen = fedsite._in_background(lambda: done.wait(BOUND_S) and "theta of round 3", poll_s=0.01)
        yields = 0
        while True:
            try:
                next(gen)
            except StopIteration as e:
                result = e.value
                break
            yields += 1                      # each yield is one small broadcast to the other ranks
            if yields == 5:
                done.set()
        self.assertGreaterEqual(yields, 5)      # at least until the call ended (a thread switch may add one)
        self.assertEqual(result, "theta of round 3")

        def fails():
            raise ConnectionResetError("the aggregator went away")
        with self.assertRaises(ConnectionResetError):
            list(fedsite._in_background(fails, poll_s=0.01))


if __name__ == "__main__":
    unittest.main()
