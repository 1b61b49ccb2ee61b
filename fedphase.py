"""fedphase.py - the site half of a federated round: the phases a site trains, the delta each
one sends, the theta_global each one brings back.

Runs on: compute nodes, every rank of `train.py --federation` (imported; not started on its
own). No port. State: runs/<run>/federation/, rank 0's delta.safetensors (the last delta
sent) and theta.safetensors (the theta_global the site holds), beside error_feedback.py's
residual files; the phase's step and round ride in train.py's checkpoints. Rank 0 speaks to
the central VM through fedsite.FedSite, the torch-free conversation; this file is the torch
half around it: on_rank0 (rank 0's answers shared with the other ranks), FedMomCarrier (the
delta and theta_global moved one tensor at a time) and the loop of phases.

In train.py (stage 5 under --federation):
    site, carrier = fedphase.join(run)             # rank 0 connects; every rank gets the block space
    run.outer = diloco.DiLoCo(model, layout, diloco.DiLoCoConfig.fedavg(H), carrier)
    start = resume(run)                            # the checkpoint, if any
    step = fedphase.train_site(run, site, carrier, start)

One phase, in the order it runs (ARCHITECTURE.md section 3 follows each call down):
    span = on_rank0(site.next_span)         rank 0 leases a DARL span, every rank learns it
    inner steps                             train_step.Stepper, DiLoCo.count_inner_step()
    end_phase(...)                          run.save (the checkpoint, BEFORE the delta leaves);
                                            --overlap: settle() the delta in flight; then
                                            DiLoCo.end_phase -> FedMomCarrier.outer_step:
                                            write_delta, site.round_trip, theta_global in
    log_round(...)                          the delta's "federation" row of metrics.jsonl
The protocol (leases, a round, who settles a lease) is FEDERATION_GUIDE.md sections 2-4;
--overlap and --overlap-fold are its section 4, "Overlap".
"""
import dataclasses
import inspect
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import data
import durable
import fedsite
import shard_wire
import tensorio
import testhooks
import wire
import wire_torch
from diloco import DiLoCoConfig, OuterCarrier, OuterResult, PhaseClock, local
from dist_env import ConfigError
from error_feedback import RankResidual, Residual
from metrics import peak_memory_gib
from train_step import HostToDevice, Stepper, autocast_ctx, grad_sync, pooled_nll


# ----------------------------------------------------------------------------- rank 0 speaks

class RankZeroFailed(RuntimeError):
    """Raised on the other ranks when rank 0's work in on_rank0 failed (rank 0 raises the original)."""


def on_rank0(work, group=None):
    """Run `work()` on rank 0 while the other ranks wait; every rank returns its value.

    `work` may be a plain function, or a generator function that yields (anything)
    whenever it is still busy - a long wait for a round, a server restart - and
    returns its value at the end. Each yield is one small broadcast, so the other
    ranks never sit in a single collective long enough to hit the process group's
    timeout. An exception on rank 0 is raised on every rank: nobody hangs."""
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


# ----------------------------------------------------------------------------- the carrier

