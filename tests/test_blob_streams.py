"""Blobs in parallel streams: get_file/put_file with N connections over TLS, the store's
upload in pieces (PUT ?ranged=1) out of order, a cut stream resuming its own range, a
wrong byte, two uploaders of one id, and a store SIGKILLed mid-upload that keeps every
acknowledged piece. Real servers on 127.0.0.1, real files; no timing."""
import hashlib
import http.client
import json
import os
import signal
import ssl
import subprocess
import sys
import tempfile
import threading
import unittest

import blob_client
import blobstore
import httpc
import httpd
from certs import make_tls
from test_blobstore import TOKEN, CuttingProxy, make_file
from testbed.harness import expect, listening_url

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 2 ** 20


class Store:
    """A blobstore in this process (make_routes on httpd), TLS when `tls`."""

    def __init__(self, test, root, tls=False, quota=10 ** 10):
        self.store = blobstore.BlobStore(root, quota, quota, chunk=MiB)
        self.ca = None
        ctx = None
        if tls:
            self.ca, cert, key = make_tls(os.path.dirname(root))
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
