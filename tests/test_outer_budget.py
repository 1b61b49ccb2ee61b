"""outer_state.py and the outer state on disk: a round whose state lives in file blocks (all
of it, or the tensors --memory-gb leaves out of memory) gives the bits of a round in memory,
on worker processes and in one, in waves too; a replay into file blocks is exact; a merge
worker reads only its own part of a delta; a restart loads the checkpoint straight into its
blocks (no private copy of the model); the start's checks refuse in one line naming the flag;
a disk error on a file block fails the round loudly with nothing published; real servers
under two budgets end with the same theta and momentum; `plan` prints what a run needs."""
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import tracemalloc
import unittest

import numpy as np

import fedmom_client
import fedmom_merge
import fedmom_state as fs
import fixtures
import httpc
import outer_state
import tensorio
import wire
from testbed.harness import listening_url, wait_for

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# odd last dimensions, a ragged int4 row, a 1-D tensor, a scalar-like one, several pieces each
SHAPES = {"embed": (700, 320), "w": (96, 131), "b": (1001,), "one": (1,), "big": (256, 768)}
KINDS = ("theta", "momentum", "residual")
INT4 = wire.Codec("int4")
HANG_S = 120
FS_IOC_SHUTDOWN = 0x8004587D     # ext4/xfs: every later I/O on the file system fails with EIO


class Case(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="budget-")
        self.addCleanup(shutil.rmtree, self.dir, True)
        self.theta = {n: np.random.default_rng(3).standard_normal(int(np.prod(s))).astype(np.float32)
                      for n, s in SHAPES.items()}

    def delta(self, rnd, i, fmt):
        rng = np.random.default_rng([rnd, i])
        path = os.path.join(self.dir, f"d{rnd}-{i}-{fmt}.safetensors")
        codec = {"int4": INT4, "int8": wire.Codec("int8", block=64), "bf16": wire.Codec("bf16"),
                 "int2": wire.Codec("int2"), "topk": wire.Codec("topk"), "f32": wire.Codec("f32")}[fmt]
        with wire.WireWriter(path, list(SHAPES.items()), codec, {}, fsync=False, threads=1) as w:
            for n, s in SHAPES.items():
                w.write(n, (0.01 * rng.standard_normal(s)).astype(np.float32))
        return path

    def step(self, rnd, codec, mu=0.9, fmts=("int4", "int8", "bf16", "int2")):
        ds = [(self.delta(rnd, i, f), w) for i, (f, w) in enumerate(zip(fmts, (0.4, 0.3, 0.2, 0.1)))]
        return outer_state.Step(rnd, ds, 0.7, mu, rnd == 1, codec)

    def store(self, disk, shared=False):
        """A store with the tensors `disk` names on disk ({kind: set}; every kind: "all")."""
        placement = {k: (set(SHAPES) if disk == "all" else disk.get(k, set())) for k in KINDS}
        st = outer_state.Store(SHAPES, placement, os.path.join(self.dir, "outer"), shared)
        self.addCleanup(st.release)
        return st

    def pool(self, procs):
        pool = fedmom_merge.Pool(procs, outer_state.worker_argv())
        self.addCleanup(pool.close)
        return pool

    def loaded(self, store):
        """theta of round 0 in the store's blocks (as a start reads --init into them)."""
        theta = outer_state.alloc(SHAPES, store, "theta", False)
        for n, a in self.theta.items():
            if isinstance(theta[n], fedmom_merge.FileTensor):
                theta[n].write(0, a.size, a)
            else:
                np.copyto(theta[n], a)
        return outer_state.OuterState(SHAPES, theta, store=store)

    def assert_same(self, a, b, what):
        fixtures.assert_same_outer(self, a, b, SHAPES, what)