class FedMomCarrier(OuterCarrier):
    """The outer step across sites: this site's delta goes to fedmom_server.py, the
    new theta_global comes back (FEDERATION_GUIDE.md section 4). Only rank 0 talks HTTP.

    outer_step(ex), on every rank of the site, with ex.handoff the phase's
    fedsite.Handoff (tokens, metrics, step; given to DiLoCo.end_phase after the local
    checkpoint was written):
      1. gather each delta tensor in turn (a DTensor's full_tensor() under FSDP; DDP
         ranks hold it whole) and rank 0 streams theta_i - theta_global, plus what
         error feedback owes (error_feedback.Residual), into one file in the wire format
         `codec` (wire.py; ex.deltas hold theta - theta_i: the sign flips here);
      2. rank 0 hands file and Handoff to `site.round_trip` (fedsite.FedSite): send,
         wait for the round to pass, settle the lease, download the current
         theta_global (whatever round it is: a stale delta still ends in the newest);
      3. _arrived(): the residual settles by the RoundResult (owed once merged, dropped if
         not, reset when the outcome is unknown); then theta_global is scattered one tensor
         at a time into ex.theta.
    No rank ever holds more than its shard plus one full tensor. What became of the delta
    comes back to the loop as OuterResult.outcome, the fedsite.RoundResult, which
    DiLoCo.end_phase returns beside its row.
    `site` is None on the ranks other than 0.
    codec: a wire.Codec or a format name ("f32", "bf16", ...); error_feedback: keep a
    residual (lossy formats only); feedback_decay (--wire-feedback-decay): beta, the part of
    what the last delta left that the next one carries (error_feedback.Residual); fresh: a
    new run (--resume none), nothing owed from an earlier one.
    encode_on: "host" (the reference: rank 0 copies each gathered tensor to the host in
    fp32 and wire.py encodes it with numpy; Residual keeps error feedback in files on rank
    0; theta_global comes down file to file, fedsite.FedSite.fetch_theta) or "device"
    (int8/int4/int2, the site's share on its devices, the same bits: shard_wire.py): in step 1
    each rank encodes its own rows of each FSDP-sharded tensor with wire_torch.py and rank
    0 gathers only their codes and scales (an eighth of the fp32 bytes for int4); a
    tensor that cannot be split so (a 1-D norm weight, an odd int4 shard before the last,
    a DDP replica) is gathered and encoded on rank 0's device. Error feedback stays with
    the rank that encoded each part (error_feedback.RankResidual: a file per rank). In step 3
    an int8/int4/int2 update of theta_global (the aggregator's --down-wire) is not applied on rank
    0's host: rank 0 broadcasts its codes and scales one tensor at a time and every rank adds
    its own rows to theta on its device (wire.add_update's float32 bits); rank 0's host then
    repeats the addition file to file behind the training and checks the aggregator's
    digest (FedSite.check_behind), joined before the next delta is sent
    (FEDERATION_GUIDE.md section 4, "Where the site encodes").
    overlap (train.py --overlap; FEDERATION_GUIDE.md section 4, "Overlap"): step 2 runs on
    a thread (site.start_round_trip) and outer_step returns at once with
    OuterResult(theta_later=True): DiLoCo keeps the model's own weights and what they were
    when the delta left. settle(outer), later, does step 3 into DiLoCo.receive_theta(),
    which folds theta_global in (diloco.fold) before the next delta is computed.
    eager (--overlap-fold eager): the same, but the outer step answers OuterResult(eager=True):
    DiLoCo, built with the aggregator's outer lr and momentum (outer_config), starts the next
    phase from one local Nesterov step of the site's own delta (diloco.eager_step) and the fold
    replaces that proxy by theta_global; every theta taken in updates DiLoCo's estimate of the
    aggregator's momentum (receive_theta's `steps`: the rounds between the old theta and the new).
    Every theta set outside outer_step goes through DiLoCo.receive_theta (load_global, settle).
    """

    def __init__(self, site, workdir, codec=None, error_feedback=True, group=None, fresh=False, log=print,
                 overlap=False, encode_on="host", feedback_decay=1.0, eager=None):
        if codec is None or isinstance(codec, str):        # a format name: "f32", "BF16", ...
            codec = wire.Codec((codec or "f32").lower())
        self.codec = codec.validate()
        if encode_on not in ("host", "device"):
            raise ValueError(f"encode_on={encode_on!r}: use 'host' (numpy, the reference) or 'device' (wire_torch)")
        if encode_on == "device" and self.codec.fmt not in wire_torch.LEVELS:
            raise ValueError(f"encode_on='device' encodes int8, int4 and int2; --wire {self.codec.fmt} is encoded "
                             "on the host")
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
        self.feedback_decay = feedback_decay
        self.residual = Residual(workdir, log, fresh, decay=feedback_decay) if (
            self.rank == 0 and self.error_feedback and encode_on == "host") else None
        self.places = None           # encode_on="device": shard_wire.plan, made at the first collective use
        self.apply_on_device = False     # encode_on="device": an int8/int4/int2 update is added on the devices
        self.wire_bytes = None       # rank 0: size of the last delta file sent, bytes
        self.round = None            # the round of the theta_global the model was loaded with
        self.delta_path = os.path.join(workdir, "delta.safetensors")
        self.theta_path = os.path.join(workdir, "theta.safetensors")
        # --overlap (FEDERATION_GUIDE.md section 4, "Overlap"): the delta in flight
        self.overlap = overlap
        self.eager = eager           # --overlap-fold eager: the aggregator's {"lr", "momentum", "nesterov"}
        self.in_flight = False       # every rank: a round trip runs on rank 0 while the site trains on
        self.busy = None             # rank 0: its fedsite.Background
        self.wait_s = None           # how long the last settle() took (the wait, theta_global, the fold), s
        self.cadence = None          # phases measured in time: fedphase.Cadence (join); None: H steps

    def broadcast_initial(self, tensors):
        """Nothing here: the site loads theta_global (load_global) before its first phase."""

    def outer_config(self, inner_steps):
        """The site's DiLoCo outer step: plain replacement (sgd, lr 1, momentum 0: no momentum
        buffers; the aggregator owns the momentum), or under --overlap-fold eager the
        aggregator's own lr and momentum, for the proxy step and the momentum estimate."""
        if self.eager is None:
            return DiLoCoConfig.fedavg(inner_steps)
        lr, mu = self.eager["lr"], self.eager["momentum"]
        return DiLoCoConfig(inner_steps=inner_steps, outer_lr=lr, outer_momentum=mu,
                            outer_optimizer="nesterov" if mu > 0 else "sgd")

    # -- per-tensor movement
    def _full(self, part, p):
        """The whole tensor of a (possibly sharded) parameter's local part: collective under FSDP."""
        if hasattr(p, "to_local"):
            from torch.distributed.tensor import DTensor
            return DTensor.from_local(part, p.device_mesh, p.placements, shape=p.shape,
                                      stride=p.stride()).full_tensor()
        return part

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
        self.places = shard_wire.plan(self.codec, params, self.rank, self.world, self.group)
        # every DTensor's rows known: the update can be added where theta is, rank by rank
        self.apply_on_device = all(p.rows is not None or not p.sharded for p in self.places)
        if self.error_feedback:
            self.residual = RankResidual(self.workdir, names, self.places, self.rank, self.world, self.group,
                                         self.log, self.fresh, decay=self.feedback_decay)

    @torch.no_grad()
    def write_delta(self, names, params, deltas):
        """Rank 0 writes theta_i - theta_global (= -deltas) tensor by tensor in the wire
        format, plus what error feedback owes; the new residual goes to Residual's file
        (encode_on="device": each rank's share, _write_on_device)."""
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
            sq = torch.tensor([self.residual.sq], dtype=torch.float64, device=local(params[0]).device)
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
                dev = local(p).device
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
    def load_global(self, outer, held=None):
        """Make DiLoCo's theta and the model equal theta_global of the aggregator's CURRENT
        round (collective; DiLoCo.receive_theta: a phase starts there). Returns that round.
        held: the round of the theta DiLoCo holds (default the last one loaded; a resumed
        site: its checkpoint's), for the momentum estimate of --overlap-fold eager."""
        self._prepare(outer.names, outer.params)
        held = self.round if held is None else held
        self.round = on_rank0(lambda: self.site.fetch_theta(self.theta_path), self.group)
        if self.residual is not None:
            self.residual.check(self.round, {n: tuple(p.shape) for n, p in zip(outer.names, outer.params)})
        with outer.receive_theta(self._steps(held, self.round)) as theta:
            self.read_theta(outer.names, outer.params, theta)
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
            # the site trains on from its own weights; DiLoCo keeps what the fold needs
            if self.site is not None:
                self.busy = self.site.start_round_trip(self.delta_path, base, ex.handoff, self.theta_path,
                                                       defer_update=self.apply_on_device)
            self.in_flight = True
            return OuterResult(theta_later=True, eager=self.eager is not None)
        result = on_rank0(lambda: self.site.round_trip(self.delta_path, base, ex.handoff, self.theta_path,
                                                       defer_update=self.apply_on_device), self.group)
        self._arrived(result)
        self._take_theta(result, ex.names, ex.params, ex.theta)
        return OuterResult(outcome=result)

    def arrived(self):
        """--overlap, collective: has the round trip in flight ended (rank 0 looks, every rank learns it)?"""
        return self.in_flight and on_rank0(lambda: self.busy.done(), self.group)

    def settle(self, outer):
        """--overlap, collective: wait for the round trip in flight (rank 0 polls, the other
        ranks wait in small broadcasts), settle error feedback by its RoundResult, and hand
        the theta_global it brought to DiLoCo.receive_theta, which folds it into the model:
        every local tensor becomes theta_global + (what it trained since the send).
        -> the RoundResult."""
        t0 = time.monotonic()
        result = on_rank0(lambda: self.busy.wait(), self.group)
        held = self.round
        self._arrived(result)
        if self.site is not None:
            testhooks.fault_point("site.fold")    # test hook (testhooks.py): error feedback settled, theta not folded in
        with outer.receive_theta(self._steps(held, result.round)) as theta:
            self._take_theta(result, outer.names, outer.params, theta)
        self.busy, self.in_flight = None, False
        self.wait_s = round(time.monotonic() - t0, 3)
        return result

    def _steps(self, held, new):
        """Rounds from the theta held to the new one, for DiLoCo's momentum estimate (eager
        only; 0: none known, the estimate stays as it is)."""
        return new - held if self.eager is not None and held is not None and new > held else 0

    def _arrived(self, result):
        """A round trip ended (every rank): error feedback settles by its RoundResult, and the
        site's round is the theta_global it brought."""
        if self.residual is not None:
            self.residual.settle(result.base_round, result.merged_into if result.merged else None,
                                 result.reason or "")
        self.round = result.round


