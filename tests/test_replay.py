"""outer_state.py and the aggregator's replay: a round in memory gives the file-to-file merge's
bits (fedmom_merge.merge_files + Publisher), a restart rebuilds theta, momentum and residual
from the checkpoint and the logged rounds bit for bit, a tampered log stops the start, and a
real fedmom_server SIGKILLed at every phase of a round ends with the uninterrupted run's bits."""
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import unittest

import numpy as np

import fedmom_client
import fedmom_merge
import fedmom_round
import fedmom_state as fs
import fixtures
import httpc
import outer_state
import tensorio
import testhooks
import wire
from testbed.harness import listening_url, wait_for

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the embedding is larger than fedmom_merge.CHUNK: the chunk loop and its threads run
SHAPES = {"embed": (300, 1000), "w": (256, 256), "b": (256,), "norm": (7,)}
SEGMENT_BYTES = 1 << 16       # checkpoint segments of 16,384 values: "w" is 4 of them, written one at a time



def setUpModule():
    os.environ[outer_state.SEGMENT_ENV] = str(SEGMENT_BYTES)     # in process and in every server started


def tearDownModule():
    os.environ.pop(outer_state.SEGMENT_ENV, None)

def write_f32(path, arrays):
    with tensorio.TensorWriter(path, [(k, "F32", a.shape) for k, a in arrays.items()], fsync=False) as w:
        for k, a in arrays.items():
            w.write(k, a)


def write_delta(path, arrays, fmt):
    """A site's delta: plain F32/BF16, or a wire format (int4, int8)."""
    if fmt in ("F32", "BF16"):
        with tensorio.TensorWriter(path, [(k, fmt, a.shape) for k, a in arrays.items()], fsync=False) as w:
            for k, a in arrays.items():
                w.write(k, a if fmt == "F32" else tensorio.f32_to_bf16(a))
    else:
        with wire.WireWriter(path, [(k, a.shape) for k, a in arrays.items()], wire.Codec(fmt), fsync=False) as w:
            for k, a in arrays.items():
                w.write(k, a)
    return path


def bits(arrays):
    """{name: the uint32 bits, flat} of a {name: float32 array} or a tensor file."""
    if isinstance(arrays, str):
        with tensorio.TensorReader(arrays) as r:
            return {n: r.read(n).reshape(-1).view(np.uint32).copy() for n in r.names}
    return {n: np.ascontiguousarray(a, np.float32).reshape(-1).view(np.uint32).copy() for n, a in arrays.items()}


class Case(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="replay-")
        self.addCleanup(shutil.rmtree, self.dir, True)
        self.rng = np.random.default_rng(7)
        self.init = os.path.join(self.dir, "init.safetensors")
        write_f32(self.init, {k: self.rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()})

    def assert_same_bits(self, want, got, what):
        want, got = bits(want), bits(got)
        self.assertEqual(sorted(want), sorted(got), what)
        for n in want:
            self.assertTrue(np.array_equal(want[n], got[n]), f"{what}: tensor {n} differs")

    def deltas(self, rnd, fmts=("int4", "F32")):
        """Round `rnd`'s deltas, the same bytes every time they are asked for."""
        rng = np.random.default_rng(1000 + rnd)
        out = []
        for i, fmt in enumerate(fmts):
            arrays = {k: (0.01 * rng.standard_normal(s)).astype(np.float32) for k, s in SHAPES.items()}
            out.append(write_delta(os.path.join(self.dir, f"d{rnd}-{i}.safetensors"), arrays, fmt))
        return out


