"""DiLoCo on real gloo process groups: 4 CPU ranks spawned once, several checks per spawn.

The workers record what they observe (group members, weights, metrics rows) into
one file per rank; the test methods compare those against references computed
here: torch's own SGD(nesterov=True) and a five-line numpy Nesterov step.
"""
import math
import os
import shutil
import sys
import tempfile
import unittest

import numpy as np
import torch
import torch.distributed as dist

import diloco
from fixtures import spawn
from outer_state import OUTER_LR, OUTER_MOMENTUM

WORLD = 4
H = 2                      # inner steps per outer step in the arithmetic check
OUTER_STEPS = 3
NESTEROV = {"outer_lr": OUTER_LR, "outer_momentum": OUTER_MOMENTUM}    # train.py's defaults


# --------------------------------------------------------------- prepared values

def replica_values(replica, step):
    """What replica r's two parameters hold at the end of outer phase `step`: exact
    binary fractions, so the mean over replicas is exact in fp32."""
    a = torch.arange(6, dtype=torch.float32).view(2, 3) * 0.25 + replica * 0.5 - step * 0.125
    b = torch.full((4,), float(replica * replica) * 0.25 + step)
    return a, b


THETA0 = (torch.ones(2, 3) * 0.5, torch.full((4,), -1.0))


class TwoParams(torch.nn.Module):
    def __init__(self, a, b):
        super().__init__()
        self.a = torch.nn.Parameter(a.clone())
        self.b = torch.nn.Parameter(b.clone())