class BitsTest(Case):
    MIXED = {"theta": {"embed", "b"}, "momentum": {"w", "big", "one"}, "residual": set(SHAPES)}

    def test_a_round_with_its_state_on_disk_is_the_round_in_memory_bit_for_bit(self):
        pool = self.pool(2)
        for codec in (INT4, None, wire.Codec("int8", block=64), wire.Codec("bf16")):
            for disk, procs in (("all", 0), (self.MIXED, 0), ("all", 2), (self.MIXED, 2)):
                what = f"down {codec and codec.fmt}, on disk {disk if disk == 'all' else 'mixed'}, {procs} workers"
                plain = outer_state.OuterState(SHAPES, {n: a.copy() for n, a in self.theta.items()})
                placed = self.loaded(self.store(disk, shared=procs > 0))
                for rnd in (1, 2, 3):
                    s = self.step(rnd, codec)
                    u1, u2 = os.path.join(self.dir, "u1"), os.path.join(self.dir, "u2")
                    outer_state.apply_round(plain, s, u1 if codec else None, fsync=False, threads=1)
                    outer_state.apply_round(placed, s, u2 if codec else None, fsync=False, threads=2,
                                            pool=pool if procs else None)
                    self.assert_same(plain, placed, f"{what}, round {rnd}")
                    if codec:
                        with open(u1, "rb") as f1, open(u2, "rb") as f2:
                            self.assertEqual(f1.read(), f2.read(), f"{what}, round {rnd}: the update file")
                self.assertIsInstance(placed.theta["embed"], fedmom_merge.FileTensor, what)

    def test_a_round_whose_deltas_do_not_fit_runs_in_waves_with_the_same_bits(self):
        # delta_bytes holds the parts of two pieces of the deltas at most: every tensor runs in
        # several waves, each wave's parts read then dropped
        pool = self.pool(2)
        for procs in (0, 2):
            plain = outer_state.OuterState(SHAPES, {n: a.copy() for n, a in self.theta.items()})
            placed = self.loaded(self.store(self.MIXED, shared=procs > 0))
            for rnd in (1, 2):
                s = self.step(rnd, INT4)
                outer_state.apply_round(plain, s, fsync=False, threads=1)
                outer_state.apply_round(placed, s, fsync=False, threads=2, pool=pool if procs else None,
                                        delta_bytes=40_000)
                self.assert_same(plain, placed, f"{procs} workers, round {rnd}")
        pieces = [(lo, lo + 100, True, False) for lo in range(0, 1000, 100)]
        waves = outer_state._waves(pieces, 2.0, 450)
        self.assertEqual([len(w) for w in waves], [2, 2, 2, 2, 2])
        self.assertEqual([p for w in waves for p in w], pieces)

    def test_a_replay_into_a_store_on_disk_is_the_replay_in_memory(self):
        """A checkpoint cut after two of its segments (segments of two rounds), replayed into
        private arrays and into file blocks (with and without workers): the same bits."""
        state, ckpt, log = fixtures.checkpoint_and_log(self, SHAPES, self.theta, self.step, INT4)
        fixtures.cut_checkpoint(self, state, self.dir, ckpt, files=2)
        plain = outer_state.rebuild(self.dir, ckpt, log, threads=1)
        self.assert_same(state, plain, "the replay in memory")
        on_disk = outer_state.rebuild(self.dir, ckpt, log, threads=1, store=self.store("all"))
        self.assert_same(plain, on_disk, "the replay into file blocks")
        pooled = outer_state.rebuild(self.dir, ckpt, log, threads=1, pool=self.pool(2),
                                     store=self.store(self.MIXED, shared=True))
        self.assert_same(plain, pooled, "the replay into file blocks and shared memory, on workers")


