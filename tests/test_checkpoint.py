"""checkpoint.py: save on 4 gloo ranks (DiLoCo k=2, DDP or FSDP2 inside each replica),
resume on 2 ranks and on 1, in both formats; atomic pointer and pruning in one process."""
import json
import os
import shutil
import sys
import tempfile
import unittest

import torch
import torch.distributed as dist

import checkpoint
import diloco
from fixtures import spawn
from outer_state import OUTER_LR, OUTER_MOMENTUM

H = 2
ROWS = []                  # diloco rows of this process


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2 = torch.nn.Linear(6, 10), torch.nn.Linear(10, 3)

    def forward(self, x):
        return self.l2(torch.tanh(self.l1(x)))


def build(rank, world, k, parallel, seed):
    """Net wrapped for `parallel` inside replicas of a k-replica layout, DiLoCo, AdamW."""
    torch.manual_seed(seed)
    net = Net()
    layout = diloco.ReplicaLayout.build(world, rank, k)
    if parallel == "fsdp":
        from torch.distributed.fsdp import fully_shard
        mesh = layout.mesh["shard"]
        fully_shard(net.l1, mesh=mesh)
        fully_shard(net.l2, mesh=mesh)
        model = fully_shard(net, mesh=mesh)
    elif parallel == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(net, process_group=layout.inner_group)
    else:
        model = net
    config = diloco.DiLoCoConfig(inner_steps=H, outer_lr=OUTER_LR, outer_momentum=OUTER_MOMENTUM)
    outer = diloco.DiLoCo(model, layout, config)
    opt = torch.optim.AdamW(net.parameters(), lr=0.01)
    return net, model, outer, opt


def full(t):
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def snapshot(net, outer, opt):
    """Whole tensors by name: weights, outer momentum, inner AdamW state (collective under FSDP)."""
    names = [n for n, _ in net.named_parameters()]
    snap = {"params": {n: full(p) for n, p in net.named_parameters()},
            "momentum": {n: full(diloco_mom) for n, diloco_mom in
                         zip(names, checkpoint._momentum_sharded(outer).values())},
            "opt": {}, "counters": {k: v for k, v in outer.counters().items() if k != "config"}}
    for n, p in net.named_parameters():
        st = opt.state.get(p, {})
        snap["opt"][n] = {k: full(v) if torch.is_tensor(v) and v.dim() else float(v) for k, v in st.items()}
    return snap


def train_step(model, opt, outer, gen):
    x = torch.randn(8, 6, generator=gen)
    loss = torch.nn.functional.mse_loss(model(x), x[:, :3].sin())
    opt.zero_grad()
    loss.backward()
    opt.step()
    row = outer.after_inner_step()
    if row is not None:
        ROWS.append(row)
    return loss.item()


def save_worker(rank, world, tmp, parallel):
    net, model, outer, opt = build(rank, world, 2, parallel, seed=rank)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(2 * H + 1):                      # two outer steps, then one step into a phase
        train_step(model, opt, outer, gen)
    replica_before = snapshot(net, outer, opt)
    probe = torch.randn(4, 6, generator=torch.Generator().manual_seed(99))
    with outer.global_weights():
        theta = snapshot(net, outer, opt)
        with torch.no_grad():
            theta["forward"] = model(probe)          # FSDP gathers what the swap wrote
    extra = {"epoch": 3, "leases": ["a", "b"]}
    checkpoint.save(os.path.join(tmp, f"c-{parallel}"), 2 * H + 1, model, opt, extra, diloco=outer)
    checkpoint.save(os.path.join(tmp, f"s-{parallel}"), 2 * H + 1, model, opt, extra, diloco=outer,
                    sharded=True)
    after = snapshot(net, outer, opt)
    torch.save({"replica": replica_before, "theta": theta, "after": after, "rows": list(ROWS)},
               os.path.join(tmp, f"save-{parallel}-rank{rank}.pt"))


def load_worker(rank, world, tmp, parallel):
    inner = parallel if world > 1 else "none"
    out = {}
    for fmt in ("c", "s"):
        net, model, outer, opt = build(rank, world, 1, inner, seed=1000 + rank)
        extra = checkpoint.load_latest(os.path.join(tmp, f"{fmt}-{parallel}"), model, opt, diloco=outer)
        out[fmt] = {"extra": extra, "snap": snapshot(net, outer, opt)}
        out[fmt]["loss"] = train_step(model, opt, outer, torch.Generator().manual_seed(5))
    torch.save(out, os.path.join(tmp, f"load-{parallel}-{world}-rank{rank}.pt"))


