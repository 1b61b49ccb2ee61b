"""blobstore: a real server on 127.0.0.1, real files, a proxy that cuts connections,
and a 1 GiB upload whose server is SIGKILLed half-way and restarted. Then blobs in
parallel streams: get_file/put_file with N connections over TLS, the store's upload in
pieces (PUT ?ranged=1) out of order, a cut stream resuming its own range, a wrong byte,
two uploaders of one id, and a store SIGKILLed mid-upload that keeps every acknowledged
piece. No timing."""
import hashlib
import http.client
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import unittest

import blob_client
import blobstore
import certs
import httpc
import httpd
from testbed.harness import child_env, expect, listening_url

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKEN = "blob-token"
MB = 10 ** 6


def make_file(path, size, seed=0):
    """`size` pseudo-random bytes written in 1 MiB pieces (never held whole); returns the sha256."""
    base = hashlib.sha256(str(seed).encode()).digest() * (2**20 // 32)
    h = hashlib.sha256()
    with open(path, "wb") as f:
        for i in range(0, size, 2**20):
            piece = (i.to_bytes(8, "little") + base[8:])[:size - i]
            f.write(piece)
            h.update(piece)
    return h.hexdigest()


class CuttingProxy:
    """TCP proxy to `upstream` that drops the first connection to carry more than
    `cut_after` bytes in direction `direction` ("up": client->server, "down")."""

    def __init__(self, upstream_url, cut_after, direction):
        _, self.host, self.port_up, _ = httpc.split_url(upstream_url)
        self.cut_after, self.direction, self.cuts = cut_after, direction, 0
        self.total = {"up": 0, "down": 0}          # bytes forwarded, all connections
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while not self.closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection((self.host, self.port_up))
            state = {"sent": 0}
            for src, dst, d in ((client, server, "up"), (server, client, "down")):
                threading.Thread(target=self._pump, args=(src, dst, d, state, (client, server)),
                                 daemon=True).start()

    def _pump(self, src, dst, direction, state, pair):
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                dst.sendall(data)
                self.total[direction] += len(data)
                if direction == self.direction:
                    state["sent"] += len(data)
                    if self.cuts == 0 and state["sent"] > self.cut_after:
                        self.cuts += 1
                        break
        except OSError:
            pass
        for s in pair:                  # hang up both sides: the peer sees a dropped connection
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def close(self):
        self.closed = True
        self.listener.close()


class LiveStoreTest(unittest.TestCase):
    QUOTA, MAX_BLOB = 60 * MB, 30 * MB

    def setUp(self):
        self._tmp = tempfile.TemporaryDirectory()
        self.addCleanup(self._tmp.cleanup)
        self.dir = self._tmp.name
        self.root = os.path.join(self.dir, "root")
        self.store = blobstore.BlobStore(self.root, self.QUOTA, self.MAX_BLOB, chunk=1 << 20)
        self.server = httpd.make_server(blobstore.make_routes(self.store), token=TOKEN)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.addCleanup(self.server.server_close)
        self.addCleanup(self.server.shutdown)
        self.url = self.server.url

    def p(self, name):
        return os.path.join(self.dir, name)

    def raw(self, method, path, headers=None, body=b"", auth=True):
        """One request with exactly these headers; returns (status, headers, body bytes)."""
        conn = httpc.connect(self.url)
        try:
            conn.putrequest(method, path, skip_accept_encoding=True)
            for k, v in {**(httpc.auth_headers(TOKEN) if auth else {}), **(headers or {})}.items():
                conn.putheader(k, v)
            conn.endheaders()
            if body:
                conn.send(body)
            resp = conn.getresponse()
            return resp.status, resp, resp.read()
        finally:
            conn.close()

    def assert_refused(self, status, reply, want, reason):
        self.assertEqual(status, want, reply)
        self.assertEqual(reply.count(b"\n"), 1)
        self.assertRegex(json.loads(reply)["error"], reason)

    def put_raw(self, blob_id, body, sha=None, extra=None):
        """A PUT as a careful client sends it: headers with `Expect: 100-continue`, the body
        only after the server's 100. Returns (status, headers, reply bytes)."""
        sock, first = self.expect_put(blob_id, len(body), sha or hashlib.sha256(body).hexdigest(), extra)
        head, _, reply = first.partition(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 100 "):
            return int(head.split()[1]), head, reply
        sock.sendall(body)
        resp = http.client.HTTPResponse(sock, method="PUT")
        resp.begin()
        return resp.status, resp, resp.read()

    def expect_put(self, blob_id, length, sha, extra=None):
        """PUT headers with `Expect: 100-continue` and no body: (socket, the server's first answer)."""
        sock = socket.create_connection(("127.0.0.1", self.server.server_address[1]))
        self.addCleanup(sock.close)
        headers = {"Host": "x", "Authorization": f"Bearer {TOKEN}", "Content-Length": str(length),
                   "X-Content-Sha256": sha, "Expect": "100-continue", **(extra or {})}
        sock.sendall(f"PUT /blobs/{blob_id} HTTP/1.1\r\n".encode()
                     + "".join(f"{k}: {v}\r\n" for k, v in headers.items()).encode() + b"\r\n")
        sock.settimeout(60)
        got = b""
        while b"\r\n\r\n" not in got:
            more = sock.recv(65536)
            self.assertTrue(more, f"connection closed after {got!r}")
            got += more
        head, _, body = got.partition(b"\r\n\r\n")
        m = re.search(rb"Content-Length: (\d+)", head)
        while m and len(body) < int(m.group(1)):
            more = sock.recv(65536)
            self.assertTrue(more, f"connection closed after {got!r}")
            body += more
        return sock, head + b"\r\n\r\n" + body

    def visible_files(self):
        out = []
        for d in ("blobs", "partial"):
            out += [f"{d}/{n}" for n in sorted(os.listdir(os.path.join(self.root, d)))]
        return out

    # ---------------------------------------------------------------- happy paths
    def test_put_head_get_list_delete(self):
        sha = make_file(self.p("src"), 5 * MB + 123)
        out = blob_client.put_file(self.url, "delta-lumi.r7", self.p("src"), token=TOKEN)
        self.assertEqual((out["id"], out["size"], out["sha256"]), ("delta-lumi.r7", 5 * MB + 123, sha))
        self.assertEqual(blob_client.head(self.url, "delta-lumi.r7", TOKEN),
                         {"complete": True, "size": 5 * MB + 123, "total": 5 * MB + 123, "sha256": sha})
        self.assertEqual(blob_client.get_file(self.url, "delta-lumi.r7", self.p("dst"), token=TOKEN), sha)
        self.assertEqual(blob_client.sha256_file(self.p("dst")), sha)
        listing = httpc.call(self.url, "GET", "/blobs", token=TOKEN)
        self.assertEqual(listing["blobs"], [{"id": "delta-lumi.r7", "size": 5 * MB + 123, "sha256": sha}])
        self.assertEqual(listing["used_bytes"], 5 * MB + 123)
        again = blob_client.put_file(self.url, "delta-lumi.r7", self.p("src"), token=TOKEN, sha256=sha)
        self.assertEqual(again["sent"], 0)                          # already there: nothing resent
        self.assertEqual(httpc.call(self.url, "DELETE", "/blobs/delta-lumi.r7", token=TOKEN)["deleted"], True)
        self.assertIsNone(blob_client.head(self.url, "delta-lumi.r7", TOKEN))
        self.assertEqual(self.visible_files(), [])
        self.assertEqual(sorted(os.listdir(self.dir)), ["dst", "root", "src"])

    def test_range_requests(self):
        body = bytes(range(256)) * 40
        self.assertEqual(self.put_raw("r", body)[0], 201)
        for rng, want in (("bytes=10-19", body[10:20]), ("bytes=10000-", body[10000:]),
                          ("bytes=-5", body[-5:]), ("bytes=10235-99999", body[10235:])):
            status, resp, got = self.raw("GET", "/blobs/r", {"Range": rng})
            self.assertEqual((status, got), (206, want), rng)
            self.assertTrue(resp.getheader("Content-Range").endswith(f"/{len(body)}"))
        for rng in ("bytes=10240-", "bytes=5-2", "bytes=0-1,4-5", "lines=1-2", "bytes=-0"):
            status, _, reply = self.raw("GET", "/blobs/r", {"Range": rng})
            self.assert_refused(status, reply, 416, "Range")
        status, resp, got = self.raw("GET", "/blobs/r")
        self.assertEqual((status, got, resp.getheader("X-Content-Sha256")),
                         (200, body, hashlib.sha256(body).hexdigest()))

    def test_a_cut_upload_resumes_from_the_offset_head_reports(self):
        body = os.urandom(3 * MB)
        sha = hashlib.sha256(body).hexdigest()
        sock = socket.create_connection(("127.0.0.1", self.server.server_address[1]))
        sock.sendall(f"PUT /blobs/cut HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
                     f"Content-Length: {len(body)}\r\nX-Content-Sha256: {sha}\r\n\r\n".encode() + body[:MB + 17])
        expect(lambda: "cut" in self.store.uploading, "the upload to start", timeout_s=60, interval_s=0.02)
        sock.close()
        expect(lambda: "cut" not in self.store.uploading, "the server to notice the dropped connection",
               timeout_s=60, interval_s=0.02)
        info = blob_client.head(self.url, "cut", TOKEN)
        self.assertEqual(info, {"complete": False, "offset": MB + 17, "total": 3 * MB, "sha256": sha})
        status, _, reply = self.raw("GET", "/blobs/cut")
        self.assert_refused(status, reply, 404, "still uploading")
        self.assertEqual(httpc.call(self.url, "GET", "/blobs", token=TOKEN)["uploads"],
                         [{"id": "cut", "offset": MB + 17, "total": 3 * MB, "uploading": False}])
        wrong = self.put_raw("cut", body[MB:], sha, {"Content-Range": f"bytes {MB}-{3 * MB - 1}/{3 * MB}"})
        self.assert_refused(wrong[0], wrong[2], 416, f"continues at byte {MB + 17}")
        self.assertEqual(json.loads(wrong[2])["offset"], MB + 17)
        self.store.hash_cache.clear()          # as after a restart: the prefix is hashed from disk
        status, _, reply = self.put_raw("cut", body[MB + 17:2 * MB], sha,
                                        {"Content-Range": f"bytes {MB + 17}-{2 * MB - 1}/{3 * MB}"})
        self.assertEqual((status, json.loads(reply)["offset"]), (202, 2 * MB))
        status, _, reply = self.put_raw("cut", body[2 * MB:], sha,
                                        {"Content-Range": f"bytes {2 * MB}-{3 * MB - 1}/{3 * MB}"})
        self.assertEqual((status, json.loads(reply)["sha256"]), (201, sha))
        self.assertEqual(self.raw("GET", "/blobs/cut")[2], body)
        self.assertEqual(self.visible_files(), ["blobs/.cut.json", "blobs/cut"])

    def test_a_reopened_store_sweeps_torn_sidecars_and_keeps_every_blob(self):
        body = b"kept across a restart"
        for blob_id in ("tmp-7", "a.tmp-1"):            # ids that look like temporary names
            self.assertEqual(self.put_raw(blob_id, body)[0], 201)
        torn = os.path.join(self.root, "blobs", ".x.json.tmp-4242")      # a sidecar writer killed
        with open(torn, "w") as f:                                      # before its rename
            f.write('{"size": 9')
        reopened = blobstore.BlobStore(self.root, self.QUOTA, self.MAX_BLOB)
        self.assertFalse(os.path.exists(torn))
        for blob_id in ("tmp-7", "a.tmp-1"):
            self.assertEqual(reopened.complete(blob_id)["sha256"], hashlib.sha256(body).hexdigest(), blob_id)
        self.assertEqual(reopened.used_bytes(), 2 * len(body))

    def test_put_file_and_get_file_survive_a_dropped_connection(self):
        sha = make_file(self.p("src"), 8 * MB, seed=1)
        up = CuttingProxy(self.url, 3 * MB, "up")
        self.addCleanup(up.close)
        out = blob_client.put_file(up.url, "via-proxy", self.p("src"), token=TOKEN, progress=False,
                                   deadline=httpc.Deadline(60, log=httpc.quiet))
        self.assertEqual((out["sha256"], up.cuts), (sha, 1))
        self.assertLess(up.total["up"], 8 * MB + MB)                # resumed, not restarted (>= 11 MB)
        down = CuttingProxy(self.url, 5 * MB, "down")
        self.addCleanup(down.close)
        self.assertEqual(blob_client.get_file(down.url, "via-proxy", self.p("dst"), token=TOKEN,
                                              deadline=httpc.Deadline(60, log=httpc.quiet)), sha)
        self.assertEqual((down.cuts, blob_client.sha256_file(self.p("dst"))), (1, sha))
        self.assertLess(down.total["down"], 8 * MB + MB)
        self.assertEqual(sorted(os.listdir(self.dir)), ["dst", "root", "src"])

    def test_concurrent_uploads_of_different_blobs(self):
        shas = {f"c{i}": make_file(self.p(f"c{i}"), 3 * MB + i, seed=i) for i in range(6)}
        results, errors = {}, []

        def upload(i):
            try:
                results[i] = blob_client.put_file(self.url, i, self.p(i), token=TOKEN)["sha256"]
            except Exception as e:            # pragma: no cover - reported below
                errors.append(e)
        threads = [threading.Thread(target=upload, args=(i,)) for i in shas]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        self.assertEqual((errors, results), ([], shas))
        for i, sha in shas.items():
            self.assertEqual(blob_client.get_file(self.url, i, self.p(i + ".back"), token=TOKEN), sha)

    def test_a_second_upload_to_the_same_id_is_refused_not_interleaved(self):
        body = os.urandom(2 * MB)
        sha = hashlib.sha256(body).hexdigest()
        sock = socket.create_connection(("127.0.0.1", self.server.server_address[1]))
        self.addCleanup(sock.close)
        sock.sendall(f"PUT /blobs/same HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
                     f"Content-Length: {len(body)}\r\nX-Content-Sha256: {sha}\r\n\r\n".encode() + body[:MB])
        expect(lambda: "same" in self.store.uploading, "the first upload to start", timeout_s=60, interval_s=0.02)
        _, first = self.expect_put("same", 2 * MB, "2" * 64)
        head, _, reply = first.partition(b"\r\n\r\n")
        self.assertTrue(head.startswith(b"HTTP/1.1 409 "), first)
        self.assertRegex(json.loads(reply)["error"], "being uploaded")
        status, _, reply = self.raw("DELETE", "/blobs/same")
        self.assert_refused(status, reply, 409, "being uploaded")
        sock.sendall(body[MB:])
        resp = http.client.HTTPResponse(sock, method="PUT")
        resp.begin()
        self.assertEqual((resp.status, json.loads(resp.read())["sha256"]), (201, sha))
        self.assertEqual(self.raw("GET", "/blobs/same")[2], body)

    # ---------------------------------------------------------------- refusals
    def test_bad_ids_headers_and_auth(self):
        body = b"x" * 1000
        sha = hashlib.sha256(body).hexdigest()
        for bad in ("../x", "..%2fx", ".hidden", "a/b", "a b", "x" * 201, ""):
            status, _, reply = self.put_raw(bad.replace(" ", "%20"), body)
            self.assertIn(status, (400, 404), bad)
            self.assertEqual(reply.count(b"\n"), 1)
        self.assert_refused(*self.put_raw("../x", body)[::2], 400, "bad blob id")
        self.assert_refused(*self.raw("GET", "/blobs/.hidden")[::2], 400, "bad blob id")
        status, _, reply = self.raw("PUT", "/blobs/ok", {"X-Content-Sha256": sha})
        self.assert_refused(status, reply, 411, "Content-Length")
        self.assert_refused(*self.put_raw("ok", body, sha="abc")[::2], 400, "X-Content-Sha256")
        self.assert_refused(*self.raw("PUT", "/blobs/ok", {"Content-Length": "1000"}, body)[::2],
                            400, "X-Content-Sha256")
        for rng in ("bytes 0-999", "bytes 0-998/1000", "bytes 5-1004/1000", "0-999/1000", "bytes 0-999/*"):
            self.assert_refused(*self.put_raw("ok", body, sha, {"Content-Range": rng})[::2], 400, "Content-Range")
        self.assert_refused(*self.put_raw("ok", body, sha, {"Content-Range": "bytes 10-1009/2000"})[::2],
                            416, "no unfinished upload")
        self.assert_refused(*self.raw("PUT", "/blobs/ok", {"Content-Length": "1000", "X-Content-Sha256": sha},
                                      body, auth=False)[::2], 401, "token")
        self.assert_refused(*self.raw("GET", "/blobs", auth=False)[::2], 401, "token")
        self.assertEqual(self.raw("GET", "/health", auth=False)[0], 200)
        self.assert_refused(*self.raw("DELETE", "/blobs/nothing")[::2], 404, "no blob")
        self.assertEqual(self.visible_files(), [])

    def test_a_wrong_checksum_discards_the_upload(self):
        body = os.urandom(2 * MB)
        status, _, reply = self.put_raw("bad", body, sha="0" * 64)
        self.assert_refused(status, reply, 400, "checksum mismatch.*discarded")
        self.assertIsNone(blob_client.head(self.url, "bad", TOKEN))
        self.assertEqual(self.visible_files(), [])
        self.assertEqual(self.put_raw("bad", body)[0], 201)
        self.assert_refused(*self.put_raw("bad", body[:10])[::2], 409, "already exists")
        self.assertEqual(self.put_raw("bad", body)[0], 200)         # same bytes again: idempotent
        with open(self.p("other"), "wb") as f:
            f.write(body[:-1])
        with self.assertRaises(httpc.CallError) as cm:              # refused at once, not retried
            blob_client.put_file(self.url, "bad", self.p("other"), token=TOKEN)
        self.assertEqual(cm.exception.status, 409)

    def test_quota_and_size_limits_answer_before_the_body_is_sent(self):
        # Expect: 100-continue: the refusal comes back although no byte of the body was sent.
        _, first = self.expect_put("big", self.MAX_BLOB + 1, "1" * 64)
        head, _, reply = first.partition(b"\r\n\r\n")
        self.assertTrue(head.startswith(b"HTTP/1.1 413 "), first)
        self.assertIn(b"Connection: close", head)
        self.assertRegex(json.loads(reply)["error"], "per-blob limit")
        for i in range(2):
            self.assertEqual(self.put_raw(f"fill{i}", b"y" * (25 * MB))[0], 201)
        _, first = self.expect_put("over", 20 * MB, "1" * 64)
        self.assertTrue(first.startswith(b"HTTP/1.1 413 "), first)
        self.assertIn(b"quota", first)
        sock, first = self.expect_put("fits", 5 * MB, hashlib.sha256(b"z" * 5 * MB).hexdigest())
        self.assertEqual(first, b"HTTP/1.1 100 Continue\r\n\r\n")
        sock.sendall(b"z" * 5 * MB)
        resp = http.client.HTTPResponse(sock, method="PUT")
        resp.begin()
        self.assertEqual(resp.status, 201)
        src = self.p("src")
        make_file(src, 20 * MB)
        with self.assertRaises(httpc.CallError) as cm:
            blob_client.put_file(self.url, "over", src, token=TOKEN)
        self.assertEqual(cm.exception.status, 413)
        httpc.call(self.url, "DELETE", "/blobs/fill0", token=TOKEN)
        httpc.call(self.url, "DELETE", "/blobs/fits", token=TOKEN)
        self.assertEqual(blob_client.put_file(self.url, "over", src, token=TOKEN)["size"], 20 * MB)

    def test_status_lists_the_store_and_exits_1_once_it_is_full(self):
        token = self.p("token")
        with open(token, "w") as f:
            f.write(TOKEN + "\n")

        def status():
            return subprocess.run([sys.executable, os.path.join(ROOT, "blobstore.py"), "status", "--url", self.url,
                                   "--token-file", token], capture_output=True, text=True, timeout=60,
                                  env=child_env())
        self.assertEqual(self.put_raw("fill0", b"y" * (25 * MB))[0], 201)
        r = status()
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("1 blobs, 0 unfinished uploads; 0.03 of 0.06 GB used", r.stdout)
        self.assertIn("fill0", r.stdout)
        for name, size in (("fill1", 25 * MB), ("fill2", 10 * MB)):       # exactly the quota
            self.assertEqual(self.put_raw(name, b"y" * size)[0], 201)
        r = status()
        self.assertEqual(r.returncode, 1, r.stdout)
        self.assertIn("!!! the store is full", r.stdout)
        r = subprocess.run([sys.executable, os.path.join(ROOT, "blobstore.py"), "status", "--url", self.url],
                           capture_output=True, text=True, timeout=60, env=child_env())    # no token: a 401
        self.assertEqual(r.returncode, 1)
        self.assertIn("status: ", r.stderr)

    def test_get_file_refuses_a_missing_blob_and_leaves_nothing(self):
        with self.assertRaises(httpc.CallError) as cm:
            blob_client.get_file(self.url, "absent", self.p("dst"), token=TOKEN)
        self.assertEqual(cm.exception.status, 404)
        self.assertEqual(sorted(os.listdir(self.dir)), ["root"])


class ProgressTest(unittest.TestCase):
    def test_quiet_for_short_transfers_then_bytes_rate_and_eta(self):
        now = [0.0]
        out = io.StringIO()
        bar = blob_client.Progress("put d", 100 * 2**20, None, clock=lambda: now[0], out=out)
        bar.update(0)
        now[0] = 1.5
        bar.update(30 * 2**20)
        self.assertEqual(out.getvalue(), "")                          # under 2 s: silent
        now[0] = 2.5
        bar.update(50 * 2**20)
        self.assertEqual(out.getvalue(), "put d: 50.0/100.0 MiB 21 MB/s ETA 2 s\n")
        now[0] = 2.9
        bar.update(60 * 2**20)
        self.assertEqual(out.getvalue().count("\n"), 1)                # at most once a second
        bar.close(100 * 2**20)
        self.assertTrue(out.getvalue().endswith("100.0/100.0 MiB 36 MB/s ETA 0 s\n"))
        quiet = io.StringIO()
        off = blob_client.Progress("x", 10, False, clock=lambda: now[0], out=quiet)
        off.update(0)
        now[0] = 100.0
        off.update(5)
        off.close(10)
        self.assertEqual(quiet.getvalue(), "")


class CrashResumeTest(unittest.TestCase):
    """1 GiB upload in one stream; the server process is SIGKILLed with a third on disk, restarted on the
    same root and port, and put_file finishes the upload from where the bytes stopped."""
    SIZE = 2**30

    def start_server(self, port=0):
        env = {**os.environ, "PWW_TOKEN": TOKEN}
        proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "blobstore.py"), "--root", self.root,
                                 "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                env=env, text=True)
        self.addCleanup(lambda: proc.poll() is None and (proc.kill(), proc.wait(30)))
        return proc, listening_url(proc, timeout=120)[0]

    def test_server_killed_mid_upload_then_resumed_to_the_right_checksum(self):
        tmp = tempfile.TemporaryDirectory()
        self.addCleanup(tmp.cleanup)
        self.root, src = os.path.join(tmp.name, "root"), os.path.join(tmp.name, "src")
        sha = make_file(src, self.SIZE, seed=7)
        proc, url = self.start_server()
        result = {}

        def upload():
            try:
                result["out"] = blob_client.put_file(url, "big", src, token=TOKEN, sha256=sha, streams=1,
                                                     deadline=httpc.Deadline(240, max_wait_s=1.0, log=httpc.quiet))
            except Exception as e:
                result["error"] = e
        t = threading.Thread(target=upload)
        t.start()
        partial = os.path.join(self.root, "partial", "big")
        expect(lambda: os.path.exists(partial) and os.path.getsize(partial) >= self.SIZE // 3,
               "a third of the upload on disk", timeout_s=180, interval_s=0.02)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        on_disk = os.path.getsize(partial)
        self.assertLess(on_disk, self.SIZE)
        proc, url2 = self.start_server(port=int(url.rsplit(":", 1)[1]))
        self.assertEqual(url2, url)
        t.join(300)
        self.assertFalse(t.is_alive(), "put_file did not finish")
        self.assertNotIn("error", result)
        out = result["out"]
        self.assertEqual((out["size"], out["sha256"]), (self.SIZE, sha))
        self.assertLess(out["sent"], self.SIZE + on_disk // 2)        # resumed, not started over
        self.assertFalse(os.path.exists(partial))
        os.unlink(src)
        self.assertEqual(blob_client.get_file(url, "big", os.path.join(tmp.name, "back"), token=TOKEN), sha)


# ---------------------------------------------------------------- parallel streams

MiB = 2 ** 20


class Store:
    """A blobstore in this process (make_routes on httpd), TLS when `tls`."""

    def __init__(self, test, root, tls=False, quota=10 ** 10):
        self.store = blobstore.BlobStore(root, quota, quota, chunk=MiB)
        self.ca = None
        ctx = None
        if tls:
            self.ca, cert, key = certs.make_tls(os.path.dirname(root))
            ctx = httpd.server_tls(cert, key)
        self.server = httpd.make_server(blobstore.make_routes(self.store), token=TOKEN, tls=ctx)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        test.addCleanup(self.server.server_close)
        test.addCleanup(self.server.shutdown)
        self.url = self.server.url


def piece(url, blob_id, body, a, b, sha, ca=None):
    """One raw PUT ?ranged=1 of body[a:b] -> (status, reply dict)."""
    conn = httpc.connect(url, 60, ca)
    try:
        conn.request("PUT", f"/blobs/{blob_id}?ranged=1", body=body[a:b],
                     headers={"Content-Range": f"bytes {a}-{b - 1}/{len(body)}", "X-Content-Sha256": sha,
                              **httpc.auth_headers(TOKEN)})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"{}")
    finally:
        conn.close()


class StreamsTest(unittest.TestCase):
    def setUp(self):
        tmp = tempfile.TemporaryDirectory()
        self.addCleanup(tmp.cleanup)
        self.dir = tmp.name

    def p(self, name):
        return os.path.join(self.dir, name)

    def test_1_2_4_8_streams_over_tls_move_identical_bytes(self):
        s = Store(self, self.p("root"), tls=True)
        sha = make_file(self.p("src"), 24 * MiB + 12345, seed=3)
        for n in (1, 2, 4, 8):
            out = blob_client.put_file(s.url, f"b{n}", self.p("src"), token=TOKEN, ca_file=s.ca, streams=n,
                                       progress=False)
            self.assertEqual((out["sha256"], out["size"], out["sent"]), (sha, 24 * MiB + 12345, 24 * MiB + 12345))
            got = blob_client.get_file(s.url, f"b{n}", self.p(f"back{n}"), token=TOKEN, ca_file=s.ca, streams=n)
            self.assertEqual((got, blob_client.sha256_file(self.p(f"back{n}"))), (sha, sha))
            self.assertEqual(s.store.complete(f"b{n}")["sha256"], sha)
        self.assertEqual(os.listdir(self.p("root/partial")), [])
        self.assertEqual(sorted(os.listdir(self.dir)),
                         sorted(["back1", "back2", "back4", "back8", "root", "src", "ca.pem", "ca.key", "ca.srl",
                                 "server.pem", "server.key", "server.csr", "server.ext"]))

    def test_the_stream_count_comes_from_the_argument_the_environment_or_the_size(self):
        self.assertEqual([blob_client.pick_streams(n * MiB) for n in (0, 1, 127, 128, 512, 4096)], [1, 1, 1, 2, 8, 8])
        os.environ[blob_client.STREAMS_ENV] = "3"
        self.addCleanup(os.environ.pop, blob_client.STREAMS_ENV)
        self.assertEqual((blob_client.pick_streams(MiB), blob_client.pick_streams(MiB, 5)), (3, 5))
        os.environ[blob_client.STREAMS_ENV] = "many"
        with self.assertRaisesRegex(ValueError, "PWW_BLOB_STREAMS.*1..32"):
            blob_client.pick_streams(MiB)

    def test_pieces_out_of_order_land_and_finish_once_all_are_there(self):
        s = Store(self, self.p("root"))
        body = os.urandom(5 * MiB + 3)
        sha = hashlib.sha256(body).hexdigest()
        cuts = [(4 * MiB, 5 * MiB + 3), (MiB, 3 * MiB), (0, MiB)]
        for a, b in cuts:
            status, reply = piece(s.url, "ooo", body, a, b, sha)
            self.assertEqual(status, 202, reply)
        info = blob_client.head(s.url, "ooo", TOKEN)
        self.assertEqual(info, {"complete": False, "offset": 0, "total": len(body), "sha256": sha,
                                "ranges": [[0, 3 * MiB], [4 * MiB, 5 * MiB + 3]]})
        self.assertEqual(httpc.call(s.url, "GET", "/blobs", token=TOKEN)["uploads"],
                         [{"id": "ooo", "offset": 4 * MiB + 3, "total": len(body), "uploading": False}])
        with self.assertRaises(httpc.CallError) as cm:             # not visible before every byte landed
            blob_client.get_file(s.url, "ooo", self.p("early"), token=TOKEN)
        self.assertEqual(cm.exception.status, 404)
        wrong = bytearray(body)
        wrong[0:MiB] = b"x" * MiB                                  # a landed byte never changes
        status, _ = piece(s.url, "ooo", bytes(wrong), 0, 3 * MiB + 1, sha)
        self.assertEqual(status, 202)
        status, reply = piece(s.url, "ooo", body, 3 * MiB, 4 * MiB, sha)
        self.assertEqual((status, reply["sha256"]), (201, sha))
        self.assertEqual(blob_client.get_file(s.url, "ooo", self.p("back"), token=TOKEN), sha)
        self.assertEqual(sorted(os.listdir(self.p("root/partial"))), [])
        self.assertEqual(piece(s.url, "ooo", body, 0, 10, sha)[0], 200)        # already there: nothing to do

    def test_a_wrong_byte_in_one_piece_fails_the_checksum_and_nothing_becomes_visible(self):
        s = Store(self, self.p("root"))
        body = os.urandom(4 * MiB)
        sha = hashlib.sha256(body).hexdigest()
        bad = bytearray(body)
        bad[3 * MiB + 7] ^= 1
        self.assertEqual(piece(s.url, "bad", bytes(bad), 2 * MiB, 4 * MiB, sha)[0], 202)
        status, reply = piece(s.url, "bad", body, 0, 2 * MiB, sha)
        self.assertEqual(status, 400)
        self.assertRegex(reply["error"], "checksum mismatch.*discarded")
        self.assertIsNone(blob_client.head(s.url, "bad", TOKEN))
        self.assertEqual(os.listdir(self.p("root/blobs")) + os.listdir(self.p("root/partial")), [])

    def test_a_cut_stream_resends_only_what_the_store_did_not_record(self):
        s = Store(self, self.p("root"))
        size = 48 * MiB
        sha = make_file(self.p("src"), size, seed=5)        # streams=2: 6 MiB pieces, 2 per connection ...
        up = CuttingProxy(s.url, 9 * MiB, "up")             # ... so the cut falls 3 MiB into a piece
        self.addCleanup(up.close)
        out = blob_client.put_file(up.url, "cut", self.p("src"), token=TOKEN, streams=2, progress=False,
                                   deadline=httpc.Deadline(60, log=httpc.quiet))
        self.assertEqual((out["sha256"], up.cuts), (sha, 1))
        # every byte the store received it recorded: what crossed twice is headers, not 3 MiB
        self.assertLess(up.total["up"], size + 64 * 1024)
        down = CuttingProxy(s.url, 9 * MiB, "down")
        self.addCleanup(down.close)
        got = blob_client.get_file(down.url, "cut", self.p("dst"), token=TOKEN, streams=2,
                                   deadline=httpc.Deadline(60, log=httpc.quiet))
        self.assertEqual((got, down.cuts, blob_client.sha256_file(self.p("dst"))), (sha, 1, sha))
        self.assertLess(down.total["down"], size + 64 * 1024)
        self.assertEqual(sorted(os.listdir(self.dir)), ["dst", "root", "src"])

    def test_two_uploaders_of_one_id_do_not_corrupt_each_other(self):
        s = Store(self, self.p("root"))
        sha = make_file(self.p("src"), 16 * MiB, seed=9)
        results, errors = [], []

        def upload():
            try:
                results.append(blob_client.put_file(s.url, "twice", self.p("src"), token=TOKEN, streams=4,
                                                    deadline=httpc.Deadline(60, log=httpc.quiet))["sha256"])
            except Exception as e:           # pragma: no cover - reported below
                errors.append(e)
        threads = [threading.Thread(target=upload) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        self.assertEqual((errors, results), ([], [sha, sha]))
        self.assertEqual(blob_client.get_file(s.url, "twice", self.p("back"), token=TOKEN), sha)

    def test_one_stream_clients_and_the_quota_still_apply(self):
        s = Store(self, self.p("root"), quota=20 * MiB)
        body = os.urandom(4 * MiB)
        sha = hashlib.sha256(body).hexdigest()
        self.assertEqual(piece(s.url, "mixed", body, 0, MiB, sha)[0], 202)
        with open(self.p("src"), "wb") as f:
            f.write(body)
        out = blob_client.put_file(s.url, "mixed", self.p("src"), token=TOKEN, streams=1)   # starts it again
        self.assertEqual((out["sha256"], out["sent"]), (sha, 4 * MiB))
        status, reply = piece(s.url, "big", bytes(17 * MiB), 0, 10, "1" * 64)      # refused before the body
        self.assertEqual(status, 413)
        self.assertRegex(reply["error"], "quota")
        self.assertEqual(os.listdir(self.p("root/partial")), [])


class CrashMidPiecesTest(unittest.TestCase):
    """The store is SIGKILLed while a piece is being written: the pieces it answered 202 for
    are there after the restart, the unanswered one is not, nothing is visible, and
    put_file in streams sends exactly the bytes that are missing."""

    def start(self, port=0):
        env = {**os.environ, "PWW_TOKEN": TOKEN, "PWW_TEST_FAULT_DIR": self.faults}
        proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "blobstore.py"), "--root", self.root,
                                 "--port", str(port), "--chunk-mb", "1"], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, env=env, text=True)
        self.addCleanup(lambda: proc.poll() is None and (proc.kill(), proc.wait(30)))
        return proc, listening_url(proc, timeout=120)[0]

    def test_acknowledged_pieces_survive_a_kill_and_the_upload_finishes_from_them(self):
        tmp = tempfile.TemporaryDirectory()
        self.addCleanup(tmp.cleanup)
        self.root, self.faults = os.path.join(tmp.name, "root"), os.path.join(tmp.name, "faults")
        os.mkdir(self.faults)
        src = os.path.join(tmp.name, "src")
        size = 16 * MiB
        sha = make_file(src, size, seed=11)
        with open(src, "rb") as f:
            body = f.read()
        proc, url = self.start()
        for a, b in ((0, 4 * MiB), (8 * MiB, 12 * MiB)):
            self.assertEqual(piece(url, "big", body, a, b, sha)[0], 202)
        with open(os.path.join(self.faults, "blob.piece"), "w") as f:
            f.write("1")                                       # the 2nd MiB of the next piece stops there
        t = threading.Thread(target=lambda: self.assertRaises(Exception, piece, url, "big", body, 4 * MiB, 8 * MiB,
                                                              sha), daemon=True)
        t.start()
        expect(lambda: os.path.exists(os.path.join(self.faults, "blob.piece.hit")), "the piece to stop mid-way",
               timeout_s=60, interval_s=0.02)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        t.join(60)
        os.unlink(os.path.join(self.faults, "blob.piece"))
        proc, url2 = self.start(port=int(url.rsplit(":", 1)[1]))
        self.assertEqual(url2, url)
        info = blob_client.head(url, "big", TOKEN)
        self.assertEqual(info["ranges"], [[0, 4 * MiB], [8 * MiB, 12 * MiB]])
        self.assertFalse(os.listdir(os.path.join(self.root, "blobs")))
        out = blob_client.put_file(url, "big", src, token=TOKEN, sha256=sha, streams=4, progress=False)
        self.assertEqual((out["sha256"], out["sent"]), (sha, size - 8 * MiB))
        self.assertEqual(blob_client.get_file(url, "big", os.path.join(tmp.name, "back"), token=TOKEN), sha)


if __name__ == "__main__":
    unittest.main()
