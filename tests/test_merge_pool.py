"""fedmom_merge.py: a round on worker processes over shared memory gives the bits of one thread
(every codec, mixed delta formats, momentum 0 and 0.9, a replay of segments of two rounds);
a worker killed mid-round fails the round loudly and the next one runs on new workers; the
shared blocks are removed when let go, at exit, and after a SIGKILL by the next start."""
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import unittest

import numpy as np

import fedmom_client
import fedmom_merge
import fedmom_state as fs
import fixtures
import httpc
import outer_state
import tensorio
import testhooks
import wire
from testbed.harness import listening_url, wait_for

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# odd last dimensions, a ragged int4 row, a 1-D tensor, a scalar-like one, several pieces each
SHAPES = {"embed": (700, 320), "w": (96, 131), "b": (1001,), "one": (1,), "big": (256, 768)}
HANG_S = 120


class Case(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="pool-")
        self.addCleanup(shutil.rmtree, self.dir, True)
        self.rng = np.random.default_rng(3)
        self.theta = {n: self.rng.standard_normal(int(np.prod(s))).astype(np.float32) for n, s in SHAPES.items()}

    def pool(self, procs):
        pool = fedmom_merge.Pool(procs, outer_state.worker_argv())
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
        fixtures.assert_same_outer(self, a, b, SHAPES, what)


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
                    self.assertIsInstance(many.theta, fedmom_merge.BlockArrays, what)

    def test_a_replay_of_segments_of_two_rounds_on_workers_is_the_same(self):
        """A checkpoint cut after two of its segments (outer_state.rebuild's `only`
        rounds) replayed with and without the workers: the same bits."""
        codec = wire.Codec("int4")
        state, ckpt, log = fixtures.checkpoint_and_log(self, SHAPES, self.theta, self.step, codec)
        fixtures.cut_checkpoint(self, state, self.dir, ckpt, files=2)
        plain = outer_state.rebuild(self.dir, ckpt, log, threads=1)
        pooled = outer_state.rebuild(self.dir, ckpt, log, threads=1, pool=self.pool(2))
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
            except fedmom_merge.WorkerDied as e:
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
        return sorted(f for f in os.listdir(fedmom_merge.shm_dir()) if f.startswith(f"{fedmom_merge.PREFIX}{os.getpid()}-"))

    def test_blocks_go_when_let_go_and_a_dead_process_blocks_at_the_next_sweep(self):
        before = self.names()
        arrays = fedmom_merge.share({n: a.copy() for n, a in self.theta.items()}, SHAPES)
        self.assertEqual(len(self.names()), len(before) + 1)
        self.assertTrue(np.array_equal(arrays["embed"], self.theta["embed"]))
        del arrays
        self.assertEqual(self.names(), before)
        # a process that made a block and was SIGKILLed leaves it; a sweep removes it
        code = ("import fedmom_merge, os, sys, time\n"
                "b = fedmom_merge.Block(4096)\nprint(b.name, flush=True)\ntime.sleep(600)\n")
        proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True)
        self.addCleanup(lambda: proc.poll() is None and (proc.kill(), proc.wait(30)))
        name = proc.stdout.readline().strip()
        proc.stdout.close()
        self.assertTrue(os.path.exists(os.path.join(fedmom_merge.shm_dir(), name)))
        proc.kill()
        proc.wait(30)
        self.assertTrue(os.path.exists(os.path.join(fedmom_merge.shm_dir(), name)), "SIGKILL leaves it")
        self.assertGreaterEqual(fedmom_merge.sweep_stale(), 1)
        self.assertFalse(os.path.exists(os.path.join(fedmom_merge.shm_dir(), name)))

    def in_pid_namespace(self, code, **kw):
        """`code` run by a python that is pid 1 of a new pid namespace (a container's aggregator:
        its own /proc), on the same shared memory directory."""
        cmd = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child", sys.executable, "-c", code]
        return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)

    def own_shm_dir(self):
        shm = os.path.join(self.dir, "shm")
        os.makedirs(shm)
        os.environ[fedmom_merge.SHM_ENV] = shm              # here and in every process started
        self.addCleanup(os.environ.pop, fedmom_merge.SHM_ENV)
        probe = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True, text=True)
        if probe.returncode != 0:
            self.skipTest(f"cannot make a pid namespace ({probe.stderr.strip() or probe.returncode}); run as root")
        return shm

    def test_a_sweep_in_another_pid_namespace_leaves_a_live_aggregators_blocks(self):
        # Schedule: this process (an aggregator, alive) holds a block; another aggregator starts
        # in a container with its own pid namespace on the same shared memory (apptainer, or
        # docker with --ipc=host) and sweeps: the live block's pid is not in its /proc.
        shm = self.own_shm_dir()
        live = fedmom_merge.Block(4096)
        self.addCleanup(live.release)
        proc = self.in_pid_namespace("import fedmom_merge\nprint(fedmom_merge.sweep_stale())\n")
        out, err = proc.communicate(timeout=HANG_S)
        self.assertEqual(proc.returncode, 0, err)
        self.assertTrue(os.path.exists(os.path.join(shm, live.name)),
                        f"a sweep in another pid namespace removed the live block {live.name}")
        fedmom_merge.sweep_stale()                         # and one here, by its maker
        self.assertTrue(os.path.exists(os.path.join(shm, live.name)), "a sweep removed its own process's block")

    def test_a_block_left_by_a_killed_process_whose_pid_comes_back_is_swept(self):
        # Schedule: an aggregator that is pid 1 of its container makes a block and is SIGKILLed;
        # its restart is pid 1 again: its sweep skips the block (its own pid), which is never
        # removed, and its first block takes the same name (O_EXCL: FileExistsError).
        shm = self.own_shm_dir()
        first = self.in_pid_namespace("import fedmom_merge, os, time\nb = fedmom_merge.Block(4096)\n"
                                      "print(os.getpid(), b.name, flush=True)\ntime.sleep(600)\n")
        self.addCleanup(lambda: first.poll() is None and (first.kill(), first.wait(30)))
        pid, name = first.stdout.readline().split()
        with open(f"/proc/{first.pid}/task/{first.pid}/children") as f:
            child = int(f.read().split()[0])              # the python, as this namespace sees it
        os.kill(child, signal.SIGKILL)
        first.wait(30)
        first.stdout.close()
        first.stderr.close()
        self.assertTrue(os.path.exists(os.path.join(shm, name)), "SIGKILL leaves it")
        again = self.in_pid_namespace("import fedmom_merge, os\nfedmom_merge.sweep_stale()\nb = fedmom_merge.Block(4096)\n"
                                      "print(os.getpid(), b.name, flush=True)\n")
        out, err = again.communicate(timeout=HANG_S)
        self.assertEqual(again.returncode, 0, f"the restart could not make its block: {err[-2000:]}")
        self.assertEqual(out.split()[0], pid, "the restart has the same pid")
        self.assertFalse(os.path.exists(os.path.join(shm, name)), f"{name} of the killed process is never swept")

    def test_too_little_shared_memory_is_refused_with_the_fix(self):
        with self.assertRaises(MemoryError) as cm:
            fedmom_merge.Block(1 << 60)
        self.assertIn("lower --memory-gb", str(cm.exception))