class ResumeOtherWorldSize:
    parallel = None

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix=f"ckpt-{cls.parallel}-")
        spawn(save_worker, 4, cls.tmp, cls.parallel)
        spawn(load_worker, 2, cls.tmp, cls.parallel)
        spawn(load_worker, 1, cls.tmp, cls.parallel)
        ld = lambda name: torch.load(os.path.join(cls.tmp, name), weights_only=False)
        cls.saved = [ld(f"save-{cls.parallel}-rank{r}.pt") for r in range(4)]
        cls.loaded = {w: [ld(f"load-{cls.parallel}-{w}-rank{r}.pt") for r in range(w)] for w in (2, 1)}

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def assertTensorsEqual(self, got, want, what):
        self.assertEqual(sorted(got), sorted(want), what)
        for n in want:
            if isinstance(want[n], dict):
                self.assertTensorsEqual(got[n], want[n], f"{what}.{n}")
            elif torch.is_tensor(want[n]):
                self.assertTrue(torch.equal(got[n], want[n]), f"{what}.{n}")
            else:
                self.assertEqual(got[n], want[n], f"{what}.{n}")

    def test_save_stores_theta_and_leaves_the_replica_alone(self):
        s = self.saved
        # mid-phase: replicas differ, theta is one tensor set on every rank
        self.assertFalse(torch.equal(s[0]["replica"]["params"]["l1.weight"], s[2]["replica"]["params"]["l1.weight"]))
        for r in range(4):
            self.assertTensorsEqual(s[r]["theta"]["params"], s[0]["theta"]["params"], f"theta rank {r}")
            self.assertTensorsEqual(s[r]["after"]["params"], s[r]["replica"]["params"], f"replica rank {r}")
        self.assertGreater(float(s[0]["theta"]["momentum"]["l1.weight"].abs().sum()), 0)
        plain = Net()
        plain.load_state_dict(s[0]["theta"]["params"])
        probe = torch.randn(4, 6, generator=torch.Generator().manual_seed(99))
        for r in range(4):
            torch.testing.assert_close(s[r]["theta"]["forward"], plain(probe).detach())

    def test_metrics_are_whole_model_norms(self):
        """Under FSDP each rank holds a shard: the norms must be reduced over the replica."""
        rows = [self.saved[r]["rows"] for r in range(4)]
        self.assertEqual(len(rows[0]), 2)
        for i in range(2):
            self.assertEqual(rows[0][i]["delta_norm"], rows[1][i]["delta_norm"])
            self.assertEqual(rows[2][i]["delta_norm"], rows[3][i]["delta_norm"])
            self.assertNotEqual(rows[0][i]["delta_norm"], rows[2][i]["delta_norm"])
            for r in range(4):
                self.assertAlmostEqual(rows[r][i]["avg_delta_norm"], rows[0][i]["avg_delta_norm"], places=6)

    def _check_resume(self, world, fmt):
        want = self.saved[0]["theta"]                       # replica 0's inner state, theta weights
        for r in range(world):
            got = self.loaded[world][r][fmt]
            what = f"{fmt} 4->{world} rank {r}"
            self.assertEqual(got["extra"], {"epoch": 3, "leases": ["a", "b"], "step": 2 * H + 1}, what)
            self.assertTensorsEqual(got["snap"]["params"], want["params"], what + " params")
            self.assertTensorsEqual(got["snap"]["momentum"], want["momentum"], what + " momentum")
            self.assertTensorsEqual(got["snap"]["opt"], want["opt"], what + " adamw")
            self.assertEqual(got["snap"]["counters"], {"inner_step": 5, "phase_steps": 1, "outer_step": 2}, what)
            self.assertTrue(0 < got["loss"] < 10, what)

    def test_consolidated_4_to_2(self):
        self._check_resume(2, "c")

    def test_consolidated_4_to_1(self):
        self._check_resume(1, "c")

    def test_sharded_4_to_2(self):
        self._check_resume(2, "s")

    def test_sharded_4_to_1(self):
        self._check_resume(1, "s")

    def test_layout_on_disk(self):
        for fmt, name in (("c", "step_000000005.pt"), ("s", "step_000000005")):
            cdir = os.path.join(self.tmp, f"{fmt}-{self.parallel}", "checkpoints")
            self.assertEqual(sorted(os.listdir(cdir)), sorted([name, "latest"]))
            with open(os.path.join(cdir, "latest")) as f:
                self.assertEqual(f.read(), name + "\n")
        with open(os.path.join(self.tmp, f"s-{self.parallel}", "checkpoints", "step_000000005", "meta.json")) as f:
            meta = json.load(f)
        self.assertEqual((meta["format"], meta["world_size"], meta["step"]), (checkpoint.FORMAT, 4, 5))