class PartsTest(Case):
    def test_a_merge_worker_reads_only_its_own_part_of_each_delta(self):
        # Schedule: the tensor "big" (256 x 768) cut as a pool of 4 would cut it; each worker's
        # session reads the int4 and int8 deltas' parts of its own run only (about a quarter
        # each), where it used to read every delta's whole tensor for every task
        step = self.step(1, INT4, fmts=("int4", "int8"))
        sh = SHAPES["big"]
        n = int(np.prod(sh))
        unit = fedmom_merge.piece_unit(sh, [INT4, wire.Codec("int8", block=64)])
        pieces = [(lo, min(lo + 8 * unit, n), True, False) for lo in range(0, n, 8 * unit)]
        cut = len(pieces) // 4
        state = self.loaded(self.store({}, shared=True))
        state.momentum = outer_state.alloc(SHAPES, state.store, "momentum", False)
        where = lambda d: d.where("big")
        session = outer_state.WorkerSession()
        self.addCleanup(lambda: [d.close() for d in session.readers])
        blocks = {}
        self.addCleanup(blocks.clear)
        for d in (state.theta, state.momentum):
            blocks[d.block.name] = fedmom_merge.Block(name=d.block.name)
        task = outer_state.Task([p for p, _ in step.deltas], [w for _, w in step.deltas], 0.7, 0.9, None, "big", sh,
                                where(state.theta), where(state.momentum), None, None, None, None, pieces[cut:2 * cut])
        session.run(task, blocks)
        with tensorio.TensorReader(step.deltas[0][0]) as r:
            whole = r.nbytes("big") + r.nbytes("big" + wire.SCALE)
        read = session.readers[0].nread
        self.assertLess(read, 0.3 * whole, f"a quarter's worker read {read} bytes of the int4 delta's {whole}")
        self.assertGreater(read, 0.2 * whole)


class FileBlockTest(Case):
    def test_a_killed_aggregators_file_blocks_are_swept_by_the_next_start_and_a_live_ones_kept(self):
        # Schedule: a process makes a file block in --outer-dir (fallocated: its disk blocks
        # taken) and is SIGKILLed; this process, alive, holds one there too; a sweep (a start's)
        # removes the dead process's and leaves the live one's.
        outer = os.path.join(self.dir, "outer")
        os.makedirs(outer)
        code = (f"import fedmom_merge, time\nb = fedmom_merge.FileBlock(1 << 20, dir={outer!r})\n"
                "print(b.path, flush=True)\ntime.sleep(600)\n")
        proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True)
        self.addCleanup(lambda: proc.poll() is None and (proc.kill(), proc.wait(30)))
        dead = proc.stdout.readline().strip()
        proc.stdout.close()
        self.assertGreaterEqual(os.stat(dead).st_blocks * 512, 1 << 20, "its blocks are taken when it is made")
        live = fedmom_merge.FileBlock(4096, dir=outer)
        self.addCleanup(live.release)
        proc.kill()
        proc.wait(30)
        self.assertTrue(os.path.exists(dead), "SIGKILL leaves it")
        self.assertEqual(fedmom_merge.sweep_stale(outer), 1)
        self.assertFalse(os.path.exists(dead))
        self.assertTrue(os.path.exists(live.path))


class RestartMemoryTest(unittest.TestCase):
    def test_a_restart_loads_the_checkpoint_into_its_blocks_with_no_private_copy_of_the_model(self):
        # Schedule: a state dir at round 3 (a checkpoint of round 1, rounds 2 and 3 logged) of a
        # model of 2M parameters (theta, momentum, residual: 24 MB); a restart in this process,
        # its state in shared memory blocks (--merge-procs 2, run here: the replay on workers),
        # tracemalloc counting every array this process allocates. It used to read the checkpoint
        # into private arrays (24 MB) before copying them into the blocks: 16 B/param at the peak.
        d = tempfile.mkdtemp(prefix="budget-restart-")
        self.addCleanup(shutil.rmtree, d, True)
        shapes = {"embed": (1024, 512), "w": (1024, 1024), "b": (1024,)}
        rng = np.random.default_rng(0)
        init = os.path.join(d, "init.safetensors")
        with tensorio.TensorWriter(init, [(n, "F32", s) for n, s in shapes.items()], fsync=False) as w:
            for n, s in shapes.items():
                w.write(n, rng.standard_normal(s).astype(np.float32))
        os.environ[fedmom_merge.MIN_ENV] = "0"
        self.addCleanup(os.environ.pop, fedmom_merge.MIN_ENV)
        cfg = lambda: fs.ServerConfig(os.path.join(d, "st"), init=init, down_wire="int4", checkpoint_rounds=2,
                                      fsync=False, merge_procs=2, memory_gb=1.0).validate()
        st = fs.FedMomState(cfg(), clock=lambda: 1000.0)
        for rnd in range(3):
            for c in ("a", "b"):
                st.join(c, f"{c}-inc")
                path = os.path.join(d, f"{c}{rnd}.safetensors")
                with wire.WireWriter(path, list(shapes.items()), INT4, {}, fsync=False) as w:
                    for n, s in shapes.items():
                        w.write(n, (0.01 * rng.standard_normal(s)).astype(np.float32))
                meta = st.check_delta_meta({"cluster": c, "incarnation": f"{c}-inc", "tokens": 10, "base_round": rnd})
                part = st.spool.part()
                shutil.copyfile(path, part)
                st.accept_delta(meta, part)
            self.assertEqual(st.tick()["round"], rnd + 1)
        self.assertEqual((st.ckpt["round"], [s.round for s in st.log]), (2, [3]))
        digest = st.outer.digest
        st.keeper.close()
        model = 4 * sum(int(np.prod(s)) for s in shapes.values())
        tracemalloc.start()
        try:
            again = fs.FedMomState(cfg(), clock=lambda: 1000.0)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        self.addCleanup(again.keeper.close)
        self.assertEqual(again.outer.digest, digest)
        self.assertIsInstance(again.outer.theta, fedmom_merge.BlockArrays)
        self.assertLess(peak, model // 2, f"the restart allocated {peak / 1e6:.1f} MB of private memory; the "
                                          f"model is {model / 1e6:.1f} MB (its state {3 * model / 1e6:.1f} MB)")


