"""diloco.py - DiLoCo inside one allocation: k model replicas, an outer step every H inner steps.

Runs on: compute nodes, imported by train.py, fedphase.py, train_config.py (and smoke.py,
bench/outer_overhead.py); not started on its own; no port, no state directory: its state
(theta, outer momentum, counters) travels inside train.py's checkpoints, and one "diloco" row
per outer step goes to metrics.jsonl. Imports torch and nothing of the project (test_imports).

What it owns:
  ReplicaLayout   the W ranks cut into k contiguous replicas of n = W / k ranks (Slurm numbers
                  ranks node by node, so the per-step inner all-reduce stays on local links);
                  the outer groups join the same position in every replica:
                      k=2 on one 8-GPU node: replica 0 = ranks 0-3, replica 1 = ranks 4-7,
                      outer groups {0,4} {1,5} {2,6} {3,7}, every H steps
                  Every rank does the outer step on what it holds (DDP: the replica; FSDP: its
                  shard), with the same position elsewhere: no broadcast afterwards.
  DiLoCo          the outer step (Douillard et al. 2023): delta_i = theta - theta_i,
                  g = mean_i delta_i, theta <- torch.optim.SGD(lr, momentum, nesterov=True);
                  train.py's defaults lr 0.7, momentum 0.9 (outer_state.py); `sgd` with lr 1.0
                  and momentum 0 is FederatedAveraging exactly. PhaseClock: --diloco-phase-s.
  OuterCarrier    who moves the bytes: outer_step(OuterExchange) -> OuterResult.
                  AllReduceCarrier averages over the outer group; fedphase.FedMomCarrier
                  (train.py --federation) sends the delta to fedmom_server.py instead, with
                  count_inner_step(), end_phase() and receive_theta() (fold(), eager_step()).

In train.py:
    layout = diloco.ReplicaLayout.build(dist.world_size, dist.rank, args.diloco_replicas)
    model = DDP(model, process_group=layout.inner_group)      # or fully_shard(mesh=layout.mesh["shard"])
    outer = diloco.DiLoCo(model, layout, diloco.DiLoCoConfig.from_args(args))
    for step in ...:
        loss.backward(); opt.step()
        row = outer.after_inner_step()        # collective every H steps: ALL ranks must call it
        if row: log(row)
    outer.finish()                            # flush the trailing partial phase, then eval
    with outer.global_weights(): evaluate(model); checkpoint.save(...)
Every rank must reach the outer step the same number of times (it is a collective triggered
by a per-rank counter): a ragged last batch or a rank-local `continue` hangs the job.

A site's phase through here: ARCHITECTURE.md, "The path of one delta"; the overlapped and
eager outer steps: FEDERATION_GUIDE.md, "Overlap".
"""
import contextlib
import dataclasses
import math
import time

import torch
import torch.distributed as dist

OUTER_OPTIMIZERS = ("nesterov", "sgd")
OUTER_DEVICES = ("same", "cpu")
# sq_norm's chunk: 4 Mi elements, so its fp64 temporary is 32 MiB whatever the model size
NORM_CHUNK = 1 << 22


def sq_norm(flat):
    """Sum of squares of a 1-D fp32 tensor, accumulated in fp64: chunk by chunk, each
    chunk squared in fp64 (exact) and summed into an fp64 scalar on the same device. The
    largest temporary is one chunk, where flat.double() would copy the whole delta (8
    bytes per parameter, twice per outer step); one host sync, at the end."""
    acc = torch.zeros((), dtype=torch.float64, device=flat.device)
    for chunk in flat.split(NORM_CHUNK):
        acc += chunk.double().square_().sum()
    return float(acc)


def local(t):
    """The tensor this rank stores: the local shard of a DTensor, the tensor itself otherwise."""
    return t.to_local() if hasattr(t, "to_local") else t


# ----------------------------------------------------------------------------- layout

