"""A delta checked while its bytes arrive: the blob store's GET ?follow=1 (every landed byte
once, then the sha256), the aggregator's POST /delta_blob {"follow": true} (fedmom_state.
Follower) against a real store on 127.0.0.1 with a test uploader that sends 8 pieces out of
order and can hold one back, its refusals (NaN 422, shape 400), two deltas followed at once,
the aggregator SIGKILLed mid-check (fault point fedmom.check_stream) with the site's fallback
accepted once, and the old POST after the upload. No timing: fault points and events."""
import hashlib
import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
import unittest

import numpy as np

import blob_client
import blobstore
import fedmom_client
import fedmom_merge
import fedmom_server as fm
import fedmom_state as fs
import httpc
import tensorio
import testhooks
from fixtures import FedMomFixture, serve_in_thread, write_tensors
from testbed.harness import child_env, free_port, listening_url

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKEN = "stream-token"
SHAPES = {f"t{i:02d}": (64, 256) for i in range(16)}      # 16 tensors of 64 KiB (F32): 1 MiB
META = {"cluster": "lumi", "incarnation": "lumi-inc", "base_round": 0, "tokens": 100}


def wait_for(path, what, limit_s=120.0):
    """Wait until `path` exists (a fault point's .hit); the limit is a hang bound, not a wait."""
    end = time.monotonic() + limit_s
    while not os.path.exists(path):
        if time.monotonic() > end:
            raise AssertionError(f"{what}: {path} never appeared")
        time.sleep(0.01)