class CoreTest(Case):
    """apply_round in memory == the file-to-file merge and Publisher, bit for bit."""

    def run_files(self, codec, mu, rounds, weights):
        prev, mom, res, out = self.init, None, None, []
        for r in range(1, rounds + 1):
            d = [(p, w) for p, w in zip(self.deltas(r, ("int4", "F32", "BF16")), weights)]
            t, m = os.path.join(self.dir, f"ft-{r}"), (os.path.join(self.dir, f"fm-{r}") if mu else None)
            u, rr = os.path.join(self.dir, f"fu-{r}"), os.path.join(self.dir, f"fr-{r}")
            sink = ((lambda specs, meta, prev=prev, res=res: fedmom_merge.Publisher(prev, res, codec, t, u, rr, meta,
                                                                                   fsync=False))
                    if codec else t)
            st = fedmom_merge.merge_files(prev, mom, d, sink, m, 0.7, mu, {"round": str(r)}, fsync=False, threads=1)
            out.append((t, m, codec and rr, codec and u, st))
            prev, mom, res = t, m, codec and rr
        return out

    def test_a_round_in_memory_is_the_file_merge_bit_for_bit(self):
        weights = [0.25, 0.5, 0.25]
        for codec in (wire.Codec("int4"), wire.Codec("int8", block=64), None):
            for mu in (0.9, 0.0):
                for threads in (1, 3):
                    what = f"down {codec and codec.fmt} momentum {mu} threads {threads}"
                    files = self.run_files(codec, mu, 3, weights)
                    state = outer_state.OuterState.load(self.init)
                    for r, (t, m, rr, u, st) in enumerate(files, start=1):
                        d = [(p, w) for p, w in zip(self.deltas(r, ("int4", "F32", "BF16")), weights)]
                        out_u = os.path.join(self.dir, f"mu-{r}")
                        got = outer_state.apply_round(state, outer_state.Step(r, d, 0.7, mu, r == 1, codec),
                                                      out_u if codec else None, {"round": str(r)}, fsync=False,
                                                      threads=threads)
                        self.assert_same_bits(t, state.theta, f"{what}, round {r}: theta")
                        if mu:
                            self.assert_same_bits(m, state.momentum, f"{what}, round {r}: momentum")
                        else:
                            self.assertIsNone(state.momentum)
                        if codec:
                            self.assert_same_bits(rr, state.residual, f"{what}, round {r}: residual")
                            with open(u, "rb") as a, open(out_u, "rb") as b:
                                self.assertEqual(a.read(), b.read(), f"{what}, round {r}: the update file")
                            self.assertEqual(got["published"]["digest"], st["published"]["digest"])
                            self.assertEqual(got["published"]["base_digest"], st["published"]["base_digest"])
                        self.assertEqual(state.digest, wire.theta_digest(t))
                        # the norms are reported, never merged: float32 dots per piece, summed in
                        # float64, so another cut of the tensor moves their last digits
                        self.assertAlmostEqual(got["theta_norm"], st["theta_norm"], delta=1e-5 * st["theta_norm"])
                        for a, b in zip(got["delta_norms"], st["delta_norms"]):
                            self.assertAlmostEqual(a, b, delta=1e-5 * b)

    def test_a_replay_checks_the_recorded_digest(self):
        state = outer_state.OuterState.load(self.init)
        steps = []
        for r in (1, 2, 3):
            s = outer_state.Step(r, [(p, 0.5) for p in self.deltas(r)], 0.7, 0.9, r == 1, wire.Codec("int4"))
            outer_state.apply_round(state, s, threads=2)
            s.digest = state.digest
            steps.append(s)
        again = outer_state.replay(outer_state.OuterState.load(self.init), steps, threads=1)
        self.assert_same_bits(state.theta, again.theta, "replayed theta")
        self.assert_same_bits(state.momentum, again.momentum, "replayed momentum")
        self.assert_same_bits(state.residual, again.residual, "replayed residual")
        steps[1] = outer_state.Step.from_json({**steps[1].to_json(), "lr": 0.69})   # another outer step
        with self.assertRaises(outer_state.ReplayMismatch) as cm:
            outer_state.replay(outer_state.OuterState.load(self.init), steps)
        self.assertIn("round 2 replayed to theta digest", str(cm.exception))
        with self.assertRaises(outer_state.ReplayMismatch):        # a gap in the log
            outer_state.replay(outer_state.OuterState.load(self.init), [steps[0], steps[2]])