def _divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclasses.dataclass
class ReplicaLayout:
    """Where this rank sits: replica r of k, position j of n inside it.

    inner_ranks = [r*n, (r+1)*n)        my replica (DDP / FSDP group)
    outer_ranks = [j, j+n, j+2n, ...]   the same position in every replica
    mesh: the 2-D DeviceMesh ("replica", "shard") of shape (k, n); mesh["shard"]
    is the inner group (give it to fully_shard), mesh["replica"] the outer one.
    """
    world_size: int
    rank: int
    replicas: int
    replica_size: int
    replica: int
    local_index: int
    inner_ranks: list
    outer_ranks: list
    mesh: object = None
    inner_group: object = None
    outer_group: object = None

    @staticmethod
    def check(world_size, replicas):
        """Raise ValueError naming the flag when k does not cut the world into equal blocks."""
        if replicas < 1 or world_size % replicas:
            ok = ", ".join(map(str, _divisors(world_size)))
            ok = ok.rsplit(", ", 1)
            ok = " or ".join(ok)
            raise ValueError(f"--diloco-replicas {replicas} does not divide {world_size} ranks; use {ok}")

    @classmethod
    def plan(cls, world_size, rank, replicas):
        """The rank arithmetic only, no process groups (usable without torch.distributed)."""
        cls.check(world_size, replicas)
        n = world_size // replicas
        r, j = divmod(rank, n)
        return cls(world_size=world_size, rank=rank, replicas=replicas, replica_size=n,
                   replica=r, local_index=j,
                   inner_ranks=list(range(r * n, (r + 1) * n)),
                   outer_ranks=list(range(j, world_size, n)))

    @classmethod
    def build(cls, world_size, rank, replicas, device_type=None):
        """Plan the layout and create its process groups (collective: call on every rank).

        The groups come from init_device_mesh(device_type, (k, n)), which creates
        every row and column group on every rank in the same order, as
        dist.new_group requires. device_type defaults from the backend
        ("cuda" for nccl, which is also ROCm's device type; "cpu" for gloo).
        """
        layout = cls.plan(world_size, rank, replicas)
        if not dist.is_initialized() or dist.get_world_size() != world_size:
            raise RuntimeError("ReplicaLayout.build needs torch.distributed initialised over "
                               f"{world_size} ranks (dist_env.init_distributed())")
        if device_type is None:
            device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
        from torch.distributed.device_mesh import init_device_mesh
        layout.mesh = init_device_mesh(device_type, (replicas, layout.replica_size),
                                       mesh_dim_names=("replica", "shard"))
        layout.inner_group = layout.mesh.get_group("shard")
        layout.outer_group = layout.mesh.get_group("replica")
        return layout


# ----------------------------------------------------------------------------- config

@dataclasses.dataclass(kw_only=True)
class DiLoCoConfig:
    """The outer step's settings. outer_lr and outer_momentum have no default here: the
    caller gives them (train_config.py, from outer_state.py: lr 0.7, momentum 0.9, the
    values the aggregator's --outer-lr/--outer-momentum default to too), so that this file
    imports nothing of the project and the defaults are said in one place."""
    outer_lr: float
    outer_momentum: float
    inner_steps: int = 100              # H: inner steps between outer steps
    outer_optimizer: str = "nesterov"   # "nesterov" | "sgd"
    outer_device: str = "same"          # where theta and the outer momentum live: "same" | "cpu"

    def __post_init__(self):
        if self.inner_steps < 1:
            raise ValueError(f"--diloco-inner-steps {self.inner_steps}: must be >= 1")
        if self.outer_optimizer not in OUTER_OPTIMIZERS:
            raise ValueError(f"--diloco-outer-optimizer {self.outer_optimizer!r}: use one of {OUTER_OPTIMIZERS}")
        if not self.outer_lr > 0:
            raise ValueError(f"--diloco-outer-lr {self.outer_lr}: must be > 0 (1.0 with sgd/0 is FedAvg)")
        if not 0 <= self.outer_momentum < 1:
            raise ValueError(f"--diloco-outer-momentum {self.outer_momentum}: must be in [0, 1)")
        if self.outer_optimizer == "nesterov" and self.outer_momentum == 0:
            raise ValueError("--diloco-outer-momentum 0 with nesterov: Nesterov needs momentum > 0; "
                             "use --diloco-outer-optimizer sgd for plain averaging")
        if self.outer_device not in OUTER_DEVICES:
            raise ValueError(f"--diloco-outer-device {self.outer_device!r}: use one of {OUTER_DEVICES}")

    @classmethod
    def fedavg(cls, inner_steps):
        """sgd, lr 1.0, momentum 0: theta becomes the plain mean of the replicas."""
        return cls(inner_steps=inner_steps, outer_optimizer="sgd", outer_lr=1.0, outer_momentum=0.0)

    @classmethod
    def from_args(cls, args):
        return cls(inner_steps=args.diloco_inner_steps, outer_optimizer=args.diloco_outer_optimizer,
                   outer_lr=args.diloco_outer_lr, outer_momentum=args.diloco_outer_momentum,
                   outer_device=args.diloco_outer_device)