class Uploader:
    """The test's own uploader: `path` as 8 pieces PUT ?ranged=1 on 8 threads, in a shuffled
    order; piece `hold` waits for self.release. join() -> the 201 reply of the last piece."""

    def __init__(self, url, blob, path, hold=None, streams=8):
        self.url, self.blob, self.path, self.hold = url, blob, path, hold
        with open(path, "rb") as f:
            self.data = f.read()
        self.sha, size = hashlib.sha256(self.data).hexdigest(), len(self.data)
        step = -(-size // streams)
        self.pieces = [(a, min(a + step, size)) for a in range(0, size, step)]
        self.release, self.replies, self.errors = threading.Event(), [], []
        order = np.random.default_rng(7).permutation(len(self.pieces))
        self.threads = [threading.Thread(target=self._put, args=(i,), daemon=True) for i in order]
        for t in self.threads:
            t.start()

    def _put(self, i):
        a, b = self.pieces[i]
        if i == self.hold:
            self.release.wait()
        _, host, port, _ = httpc.split_url(self.url)
        conn = http.client.HTTPConnection(host, port, timeout=120)
        try:
            conn.request("PUT", f"/blobs/{self.blob}?ranged=1", body=self.data[a:b], headers={
                "Content-Range": f"bytes {a}-{b - 1}/{len(self.data)}", "X-Content-Sha256": self.sha,
                "Authorization": f"Bearer {TOKEN}"})
            resp = conn.getresponse()
            self.replies.append((resp.status, json.loads(resp.read())))
        except Exception as e:              # the test reads it: no exception escapes a thread
            self.errors.append(e)
        finally:
            conn.close()

    def join(self):
        for t in self.threads:
            t.join(120)
        assert not self.errors, self.errors
        return [r for s, r in self.replies if s == 201]


class Post:
    """POST /delta_blob on a thread -> (status, reply) at join()."""

    def __init__(self, url, body):
        self.out = None
        self.thread = threading.Thread(target=self._run, args=(url, body), daemon=True)
        self.thread.start()

    def _run(self, url, body):
        try:
            self.out = 200, httpc.call(url, "POST", "/delta_blob", body, token=TOKEN, timeout=300)
        except httpc.CallError as e:
            self.out = e.status, e.reply

    def join(self):
        self.thread.join(300)
        return self.out


class StreamFixture(FedMomFixture):
    def setUp(self):
        super().setUp()
        rng = np.random.default_rng(3)
        write_tensors(self.init, {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}, "F32")
        self.store = blobstore.BlobStore(os.path.join(self.dir, "blobs"), 1 << 30, 1 << 28)
        self.blob_url = serve_in_thread(self, blobstore.make_routes(self.store), token=TOKEN)
        self.faults = os.path.join(self.dir, "faults")
        os.makedirs(self.faults)

    def make_delta(self, name, nan=None, shapes=SHAPES):
        rng = np.random.default_rng(len(name))
        arrays = {k: (0.01 * rng.standard_normal(s)).astype(np.float32) for k, s in shapes.items()}
        if nan is not None:
            arrays[nan][3, 5] = np.nan
        path = os.path.join(self.dir, name + ".safetensors")
        write_tensors(path, arrays, "F32")
        return path

    def aggregator(self, name="st", join=("lumi",)):
        cfg = fs.ServerConfig(os.path.join(self.dir, name), self.init, blob_url=self.blob_url)
        st = fs.FedMomState(cfg.validate(), clock=self.clock)
        for c in join:
            st.join(c, f"{c}-inc")
        return st, serve_in_thread(self, fm.make_routes(st, blob_token=TOKEN), token=TOKEN)

    def body(self, up, blob, cluster="lumi", follow=True):
        return {**META, "cluster": cluster, "incarnation": f"{cluster}-inc", "blob": blob, "sha256": up.sha,
                **({"follow": True, "size": len(up.data)} if follow else {})}

    def outside(self, path, piece):
        """The tensors of `path` none of whose bytes are in [a, b) = piece."""
        a, b = piece
        with tensorio.TensorReader(path) as r:
            return [n for n in r.names if not (r.span(n)[0] < b and a < r.span(n)[1])]

    def arm(self, name, skip):
        with open(os.path.join(self.faults, name), "w") as f:
            f.write(str(skip))


class FollowStreamTest(StreamFixture):
    def test_the_follow_stream_gives_each_landed_byte_once_then_the_sha(self):
        path = self.make_delta("d")
        got = []
        t = threading.Thread(target=lambda: got.extend(blob_client.follow(self.blob_url, "b1", token=TOKEN)))
        t.start()
        up = Uploader(self.blob_url, "b1", path, hold=2)
        seen = bytearray(len(up.data))
        count = np.zeros(len(up.data), np.int32)
        up.release.set()
        self.assertEqual(len(up.join()), 1)
        t.join(120)
        *data, end = got
        for kind, off, payload in data:
            self.assertEqual(kind, b"R")
            seen[off:off + len(payload)] = payload
            count[off:off + len(payload)] += 1
        self.assertEqual(end, (b"E", 0, {"complete": True, "sha256": up.sha, "size": len(up.data)}))
        self.assertTrue((count == 1).all(), "every byte exactly once")
        self.assertEqual(bytes(seen), up.data)
        # a blob already complete: sent whole; an in-order upload: followed too; an absent id ends "gone"
        again = list(blob_client.follow(self.blob_url, "b1", token=TOKEN))
        self.assertEqual(b"".join(p for k, _, p in again[:-1]), up.data)
        got.clear()
        t = threading.Thread(target=lambda: got.extend(blob_client.follow(self.blob_url, "b2", token=TOKEN)))
        t.start()
        blob_client.put_file(self.blob_url, "b2", path, token=TOKEN, streams=1)
        t.join(120)
        self.assertEqual(b"".join(p for k, _, p in got[:-1]), up.data)
        self.assertTrue(got[-1][2]["complete"])
        gone = list(blobstore.BlobStore.follow(self.store, "never", wait_s=0))
        self.assertIn(b'"gone"', gone[-1])


class FollowedDeltaTest(StreamFixture):
    def test_a_followed_delta_is_checked_before_its_last_piece_and_accepted(self):
        st, url = self.aggregator()
        path = self.make_delta("d")
        os.environ[testhooks.FAULT_DIR_ENV] = self.faults
        self.addCleanup(os.environ.pop, testhooks.FAULT_DIR_ENV, None)
        up = Uploader(self.blob_url, "bd", path, hold=3)
        early = self.outside(path, up.pieces[3])
        self.assertGreater(len(early), 0)
        self.assertLess(len(early), len(SHAPES))
        self.arm("fedmom.check_stream", len(early) - 1)      # stops at the len(early)-th tensor checked
        post = Post(url, self.body(up, "bd"))
        hit = os.path.join(self.faults, "fedmom.check_stream.hit")
        wait_for(hit, "the streamed check of every tensor outside the held piece")
        self.assertEqual(st.pending, {})                      # not accepted: the last piece is held
        os.unlink(os.path.join(self.faults, "fedmom.check_stream"))
        up.release.set()
        up.join()
        status, reply = post.join()
        self.assertEqual(status, 200, reply)
        self.assertTrue(reply["accepted"])
        self.assertEqual(reply["streamed"], {"tensors": len(SHAPES), "before_last_byte": len(early)})
        (p,) = st.pending.values()
        with open(p.path, "rb") as f:
            self.assertEqual(f.read(), up.data)
        self.assertEqual(p.norm, fedmom_merge.check_delta_file(p.path, st.keeper.specs))
        self.assertIsNotNone(p.landed)
        self.assertIsNone(self.store.complete("bd"))          # deleted once fetched
        # the same POST again: a duplicate, as today
        again = httpc.call(url, "POST", "/delta_blob", self.body(up, "bd"), token=TOKEN)
        self.assertTrue(again["duplicate"])

    def test_the_streamed_norm_is_check_delta_files_bit_for_bit_and_the_refusals_the_same(self):
        path = self.make_delta("d")
        specs = {k: tuple(s) for k, s in SHAPES.items()}
        with fedmom_merge.DeltaCheck(path, specs) as c:
            c.open()
            for name in reversed(c.names):                   # another order: the same bits
                c.check(name)
            self.assertEqual(c.norm(), fedmom_merge.check_delta_file(path, specs))
        bad = self.make_delta("nan", nan="t05")
        with self.assertRaises(fedmom_merge.DeltaRejected) as whole, fedmom_merge.DeltaCheck(bad, specs) as c:
            fedmom_merge.check_delta_file(bad, specs)
        with self.assertRaises(fedmom_merge.DeltaRejected) as steps, fedmom_merge.DeltaCheck(bad, specs) as c:
            c.open()
            c.check("t05")
        self.assertEqual((whole.exception.status, whole.exception.reason),
                         (steps.exception.status, steps.exception.reason))

    def test_a_nan_tensor_is_refused_422_and_a_wrong_shape_400(self):
        st, url = self.aggregator(join=("lumi", "snellius"))
        up = Uploader(self.blob_url, "bn", self.make_delta("nan", nan="t02"))
        post = Post(url, self.body(up, "bn"))
        up.release.set()
        up.join()
        status, reply = post.join()
        self.assertEqual((status, reply["code"]), (422, "bad_delta"))
        self.assertIn("tensor 't02' holds NaN or Inf", reply["error"])
        shapes = {**SHAPES, "t07": (64, 128)}
        up = Uploader(self.blob_url, "bs", self.make_delta("shape", shapes=shapes))
        post = Post(url, self.body(up, "bs", cluster="snellius"))
        up.release.set()
        up.join()
        status, reply = post.join()
        self.assertEqual(status, 400, reply)
        self.assertIn("tensor 't07' has shape [64, 128], theta_global has [64, 256]", reply["error"])
        self.assertEqual(st.pending, {})

    def test_two_deltas_followed_at_once_are_checked_together(self):
        st, url = self.aggregator(join=("lumi", "snellius"))
        os.environ[testhooks.FAULT_DIR_ENV] = self.faults
        self.addCleanup(os.environ.pop, testhooks.FAULT_DIR_ENV, None)
        ups, posts, early = [], [], 0
        for cluster in ("lumi", "snellius"):
            path = self.make_delta(cluster)
            up = Uploader(self.blob_url, f"b-{cluster}", path, hold=5)
            early += len(self.outside(path, up.pieces[5]))
            ups.append(up)
        # the early-th check overall: each delta can check only its own tensors outside its held
        # piece, so this point is reached only with both followed and checked at once
        self.arm("fedmom.check_stream", early - 1)
        for up, cluster in zip(ups, ("lumi", "snellius")):
            posts.append(Post(url, self.body(up, up.blob, cluster=cluster)))
        wait_for(os.path.join(self.faults, "fedmom.check_stream.hit"), "both deltas' early checks")
        os.unlink(os.path.join(self.faults, "fedmom.check_stream"))
        for up in ups:
            up.release.set()
            up.join()
        replies = [p.join() for p in posts]
        self.assertEqual([s for s, _ in replies], [200, 200], replies)
        self.assertEqual(sum(r["streamed"]["before_last_byte"] for _, r in replies), early)
        self.assertEqual(len(st.pending), 2)

    def test_the_old_post_after_the_upload_still_works(self):
        st, url = self.aggregator()
        up = Uploader(self.blob_url, "bo", self.make_delta("d"))
        up.release.set()
        up.join()
        reply = httpc.call(url, "POST", "/delta_blob", self.body(up, "bo", follow=False), token=TOKEN)
        self.assertTrue(reply["accepted"])
        self.assertNotIn("streamed", reply)
        (p,) = st.pending.values()
        self.assertIsNotNone(p.landed)


class FollowCrashTest(StreamFixture):
    def start(self, port, state_dir, token_file):
        proc = subprocess.Popen([sys.executable, "fedmom_server.py", "--state-dir", state_dir, "--init", self.init,
                                 "--port", str(port), "--blob-url", self.blob_url, "--token-file", token_file],
                                cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=child_env(**{testhooks.FAULT_DIR_ENV: self.faults}))
        self.addCleanup(lambda: proc.poll() is None and (proc.kill(), proc.wait(30)))
        listening_url(proc, timeout=120)
        return proc

    def test_an_aggregator_killed_mid_check_accepts_the_sites_fallback_once(self):
        token_file = os.path.join(self.dir, "token")
        with open(token_file, "w") as f:
            f.write(TOKEN)
        port, state_dir = free_port(), os.path.join(self.dir, "agg")
        proc = self.start(port, state_dir, token_file)
        url = f"http://127.0.0.1:{port}"
        client = fedmom_client.FedMomClient(url, "lumi", "lumi-inc", token=TOKEN, blob_url=self.blob_url,
                                            timeout=300)
        client.join()
        # a second member that sends nothing: the round stays open, so the spool still holds it
        fedmom_client.FedMomClient(url, "snellius", "snellius-inc", token=TOKEN).join()
        self.arm("fedmom.check_stream", 2)
        path, out = self.make_delta("d"), {}

        def send():
            try:
                out["reply"] = client.send_delta(path, 0, 100, [], {}, transport="blob",
                                                 deadline=httpc.Deadline(300, what="send"))
            except Exception as e:           # read below: no exception escapes the thread
                out["error"] = e
        t = threading.Thread(target=send)
        t.start()
        hit = os.path.join(self.faults, "fedmom.check_stream.hit")
        wait_for(hit, "the followed check's third tensor")
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
        os.unlink(os.path.join(self.faults, "fedmom.check_stream"))
        os.unlink(hit)
        self.start(port, state_dir, token_file)
        t.join(300)
        self.assertNotIn("error", out)
        self.assertTrue(out["reply"]["accepted"])
        st = httpc.call(url, "GET", "/status", token=TOKEN)
        self.assertEqual((st["round"], st["pending"]), (0, ["lumi"]))
        spool = os.listdir(os.path.join(state_dir, "spool"))
        self.assertEqual(sorted(f for f in spool if not f.startswith(".")),
                         ["r0_lumi_lumi-inc.json", "r0_lumi_lumi-inc.safetensors"])
        with open(os.path.join(state_dir, "spool", "r0_lumi_lumi-inc.safetensors"), "rb") as f, \
                open(path, "rb") as g:
            self.assertEqual(f.read(), g.read())


if __name__ == "__main__":
    unittest.main()
