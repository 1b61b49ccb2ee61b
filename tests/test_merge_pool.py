"""merge_pool.py: a round on worker processes over shared memory gives the bits of one thread
(every codec, mixed delta formats, momentum 0 and 0.9, a replay of segments of two rounds);
a worker killed mid-round fails the round loudly and the next one runs on new workers; the
shared blocks are removed when let go, at exit, and after a SIGKILL by the next start."""
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import unittest

import numpy as np

import fedmom_checkpoint
import merge_pool
import outer_state
import tensorio
import testhooks
import wire
from harness import wait_for

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# odd last dimensions, a ragged int4 row, a 1-D tensor, a scalar-like one, several pieces each
SHAPES = {"embed": (700, 320), "w": (96, 131), "b": (1001,), "one": (1,), "big": (256, 768)}
HANG_S = 120


def bits(arrays):
    return {n: np.ascontiguousarray(a, np.float32).reshape(-1).view(np.uint32).copy() for n, a in arrays.items()}


class Case(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="pool-")
        self.addCleanup(shutil.rmtree, self.dir, True)
        self.rng = np.random.default_rng(3)
        self.theta = {n: self.rng.standard_normal(int(np.prod(s))).astype(np.float32) for n, s in SHAPES.items()}

    def pool(self, procs):
        pool = merge_pool.Pool(procs, outer_state.worker_argv())
        self.addCleanup(pool.close)
        return pool

    def delta(self, rnd, i, fmt):
        rng = np.random.default_rng([rnd, i])
        arrays = {n: (0.01 * rng.standard_normal(s)).astype(np.float32) for n, s in SHAPES.items()}
        path = os.path.join(self.dir, f"d{rnd}-{i}-{fmt}.safetensors")
        codec = {"int4": wire.Codec("int4"), "int8": wire.Codec("int8", block=64), "topk": wire.Codec("topk"),
                 "bf16": wire.Codec("bf16"), "f32": wire.Codec("f32"), "int2": wire.Codec("int2")}[fmt]
        with wire.WireWriter(path, list(SHAPES.items()), codec, {}, fsync=False, threads=1) as w:
            for n, a in arrays.items():
                w.write(n, a)
        return path

    def step(self, rnd, codec, mu=0.9, fresh=None):
        ds = [(self.delta(rnd, 0, "int4"), 0.4), (self.delta(rnd, 1, "int8"), 0.3), (self.delta(rnd, 2, "bf16"), 0.2),
              (self.delta(rnd, 3, "int2"), 0.1)]
        return outer_state.Step(rnd, ds, 0.7, mu, rnd == 1 if fresh is None else fresh, codec)

    def assert_same(self, a, b, what):
        for which in ("theta", "momentum", "residual"):
            x, y = getattr(a, which), getattr(b, which)
            self.assertEqual(x is None, y is None, f"{what}: {which}")
            if x is not None:
                bx, by = bits(x), bits(y)
                for n in SHAPES:
                    self.assertTrue(np.array_equal(bx[n], by[n]), f"{what}: {which} of {n} differs")
        self.assertEqual(a.digest, b.digest, what)