# ---------------------------------------------------------------- real servers

def tmpfs(test, path, size):
    os.makedirs(path)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path], capture_output=True, text=True)
    if r.returncode != 0:
        test.skipTest(f"cannot mount a tmpfs of {size} ({r.stderr.strip() or r.returncode}); run as root")
    test.addCleanup(subprocess.run, ["umount", "-l", path])
    return path


class ServerCase(Case):
    """Real fedmom_server processes --down-wire int4 --merge-procs 2 on the model SHAPES."""

    def fixed(self):
        """The bytes such a server holds with none of its outer state in memory."""
        return outer_state.Budget(0, SHAPES, KINDS, INT4, 2).minimum()

    def init(self):
        path = os.path.join(self.dir, "init.safetensors")
        if not os.path.exists(path):
            with tensorio.TensorWriter(path, [(n, "F32", s) for n, s in SHAPES.items()], fsync=False) as w:
                for n, s in SHAPES.items():
                    w.write(n, self.theta[n].reshape(s))
        return path

    def command(self, sd, *flags):
        return [sys.executable, "fedmom_server.py", "--state-dir", sd, "--port", "0", "--down-wire", "int4",
                "--threads", "1", "--merge-procs", "2", "--init", self.init(), *flags]

    def env(self, **kw):
        return {**os.environ, fedmom_merge.MIN_ENV: "0", **kw}

    def start(self, sd, *flags, env=None):
        proc = subprocess.Popen(self.command(sd, *flags), cwd=ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, env=env or self.env())
        self.addCleanup(lambda: proc.poll() is None and (proc.kill(), proc.wait(30)))
        url, out = listening_url(proc, timeout=HANG_S)
        return proc, url, out

    def refused(self, sd, *flags, env=None):
        """The one line a start that must refuse says -> its stderr's last line."""
        p = subprocess.run(self.command(sd, *flags), cwd=ROOT, capture_output=True, text=True, timeout=HANG_S,
                           env=env or self.env())
        self.assertNotEqual(p.returncode, 0, p.stdout[-2000:] + p.stderr[-2000:])
        return p.stderr.strip().splitlines()[-1]

    def send_round(self, url, rnd):
        clients = [fedmom_client.FedMomClient(url, c, f"{c}-inc") for c in ("a", "b")]
        for c in clients if rnd == 0 else ():
            c.join()
        for i, c in enumerate(clients):
            c.send_delta(self.delta(rnd, i, ("int4", "int8")[i]), rnd, (10, 30)[i], [], {})

    def wait_round(self, url, rnd, out):
        got = fedmom_client.FedMomClient(url, "a", "a-inc").wait_round_after(rnd - 1, timeout_s=HANG_S)
        self.assertEqual(got, rnd, f"round {rnd - 1} did not merge; the server said:\n" + out.text()[-3000:])

    def stop(self, proc):
        proc.send_signal(signal.SIGTERM)
        self.assertEqual(proc.wait(60), 0)

    def export(self, sd, *flags):
        """theta, momentum and residual of a stopped server, rebuilt by `fedmom_server.py export`."""
        out = {k: os.path.join(self.dir, f"{os.path.basename(sd)}-{k}-{len(flags)}.safetensors") for k in KINDS}
        p = subprocess.run([sys.executable, "fedmom_server.py", "export", "--state-dir", sd, out["theta"],
                            "--momentum", out["momentum"], "--residual", out["residual"], *flags],
                           cwd=ROOT, capture_output=True, text=True, timeout=HANG_S, env=self.env())
        self.assertEqual(p.returncode, 0, p.stderr[-3000:])
        got = {}
        for k, path in out.items():
            with tensorio.TensorReader(path) as r:
                got[k] = {n: r.read(n).reshape(-1).view(np.uint32).copy() for n in r.names}
        return got