# ----------------------------------------------------------------------------- carriers

@dataclasses.dataclass
class OuterExchange:
    """What a carrier gets for one outer step. Tensors are this rank's local
    shards (whole tensors under DDP), fp32, in `names` order."""
    names: list
    params: list                 # the model's parameters (DTensor under FSDP), read-only here
    deltas: list                 # theta - theta_i of this replica, views into `flat`
    flat: torch.Tensor           # the deltas as one fp32 buffer on the model's device
    theta: list                  # the carrier leaves the new global theta in these, in place
    outer_opt: torch.optim.Optimizer   # SGD over `theta`; a carrier that gets theta from a server ignores it
    inner_steps: int             # length of the phase just finished (short for the trailing flush)
    deltas_on_theta_device: object = None   # () -> `deltas` as they stand, on theta's device
    handoff: object = None       # what the caller hands over with the deltas (DiLoCo.end_phase):
                                 # FedMomCarrier needs the phase's fedsite.Handoff; AllReduceCarrier none


@dataclasses.dataclass
class OuterResult:
    """What a carrier's outer_step tells DiLoCo."""
    avg_delta_sq: float = math.nan   # squared norm of the mean delta on this rank's shard (the row's
                                     # avg_delta_norm and agreement); NaN: not known here
    theta_later: bool = False        # the new theta is not in ex.theta: it comes later, through
                                     # DiLoCo.receive_theta, and the replica trains on from its own
                                     # weights meanwhile (FedMomCarrier under --overlap)
    outcome: object = None           # what became of the step, for end_phase's caller (FedMomCarrier:
                                     # the fedsite.RoundResult; None while theta_later)
    eager: bool = False              # with theta_later: the replica trains on from eager_step(), one
                                     # local outer step of its own delta with this DiLoCo's outer lr and
                                     # momentum, not from its own weights (FedMomCarrier, --overlap-fold eager)


class OuterCarrier:
    """Moves one outer step's data. Implement outer_step(); the rest has defaults."""

    def outer_step(self, ex: OuterExchange) -> OuterResult:
        """Leave the new theta in ex.theta (or say OuterResult.theta_later); return an OuterResult."""
        raise NotImplementedError

    def broadcast_initial(self, tensors):
        """Make these local tensors equal across replicas before training (theta(0))."""
        raise NotImplementedError

    def sync_buffers(self, buffers):
        """Floating-point buffers (BatchNorm running statistics): keep as is by default."""