class StateReplayTest(Case):
    """FedMomState in process: a restart after every round rebuilds the same arrays."""

    def state(self, **kw):
        cfg = fs.ServerConfig(os.path.join(self.dir, "st"), init=kw.pop("init", self.init), fsync=False,
                              down_wire="int4", **kw)
        return fs.FedMomState(cfg.validate(), clock=lambda: 1000.0)

    def send(self, st, rnd):
        for c, path in zip(("a", "b"), self.deltas(rnd)):
            st.join(c, f"{c}-inc")
            m = st.check_delta_meta({"cluster": c, "incarnation": f"{c}-inc", "tokens": 10 if c == "a" else 30,
                                     "base_round": st.round})
            part = st.spool.part()
            shutil.copyfile(path, part)
            st.accept_delta(m, part)

    def test_a_restart_after_any_round_rebuilds_the_same_bits_and_the_disk_stays_bounded(self):
        ref = self.state()
        arrays = []
        for r in range(1, 8):
            self.send(ref, r - 1)
            self.assertEqual(ref.tick()["round"], r)
            arrays.append(ref.outer.copy())
        del ref
        shutil.rmtree(os.path.join(self.dir, "st"))
        st = self.state(checkpoint_rounds=3)
        for r in range(1, 8):
            self.send(st, r - 1)
            self.assertEqual(st.tick()["round"], r)
            st = self.state(init=None, checkpoint_rounds=3)      # a restart after every round
            self.assertEqual(st.round, r)
            want = arrays[r - 1]
            for which in ("theta", "momentum", "residual"):
                self.assert_same_bits(getattr(want, which), getattr(st.outer, which), f"round {r}: {which}")
            self.assertEqual(st.ckpt["round"], r - r % 3)
            self.assertEqual([s.round for s in st.log], list(range(r - r % 3 + 1, r + 1)))
            spooled = [f for f in os.listdir(st.spool.dir) if f.endswith(".safetensors")]
            self.assertEqual(len(spooled), 2 * (r % 3), "the deltas of the logged rounds, no more")
            kept = [f["file"] for f in st.kept_files()]
            self.assertIn(st.ckpt["dir"] + "/", kept)
        self.assert_same_bits(want.theta, os.path.join(st.dir, st.theta_file), "theta written out")

    def test_a_checkpoint_cut_after_any_segment_rebuilds_the_same_bits(self):
        """Round 3's checkpoint written over round 0's segment by segment and cut after each of
        them in turn (a crash, a full disk): the segments hold two rounds, and the rebuild
        replays each from its own (round 0's hold theta alone, round 3's also momentum and
        residual) to the same bits; once all are written it replays nothing."""
        st = self.state(checkpoint_rounds=100)
        for r in (1, 2, 3):
            self.send(st, r - 1)
            st.tick()
        want, old = st.outer.copy(), st.ckpt
        n = len(outer_state.segments(st.outer.shapes, SEGMENT_BYTES, old["dir"]))
        self.assertEqual(n, 7, "embed, w in four segments, b, norm")
        for k in range(1, n + 1):
            fixtures.cut_checkpoint(self, st.outer, st.dir, old, files=k)
            got = outer_state.rebuild(st.dir, old, st.log, threads=2)
            for which in ("theta", "momentum", "residual"):
                self.assert_same_bits(getattr(want, which), getattr(got, which), f"cut after {k}: {which}")
            self.assertEqual((got.round, got.digest), (3, want.digest))
        record = dict(old, round=3, digest=want.digest)
        again = outer_state.rebuild(st.dir, record, [], threads=1)
        self.assert_same_bits(want.residual, again.residual, "the finished checkpoint, nothing replayed")

    def test_a_changed_checkpoint_stops_the_start_and_export(self):
        st = self.state(checkpoint_rounds=2)
        for r in (1, 2, 3):
            self.send(st, r - 1)
            st.tick()
        self.assertEqual((st.ckpt["round"], [s.round for s in st.log]), (2, [3]))
        path = os.path.join(st.dir, outer_state.checkpoint_files(st.dir, st.ckpt)[0])   # embed's segment
        with tensorio.TensorReader(path) as r:
            arrays, meta = {n: r.read(n).copy() for n in r.names}, dict(r.metadata)
        self.assertEqual(meta["tensor"], "embed")
        arrays["momentum"][:100] *= 2                              # round 3 would step from another momentum
        with tensorio.TensorWriter(path, [(k, "F32", a.shape) for k, a in arrays.items()], meta, fsync=False) as w:
            for k, a in arrays.items():
                w.write(k, a)
        with self.assertRaises(SystemExit) as cm:
            self.state(init=None, checkpoint_rounds=2)
        self.assertIn("round 3 replayed to theta digest", str(cm.exception))
        out = subprocess.run([sys.executable, "fedmom_server.py", "export", "--state-dir", st.dir,
                              os.path.join(self.dir, "out.safetensors")], cwd=ROOT, capture_output=True, text=True,
                             timeout=120)
        self.assertEqual(out.returncode, 1, out.stdout + out.stderr)
        self.assertIn("cannot be rebuilt", out.stderr)
        self.assertFalse(os.path.exists(os.path.join(self.dir, "out.safetensors")))

    def test_export_and_checkpoint_of_a_stopped_state_dir(self):
        st = self.state(checkpoint_rounds=4)
        for r in (1, 2, 3):
            self.send(st, r - 1)
            st.tick()
        want = st.outer.copy()
        run = lambda *a: subprocess.run([sys.executable, "fedmom_server.py", *a, "--state-dir", st.dir], cwd=ROOT,
                                        capture_output=True, text=True, timeout=120)
        out = run("export", os.path.join(self.dir, "t.safetensors"), "--momentum", os.path.join(self.dir, "m"),
                  "--residual", os.path.join(self.dir, "r"))
        self.assertEqual(out.returncode, 0, out.stdout + out.stderr)
        self.assertIn(f"theta digest {want.digest}", out.stdout)
        for which, fn in (("theta", "t.safetensors"), ("momentum", "m"), ("residual", "r")):
            self.assert_same_bits(getattr(want, which), os.path.join(self.dir, fn), f"exported {which}")
        out = run("checkpoint")
        self.assertEqual(out.returncode, 0, out.stdout + out.stderr)
        with open(os.path.join(st.dir, "state.json")) as f:
            saved = json.load(f)
        self.assertEqual((saved["checkpoint"]["round"], saved["log"]), (3, []))
        self.assertEqual(sorted(os.listdir(st.dir)), sorted(["lock", saved["checkpoint"]["dir"], "rounds.jsonl", "spool",
                                                             "state.json", "update-3.safetensors"]))
        for fn in outer_state.checkpoint_files(st.dir, saved["checkpoint"]):
            with tensorio.TensorReader(os.path.join(st.dir, fn)) as r:
                self.assertEqual((r.metadata["round"], r.names), ("3", ["theta", "momentum", "residual"]), fn)
        self.assertEqual(os.listdir(st.spool.dir), [])
        again = self.state(init=None)                         # and a restart from it: the same bits
        for which in ("theta", "momentum", "residual"):
            self.assert_same_bits(getattr(want, which), getattr(again.outer, which), f"after checkpoint: {which}")

    def test_a_tampered_logged_delta_stops_the_start(self):
        st = self.state()
        for r in (1, 2):
            self.send(st, r - 1)
            st.tick()
        path = os.path.join(st.dir, st.log[0].deltas[1][0])          # round 1's F32 delta, one value changed
        with tensorio.TensorReader(path) as r:
            arrays = {n: r.read(n).copy() for n in r.names}
        arrays["norm"][0] += 1.0
        write_f32(path, arrays)
        with self.assertRaises(SystemExit) as cm:
            self.state(init=None)
        self.assertIn("cannot be rebuilt from the checkpoint of round 0", str(cm.exception))
        self.assertIn("round 1 replayed to theta digest", str(cm.exception))


