"""A review of the fused round (outer_state.apply_round) and the checkpoint in segments
(outer_state.py): each test is a schedule or an input that breaks one of their
promises, with real files and processes (fedmom_server.py's offline commands).

  - a checkpoint written at the round its segment directory is named for, with another
    segment size (PWW_TEST_SEGMENT_BYTES, or a SEGMENT_BYTES changed between versions),
    removes the last checkpoint's segments before the new ones exist: cut short, the
    state dir holds no checkpoint at all (SegmentDirectoryTest);
  - apply_round that raises while the pool's spans still run (a damaged delta, found
    by its decode) returns while they go on writing the arrays (ApplyRoundRaiseTest);
  - apply_round with a wire.Codec("f32") update writes an update of zeros (latent: the
    server passes None for --down-wire f32) (F32CodecTest);
  - a checkpoint directory that is gone stops the rebuild with "min() arg is an empty
    sequence", naming neither the directory nor the fix (MissingCheckpointTest);
  - a segment is SEGMENT_BYTES per array at most, say the docstring and RUNBOOK (the disk
    "one segment, 3 x 64 MiB, more"), but a row pair of an odd last dimension joined to
    TOPK_ALIGN, or a 1-D tensor, is one segment of any size (SegmentSizeTest).
"""
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import unittest

import numpy as np

import fedmom_merge
import fedmom_state as fs
import fixtures
import outer_state
import tensorio
import wire

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = {"w": (256, 256), "e": (64, 300), "b": (256,)}


def write_f32(path, arrays):
    with tensorio.TensorWriter(path, [(k, "F32", a.shape) for k, a in arrays.items()], fsync=False) as w:
        for k, a in arrays.items():
            w.write(k, a)
    return path


def same_bits(a, b):
    return sorted(a) == sorted(b) and all(np.array_equal(np.asarray(a[n], np.float32).reshape(-1).view(np.uint32),
                                                         np.asarray(b[n], np.float32).reshape(-1).view(np.uint32))
                                          for n in a)


class Case(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="replay-review-")
        self.addCleanup(shutil.rmtree, self.dir, True)
        self.rng = np.random.default_rng(11)
        self.init = write_f32(os.path.join(self.dir, "init.safetensors"),
                              {k: self.rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()})
        self.seg = os.environ.get(outer_state.SEGMENT_ENV)
        self.addCleanup(self.restore_env)

    def restore_env(self):
        if self.seg is None:
            os.environ.pop(outer_state.SEGMENT_ENV, None)
        else:
            os.environ[outer_state.SEGMENT_ENV] = self.seg

    def state(self, **kw):
        cfg = fs.ServerConfig(os.path.join(self.dir, "st"), init=kw.pop("init", self.init), fsync=False,
                              down_wire="int4", checkpoint_rounds=100, **kw)
        return fs.FedMomState(cfg.validate(), clock=lambda: 1000.0)

    def rounds(self, st, n):
        for _ in range(n):
            for c in ("a", "b"):
                st.join(c, f"{c}-inc")
                path = write_f32(os.path.join(self.dir, f"d-{st.round}-{c}"),
                                 {k: (0.01 * self.rng.standard_normal(s)).astype(np.float32)
                                  for k, s in SHAPES.items()})
                meta = st.check_delta_meta({"cluster": c, "incarnation": f"{c}-inc", "tokens": 10,
                                            "base_round": st.round})
                part = st.spool.part()
                shutil.copyfile(path, part)
                st.accept_delta(meta, part)
            st.tick()