class AllReduceCarrier(OuterCarrier):
    """The in-allocation carrier: one all-reduce of the flat delta buffer over the
    outer group, then OuterOpt with grad = mean delta, on every rank redundantly."""

    def __init__(self, layout):
        self.group = layout.outer_group
        self.k = layout.replicas
        self.src = layout.outer_ranks[0]      # the rank of replica 0 at my position

    def outer_step(self, ex):
        if self.k > 1:
            dist.all_reduce(ex.flat, op=dist.ReduceOp.SUM, group=self.group)
        ex.flat.div_(self.k)
        for t, d in zip(ex.theta, ex.deltas_on_theta_device()):
            t.grad = d
        ex.outer_opt.step()
        for t in ex.theta:
            t.grad = None
        return OuterResult(avg_delta_sq=sq_norm(ex.flat))

    def broadcast_initial(self, tensors):
        if self.k > 1:
            for t in tensors:
                dist.broadcast(t, src=self.src, group=self.group)

    def sync_buffers(self, buffers):
        """Average float buffers over the replicas so that every replica evaluates
        theta with the same normalisation statistics."""
        if self.k > 1:
            for b in buffers:
                if b.is_floating_point():
                    dist.all_reduce(b, op=dist.ReduceOp.SUM, group=self.group)
                    b.div_(self.k)


def fold(weight, theta, sent):
    """The one-step-delayed outer update, in place: weight <- theta + (weight - sent). `sent`
    is what the replica's weight was at the outer step whose theta came later, `theta` that
    theta (a federated site: the theta_global its delta brought back): the replica keeps
    exactly what it trained since, on the new base, so its next delta (base theta) is that
    progress alone. One temporary of weight's size."""
    d = weight.to(theta.dtype) - sent.to(weight.device, theta.dtype)    # fp32: theta's precision
    weight.copy_(d.add_(theta.to(weight.device)))


def eager_step(theta, g, m, lr, mu, nesterov=True):
    """The eager proxy of an outer step whose theta comes later (Kale et al. 2025, "eager
    updates"): one step of torch.optim.SGD(lr, momentum=mu, nesterov) from `theta` with this
    replica's own outer gradient `g` (theta - its weights) standing in for the merged one,
    `m` the momentum buffer the step would start from (None with momentum 0). Returns the
    proxy, a new tensor on theta's device; `m` is left as it is (the aggregator's step, when
    it comes, replaces this one). Temporaries: two of theta's size."""
    g = g.to(theta.device, theta.dtype)
    if m is None:
        return theta - g * lr
    buf = m * mu + g                                     # the step's own momentum buffer
    step = buf.mul_(mu).add_(g) if nesterov else buf     # g + mu * buf: Nesterov's look-ahead
    return theta - step.mul_(lr)


def momentum_from_update(lr, mu, steps):
    """How the momentum buffer m of SGD(lr, momentum=mu, nesterov=True) follows from an update
    u = new - old of theta it made in `steps` steps, the buffer itself never being sent:
        m' = mu*m + g,  u = -lr*(g + mu*m')   =>   m' = (mu*m - u/lr) / (1 + mu)
    exact for one step. For k > 1 steps none of which was seen, each is taken as u/k:
    k applications give a^k*m - (1 - a^k)*u/(k*lr), a = mu/(1+mu), exact when the k steps
    moved theta equally. Returns (keep, c): m' = keep*m + c*old - c*new, linear in old and
    new, so it is computed around an in-place write of theta with no copy of it."""
    a = mu / (1.0 + mu)
    return a ** steps, (1.0 - a ** steps) / (steps * lr)


# ----------------------------------------------------------------------------- DiLoCo