# ----------------------------------------------------------------------------- the site's run

def join(run):
    """One site = one stream: rank 0 connects to DARL and FedMom (fedsite.FedSite), every rank
    gets the block space and will read the windows of the spans rank 0 leases (run.source);
    the outer step goes through fedmom_server.py. `run`: train.Run, its model built.
    Returns (site, carrier); site is None off rank 0."""
    cfg, d, windows = run.cfg, run.d, run.windows
    if windows.train_windows < 1:      # said before any call to the central VM
        raise ConfigError(f"{cfg.data} has no training windows (all are held out): tokenize more "
                          "text, or fewer --heldout-windows in tokenize_corpus.py")
    per_step = cfg.batch_size * d.world_size * cfg.grad_accum
    site = fedsite.FedSite(cfg, windows, 4 * run.n_params, run.log.log, cfg.central_retry_s) if d.is_main else None
    if site is not None:
        run.log.incarnation = site.incarnation      # the one FedMom and DARL know this process by
    block_size, darl_seed, _, outer, offered = on_rank0(lambda: site.connect(per_step))
    eager = eager_settings(cfg, outer, run.log.log) if cfg.overlap and cfg.overlap_fold == "eager" else None
    phase_s = phase_length(cfg, offered, run.log.log)
    run.source = fedsite.LeasedSource(cfg, windows, block_size, darl_seed, d.rank, d.world_size)
    workdir = os.path.join(run.run_dir, "federation")
    if d.is_main:
        os.makedirs(workdir, exist_ok=True)
    carrier = FedMomCarrier(site, workdir, codec=cfg.wire_codec(), error_feedback=cfg.error_feedback,
                            fresh=cfg.resume == "none", log=run.log.log, overlap=cfg.overlap,
                            encode_on=cfg.encode_on, feedback_decay=cfg.wire_feedback_decay, eager=eager)
    carrier.cadence = Cadence(phase_s, cfg.diloco_inner_steps, per_step, block_size, cfg.overlap,
                              d.device, d.rank) if phase_s else None
    return site, carrier