class ServerCase(Case):
    """A real fedmom_server --merge-procs 2 --down-wire int4, its shared memory on a tmpfs of
    SHM_SIZE (the outer state of SHAPES is 5.2 MB: theta, momentum, residual)."""
    SHM_SIZE = "8m"

    def at_round_1(self):
        """A server on a fresh state dir and its own tmpfs (self.shm) with round 0 merged ->
        (state dir, fault dir, process, url)."""
        shm = self.mount_shm()
        sd, faults = os.path.join(self.dir, "st"), os.path.join(self.dir, "faults")
        os.makedirs(faults)
        proc, url = self.start(sd, shm, faults)
        self.send_round(url, 0)
        self.wait_round(url, 1)
        self.shm = shm
        return sd, faults, proc, url

    def stop_at_round_2(self, proc, sd):
        """SIGTERM, then the state dir replayed in one thread: round 2, every logged round's digest checked."""
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        self.assertEqual(self.replayed_in_one_thread(sd).round, 2)

    def hold_first_task(self, url, faults, rnd):
        """Arm merge.worker (every worker task stops there until the file is removed), send
        round `rnd`, wait for a worker to reach the point -> (the arm file, that worker's pid)."""
        arm = os.path.join(faults, "merge.worker")
        with open(arm, "w") as f:
            f.write("0")
        self.send_round(url, rnd)
        self.assertTrue(wait_for(lambda: os.path.exists(arm + ".hit"), HANG_S), "no worker reached the point")
        with open(arm + ".hit") as f:
            return arm, int(f.read())

    def mount_shm(self):
        shm = os.path.join(self.dir, "shm")
        os.makedirs(shm)
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={self.SHM_SIZE}", "tmpfs", shm],
                           capture_output=True, text=True)
        if r.returncode != 0:
            self.skipTest(f"cannot mount a tmpfs of {self.SHM_SIZE} ({r.stderr.strip() or r.returncode}); run as root")
        self.addCleanup(subprocess.run, ["umount", "-l", shm])
        return shm

    def start(self, sd, shm, faults, init=True, *flags):
        env = {**os.environ, testhooks.FAULT_DIR_ENV: faults, fedmom_merge.SHM_ENV: shm, fedmom_merge.MIN_ENV: "0"}
        cmd = [sys.executable, "fedmom_server.py", "--state-dir", sd, "--port", "0", "--down-wire", "int4",
               "--checkpoint-rounds", "10", "--threads", "1", "--merge-procs", "2", *flags]
        if init:
            path = os.path.join(self.dir, "init.safetensors")
            with tensorio.TensorWriter(path, [(n, "F32", s) for n, s in SHAPES.items()], fsync=False) as w:
                for n, s in SHAPES.items():
                    w.write(n, self.theta[n].reshape(s))
            cmd += ["--init", path]
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.addCleanup(lambda: proc.poll() is None and (proc.kill(), proc.wait(30)))
        url, self.out = listening_url(proc, timeout=HANG_S)
        return proc, url

    def send_round(self, url, rnd, fmts=("int4", "int8"), paths=(None, None), tokens=(10, 30)):
        clients = [fedmom_client.FedMomClient(url, c, f"{c}-inc") for c in ("a", "b")]
        for c in clients if rnd == 0 else ():
            c.join()
        for i, c in enumerate(clients):
            c.send_delta(paths[i] or self.delta(rnd, i, fmts[i]), rnd, tokens[i], [], {})

    def status(self, url):
        return httpc.call(url, "GET", "/status")

    def wait_round(self, url, rnd):
        got = fedmom_client.FedMomClient(url, "a", "a-inc").wait_round_after(rnd - 1, timeout_s=HANG_S)
        self.assertEqual(got, rnd, f"round {rnd - 1} did not merge; the server said:\n" + self.out.text()[-3000:])

    def workers(self, proc):
        """The server's children: its merge workers."""
        out = set()
        for tid in os.listdir(f"/proc/{proc.pid}/task"):
            with open(f"/proc/{proc.pid}/task/{tid}/children") as f:
                out |= {int(p) for p in f.read().split()}
        return out

    def hit_by(self, arm, pids):
        """The pid a worker stopped at `arm` wrote, once it is one of `pids` (the live workers)."""
        try:
            with open(arm + ".hit") as f:
                pid = int(f.read() or 0)
        except FileNotFoundError:
            return None
        return pid if pid in pids else None

    @staticmethod
    def alive(pid):
        """pid runs (a zombie, exited but not reaped yet, does not)."""
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except (FileNotFoundError, ProcessLookupError, IndexError):
            return False

    @staticmethod
    def resume_quietly(pid):
        """SIGCONT a worker this test stopped (if the pool has not killed it): it goes on, or exits."""
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass

    def replayed_in_one_thread(self, sd):
        """The state dir rebuilt here, in one thread: every logged round checked against the
        digest the server's workers published."""
        cfg = fs.ServerConfig(sd, down_wire="int4", checkpoint_rounds=10, fsync=False, merge_procs=1).validate()
        return fs.FedMomState(cfg, clock=lambda: 1000.0).outer