class SegmentDirectoryTest(Case):
    """write_checkpoint's promise: "A `last` of another layout (whole files, other segments)
    is left as it is and the segments go to a new directory". The new directory is named
    ckpt-<round>; when the last checkpoint's directory has that very name (it was first
    written at this round), write_checkpoint takes it for one "left by a layout change cut
    short" and unlinks every segment of the checkpoint state.json names, then writes the
    new ones there one by one: a crash, a full disk or a file-size limit in between leaves
    the state dir with no checkpoint, and the log that could replay one was emptied by the
    checkpoint before (fedmom_server.py checkpoint)."""

    def test_a_checkpoint_at_its_directorys_round_with_another_segment_size_keeps_the_last_one(self):
        os.environ[outer_state.SEGMENT_ENV] = str(1 << 16)
        outer = outer_state.init_outer(self.init)
        last = outer_state.write_checkpoint(outer, self.dir, None, fsync=False)
        self.assertEqual((last["dir"], last["round"]), ("ckpt-0", 0))
        os.environ[outer_state.SEGMENT_ENV] = str(1 << 17)     # another segment size, the same round
        fixtures.cut_checkpoint(self, outer, self.dir, last, files=1)   # a crash after the first new segment
        try:
            got = outer_state.rebuild(self.dir, last, [], threads=1)
        except ValueError as e:
            self.fail(f"the checkpoint state.json still names was destroyed by the one cut short: {e}")
        self.assertTrue(same_bits(outer.theta, got.theta))

    def test_an_offline_checkpoint_cut_short_leaves_the_state_dir_it_found(self):
        # Schedule: a state dir at round 2 (its checkpoint round 0's, 2 rounds logged);
        # `fedmom_server.py checkpoint` (segments of 32 KiB) makes round 2 the checkpoint, in
        # ckpt-2/, and empties the log; the same command again with 1 MiB segments (as after
        # an upgrade that changes SEGMENT_BYTES) under a 200 KiB file-size limit, so that its
        # first segment fails (EFBIG, as a full disk would). It unlinked ckpt-2's segments first:
        # `export` can no longer rebuild round 2.
        os.environ[outer_state.SEGMENT_ENV] = str(1 << 16)
        st = self.state()
        self.rounds(st, 2)
        want = st.outer.digest
        sd = st.dir
        del st

        def run(seg, *args, limit=None):
            env = {**os.environ, outer_state.SEGMENT_ENV: str(seg)}
            pre = (lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))) if limit else None
            return subprocess.run([sys.executable, "fedmom_server.py", *args, "--state-dir", sd], cwd=ROOT, env=env,
                                  capture_output=True, text=True, timeout=120, preexec_fn=pre)
        out = run(1 << 15, "checkpoint")
        self.assertEqual(out.returncode, 0, out.stdout + out.stderr)
        with open(os.path.join(sd, "state.json")) as f:
            self.assertEqual(json.load(f)["checkpoint"]["dir"], "ckpt-2")
        out = run(1 << 20, "checkpoint", limit=200 << 10)
        self.assertNotEqual(out.returncode, 0, "the file-size limit was to stop the second checkpoint")
        out = run(1 << 15, "export", os.path.join(self.dir, "theta.safetensors"))
        self.assertEqual(out.returncode, 0, "a checkpoint that failed lost the state dir's round 2: "
                         + out.stdout + out.stderr)
        self.assertIn(f"theta digest {want}", out.stdout)


class ApplyRoundRaiseTest(unittest.TestCase):
    """apply_round's promise: "nothing is written after apply_round returns or raises". A piece
    that raises (here a damaged int8 delta whose decode finds code -128 in the first piece;
    fedmom_merge.DeltaReader.read raises WireError) ends wire.run_spans at the first
    failed future while the other spans still run on the pool: apply_round closes its readers
    and raises, and those spans go on writing theta (and the momentum) for a whole span each."""

    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="replay-review-")
        self.addCleanup(shutil.rmtree, self.dir, True)

    def test_no_span_writes_theta_after_apply_round_raised(self):
        shape = (4096, 1024)                     # 64 pieces of fedmom_merge.STEP: 4 spans of the pool
        rng = np.random.default_rng(3)
        bad = os.path.join(self.dir, "bad.safetensors")
        with wire.WireWriter(bad, [("big", shape)], wire.Codec("int8"), fsync=False) as w:
            w.write("big", (0.01 * rng.standard_normal(shape)).astype(np.float32))
        with tensorio.TensorReader(bad) as r:
            start = r.span("big")[0]
        with open(bad, "r+b") as f:               # code -128 at element 0: the first piece's decode fails
            f.seek(start)
            f.write(b"\x80")
        deltas = [(bad, 0.2)]
        for i in range(4):                        # int8 too: their parts stay in memory, so the spans
            p = os.path.join(self.dir, f"d{i}.safetensors")      # left running are not stopped by the
            with wire.WireWriter(p, [("big", shape)], wire.Codec("int8"), fsync=False) as w:    # closed files
                w.write("big", (0.01 * rng.standard_normal(shape)).astype(np.float32))
            deltas.append((p, 0.2))
        theta = rng.standard_normal(shape).astype(np.float32).reshape(-1)
        state = outer_state.OuterState({"big": shape}, {"big": theta})
        with self.assertRaises(wire.WireError):
            outer_state.apply_round(state, outer_state.Step(1, deltas, 0.7, 0.9, True, None), threads=2)
        self.assertTrue(state.dirty)
        tail = slice(3 * theta.size // 4, theta.size)             # the last span's elements
        at_raise = state.theta["big"][tail].copy()
        gate = threading.Barrier(2)               # two spans that meet: both threads of the pool are free
        wire.run_spans(lambda a, b: gate.wait(), 2, 1, wire.TASK, 2)
        changed = int(np.count_nonzero(state.theta["big"][tail].view(np.uint32) != at_raise.view(np.uint32)))
        self.assertEqual(changed, 0, f"{changed} values of theta were written after apply_round raised")


class F32CodecTest(unittest.TestCase):
    """apply_round with a wire.Codec("f32") update (latent: ServerConfig.down_codec gives None
    for --down-wire f32): publish_whole takes Codec.encode's parts, whose f32 part IS x, then
    subtracts sent (also x) from x in place: the update file written behind is all zeros and
    the residual too, where Publisher writes x."""

    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="replay-review-")
        self.addCleanup(shutil.rmtree, self.dir, True)

    def test_an_f32_update_holds_the_step(self):
        p = lambda n: os.path.join(self.dir, n)
        init = write_f32(p("init"), {"a": np.arange(20, dtype=np.float32).reshape(4, 5)})
        delta = write_f32(p("d"), {"a": np.ones((4, 5), np.float32)})
        codec = wire.Codec("f32")
        state = outer_state.OuterState.load(init)
        outer_state.apply_round(state, outer_state.Step(1, [(delta, 1.0)], 0.7, 0.9, True, codec), p("u-fused"),
                                {"round": "1"}, fsync=False, threads=1)
        fedmom_merge.merge_files(init, None, [(delta, 1.0)],
                                 lambda specs, meta: fedmom_merge.Publisher(init, None, codec, p("t"), p("u-ref"),
                                                                            p("r"), meta, fsync=False),
                                 None, 0.7, 0.9, {"round": "1"}, fsync=False, threads=1)
        with tensorio.TensorReader(p("u-ref")) as a, tensorio.TensorReader(p("u-fused")) as b:
            self.assertTrue(same_bits({"a": a.read("a")}, {"a": b.read("a")}),
                            f"the update written holds {b.read('a').reshape(-1)[:4]}, the step is "
                            f"{a.read('a').reshape(-1)[:4]}")