def phase_length(cfg, offered, log):
    """T of phases measured in time: --diloco-phase-s when given (0: off), else the aggregator's
    offer in its join answer (fedmom_server.py --phase-s), else None (H steps a phase)."""
    if cfg.diloco_phase_s is not None:
        t, whence = cfg.diloco_phase_s or None, "--diloco-phase-s"
    else:
        t, whence = offered, "the aggregator's --phase-s"
    if t:
        log(f"phases measured in time: {t:g} s a round ({whence}), the site's own round trip counted in it; "
            f"the first phase leases {cfg.diloco_inner_steps} steps' blocks (--diloco-inner-steps) and the "
            "clock ends it")
    else:
        log(f"phases of {cfg.diloco_inner_steps} inner steps (--diloco-inner-steps; "
            + ("--diloco-phase-s 0)" if cfg.diloco_phase_s == 0 else "the aggregator offers no --phase-s)"))
    return t


class Cadence:
    """Phases measured in time on a federated site (--diloco-phase-s T, or the aggregator's
    --phase-s): what the next phase may spend, and how many blocks to lease for it.

    The aim is that every site's delta reaches the aggregator T s after the round opened,
    whatever the site's speed and link (FEDERATION_GUIDE.md, "Phases measured in time"):
    a phase that starts `age` s into the open round (the replies say how long it has been
    open) gets budget = T - age - pre_send, where pre_send is the measured time from the
    last inner step to the delta's acceptance (checkpoint, encode, upload). Without an age
    (--overlap: the next phase starts before the round closes; an aggregator that does not
    say it) the budget is T minus the site's own measured overhead per round (the cycle less
    its inner steps and its waits). Never below MIN_SHARE x T: a site that starts late still
    brings something. The lease is sized from budget / the measured step time
    (diloco.PhaseClock); the clock still ends the phase if the steps slow down.
    Rank 0 plans (plan(), learn()); every rank holds the PhaseClock, which shares rank 0's
    verdict after every step."""
    MIN_SHARE = 0.25

    def __init__(self, phase_s, inner_steps, per_step, block_size, overlap, device, rank):
        self.phase_s, self.inner_steps, self.per_step, self.block_size = phase_s, inner_steps, per_step, block_size
        self.overlap = overlap
        self.clock = PhaseClock(device=device, clock=testhooks.phase_clock(rank))
        self.pre_send_s = None       # last inner step -> delta accepted, s (running mean)
        self.overhead_s = None       # a cycle less its inner steps and waits, s (running mean)
        self.budget_s = self.predicted = None

    def budget(self, site, held_round):
        age = None if self.overlap else site.round_age(held_round)
        if age is not None:
            b = self.phase_s - age - (self.pre_send_s or 0.0)
        else:
            b = self.phase_s - (self.overhead_s or 0.0)
        return max(b, self.MIN_SHARE * self.phase_s)

    def plan(self, site, held_round):
        """Rank 0, before the lease: -> blocks to lease for the next phase."""
        self.budget_s = self.budget(site, held_round)
        step_s = self.clock.step_s
        self.predicted = max(1, round(self.budget_s / step_s)) if step_s else self.inner_steps
        return data.blocks_per_phase(self.predicted, self.per_step, self.block_size)

    def more(self):
        """Rank 0, at the end of a span with time left: blocks for the steps that still fit in
        the budget, or None when fewer than a block's steps do."""
        clock = self.clock
        est = clock.estimate()
        if est <= 0:
            return None
        steps = round((clock.budget_s - clock.elapsed()) / est)     # as near the budget as blocks allow
        if steps < max(1, math.ceil(self.block_size / self.per_step)):
            return None
        return data.blocks_per_phase(steps, self.per_step, self.block_size)

    def learn(self, pre_send_s, overhead_s):
        for name, v in (("pre_send_s", pre_send_s), ("overhead_s", overhead_s)):
            if v is not None and v >= 0:
                old = getattr(self, name)
                setattr(self, name, v if old is None else 0.5 * old + 0.5 * v)