class ResumeDDPTest(ResumeOtherWorldSize, unittest.TestCase):
    parallel = "ddp"


class ResumeFSDPTest(ResumeOtherWorldSize, unittest.TestCase):
    parallel = "fsdp"


def grow_worker(rank, world, tmp, load_from, parallel, k, save_to):
    """On `world` ranks (`parallel` inside k replicas): resume from the checkpoints of a
    smaller run (both formats) if `load_from`, train, then save both formats to `save_to`."""
    inner = parallel if world > 1 else "none"
    out = {"loaded": {}}
    net, model, outer, opt = build(rank, world, k, inner, seed=1000 + rank)
    if load_from:
        for fmt in ("c", "s"):
            net, model, outer, opt = build(rank, world, k, inner, seed=1000 + rank)
            extra = checkpoint.load_latest(os.path.join(tmp, f"{load_from}-{fmt}"), model, opt, diloco=outer)
            out["loaded"][fmt] = {"extra": extra, "snap": snapshot(net, outer, opt)}
    gen = torch.Generator().manual_seed(rank)
    for _ in range(2 * H + 1):                      # two outer steps, then one step into a phase
        train_step(model, opt, outer, gen)
    with outer.global_weights():
        out["theta"] = snapshot(net, outer, opt)
    step = outer.counters()["inner_step"]
    for fmt in ("c", "s"):
        checkpoint.save(os.path.join(tmp, f"{save_to}-{fmt}"), step, model, opt, {"world": world},
                        diloco=outer, sharded=fmt == "s")
    torch.save(out, os.path.join(tmp, f"grow-{save_to}-rank{rank}.pt"))


