"""diloco.py - DiLoCo inside one allocation: k model replicas, an outer step every H inner steps.

Runs on: compute nodes, imported by train.py (and smoke.py, bench/outer_overhead.py).
Not started on its own. No port, no state directory of its own: its state
(theta, outer momentum, counters) travels inside train.py's checkpoints
(checkpoint.py), and one "diloco" row per outer step goes to runs/<run>/metrics.jsonl.

The allocation's W ranks are cut into k contiguous blocks of n = W / k ranks:

    k=2 on one 8-GPU node:  replica 0 = ranks 0-3    replica 1 = ranks 4-7
                            inner group: DDP/FSDP every step, inside the block
                            outer groups {0,4} {1,5} {2,6} {3,7}: every H steps

Contiguous because Slurm numbers ranks node by node: a replica spans as few nodes
as possible, so the per-step inner all-reduce stays on the fast local links.
Every rank does the outer step itself, with the ranks holding the same position
in the other replicas. Under DDP those ranks hold identical replicas, so n
parallel k-way exchanges leave every rank with theta and no broadcast is needed
afterwards; under FSDP rank j holds shard j and exchanges it with the ranks
holding shard j elsewhere - the same code, on local shards.

The outer step (DiLoCo, Douillard et al. 2023):
    delta_i = theta - theta_i          this replica's drift over the phase
    g       = mean_i delta_i           the pseudo-gradient
    theta  <- OuterOpt(theta, g)       torch.optim.SGD(lr, momentum, nesterov=True)
Defaults: Nesterov, lr 0.7, momentum 0.9. `sgd` with lr 1.0 and momentum 0 makes
theta = mean_i theta_i exactly, i.e. FederatedAveraging (the control arm).

Who moves the bytes is one small interface, OuterCarrier: AllReduceCarrier
averages the deltas over the outer group; FedMomCarrier (train.py --federation)
sends this site's delta to fedmom_server.py and receives the new theta_global
instead, tensor by tensor, without changing the counting, the metrics or the
copy-back here. Under federation the phase ends where the DARL span ends, not
always after H steps: the caller counts steps with count_inner_step() and ends the
phase with end_phase(handoff).

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

Every rank must reach the outer step the same number of times (it is a
collective triggered by a per-rank counter): a ragged last batch or a rank-local
`continue` in the inner loop hangs the job in the all-reduce instead of failing.
"""
import contextlib
import dataclasses
import json
import math
import os
import re
import time

import numpy as np
import torch
import torch.distributed as dist

import durable
import testhooks
from outer_defaults import OUTER_LR, OUTER_MOMENTUM

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

@dataclasses.dataclass
class DiLoCoConfig:
    inner_steps: int = 100              # H: inner steps between outer steps
    outer_optimizer: str = "nesterov"   # "nesterov" | "sgd"
    outer_lr: float = OUTER_LR
    outer_momentum: float = OUTER_MOMENTUM
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


def add_diloco_args(parser):
    """The --diloco-* flags, shared by train.py, smoke.py and the benches."""
    d = DiLoCoConfig()
    g = parser.add_argument_group("DiLoCo (k replicas inside this allocation)")
    g.add_argument("--diloco-replicas", type=int, default=1,
                   help="k: model replicas, contiguous equal rank blocks; must divide the rank count "
                        "(default 1 = plain data parallel, no outer step)")
    g.add_argument("--diloco-inner-steps", type=int, default=d.inner_steps,
                   help=f"H: inner steps between outer steps (default {d.inner_steps})")
    fed = "; refused with train.py --federation, where fedmom_server.py sets the outer step"
    g.add_argument("--diloco-outer-optimizer", choices=OUTER_OPTIMIZERS, default=d.outer_optimizer,
                   help=f"outer optimizer (default {d.outer_optimizer}; sgd + lr 1.0 + momentum 0 = FedAvg{fed})")
    g.add_argument("--diloco-outer-lr", type=float, default=d.outer_lr,
                   help=f"outer learning rate (default {d.outer_lr}{fed}: --outer-lr)")
    g.add_argument("--diloco-outer-momentum", type=float, default=d.outer_momentum,
                   help=f"outer momentum (default {d.outer_momentum}{fed}: --outer-momentum)")
    g.add_argument("--diloco-outer-device", choices=OUTER_DEVICES, default=d.outer_device,
                   help="where theta and the outer momentum live: 'same' as the model, or 'cpu' "
                        "(saves two fp32 parameter copies of device memory for two host<->device "
                        f"copies per outer step; default {d.outer_device})")
    return g


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


class OuterCarrier:
    """Moves one outer step's data. Implement outer_step(); the rest has defaults."""

    def outer_step(self, ex: OuterExchange) -> dict:
        """Leave the new theta in ex.theta. Return what is known here: "avg_delta_sq" (the
        squared norm of the mean delta on this rank's shard) feeds the row's norms; any
        other key goes into DiLoCo's row as it is (FedMomCarrier: "federation")."""
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
        return {"avg_delta_sq": sq_norm(ex.flat)}

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


# ----------------------------------------------------------------------------- the cross-site carrier

