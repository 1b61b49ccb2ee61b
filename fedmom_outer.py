"""fedmom_outer.py - the aggregator's outer state in use: theta_global, the momentum buffer and
the residual of --down-wire in the blocks --memory-gb gives them (outer_budget.Store: memory,
and file blocks in --outer-dir past it), a round merged into them robustly, checkpointed,
rebuilt, and copied to files for downloads.

Runs on: the central VM, imported by fedmom_state.py (FedMomState holds one OuterKeeper);
Python standard library + numpy + tensorio.py + outer_state.py (the arrays and a round
applied to them) + outer_budget.py (where they live) + fedmom_checkpoint.py (the checkpoint
and the replay) + fedmom_merge.py (the clip, a delta's norm) + fedmom_store.py; never torch,
no HTTP. Not run on its own.

The arrays belong to `mem_lock`: a merge, a checkpoint and writing a copy hold it, for
seconds to minutes; the bookkeeping beside them (the round, the checkpoint's record, the
log of Steps, the update) is the Ledger's and its lock's (fedmom_store.py). mem_lock is
always taken BEFORE the Ledger's lock, never after it.

The robust merge (merge): each delta is scaled to at most --clip-factor x the median delta
norm of the round and of the last rounds' merged deltas (fedmom_merge.clip_scales), and a
merge whose theta or momentum would not be finite is redone from the rebuilt arrays -
without the largest contribution (excluded), or with the momentum reset when the old
momentum alone overflows. fedmom_merge.py's docstring has the update rule.
"""
import hashlib
import math
import json
import os
import threading
import time
import traceback

import numpy as np

import durable
import fedmom_checkpoint
import fedmom_merge
import fedmom_store
import merge_pool
import outer_budget
import testhooks
import outer_state
import tensorio
from fedmom_round import Refused
from fedmom_store import log

BUSY_RETRY_S = 5              # Retry-After of a 503 busy: a copy of theta waits for a merge or checkpoint
CHECKPOINT_RETRY_S = 30.0     # a checkpoint that failed (a full disk) is tried again after this
MERGE_PAUSE_ENV = "PWW_FEDMOM_MERGE_PAUSE_S"   # tests: sleep after each merged tensor


def file_sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def structure_digest(specs):
    return hashlib.sha256(json.dumps(sorted((n, list(s)) for n, s in specs.items())).encode()).hexdigest()


def init_shapes(init_path):
    """{name: shape} of the init file (its header), checked: every tensor floating point."""
    with tensorio.TensorReader(init_path) as r:
        bad = [n for n in r.names if r.specs[n][0] not in tensorio.FLOAT_DTYPES]
        if bad:
            raise SystemExit(f"--init {init_path}: tensors {bad[:5]} are not floating point; "
                             "only float tensors can be merged (save the parameters alone)")
        return {n: tuple(r.specs[n][1]) for n in r.names}


def init_outer(init_path, store=None):
    """theta of round 0 (outer_state.OuterState, no momentum or residual yet) from the init
    file, every tensor as fp32 straight into its place (the store's blocks), checked: floating
    point and finite."""
    shapes = init_shapes(init_path)
    theta = outer_state.alloc(shapes, store, "theta", False)
    with tensorio.TensorReader(init_path) as r:
        for n in r.names:
            outer_state.fill(theta[n], r, n)
            if not all(np.isfinite(c).all() for c in merge_pool.chunks(theta[n])):
                raise SystemExit(f"--init {init_path}: tensor {n!r} holds NaN or Inf; a global model "
                                 "must start finite")
    return outer_state.OuterState(shapes, theta, store=store)


def init_theta(init_path, out_path, fsync=True):
    """theta-0 from the init file as one fp32 tensor file (init_outer's checks)."""
    init_outer(init_path).write("theta", out_path, fsync=fsync)


def init_id(init_path, specs):
    """What state.json records of the model a run started from, to recognise it at a restart."""
    st = os.stat(init_path)
    return {"sha256": file_sha256(init_path), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "structure": structure_digest(specs)}