class TwoBudgetsTest(ServerCase):
    def test_the_same_rounds_under_two_budgets_end_with_the_same_theta_and_momentum(self):
        # Schedule: two servers, one with its outer state in memory (the machine's budget), one
        # with --memory-gb 1 MB above its fixed part (most of theta in memory, the rest of the
        # state in file blocks in --outer-dir); the same three rounds of int4 and int8 deltas.
        # Each round's theta is served with the same bytes; once stopped, the state dirs rebuild
        # (a replay of the logged rounds, in memory and on disk) to the same theta, momentum and
        # residual, bit for bit, whatever budget the rebuild runs under.
        small = f"{(self.fixed() + 1_000_000) / 1e9:.9f}"
        runs = {}
        for name, flags in (("memory", ()), ("disk", ("--memory-gb", small))):
            sd = os.path.join(self.dir, name)
            proc, url, out = self.start(sd, "--checkpoint-rounds", "10", *flags)
            served = []
            for rnd in range(3):
                self.send_round(url, rnd)
                self.wait_round(url, rnd + 1, out)
                path = os.path.join(self.dir, f"{name}-theta-{rnd + 1}.safetensors")
                fedmom_client.FedMomClient(url, "a", "a-inc").download_theta(path)
                with open(path, "rb") as f:
                    served.append(f.read())
            self.stop(proc)
            runs[name] = (sd, served, out.text())
        self.assertIn("0.0 MB on disk", runs["memory"][2])
        self.assertRegex(runs["disk"][2], r"outer state 5.2 MB, 1.0 MB in memory, 4.[0-9] MB on disk "
                                          r".*theta 4/5, momentum 2/5")
        left = [f for f in os.listdir(os.path.join(runs["disk"][0], "outer")) if f.startswith(fedmom_merge.PREFIX)]
        self.assertEqual(left, [], "the file blocks are removed when the server stops")
        self.assertEqual(runs["memory"][1], runs["disk"][1], "a round's theta differs between the budgets")
        want = self.export(runs["memory"][0])
        for flags in ((), ("--memory-gb", small)):
            got = self.export(runs["disk"][0], *flags)
            for k in KINDS:
                for n in SHAPES:
                    self.assertTrue(np.array_equal(want[k][n], got[k][n]), f"{k} of {n} differs ({flags})")