def _arith(rank, layout, config, steps):
    """Run `steps` outer phases of H prepared inner steps; return theta after each and the rows."""
    model = TwoParams(*[t + layout.replica for t in THETA0])   # replicas differ: theta(0) must fix it
    outer = diloco.DiLoCo(model, layout, config)
    theta0 = [p.detach().clone() for p in model.parameters()]
    thetas, rows = [], []
    for s in range(steps):
        for i in range(H):
            with torch.no_grad():
                for p, v in zip(model.parameters(), replica_values(layout.replica, s)):
                    p.copy_(v)
            row = outer.after_inner_step()
            assert (row is None) == (i < H - 1), (i, row)
        rows.append(row)
        thetas.append([p.detach().clone() for p in model.parameters()])
    return {"theta0": theta0, "thetas": thetas, "rows": rows, "state": outer.state_dict()}


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2 = torch.nn.Linear(5, 8), torch.nn.Linear(8, 1)

    def forward(self, x):
        return self.l2(torch.tanh(self.l1(x)))


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def _ddp_reconverge(rank, layout):
    """DDP inside each 2-rank replica, FedAvg every 3 steps; record weights at key moments."""
    torch.manual_seed(100 + rank)                          # a different model on every rank
    net = Net()
    before = _flat(net)
    ddp = torch.nn.parallel.DistributedDataParallel(net, process_group=layout.inner_group)
    outer = diloco.DiLoCo(ddp, layout, diloco.DiLoCoConfig.fedavg(inner_steps=3))
    start = _flat(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(7 + rank)           # different data on every rank
    rec = {"before": before, "start": start, "rows": []}

    def step():
        x = torch.randn(16, 5, generator=gen)
        y = x.sum(1, keepdim=True) * (1 + layout.replica)   # replicas learn different targets
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        return outer.after_inner_step()

    step(); step()
    rec["mid"] = _flat(net)
    rec["rows"].append(step())
    rec["after_outer"] = _flat(net)
    step()
    rec["drifted"] = _flat(net)
    with outer.global_weights():
        rec["inside_global"] = _flat(net)
    rec["after_global"] = _flat(net)
    rec["flush"] = outer.finish()
    rec["after_flush"] = _flat(net)
    rec["finish_again"] = outer.finish()
    return rec


def worker(rank, world, tmp):
    out = {"layouts": {}}
    for k in (1, 2, 4):
        lay = diloco.ReplicaLayout.build(world, rank, k)
        inner = torch.tensor([float(rank)])
        outer = torch.tensor([float(rank)])
        dist.all_reduce(inner, group=lay.inner_group)
        dist.all_reduce(outer, group=lay.outer_group)
        out["layouts"][k] = {
            "replica": lay.replica, "local_index": lay.local_index,
            "inner_ranks": lay.inner_ranks, "outer_ranks": lay.outer_ranks,
            "inner_members": dist.get_process_group_ranks(lay.inner_group),
            "outer_members": dist.get_process_group_ranks(lay.outer_group),
            "inner_sum": inner.item(), "outer_sum": outer.item()}
        out.setdefault("layout_objs", {})[k] = lay
    lays = out.pop("layout_objs")
    nesterov = diloco.DiLoCoConfig(inner_steps=H, **NESTEROV)
    out["nesterov_k4"] = _arith(rank, lays[4], nesterov, OUTER_STEPS)
    out["nesterov_k2"] = _arith(rank, lays[2], nesterov, OUTER_STEPS)
    out["fedavg_k2"] = _arith(rank, lays[2], diloco.DiLoCoConfig.fedavg(H), 2)
    out["cpu_k2"] = _arith(rank, lays[2], diloco.DiLoCoConfig(inner_steps=H, outer_device="cpu", **NESTEROV), 2)
    out["ddp"] = _ddp_reconverge(rank, lays[2])
    # state round trip: a fresh DiLoCo restored from the arithmetic run's state
    fresh = TwoParams(*THETA0)
    outer = diloco.DiLoCo(fresh, lays[2], nesterov)
    outer.load_state_dict(out["nesterov_k2"]["state"])
    out["restored"] = outer.state_dict()
    out["restored_params"] = [p.detach().clone() for p in fresh.parameters()]
    torch.save(out, os.path.join(tmp, f"rank{rank}.pt"))


# --------------------------------------------------------------- references

def reference_thetas(k, config, steps):
    """torch.optim.SGD on a standalone copy of theta, grad = mean of the replicas' deltas."""
    theta = [t.clone() for t in THETA0]                     # replica 0, rank 0 initialises
    opt = torch.optim.SGD(theta, lr=config.outer_lr, momentum=config.outer_momentum,
                          nesterov=config.outer_optimizer == "nesterov")
    out = []
    for s in range(steps):
        vals = [replica_values(r, s) for r in range(k)]
        for i, t in enumerate(theta):
            t.grad = sum(t - v[i] for v in vals) / k
        opt.step()
        out.append([t.clone() for t in theta])
    return out


def numpy_nesterov(k, lr, mom, steps):
    """The same outer optimizer written out: m = mom*m + g; theta -= lr*(g + mom*m)."""
    theta = [t.numpy().astype(np.float64) for t in THETA0]
    m = [np.zeros_like(t) for t in theta]
    out = []
    for s in range(steps):
        vals = [[v.numpy().astype(np.float64) for v in replica_values(r, s)] for r in range(k)]
        for i in range(len(theta)):
            g = sum(theta[i] - v[i] for v in vals) / k
            m[i] = mom * m[i] + g
            theta[i] = theta[i] - lr * (g + mom * m[i])
        out.append([t.copy() for t in theta])
    return out


class OverlapFoldTest(unittest.TestCase):
    """--overlap's fold (diloco.fold) against a numpy reference, and over a run of phases:
    a one-site aggregator that applies each delta it merges (FedAvg: theta += delta) ends at
    theta(0) plus exactly the progress of the merged phases; an unmerged phase's progress
    is dropped by the next fold, so nothing is trained into theta twice."""

    def test_fold_is_theta_plus_what_was_trained_since_the_send(self):
        rng = np.random.default_rng(0)
        theta, sent = rng.normal(size=(3, 5)).astype(np.float32), rng.normal(size=(3, 5)).astype(np.float32)
        local = sent + rng.normal(scale=1e-2, size=(3, 5)).astype(np.float32)
        got = torch.from_numpy(local.copy())
        diloco.fold(got, torch.from_numpy(theta), torch.from_numpy(sent))
        np.testing.assert_array_equal(got.numpy(), theta + (local - sent))
        same = torch.from_numpy(sent.copy())          # nothing trained since the send: theta exactly
        diloco.fold(same, torch.from_numpy(theta), torch.from_numpy(sent))
        np.testing.assert_array_equal(same.numpy(), theta)

    def test_delayed_outer_updates_keep_each_merged_phase_once(self):
        rng = np.random.default_rng(1)
        phases = 7
        progress = [rng.normal(size=(4, 6)).astype(np.float64) for _ in range(phases)]
        merged = [True, True, False, True, False, False, True]
        theta0 = rng.normal(size=(4, 6))
        theta = theta0.copy()                         # the aggregator's
        model = torch.from_numpy(theta0.copy())       # the site's weights
        base, sent, in_flight = torch.from_numpy(theta0.copy()), None, None
        for k in range(phases):
            model += torch.from_numpy(progress[k])    # "train" phase k
            if in_flight is not None:                  # phase k's end: round trip k-1, then the fold
                delta, ok = in_flight
                if ok:
                    theta = theta + delta
                base = torch.from_numpy(theta.copy())
                diloco.fold(model, base, sent)
            in_flight = ((model - base).numpy().copy(), merged[k])    # send delta k, train on
            sent = model.clone()
        delta, ok = in_flight                          # the last round trip
        theta = theta + delta if ok else theta
        want = theta0 + sum(p for p, m in zip(progress, merged) if m)
        np.testing.assert_allclose(theta, want, rtol=0, atol=1e-12)


class LaterCarrier(diloco.OuterCarrier):
    """A carrier whose theta comes later, as FedMomCarrier's does under --overlap: its outer
    step keeps the deltas it was given and answers theta_later (eager: and the eager proxy,
    as under --overlap-fold eager)."""

    def __init__(self, eager=False):
        self.deltas, self.eager = None, eager

    def broadcast_initial(self, tensors):
        pass

    def outer_step(self, ex):
        self.deltas = [d.clone() for d in ex.deltas]
        return diloco.OuterResult(theta_later=True, outcome="in flight", eager=self.eager)


def naive_step(theta, m, g, lr, mu):
    """The naive reference: one step of SGD(lr, momentum=mu, nesterov=True, dampening=0) in
    float64 -> (new theta, new buffer)."""
    buf = mu * m + g
    return theta - lr * (g + mu * buf), buf


class EagerTest(unittest.TestCase):
    """--overlap-fold eager (FEDERATION_GUIDE.md section 4, "Overlap"): the proxy a site starts
    its next phase from is one Nesterov step of its own delta (against the numpy reference);
    the site's estimate of the aggregator's momentum, recovered from the thetas it receives,
    is the aggregator's buffer; and the fold replaces the proxy by the real theta, keeping only
    what was trained since the send."""
    LR, MU = 0.7, 0.9

    def test_eager_step_is_a_nesterov_step_of_the_own_delta(self):
        rng = np.random.default_rng(2)
        theta, g, m = (rng.normal(size=(5, 7)) for _ in range(3))
        want, _ = naive_step(theta, m, g, self.LR, self.MU)
        t32 = [torch.from_numpy(x.astype(np.float32)) for x in (theta, g, m)]
        got = diloco.eager_step(*t32, self.LR, self.MU)
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-6)
        self.assertTrue(torch.equal(t32[2], torch.from_numpy(m.astype(np.float32))), "the buffer is left as it is")
        # torch's own optimizer agrees, and momentum 0 is a plain step
        p = torch.nn.Parameter(t32[0].clone())
        opt = torch.optim.SGD([p], lr=self.LR, momentum=self.MU, nesterov=True)
        opt.state[p]["momentum_buffer"] = t32[2].clone()
        p.grad = t32[1].clone()
        opt.step()
        np.testing.assert_allclose(got.numpy(), p.detach().numpy(), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(diloco.eager_step(t32[0], t32[1], None, 1.0, 0.0).numpy(), theta - g,
                                   rtol=1e-6, atol=1e-6)

    def _site(self):
        model = TwoParams(*THETA0)
        cfg = diloco.DiLoCoConfig(inner_steps=H, outer_lr=self.LR, outer_momentum=self.MU)
        return model, diloco.DiLoCo(model, diloco.ReplicaLayout.plan(1, 0, 1), cfg, LaterCarrier(eager=True))

    def test_the_momentum_estimate_follows_the_aggregators_buffer(self):
        # an aggregator's rounds in float64 (its first buffer is g: a zero buffer's step); the
        # site sees each new theta (steps=1), then three rounds at once whose steps were equal
        rng = np.random.default_rng(3)
        model, outer = self._site()
        theta = [t.double().numpy() for t in THETA0]
        m = [np.zeros_like(x) for x in theta]
        for r in range(6):
            gs = [rng.normal(scale=0.1, size=x.shape) for x in theta]
            theta, m = map(list, zip(*(naive_step(t, b, g, self.LR, self.MU) for t, b, g in zip(theta, m, gs))))
            with outer.receive_theta(steps=1) as held:
                for h, x in zip(held, theta):
                    h.copy_(torch.from_numpy(x))
            for est, want in zip(outer.momentum(), m):
                np.testing.assert_allclose(est.numpy(), want, rtol=1e-4, atol=1e-5, err_msg=f"round {r + 1}")
        gs = [rng.normal(scale=0.1, size=x.shape) for x in theta]
        for _ in range(3):       # the same update three times: u = -lr*(g + mu*buf) equal in each round
            u = [-0.05 * g for g in gs]
            m = [(self.MU * b - x / self.LR) / (1 + self.MU) for b, x in zip(m, u)]
            theta = [t + x for t, x in zip(theta, u)]
        with outer.receive_theta(steps=3) as held:
            for h, x in zip(held, theta):
                h.copy_(torch.from_numpy(x))
        for est, want in zip(outer.momentum(), m):
            np.testing.assert_allclose(est.numpy(), want, rtol=1e-4, atol=1e-5)
        before = [x.clone() for x in outer.momentum()]
        with outer.receive_theta(steps=0) as held:      # the same round again: nothing to learn
            pass
        self.assertTrue(all(torch.equal(a, b) for a, b in zip(before, outer.momentum())))

    def test_the_fold_replaces_the_proxy_and_keeps_what_was_trained_since(self):
        model, outer = self._site()
        m0 = [torch.full_like(t, 0.125) for t in outer.theta]     # an estimate from earlier rounds
        for b, x in zip(outer.momentum(), m0):
            b.copy_(x)
        with torch.no_grad():
            model.a.add_(0.25)                                     # phase k
            model.b.sub_(0.5)
        outer.count_inner_step()
        trained = [p.detach().double().numpy().copy() for p in model.parameters()]
        outer.end_phase()                                          # delta k leaves
        proxy = [naive_step(t.double().numpy(), m.double().numpy(), t.double().numpy() - w, self.LR, self.MU)[0]
                 for t, m, w in zip(THETA0, m0, trained)]
        for p, want in zip(model.parameters(), proxy):             # phase k+1 starts from the proxy
            np.testing.assert_allclose(p.detach().numpy(), want, rtol=1e-6, atol=1e-6)
        with outer.global_weights():                               # evals and checkpoints: theta_r still
            for p, x in zip(model.parameters(), THETA0):
                self.assertTrue(torch.equal(p.detach(), x))
        with torch.no_grad():
            model.b.add_(0.75)                                     # phase k+1 trains on the proxy
        outer.count_inner_step()
        new = [x + 1.0 for x in THETA0]                            # theta_{r+1} arrives: the fold
        with outer.receive_theta(steps=1) as theta:
            for t, x in zip(theta, new):
                t.copy_(x)
        a, b = (p.detach() for p in model.parameters())
        torch.testing.assert_close(a, new[0], rtol=0, atol=1e-6, msg="nothing trained on a since the send")
        torch.testing.assert_close(b, new[1] + 0.75, rtol=0, atol=1e-6, msg="b keeps phase k+1's progress alone")
        outer.end_phase()                                          # delta k+1: phase k+1's progress alone
        torch.testing.assert_close(outer.carrier.deltas[0], torch.zeros(2, 3), rtol=0, atol=1e-6)
        torch.testing.assert_close(outer.carrier.deltas[1], torch.full((4,), -0.75), rtol=0, atol=1e-6)


class ReceiveThetaTest(unittest.TestCase):
    """DiLoCo.receive_theta, the one way a carrier sets theta outside an outer step (one
    process, no group): the weights become theta and a phase starts there; after an outer
    step whose theta came later, the replica trains on from its own weights and the theta
    that comes is folded in, so the next delta is the progress since the send alone."""

    def _outer(self):
        model = TwoParams(*THETA0)
        return model, diloco.DiLoCo(model, diloco.ReplicaLayout.plan(1, 0, 1), diloco.DiLoCoConfig.fedavg(H),
                                    LaterCarrier())

    def test_the_weights_become_theta_and_a_phase_starts(self):
        model, outer = self._outer()
        with torch.no_grad():
            model.a.add_(1.0)
        outer.count_inner_step()
        new = [torch.full_like(t, 3.0) for t in outer.theta]
        with outer.receive_theta() as theta:
            for t, x in zip(theta, new):
                t.copy_(x)
        for p, x in zip(model.parameters(), new):
            self.assertTrue(torch.equal(p.detach(), x))
        self.assertEqual((outer.phase_steps, outer.ahead), (0, False))

    def test_a_theta_that_comes_later_is_folded_into_the_weights(self):
        model, outer = self._outer()
        with torch.no_grad():
            model.a.add_(0.25)                        # phase 1
        outer.count_inner_step()
        trained = [p.detach().clone() for p in model.parameters()]
        row, outcome = outer.end_phase()
        self.assertEqual((outcome, row["outer_step"], outer.ahead), ("in flight", 1, True))
        for p, x in zip(model.parameters(), trained):   # theta_later: the weights stay the replica's
            self.assertTrue(torch.equal(p.detach(), x))
        with torch.no_grad():
            model.b.add_(0.5)                         # trains on while the theta is on its way
        outer.count_inner_step()
        with outer.global_weights():                  # evals and checkpoints see theta, the old one
            for p, x in zip(model.parameters(), THETA0):
                self.assertTrue(torch.equal(p.detach(), x))
        new = [x + 1.0 for x in THETA0]
        with outer.receive_theta() as theta:
            for t, x in zip(theta, new):
                t.copy_(x)
        a, b = (p.detach() for p in model.parameters())
        self.assertTrue(torch.equal(a, new[0]), "nothing trained on a since the send: theta exactly")
        self.assertTrue(torch.equal(b, new[1] + 0.5), "b keeps what it trained since the send")
        self.assertEqual(outer.phase_steps, 1, "the phase in progress goes on")
        outer.end_phase()
        self.assertTrue(torch.equal(outer.carrier.deltas[0], torch.zeros(2, 3)))
        self.assertTrue(torch.equal(outer.carrier.deltas[1], torch.full((4,), -0.5)),
                        "the next delta is the progress since the send alone")


class DiLoCoGlooTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="diloco-test-")
        spawn(worker, WORLD, cls.tmp)
        cls.r = [torch.load(os.path.join(cls.tmp, f"rank{i}.pt"), weights_only=False) for i in range(WORLD)]

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def test_layout_k1_k2_k4_on_4_ranks(self):
        expect = {1: ([[0, 1, 2, 3]] * 4, [[0], [1], [2], [3]]),
                  2: ([[0, 1], [0, 1], [2, 3], [2, 3]], [[0, 2], [1, 3], [0, 2], [1, 3]]),
                  4: ([[0], [1], [2], [3]], [[0, 1, 2, 3]] * 4)}
        for k, (inner, outer) in expect.items():
            for rank in range(WORLD):
                got = self.r[rank]["layouts"][k]
                self.assertEqual(got["inner_ranks"], inner[rank], (k, rank))
                self.assertEqual(got["inner_members"], inner[rank], (k, rank))
                self.assertEqual(got["outer_ranks"], outer[rank], (k, rank))
                self.assertEqual(got["outer_members"], outer[rank], (k, rank))
                self.assertEqual(got["replica"], rank // (WORLD // k))
                self.assertEqual(got["inner_sum"], sum(inner[rank]))     # the group really reduces
                self.assertEqual(got["outer_sum"], sum(outer[rank]))

    def test_replicas_must_divide_world(self):
        with self.assertRaisesRegex(ValueError, r"--diloco-replicas 3 does not divide 8 ranks; use 1, 2, 4 or 8"):
            diloco.ReplicaLayout.plan(8, 0, 3)
        lay = diloco.ReplicaLayout.plan(8, 5, 2)
        self.assertEqual((lay.replica, lay.local_index, lay.outer_ranks), (1, 1, [1, 5]))

    def test_config_errors_name_the_flag(self):
        for kw, flag in [({"inner_steps": 0}, "--diloco-inner-steps"),
                         ({"outer_optimizer": "adam"}, "--diloco-outer-optimizer"),
                         ({"outer_momentum": 0.0}, "--diloco-outer-momentum"),
                         ({"outer_device": "gpu"}, "--diloco-outer-device")]:
            with self.assertRaisesRegex(ValueError, flag):
                diloco.DiLoCoConfig(**{**NESTEROV, **kw})

    def test_theta0_broadcast_from_replica_0(self):
        for case in ("nesterov_k4", "nesterov_k2"):
            for rank in range(WORLD):
                for got, want in zip(self.r[rank][case]["theta0"], THETA0):
                    self.assertTrue(torch.equal(got, want), (case, rank))   # rank 0's values (+0)
        ddp = [self.r[rank]["ddp"] for rank in range(WORLD)]
        self.assertFalse(torch.equal(ddp[0]["before"], ddp[2]["before"]))   # seeds differ per rank
        for rank in range(WORLD):
            self.assertTrue(torch.equal(ddp[rank]["start"], ddp[0]["before"]), rank)

    def _check_against_torch(self, case, k, config, steps):
        ref = reference_thetas(k, config, steps)
        npref = numpy_nesterov(k, config.outer_lr, config.outer_momentum, steps)
        for rank in range(WORLD):
            got = self.r[rank][case]["thetas"]
            for s in range(steps):
                for g, want, w64 in zip(got[s], ref[s], npref[s]):
                    # gloo sums in its own order; after a Nesterov step values are no longer dyadic
                    torch.testing.assert_close(g, want, rtol=1e-6, atol=1e-7, msg=f"{case} rank {rank} step {s}")
                    np.testing.assert_allclose(g.numpy(), w64, rtol=1e-6, atol=1e-6)

    def test_nesterov_matches_torch_sgd_k4(self):
        self._check_against_torch("nesterov_k4", 4, diloco.DiLoCoConfig(inner_steps=H, **NESTEROV), OUTER_STEPS)

    def test_nesterov_matches_torch_sgd_k2(self):
        self._check_against_torch("nesterov_k2", 2, diloco.DiLoCoConfig(inner_steps=H, **NESTEROV), OUTER_STEPS)

    def test_outer_device_cpu_same_numbers(self):
        self._check_against_torch("cpu_k2", 2, diloco.DiLoCoConfig(inner_steps=H, **NESTEROV), 2)

    def test_fedavg_is_exact_mean(self):
        for rank in range(WORLD):
            for s, theta in enumerate(self.r[rank]["fedavg_k2"]["thetas"]):
                vals = [replica_values(r, s) for r in range(2)]
                for i, t in enumerate(theta):
                    self.assertTrue(torch.equal(t, (vals[0][i] + vals[1][i]) / 2), (rank, s, i))

    def test_metrics_rows(self):
        k = 2
        for rank in range(WORLD):
            rows = self.r[rank]["fedavg_k2"]["rows"]
            self.assertEqual([r["outer_step"] for r in rows], [1, 2])
            self.assertEqual([r["inner_step"] for r in rows], [H, 2 * H])
            # step 0: theta = THETA0, delta_r = THETA0 - values(r, 0)
            rep = rank // 2
            deltas = [[t - v for t, v in zip(THETA0, replica_values(r, 0))] for r in range(k)]
            own = math.sqrt(sum(float((d ** 2).sum()) for d in deltas[rep]))
            avg = math.sqrt(sum(float((((deltas[0][i] + deltas[1][i]) / 2) ** 2).sum()) for i in range(2)))
            row = rows[0]
            self.assertEqual(row["split"], "diloco")
            self.assertAlmostEqual(row["delta_norm"], own, places=5)
            self.assertAlmostEqual(row["avg_delta_norm"], avg, places=5)
            self.assertAlmostEqual(row["agreement"], avg / own, places=5)
            self.assertGreaterEqual(row["outer_ms"], 0)

    def test_ddp_replicas_drift_then_reconverge(self):
        d = [self.r[rank]["ddp"] for rank in range(WORLD)]
        # mid-phase: DDP keeps each replica identical inside, replicas differ from each other
        self.assertTrue(torch.equal(d[0]["mid"], d[1]["mid"]))
        self.assertTrue(torch.equal(d[2]["mid"], d[3]["mid"]))
        self.assertFalse(torch.allclose(d[0]["mid"], d[2]["mid"]))
        # the outer step (FedAvg) brings all four ranks back to one theta
        for rank in range(WORLD):
            self.assertTrue(torch.equal(d[rank]["after_outer"], d[0]["after_outer"]), rank)
            self.assertEqual(d[rank]["rows"][0]["outer_step"], 1)
        # the mean delta is one tensor; each replica divides its norm by its own drift
        rows = [d[rank]["rows"][0] for rank in range(WORLD)]
        self.assertEqual({r["avg_delta_norm"] for r in rows}, {rows[0]["avg_delta_norm"]})
        self.assertEqual(rows[0]["delta_norm"], rows[1]["delta_norm"])
        self.assertNotEqual(rows[0]["delta_norm"], rows[2]["delta_norm"])
        for r in rows:
            self.assertAlmostEqual(r["agreement"], r["avg_delta_norm"] / r["delta_norm"])
        # global_weights swaps theta in (identical everywhere) and the replica back out
        self.assertFalse(torch.equal(d[0]["drifted"], d[2]["drifted"]))
        for rank in range(WORLD):
            self.assertTrue(torch.equal(d[rank]["inside_global"], d[0]["after_outer"]), rank)
            self.assertTrue(torch.equal(d[rank]["after_global"], d[rank]["drifted"]), rank)
        # finish() flushes the one-step trailing phase, once
        for rank in range(WORLD):
            self.assertEqual(d[rank]["flush"]["phase_steps"], 1)
            self.assertEqual(d[rank]["flush"]["outer_step"], 2)
            self.assertIsNone(d[rank]["finish_again"])
            self.assertTrue(torch.equal(d[rank]["after_flush"], d[0]["after_flush"]), rank)
        mean = (d[0]["drifted"] + d[2]["drifted"]) / 2
        torch.testing.assert_close(d[0]["after_flush"], mean)

    def test_state_dict_round_trip(self):
        for rank in range(WORLD):
            src = self.r[rank]["nesterov_k2"]["state"]
            got = self.r[rank]["restored"]
            self.assertEqual(got["counters"], src["counters"])
            self.assertEqual(src["counters"]["outer_step"], OUTER_STEPS)
            for n in ("a", "b"):
                self.assertTrue(torch.equal(got["theta"][n], src["theta"][n]))
                self.assertTrue(torch.equal(got["momentum"][n], src["momentum"][n]))
                self.assertGreater(float(src["momentum"][n].abs().sum()), 0)
            for p, n in zip(self.r[rank]["restored_params"], ("a", "b")):
                self.assertTrue(torch.equal(p, src["theta"][n]))


if __name__ == "__main__":
    sys.exit("run with: .venv/bin/python tests/run.py test_diloco")