class RebuildSharedMemoryTest(ServerCase):
    def test_a_worker_killed_mid_round_is_retried_when_shared_memory_holds_the_state_once(self):
        # Schedule: round 0 merged and logged (the checkpoint is round 0's, at the start); the
        # shared memory holds the outer state once and a half (the start's check asks for once);
        # round 1: a worker SIGKILLed at its first task. The round fails (WorkerDied) and the
        # state is rebuilt: the checkpoint loaded and round 0 replayed on the workers (once into
        # new shared arrays while the failed round's were still held: twice the state; now into
        # the same blocks).
        sd, faults, proc, url = self.at_round_1()
        arm, pid = self.hold_first_task(url, faults, 1)
        os.kill(pid, signal.SIGKILL)
        os.unlink(arm)
        st = wait_for(lambda: (lambda s: (s["merge_error"] or s["replay_error"]) and s)(self.status(url)), HANG_S)
        self.assertTrue(st, "the failed round never showed on /status")
        self.assertIsNone(st["replay_error"], "a worker's death stopped the merges for good; the server said:\n"
                          + self.out.text()[-3000:])
        self.assertIn("a merge worker died mid-round", st["merge_error"])
        self.wait_round(url, 2)                          # the retry (fedmom_round.MERGE_RETRY_S later)
        self.stop_at_round_2(proc, sd)


    def test_a_round_redone_without_an_overflowing_delta_fits_in_shared_memory_holding_the_state_once(self):
        # Schedule: round 0 merged and logged; round 1's delta a overflows tensor "w" (3e38,
        # --clip-factor 0): NonFinite, the state rebuilt (round 0 replayed on the workers, which
        # still map the failed try's arrays: no worker died) and the round redone without a.
        shm = self.mount_shm()
        sd, faults = os.path.join(self.dir, "st"), os.path.join(self.dir, "faults")
        os.makedirs(faults)
        proc, url = self.start(sd, shm, faults, True, "--clip-factor", "0")
        self.send_round(url, 0)
        self.wait_round(url, 1)
        rng = np.random.default_rng(5)
        bad = {n: (0.01 * rng.standard_normal(s)).astype(np.float32) for n, s in SHAPES.items()}
        bad["w"][:] = 3e38
        path = os.path.join(self.dir, "overflowing.safetensors")
        with tensorio.TensorWriter(path, [(n, "F32", s) for n, s in SHAPES.items()], fsync=False) as w:
            for n, a in bad.items():
                w.write(n, a)
        self.send_round(url, 1, paths=(path, None), tokens=(1000, 10))
        st = wait_for(lambda: (lambda s: (s["round"] == 2 or s["replay_error"]) and s)(self.status(url)), HANG_S)
        self.assertTrue(st, "round 1 neither merged nor failed")
        self.assertIsNone(st["replay_error"], "an excluded delta stopped the merges for good; the server said:\n"
                          + self.out.text()[-3000:])
        self.assertEqual(st["round"], 2)
        self.stop_at_round_2(proc, sd)