class ResumeOnMoreRanksTest(unittest.TestCase):
    """A checkpoint of 1 plain process resumed on 2 FSDP ranks, and one of those 2 ranks
    resumed on 4 (DDP inside 2 DiLoCo replicas): the job got more nodes."""

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="ckpt-grow-")
        spawn(grow_worker, 1, cls.tmp, None, "none", 1, "w1")
        spawn(grow_worker, 2, cls.tmp, "w1", "fsdp", 1, "w2")
        spawn(grow_worker, 4, cls.tmp, "w2", "ddp", 2, "w4")
        ld = lambda name: torch.load(os.path.join(cls.tmp, name), weights_only=False)
        cls.runs = {w: [ld(f"grow-w{w}-rank{r}.pt") for r in range(w)] for w in (1, 2, 4)}

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    assertTensorsEqual = ResumeOtherWorldSize.assertTensorsEqual

    def _check_grow(self, src, dst):
        want = self.runs[src][0]["theta"]                 # what the smaller run saved (theta, its inner state)
        for fmt in ("c", "s"):
            for r in range(dst):
                got = self.runs[dst][r]["loaded"][fmt]
                what = f"{fmt} {src}->{dst} rank {r}"
                self.assertEqual(got["extra"], {"world": src, "step": want["counters"]["inner_step"]}, what)
                self.assertTensorsEqual(got["snap"]["params"], want["params"], what + " params")
                self.assertTensorsEqual(got["snap"]["momentum"], want["momentum"], what + " momentum")
                self.assertTensorsEqual(got["snap"]["opt"], want["opt"], what + " adamw")
                self.assertEqual(got["snap"]["counters"], want["counters"], what)
        self.assertEqual(self.runs[1][0]["theta"]["counters"], {"inner_step": 5, "phase_steps": 1, "outer_step": 2})
        self.assertEqual(self.runs[2][0]["theta"]["counters"], {"inner_step": 10, "phase_steps": 0, "outer_step": 5})
        self.assertGreater(float(want["momentum"]["l1.weight"].abs().sum()), 0, "a real outer momentum")

    def test_one_rank_to_two(self):
        self._check_grow(1, 2)

    def test_two_ranks_to_four(self):
        self._check_grow(2, 4)

    def test_the_bigger_runs_trained_on(self):
        for w in (2, 4):
            theta = [self.runs[w][r]["theta"]["params"] for r in range(w)]
            for r in range(1, w):
                self.assertTensorsEqual(theta[r], theta[0], f"theta on {w} ranks, rank {r}")
            self.assertFalse(torch.equal(theta[0]["l1.weight"], self.runs[w // 2][0]["theta"]["params"]["l1.weight"]))


class SingleProcessTest(unittest.TestCase):
    """No process group at all: the plain-module path, pointer, pruning, crash leftovers."""

    def setUp(self):
        self.run_dir = tempfile.mkdtemp(prefix="ckpt-single-")
        self.addCleanup(shutil.rmtree, self.run_dir, ignore_errors=True)
        torch.manual_seed(0)
        self.net = Net()
        self.opt = torch.optim.AdamW(self.net.parameters(), lr=0.1)

    def step(self):
        self.opt.zero_grad()
        self.net(torch.randn(4, 6)).square().mean().backward()
        self.opt.step()

    def test_keep_last_n_and_latest_pointer(self):
        self.assertIsNone(checkpoint.load_latest(self.run_dir, self.net, self.opt))
        for step in (10, 20, 30):
            self.step()
            sharded = step == 20
            checkpoint.save(self.run_dir, step, self.net, self.opt, {"s": step}, sharded=sharded, keep=2)
        cdir = checkpoint.checkpoint_dir(self.run_dir)
        self.assertEqual(sorted(os.listdir(cdir)), ["latest", "step_000000020", "step_000000030.pt"])
        want = {n: p.detach().clone() for n, p in self.net.named_parameters()}
        self.step()
        self.assertEqual(checkpoint.load_latest(self.run_dir, self.net, self.opt), {"s": 30, "step": 30})
        for n, p in self.net.named_parameters():
            self.assertTrue(torch.equal(p, want[n]), n)
        self.assertEqual(checkpoint.load(os.path.join(cdir, "step_000000020"), self.net, self.opt)["step"], 20)

    def test_crash_leftovers_are_ignored_then_cleaned(self):
        checkpoint.save(self.run_dir, 1, self.net, self.opt)
        cdir = checkpoint.checkpoint_dir(self.run_dir)
        with open(os.path.join(cdir, "step_000000002.pt.tmp"), "wb") as f:
            f.write(b"half a checkpoint")                   # killed while writing step 2
        self.assertTrue(checkpoint.latest(self.run_dir).endswith("step_000000001.pt"))
        os.unlink(os.path.join(cdir, "latest"))             # and even without the pointer
        self.assertTrue(checkpoint.latest(self.run_dir).endswith("step_000000001.pt"))
        checkpoint.save(self.run_dir, 3, self.net, self.opt)
        self.assertNotIn("step_000000002.pt.tmp", os.listdir(cdir))

    def test_the_optimizer_keeps_its_own_kernel_choice_across_a_resume(self):
        # a GPU run's checkpoint (fused AdamW) resumed where the run builds foreach, and back
        fused = torch.optim.AdamW(self.net.parameters(), lr=0.1, fused=True)
        fused.zero_grad()
        self.net(torch.randn(4, 6)).square().mean().backward()
        fused.step()
        self.net.zero_grad(set_to_none=True)       # as in a fresh run: no gradients before the load
        for sharded in (False, True):
            path = checkpoint.save(self.run_dir, 5 + sharded, self.net, fused, sharded=sharded)
            plain = torch.optim.AdamW(self.net.parameters(), lr=0.1)
            checkpoint.load(path, self.net, plain)
            self.assertEqual([(g["fused"], g["foreach"]) for g in plain.param_groups], [(None, None)],
                             "the loaded state, not the writer's kernel choice")
            self.assertEqual(plain.state_dict()["state"][0]["step"].item(), 1.0, "the state itself was loaded")
            again = torch.optim.AdamW(self.net.parameters(), lr=0.1, fused=True)
            checkpoint.save(self.run_dir, 7 + sharded, self.net, plain, sharded=sharded)
            checkpoint.load(checkpoint.latest(self.run_dir), self.net, again)
            self.assertEqual([g["fused"] for g in again.param_groups], [True])
            self.net.zero_grad(set_to_none=True)

    def test_refuses_other_format_and_non_json_extra(self):
        path = checkpoint.save(self.run_dir, 1, self.net, self.opt)
        blob = torch.load(path, weights_only=True)
        blob["meta_json"] = json.dumps(dict(json.loads(blob["meta_json"]), format="pww-checkpoint/0"))
        torch.save(blob, path)
        with self.assertRaisesRegex(ValueError, "pww-checkpoint/0"):
            checkpoint.load(path, self.net, self.opt)
        with self.assertRaises(TypeError):
            checkpoint.save(self.run_dir, 2, self.net, self.opt, {"x": object()})
        self.assertFalse(os.path.exists(os.path.join(checkpoint.checkpoint_dir(self.run_dir), "step_000000002.pt")))


if __name__ == "__main__":
    sys.exit("run with: .venv/bin/python tests/run.py test_checkpoint")