def eager_settings(cfg, outer, log):
    """--overlap-fold eager: the aggregator's outer step as its join answer says it (every rank
    got it from rank 0). An aggregator that does not say it (older than --overlap-fold eager)
    is refused: the proxy would be a guess at its step."""
    if not outer or not outer.get("nesterov") or not {"lr", "momentum"} <= set(outer):
        raise ConfigError(f"--overlap-fold eager needs the aggregator's outer lr and Nesterov momentum, and "
                          f"{cfg.federation}'s /join answer does not give them ({outer!r}): update "
                          "fedmom_server.py on the central VM, or run --overlap-fold arrival")
    log(f"--overlap-fold eager: the aggregator's outer step is Nesterov, lr {outer['lr']:g}, momentum "
        f"{outer['momentum']:g}; each phase after a send starts from that step of this site's own delta"
        + (" (FedAvg: lr 1 and momentum 0 make that proxy the site's own weights, as --overlap-fold arrival)"
           if outer["lr"] == 1 and outer["momentum"] == 0 else ""))
    return {k: outer[k] for k in ("lr", "momentum", "nesterov")}


def train_site(run, site, carrier, start):
    """One site of the federation (every rank): theta_global of the current round, phases until
    DARL has no blocks left, every merged lease committed; then the final theta_global scored
    and saved. On an error rank 0 stops talking and releases nothing. Returns the step count."""
    try:
        # theta_global of the CURRENT round; a resumed site starts a fresh phase from it
        if carrier.eager is not None and start:
            run.log.log(f"--overlap-fold eager: the checkpoint of step {start} restored the estimate of the "
                        f"aggregator's momentum at round {run.fed_round}, norm {run.outer.momentum_norm():.6g}")
        carrier.load_global(run.outer, held=run.fed_round if start else None)
        where = "device (wire_torch)" if carrier.encode_on == "device" else "host (numpy)"
        run.log.log(f"federation: cluster {run.cfg.cluster}, theta_global of round {carrier.round}; "
                    f"LR schedule over {run.total} steps (--steps; default: the whole corpus at this site); "
                    f"deltas in {run.cfg.wire}, encoded on the {where} (--encode-on)")
        step = phase_loop(run, site, carrier, start)
        on_rank0(lambda: site.finish())         # every merged lease committed, then leave
        carrier.load_global(run.outer)          # the final global model
    except BaseException:
        if site is not None:
            site.abort()
        raise
    run.log_eval(step, carrier.round, final=True)
    run.save(step, carrier.round)
    return step