class OuterKeeper:
    """The outer state of the ledger's round: `outer` (outer_state.OuterState) and what is done
    to it. `clock` is the monotonic clock (the checkpoint's retry, a merge's seconds)."""

    def __init__(self, cfg, state_dir, ledger, clock=time.monotonic):
        self.cfg, self.dir, self.ledger, self.clock = cfg, state_dir, ledger, clock
        self.outer = None             # theta, momentum, residual of the ledger's round, in its store's blocks
        self.specs = {}               # tensor -> shape
        self.budget = self.store = None   # outer_budget.Budget and Store, once the shapes are known (place())
        self.outer_dir = cfg.outer_dir or os.path.join(state_dir, outer_budget.OUTER_DIR)
        self.mem_lock = threading.Lock()
        self.checkpointing = False    # a checkpoint holds mem_lock (writing the arrays out)
        self.replay_error = None      # a rebuild that gave other bits than the round recorded: merges stop
        self.last_checkpoint = None   # {"round", "seconds", "bytes"} of the last one written
        self.checkpoint_retry_at = 0.0
        self.merge_pause_s = float(os.environ.get(MERGE_PAUSE_ENV, "0") or 0)
        self._pool = None             # merge_pool.Pool, started at the first round or replay that needs it
        merge_pool.sweep_stale()      # the shared arrays of an aggregator killed here before

    def procs(self):
        """The merge workers a round runs on (0: in this process): --merge-procs, for a model
        of POOL_MIN_PARAMS or more (a smaller one runs faster here than through the pipes)."""
        procs = self.cfg.merge_procs or os.cpu_count() or 1
        params = sum(math.prod(sh) for sh in self.specs.values())
        return procs if procs > 1 and params >= merge_pool.min_params() else 0

    def pool(self):
        """The round's worker processes (None: this process), started on first use: an
        aggregator that never merges starts none."""
        if not self.procs():
            return None
        if self._pool is None:
            self._pool = merge_pool.Pool(self.procs(), outer_state.worker_argv())
        return self._pool

    def place(self, kinds=None):
        """Once the shapes are known, at a start: the budget, the start's checks and the store
        the outer state is loaded into (outer_budget.make_store), for the arrays of `kinds`
        (default: those this run keeps)."""
        cfg = self.cfg
        kinds = kinds or outer_budget.kinds_of(cfg.outer_momentum, cfg.down_codec())
        self.budget, self.store = outer_budget.make_store(self.specs, kinds, cfg.down_codec(), self.procs(),
                                                          cfg.memory_gb, self.outer_dir, lambda m: log(f"fedmom: {m}"))

    def pool_for(self, steps):
        """The pool when there is work for it."""
        return self.pool() if steps else None

    def close(self):
        """Stop the merge workers (they also exit on their own when this process dies) and let
        go of the outer state's blocks."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None
        if self.store is not None:
            self.outer = None
            self.store.release()

    # ---- a start

    def create(self, init_path):
        """Round 0 from --init, read into the store's blocks and written as the first
        checkpoint -> its record (the rebuild at the start finds the arrays in place)."""
        self.specs = init_shapes(init_path)
        self.place()
        self.outer = init_outer(init_path, self.store)
        return fedmom_checkpoint.write_checkpoint(self.outer, self.dir, None, self.cfg.fsync)

    def read_shapes(self):
        self.specs = fedmom_checkpoint.read_shapes(self.dir, self.ledger.ckpt)
        self.place()

    def logged_files(self):
        """The spool files of the rounds logged since the checkpoint (a restart replays them)."""
        return {os.path.join(self.dir, f) for s in self.ledger.log for f in fedmom_checkpoint.step_files(s)}

    def clean_dir(self):
        """Remove what a crash left in the state dir: temp files, files of other rounds, a
        checkpoint of the older layout that a newer one replaced."""
        ckpt, update = self.ledger.ckpt, self.ledger.update
        keep = set(fedmom_checkpoint.checkpoint_files(self.dir, ckpt)) | {"state.json", "rounds.jsonl", "spool"}
        if update:
            keep.add(update["file"])
        for fn in os.listdir(self.dir):
            if fn not in keep and (fn.startswith(("theta-", "momentum-", "merged-", "update-", "residual-"))
                                   or durable.is_tmp(fn)):
                os.unlink(os.path.join(self.dir, fn))
        for d in os.listdir(self.dir):
            path = os.path.join(self.dir, d)
            if not (d.startswith(fedmom_checkpoint.CKPT_DIR) and os.path.isdir(path)):
                continue
            for fn in os.listdir(path):          # a segment a killed checkpoint was writing, or every
                if durable.is_tmp(fn) or d != ckpt.get("dir"):          # file of a checkpoint not named
                    os.unlink(os.path.join(path, fn))
            if d != ckpt.get("dir"):
                os.rmdir(path)

    def rebuild(self, at_start=False):
        """`outer` from the checkpoint's files and the Steps logged since, each replayed and
        checked against the theta digest it published (fedmom_checkpoint.rebuild). At the start
        a mismatch stops the server; later (rebuilding after a failed merge) it stops the merges
        and shows on /status. The caller holds mem_lock (or is starting)."""
        c, steps, rnd, t0 = self.ledger.ckpt, self.ledger.log, self.ledger.table.round, time.monotonic()
        if self.outer is not None and self.outer.dirty:
            # the failed round's arrays are the store's blocks: the checkpoint is loaded into
            # them again (the caller dropped the failed try's frames), the state held once
            self.outer.drop()
        try:
            outer = fedmom_checkpoint.rebuild(self.dir, c, steps, self.cfg.threads, pool=self.pool_for(steps),
                                              store=self.store, delta_bytes=self.budget.delta_bytes())
        except Exception as e:         # a mismatch, a missing or damaged file, a non-finite replay, a disk
            if self.outer is not None:
                self.outer.dirty = True    # whatever it holds is not a durable round: never served
            if isinstance(e, (merge_pool.WorkerDied, merge_pool.DiskError)) and not at_start:
                # nothing durable is wrong (a worker died, a file block's disk failed): the next
                # merge rebuilds first (merge), on new workers
                log(f"fedmom: the rebuild of round {rnd} FAILED ({type(e).__name__}: {e}); it runs again before "
                    "the next merge")
                raise
            why = (f"the outer state of round {rnd} cannot be rebuilt from the checkpoint of round "
                   f"{c['round']} and the {len(steps)} round(s) logged since: {type(e).__name__}: {e}")
            if at_start:
                raise SystemExit(f"fedmom_server: !!! {why}. Nothing was changed; restore the state dir from a "
                                 "backup, or keep it for a bug report")
            log(f"fedmom: !!! {why}; merges stop")
            self.replay_error = why
            raise
        if outer.round != rnd:
            raise SystemExit(f"fedmom_server: !!! state.json is at round {rnd} but its checkpoint "
                             f"(round {c['round']}) and log reach round {outer.round}")
        self.outer = outer
        if steps:
            log(f"fedmom: replayed rounds {steps[0].round}-{steps[-1].round} from the checkpoint of round "
                f"{c['round']} in {time.monotonic() - t0:.1f} s; theta digest {outer.digest[:12]}... as recorded")

    # ---- a round

    def merge(self, batch, history):
        """The merge of `batch` (fedmom_round.Pending) into round + 1, robustly (the module
        docstring); `history`: the delta norms of the last rounds, for the clip. The caller
        holds mem_lock; the arrays become round + 1's (outer_state.apply_round), and a failed
        try rebuilds them first. -> (stats or None, the deltas merged, [(delta, why excluded)])."""
        cfg, rnd = self.cfg, self.ledger.table.round
        if self.outer.dirty:                        # a rebuild cut short by a merge worker's death
            self.rebuild()
        live, dropped, reset = list(batch), [], None
        new, mu, codec = rnd + 1, cfg.outer_momentum, cfg.down_codec()
        while live:
            total = sum(p.tokens for p in live)
            shares = [p.tokens / total for p in live]
            scales, clip = self._clip(live, history, rnd)
            step = outer_state.Step(new, [(os.path.relpath(p.path, self.dir), w * c)
                                          for p, w, c in zip(live, shares, scales)],
                                    cfg.outer_lr, mu, bool(reset) or mu == 0 or self.outer.momentum is None, codec)
            t0 = self.clock()
            try:
                stats = outer_state.apply_round(
                    self.outer, fedmom_checkpoint.resolved(step, self.dir),
                    codec and os.path.join(self.dir, f"update-{new}.safetensors"), {"round": str(new)}, cfg.fsync,
                    cfg.threads, after_tensor=self._after_tensor, pool=self.pool_for([step]),
                    delta_bytes=self.budget.delta_bytes())
            except fedmom_merge.NonFinite as e:
                traceback.clear_frames(e.__traceback__)     # the failed try's arrays, let go before the rebuild
                self.rebuild()                      # the arrays are half merged: back to round rnd
                if not step.fresh and outer_state.momentum_alone_overflows(self.outer, e.name, cfg.outer_lr, mu):
                    reset = (f"{e}, with every delta zero: the momentum buffer of round {rnd} is reset "
                             "(this round steps as the first one did)")
                    log(f"fedmom: MOMENTUM RESET at the merge of round {rnd}: {reset}")
                    continue
                worst = max(zip(live, shares, scales), key=lambda x: x[1] * x[2] * (x[0].norm or 0.0))[0]
                why = (f"{e}: this delta (norm {worst.norm:.4g}), the largest contribution, is excluded "
                       "and the round merged without it")
                log(f"fedmom: EXCLUDED delta from {worst.cluster} ({worst.incarnation}) at the merge of round "
                    f"{rnd}: {why}")
                live.remove(worst)
                dropped.append((worst, why))
                continue
            step.digest = self.outer.digest
            update = codec and {"file": f"update-{new}.safetensors", "round": new, "format": codec.fmt,
                                **stats["published"]}
            stats.update(merge_s=self.clock() - t0, weights=shares, scales=scales, clip=clip, momentum_reset=reset,
                         update=update, step=step, outer_lr=cfg.outer_lr, outer_momentum=mu)
            return stats, live, dropped
        return None, [], dropped

    def _clip(self, batch, history, rnd):
        """The robust rule (fedmom_merge.clip_scales): scale per delta and the record's "clip"."""
        factor = self.cfg.clip_factor
        scales, limit = fedmom_merge.clip_scales([p.norm or 0.0 for p in batch], history, factor)
        clipped = [{"cluster": p.cluster, "incarnation": p.incarnation, "norm": p.norm, "scale": round(c, 6)}
                   for p, c in zip(batch, scales) if c < 1.0]
        for c in clipped:
            log(f"fedmom: CLIPPED delta from {c['cluster']} ({c['incarnation']}) for round {rnd}: "
                f"norm {c['norm']:.4g} > {factor:g} x the median norm; scaled by {c['scale']:.4g}")
        return scales, {"factor": factor, "limit": limit, "clipped": clipped}

    def _after_tensor(self, name):
        if self.merge_pause_s:
            time.sleep(self.merge_pause_s)
        testhooks.fault_point("fedmom.merge")

    def past_files(self, new, old_update):
        """The files of the round before `new` (its update and copies of theta and momentum) that
        no checkpoint names, for the caller to remove. The caller holds the ledger's lock."""
        ckpt = set(fedmom_checkpoint.checkpoint_files(self.dir, self.ledger.ckpt))
        names = [f"theta-{new - 1}.safetensors", f"momentum-{new - 1}.safetensors"]
        names += [old_update["file"]] if old_update else []
        return [os.path.join(self.dir, fn) for fn in names
                if fn not in ckpt and os.path.exists(os.path.join(self.dir, fn))]

    # ---- the checkpoint

    def checkpoint_due(self):
        """The caller holds the ledger's lock."""
        rnd = self.ledger.table.round
        return (self.outer is not None and not self.outer.dirty and self.outer.round == rnd
                and self.clock() >= self.checkpoint_retry_at
                and rnd - self.ledger.ckpt["round"] >= self.cfg.checkpoint_rounds)

    def checkpoint(self, force=False):
        """Write theta, momentum and residual of the current round, durable, segment by segment
        over the last checkpoint's (fedmom_checkpoint.write_checkpoint: the disk holds one
        checkpoint and one segment more); once every segment is written, state.json names the
        new checkpoint and the logged rounds' deltas it covers are removed (outside the locks).
        -> its round, or None when none was due."""
        L, gone = self.ledger, []
        with self.mem_lock:
            with L.lock:
                if not (force or self.checkpoint_due()) or self.outer.dirty:
                    return None
                rnd, self.checkpointing = L.table.round, True
            t0 = time.monotonic()
            try:
                record = fedmom_checkpoint.write_checkpoint(self.outer, self.dir, L.ckpt, self.cfg.fsync,
                                                            after_file=lambda: testhooks.fault_point("fedmom.checkpoint"))
            finally:
                with L.lock:
                    self.checkpointing = False
            with L.lock:
                mark, old, covered = L.mark(), L.ckpt, [s for s in L.log if s.round <= rnd]
                L.ckpt, L.log = record, [s for s in L.log if s.round > rnd]
                L.save_or_rewind(mark)
                gone = [os.path.join(self.dir, f)                         # clean_dir's, after a crash
                        for f in fedmom_checkpoint.stale_files(self.dir, old, record)]
                gone += fedmom_store.bury([os.path.join(self.dir, f) for s in covered
                                           for f in fedmom_checkpoint.step_files(s)])
                nbytes = sum(os.path.getsize(os.path.join(self.dir, f))
                             for f in fedmom_checkpoint.checkpoint_files(self.dir, record))
                self.last_checkpoint = {"round": rnd, "seconds": round(time.monotonic() - t0, 3), "bytes": nbytes}
        log(f"fedmom: checkpoint of round {rnd}: {nbytes / 2**30:.2f} GiB in {self.last_checkpoint['seconds']:.1f} s; "
            f"{len(covered)} logged round(s) covered")
        fedmom_store.remove(gone)
        return rnd

    def checkpoint_when_due(self):
        """checkpoint() after a round, or at a start (killed before it was written); a failure is
        tried again in CHECKPOINT_RETRY_S: the rounds are durable without it."""
        try:
            self.checkpoint()
        except Exception as e:
            self.checkpoint_retry_at = self.clock() + CHECKPOINT_RETRY_S
            log(f"fedmom: checkpoint of round {self.ledger.table.round} FAILED ({type(e).__name__}: {e}); the "
                f"rounds since the last one (round {self.ledger.ckpt['round']}) stay logged and are replayed at "
                "a restart")

    # ---- reading

    def copy(self, which):
        """(file name or None, round) of `which` ("theta", "momentum") of the current round as a
        file of the state dir: one already on disk (the checkpoint's, or a copy), else written
        from memory (not durable, not needed for a restart: a copy to read; None when no
        momentum is kept). Never waits for the arrays: a merge or a checkpoint holds mem_lock for
        seconds to minutes, and a download waiting there would hold an HTTP worker all that time
        (enough of them and heartbeats and /status wait too): while one runs, 503 busy, and the
        client retries; the bookkeeping around them and another copy being written are waited
        for. The copy is written holding mem_lock (the arrays and the round cannot change) but
        not the ledger's lock."""
        L = self.ledger
        with L.lock:
            rnd, fn = L.table.round, f"{which}-{L.table.round}.safetensors"
            if os.path.exists(os.path.join(self.dir, fn)):
                return fn, rnd
        while not self.mem_lock.acquire(timeout=0.05):   # held by a merge, a checkpoint, or their bookkeeping
            with L.lock:
                if L.table.merging or self.checkpointing:
                    raise Refused(503, f"the {which} of round {rnd} is not on disk and the outer state is busy "
                                       f"({'a merge' if L.table.merging else 'a checkpoint'}); retry in a few "
                                       "seconds", code="busy", round=rnd, retry_after_s=BUSY_RETRY_S)
        try:
            with L.lock:
                rnd, fn = L.table.round, f"{which}-{L.table.round}.safetensors"
                if self.outer is None or self.outer.dirty or self.outer.round != rnd:
                    raise Refused(503, f"the outer state of round {rnd} is not in memory "
                                       f"({self.replay_error or 'being rebuilt'}); see GET /status",
                                  code="unavailable", round=rnd)
                if which == "momentum" and self.outer.momentum is None:
                    return None, rnd
            if not os.path.exists(os.path.join(self.dir, fn)):
                self.outer.write(which, os.path.join(self.dir, fn), fsync=False)
            return fn, rnd
        finally:
            self.mem_lock.release()

    def open_theta(self):
        """(open file, round) of the current theta_global (a copy: copy()); the open file stays
        readable after the next round removes it."""
        while True:
            fn, rnd = self.copy("theta")
            try:
                return open(os.path.join(self.dir, fn), "rb"), rnd
            except FileNotFoundError:        # removed by a round that ended just now: its successor's
                continue

    def open_update(self, base_round, base_digest):
        """(open file, round, digest) of the update from round `base_round` to the current
        round, for a site whose theta of base_round has wire.Digest `base_digest`; the site
        adds it to that theta and gets `digest` (wire.apply_update). Refused 409 no_update
        (download the full theta) unless exactly that update exists."""
        with self.ledger.lock:
            u, rnd = self.ledger.update, self.ledger.table.round
            if u is None or u["round"] != rnd:
                why = ("this aggregator publishes no updates (--down-wire f32)" if self.cfg.down_codec() is None
                       else f"round {rnd} has no update (its merge ran without --down-wire)")
            elif base_round != u["round"] - 1:
                why = f"the update of round {u['round']} applies to round {u['round'] - 1}, not {base_round}"
            elif base_digest != u["base_digest"]:
                why = (f"your theta of round {base_round} is not the one the update applies to (digest "
                       f"{str(base_digest)[:12]}... != {u['base_digest'][:12]}...)")
            else:
                return open(os.path.join(self.dir, u["file"]), "rb"), u["round"], u["digest"]
        raise Refused(409, f"{why}: download the full theta_global (GET /theta)", code="no_update", round=rnd)

    def kept_files(self):
        """What the state dir holds and why -> [{"file", "bytes", "why"}]: the checkpoint, the
        deltas of the rounds logged since (a restart replays them), the current round's update
        and copy of theta (when one was written), and the open round's deltas; anything else
        is removed once a later round or checkpoint is durable (fedmom_state.py's docstring)."""
        out, L = [], self.ledger
        with L.lock:
            c, rnd = L.ckpt["round"], L.table.round
            if "dir" in L.ckpt:                    # the segments, as one entry
                segs = fedmom_checkpoint.checkpoint_files(self.dir, L.ckpt)
                size = sum(os.path.getsize(os.path.join(self.dir, f)) for f in segs
                           if os.path.exists(os.path.join(self.dir, f)))
                out.append({"file": L.ckpt["dir"] + "/", "bytes": size,
                            "why": f"checkpoint of round {c}: theta_global, the momentum buffer and what the "
                                   f"updates rounded away, in {len(segs)} segments"})
                named = []
            else:
                named = [(L.ckpt["theta"], f"checkpoint of round {c}: theta_global"),
                         (L.ckpt["momentum"], f"checkpoint of round {c}: the momentum buffer"),
                         (L.ckpt["residual"], f"checkpoint of round {c}: what its update rounded away")]
            named += [(p, f"round {s.round}'s merged delta, replayed from the checkpoint at a restart")
                      for s in L.log for p, _ in s.deltas]
            if L.update and L.update["round"] == rnd:
                named += [(L.update["file"], "the current round's update (--down-wire)")]
            named += [(f"theta-{rnd}.safetensors", "a copy of the current theta_global, for downloads")]
            named += [(os.path.relpath(p.path, self.dir), f"{p.cluster}'s delta for the open round {rnd}")
                      for p in L.table.pending.values()]
        for fn, why in named:
            try:
                out.append({"file": fn, "bytes": os.path.getsize(os.path.join(self.dir, fn)), "why": why})
            except (TypeError, OSError):        # no momentum yet, or a file just replaced
                continue
        return out

    def status(self):
        """The outer state's part of GET /status (the caller holds the ledger's lock)."""
        L, cfg = self.ledger, self.cfg
        mem, disk = self.budget.split() if self.budget else (0, 0)
        return {"replay_error": self.replay_error,
                "memory": self.budget and {"budget_bytes": self.budget.memory, "fixed_bytes": self.budget.minimum(),
                                           "in_memory_bytes": mem, "on_disk_bytes": disk,
                                           "outer_dir": self.outer_dir if disk else None},
                "checkpoint": {"round": L.ckpt["round"], "every": cfg.checkpoint_rounds,
                               "logged_rounds": [s.round for s in L.log], "last": self.last_checkpoint},
                "parameters": sum(int(np.prod(s)) for s in self.specs.values()), "tensors": len(self.specs),
                "update": L.update and {k: L.update[k] for k in ("round", "format", "update_bytes", "residual_norm")}}