class StartCheckTest(ServerCase):
    def test_a_budget_below_the_fixed_part_is_refused_naming_the_flag(self):
        line = self.refused(os.path.join(self.dir, "st"), "--memory-gb", "0.1")
        self.assertIn("--memory-gb 0.1 is less than the aggregator holds", line)
        self.assertIn("raise --memory-gb to at least", line)
        self.assertFalse(os.path.exists(os.path.join(self.dir, "st", "state.json")), "nothing was created")

    def test_a_budget_that_shared_memory_cannot_hold_is_refused_naming_the_flag(self):
        shm = tmpfs(self, os.path.join(self.dir, "shm"), "4m")
        line = self.refused(os.path.join(self.dir, "st"), "--memory-gb", "1",
                            env=self.env(**{fedmom_merge.SHM_ENV: shm}))
        self.assertIn("--memory-gb 1 puts", line)
        self.assertIn("lower --memory-gb to", line)
        self.assertIn("mount -o remount,size=", line)

    def test_an_outer_dir_too_small_for_what_the_budget_leaves_on_disk_is_refused_naming_the_flag(self):
        outer = tmpfs(self, os.path.join(self.dir, "outer"), "1m")
        line = self.refused(os.path.join(self.dir, "st"), "--memory-gb", f"{(self.fixed() + 1000) / 1e9:.9f}",
                            "--outer-dir", outer)
        self.assertIn("on disk and --outer-dir", line)
        self.assertIn("point --outer-dir at a larger disk, or raise --memory-gb", line)

    def test_the_default_budget_on_a_small_shared_memory_keeps_the_rest_on_disk_and_merges(self):
        # Schedule: /dev/shm (here a 4 MiB tmpfs) holds less than the outer state (5.2 MB): the
        # default budget takes what it has free and puts the rest in --outer-dir; the round merges
        # and the replay in one thread gives its digest. (Before, such a start was refused.)
        shm = tmpfs(self, os.path.join(self.dir, "shm"), "4m")
        sd = os.path.join(self.dir, "st")
        proc, url, out = self.start(sd, env=self.env(**{fedmom_merge.SHM_ENV: shm}))
        self.send_round(url, 0)
        self.wait_round(url, 1, out)
        self.assertIn(f"what {shm} has free", out.text())
        self.stop(proc)
        cfg = fs.ServerConfig(sd, down_wire="int4", fsync=False, merge_procs=1).validate()
        st = fs.FedMomState(cfg, clock=lambda: 1000.0)
        self.addCleanup(st.keeper.close)
        self.assertEqual(st.outer.round, 1)


class DiskErrorTest(ServerCase):
    def test_a_disk_error_on_a_file_block_fails_the_round_loudly_and_publishes_nothing(self):
        # Schedule: --outer-dir on an ext4 file system of its own (a loop device), most of the
        # outer state there; round 0 merged; the file system shut down (every I/O now EIO, as a
        # disk that died); round 1 sent. The round must fail (merge_error naming the I/O error
        # and the file block), the process live (no SIGBUS), round 1 not published (no update,
        # the round number unchanged), and after a restart on a working disk round 1 merges
        # from the spool, every logged round replayed to its recorded digest.
        if shutil.which("mkfs.ext4") is None:
            self.skipTest("no mkfs.ext4")
        img, mnt = os.path.join(self.dir, "outer.img"), os.path.join(self.dir, "outer")
        os.makedirs(mnt)
        with open(img, "wb") as f:
            f.truncate(64 << 20)
        subprocess.run(["mkfs.ext4", "-q", "-F", img], check=True, capture_output=True)
        r = subprocess.run(["mount", "-o", "loop", img, mnt], capture_output=True, text=True)
        if r.returncode != 0:
            self.skipTest(f"cannot mount a loop device ({r.stderr.strip() or r.returncode}); run as root")
        self.addCleanup(subprocess.run, ["umount", "-l", mnt], capture_output=True)
        sd = os.path.join(self.dir, "st")
        flags = ("--memory-gb", f"{(self.fixed() + 1_000_000) / 1e9:.9f}", "--outer-dir", mnt,
                 "--checkpoint-rounds", "10")
        proc, url, out = self.start(sd, *flags)
        self.send_round(url, 0)
        self.wait_round(url, 1, out)
        fd = os.open(mnt, os.O_RDONLY)
        try:
            fcntl.ioctl(fd, FS_IOC_SHUTDOWN, (2).to_bytes(4, "little"))     # NOLOGFLUSH
        except OSError as e:
            self.skipTest(f"cannot shut the file system down ({e})")
        finally:
            os.close(fd)
        self.send_round(url, 1)
        st = wait_for(lambda: (lambda s: s["merge_error"] and s)(httpc.call(url, "GET", "/status")), HANG_S)
        self.assertTrue(st, "the round never failed; the server said:\n" + out.text()[-3000:])
        self.assertIn("Input/output error", st["merge_error"])
        self.assertIn("--outer-dir", st["merge_error"])
        self.assertIsNone(proc.poll(), "the aggregator died")
        self.assertEqual(st["round"], 1)
        self.assertFalse(os.path.exists(os.path.join(sd, "update-2.safetensors")), "round 1's update was published")
        with open(os.path.join(sd, "state.json")) as f:
            self.assertEqual(json.load(f)["round"], 1)
        self.stop(proc)
        subprocess.run(["umount", "-l", mnt], check=True)
        proc, url, out = self.start(sd, *flags[:2], "--outer-dir", os.path.join(self.dir, "outer2"), *flags[4:])
        self.wait_round(url, 2, out)
        self.stop(proc)
        cfg = fs.ServerConfig(sd, down_wire="int4", fsync=False, merge_procs=1, checkpoint_rounds=10).validate()
        st = fs.FedMomState(cfg, clock=lambda: 1000.0)
        self.addCleanup(st.keeper.close)
        self.assertEqual((st.outer.round, st.outer.digest), (2, st.log[-1].digest))