def phase_loop(run, site, carrier, start):
    """Outer phases until DARL has no blocks left: one span, its inner steps, the checkpoint,
    the round trip. Every rank runs this; returns the step count at the end.
    With carrier.cadence (phases measured in time) rank 0 sizes each lease from its plan and,
    after every inner step, says whether the phase ends on the next block boundary
    (PhaseClock.share: every rank ends on the same step); the part of the span not trained
    goes back to DARL's pool (fedsite.close_phase), and the next phase leases afresh."""
    cfg, d, log, model, outer, source = run.cfg, run.d, run.log, run.model, run.outer, run.source
    step, phases, seq, heldout = start, 0, run.windows.seq_len, {}
    cadence = carrier.cadence
    if not start:                        # the held-out loss before training, sent with the first delta
        ev = run.log_eval(0, carrier.round, first=True)
        heldout = {"heldout_loss": ev["loss"], "heldout_round": carrier.round}
    since_nll, since_tok = torch.zeros((), dtype=torch.float64, device=d.device), 0   # this rank
    to_device = HostToDevice(d.device)
    stepper = Stepper(run, step)
    model.train()
    pending = None                       # --overlap: the Sent of the delta in flight, its row written at settle()
    last = {}                            # the last cycle's utilisation, length and wait, sent with the next delta
    t_cycle = time.perf_counter()
    while (span := on_rank0(lambda: site.next_span(
            carrier.busy, cadence.plan(site, carrier.round) if cadence and d.is_main else None))) is not None:
        if span == fedsite.SETTLE:       # its round trip ended before DARL gave a span: take its theta in
            settle(run, carrier, pending, step)
            continue
        # runs of blocks mixed together once the step time is known (every rank: None until the first
        # phase ended), single blocks before, where the clock's cut may fall anywhere
        mix = cadence is not None and cadence.clock.step_s is not None
        phase = part = source.phase(*span, timed=cadence is not None, mix=mix)
        parts = [part]                   # a phase measured in time may go on into more spans
        if carrier.in_flight:            # overlap: the base stays the sent delta's until its round trip ends
            pending.round_at_next_phase = carrier.current()
        elif carrier.current() != carrier.round:
            # round start: theta_global of the aggregator's CURRENT round, unconditionally
            carrier.load_global(outer)
            log.log(f"loaded theta_global of round {carrier.round}")
        in_nll, in_tok = torch.zeros((), dtype=torch.float64, device=d.device), 0
        t_phase, fold_s = time.perf_counter(), 0.0
        budget = cadence.budget(site, carrier.round) if cadence and d.is_main else None
        if cadence:
            cadence.clock.begin(budget)
        decided = cadence is None        # phases measured in time: until the clock has spoken
        stepper.mark(step)               # the first row's step_ms: inner steps only, not the lease and theta waits
        s, ended_by = 0, None
        while True:
            while s < part.steps:
                phase = part
                stepper.begin(step)
                micros = phase.micro_batches(s)
                # the loss is normalised by the GLOBAL token count of the step: DDP and FSDP
                # average gradients over ranks, so each rank scales its token sum by
                # world/tokens, and a short (or empty) share of a ragged last step weighs right
                scale = d.world_size / (len(phase.step_windows(s)) * seq)
                for i, idx in enumerate(micros):
                    real = len(idx) > 0
                    t = to_device(run.windows.batch(idx if real else phase.windows[:1]))
                    with grad_sync(model, cfg, i == len(micros) - 1), autocast_ctx(cfg, d):
                        logits = model(t[:, :-1])
                        nll = F.cross_entropy(logits.flatten(0, 1).float(), t[:, 1:].flatten(), reduction="sum")
                    # an empty share still runs forward and backward (times 0): every rank makes
                    # the same collective calls, or FSDP/DDP wait forever for the missing one
                    (nll * (scale if real else 0.0)).backward()
                    if real:
                        in_nll += nll.detach()
                        since_nll += nll.detach()
                        in_tok += idx.size * seq
                        since_tok += idx.size * seq
                stepper.end()
                step += 1
                outer.count_inner_step()
                if cfg.throttle_ms:
                    time.sleep(cfg.throttle_ms / 1000)      # demo/test only: a slower site
                if not decided:
                    decided = clock_verdict(cadence.clock, phase, s, budget)   # collective, every rank
                if cfg.overlap_fold != "end" and s < phase.steps - 1 and carrier.arrived():
                    t_fold = time.perf_counter()            # theta_global is here: fold it in now, not at the end
                    with stepper.pause():
                        settle(run, carrier, pending, step)
                    fold_s += time.perf_counter() - t_fold
                    if cadence:
                        cadence.clock.pause(time.perf_counter() - t_fold)
                if stepper.due(step, s == phase.steps - 1):
                    row_nll, row_tok = pooled_nll(since_nll, since_tok, d)
                    log.total += int(row_tok)
                    stepper.train_row(step, row_nll / row_tok, row_tok, "tokens", round=carrier.round)
                    since_nll.zero_()
                    since_tok = 0
                s += 1
            if cadence is None or part.cut:
                break
            # the span ended with time left: rank 0 says whether another fits, and leases it
            t_more = time.perf_counter()
            with stepper.pause():
                # --overlap-fold end: the delta in flight settles at the phase's end, never mid-phase
              busy = carrier.busy if cfg.overlap_fold != "end" else None
              kind, more = on_rank0(lambda: more_span(site, cadence, busy))
            if kind == "span":
                part = source.phase(*more, timed=True, mix=mix)
                parts.append(part)
                s, decided = 0, False
            elif kind == fedsite.SETTLE:        # --overlap: the delta in flight came back meanwhile
                with stepper.pause():
                    settle(run, carrier, pending, step)
            else:
                ended_by = kind                   # "clock": no time for a block more; "data": DARL is done
                break
            cadence.clock.pause(time.perf_counter() - t_more)
            fold_s += time.perf_counter() - t_more

        # -- the phase's end: what the delta carries, the checkpoint, then the round trip
        t_inner_end, mono_inner_end = time.perf_counter(), time.monotonic()
        inner_s = t_inner_end - t_phase - fold_s      # a fold mid-phase is not an inner step
        ended_by = "steps" if cadence is None else "clock" if part.cut else ended_by
        if cadence and os.environ.get(testhooks.PHASE_CLOCK_RATE_ENV):   # a test's skewed clocks: every rank says
            print(f"phase clock: rank {d.rank} ends the phase after {sum(p.steps for p in parts)} steps, "
                  f"{sum(len(p) for p in parts)} windows (cut: {part.cut})", flush=True)
        if cadence:                      # the rest of its leases goes back to DARL: none outlives the phase
            on_rank0(lambda: fedsite.close_phase(site, part.end if part.cut else None))
        spans = [(p.lease, p.start, p.end) for p in parts]
        steps, windows = sum(p.steps for p in parts), sum(len(p) for p in parts)
        step_s = cadence.clock.end() if cadence else inner_s / max(steps, 1)
        phase_nll, phase_tok = pooled_nll(in_nll, in_tok, d)
        tokens = windows * seq
        tps = tokens / inner_s
        per_rank = run.flops * tps / d.world_size
        handoff = fedsite.Handoff(tokens=tokens, step=step, metrics={
            "loss": phase_nll / phase_tok, "tokens_per_s": tps, "mfu": per_rank / stepper.peak if stepper.peak else None,
            "tflops_per_rank": per_rank / 1e12, "peak_mem_gib": peak_memory_gib(d), "inner_s": inner_s,
            "steps": steps, "step_s": inner_s / max(steps, 1), "budget_s": budget,
            "ended_by": ended_by, **last, **heldout})
        heldout = {}                             # each held-out loss goes with one delta
        row, result = end_phase(run, carrier, handoff, pending)
        phases += 1
        sent = Sent(step=step, loss=handoff.metrics["loss"], span=spans, windows=windows, steps=steps,
                    inner_s=inner_s, tokens_per_s=tps, delta_norm=row["delta_norm"], outer_ms=row["outer_ms"],
                    wire_bytes=carrier.wire_bytes, residual_norm=carrier.residual_norm())
        if result is None:                       # overlap: in flight, its row written when it settles
            pending = sent
        else:
            log_round(run, carrier, sent, result, step)
        if cfg.eval_every and phases % cfg.eval_every == 0:
            ev = run.log_eval(step, carrier.round)       # reported with the next delta: the page plots it
            heldout = {"heldout_loss": ev["loss"], "heldout_round": carrier.round}
        now = time.perf_counter()
        last = log_phase(run, carrier, sent, result, step, step_s, budget, ended_by, now - t_cycle, now - t_inner_end)
        if cadence and d.is_main:
            wait = result.wait_s if result is not None else (carrier.wait_s or 0.0)
            cadence.learn(result.sent_at - mono_inner_end if result is not None and result.sent_at else None,
                          (now - t_cycle) - inner_s - wait)
        t_cycle = now
        stepper.mark(step)
    if carrier.in_flight:                        # DARL is done: the last delta's round trip
        settle(run, carrier, pending, step)
    return step


