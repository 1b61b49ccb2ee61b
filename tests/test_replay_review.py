"""Fault schedules that break the outer state in memory (outer_state.py, FedMomState._rebuild and
open_theta): each test names its schedule and fails while the problem stands.

  - a rebuild that fails after a failed merge leaves the half-merged arrays in memory, and
    GET /theta writes them out and serves them as the durable round's theta;
  - a rebuild that fails with an exception _rebuild does not list (fedmom_merge.NonFinite, an
    ArithmeticError) sets no replay_error: no alarm, the next merge runs over the half-merged
    arrays and makes a wrong round durable, and a start with that log ends in a traceback
    instead of the "cannot be rebuilt" refusal;
"""
import os
import shutil
import subprocess
import tempfile
import unittest

import numpy as np

import fedmom_merge
import fedmom_state as fs
import tensorio
import wire
from test_replay import SHAPES, write_delta, write_f32

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Case(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="replay-review-")
        self.addCleanup(shutil.rmtree, self.dir, True)
        rng = np.random.default_rng(7)
        self.init = os.path.join(self.dir, "init.safetensors")
        write_f32(self.init, {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()})
        self.clock = [1000.0]

    def state(self, **kw):
        cfg = fs.ServerConfig(os.path.join(self.dir, "st"), init=kw.pop("init", self.init), fsync=False,
                              down_wire="int4", clip_factor=0, checkpoint_rounds=4, **kw)
        return fs.FedMomState(cfg.validate(), clock=lambda: self.clock[0])

    def delta(self, name, value=None, seed=0):
        """A small F32 delta; value: tensor "w" set to it (3e38 overflows the outer step)."""
        rng = np.random.default_rng(1000 + seed)
        arrays = {k: (0.01 * rng.standard_normal(s)).astype(np.float32) for k, s in SHAPES.items()}
        if value is not None:
            arrays["w"][:] = value
        return write_delta(os.path.join(self.dir, name), arrays, "F32")

    def send(self, st, cluster, path, tokens):
        st.join(cluster, f"{cluster}-inc")
        meta = st.check_delta_meta({"cluster": cluster, "incarnation": f"{cluster}-inc", "tokens": tokens,
                                    "base_round": st.round})
        part = st.new_part_path()
        shutil.copyfile(path, part)
        st.accept_delta(meta, part)

    def round_one_logged(self):
        """Round 1 merged and logged (the checkpoint is round 0's): -> (state, round 1's digest)."""
        st = self.state()
        self.send(st, "a", self.delta("a0", seed=1), 10)
        self.send(st, "b", self.delta("b0", seed=2), 10)
        self.assertEqual(st.tick()["round"], 1)
        self.assertEqual((st.ckpt["round"], [s.round for s in st.log]), (0, [1]))
        return st, st.log[-1].digest

    def overflowing_round(self, st):
        """Round 2: a's delta overflows tensor "w" (NonFinite, after "embed" was merged in place)."""
        self.send(st, "a", self.delta("a1", 3e38, seed=3), 1000)
        self.send(st, "b", self.delta("b1", seed=4), 10)
        self.assertIsNone(st.tick(), "the round cannot merge")
        self.assertEqual(st.round, 1)