class RankZeroFailed(RuntimeError):
    """Raised on the other ranks when rank 0's work in on_rank0 failed (rank 0 raises the original)."""


def on_rank0(work, group=None):
    """Run `work()` on rank 0 while the other ranks wait; every rank returns its value.

    `work` may be a plain function, or a generator function that yields (anything)
    whenever it is still busy - a long wait for a round, a server restart - and
    returns its value at the end. Each yield is one small broadcast, so the other
    ranks never sit in a single collective long enough to hit the process group's
    timeout. An exception on rank 0 is raised on every rank: nobody hangs."""
    import inspect
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    gen = None
    while True:
        msg = [None]
        if rank == 0:
            try:
                if gen is None:
                    gen = work()
                    if not inspect.isgenerator(gen):
                        raise StopIteration(gen)
                next(gen)
                msg[0] = ("wait", None)
            except StopIteration as e:
                msg[0] = ("done", e.value)
            except Exception as e:
                if world == 1:
                    raise
                failure = e
                msg[0] = ("error", f"{type(e).__name__}: {e}")
        if world > 1:
            dist.broadcast_object_list(msg, src=0, group=group)
        kind, value = msg[0]
        if kind == "done":
            return value
        if kind == "error":
            if rank == 0:
                raise failure
            raise RankZeroFailed(value)