class WorkerDeathTest(ServerCase):
    SHM_SIZE = "64m"

    def test_workers_killed_mid_round_and_again_in_the_rebuild_leave_the_round_to_its_retry(self):
        # Schedule: round 0 merged and logged; round 1: every worker SIGKILLed at its first task
        # (the round fails: WorkerDied), then the new workers SIGKILLed again at their first task
        # of the rebuild's replay of round 0. Nothing durable is wrong: the round's retry must
        # rebuild and merge it, not stop the merges as if the log could not be replayed.
        sd, faults, proc, url = self.at_round_1()
        arm = os.path.join(faults, "merge.worker")
        with open(arm, "w") as f:
            f.write("0")                                 # every worker task stops there until it is removed
        self.send_round(url, 1)
        killed = set()
        for what in ("the round", "the rebuild's replay"):
            self.assertTrue(wait_for(lambda: self.hit_by(arm, self.workers(proc) - killed), HANG_S),
                            f"no worker reached the point in {what}; the server said:\n" + self.out.text()[-3000:])
            for pid in self.workers(proc) - killed:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:               # a worker of a pool just closed, gone by itself
                    pass
                killed.add(pid)
        st = wait_for(lambda: (lambda s: (s["merge_error"] or s["replay_error"]) and s)(self.status(url)), HANG_S)
        os.unlink(arm)
        self.assertTrue(st, "the failed round never showed on /status")
        self.assertIsNone(st["replay_error"], "two workers' deaths stopped the merges for good; the server said:\n"
                          + self.out.text()[-3000:])
        self.assertIn("a merge worker died mid-round", st["merge_error"])
        self.wait_round(url, 2)                          # the retry rebuilds, then merges
        self.stop_at_round_2(proc, sd)