class BitsTest(Case):
    def test_a_round_on_workers_is_the_round_in_one_thread_bit_for_bit(self):
        pool = self.pool(3)
        for codec in (wire.Codec("int4"), wire.Codec("int8", block=64), None, wire.Codec("topk"), wire.Codec("int2")):
            for mu in (0.9, 0.0):
                what = f"down {codec and codec.fmt}, momentum {mu}"
                one = outer_state.OuterState(SHAPES, {n: a.copy() for n, a in self.theta.items()})
                many = outer_state.OuterState(SHAPES, {n: a.copy() for n, a in self.theta.items()})
                for rnd in (1, 2, 3):
                    s = self.step(rnd, codec, mu)
                    u1, u2 = os.path.join(self.dir, "u1"), os.path.join(self.dir, "u2")
                    got1 = outer_state.apply_round(one, s, u1 if codec else None, fsync=False, threads=1)
                    got2 = outer_state.apply_round(many, s, u2 if codec else None, fsync=False, threads=1, pool=pool)
                    self.assert_same(one, many, f"{what}, round {rnd}")
                    if codec:
                        with open(u1, "rb") as f1, open(u2, "rb") as f2:
                            self.assertEqual(f1.read(), f2.read(), f"{what}, round {rnd}: the update file")
                    self.assertAlmostEqual(got1["theta_norm"], got2["theta_norm"], delta=1e-9 * got1["theta_norm"])
                if codec is None or codec.fmt in wire.LEVELS:
                    self.assertIsInstance(many.theta, merge_pool.SharedArrays, what)

    def test_a_replay_of_segments_of_two_rounds_on_workers_is_the_same(self):
        """A checkpoint cut after two of its segments (fedmom_checkpoint.rebuild's `only`
        rounds) replayed with and without the workers: the same bits."""
        os.environ[fedmom_checkpoint.SEGMENT_ENV] = str(1 << 16)
        self.addCleanup(os.environ.pop, fedmom_checkpoint.SEGMENT_ENV)
        codec = wire.Codec("int4")
        state = outer_state.OuterState(SHAPES, {n: a.copy() for n, a in self.theta.items()})
        ckpt = fedmom_checkpoint.write_checkpoint(state, self.dir, None, fsync=False)
        log = []
        for rnd in (1, 2, 3):
            s = self.step(rnd, codec)
            outer_state.apply_round(state, s, fsync=False, threads=1)
            s.digest = state.digest
            log.append(dataclasses.replace(s, deltas=[(os.path.relpath(p, self.dir), w) for p, w in s.deltas]))
        n = [0]

        class Cut(Exception):
            pass

        def after():
            n[0] += 1
            if n[0] == 2:
                raise Cut
        with self.assertRaises(Cut):
            fedmom_checkpoint.write_checkpoint(state, self.dir, ckpt, fsync=False, after_file=after)
        plain = fedmom_checkpoint.rebuild(self.dir, ckpt, log, threads=1)
        pooled = fedmom_checkpoint.rebuild(self.dir, ckpt, log, threads=1, pool=self.pool(2))
        self.assert_same(plain, pooled, "the replay")
        self.assert_same(state, pooled, "the replay against the round as it ran")


class FailureTest(Case):
    def test_a_worker_killed_mid_round_fails_the_round_and_new_workers_take_the_next(self):
        faults = os.path.join(self.dir, "faults")
        os.makedirs(faults)
        os.environ[testhooks.FAULT_DIR_ENV] = faults
        self.addCleanup(os.environ.pop, testhooks.FAULT_DIR_ENV)
        pool = self.pool(2)
        codec = wire.Codec("int4")
        want = outer_state.OuterState(SHAPES, {n: a.copy() for n, a in self.theta.items()})
        outer_state.apply_round(want, self.step(1, codec), fsync=False, threads=1)
        state = outer_state.OuterState(SHAPES, {n: a.copy() for n, a in self.theta.items()})
        arm = os.path.join(faults, "merge.worker")
        with open(arm, "w") as f:
            f.write("3")                                  # the fourth task a worker takes stops there
        import threading
        failed = []

        def go():
            try:
                outer_state.apply_round(state, self.step(1, codec), fsync=False, threads=1, pool=pool)
            except merge_pool.WorkerDied as e:
                failed.append(e)
        t = threading.Thread(target=go)
        t.start()
        self.assertTrue(wait_for(lambda: os.path.exists(arm + ".hit"), HANG_S), "no worker reached the point")
        with open(arm + ".hit") as f:
            os.kill(int(f.read()), signal.SIGKILL)
        os.unlink(arm)
        t.join(HANG_S)
        self.assertFalse(t.is_alive())
        self.assertEqual(len(failed), 1, "the round failed, loudly")
        self.assertIn("a merge worker died mid-round", str(failed[0]))
        self.assertTrue(state.dirty, "the half-merged arrays are marked")
        again = outer_state.OuterState(SHAPES, {n: a.copy() for n, a in self.theta.items()})
        outer_state.apply_round(again, self.step(1, codec), fsync=False, threads=1, pool=pool)   # new workers
        self.assert_same(want, again, "the round on the new workers")