class KillTest(Case):
    """A real fedmom_server --down-wire int4 --checkpoint-rounds 2, SIGKILLed at each phase of a
    round and restarted: the run ends with the uninterrupted run's theta, momentum and residual."""
    ROUNDS = 5
    # (fault point, times passed before it stops, base round): rounds 2 and 4 are checkpoints
    PHASES = [("fedmom.spooled", 0, 2), ("fedmom.merge", 1, 3), ("fedmom.merge", 3, 2),
              ("fedmom.round_durable", 0, 3), ("fedmom.checkpoint", 0, 1), ("fedmom.checkpoint", 1, 3),
              ("fedmom.unlink", 0, 3)]

    def start(self, sd, faults, init=True):
        # the round and the replay on two worker processes (fedmom_merge.py), however small the model
        env = {**os.environ, testhooks.FAULT_DIR_ENV: faults, fedmom_merge.MIN_ENV: "0"}
        cmd = [sys.executable, "fedmom_server.py", "--state-dir", sd, "--port", "0", "--down-wire", "int4",
               "--checkpoint-rounds", "2", "--threads", "2", "--merge-procs", "2"] + (["--init", self.init] if init else [])
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.addCleanup(lambda: proc.poll() is None and (proc.kill(), proc.wait(30)))
        url, self.out = listening_url(proc, timeout=120)
        return proc, url

    def send_round(self, url, rnd):
        for c, path in zip(("a", "b"), self.deltas(rnd)):
            fedmom_client.FedMomClient(url, c, f"{c}-inc").send_delta(path, rnd, 10 if c == "a" else 30, [], {})

    def final_state(self, sd):
        cfg = fs.ServerConfig(sd, down_wire="int4", checkpoint_rounds=2, fsync=False).validate()
        return fs.FedMomState(cfg, clock=lambda: 1000.0).outer

    def run_to_end(self, name, point=None, skip=0, at_round=None):
        sd, faults = os.path.join(self.dir, name), os.path.join(self.dir, name + "-faults")
        os.makedirs(faults)
        proc, url = self.start(sd, faults)
        for c in ("a", "b"):
            fedmom_client.FedMomClient(url, c, f"{c}-inc").join()
        for rnd in range(self.ROUNDS):
            arm = os.path.join(faults, point or "-")
            if rnd == at_round:
                with open(arm, "w") as f:
                    f.write(str(skip))
            sender = threading.Thread(target=self._send_quietly, args=(url, rnd), daemon=True)
            sender.start()
            if rnd == at_round:
                self.assertTrue(wait_for(lambda: os.path.exists(arm + ".hit"), 120),
                                f"{point} never reached; the server said:\n" + self.out.text()[-3000:])
                proc.send_signal(signal.SIGKILL)
                proc.wait(30)
                sender.join(120)
                os.unlink(arm)
                proc, url = self.start(sd, faults, init=False)
                try:                                 # what was not accepted is sent again; duplicates answer as such
                    self.send_round(url, rnd)
                except fedmom_client.StaleRound:     # killed after the round was durable: nothing to resend
                    pass
            else:
                sender.join(120)
            got = fedmom_client.FedMomClient(url, "a", "a-inc").wait_round_after(rnd, timeout_s=120)
            self.assertEqual(got, rnd + 1, f"{name}: round {rnd} did not merge; the server said:\n"
                             + self.out.text()[-3000:])
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        return self.final_state(sd)

    def _send_quietly(self, url, rnd):
        try:
            self.send_round(url, rnd)
        except (httpc.CallError, OSError, ConnectionError, Exception):
            pass                                      # the server was killed under it: sent again after the restart

    def test_a_sigkill_at_every_phase_of_a_round_ends_with_the_same_bits(self):
        want = self.run_to_end("uninterrupted")
        for point, skip, rnd in self.PHASES:
            name = f"{point.split('.')[1]}-{skip}-r{rnd}"
            with self.subTest(name):
                got = self.run_to_end(name, point, skip, rnd)
                for which in ("theta", "momentum", "residual"):
                    self.assert_same_bits(getattr(want, which), getattr(got, which), f"{name}: {which}")
                with open(os.path.join(self.dir, name, "state.json")) as f:
                    st = json.load(f)
                self.assertEqual(st["round"], self.ROUNDS)
                self.assertEqual(st["checkpoint"]["round"], 4)


# A rebuild that fails must never leave its half-merged arrays in use: a rebuild failing after
# a failed merge must not let GET /theta write them out as the durable round's theta, and one
# failing for any reason (fedmom_merge.NonFinite too) sets replay_error: merges stop, the alarm
# shows, and a start with that log ends in the "cannot be rebuilt" refusal, not a traceback.
class RebuildCase(unittest.TestCase):
    """A rebuild that fails (schedules in the comment above FailedRebuildTest)."""
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
        part = st.spool.part()
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


class FailedRebuildTest(RebuildCase):
    """The schedules name the methods as they were when found: FedMomState's _merge, _rebuild and
    _written are now outer_state.OuterKeeper's merge, rebuild and copy."""

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
        except fedmom_round.Refused:
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


class DirtyMergeTest(RebuildCase):
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