class FedMomCarrier(OuterCarrier):
    """The outer step across sites: this site's delta goes to fedmom_server.py, the
    new theta_global comes back (FEDERATION_GUIDE.md section 4). Only rank 0 talks HTTP.

    outer_step(ex), on every rank of the site, with ex.handoff the phase's
    fedsite.Handoff (tokens, metrics, step; given to DiLoCo.end_phase after the local
    checkpoint was written):
      1. gather each delta tensor in turn (a DTensor's full_tensor() under FSDP; DDP
         ranks hold it whole) and rank 0 streams theta_i - theta_global, plus what
         error feedback owes (Residual, below), into one file in the wire format
         `codec` (wire.py; ex.deltas hold theta - theta_i: the sign flips here);
      2. rank 0 hands file and Handoff to `site.round_trip` (fedsite.FedSite): send,
         wait for the round to pass, settle the lease, download the current
         theta_global (whatever round it is: a stale delta still ends in the newest);
      3. the Residual settles by the RoundResult (owed once merged, dropped if not, reset
         when the outcome is unknown), then theta_global is scattered one tensor at a
         time into ex.theta.
    No rank ever holds more than its shard plus one full tensor. The delta's data flows
    one way, train.py -> here -> fedsite -> fedmom_client (ARCHITECTURE.md section 3);
    what became of it comes back as the return value, {"federation": fedsite.RoundResult},
    in DiLoCo's row.
    `site` is None on the ranks other than 0.
    codec: a wire.Codec or a format name ("f32", "bf16", ...); error_feedback: keep a
    Residual (lossy formats only); fresh: a new run (--resume none), nothing owed from
    an earlier one.
    encode_on: "host" (the reference: rank 0 copies each gathered tensor to the host in
    fp32 and wire.py encodes it with numpy; Residual keeps error feedback in files on rank
    0; theta_global comes down file to file, fedsite.FedSite.fetch_theta) or "device"
    (int8/int4, the site's share on its devices, the same bits: shard_wire.py): in step 1
    each rank encodes its own rows of each FSDP-sharded tensor with wire_torch.py and rank
    0 gathers only their codes and scales (an eighth of the fp32 bytes for int4); a
    tensor that cannot be split so (a 1-D norm weight, an odd int4 shard before the last,
    a DDP replica) is gathered and encoded on rank 0's device. Error feedback stays with
    the rank that encoded each part (RankResidual, below: a file per rank). In step 3 an int8/int4
    update of theta_global (the aggregator's --down-wire) is not applied on rank 0's host:
    rank 0 broadcasts its codes and scales one tensor at a time and every rank adds its own
    rows to ex.theta on its device (wire.add_update's float32 bits); rank 0's host then
    repeats the addition file to file behind the training and checks the aggregator's
    digest (FedSite.check_behind), joined before the next delta is sent
    (FEDERATION_GUIDE.md section 4, "Where the site encodes").
    overlap (train.py --overlap; FEDERATION_GUIDE.md section 4, "Overlap"): step 2 runs on
    a thread (site.start_round_trip) and outer_step returns at once, the model keeping its
    own weights ("keep_weights") and every rank its local shards as sent (`sent`, host
    fp32); the caller's settle(outer) at the next phase's end does step 3 and folds
    theta_global in (fold()), before that phase's delta is computed.
    """

    def __init__(self, site, workdir, codec=None, error_feedback=True, group=None, fresh=False, log=print,
                 overlap=False, encode_on="host"):
        import wire
        if codec is None or isinstance(codec, str):        # a format name: "f32", "BF16", ...
            codec = wire.Codec((codec or "f32").lower())
        self.codec = codec.validate()
        if encode_on not in ("host", "device"):
            raise ValueError(f"encode_on={encode_on!r}: use 'host' (numpy, the reference) or 'device' (wire_torch)")
        if encode_on == "device" and self.codec.fmt not in ("int8", "int4"):
            raise ValueError(f"encode_on='device' encodes int8 and int4; --wire {self.codec.fmt} is encoded on the host")
        self.encode_on = encode_on
        self.site, self.workdir, self.group, self.log, self.fresh = site, workdir, group, log, fresh
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size(group) if dist.is_initialized() else 1
        if self.rank == 0:
            os.makedirs(workdir, exist_ok=True)
            # a job killed while it wrote a theta or delta file (the host's apply behind the
            # training among them) left a model-sized temporary
            for n in os.listdir(workdir):
                if n.startswith(("theta", "delta")) and durable.is_tmp(n):
                    durable.unlink(os.path.join(workdir, n))
        # error feedback (nothing to owe with a lossless format): on rank 0, which writes the
        # delta, under encode_on="host"; under "device" on every rank, built with the plan
        self.error_feedback = error_feedback and self.codec.fmt != "f32"
        self.residual = Residual(workdir, log, fresh) if (
            self.rank == 0 and self.error_feedback and encode_on == "host") else None
        self.places = None           # encode_on="device": shard_wire.plan, made at the first collective use
        self.apply_on_device = False     # encode_on="device": an int8/int4 update is added on the devices
        self.wire_bytes = None       # rank 0: size of the last delta file sent, bytes
        self.round = None            # the round of the theta_global the model was loaded with
        self.delta_path = os.path.join(workdir, "delta.safetensors")
        self.theta_path = os.path.join(workdir, "theta.safetensors")
        # --overlap (FEDERATION_GUIDE.md section 4, "Overlap"): the delta in flight
        self.overlap = overlap
        self.in_flight = False       # every rank: a round trip runs on rank 0 while the site trains on
        self.busy = None             # rank 0: its fedsite.Background
        self.sent = None             # every rank: its local shards as they were sent (CPU, fp32)
        self.wait_s = None           # how long the last settle() took (the wait, theta_global, the fold), s

    def broadcast_initial(self, tensors):
        """Nothing here: the site loads theta_global (load_global) before its first phase."""

    # -- per-tensor movement
    def _full(self, local, p):
        """The whole tensor of a (possibly sharded) parameter's local part: collective under FSDP."""
        if hasattr(p, "to_local"):
            from torch.distributed.tensor import DTensor
            return DTensor.from_local(local, p.device_mesh, p.placements, shape=p.shape,
                                      stride=p.stride()).full_tensor()
        return local

    def _scatter(self, full, p):
        """This rank's part of a whole tensor that rank 0 holds (`full` is an empty buffer elsewhere)."""
        if hasattr(p, "to_local"):
            from torch.distributed.tensor import distribute_tensor
            return distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=0).to_local()
        if self.world > 1:
            dist.broadcast(full, src=0, group=self.group)
        return full

    def residual_norm(self):
        """Rank 0: the norm of what error feedback kept from the last delta (None without it)."""
        return math.sqrt(self.residual.sq) if self.residual is not None else None

    def _prepare(self, names, params):
        """encode_on="device", collective, once: which rank encodes which rows of each tensor
        (shard_wire.plan) and, with error feedback, every rank's RankResidual."""
        if self.encode_on != "device" or self.places is not None:
            return
        import shard_wire
        self.places = shard_wire.plan(self.codec, params, self.rank, self.world, self.group)
        # every DTensor's rows known: the update can be added where theta is, rank by rank
        self.apply_on_device = all(p.rows is not None or not p.sharded for p in self.places)
        if self.error_feedback:
            self.residual = RankResidual(self.workdir, names, self.places, self.rank, self.world, self.group,
                                         self.log, self.fresh)

    @torch.no_grad()
    def write_delta(self, names, params, deltas):
        """Rank 0 writes theta_i - theta_global (= -deltas) tensor by tensor in the wire
        format, plus what error feedback owes; the new residual goes to Residual's file
        (encode_on="device": each rank's share, _write_on_device)."""
        import wire
        if self.encode_on == "device":
            return self._write_on_device(names, params, deltas)
        writer = fb = None
        if self.rank == 0:
            shapes = [(n, tuple(p.shape)) for n, p in zip(names, params)]
            # no fsync: the upload reads the file back at once, and nothing reads it after a restart
            writer = wire.WireWriter(self.delta_path, shapes, self.codec, {"base_round": str(self.round)},
                                     fsync=False)
            fb = self.residual.begin(shapes, self.round) if self.residual is not None else None
        try:
            for n, p, d in zip(names, params, deltas):
                full = self._full(d, p)
                if writer is not None:
                    # a gathered tensor is ours to negate in place; a DDP delta is a view into
                    # DiLoCo's buffer, negated into one new tensor
                    full = full.neg_() if full is not d else full.neg()
                    x = full.float().cpu().numpy()
                    if fb is not None:
                        x = fb.add_owed(n, x)
                    sent = writer.write(n, x)
                    if fb is not None:
                        fb.keep(n, x, sent)
                del full
        except BaseException:
            for w in (writer, fb):
                if w is not None:
                    w.abort()
            raise
        if writer is not None:
            writer.close()
            if fb is not None:
                fb.close()
            self.wire_bytes = os.path.getsize(self.delta_path)

    def _write_on_device(self, names, params, deltas):
        """encode_on="device" (collective): a tensor split by rows (shard_wire) is encoded by
        every rank, x = its rows of -delta + what its RankResidual owes, and rank 0 gathers
        the codes and scales; any other tensor is gathered whole and encoded on rank 0's
        device. The same float32 operations as the host path: the same file and residual."""
        import shard_wire
        import wire
        import wire_torch
        self._prepare(names, params)
        writer = None
        if self.rank == 0:
            writer = wire.WireWriter(self.delta_path, [(n, tuple(p.shape)) for n, p in zip(names, params)],
                                     self.codec, {"base_round": str(self.round)}, fsync=False)   # as above
        fb = self.residual.begin(self.round) if self.residual is not None else None

        def encode(name, x):
            if fb is not None:
                x = fb.add_owed(name, x)
            parts, sent = wire_torch.encode(self.codec, x)
            if fb is not None:
                fb.keep_left(name, x - sent)
            return parts
        try:
            for n, p, d, place in zip(names, params, deltas, self.places):
                if place.per_rank:
                    parts = shard_wire.gather(self.codec, place, encode(n, d.neg()), self.rank, self.world,
                                              self.group)
                else:
                    full = self._full(d, p)
                    parts = None
                    if self.rank == 0:
                        parts = encode(n, (full.neg_() if full is not d else full.neg()).float())
                    del full
                if writer is not None:
                    writer.write_parts(n, wire_torch.to_numpy(parts))
        except BaseException:
            for w in (writer, fb):
                if w is not None:
                    w.abort()
            raise
        if fb is not None:
            fb.close()
            sq = torch.tensor([self.residual.sq], dtype=torch.float64, device=_local(params[0]).device)
            if self.world > 1:
                dist.all_reduce(sq, group=self.group)
            self.residual.sq = float(sq[0])           # the whole residual's, on every rank
        if writer is not None:
            writer.close()
            self.wire_bytes = os.path.getsize(self.delta_path)

    @torch.no_grad()
    def apply_update(self, names, params, theta, update_path):
        """encode_on="device" (collective): theta += the update file rank 0 downloaded, on
        every rank's device: rank 0 reads one tensor's codes and scales at a time and
        broadcasts them, every rank decodes its own rows (all of a replicated tensor) and
        adds them in float32, wire.add_update's bits. The file's layout and shapes were
        checked by FedSite before it handed the update over."""
        import shard_wire
        import wire
        reader = None

        def open_update():
            nonlocal reader
            reader = wire.WireReader(update_path)
            return reader.codec
        try:
            codec = on_rank0(open_update, self.group)
            for n, place, t in zip(names, self.places, theta):
                parts = None
                if reader is not None:
                    parts = {part[len(n):]: reader.r.read(part) for part, _, _ in codec.parts(n, place.shape)}
                buf = shard_wire.broadcast(codec, place.shape, parts, t.device, self.rank, self.world, self.group)
                t.add_(shard_wire.local_values(codec, buf, place, self.rank).view(t.shape))
                del buf
        finally:
            if reader is not None:
                reader.close()

    def _take_theta(self, result, names, params, theta):
        """The theta_global a round trip brought, into `theta`: its update added on the
        devices, then checked behind on rank 0's host (RoundResult.update), or the whole
        file read and scattered."""
        if result.update is not None:
            self.apply_update(names, params, theta, result.update)
            if self.site is not None:
                self.site.check_behind(self.theta_path)
        else:
            self.read_theta(names, params, theta)

    @torch.no_grad()
    def read_theta(self, names, params, theta):
        """theta_global from rank 0's file into `theta` (local parts), one tensor at a time."""
        import tensorio
        reader = tensorio.TensorReader(self.theta_path) if self.rank == 0 else None
        try:
            def check():
                want = {n: tuple(p.shape) for n, p in zip(names, params)}
                have = {n: reader.specs[n][1] for n in reader.names}
                if want != have:
                    miss = sorted(set(want) - set(have))[:5]
                    extra = sorted(set(have) - set(want))[:5]
                    diff = sorted(n for n in set(want) & set(have) if want[n] != have[n])[:5]
                    raise ValueError(f"theta_global does not fit this model: missing {miss}, extra {extra}, "
                                     f"other shapes {diff}; start fedmom_server.py with --init from this "
                                     "train.py's --export-init (same --model and corpus)")
            on_rank0(check, self.group)
            for n, p, t in zip(names, params, theta):
                dev = _local(p).device
                if reader is not None:
                    full = torch.from_numpy(reader.read(n, as_float32=True)).view(p.shape).to(dev)
                else:
                    full = torch.empty(p.shape, dtype=torch.float32, device=dev)
                t.copy_(self._scatter(full, p))
                del full
        finally:
            if reader is not None:
                reader.close()

    # -- the round
    @torch.no_grad()
    def load_global(self, outer):
        """Make the model and outer.theta equal theta_global of the aggregator's CURRENT
        round (collective). Returns that round."""
        self._prepare(outer.names, outer.params)
        self.round = on_rank0(lambda: self.site.fetch_theta(self.theta_path), self.group)
        if self.residual is not None:
            self.residual.check(self.round, {n: tuple(p.shape) for n, p in zip(outer.names, outer.params)})
        self.read_theta(outer.names, outer.params, outer.theta)
        for t, p in zip(outer.theta, outer.params):
            _local(p).copy_(t)
        outer.ahead = False
        return self.round

    def current(self):
        """The aggregator's round now (collective: rank 0 asks, every rank learns it)."""
        return on_rank0(lambda: self.site.current_round(), self.group)

    def outer_step(self, ex):
        if ex.handoff is None:
            raise RuntimeError("FedMomCarrier: the outer step needs the phase's fedsite.Handoff "
                               "(DiLoCo.end_phase(handoff))")
        base = self.round
        self.write_delta(ex.names, ex.params, ex.deltas)
        if self.overlap:
            # the site trains on from its own weights; what the fold needs is kept on the host
            self.sent = [_local(p).detach().to("cpu", torch.float32, copy=True) for p in ex.params]
            if self.site is not None:
                self.busy = self.site.start_round_trip(self.delta_path, base, ex.handoff, self.theta_path,
                                                       defer_update=self.apply_on_device)
            self.in_flight = True
            return {"federation": None, "keep_weights": True}
        result = on_rank0(lambda: self.site.round_trip(self.delta_path, base, ex.handoff, self.theta_path,
                                                       defer_update=self.apply_on_device), self.group)
        if self.residual is not None:
            self.residual.settle(base, result.merged_into if result.merged else None, result.reason or "")
        self._take_theta(result, ex.names, ex.params, ex.theta)
        self.round = result.round
        return {"federation": result}

    @torch.no_grad()
    def settle(self, outer):
        """--overlap, collective: wait for the round trip in flight (rank 0 polls, the other
        ranks wait in small broadcasts), settle error feedback by its RoundResult, load the
        theta_global it brought into outer.theta and fold it into the model: every local
        tensor becomes theta_global + (what it trained since the send). -> the RoundResult."""
        t0 = time.monotonic()
        result = on_rank0(lambda: self.busy.wait(), self.group)
        if self.residual is not None:
            self.residual.settle(result.base_round, result.merged_into if result.merged else None,
                                 result.reason or "")
        if self.site is not None:
            testhooks.fault_point("site.fold")    # test hook (testhooks.py): error feedback settled, theta not folded in
        self._take_theta(result, outer.names, outer.params, outer.theta)
        for p, t, s in zip(outer.params, outer.theta, self.sent):
            fold(_local(p), t, s)
        self.round, self.busy, self.sent, self.in_flight = result.round, None, None, False
        self.wait_s = round(time.monotonic() - t0, 3)
        return result