class FailedRebuildTest(Case):
    def test_a_failed_rebuild_never_serves_the_half_merged_arrays_as_the_durable_theta(self):
        # Schedule: round 1 durable and logged; its delta a becomes unreadable (lost with a disk
        # error; here: removed); round 2's merge raises NonFinite at tensor "w" after merging
        # "embed" in place; _merge's _rebuild fails (FileNotFoundError: replay_error set), and so
        # does _merge_and_finish's; then GET /theta (open_theta). _written writes self.outer (still
        # dirty, half of round 2) as theta-1 and serves it as round 1: fedmom_state.py _written /
        # open_theta never look at outer.dirty or replay_error.
        st, digest1 = self.round_one_logged()
        os.unlink(os.path.join(st.dir, st.log[0].deltas[0][0]))
        self.overflowing_round(st)
        self.assertIsNotNone(st.replay_error)
        try:
            f, rnd = st.open_theta()
        except fs.Refused:
            return                                   # refusing to serve is a right answer
        f.close()
        served = wire.theta_digest(os.path.join(st.dir, f"theta-{rnd}.safetensors"))
        self.assertEqual((rnd, served), (1, digest1),
                         "GET /theta served a theta that is not round 1's (the half-merged arrays of round 2)")

    def test_a_rebuild_that_overflows_stops_the_merges_and_raises_the_alarm(self):
        # Schedule: round 1 durable and logged; its F32 delta b damaged on disk so that the replay
        # overflows (its exponent bits flipped: Inf in tensor "w"; same size, so nothing notices at
        # a start); round 2's merge raises NonFinite; _merge's _rebuild replays round 1, which raises
        # fedmom_merge.NonFinite (an ArithmeticError), not in _rebuild's except list
        # (ReplayMismatch, OSError, ValueError, FormatError): replay_error stays None, the
        # _merge_and_finish fallback swallows it (except Exception: pass), and self.outer stays
        # dirty. Nothing stops the next merge from running over the half-merged arrays (_ready and
        # apply_round never look at outer.dirty); /status shows no REPLAY alarm.
        st, digest1 = self.round_one_logged()
        path = os.path.join(st.dir, st.log[0].deltas[1][0])
        with tensorio.TensorReader(path) as r:
            arrays = {n: r.read(n).copy() for n in r.names}
        arrays["w"].reshape(-1)[0] = np.inf
        write_f32(path, arrays)
        self.overflowing_round(st)
        self.assertTrue(st.outer.dirty, "the arrays are half merged")
        self.assertIsNotNone(st.replay_error, "a rebuild that failed: the merges must stop and /status must say so")

    def test_a_logged_round_that_overflows_on_replay_stops_the_start_with_its_reason(self):
        # Schedule: as above (a logged delta damaged so that its replay overflows), then a restart.
        # _rebuild(at_start=True) turns ReplayMismatch/OSError/ValueError into the one-line
        # SystemExit "cannot be rebuilt ... restore the state dir from a backup"; NonFinite escapes
        # as a traceback out of FedMomState.__init__ (and out of fedmom_server.py export).
        st, _ = self.round_one_logged()
        path = os.path.join(st.dir, st.log[0].deltas[1][0])
        with tensorio.TensorReader(path) as r:
            arrays = {n: r.read(n).copy() for n in r.names}
        arrays["w"].reshape(-1)[0] = np.inf
        write_f32(path, arrays)
        del st
        try:
            self.state(init=None)
        except SystemExit as e:
            self.assertIn("cannot be rebuilt", str(e))
        except fedmom_merge.NonFinite as e:
            self.fail(f"the start ended in a traceback ({type(e).__name__}: {e}), not the 'cannot be rebuilt' "
                      "refusal")
        else:
            self.fail("the start replayed a log that overflows")


class DirtyMergeTest(Case):
    """The state dir on a real 16 MiB tmpfs (root): a full disk at the update's write."""

    def setUp(self):
        super().setUp()
        self.disk = os.path.join(self.dir, "disk")
        os.makedirs(self.disk)
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", self.disk], capture_output=True,
                           text=True)
        if r.returncode:
            self.skipTest(f"cannot mount a tmpfs ({r.stderr.strip()}); run as root")
        self.addCleanup(subprocess.run, ["umount", "-l", self.disk])

    def test_a_merge_never_runs_over_the_arrays_of_a_failed_merge(self):
        # Schedule: round 1 durable and logged, its delta b damaged so that its replay overflows
        # (Inf in tensor "w"); round 2 ready; the disk fills, so apply_round's update write fails
        # after "embed" was merged in place (outer.dirty); _merge_and_finish's _rebuild raises
        # NonFinite, swallowed (replay_error None); space returns, the retry 30 s later runs
        # apply_round over the half-merged arrays and makes round 2 durable with a theta no
        # uninterrupted run has (its digest recorded as if right), published to every site.
        want = self.state()                          # the uninterrupted run, elsewhere
        self.send(want, "a", self.delta("a0", seed=1), 10)
        self.send(want, "b", self.delta("b0", seed=2), 10)
        self.assertEqual(want.tick()["round"], 1)
        self.send(want, "a", self.delta("a1", seed=3), 10)
        self.send(want, "b", self.delta("b1", seed=4), 10)
        self.assertEqual(want.tick()["round"], 2)
        st = fs.FedMomState(fs.ServerConfig(os.path.join(self.disk, "st"), init=self.init, fsync=False,
                                            down_wire="int4", clip_factor=0, checkpoint_rounds=4).validate(),
                            clock=lambda: self.clock[0])
        self.send(st, "a", self.delta("a0", seed=1), 10)
        self.send(st, "b", self.delta("b0", seed=2), 10)
        self.assertEqual(st.tick()["round"], 1)
        path = os.path.join(st.dir, st.log[0].deltas[1][0])
        with tensorio.TensorReader(path) as r:
            arrays = {n: r.read(n).copy() for n in r.names}
        arrays["w"].reshape(-1)[0] = np.inf
        write_f32(path, arrays)
        self.send(st, "a", self.delta("a1", seed=3), 10)
        self.send(st, "b", self.delta("b1", seed=4), 10)
        free = os.statvfs(self.disk)
        filler = os.path.join(self.disk, "filler")
        with open(filler, "wb") as f:
            f.write(b"\0" * max(0, free.f_bavail * free.f_frsize - (8 << 10)))
        self.assertIsNone(st.tick())
        self.assertIn("No space left", st.merge_error)
        os.unlink(filler)
        self.clock[0] += 31
        rec = st.tick()
        if rec is None:                              # refusing to merge over them is a right answer
            return
        self.assertEqual(st.outer.digest, want.outer.digest,
                         "round 2 was made durable from the half-merged arrays of its failed first try")




if __name__ == "__main__":
    unittest.main()