class PhaseClock:
    """Phases measured in time (train.py --diloco-phase-s): a phase runs as many inner steps
    as fit in its budget, judged from the step time measured on global rank 0, and ends on
    the same step on every rank by construction. Rank 0 alone judges; after every inner step
    every rank calls share() once (one broadcast of one integer over `group`), so no rank
    can leave the phase while another waits in a collective, whatever its own clock says.

    Use (every rank):
        clock.begin(budget_s)                 # the phase starts
        ... an inner step ...
        if clock.after_step(): end the phase  # collective
        clock.end()                           # the phase's step time feeds the next estimate
    A caller that ends phases on its own terms (fedphase: on a block boundary) calls
    share(value) with rank 0's verdict instead of after_step(), and estimate()/elapsed() on
    rank 0 to make it. `clock`: the time source (seconds; tests give one rank a faster one).
    """

    def __init__(self, group=None, device=None, clock=None):
        self.group, self.device = group, torch.device("cpu") if device is None else device
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size(group) if dist.is_initialized() else 1
        self.clock = clock or time.perf_counter
        self.step_s = None           # seconds an inner step took in the phases before (a running mean)
        self.budget_s, self.t0, self.steps, self.first_s, self.paused = None, None, 0, None, 0.0

    def begin(self, budget_s):
        self.budget_s, self.t0, self.steps, self.first_s, self.paused = budget_s, self.clock(), 0, None, 0.0

    def pause(self, seconds):
        """`seconds` of the phase that were not inner steps (a fold of theta_global mid-phase)."""
        self.paused += seconds

    def elapsed(self):
        return self.clock() - self.t0 - self.paused

    def count(self):
        """An inner step ended (every rank)."""
        self.steps += 1
        if self.steps == 1:
            self.first_s = self.elapsed()

    def estimate(self):
        """Seconds the next inner step will take: this phase's mean after its first step (the
        first may carry a warm-up), else the earlier phases', else the first step's."""
        if self.steps >= 2:
            return (self.elapsed() - self.first_s) / (self.steps - 1)
        return self.step_s if self.step_s is not None else (self.first_s or 0.0)

    def share(self, value):
        """Rank 0's integer, on every rank (collective over the group)."""
        if self.world == 1:
            return int(value)
        t = torch.tensor([int(value) if self.rank == 0 else 0], dtype=torch.int64, device=self.device)
        dist.broadcast(t, src=0, group=self.group)
        return int(t.item())

    def after_step(self):
        """Collective: True when the phase ends after this step (the next would overrun the budget)."""
        self.count()
        stop = self.rank == 0 and self.elapsed() + self.estimate() > self.budget_s
        return bool(self.share(stop))

    def end(self):
        """The phase is over: its measured step time moves the estimate for the next phase."""
        if self.steps >= 2 or (self.steps and self.step_s is None):
            self.step_s = self.estimate()          # this phase's, its first step left out: a speed-up shows at once
        elif self.steps:
            self.step_s = 0.5 * self.step_s + 0.5 * self.elapsed()
        return self.step_s


def _unwrap(model):
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