def fold(local, theta, sent):
    """The one-step-delayed outer update, in place: local <- theta + (local - sent). `sent`
    is what the site's weights were when its delta left, `theta` the theta_global that came
    back: the site keeps exactly what it trained since the send, on the new base, so its
    next delta (base theta) is that progress alone. One temporary of local's size."""
    d = local.to(theta.dtype) - sent.to(local.device, theta.dtype)    # fp32: theta's precision
    local.copy_(d.add_(theta.to(local.device)))


class Residual:
    """Error feedback at a site (rank 0 of the job that writes the delta): what the wire
    format dropped, owed to the aggregator and added to the next delta.

    Two F32 tensor files in the federation workdir (runs/<run>/federation/), beside the
    checkpoints, so a requeued job with --resume auto finds them:
      residual-next.safetensors  what the delta in flight will leave owed; metadata
                                 base_round. Written tensor by tensor with the delta.
      residual.safetensors       owed now: residual-next renamed once its delta was
                                 merged (into base_round + 1); theta_global lacks exactly this
    The rules (the residual follows the aggregator's merges, not the local step):
      send:        x = delta + owed; sent = decode(encode(x)); next = x - sent
      merged:      next becomes owed (rename)
      not merged (stale, refused, excluded, lease lost): next is dropped and owed stays
                   owed: x never arrived, so neither did the owed part of it
      outcome unknown (the aggregator may still merge it), or a restart that finds next
                   (it may have been sent): both reset, and said - the other choices
                   risk sending one residual twice
      theta_global of a round R <= base_round (a new aggregator state), or other tensor
                   names or shapes: owed is meaningless now: reset, and said
    A new run (--resume none) starts with nothing owed; a job that finds the files a job of
    this run left under --encode-on device (one per rank: RankResidual) resets, and says so.
    """

    def __init__(self, workdir, log=print, fresh=False):
        self.log = log
        self.path = os.path.join(workdir, "residual.safetensors")
        self.next_path = os.path.join(workdir, "residual-next.safetensors")
        self.sq = 0.0                   # squared norm of the residual the last delta left
        self.told = False               # the first use of a residual in this job is logged
        self._drop(*(os.path.join(workdir, n) for n in os.listdir(workdir)      # a killed write's temporary
                     if n.startswith("residual") and durable.is_tmp(n)))
        ranked = [os.path.join(workdir, n) for n in os.listdir(workdir) if RankResidual.FILE.fullmatch(n)]
        if ranked and not fresh:
            self.log("error feedback reset (nothing owed from now on): the residual was kept per rank by a "
                     "job with --encode-on device; this job encodes on the host")
        self._drop(*ranked)
        if fresh:
            self._drop(self.path, self.next_path)
        elif os.path.exists(self.next_path):
            self.reset("after a restart, the delta that left residual-next.safetensors may or may not "
                       "have been merged")

    def _drop(self, *paths):
        for p in paths:
            durable.unlink(p)

    def reset(self, why):
        if os.path.exists(self.path) or os.path.exists(self.next_path):
            self.log(f"error feedback reset (nothing owed from now on): {why}")
        self._drop(self.path, self.next_path)

    def check(self, round_now, shapes):
        """At each download of theta_global: is what is owed still meaningful?"""
        import tensorio
        if not os.path.exists(self.path):
            return
        try:
            with tensorio.TensorReader(self.path) as r:
                base = int(r.metadata.get("base_round", "-1"))
                have = {n: r.specs[n][1] for n in r.names}
                dtypes = {r.specs[n][0] for n in r.names}
        except (tensorio.FormatError, ValueError) as e:
            return self.reset(f"{self.path} is unreadable ({e})")
        if round_now <= base:
            self.reset(f"the aggregator is at round {round_now}, but this residual was left by a delta "
                       f"of round {base} merged after it (a new aggregator state?)")
        elif have != shapes or dtypes - {"F32"}:
            self.reset("the residual's tensor names or shapes differ from the model's")

    def begin(self, shapes, base_round):
        return _ResidualWrite(self, shapes, base_round)

    def settle(self, base_round, merged_into, reason):
        """After the round trip of the delta of `base_round`: merged_into (None: not merged)."""
        if not os.path.exists(self.next_path):
            return
        if merged_into is not None:
                durable.rename(self.next_path, self.path)
        elif reason.startswith("outcome unknown"):
            self.reset(f"the delta of round {base_round} may still be merged ({reason})")
        else:
            self._drop(self.next_path)       # never merged: what was owed is still owed