def clock_verdict(clock, phase, s, budget):
    """After inner step `s` of a phase measured in time (every rank, collective): rank 0 says
    where the phase ends (the first block boundary at or after what it trained, when the one
    after would overrun the budget: data.LeasedPhase.cut_point) or that it goes on, and every
    rank cuts the phase alike. -> True once decided (the phase's end is known)."""
    clock.count()
    trained = min((s + 1) * phase.per_step, len(phase))
    verdict = -1
    if clock.rank == 0:
        n = phase.cut_point(trained, budget - clock.elapsed(), clock.estimate())
        verdict = -1 if n is None else n
    verdict = clock.share(verdict)
    if verdict < 0:
        return s >= phase.steps - 1
    if verdict < len(phase):
        phase.cut_at(verdict)
    return True


def more_span(site, cadence, busy):
    """Rank 0, when a span of a phase measured in time ended with time left: ("span", the next
    span, leased for what is left of the budget), ("clock", None) when not even a block more
    fits, ("data", None) when DARL has no block for it now (fedsite.more_span), or (SETTLE, None) under --overlap when the
    delta in flight came back first (take its theta in, then ask again)."""
    blocks = cadence.more()
    if blocks is None:
        return "clock", None
    got = yield from fedsite.more_span(site, busy, blocks)
    if got == fedsite.SETTLE:
        return fedsite.SETTLE, None
    return ("data", None) if got is None else ("span", got)


def log_phase(run, carrier, sent, result, step, step_s, budget, ended_by, cycle_s, after_s):
    """The "phase" row of metrics.jsonl (FEDERATION_GUIDE.md section 6): how the phase ended and
    how busy the site was over its whole cycle (lease, inner steps, checkpoint, round trip)
    -> what the next delta reports of it."""
    wait = result.wait_s if result is not None else carrier.wait_s
    util = sent.inner_s / cycle_s if cycle_s > 0 else None
    row = {"split": "phase", "step": step, "steps": sent.steps, "step_s": step_s, "budget_s": budget,
           "predicted_steps": carrier.cadence.predicted if carrier.cadence and run.d.is_main else None,
           "ended_by": ended_by, "inner_s": round(sent.inner_s, 3), "cycle_s": round(cycle_s, 3),
           "after_s": round(after_s, 3), "util": util, "wait_s": wait,
           "waited_on": result.waiting_on if result is not None else None, "round": carrier.round}
    run.log.metric(row)
    return {"util": util, "cycle_s": cycle_s, "wait_s": wait}