class HungWorkerTest(ServerCase):
    SHM_SIZE = "64m"

    def test_a_worker_stopped_mid_round_fails_the_round_and_the_retry_merges_it(self):
        # Schedule: round 0 merged and logged; round 1: a worker SIGSTOPped at its first task
        # (hung: alive, silent). The round must fail loudly (merge_error), not hold the merge
        # forever, and its retry merge on new workers.
        shm = self.mount_shm()
        sd, faults = os.path.join(self.dir, "st"), os.path.join(self.dir, "faults")
        os.makedirs(faults)
        os.environ[fedmom_merge.TIMEOUT_ENV] = "20"       # the server's (a task here takes milliseconds)
        self.addCleanup(os.environ.pop, fedmom_merge.TIMEOUT_ENV)
        proc, url = self.start(sd, shm, faults)
        self.send_round(url, 0)
        self.wait_round(url, 1)
        arm, stopped = self.hold_first_task(url, faults, 1)
        os.kill(stopped, signal.SIGSTOP)
        self.addCleanup(self.resume_quietly, stopped)
        os.unlink(arm)                                   # the other worker goes on; the stopped one cannot
        st = wait_for(lambda: (lambda s: (s["merge_error"] or s["replay_error"]) and s)(self.status(url)), HANG_S)
        self.assertTrue(st, "a stopped worker held the round: no merge_error")
        self.assertIsNone(st["replay_error"])
        self.assertIn("answered nothing", st["merge_error"])
        self.wait_round(url, 2)
        self.stop_at_round_2(proc, sd)


class OrphanTest(ServerCase):
    def test_a_killed_aggregators_worker_mid_task_exits_and_its_restart_starts(self):
        # Schedule: the shared memory holds the state once and a half; round 1: a worker held at
        # its first task (a long task, or hung) and the aggregator SIGKILLed; restarted at once.
        # The orphan still maps the dead aggregator's arrays (unlinked by the restart's sweep,
        # but not freed): the restart was refused as if /dev/shm were too small.
        sd, faults, proc, url = self.at_round_1()
        arm, _ = self.hold_first_task(url, faults, 1)
        workers = self.workers(proc)
        proc.kill()
        proc.wait(30)
        gone = wait_for(lambda: not any(map(self.alive, workers)), HANG_S)
        os.unlink(arm)
        self.assertTrue(gone, "a worker of the killed aggregator is still alive, holding its shared memory")
        proc, url = self.start(sd, self.shm, faults, False)   # at once: nothing left holds the memory
        self.wait_round(url, 2)                          # round 1, spooled, merges after the restart
        self.stop_at_round_2(proc, sd)


class StartCheckTest(ServerCase):
    SHM_SIZE = "5324800"                                 # bytes: 1300 pages

    def test_shared_memory_that_holds_the_arrays_but_not_the_round_is_refused_at_the_start(self):
        # Schedule: a tmpfs of 5.08 MiB; the outer state of SHAPES with --down-wire int4 is 4.97 MiB,
        # and a round adds its update's two scratch slots (0.23 MiB, outer_state._Scratch): the
        # start must refuse, or the round must merge; neither may be a round that fails at every
        # try. (The default --memory-gb keeps what shared memory cannot hold on disk: it merges.)
        shm = self.mount_shm()
        sd, faults = os.path.join(self.dir, "st"), os.path.join(self.dir, "faults")
        os.makedirs(faults)
        try:
            proc, url = self.start(sd, shm, faults)
        except AssertionError as e:                      # it stopped at its start: naming the fix
            self.assertIn("--memory-gb", str(e))
            self.assertIn("mount -o remount,size=", str(e))
            return
        self.send_round(url, 0)
        st = wait_for(lambda: (lambda s: (s["round"] == 1 or s["merge_error"]) and s)(self.status(url)), HANG_S)
        self.assertTrue(st, "round 0 neither merged nor failed")
        self.assertIsNone(st["merge_error"], "the start was accepted, but the round cannot fit; the server said:\n"
                          + self.out.text()[-3000:])


if __name__ == "__main__":
    unittest.main()