class _ResidualWrite:
    """One delta's pass over Residual: owed in, new residual out, tensor by tensor."""

    def __init__(self, res, shapes, base_round, metadata=None, fsync=True):
        import tensorio
        self.res = res
        self.owed = tensorio.TensorReader(res.path) if os.path.exists(res.path) else None
        if self.owed is not None and not res.told:
            res.log(f"error feedback: the delta of round {base_round} carries the residual left by the "
                    f"merged delta of round {self.owed.metadata.get('base_round')} ({res.path})")
            res.told = True
        self.w = tensorio.TensorWriter(res.next_path, [(n, "F32", s) for n, s in shapes],
                                       {"base_round": str(base_round), **(metadata or {})}, fsync=fsync)
        res.sq = 0.0

    def add_owed(self, name, x):
        return x if self.owed is None else x + self.owed.read(name).reshape(x.shape)

    def keep(self, name, x, sent):
        self.keep_left(name, x - sent)

    def keep_left(self, name, left):
        """The residual x - sent of one tensor, computed by the caller (on a device: FedMomCarrier)."""
        self.res.sq += float(np.dot(left.reshape(-1).astype(np.float64), left.reshape(-1).astype(np.float64)))
        self.w.write(name, left)

    def close(self):
        self.w.close()
        if self.owed is not None:
            self.owed.close()

    def abort(self):
        self.w.abort()
        if self.owed is not None:
            self.owed.close()