def end_phase(run, carrier, handoff, pending=None):
    """A federated phase's outer step (collective): the local checkpoint (model, optimizer,
    step, round) first, THEN the delta leaves with the Handoff (FEDERATION_GUIDE.md
    section 4, step 4), so a site killed during the round trip resumes at a step that
    counts the phase its delta carried. Under --overlap the previous delta (pending: its
    Sent) settles and its theta_global is folded in between the two: the checkpoint never
    holds a fold. Returns DiLoCo.end_phase's (row, fedsite.RoundResult or None while the
    delta is in flight)."""
    if carrier.eager is not None:         # said first: a kill mid-save resumes from an earlier one, also said
        run.log.log(f"--overlap-fold eager: the checkpoint of step {handoff.step} holds the estimate of the "
                    f"aggregator's momentum at round {carrier.round}, norm {run.outer.momentum_norm():.6g}")
    run.save(handoff.step, carrier.round)
    if carrier.in_flight:
        settle(run, carrier, pending, handoff.step)
    return run.outer.end_phase(handoff)


def settle(run, carrier, pending, step):
    """--overlap (collective): the round trip in flight ends here - FedMomCarrier.settle waits
    for it and folds its theta_global in - and its delta's row is written (`pending`: its Sent)."""
    log_round(run, carrier, pending, carrier.settle(run.outer), step)


@dataclasses.dataclass
class Sent:
    """What one phase's delta carried, from the phase's end until its round trip ended."""
    step: int                    # the site's step at the phase's end (its checkpoint's)
    loss: float                  # the phase's training loss, pooled over ranks
    span: list                   # [(lease, start, end)] of the DARL spans it trained (more than one: a
                                 # phase measured in time that went on past a span's end)
    windows: int
    steps: int
    inner_s: float               # its inner steps' time, a fold mid-phase not counted
    tokens_per_s: float
    delta_norm: float            # DiLoCo's row of the outer step that sent it
    outer_ms: float
    wire_bytes: int              # rank 0: the delta file's size
    residual_norm: float         # rank 0: what error feedback kept (None without it)
    round_at_next_phase: int = None    # --overlap: the aggregator's round when the next phase began


def log_round(run, carrier, sent, r, step):
    """The "federation" row of one delta (FEDERATION_GUIDE.md section 6), built and written here
    only, once its round trip ended: what the phase trained (sent) and what became of it (r, the
    fedsite.RoundResult); `step` is the site's step now (under --overlap: at the fold)."""
    cfg = run.cfg
    row = {"split": "federation", "step": sent.step, "loss": sent.loss, "lease": sent.span[0][0],
           "positions": [sent.span[0][1], sent.span[-1][2]], "spans": [list(x) for x in sent.span],
           "windows": sent.windows, "steps": sent.steps,
           "inner_s": round(sent.inner_s, 3), "tokens_per_s": sent.tokens_per_s, "delta_norm": sent.delta_norm,
           "outer_ms": sent.outer_ms, "wire": cfg.wire, "encode_on": carrier.encode_on,
           "wire_bytes": sent.wire_bytes, "residual_norm": sent.residual_norm, "overlap": cfg.overlap}
    if sent.round_at_next_phase is not None:
        row["round_at_next_phase"] = sent.round_at_next_phase
    row.update({"round": r.round, "base_round": r.base_round, "tokens": r.tokens, "merged": r.merged,
                "merged_into": r.merged_into, "reason": r.reason, "send_s": r.send_s, "wait_s": r.wait_s,
                "theta_via": r.theta_via, "down_bytes": r.down_bytes, "down_s": r.down_s})
    if cfg.overlap:
        row["settle_s"] = carrier.wait_s         # its return outside inner steps: wait, theta_global, fold
        row["fold_step"] = step
    run.log.metric(row)
    run.log.log(f"round {r.base_round} -> {r.round}: " + ("merged" if r.merged else f"NOT merged ({r.reason})")
                + f"; lease {r.lease} [{r.start}, {r.end}) = {sent.windows} windows in {sent.steps} steps, "
                f"loss {sent.loss:.4f}, {sent.tokens_per_s:.4g} tokens/s, outer step {sent.outer_ms / 1e3:.1f} s"
                + (f", waited {carrier.wait_s:.1f} s for it" if cfg.overlap else ""))
