"""The round's exchange as a pipeline: a site follows the update of round r+1 while the
aggregator merges it, adds each tensor as its bytes arrive, and uses the result only once the
round is durable and its digest is the durable round's (FEDERATION_GUIDE.md section 4, "The
update as it is merged"). Real fedmom_server.py processes on loopback; the merge is held at
an exact tensor by the fedmom.merge fault point (testhooks.py), never by a sleep."""
import html
import os
import signal
import subprocess
import sys
import threading
import types
import urllib.request

import numpy as np

import durable
import fedmom_client
import fedsite
import httpc
import tensorio
import testhooks
import wire
from fixtures import FedMomFixture
from testbed.harness import listening_url, wait_for as poll


def wait_for(cond, limit_s):
    """poll() that fails the test at the limit (a hang bound, not a wait)."""
    assert poll(cond, limit_s), "the condition never held"

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class FollowTest(FedMomFixture):
    def start(self, sd, *extra):
        proc = subprocess.Popen([sys.executable, "fedmom_server.py", "--state-dir", sd, "--port", "0",
                                 "--down-wire", "int4", *extra], cwd=ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, testhooks.FAULT_DIR_ENV: self.faults})
        self.addCleanup(lambda: proc.poll() is None and (proc.kill(), proc.wait(30)))
        return proc, listening_url(proc, timeout=120)[0]

    def setUp(self):
        super().setUp()
        self.faults = os.path.join(self.dir, "faults")
        os.makedirs(self.faults)
        self.said = []

    def arm(self, name, skip=0):
        with open(os.path.join(self.faults, name), "w") as f:
            f.write(str(skip))

    def hit(self, name):
        return os.path.exists(os.path.join(self.faults, name + ".hit"))

    def release(self, name):
        os.unlink(os.path.join(self.faults, name))

    def site(self, url, name):
        cfg = types.SimpleNamespace(cluster=name, token_file=None, darl_url="http://127.0.0.1:9", federation=url,
                                    blob_url=None, ca_file=None, transport="inline")
        return fedsite.FedSite(cfg, None, 0, self.said.append)

    def bits(self, path):
        with tensorio.TensorReader(path) as r:
            return {n: r.read(n).view(np.uint32).copy() for n in r.names}

    def served(self, url):
        path = os.path.join(self.dir, f"served-{len(os.listdir(self.dir))}.safetensors")
        fedmom_client.FedMomClient(url, "reader", "reader-inc").download_theta(path)
        return path

    def durable_round(self, sd):
        return httpc.call(self.url, "GET", "/round")["round"]

    def send_both(self, url, rnd):
        for c, tok in (("a", 10), ("b", 30)):
            fedmom_client.FedMomClient(url, c, f"{c}-inc").send_delta(self.delta("F32")[0], rnd, tok, [], {})

    def two_members(self):
        """An aggregator with members a and b; site a (a real FedSite) holding round 0's theta
        -> (state dir, process, a's theta path, a, the round a's first fetch gave)."""
        sd = os.path.join(self.dir, "st")
        proc, self.url = self.start(sd, "--init", self.init)
        for c in ("a", "b"):
            fedmom_client.FedMomClient(self.url, c, f"{c}-inc").join()
        path = os.path.join(self.dir, "a", "theta.safetensors")
        os.makedirs(os.path.dirname(path))
        a = self.site(self.url, "a")
        return sd, proc, path, a, a._fetch(path)

    def test_a_site_holds_update_bytes_before_the_round_is_durable_and_uses_them_only_after(self):
        sd, proc, path, a, rnd = self.two_members()
        self.assertEqual(rnd, 0)
        before = self.bits(path)
        # the merge stops after its 3rd tensor (of 4): the round is not durable
        self.arm("fedmom.merge", skip=2)
        self.send_both(self.url, 0)
        wait_for(lambda: self.hit("fedmom.merge"), 120)
        a.follow = fedsite.Follow.start(a, 0, path)
        fol = a.follow
        # the site receives bytes of round 1's update while round 0 is still the durable one
        wait_for(lambda: fol.f.total is not None and fol.f.have > 8, 120)
        self.assertEqual(fol.f.round, 1)
        self.assertFalse(fol.f.durable)
        self.assertLess(fol.f.have, fol.f.total)
        self.assertEqual(httpc.call(self.url, "GET", "/round")["round"], 0)
        self.assertEqual(self.bits(path).keys(), before.keys())     # theta is untouched meanwhile
        for n in before:
            self.assertTrue(np.array_equal(self.bits(path)[n], before[n]))
        self.release("fedmom.merge")
        reply = fedmom_client.FedMomClient(self.url, "a", "a-inc").heartbeat(wait_round_after=0, wait_s=60)
        self.assertEqual(reply["round"], 1)
        a.last_update = reply["update"]
        self.assertEqual(a._fetch(path), 1)
        self.assertEqual(a.down["via"], "followed", self.said)
        want, got = self.bits(self.served(self.url)), self.bits(path)
        for n in want:                                            # the aggregator's bits, not close values
            self.assertTrue(np.array_equal(want[n], got[n]), n)
        self.assertEqual(a.held, (1, wire.theta_digest(path)))
        self.assertFalse(os.path.exists(os.path.join(self.dir, "a", "theta-next.safetensors")))
        self.assertFalse(os.path.exists(os.path.join(self.dir, "a", "theta-followed.safetensors")))

    def test_a_merge_killed_mid_update_is_never_used_and_the_site_gets_the_durable_bits(self):
        sd, proc, path, a, _ = self.two_members()
        self.arm("fedmom.merge", skip=1)
        self.send_both(self.url, 0)
        wait_for(lambda: self.hit("fedmom.merge"), 120)
        a.follow = fedsite.Follow.start(a, 0, path)
        fol = a.follow
        wait_for(lambda: fol.f.total is not None and fol.f.have > 8, 120)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        self.release("fedmom.merge")
        # the follow cannot finish from this merge: the site waits for the durable round
        proc, url = self.start(sd, "--port", self.url.rsplit(":", 1)[1])
        self.assertEqual(url, self.url)
        for c in ("a", "b"):
            fedmom_client.FedMomClient(self.url, c, f"{c}-inc").join()
        reply = fedmom_client.FedMomClient(self.url, "a", "a-inc").heartbeat(wait_round_after=0, wait_s=60)
        self.assertEqual(reply["round"], 1)
        a.last_update = reply["update"]
        self.assertEqual(a._fetch(path), 1)
        want, got = self.bits(self.served(self.url)), self.bits(path)
        for n in want:
            self.assertTrue(np.array_equal(want[n], got[n]), n)
        self.assertEqual(wire.theta_digest(path), reply["update"]["digest"])

    def test_a_site_whose_round_does_not_close_takes_the_durable_theta_at_once(self):
        # a's delta is in, b never sends: the round stays open and its update never starts.
        # The site asks for theta (its delta excluded, a stale round): it must not wait on the follow.
        sd, proc, path, a, _ = self.two_members()
        fedmom_client.FedMomClient(self.url, "a", "a-inc").send_delta(self.delta("F32")[0], 0, 10, [], {})
        a.follow = fedsite.Follow.start(a, 0, path)
        fol = a.follow
        wait_for(lambda: fol.f.conn is not None, 120)       # its first long poll (202) is under way
        a.last_update = fedmom_client.FedMomClient(self.url, "a", "a-inc").heartbeat().get("update")
        box = {}
        t = threading.Thread(target=lambda: box.setdefault("round", a._fetch(path)), daemon=True)
        t.start()
        t.join(60)                                          # a hang bound: the 202 poll alone lasts 30 s
        self.assertFalse(t.is_alive(), "fetching theta waited on a follow of a round that never merged")
        self.assertEqual(box["round"], 0)
        self.assertFalse(fol.thread.is_alive())
        self.assertEqual(httpc.call(self.url, "GET", "/round")["round"], 0)
        self.assertFalse(os.path.exists(os.path.join(self.dir, "a", "theta-followed.safetensors")))

    def test_the_round_record_and_the_status_page_show_the_exchange_on_one_time_line(self):
        sd = os.path.join(self.dir, "st")
        proc, self.url = self.start(sd, "--init", self.init)
        for c in ("a", "b"):
            fedmom_client.FedMomClient(self.url, c, f"{c}-inc").join()
        self.send_both(self.url, 0)
        reply = fedmom_client.FedMomClient(self.url, "a", "a-inc").heartbeat(wait_round_after=0, wait_s=60)
        self.assertEqual(reply["round"], 1)
        # round 1's record: the merge of round 0's deltas, its stages after the last delta's last byte
        rec = [r for r in durable.read_jsonl(os.path.join(sd, "rounds.jsonl")) if r["round"] == 1][-1]
        ex = rec["exchange"]
        stages = [ex[k] for k in ("accepted_s", "closed_s", "merge_start_s", "offered_s", "merged_s", "durable_s")]
        self.assertTrue(all(x is not None and x >= 0 for x in stages), ex)
        self.assertEqual(stages, sorted(stages), f"the stages in the order they happen: {ex}")
        # each site says, with its next delta, when it held round 1's theta and what it waited
        for c, lag in (("a", 0.25), ("b", 1.5)):
            fedmom_client.FedMomClient(self.url, c, f"{c}-inc").send_delta(
                self.delta("F32")[0], 1, 10, [], {"exchange_round": 1, "held_lag_s": lag, "exchange_wait_s": 3.0})
        fedmom_client.FedMomClient(self.url, "a", "a-inc").heartbeat(wait_round_after=1, wait_s=60)
        with urllib.request.urlopen(self.url + "/", timeout=60) as resp:
            page = html.unescape(resp.read().decode())
        self.assertIn("Exchange of round 1, from the last delta's last byte:", page)
        self.assertIn(f"durable +{ex['durable_s']:.2f} s", page)
        self.assertIn(f"held by a +{ex['durable_s'] + 0.25:.2f} s (its wait 3.0 s), b +{ex['durable_s'] + 1.5:.2f} s", page)


class GrowingTest(FedMomFixture):
    def test_a_reader_gets_each_tensor_as_it_is_written_and_an_error_when_the_writer_fails(self):
        path = os.path.join(self.dir, "g.safetensors")
        specs = [("a", "F32", (1000,)), ("b", "F32", (500,))]
        w = tensorio.TensorWriter(path, specs, fsync=False)
        g = tensorio.Growing(w, {"round": 1})
        got, done = bytearray(), threading.Event()

        def read():
            try:
                for piece in g.follow():
                    got.extend(piece)
            except OSError as e:
                got.extend(b"!" + str(e).encode())
            done.set()
        t = threading.Thread(target=read)
        t.start()
        w.write("a", np.arange(1000, dtype=np.float32))
        g.advance(w.flushed())
        wait_for(lambda: len(got) == w.flushed(), 30)
        self.assertFalse(done.is_set())                         # b is not written: the reader waits
        g.fail("the merge stopped")
        t.join(30)
        self.assertTrue(got.endswith(b"the merge stopped"), got[-60:])
        w.abort()
        g.close()