class RankResidual(Residual):
    """Error feedback under encode_on="device" (FedMomCarrier, shard_wire.py): Residual's
    rules, unchanged, with each rank keeping what it encoded - the residual of its own rows
    of every tensor encoded per rank, and on rank 0 that of every tensor encoded whole - in
    files of its own in the federation workdir:
      residual-rank<r>.safetensors        owed now (residual-rank<r>-next renamed once merged)
      residual-rank<r>-next.safetensors   what the delta in flight will leave owed
    each with metadata base_round, world_size and layout (per tensor its rows [start, stop)
    of dim 0, or "whole"). Every rank writes its file, with no tensor if it encodes none, and
    settles it by the same RoundResult. What can differ between ranks - a file left by a
    job killed between two ranks' renames, another world size or layout, a residual the
    host path kept (--encode-on host), another base round - is decided by all ranks at
    once (one all_gather of each rank's reason): any reason resets every rank, said once
    by rank 0, since a partial reset would leave some rows owed and others not.
    Device memory: none kept (4 B per parameter twice over, owed and next, until a delta's
    outcome is known, is more than the files cost); each rank reads its owed rows and
    writes its new ones one tensor at a time, 1/world of the model's fp32 bytes each way."""

    FILE = re.compile(r"residual-rank(\d+)(-next)?\.safetensors")

    def __init__(self, workdir, names, places, rank, world, group=None, log=print, fresh=False):
        self.workdir, self.rank, self.world, self.group = workdir, rank, world, group
        self.log = log if rank == 0 else (lambda msg: None)
        self.path = os.path.join(workdir, f"residual-rank{rank}.safetensors")
        self.next_path = os.path.join(workdir, f"residual-rank{rank}-next.safetensors")
        self.sq = 0.0                   # squared norm of the whole residual the last delta left
        self.told = False
        os.makedirs(workdir, exist_ok=True)
        self.specs = [(n, pl.locals[rank] if pl.per_rank else pl.shape) for n, pl in zip(names, places)
                      if pl.per_rank or rank == 0]
        self.layout = json.dumps({n: list(pl.rows[rank]) if pl.per_rank else "whole"
                                  for n, pl in zip(names, places) if pl.per_rank or rank == 0},
                                 separators=(",", ":"))
        stem = os.path.basename(self.path)[:-len(".safetensors")]
        self._drop(*(os.path.join(workdir, n) for n in os.listdir(workdir)       # a killed write's temporary
                     if n.startswith(stem) and durable.is_tmp(n)))
        if fresh:
            self._drop(self.path, self.next_path, *self._foreign())
            return
        why = base = None
        if os.path.exists(self.next_path):
            why = (f"after a restart, the delta that left {os.path.basename(self.next_path)} may or may not "
                   "have been merged")
        elif os.path.exists(self.path):
            why, base = self._read_check(None)
        if self.rank == 0 and why is None:
            foreign = [os.path.basename(p) for p in self._foreign()]
            if foreign:
                why = (f"{', '.join(sorted(foreign)[:3])} left by a job with --encode-on host or more ranks; "
                       f"this job keeps the residual per rank over {world} ranks")
        self._agree(why, base)

    def _foreign(self):
        """Files no rank of this job keeps: the host path's, and those of ranks >= world."""
        out = [os.path.join(self.workdir, n) for n in ("residual.safetensors", "residual-next.safetensors")]
        for n in os.listdir(self.workdir):
            m = self.FILE.fullmatch(n)
            if m and int(m[1]) >= self.world:
                out.append(os.path.join(self.workdir, n))
        return [p for p in out if os.path.exists(p)]

    def _read_check(self, round_now):
        """(why this rank's owed file must go, or None; its base_round)."""
        import tensorio
        try:
            with tensorio.TensorReader(self.path) as r:
                meta = r.metadata
                base = int(meta.get("base_round", "-1"))
                have = [(n, r.specs[n][1]) for n in r.names]
                dtypes = {r.specs[n][0] for n in r.names}
        except (tensorio.FormatError, ValueError) as e:
            return f"{self.path} is unreadable ({e})", None
        if meta.get("world_size") != str(self.world):
            return (f"the residual was kept over {meta.get('world_size')} ranks, this job has {self.world} "
                    "(another world size)"), base
        if meta.get("layout") != self.layout or have != [(n, tuple(s)) for n, s in self.specs] or dtypes - {"F32"}:
            return "the residual's tensors, shapes or rows differ from this job's layout", base
        if round_now is not None and round_now <= base:
            return (f"the aggregator is at round {round_now}, but this residual was left by a delta of round "
                    f"{base} merged after it (a new aggregator state?)"), base
        return None, base

    def _agree(self, why, base):
        """Collective: reset every rank if any rank has a reason, or if the ranks' owed files
        are not all there or not all of one base round."""
        got = [(why, base if os.path.exists(self.path) else None)]
        if self.world > 1 and dist.is_initialized():
            got = [None] * self.world
            dist.all_gather_object(got, (why, base if os.path.exists(self.path) else None), group=self.group)
        why = next((w for w, _ in got if w), None)
        if why is None and len({b for _, b in got}) > 1:
            why = ("the ranks' residual files disagree (some missing, or of other rounds: a job killed "
                   "between their renames)")
        if why is not None:
            self.reset(why)

    def reset(self, why):
        self.log(f"error feedback reset (nothing owed from now on): {why}")
        self._drop(self.path, self.next_path, *(self._foreign() if self.rank == 0 else ()))

    def settle(self, base_round, merged_into, reason):
        if merged_into is not None and os.path.exists(self.next_path):
            durable.fsync_file(self.next_path)      # written without fsync (_RankWrite): owed from now on
        super().settle(base_round, merged_into, reason)

    def check(self, round_now, shapes=None):
        """Collective, at each download of theta_global: is what is owed still meaningful on every rank?"""
        why, base = self._read_check(round_now) if os.path.exists(self.path) else (None, None)
        self._agree(why, base)

    def begin(self, base_round):
        return _RankWrite(self, base_round)


