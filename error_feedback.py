"""error_feedback.py - a federated site's error feedback: what the wire format dropped from its
delta, kept in files and owed to the aggregator with the next delta.

Runs on: compute nodes, imported by fedphase.py (FedMomCarrier) and the tests; not started on
its own. No port. State: the residual files in the federation workdir
(runs/<run>/federation/, beside the checkpoints), which a job with --resume auto finds again:
  Residual       --encode-on host: rank 0, which encodes the whole delta with numpy, keeps
                 residual.safetensors (owed now) and residual-next.safetensors (what the
                 delta in flight will leave owed)
  RankResidual   --encode-on device: every rank keeps what it encoded of each tensor,
                 residual-rank<r>.safetensors and residual-rank<r>-next.safetensors
Both follow one set of rules (Residual's docstring), driven by FedMomCarrier: begin() with
each delta written, check() at each download of theta_global, settle() by each delta's
fedsite.RoundResult. Why a residual follows the aggregator's merges and not the local
step: FEDERATION_GUIDE.md section 4, "Wire formats and error feedback".
"""
import json
import os
import re

import numpy as np
import torch
import torch.distributed as dist

import durable
import tensorio
from diloco import sq_norm


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
      send:        x = delta + decay x owed; sent = decode(encode(x)); next = x - sent
                   (decay: --wire-feedback-decay, beta; 1 carries all of it. The files
                   keep the residual undecayed, so a restart decays it once, when it is used)
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

    def __init__(self, workdir, log=print, fresh=False, decay=1.0):
        self.log, self.decay = log, float(decay)
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
        """x + decay x owed (float32; decay 1: x + owed, no multiply)."""
        if self.owed is None:
            return x
        owed = self.owed.read(name).reshape(x.shape)
        return x + (owed if self.res.decay == 1 else owed * np.float32(self.res.decay))

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

    def __init__(self, workdir, names, places, rank, world, group=None, log=print, fresh=False, decay=1.0):
        self.workdir, self.rank, self.world, self.group = workdir, rank, world, group
        self.decay = float(decay)
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
        owed = torch.from_numpy(self.owed.read(name)).view(x.shape).to(x.device)
        return x + (owed if self.res.decay == 1 else owed * self.res.decay)

    def keep_left(self, name, left):
        self.res.sq += sq_norm(left.reshape(-1))
        self.w.write(name, left.cpu().numpy())