class MissingCheckpointTest(Case):
    """A state dir whose checkpoint directory is gone (a restore that missed it, an operator's
    rm): _load_segments derives the model's shapes from the segments it finds, so none is
    "the model's" too, and rebuild ends in min() of nothing. The message should name the
    directory state.json names (the conventions: readers fail with a hint)."""

    def test_a_missing_checkpoint_directory_is_named(self):
        os.environ[outer_state.SEGMENT_ENV] = str(1 << 16)
        st = self.state()
        self.rounds(st, 1)
        sd, d = st.dir, st.ckpt["dir"]
        del st
        shutil.rmtree(os.path.join(sd, d))
        with self.assertRaises(ValueError) as cm:
            outer_state.load_outer(sd, threads=1)
        self.assertIn(d, str(cm.exception), "the error names the checkpoint that is missing")


class SegmentSizeTest(unittest.TestCase):
    """outer_state.segments: "a run of its whole rows (SEGMENT_BYTES of fp32 each at
    most)". Its unit is lcm(2 x cols, TOPK_ALIGN) for an odd last dimension, the whole tensor
    for a 1-D one: a (768, 50257) tensor (a vocabulary of 50,257 as the last dimension) is one
    segment of 147 MiB per array, so the checkpoint's extra disk is 3 x that, not 3 x 64 MiB."""

    def test_a_segment_is_segment_bytes_at_most_but_for_the_units_the_docstring_names(self):
        """The rule as documented: even last dimensions (every large tensor of Qwen3) keep to
        SEGMENT_BYTES; a 1-D tensor and an odd last dimension whose unit exceeds it are one
        segment, and segments() and the RUNBOOK say so."""
        for shape in ((151936, 1024), (9728, 1024), (1024, 3072), (4096, 25600)):
            segs = outer_state.segments({"x": shape}, outer_state.SEGMENT_BYTES, "ckpt-0")
            largest = max(hi - lo for _, _, lo, hi in segs) * 4
            self.assertLessEqual(largest, outer_state.SEGMENT_BYTES, f"{shape}: {largest / 2**20:.0f} MiB")
        for shape in ((768, 50257), (100_000_001,)):
            segs = outer_state.segments({"x": shape}, outer_state.SEGMENT_BYTES, "ckpt-0")
            self.assertEqual(len(segs), 1, f"{shape}: one unit, one segment")
        self.assertIn("a 1-D tensor is one segment", outer_state.segments.__doc__)


if __name__ == "__main__":
    unittest.main()