class DiLoCo:
    """Counts inner steps, runs the outer step every H, keeps theta and the outer momentum.

    Construction broadcasts theta(0) from replica 0 (collective, every rank):
    ranks seed differently, and averaging deltas of models that never were one
    model trains to nothing while every metric looks healthy.
    """

    def __init__(self, model, layout, config: DiLoCoConfig, carrier: OuterCarrier | None = None,
                 phase_clock: PhaseClock | None = None, phase_s: float | None = None):
        self.model, self.layout, self.config = _unwrap(model), layout, config
        # --diloco-phase-s inside one allocation: each phase lasts phase_s seconds of inner
        # steps, ended on the same step by every rank of every replica (PhaseClock)
        self.phase_clock, self.phase_s = (phase_clock, phase_s) if phase_s else (None, None)
        self.carrier = carrier if carrier is not None else AllReduceCarrier(layout)
        named = [(n, p) for n, p in self.model.named_parameters()]
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.sharded = any(hasattr(p, "to_local") for p in self.params)
        self.device = local(self.params[0]).device if self.params else torch.device("cpu")
        self.outer_device = torch.device("cpu") if config.outer_device == "cpu" else self.device
        # theta on the host of a GPU run lives in pinned memory: it is copied to the device
        # twice per outer step (into the delta, then into the parameters), at full bus speed
        # and without blocking (pageable memory goes through a bounce buffer, and blocks).
        # The averaged delta comes back through ordinary memory instead: that one copy per
        # outer step is waited for at once anyway (the outer optimizer reads it next), and
        # pinning it too would double the page-locked memory per rank (theta's 4 bytes per
        # local parameter again: 4 GB per rank for qwen3-8B over 8 GCDs), which the driver
        # takes from the node's RAM for good.
        self.pinned = self.outer_device.type == "cpu" and self.device.type == "cuda"
        numel = sum(local(p).numel() for p in self.params)
        with torch.no_grad():
            self.carrier.broadcast_initial([local(p) for p in self.params]
                                           + [b for b in self.model.buffers()])
            if self.pinned:
                self.theta = self._host_views(torch.empty(numel, dtype=torch.float32, pin_memory=True))
                for t, p in zip(self.theta, self.params):
                    t.copy_(local(p), non_blocking=True)
                self._sync()
            else:
                self.theta = [local(p).detach().to(self.outer_device, torch.float32, copy=True)
                              for p in self.params]
        self.host_flat = torch.empty(numel, dtype=torch.float32) if self.pinned else None
        self.outer_opt = torch.optim.SGD(self.theta, lr=config.outer_lr, momentum=config.outer_momentum,
                                         nesterov=config.outer_optimizer == "nesterov")
        if config.outer_momentum > 0:
            # Zero buffers behave exactly like torch's lazy first step (buf = 0*m + g = g)
            # and give the checkpoint a fixed shape from step 0 on.
            for t in self.theta:
                self.outer_opt.state[t]["momentum_buffer"] = torch.zeros_like(t)
        self.flat = torch.empty(numel, dtype=torch.float32, device=self.device)
        self.inner_step = 0          # inner steps since construction (or restore)
        self.phase_steps = 0         # inner steps since the last outer step
        self.outer_step = 0
        self.ahead = False           # the replica's weights are not theta although no step is counted
        self.sent = None             # after an outer step whose theta comes later: the replica's local
                                     # weights at that step (host, fp32), for receive_theta's fold

    # -- the loop
    def after_inner_step(self):
        """Call after every optimizer step on every rank; returns a metrics row at outer
        steps, which come every H inner steps."""
        self.count_inner_step()
        if self.phase_clock is not None:
            if self.phase_clock.t0 is None:
                self.phase_clock.begin(self.phase_s)
            if not self.phase_clock.after_step():     # collective: every rank, every step
                return None
            self.phase_clock.end()
            row = self._outer_step()[0]
            row["step_s"], row["ended_by"] = self.phase_clock.step_s, "clock"
            self.phase_clock.begin(self.phase_s)
            return row
        if self.phase_steps >= self.config.inner_steps:
            return self._outer_step()[0]
        return None

    def begin_phase(self):
        """--diloco-phase-s: the first phase's clock starts now (the loop's first step)."""
        if self.phase_clock is not None:
            self.phase_clock.begin(self.phase_s)

    def count_inner_step(self):
        """Count an optimizer step without an outer step: for a caller that says itself
        where phases end (federation: a phase is one DARL span, not always H steps)."""
        self.inner_step += 1
        self.phase_steps += 1

    def end_phase(self, handoff=None):
        """The outer step now (collective, every rank), at the end of a phase the caller
        counted with count_inner_step; `handoff` goes to the carrier with the deltas
        (OuterExchange.handoff). Returns (the metrics row, OuterResult.outcome: what the
        carrier says became of the step; FedMomCarrier: the fedsite.RoundResult, or None
        while its theta comes later)."""
        return self._outer_step(handoff)

    def finish(self):
        """Flush a trailing partial phase (collective). With momentum this last step is
        mis-scaled: the buffer holds full-H momentum while the delta covers fewer steps."""
        return self._outer_step()[0] if self.phase_steps else None

    @contextlib.contextmanager
    def receive_theta(self, steps=0):
        """The one way a carrier sets theta outside an outer step. Inside: the carrier writes
        this rank's part of the new theta into the list it is given, in place, in parameter
        order (DiLoCo's own tensors: one tensor at a time, no copy of the model; collective
        if the carrier's writes are). `steps`: how many outer steps of the optimizer that made
        the new theta lie between the old and the new (a federated site: rounds); with momentum
        buffers (the estimate eager_step starts from) and steps > 0, they follow the update
        (momentum_from_update; 0: left as they are). On leaving, the model's weights follow:
          - after an outer step whose theta came later (OuterResult.theta_later), fold():
            each weight becomes theta + (weight - what it was at that step), the replica's
            progress since then on the new theta (the weights stay ahead of theta);
          - otherwise the weights become theta and a phase starts there (phase_steps 0):
            a download of the global model (a federated site's start, resume or round)."""
        track = self.momentum() if steps > 0 else []
        if track:
            keep, c = momentum_from_update(self.config.outer_lr, self.config.outer_momentum, steps)
            with torch.no_grad():
                for m, t in zip(track, self.theta):
                    m.mul_(keep).add_(t, alpha=c)
        yield self.theta
        with torch.no_grad():
            for m, t in zip(track, self.theta):
                m.sub_(t, alpha=c)
            if self.sent is not None:
                for p, t, s in zip(self.params, self.theta, self.sent):
                    fold(local(p), t, s)
                self.sent = None
            else:
                for t, p in zip(self.theta, self.params):
                    local(p).copy_(t)
                self.ahead, self.phase_steps = False, 0

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _host_views(self, buf):
        """buf cut into one view per parameter (local shapes), in parameter order."""
        out, off = [], 0
        for p in self.params:
            n = local(p).numel()
            out.append(buf[off:off + n].view(local(p).shape))
            off += n
        return out

    def _deltas_on_theta_device(self, deltas):
        """The deltas where theta lives: themselves, or (theta on the host of a GPU run)
        copied into the host staging buffer, a blocking copy finished before the outer
        optimizer reads."""
        if not self.pinned:
            return deltas if self.outer_device == self.device else [d.to(self.outer_device) for d in deltas]
        self.host_flat.copy_(self.flat)
        return self._host_views(self.host_flat)

    @torch.no_grad()
    def _outer_step(self, handoff=None):
        self._sync()
        t0 = time.perf_counter()
        deltas, off = [], 0
        for t, p in zip(self.theta, self.params):
            d = self.flat[off:off + t.numel()].view(t.shape)
            off += t.numel()
            d.copy_(t, non_blocking=True)
            d.sub_(local(p))
            deltas.append(d)
        delta_sq = sq_norm(self.flat)
        ex = OuterExchange(names=self.names, params=self.params, deltas=deltas, flat=self.flat,
                           theta=self.theta, outer_opt=self.outer_opt, inner_steps=self.phase_steps,
                           deltas_on_theta_device=lambda: self._deltas_on_theta_device(deltas),
                           handoff=handoff)
        got = self.carrier.outer_step(ex)
        if got.theta_later:
            # the replica trains on from its own weights while the new theta is on its way
            # (receive_theta folds it in); global_weights() swaps theta in meanwhile
            if self.sent is not None:
                raise RuntimeError("DiLoCo: an outer step's theta is still to come (receive_theta) "
                                   "and another outer step defers its theta too")
            if got.eager:             # ... from one local outer step of its own delta instead
                self._eager_start(deltas)
            self.sent = [local(p).detach().to("cpu", torch.float32, copy=True) for p in self.params]
            self.ahead = True
        else:
            for t, p in zip(self.theta, self.params):
                local(p).copy_(t, non_blocking=True)
            self.ahead = False
        self.carrier.sync_buffers(list(self.model.buffers()))
        sq = [delta_sq, got.avg_delta_sq]
        if self.sharded and self.layout.replica_size > 1:
            sq_t = torch.tensor(sq, dtype=torch.float64, device=self.device)
            dist.all_reduce(sq_t, group=self.layout.inner_group)
            sq = sq_t.tolist()
        self._sync()
        self.outer_step += 1
        row = {"split": "diloco", "outer_step": self.outer_step, "inner_step": self.inner_step,
               "phase_steps": self.phase_steps, "delta_norm": math.sqrt(sq[0]),
               "avg_delta_norm": math.sqrt(sq[1]) if sq[1] == sq[1] else None,
               "outer_ms": (time.perf_counter() - t0) * 1e3}
        row["agreement"] = (row["avg_delta_norm"] / row["delta_norm"]
                            if row["avg_delta_norm"] is not None and row["delta_norm"] > 0 else None)
        self.phase_steps = 0
        return row, got.outcome

    def _eager_start(self, deltas):
        """OuterResult.eager: the weights become eager_step's proxy, tensor by tensor (the
        deltas are still this phase's: theta - weights); theta and the momentum stay as they
        are until the real step's theta comes (receive_theta)."""
        cfg, ms = self.config, self.momentum() or [None] * len(self.theta)
        for t, d, m, p in zip(self.theta, deltas, ms, self.params):
            local(p).copy_(eager_step(t, d, m, cfg.outer_lr, cfg.outer_momentum,
                                      cfg.outer_optimizer == "nesterov"))

    def momentum_norm(self):
        """The L2 norm of the outer momentum buffers over the replica (collective under FSDP), 0 without."""
        sq = sum((sq_norm(m.reshape(-1).float()) for m in self.momentum()), 0.0)
        if self.sharded and self.layout.replica_size > 1:
            sq_t = torch.tensor([sq], dtype=torch.float64, device=self.device)
            dist.all_reduce(sq_t, group=self.layout.inner_group)
            sq = float(sq_t[0])
        return math.sqrt(sq)

    # -- theta for eval and checkpoints
    @contextlib.contextmanager
    @torch.no_grad()
    def global_weights(self):
        """Inside: the model holds theta (identical on every rank). After: the replica's
        own weights are back. Free right after an outer step (they are equal then)."""
        if self.phase_steps == 0 and not self.ahead:
            yield self.model
            return
        saved = [local(p).detach().to(self.outer_device, copy=True) for p in self.params]
        try:
            for t, p in zip(self.theta, self.params):
                local(p).copy_(t)
            yield self.model
        finally:
            for s, p in zip(saved, self.params):
                local(p).copy_(s)

    # -- state
    def counters(self):
        return {"inner_step": self.inner_step, "phase_steps": self.phase_steps,
                "outer_step": self.outer_step, "config": dataclasses.asdict(self.config)}

    def momentum(self):
        """Local momentum buffers in parameter order (empty list when momentum is 0)."""
        st = self.outer_opt.state
        return [st[t]["momentum_buffer"] for t in self.theta if "momentum_buffer" in st.get(t, {})]

    def state_dict(self, include_theta=True):
        """theta, outer momentum (local shards, by parameter name) and counters."""
        sd = {"counters": self.counters(),
              "momentum": {n: m.clone() for n, m in zip(self.names, self.momentum())}}
        if include_theta:
            sd["theta"] = {n: t.clone() for n, t in zip(self.names, self.theta)}
        return sd

    @torch.no_grad()
    def load_state_dict(self, sd):
        """Restore counters, momentum and theta; the replicas restart from theta (their
        mid-phase drift is not saved). Without "theta", theta is taken from the model's
        current parameters (a checkpoint stores theta as the model weights)."""
        c = sd["counters"]
        self.inner_step, self.phase_steps, self.outer_step = c["inner_step"], c["phase_steps"], c["outer_step"]
        theta = sd.get("theta")
        for n, t, p in zip(self.names, self.theta, self.params):
            t.copy_(theta[n] if theta is not None else local(p))
        for n, m in zip(self.names, self.momentum()):
            m.copy_(sd["momentum"][n])
        for t, p in zip(self.theta, self.params):     # every replica restarts from theta
            local(p).copy_(t)
        self.ahead, self.sent = False, None