class BlocksTest(Case):
    def names(self):
        return sorted(f for f in os.listdir(merge_pool.shm_dir()) if f.startswith(f"{merge_pool.PREFIX}{os.getpid()}-"))

    def test_blocks_go_when_let_go_and_a_dead_process_blocks_at_the_next_sweep(self):
        before = self.names()
        arrays = merge_pool.share({n: a.copy() for n, a in self.theta.items()}, SHAPES)
        self.assertEqual(len(self.names()), len(before) + 1)
        self.assertTrue(np.array_equal(arrays["embed"], self.theta["embed"]))
        del arrays
        self.assertEqual(self.names(), before)
        # a process that made a block and was SIGKILLed leaves it; a sweep removes it
        code = ("import merge_pool, os, sys, time\n"
                "b = merge_pool.Block(4096)\nprint(b.name, flush=True)\ntime.sleep(600)\n")
        proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True)
        self.addCleanup(lambda: proc.poll() is None and (proc.kill(), proc.wait(30)))
        name = proc.stdout.readline().strip()
        proc.stdout.close()
        self.assertTrue(os.path.exists(os.path.join(merge_pool.shm_dir(), name)))
        proc.kill()
        proc.wait(30)
        self.assertTrue(os.path.exists(os.path.join(merge_pool.shm_dir(), name)), "SIGKILL leaves it")
        self.assertGreaterEqual(merge_pool.sweep_stale(), 1)
        self.assertFalse(os.path.exists(os.path.join(merge_pool.shm_dir(), name)))

    def test_an_aggregator_whose_shared_memory_is_too_small_stops_at_its_start_naming_the_fix(self):
        """$PWW_SHM_DIR on a 16 MiB tmpfs and a model of 2M parameters with --down-wire int4
        (24 MB of shared arrays): the start stops with the fix in one message, before any round
        could fail on it; --merge-procs 1 starts."""
        shm = os.path.join(self.dir, "shm")
        os.makedirs(shm)
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", shm], capture_output=True, text=True)
        if r.returncode != 0:
            self.skipTest(f"cannot mount a 16 MiB tmpfs ({r.stderr.strip() or r.returncode}); run as root")
        self.addCleanup(subprocess.run, ["umount", "-l", shm])
        init = os.path.join(self.dir, "init.safetensors")
        with tensorio.TensorWriter(init, [("w", "F32", (2048, 1024))], fsync=False) as w:
            w.write("w", np.zeros((2048, 1024), np.float32))
        env = {**os.environ, merge_pool.SHM_ENV: shm, merge_pool.MIN_ENV: "1"}
        cmd = [sys.executable, "fedmom_server.py", "--state-dir", os.path.join(self.dir, "st"), "--init", init,
               "--down-wire", "int4", "--port", "0"]
        out = subprocess.run(cmd + ["--merge-procs", "2"], cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=HANG_S)
        self.assertNotEqual(out.returncode, 0)
        self.assertIn("which has 16 MiB free; it needs 24 MiB", out.stderr)
        self.assertIn("--merge-procs 1", out.stderr)
        self.assertIn("mount -o remount,size=", out.stderr)
        proc = subprocess.Popen(cmd + ["--merge-procs", "1"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        self.addCleanup(lambda: proc.poll() is None and (proc.kill(), proc.wait(30)))
        from harness import listening_url
        listening_url(proc, timeout=HANG_S)               # it serves
        proc.terminate()
        proc.wait(60)

    def test_too_little_shared_memory_is_refused_with_the_fix(self):
        with self.assertRaises(MemoryError) as cm:
            merge_pool.Block(1 << 60)
        self.assertIn("--merge-procs 1", str(cm.exception))


if __name__ == "__main__":
    unittest.main()