class _RankWrite(_ResidualWrite):
    """One delta's pass over a RankResidual: torch tensors on the device in and out, one at a time."""

    def __init__(self, res, base_round):
        # no fsync on the way: the file is needed durable only once it becomes owed, which
        # RankResidual.settle makes it, a round trip later (the kernel has written it back by
        # then); a crash before that leaves a next file, which a restart resets anyway
        super().__init__(res, res.specs, base_round, {"world_size": str(res.world), "rank": str(res.rank),
                                                      "layout": res.layout}, fsync=False)

    def add_owed(self, name, x):
        if self.owed is None:
            return x
        return x + torch.from_numpy(self.owed.read(name)).view(x.shape).to(x.device)

    def keep_left(self, name, left):
        self.res.sq += sq_norm(left.reshape(-1))
        self.w.write(name, left.cpu().numpy())


# ----------------------------------------------------------------------------- DiLoCo

def _local(t):
    """The tensor this rank stores: the local shard of a DTensor, the tensor itself otherwise."""
    return t.to_local() if hasattr(t, "to_local") else t


def _unwrap(model):
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


class DiLoCo:
    """Counts inner steps, runs the outer step every H, keeps theta and the outer momentum.

    Construction broadcasts theta(0) from replica 0 (collective, every rank):
    ranks seed differently, and averaging deltas of models that never were one
    model trains to nothing while every metric looks healthy.
    """

    def __init__(self, model, layout, config: DiLoCoConfig, carrier: OuterCarrier | None = None):
        self.model, self.layout, self.config = _unwrap(model), layout, config
        self.carrier = carrier if carrier is not None else AllReduceCarrier(layout)
        named = [(n, p) for n, p in self.model.named_parameters()]
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.sharded = any(hasattr(p, "to_local") for p in self.params)
        self.device = _local(self.params[0]).device if self.params else torch.device("cpu")
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
        numel = sum(_local(p).numel() for p in self.params)
        with torch.no_grad():
            self.carrier.broadcast_initial([_local(p) for p in self.params]
                                           + [b for b in self.model.buffers()])
            if self.pinned:
                self.theta = self._host_views(torch.empty(numel, dtype=torch.float32, pin_memory=True))
                for t, p in zip(self.theta, self.params):
                    t.copy_(_local(p), non_blocking=True)
                self._sync()
            else:
                self.theta = [_local(p).detach().to(self.outer_device, torch.float32, copy=True)
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

    # -- the loop
    def after_inner_step(self):
        """Call after every optimizer step on every rank; returns a metrics row at outer
        steps, which come every H inner steps."""
        self.count_inner_step()
        if self.phase_steps >= self.config.inner_steps:
            return self._outer_step()
        return None

    def count_inner_step(self):
        """Count an optimizer step without an outer step: for a caller that says itself
        where phases end (federation: a phase is one DARL span, not always H steps)."""
        self.inner_step += 1
        self.phase_steps += 1

    def end_phase(self, handoff=None):
        """The outer step now (collective, every rank), at the end of a phase the caller
        counted with count_inner_step; `handoff` goes to the carrier with the deltas
        (OuterExchange.handoff). Returns the metrics row."""
        return self._outer_step(handoff)

    def finish(self):
        """Flush a trailing partial phase (collective). With momentum this last step is
        mis-scaled: the buffer holds full-H momentum while the delta covers fewer steps."""
        return self._outer_step() if self.phase_steps else None

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _host_views(self, buf):
        """buf cut into one view per parameter (local shapes), in parameter order."""
        out, off = [], 0
        for p in self.params:
            n = _local(p).numel()
            out.append(buf[off:off + n].view(_local(p).shape))
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
            d.sub_(_local(p))
            deltas.append(d)
        delta_sq = sq_norm(self.flat)
        ex = OuterExchange(names=self.names, params=self.params, deltas=deltas, flat=self.flat,
                           theta=self.theta, outer_opt=self.outer_opt, inner_steps=self.phase_steps,
                           deltas_on_theta_device=lambda: self._deltas_on_theta_device(deltas),
                           handoff=handoff)
        got = dict(self.carrier.outer_step(ex) or {})
        # keep_weights (FedMomCarrier under --overlap): the replica trains on from its own
        # weights while the new theta is on its way; global_weights() then swaps theta in
        self.ahead = bool(got.pop("keep_weights", False))
        if not self.ahead:
            for t, p in zip(self.theta, self.params):
                _local(p).copy_(t, non_blocking=True)
        self.carrier.sync_buffers(list(self.model.buffers()))
        sq = [delta_sq, got.pop("avg_delta_sq", float("nan"))]
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
        row.update(got)                          # what else the carrier knows (FedMomCarrier: "federation")
        self.phase_steps = 0
        return row

    # -- theta for eval and checkpoints
    @contextlib.contextmanager
    @torch.no_grad()
    def global_weights(self):
        """Inside: the model holds theta (identical on every rank). After: the replica's
        own weights are back. Free right after an outer step (they are equal then)."""
        if self.phase_steps == 0 and not self.ahead:
            yield self.model
            return
        saved = [_local(p).detach().to(self.outer_device, copy=True) for p in self.params]
        try:
            for t, p in zip(self.theta, self.params):
                _local(p).copy_(t)
            yield self.model
        finally:
            for s, p in zip(saved, self.params):
                _local(p).copy_(s)

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
            t.copy_(theta[n] if theta is not None else _local(p))
        for n, m in zip(self.names, self.momentum()):
            m.copy_(sd["momentum"][n])
        for t, p in zip(self.theta, self.params):     # every replica restarts from theta
            _local(p).copy_(t)
        self.ahead = False