class PlanTest(unittest.TestCase):
    def plan(self, *args):
        p = subprocess.run([sys.executable, "fedmom_server.py", "plan", *args], cwd=ROOT, capture_output=True,
                           text=True, timeout=HANG_S)
        self.assertEqual(p.returncode, 0, p.stderr)
        return p.stdout

    def test_plan_prints_the_memory_the_disk_and_the_seconds_of_a_round_in_each_mode(self):
        out = self.plan("--params", "8e9", "--sites", "2", "--down-wire", "int4", "--memory-gb", "48")
        for line in ("plan: 8.000G parameters", "--memory-gb 48.00", "outer state 96.00 GB", "on disk (--outer-dir)",
                     "state dir: checkpoint", "blob store", "in all", "all in memory", "nothing in memory"):
            self.assertIn(line, out)
        mem, disk = outer_state.Budget(48 * 10**9, outer_state.shapes_of(8 * 10**9), KINDS, INT4, 16).split()
        self.assertIn(f"{mem / 1e9:.2f} GB in memory", out)
        self.assertIn(f"{disk / 1e9:.2f} GB on disk", out)

    def test_plan_reads_a_models_shapes_from_its_init_file(self):
        d = tempfile.mkdtemp(prefix="budget-plan-")
        self.addCleanup(shutil.rmtree, d, True)
        init = os.path.join(d, "init.safetensors")
        with tensorio.TensorWriter(init, [(n, "BF16", s) for n, s in SHAPES.items()], fsync=False) as w:
            for n, s in SHAPES.items():
                w.write(n, np.zeros(s, np.float32))
        out = self.plan("--init", init, "--down-wire", "f32", "--outer-momentum", "0")
        params = sum(int(np.prod(s)) for s in SHAPES.values())
        self.assertIn(f"plan: {params / 1e9:.3f}G parameters", out)
        self.assertIn("largest tensor 0.2M values", out)
        self.assertIn("(theta: 4 B/param)", out)


class BudgetTest(unittest.TestCase):
    def test_theta_goes_in_memory_first_then_the_momentum_then_the_residual(self):
        b = outer_state.Budget(0, SHAPES, KINDS, INT4, 2)
        theta = 4 * sum(int(np.prod(s)) for s in SHAPES.values())
        at = lambda extra: outer_state.Budget(b.minimum() + extra, SHAPES, KINDS, INT4, 2)
        self.assertEqual(at(0).placement(), {k: set(SHAPES) for k in KINDS})
        self.assertEqual(at(theta).placement(), {"theta": set(), "momentum": set(SHAPES), "residual": set(SHAPES)})
        self.assertEqual(at(theta).split(), (theta, 2 * theta))
        self.assertEqual(at(3 * theta).split(), (3 * theta, 0))
        part = at(4 * 700 * 320).placement()                  # the embedding alone fits
        self.assertEqual(part["theta"], set(SHAPES) - {"embed"})

    def test_the_fixed_part_at_32b_with_nothing_in_memory_is_below_the_original_designs_10_gib(self):
        b = outer_state.Budget(0, outer_state.shapes_of(32 * 10**9), KINDS, INT4, 16)
        self.assertLess(b.minimum(), 10 * 2**30)
        self.assertEqual(b.split()[0], 0)


if __name__ == "__main__":
    unittest.main()
