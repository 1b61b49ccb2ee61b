"""outer_state.py - the aggregator's outer state (theta_global, momentum, residual): one round
applied to it, its checkpoint and replay, the memory budget it lives in, and its keeper.

Used on the central VM inside fedmom_server.py (fedmom_state.FedMomState holds one
OuterKeeper; its `plan`, `export` and `checkpoint` commands use the budget and the checkpoint
of a stopped aggregator), and run as the aggregator's merge workers, started by
fedmom_merge.Pool, one per fedmom_server.py --merge-procs:
    python outer_state.py --merge-worker        # answers the Tasks of a round on stdin
Numpy, never torch; train_config.py and demo.py take the outer step's defaults from here.
Tested in tests/test_replay.py (bit for bit against the file-to-file merge:
fedmom_merge.merge_files + Publisher), tests/test_merge_pool.py and tests/test_outer_budget.py.

Its parts, in reading order:
  - the round: OuterState (per tensor one flat float32 array each of theta_global, the
    Nesterov momentum and, with --down-wire, the residual the updates rounded away) and Step,
    a round's recorded inputs (the deltas' files with their weights, the outer lr and
    momentum, whether the momentum starts afresh, the downstream codec); apply_round() merges
    a Step into the arrays in place, on threads or on the merge workers (Task, WorkerSession),
    and writes the round's update; replay() runs Steps again;
  - the outer step's defaults: OUTER_LR and OUTER_MOMENTUM;
  - the outer state on disk: the checkpoint in segments, the log of Steps since it (in
    state.json), rebuild() and write_checkpoint(); log(), bury() and remove() for the files;
  - the memory budget (--memory-gb): Budget, the machine's checks, Store (which tensors live in
    memory, which in file blocks in --outer-dir), and plan(), a run's needs;
  - OuterKeeper: the outer state in use: the robust merge, the checkpoint, the rebuild after a
    start or a failed round, the copies of theta for downloads.

A round is a pure function of the state and its Step, in the same float32 operations in the
same order in memory, in a file block or on a worker: its bits equal the file-to-file merge's
whatever --memory-gb and --merge-procs (the rule itself is fedmom_merge.py's docstring). Each
Step carries the theta digest (wire.Digest) of its first run; a replay that ends elsewhere
raises ReplayMismatch. A round that raises part way (NonFinite, a full disk,
fedmom_merge.DiskError) leaves state.dirty set, and the caller rebuilds the state.

    state = OuterState.load("theta-8.safetensors", "momentum-8.safetensors", "residual-8.safetensors", 8)
    stats = apply_round(state, Step(9, [("spool/a", 0.25), ("spool/b", 0.75)], 0.7, 0.9, False,
                                    wire.Codec("int4")), out_update="update-9.safetensors")

The state dir: fedmom_state.py's docstring. Sizing: FEDERATION_GUIDE.md, "Sizing the central VM".
"""
import dataclasses
import hashlib
import json
import math
import os
import secrets
import sys
import threading
import time
import traceback

import numpy as np

import durable
import fedmom_merge
import tensorio
import testhooks
import wire
from fedmom_round import Refused


class ReplayMismatch(RuntimeError):
    """A replayed round gave another theta than the one recorded when it first ran."""


@dataclasses.dataclass
class Step:
    """The inputs of one round, as recorded in state.json: enough to run it again."""
    round: int                 # the round this step makes (theta of round-1 -> round)
    deltas: list               # [(path, weight)]: weight = token share x clip scale, as merged
    lr: float
    mu: float
    fresh: bool                # the momentum buffer starts as g (the first merge, or a reset)
    codec: wire.Codec | None   # --down-wire's codec; None: theta published whole (f32)
    digest: str | None = None  # theta's wire.Digest after this step, from its first run

    def to_json(self):
        return {"round": self.round, "deltas": [[p, w] for p, w in self.deltas], "lr": self.lr, "mu": self.mu,
                "fresh": self.fresh, "codec": self.codec and dataclasses.asdict(self.codec), "digest": self.digest}

    @classmethod
    def from_json(cls, d):
        codec = wire.Codec(**d["codec"]).validate() if d.get("codec") else None
        return cls(int(d["round"]), [(p, float(w)) for p, w in d["deltas"]], float(d["lr"]), float(d["mu"]),
                   bool(d["fresh"]), codec, d.get("digest"))


class OuterState:
    """theta, momentum (None: none kept yet, or --outer-momentum 0) and residual (None:
    nothing owed) as {name: flat float32 array}, in the order of `shapes`; `digest` is
    theta's wire.Digest. A round changes them in place (apply_round).

    store: where the arrays live (Store: in memory, shared with the merge
    workers, or in file blocks on disk, as --memory-gb places each tensor): the arrays are
    its fedmom_merge.BlockArrays, made once and reused by every load, round and rebuild, and a
    tensor on disk is a fedmom_merge.FileTensor, read and written a piece at a time. None:
    private arrays, made as needed (tests, the offline commands)."""

    def __init__(self, shapes, theta, momentum=None, residual=None, round=0, digest=None, store=None):
        self.shapes = dict(shapes)
        self.theta, self.momentum, self.residual = theta, momentum, residual
        self.round, self.dirty, self.store = round, False, store
        self.digest = digest if digest is not None else self.theta_digest()

    @classmethod
    def load(cls, theta_path, momentum_path=None, residual_path=None, round=0, store=None):
        """The arrays from a checkpoint's files (momentum/residual None: not kept), read
        straight into their place (the store's blocks: no second copy)."""
        with tensorio.TensorReader(theta_path) as r:
            shapes = {n: tuple(r.specs[n][1]) for n in r.names}
        arrays = [_read_all(p, shapes, alloc(shapes, store, k, False)) if p else None
                  for k, p in zip(ARRAYS, (theta_path, momentum_path, residual_path))]
        return cls(shapes, *arrays, round=round, store=store)

    @property
    def names(self):
        return list(self.shapes)

    def nbytes(self):
        return sum(a.nbytes for d in (self.theta, self.momentum, self.residual) if d for a in d.values())

    def theta_digest(self):
        d = wire.Digest()
        for n, sh in self.shapes.items():
            d.add_chunks(n, sh, fedmom_merge.chunks(self.theta[n]))
        return d.hexdigest()

    def write(self, which, path, metadata=None, fsync=True):
        """One of "theta", "momentum", "residual" as an F32 tensor file (atomic; durable with
        fsync); a tensor on disk is copied a bounded piece at a time."""
        arrays = getattr(self, which)
        specs = [(n, "F32", sh) for n, sh in self.shapes.items()]
        meta = {"round": str(self.round), **{k: str(v) for k, v in (metadata or {}).items()}}
        with tensorio.TensorWriter(path, specs, meta, fsync=fsync) as w:
            for n in self.shapes:
                w.write_chunks(n, fedmom_merge.chunks(arrays[n]))
        return path

    def share(self):
        """theta, momentum and residual into shared memory (fedmom_merge.BlockArrays), for a
        round on worker processes; arrays already in blocks (a store's) stay as they are."""
        self.theta = fedmom_merge.share(self.theta, self.shapes)
        self.momentum = fedmom_merge.share(self.momentum, self.shapes)
        self.residual = fedmom_merge.share(self.residual, self.shapes)
        return self

    def sync(self):
        """The file blocks' writes on disk (fdatasync): a write-back error raises here (DiskError)."""
        if self.store is not None:
            self.store.sync()

    def drop(self):
        """Let go of the arrays (a failed round's, before a rebuild: private or shared memory
        holds the outer state once, not twice; a store keeps its blocks, which the rebuild
        loads into); the state stays dirty, never served."""
        self.theta = self.momentum = self.residual = None
        self.dirty = True

    def copy(self):
        """A deep copy in private memory (tests)."""
        dup = lambda d: d and {n: fedmom_merge.whole(a).copy() for n, a in d.items()}
        return OuterState(self.shapes, dup(self.theta), dup(self.momentum), dup(self.residual), self.round,
                          self.digest)


ARRAYS = ("theta", "momentum", "residual")


def alloc(shapes, store, kind, zero, shared=False):
    """The arrays of one of ARRAYS: the store's blocks (made once, reused), else new ones,
    in shared memory for a round on workers, or private."""
    if store is not None:
        arrays = store.arrays(kind)
        if zero:
            arrays.zero()
        return arrays
    if shared:
        return fedmom_merge.BlockArrays(shapes, zero)
    return {n: (np.zeros if zero else np.empty)(math.prod(sh), np.float32) for n, sh in shapes.items()}


def _read_all(path, shapes, into):
    with tensorio.TensorReader(path) as r:
        if sorted(r.names) != sorted(shapes):
            raise ValueError(f"{path}: its tensors are not theta's")
        for n in shapes:
            fill(into[n], r, n)
    return into


def fill(dest, reader, name, lo=0):
    """Tensor `name` of a tensorio.TensorReader (any float dtype, as float32) into elements
    [lo, lo + its size) of dest, a flat float32 array or fedmom_merge.FileTensor: an F32
    tensor straight into an array, or a bounded piece at a time into a file block."""
    dtype, shape = reader.specs[name]
    n = math.prod(shape)
    if isinstance(dest, np.ndarray) and dtype == "F32":
        reader.read(name, out=dest[lo:lo + n])
    elif dtype != "F32":                                # an --init in BF16/F16: one tensor converted
        a = np.ascontiguousarray(reader.read(name, as_float32=True), np.float32).reshape(-1)
        if isinstance(dest, np.ndarray):
            np.copyto(dest[lo:lo + n], a)
        else:
            dest.write(lo, lo + n, a)
    else:
        step = fedmom_merge.CHUNK_BYTES // 4
        buf = np.empty(min(step, max(n, 1)), np.float32)
        for s in range(0, n, step):
            e = min(s + step, n)
            dest.write(lo + s, lo + e, reader.read_range(name, s, e, buf))


class _Tensor:
    """What every piece of one tensor's round shares: the arrays, the deltas, the outputs.
    A piece is (lo, hi, first, owed): first, the momentum starts afresh there (buf = g); owed,
    a residual is owed there (added to the update's x)."""

    def __init__(self, name, shape, T, M, owed, residual, deltas, weights, lr, mu, codec, codes=None, sbits=None):
        """T, M (None: no momentum this round), owed (the residual owed, or None), residual
        (where the new one goes; None: a new array): flat float32 arrays, or
        fedmom_merge.FileTensors (a tensor on disk: each piece read, merged, written back);
        codes/sbits: where the update's parts go, flat uint8/uint16 (None: new arrays)."""
        self.name, self.shape, self.n = name, shape, math.prod(shape)
        self.T, self.M, self.owed = T, M, owed
        self.deltas, self.weights = deltas, weights
        self.lr, self.mu, self.codec = lr, mu, codec
        self.blocks = self.codec is not None and self.codec.fmt in wire.LEVELS
        self.codes = self.sbits = self.x = None
        if self.blocks:                                    # the update's parts, filled piece by piece
            R, C, nb = wire.as_blocks(shape, self.codec.block)
            codes = codes if codes is not None else np.empty(update_codes_size(self.codec, self.n), np.uint8)
            codes = codes[:update_codes_size(self.codec, self.n)]
            self.codes = codes if self.codec.fmt != "int8" else codes.view(np.int8).reshape(R, C)
            self.sbits = (sbits if sbits is not None else np.empty(R * nb, np.uint16))[:R * nb].reshape(R, nb)
            self.C = C
        elif self.codec is not None:                       # another format: encoded whole, after the merge
            self.x = np.empty(self.n, np.float32)
        self.residual = None
        if self.codec is not None:
            self.residual = residual if residual is not None else owed if owed is not None else \
                np.empty(self.n, np.float32)
        self.on_disk = any(isinstance(a, fedmom_merge.FileTensor) for a in (T, M, owed, self.residual))

    @classmethod
    def of_state(cls, name, shape, state, step, deltas, mu, residual):
        pick = lambda d: d[name] if d is not None else None
        return cls(name, shape, state.theta[name], pick(state.momentum) if mu > 0 else None, pick(state.residual),
                   pick(residual), deltas, [w for _, w in step.deltas], step.lr, mu, step.codec)

    def run(self, pieces):
        """Merge (and publish) pieces [(lo, hi, first, owed)] in order, with this thread's own
        buffers. -> [(||old theta||^2, [||delta_i||^2], ||residual||^2, None or "theta"/"momentum")]."""
        k = len(self.deltas)
        size = max(p[1] - p[0] for p in pieces)
        bufs = [np.empty(size, np.float32) for _ in range(8 if self.on_disk else 4)]
        dbuf = [np.empty(size, np.float32) for _ in range(k)]
        out = []
        for lo, hi, first, owed in pieces:
            n = hi - lo
            out.append(self._piece(lo, hi, first, owed, [b[:n] for b in bufs], dbuf))
            if out[-1][3]:
                break
        return out

    def _piece(self, lo, hi, first, owed, bufs, dbuf):
        s, tmp, mg, sent = bufs[:4]
        tb, mb, ob, rb = bufs[4:] if self.on_disk else (None,) * 4
        T = fedmom_merge.piece(self.T, lo, hi, tb)
        M = fedmom_merge.piece(self.M, lo, hi, mb) if self.M is not None else None
        tsq, dsq, rsq = fedmom_merge.sq_norm(T), [0.0] * len(self.deltas), 0.0
        ds = [d.read(lo, hi, b) for d, b in zip(self.deltas, dbuf)]
        with np.errstate(over="ignore", invalid="ignore"):          # overflow is checked just below
            fedmom_merge.scaled_sum(ds, self.weights, s, tmp, dsq)
            merged = T if self.codec is None else mg
            fedmom_merge.nesterov_chunk(T, M, s, tmp, self.lr, self.mu, first, out=merged)
            if self.codec is None and not np.isfinite(T).all():
                return tsq, dsq, rsq, "theta"
            if M is not None and not np.isfinite(M).all():
                return tsq, dsq, rsq, "momentum"
            if M is not None:
                fedmom_merge.put(self.M, lo, hi, M)
            if self.codec is None:
                fedmom_merge.put(self.T, lo, hi, T)
                return tsq, dsq, rsq, None
            # Publisher.write, piece by piece. A non-finite merged value needs no check of its
            # own here: x is then Inf or NaN, so is its block's scale, and theta's check below fails
            x = mg
            np.subtract(x, T, out=x)                                 # x = (merged - prev) + residual
            if owed:
                x += fedmom_merge.piece(self.owed, lo, hi, ob)
            if not self.blocks:                                      # encoded whole after the merge
                if not np.isfinite(x).all():
                    return tsq, dsq, rsq, "theta"
                np.copyto(self.x[lo:hi], x)
                return tsq, dsq, rsq, None
            a, b = lo // self.C, hi // self.C
            fmt = self.codec.fmt
            codes = self.codes[wire.code_start(fmt, lo):] if fmt != "int8" else self.codes[a:b]
            wire.encode_span(x.reshape(b - a, self.C), 0, b - a, self.codec, codes, self.sbits[a:b],
                                     sent.reshape(b - a, self.C))
            np.add(T, sent, out=T)                                   # theta = prev + sent (wire.add_update)
            if not np.isfinite(T).all():
                return tsq, dsq, rsq, "theta"
            res = fedmom_merge.piece(self.residual, lo, hi, rb)        # (its old values are not read)
            np.subtract(x, sent, out=res)                            # residual = x - sent
            rsq = fedmom_merge.sq_norm(res)
            fedmom_merge.put(self.T, lo, hi, T)
            fedmom_merge.put(self.residual, lo, hi, res)
        return tsq, dsq, rsq, None

    def publish_whole(self, lo, hi, threads):
        """A format encoded whole (bf16, topk), elements [lo, hi) (the whole tensor, or a run of
        its topk chunks): the rest of Publisher.write on self.x -> (parts, ||residual||^2)."""
        x = self.x[lo:hi]
        parts, sent = self.codec.encode(x.reshape(self.shape) if hi - lo == self.n else x, threads)
        sent = np.asarray(sent, np.float32).reshape(-1)
        if np.shares_memory(sent, x):                  # f32 "encodes" x as itself: keep the step as sent
            sent = sent.copy()
        parts = {k: p.copy() if np.shares_memory(p, x) else p for k, p in parts.items()}   # x is reused below
        T = fedmom_merge.piece(self.T, lo, hi, None)
        wire.add_into(T, sent, threads)
        if not np.isfinite(T).all():
            raise fedmom_merge.NonFinite("theta", self.name, "deltas")
        fedmom_merge.put(self.T, lo, hi, T)
        x -= sent
        if isinstance(self.residual, np.ndarray):
            np.copyto(self.residual[lo:hi], x)
        else:
            self.residual.write(lo, hi, x)
        return parts, fedmom_merge.sq_norm(x)

    def update_parts(self):
        """The int8/int4 update of this tensor, as Codec.encode returns its parts."""
        return update_parts(self.codec, self.shape, self.codes, self.sbits)


def update_codes_size(codec, n):
    """Bytes of an int8/int4/int2 update's codes for n values."""
    return wire.packed_bytes(n, wire.CODE_BITS[codec.fmt])


def update_parts(codec, shape, codes, sbits):
    """{part suffix: array} of one tensor's int8/int4 update, as Codec.encode returns them."""
    rows, cols = wire.rows_cols(shape)
    codes = codes.reshape(-1)[:update_codes_size(codec, math.prod(shape))]
    codes = codes if codec.fmt != "int8" else codes.view(np.int8).reshape(shape)
    nb = -(-cols // codec.block)
    return {"": codes, wire.SCALE: sbits.reshape(-1)[:rows * nb].reshape(rows, nb)}


# ---------------------------------------------------------------- the round on worker processes

@dataclasses.dataclass
class Task:
    """One worker's share of one tensor of a round (fedmom_merge.py): the step, where the arrays
    are ((block key, byte offset, count); None: none; the key of a file block is its path),
    where the update's parts go, and the pieces [(lo, hi, first, owed)], one contiguous run."""
    deltas: list
    weights: list
    lr: float
    mu: float
    codec: dict | None
    name: str
    shape: tuple
    T: tuple
    M: tuple | None
    owed: tuple | None
    residual: tuple | None
    codes: tuple | None
    sbits: tuple | None
    pieces: list

    def blocks(self):
        return {w[0] for w in (self.T, self.M, self.owed, self.residual, self.codes, self.sbits) if w is not None}


class WorkerSession:
    """A worker's side of a round: the delta files kept open while a round's tasks come, the
    parts of its own run of each tensor read (fedmom_merge.DeltaReader.load: the codes of
    that span, not of the whole tensor), the pieces run by _Tensor."""

    def __init__(self):
        self.paths, self.readers = None, []

    def run(self, task, blocks):
        testhooks.fault_point("merge.worker")           # test hook: a worker held (then killed) mid-round
        if task.deltas != self.paths:
            for d in self.readers:
                d.close()
            self.readers, self.paths = [], None
            self.readers = [fedmom_merge.DeltaReader(p) for p in task.deltas]
            self.paths = list(task.deltas)
        for d in self.readers:
            d.load(task.name, task.shape, task.pieces[0][0], task.pieces[-1][1])
        view = lambda w, dtype=np.float32: blocks[w[0]].view(w[1], w[2], dtype) if w is not None else None
        codec = wire.Codec(**task.codec) if task.codec else None
        t = _Tensor(task.name, task.shape, view(task.T), view(task.M), view(task.owed), view(task.residual),
                    self.readers, task.weights, task.lr, task.mu, codec, view(task.codes, np.uint8),
                    view(task.sbits, np.uint16))
        return t.run(task.pieces)


def apply_round(state, step, out_update=None, metadata=None, fsync=True, threads=None, after_tensor=None,
                only=None, pool=None, delta_bytes=None, on_update=None):
    """Merge step's deltas into `state` in place (module docstring). out_update: where the
    round's update goes (step.codec given); None writes nothing (a replay). after_tensor(name):
    called after each tensor (the aggregator's fault point). Raises fedmom_merge.NonFinite
    (its cause is only a guess here: the old values are gone; see momentum_alone_overflows),
    ReplayMismatch when step.digest is set and the result differs, or fedmom_merge.DiskError (a
    file block's disk failed; the file blocks are fdatasync'd before it returns, so a write-back
    error is one too); either way state.dirty.
    -> {"theta_norm" (of the old theta), "delta_norms", "bytes_read", "bytes_written",
        "published": {"base_digest", "digest", "update_bytes", "residual_norm"} or None}.

    Each tensor is cut into pieces on the block boundaries of every codec involved
    (fedmom_merge.piece_unit), and each piece goes through the whole round while it is in
    cache: the deltas' blocks decoded, the weighted sum, the Nesterov step, and with a block
    --down-wire the update's blocks encoded, theta advanced by what they decode to and the
    residual kept; the pieces run on wire.py's thread pool, their norms added in piece order.
    A tensor on disk (a store's file block) is read a piece at a time and written back.
    Every value is computed by the same float32 operations as fedmom_merge.merge_files +
    Publisher, so the bits are theirs whatever the pieces, threads or placement
    (tests/test_replay.py, tests/test_outer_budget.py); the norms (float64 sums of float32
    dots, reported only) may differ from theirs in the last digits. The theta digest (one
    sha256, serial) and the update file's writes run behind, on a thread of their own, while
    the next tensor merges.

    delta_bytes: the most the deltas' parts may hold in memory at once (Budget:
    the merge's share of --memory-gb); a tensor whose parts of every delta would hold more
    runs in waves of pieces that fit, each wave's parts read then dropped. None: one wave.

    only: {name: [(lo, hi, has_momentum, owed)]}: the round applied to those runs of elements
    alone (a checkpoint's segments still behind this round: rebuild), each
    with what it holds at the round before (a momentum buffer, a residual owed); the rest is
    left as it is, nothing is written and no digest is made or checked (the state's round and
    digest are the caller's to set). Each run must start and end on a whole row (a pair of
    rows when a row is odd) and, with a topk --down-wire, on a chunk of it.

    pool: a fedmom_merge.Pool of 2 or more workers: the pieces of each wave run in those
    processes, one contiguous run each, on the state's arrays in blocks they share (a
    store's, or private arrays moved into shared memory: state.share()); the same bits. A
    topk or bf16 --down-wire is encoded whole, here.

    on_update(writer): called once the update file's header is written, with its
    tensorio.TensorWriter -> a tensorio.Growing (or None) that is advanced after each tensor
    of the update is written and failed if the round raises: the sites read the update
    while later tensors merge (fedmom_state.FedMomState.follow_update)."""
    threads = wire.resolve_threads(threads)
    codec, mu, shapes = step.codec, step.mu, state.shapes
    fresh = step.fresh or state.momentum is None or mu == 0
    if only is not None and out_update is not None:
        raise ValueError("apply_round: a round applied to part of the state (only=) writes no update")
    use_pool = pool is not None and pool.procs > 1 and (codec is None or codec.fmt in wire.LEVELS)
    state.dirty = True
    deltas, uw, behind, scratch, growing = [], None, None, None, None
    try:
        for p, _ in step.deltas:
            deltas.append(fedmom_merge.DeltaReader(p))
        _check_deltas(deltas, shapes)
        if use_pool:
            state.share()
        new = lambda kind, zero: alloc(shapes, state.store, kind, zero, shared=use_pool)
        residual = None                                    # where the new residual goes
        if only is None:
            if mu > 0 and state.momentum is None:
                state.momentum = new("momentum", False)
            if mu == 0:
                state.momentum = None
            if codec is not None:
                residual = state.residual if state.residual is not None else \
                    new("residual", False) if use_pool or state.store is not None else None
            runs = {n: [(0, math.prod(sh), fresh, state.residual is not None)] for n, sh in shapes.items()}
        else:
            if mu > 0 and state.momentum is None:
                state.momentum = new("momentum", True)
            if codec is not None and state.residual is None:
                state.residual = new("residual", True)
            residual = state.residual
            runs = {n: [(lo, hi, step.fresh or not has_m or mu == 0, owed) for lo, hi, has_m, owed in only[n]]
                    for n in shapes if n in only}
        if codec is not None and out_update is not None:
            meta = {k: str(v) for k, v in (metadata or {}).items()}
            uw = wire.WireWriter(out_update, list(shapes.items()), codec, meta, fsync=fsync, threads=threads)
            growing = on_update(uw.w) if on_update is not None else None
        if use_pool and codec is not None:
            scratch = _Scratch(codec, shapes)
        new_residual = {} if codec is not None else None
        sums = {"theta": 0.0, "delta": [0.0] * len(deltas)}
        base_digest, digest, rsq = state.digest, wire.Digest(), 0.0
        behind, pending = wire.Behind(), []
        for n, sh in shapes.items():
            if n not in runs:
                continue
            blocks = codec is not None and codec.fmt in wire.LEVELS
            unit = fedmom_merge.piece_unit(sh, [d.codec for d in deltas if d.blocks] + [codec if blocks else None])
            step_n = max(unit, fedmom_merge.STEP // unit * unit)
            pieces = [(lo, min(lo + step_n, hi), first, owed)
                      for a, hi, first, owed in runs[n] for lo in range(a, hi, step_n)]
            waves = _waves(pieces, sum(d.part_bytes(sh) for d in deltas), delta_bytes)
            whole = sum(d.whole_bytes(sh) for d in deltas)         # topk deltas: decoded whole by each worker
            procs = max(1, delta_bytes // whole) if delta_bytes and whole else None
            slot = scratch.take() if scratch is not None else None
            if use_pool:
                results = [r for w in waves for r in _pool_tensor(pool, state, step, n, sh, mu, w, residual, slot,
                                                                   procs)]
                t = None
            else:
                t = _Tensor.of_state(n, sh, state, step, deltas, mu, residual)
                results = [r for w in waves for r in _run_wave(t, deltas, n, sh, w, step_n, threads)]
            for r in results:
                if r is None:                              # after a bad piece of its span: never reached
                    continue
                tsq, dsq, r_sq, bad = r
                sums["theta"] += tsq
                for i, v in enumerate(dsq):
                    sums["delta"][i] += v
                rsq += r_sq
                if bad:
                    raise fedmom_merge.NonFinite(bad, n, "deltas")
            parts = None
            if t is not None and t.x is not None:
                for lo, hi, _, _ in runs[n]:
                    parts, r_sq = t.publish_whole(lo, hi, threads)
                    rsq += r_sq
            elif t is not None and t.blocks:
                parts = t.update_parts()
            elif use_pool and blocks:
                parts = update_parts(codec, sh, *slot.views)
            if codec is not None:
                new_residual[n] = t.residual if t is not None else residual[n]
            if only is None:
                pending.append(behind.submit(lambda n=n, sh=sh: digest.add_chunks(n, sh, fedmom_merge.chunks(
                    state.theta[n]))))
            if uw is not None:
                pending.append(behind.submit(_write_update, uw, n, parts, growing))
                if use_pool:
                    slot.busy = pending[-1]                # reused once this write is done
            pending = [f for f in pending if not f.done() or f.result()]   # re-raise a failure behind
            if after_tensor is not None:
                after_tensor(n)
        for f in pending:
            f.result()
        state.sync()                                       # a file block's write-back error: the round fails
        if only is not None:
            state.dirty = False
            return {"theta_norm": math.sqrt(sums["theta"]), "delta_norms": [math.sqrt(s) for s in sums["delta"]],
                    "bytes_read": sum(d.nread for d in deltas), "bytes_written": 0, "published": None}
        if uw is not None:
            uw.close()
            uw = None
        if residual is not None:
            new_residual = residual                        # the same arrays, in place
        state.residual, state.round, state.digest = new_residual, step.round, digest.hexdigest()
        if step.digest is not None and step.digest != state.digest:
            raise ReplayMismatch(f"round {step.round} replayed to theta digest {state.digest[:16]}..., but it "
                                 f"published {step.digest[:16]}... when it ran")
        state.dirty = False
        published = None
        if codec is not None:
            published = {"base_digest": base_digest, "digest": state.digest, "residual_norm": math.sqrt(rsq),
                         "update_bytes": os.path.getsize(out_update) if out_update else None}
        return {"theta_norm": math.sqrt(sums["theta"]), "delta_norms": [math.sqrt(s) for s in sums["delta"]],
                "bytes_read": sum(d.nread for d in deltas),
                "bytes_written": published and published["update_bytes"] or 0, "published": published}
    finally:
        if behind is not None:
            behind.close()                                 # nothing writes after we return or raise
        if growing is not None and state.dirty:
            growing.fail(f"the merge of round {step.round} stopped")
        if uw is not None:
            uw.abort()
        for d in deltas:
            d.close()


def _write_update(uw, name, parts, growing):
    """One tensor of the round's update written (behind the merge), and offered to its readers."""
    uw.write_parts(name, parts)
    if growing is not None:
        growing.advance(uw.w.flushed())


def _waves(pieces, per_elem, delta_bytes):
    """pieces cut into runs of consecutive pieces whose deltas' parts (per_elem bytes per
    element, all deltas) fit delta_bytes; one wave when there is no bound or nothing to hold."""
    if not delta_bytes or not per_elem:
        return [pieces]
    cap, out, size = max(1, int(delta_bytes // per_elem)), [[]], 0
    for p in pieces:
        if out[-1] and size + (p[1] - p[0]) > cap:
            out.append([])
            size = 0
        out[-1].append(p)
        size += p[1] - p[0]
    return out


def _run_wave(t, deltas, n, sh, pieces, step_n, threads):
    """One wave of a tensor in this process: each delta's parts of its span read, its pieces
    run on wire.py's threads -> their results in order (None after a bad piece of a span)."""
    for d in deltas:
        d.load(n, sh, pieces[0][0], pieces[-1][1])
    results = [None] * len(pieces)

    def run(a, b):
        done = t.run(pieces[a:b])                          # shorter after a bad piece: the rest stay None
        results[a:a + len(done)] = done
    wire.run_spans(run, len(pieces), 1, step_n, threads)
    return results


class _Scratch:
    """Two slots of shared memory for one tensor's update parts (codes, scale bits), the
    largest tensor's size: the workers fill one while the other is still being written out."""

    class Slot:
        def __init__(self, codes_bytes, sbits_count):
            self.block = fedmom_merge.Block(codes_bytes + 2 * sbits_count)
            self.codes_bytes, self.sbits_count = codes_bytes, sbits_count
            self.views = (self.block.view(0, codes_bytes, np.uint8),
                          self.block.view(codes_bytes, sbits_count, np.uint16))
            self.busy = None

        def where(self):
            return (self.block.name, 0, self.codes_bytes), (self.block.name, self.codes_bytes, self.sbits_count)

    def __init__(self, codec, shapes):
        codes, sbits = self.sizes(codec, shapes)
        self.slots, self.i = [self.Slot(codes, sbits), self.Slot(codes, sbits)], 0

    @staticmethod
    def sizes(codec, shapes):
        """(code bytes, scale bits count) of one slot: the largest tensor's."""
        nb = lambda sh: wire.as_blocks(sh, codec.block)
        codes = max((update_codes_size(codec, math.prod(sh)) for sh in shapes.values()), default=1)
        sbits = max((nb(sh)[0] * nb(sh)[2] for sh in shapes.values()), default=1)
        return -(-codes // 2) * 2, sbits                   # the scale bits start on an even byte

    def take(self):
        slot = self.slots[self.i]
        self.i ^= 1
        if slot.busy is not None:
            slot.busy.result()                             # its last tensor's write is done
            slot.busy = None
        return slot

    def __del__(self):
        for s in getattr(self, "slots", ()):
            s.block.release()


def scratch_bytes(shapes, codec):
    """The shared memory a round on the workers takes besides the outer state: the update's
    two scratch slots (_Scratch) with an int8/int4/int2 --down-wire codec, else nothing."""
    if codec is None or codec.fmt not in wire.LEVELS:
        return 0
    codes, sbits = _Scratch.sizes(codec, shapes)
    return 2 * (codes + 2 * sbits)


def _pool_tensor(pool, state, step, n, sh, mu, pieces, residual, slot, procs=None):
    """One wave of a tensor's pieces on the pool's workers (`procs` of them at most), one
    contiguous run each -> the pieces' results in order (None after a bad piece of a run).
    residual: the arrays the new residual goes to (the owed ones, in place, or new ones)."""
    k = min(pool.procs, len(pieces), procs or pool.procs)
    cuts = [len(pieces) * i // k for i in range(k + 1)]
    where = lambda d: d.where(n) if d is not None else None
    codec = step.codec
    owed = where(state.residual)
    residual = where(residual)
    codes, sbits = slot.where() if slot is not None and codec is not None and codec.fmt in wire.LEVELS \
        else (None, None)
    tasks = [Task([p for p, _ in step.deltas], [w for _, w in step.deltas], step.lr, mu,
                  codec and dataclasses.asdict(codec), n, tuple(sh), where(state.theta),
                  where(state.momentum) if mu > 0 else None, owed, residual if codec is not None else None,
                  codes, sbits, pieces[cuts[i]:cuts[i + 1]]) for i in range(k)]
    out = []
    for i, done in enumerate(pool.run(tasks)):
        out += done + [None] * (cuts[i + 1] - cuts[i] - len(done))
    return out


def _check_deltas(deltas, shapes):
    """Each delta holds every tensor of theta with its element count (fedmom_merge's check;
    the aggregator checked more at acceptance)."""
    for d in deltas:
        for n, sh in shapes.items():
            dtype, shape = d.specs.get(n, (None, None))
            if dtype not in fedmom_merge.DELTA_DTYPES or math.prod(shape) != math.prod(sh):
                raise ValueError(f"{d.path}: tensor {n!r} is {dtype} {shape}; the merge needs "
                                 f"{' or '.join(fedmom_merge.DELTA_DTYPES)} with shape {sh}")


def momentum_alone_overflows(state, name, lr, mu):
    """After a NonFinite merge and the state rebuilt: would tensor `name` overflow with every
    delta zero (the old momentum alone)? Then the round resets the momentum (fedmom_merge)."""
    if state.momentum is None:
        return False
    T, M = state.theta[name], state.momentum[name]
    step = fedmom_merge.CHUNK_BYTES // 4                     # elementwise: a piece at a time, never a whole copy
    tb, mb = np.empty(min(step, max(T.size, 1)), np.float32), np.empty(min(step, max(T.size, 1)), np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        for lo in range(0, T.size, step):
            hi = min(lo + step, T.size)
            t, m = tb[:hi - lo], mb[:hi - lo]
            np.copyto(t, fedmom_merge.piece(T, lo, hi, t))
            np.copyto(m, fedmom_merge.piece(M, lo, hi, m))
            if fedmom_merge._momentum_alone_overflows(t, m, lr, mu):
                return True
    return False


def replay(state, steps, threads=None, progress=None, pool=None, delta_bytes=None):
    """Apply recorded Steps to a checkpoint's state, each checked against its digest."""
    for s in steps:
        if s.round != state.round + 1:
            raise ReplayMismatch(f"the log's round {s.round} does not follow the state's round {state.round}")
        apply_round(state, s, threads=threads, pool=pool, delta_bytes=delta_bytes)
        if progress is not None:
            progress(s)
    return state


def worker_argv():
    """The command of a merge worker (fedmom_merge.Pool): this file, serving Tasks."""
    return [sys.executable, os.path.abspath(__file__), "--merge-worker"]




# ==== the outer step's defaults ===================================================================
# Nesterov, lr 0.7, momentum 0.9: DiLoCo's (Douillard et al. 2023), which beat plain averaging
# and outer Adam at H = 500 inner steps. The aggregator's --outer-lr / --outer-momentum
# (fedmom_state.ServerConfig), DiLoCo's --diloco-outer-lr / --diloco-outer-momentum inside one
# allocation (train_config.py), demo.py and bench/convergence.py's Nesterov arms default to
# these. lr 1.0 with momentum 0 makes theta the weighted mean of the replicas: exact FedAvg.

OUTER_LR = 0.7
OUTER_MOMENTUM = 0.9


# ==== the outer state on disk: the checkpoint, the log of Steps, the rebuild ======================
# state.json names a checkpoint {"round", "dir", "digest"} and a "log": the Step of every round
# since, its delta paths relative to the state dir. The current round's state is the checkpoint
# with the logged Steps replayed on top (rebuild), checked against the theta digest the last one
# published; the segments are read straight into the store's blocks, a bounded piece at a time.
# The checkpoint is ckpt-<r>/<tensor>-<part>.safetensors: theta, momentum and residual (those
# kept) of one tensor or a run of its whole rows (SEGMENT_BYTES of fp32 each at most), with its
# round in the metadata. A new checkpoint replaces the segments one at a time (written aside,
# fsync'd, renamed over), so the disk holds one checkpoint and one segment more. One cut short
# leaves segments of two rounds: a round is elementwise, so rebuild replays each segment from its
# own round; the record names the round every segment has reached, and the log keeps every Step
# since it. The older layout {"round", "theta", "momentum", "residual"} is read, then replaced.

STATE_FORMAT = "pww-fedmom-state/3"   # 2: identity, epoch, custody owed, violations; 3: checkpoint + log
READS_FORMATS = ("pww-fedmom-state/2", STATE_FORMAT)   # a /2 state is a checkpoint of its round, no log
CKPT_DIR = "ckpt"             # a checkpoint of segments: ckpt-<the round it was first written at>/
SEGMENT_FORMAT = "pww-fedmom-segment/1"
SEGMENT_BYTES = 64 << 20      # fp32 bytes of one array of a segment (segments() says when one is larger): 3 x this extra disk
SEGMENT_ENV = "PWW_TEST_SEGMENT_BYTES"   # tests: smaller segments, so that a small model has several
TOPK_ALIGN = 4096             # segments also start on a multiple of this: whole chunks of a topk --down-wire
                              # (its chunk is wire.Codec's default: fedmom_server.py has no flag for it)


def write_json(path, obj, fsync=True):
    """state.json and the spool's records: durable.write_json, indented, keys sorted."""
    durable.write_json(path, obj, fsync, indent=1, sort_keys=True)


def read_record(st, where):
    """(checkpoint, [Step]) of a state.json dict. A /2 state kept every round's files: its
    current ones are a checkpoint of its round, with nothing logged. ValueError otherwise."""
    if st.get("format") == STATE_FORMAT:
        return st["checkpoint"], [Step.from_json(x) for x in st["log"]]
    if st.get("format") in READS_FORMATS:
        u = st.get("update")
        owed = u and u["round"] == st["round"] and u.get("residual") or None
        return {"round": st["round"], "theta": st["theta"], "momentum": st["momentum"], "residual": owed}, []
    raise ValueError(f"{where}: format {st.get('format')!r}, this code reads "
                     f"{' and '.join(map(repr, READS_FORMATS))}; use the fedmom_server.py that wrote it")


def step_files(step):
    """A logged round's spool files (relative): each delta and its acceptance record."""
    return [f for p, _ in step.deltas for f in (p, p[:-len(".safetensors")] + ".json")]


def resolved(step, state_dir):
    """A Step with its delta paths made absolute (the log keeps them relative to the state dir)."""
    return dataclasses.replace(step, deltas=[(os.path.join(state_dir, p), w) for p, w in step.deltas])


def segment_bytes():
    """SEGMENT_BYTES, or $PWW_TEST_SEGMENT_BYTES (tests; a checkpoint records the size it used)."""
    env = os.environ.get(SEGMENT_ENV, "").strip()
    return int(env) if env else SEGMENT_BYTES


def segments(shapes, seg_bytes, d):
    """[(file name, tensor, lo, hi)] of a checkpoint of these {name: shape}: each tensor whole,
    or cut into runs of whole rows (pairs of rows when a row is odd: int4 packs two values a
    byte, int2 four, and TOPK_ALIGN is a multiple of 4) and whole TOPK_ALIGN elements, so that every block or chunk of every wire format
    lies inside one segment and a segment can be replayed alone (apply_round's
    `only`). A segment holds `seg_bytes` of fp32 per array at most, unless that one unit is
    larger: a 1-D tensor is one segment, and so is an odd last dimension's lcm(2 x cols,
    TOPK_ALIGN) when it exceeds the tensor (a (768, 50257) tensor: 147 MiB). Language
    models' large tensors have even last dimensions (Qwen3: 1024 to 25600): 64 MiB there."""
    out = []
    for i, (name, sh) in enumerate(shapes.items()):
        n, cols = math.prod(sh), (sh[-1] if sh else 1)
        unit = math.lcm(max(1, cols if cols % 2 == 0 else 2 * cols), TOPK_ALIGN)
        per = max(unit, seg_bytes // 4 // unit * unit)
        for j, lo in enumerate(range(0, max(n, 1), per)):
            out.append((f"{d}/{i:05d}-{j:04d}.safetensors", name, lo, min(lo + per, n)))
    return out


def _segment_files(state_dir, d):
    full = os.path.join(state_dir, d)
    return sorted(f"{d}/{f}" for f in os.listdir(full) if f.endswith(".safetensors")) if os.path.isdir(full) else []


def read_shapes(state_dir, ckpt):
    """{name: shape} of theta, in order, from the checkpoint's files (headers only)."""
    if "dir" not in ckpt:
        with tensorio.TensorReader(os.path.join(state_dir, ckpt["theta"])) as r:
            return {n: tuple(r.specs[n][1]) for n in r.names}
    shapes = {}
    for fn in _segment_files(state_dir, ckpt["dir"]):
        with tensorio.TensorReader(os.path.join(state_dir, fn)) as r:
            shapes.setdefault(r.metadata["tensor"], tuple(json.loads(r.metadata["shape"])))
    return shapes


def checkpoint_files(state_dir, ckpt):
    """The files the checkpoint is made of (relative to the state dir)."""
    if "dir" in ckpt:
        return _segment_files(state_dir, ckpt["dir"])
    return [ckpt[k] for k in ARRAYS if ckpt.get(k)]


class _Segment:
    def __init__(self, fn, tensor, lo, hi, rnd, arrays):
        self.fn, self.tensor, self.lo, self.hi, self.round, self.arrays = fn, tensor, lo, hi, rnd, arrays


def _load_segments(state_dir, ckpt, store=None):
    """-> (OuterState with every segment's arrays in place, [_Segment]). Each segment is read
    straight into the arrays' place (a store's blocks, in memory or on disk: no private copy
    first); the arrays a segment lacks (no momentum or residual at its round) are zero there
    and marked so in its _Segment."""
    shapes = read_shapes(state_dir, ckpt)
    if not shapes:
        raise ValueError(f"{state_dir}/{ckpt['dir']}: the checkpoint state.json names holds no segment "
                         "(the directory is missing or empty): restore it, or the state dir, from a backup")
    want = segments(shapes, ckpt["segment_bytes"], ckpt["dir"])
    have = _segment_files(state_dir, ckpt["dir"])
    if [w[0] for w in want] != have:
        missing, extra = sorted({w[0] for w in want} - set(have)), sorted(set(have) - {w[0] for w in want})
        raise ValueError(f"{state_dir}/{ckpt['dir']}: the checkpoint's segments are not the model's: missing "
                         f"{missing[:3]}, unexpected {extra[:3]}")
    segs = []
    for fn, name, lo, hi in want:                          # the headers first: which arrays are kept
        with tensorio.TensorReader(os.path.join(state_dir, fn)) as r:
            m = r.metadata
            if (m.get("segment") != SEGMENT_FORMAT or m.get("tensor") != name or int(m["lo"]) != lo
                    or int(m["hi"]) != hi):
                raise ValueError(f"{state_dir}/{fn}: not the segment {name}[{lo}:{hi}] of this checkpoint")
            rnd = int(m["round"])
            if not ckpt["round"] <= rnd:
                raise ValueError(f"{state_dir}/{fn}: round {rnd}, older than the checkpoint's {ckpt['round']}")
            segs.append(_Segment(fn, name, lo, hi, rnd, set(r.names)))
    kept = {k: alloc(shapes, store, k, False) if any(k in g.arrays for g in segs) else None
            for k in ARRAYS}
    for g in segs:
        with tensorio.TensorReader(os.path.join(state_dir, g.fn)) as r:
            for k, arrays in kept.items():
                if arrays is None:
                    continue
                if k in g.arrays:
                    fill(arrays[g.tensor], r, k, g.lo)
                else:
                    fedmom_merge.zero(arrays[g.tensor], g.lo, g.hi)
    outer = OuterState(shapes, kept["theta"], kept["momentum"], kept["residual"], ckpt["round"],
                                   digest="", store=store)
    return outer, segs


def rebuild(state_dir, ckpt, log, threads=None, pool=None, store=None, delta_bytes=None):
    """The outer state the checkpoint and the logged Steps make (replay: each
    Step checked against its digest; a checkpoint of segments of two rounds replays each from
    its own and checks the digest once they have met), in `store`'s blocks when given
    (Store). Raises what went wrong (ReplayMismatch, a missing or damaged file,
    a NonFinite replay, an OSError of a file block)."""
    path = lambda fn: fn and os.path.join(state_dir, fn)
    steps = [resolved(s, state_dir) for s in log]
    if "dir" not in ckpt:
        outer = OuterState.load(path(ckpt["theta"]), path(ckpt["momentum"]), path(ckpt["residual"]),
                                            ckpt["round"], store=store)
        return replay(outer, steps, threads, pool=pool, delta_bytes=delta_bytes)
    outer, segs = _load_segments(state_dir, ckpt, store)
    rounds = {s.round for s in segs}
    behind = min(rounds)
    for s in steps:
        if s.round <= behind:
            continue
        if s.round != behind + 1:
            raise ReplayMismatch(f"the log's round {s.round} does not follow round {behind}")
        todo = [g for g in segs if g.round < s.round]
        if len(todo) == len(segs) and len({frozenset(g.arrays) for g in segs}) == 1:
            outer.round = s.round - 1
            outer.momentum = outer.momentum if "momentum" in segs[0].arrays else None
            outer.residual = outer.residual if "residual" in segs[0].arrays else None
            apply_round(outer, s, threads=threads, pool=pool, delta_bytes=delta_bytes)   # digest checked
        else:
            only = {}
            for g in todo:
                only.setdefault(g.tensor, []).append((g.lo, g.hi, "momentum" in g.arrays, "residual" in g.arrays))
            apply_round(outer, dataclasses.replace(s, digest=None), threads=threads, only=only,
                                    pool=pool, delta_bytes=delta_bytes)
        for g in todo:
            g.round = s.round
            g.arrays = {"theta"} | ({"momentum"} if s.mu > 0 else set()) | ({"residual"} if s.codec else set())
        behind = s.round
    if len({g.round for g in segs}) != 1:
        raise ReplayMismatch(f"the checkpoint's segments reach rounds {sorted({g.round for g in segs})}: "
                                         "the log does not bring them to one round")
    if len({frozenset(g.arrays) for g in segs}) != 1:
        raise ReplayMismatch("the checkpoint's segments keep different arrays at one round")
    outer.round = segs[0].round
    outer.momentum = outer.momentum if "momentum" in segs[0].arrays else None
    outer.residual = outer.residual if "residual" in segs[0].arrays else None
    outer.digest = outer.theta_digest()
    want = log[-1].digest if log else ckpt.get("digest")
    if want is not None and want != outer.digest:
        raise ReplayMismatch(f"the checkpoint and log rebuild round {outer.round} to theta digest "
                                         f"{outer.digest[:16]}..., but it published {want[:16]}...")
    return outer


def write_checkpoint(outer, state_dir, last=None, fsync=True, after_file=None):
    """theta, momentum and residual (those kept) of outer's round, segment by segment, each
    replacing the `last` checkpoint's segment of the same part -> the checkpoint's record
    {"round", "dir", "segment_bytes", "digest"} (for state.json, once every segment is
    written). A `last` of another layout (whole files, other segments) is left as it is and
    the segments go to a new directory: the caller removes the old one once state.json names
    the new. after_file(): called after each segment (the aggregator's fault point)."""
    seg = segment_bytes()
    same = last is not None and "dir" in last and last.get("segment_bytes") == seg
    d = last["dir"] if same else f"{CKPT_DIR}-{outer.round}"
    if not same and last is not None and d == last.get("dir"):    # the live one has this name: never touch it
        d = f"{CKPT_DIR}-{outer.round}-{seg}"
    if not same and os.path.isdir(os.path.join(state_dir, d)):     # left by a layout change cut short
        for fn in _segment_files(state_dir, d):
            durable.unlink(os.path.join(state_dir, fn))
    os.makedirs(os.path.join(state_dir, d), exist_ok=True)
    kept = [k for k in ARRAYS if getattr(outer, k) is not None]
    for fn, name, lo, hi in segments(outer.shapes, seg, d):
        meta = {"segment": SEGMENT_FORMAT, "tensor": name, "lo": str(lo), "hi": str(hi), "round": str(outer.round),
                "shape": json.dumps(list(outer.shapes[name]))}
        with tensorio.TensorWriter(os.path.join(state_dir, fn), [(k, "F32", (hi - lo,)) for k in kept], meta,
                                   fsync=fsync) as w:
            for k in kept:
                w.write_chunks(k, fedmom_merge.chunks(getattr(outer, k)[name], lo, hi))
        if after_file is not None:
            after_file()
    if fsync:
        durable.fsync_dir(os.path.join(state_dir, d))
        durable.fsync_dir(state_dir)
    return {"round": outer.round, "dir": d, "segment_bytes": seg, "digest": outer.digest}


def stale_files(state_dir, old, new):
    """What a checkpoint `new` leaves of the one before, `old`, to remove once state.json names
    `new`: the old layout's files, or a segment directory and its files (files first)."""
    if "dir" in old and old["dir"] == new.get("dir"):
        return []
    files = checkpoint_files(state_dir, old)
    return files + ([old["dir"]] if "dir" in old else [])


def read_state(sd):
    try:
        with open(os.path.join(sd, "state.json")) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{sd}: no readable state.json ({e})") from None


def load_outer(state_dir, threads=None, store=None):
    """The outer state (OuterState) of a stopped aggregator's state dir: rebuild
    from what its state.json names (into `store`'s blocks when given: Store). Reads
    only (a running aggregator removes logged files as it checkpoints: download its theta with
    GET /theta). Raises ValueError naming the problem."""
    sd = os.path.abspath(state_dir)
    st = read_state(sd)
    ckpt, log = read_record(st, f"{sd}/state.json")
    try:
        outer = rebuild(sd, ckpt, log, threads, store=store)
    except Exception as e:
        raise ValueError(f"{sd}: the outer state of round {st['round']} cannot be rebuilt: "
                         f"{type(e).__name__}: {e}") from None
    if outer.round != st["round"]:
        raise ValueError(f"{sd}: state.json is at round {st['round']}, its checkpoint and log reach {outer.round}")
    return outer


def checkpoint_offline(state_dir, threads=None, fsync=True, store=None):
    """Make the current round of a stopped aggregator's state dir its checkpoint (load_outer,
    write_checkpoint, state.json's log emptied, the files it no longer needs removed): a
    restart then replays nothing. -> the round."""
    sd = os.path.abspath(state_dir)
    outer = load_outer(sd, threads, store)
    st = read_state(sd)
    old, logged = read_record(st, f"{sd}/state.json")
    record = write_checkpoint(outer, sd, old, fsync)
    st.update(format=STATE_FORMAT, checkpoint=record, log=[])
    for k in ("theta", "momentum"):
        st.pop(k, None)
    if st.get("update"):
        st["update"].pop("residual", None)
    write_json(os.path.join(sd, "state.json"), st, fsync)
    for fn in stale_files(sd, old, record) + [f for s in logged for f in step_files(s)]:
        path = os.path.join(sd, fn)
        os.rmdir(path) if os.path.isdir(path) else durable.unlink(path)
    return outer.round


# ---------------------------------------------------------------- log lines, and files let go
# A file no round needs is renamed aside under the state lock (bury: a rename frees nothing, so it
# costs nothing there) and unlinked once the lock is released (remove: freeing a multi-GB file
# takes the file system seconds, which heartbeats and GET /status would wait out).

def log(msg):
    print(time.strftime("%Y-%m-%d %H:%M:%S ") + msg, flush=True)


def bury(paths):
    """Under the lock: take `paths` off their names at once -> the new names, for remove() once
    the lock is released. A spool entry must be gone before the state that no longer names
    it is saved."""
    out = []
    for path in paths:
        tomb = os.path.join(os.path.dirname(path), f".gone-{secrets.token_hex(8)}")
        try:
            os.replace(path, tomb)
        except FileNotFoundError:
            continue
        out.append(tomb)
    return out


def remove(paths):
    """Unlink files no round needs any more, OUTSIDE the state lock."""
    for path in paths:
        testhooks.fault_point("fedmom.unlink")
        if os.path.isdir(path):          # an old checkpoint's directory, its files removed before it
            os.rmdir(path)
        else:
            durable.unlink(path)


# ==== the memory budget (--memory-gb): what stays in memory, what goes to disk ====================
# Inside --memory-gb G (Budget.fixed): the aggregator (AGG_BASE) and each merge worker
# (WORKER_BASE); a round's two update scratch slots in shared memory and the deltas' parts read
# at once (at most DELTA_RESERVE x the largest tensor's fp32 bytes; more deltas run in waves);
# one delta checked at a time (CHECK_BYTES; topk and --down-wire a whole tensor: TOPK_TENSORS).
# What is left of G holds theta, then the momentum, then the residual, tensor by tensor in file
# order; the rest live in file blocks in --outer-dir (fedmom_merge.FileBlock), read and written
# a piece at a time by the same code, so the bits do not depend on G. The file blocks are
# scratch, never a checkpoint: a start sweeps what a dead aggregator left and loads the
# checkpoint straight into the blocks. G defaults to 3/4 of the machine's (or cgroup's) memory
# within what is available and what shared memory holds (default_memory); check_machine refuses
# in one line, naming the flag, a G that RAM, shared memory or the disk cannot hold.

GB = 10**9
OUTER_DIR = "outer"           # --outer-dir's default, in the state dir
AGG_BASE = 256 << 20          # the aggregator's own memory at rest: Python, numpy, TLS, HTTP threads, its books
WORKER_BASE = 64 << 20        # one merge worker: measured 19 MiB anonymous at rest, + its pieces' buffers
DELTA_RESERVE = 1.0           # the deltas' parts a round holds at once, in fp32 tensors of the largest
CHECK_BYTES = 32 << 20        # a delta's check: 16M values of a block format's parts + the threads' pieces
TOPK_TENSORS = 4              # a topk delta or --down-wire: a tensor decoded or encoded whole, ~4 fp32 copies
VOCAB = 131328                # the largest tensor when only --params is known: this vocabulary x the width
QWEN3_WIDTH = {0.6e9: 1024, 1.7e9: 2048, 4e9: 2560, 8e9: 4096, 14e9: 5120, 32e9: 5120}   # params -> hidden dim


def largest_of(params):
    """The largest tensor (values) of a Qwen3 model of about `params` parameters: the
    embedding, VOCAB x the width of the flavor nearest in size."""
    near = min(QWEN3_WIDTH, key=lambda p: abs(math.log(p / max(params, 1))))
    return VOCAB * QWEN3_WIDTH[near]


def shapes_of(params):
    """{name: shape} standing for a model known by its size alone: its largest tensor
    (largest_of), the rest in tensors an eighth of that (a Qwen3 feed-forward matrix is a
    tenth to a third of its embedding)."""
    big = min(largest_of(params), params)
    rest, part = params - big, max(1, big // 8)
    out = {"embedding": (big,)}
    out.update({f"part{i}": (min(part, rest - i * part),) for i in range(-(-rest // part))})
    return out


@dataclasses.dataclass
class Budget:
    """G bytes for a model of `shapes`, keeping `kinds` (of ARRAYS), with `procs`
    merge workers (0: the round runs in the aggregator) and the --down-wire codec."""
    memory: int
    shapes: dict
    kinds: tuple
    codec: object = None          # wire.Codec or None
    procs: int = 0
    topk_deltas: bool = False     # the sites send topk deltas (plan: --wire topk)

    @property
    def params(self):
        return sum(math.prod(sh) for sh in self.shapes.values())

    @property
    def largest(self):
        return max((math.prod(sh) for sh in self.shapes.values()), default=0)

    def state_bytes(self):
        return 4 * self.params * len(self.kinds)

    def delta_bytes(self):
        """The deltas' parts a round may hold at once (apply_round's delta_bytes)."""
        return int(DELTA_RESERVE * 4 * self.largest)

    def scratch_bytes(self):
        return scratch_bytes(self.shapes, self.codec) if self.procs else 0

    def fixed(self):
        """{what: bytes} the aggregator holds besides its outer state."""
        whole = self.topk_deltas or (self.codec is not None and self.codec.fmt not in ("int8", "int4", "int2"))
        out = {"aggregator": AGG_BASE, "merge workers": self.procs * WORKER_BASE,
               "update scratch": self.scratch_bytes(), "deltas' parts": self.delta_bytes(),
               "a delta's check": CHECK_BYTES}
        if whole:                    # a topk delta is decoded whole by each worker that merges part of it
            copies = max(self.procs, 1) if self.topk_deltas else 1
            out["whole-tensor codecs"] = TOPK_TENSORS * 4 * self.largest * copies
        return out

    def minimum(self):
        return sum(self.fixed().values())

    def placement(self):
        """{kind: set of tensor names on disk}: theta first, then momentum, then residual, each
        tensor in memory if it fits in what is left of G, else on disk."""
        left, out = self.memory - self.minimum(), {}
        for kind in self.kinds:
            out[kind] = set()
            for n, sh in self.shapes.items():
                b = 4 * math.prod(sh)
                if b <= left:
                    left -= b
                else:
                    out[kind].add(n)
        return out

    def split(self):
        """(bytes of the outer state in memory, bytes on disk)."""
        disk = sum(4 * math.prod(self.shapes[n]) for names in self.placement().values() for n in names)
        return self.state_bytes() - disk, disk


def kinds_of(outer_momentum, codec):
    """The arrays a run keeps: theta, the momentum unless --outer-momentum 0, the residual with --down-wire."""
    return ("theta",) + (("momentum",) if outer_momentum > 0 else ()) + (("residual",) if codec else ())


# ---------------------------------------------------------------- the machine

def meminfo(key):
    """A /proc/meminfo field in bytes (0 if it cannot be read)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def cgroup_limit():
    """This process's memory limit set by its cgroup (v2 memory.max or v1
    memory.limit_in_bytes), or None when there is none."""
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 1 << 60:
            return int(text)
    return None


def default_memory(budget_for, shared):
    """--memory-gb when not given -> (bytes, why): 3/4 of the machine's memory (its cgroup's
    limit if lower), at most 9/10 of what is available now; with merge workers (`shared`) no
    more than the shared memory free holds besides the fixed part. budget_for(bytes) -> Budget."""
    total = meminfo("MemTotal")
    limit = cgroup_limit()
    g, why = 3 * min(total, limit or total) // 4, f"3/4 of {'the cgroup limit' if limit and limit < total else 'RAM'}"
    avail = meminfo("MemAvailable")
    if avail and 9 * avail // 10 < g:
        g, why = 9 * avail // 10, "9/10 of the memory available"
    free = fedmom_merge.free_bytes()
    b = budget_for(g)
    if shared and free is not None and b.split()[0] + b.scratch_bytes() > free:
        g, why = b.minimum() + max(0, free - b.scratch_bytes()), f"what {fedmom_merge.shm_dir()} has free"
    return max(g, budget_for(0).minimum()), why


def check_machine(b, shared, outer_dir, given):
    """The start's checks: RAM, shared memory and --outer-dir against the budget -> None, or a
    SystemExit in one line naming the flag to change."""
    need, flag = b.minimum(), f"--memory-gb {b.memory / GB:g}"
    if b.memory < need:
        raise SystemExit(f"fedmom_server: {flag} is less than the aggregator holds with none of its outer state in "
                         f"memory ({gb(need)}: {describe_fixed(b)}): raise --memory-gb to at least "
                         f"{math.ceil(need / GB * 10) / 10:g}, or lower --merge-procs")
    avail = meminfo("MemAvailable")
    if given and avail and b.memory > avail:
        raise SystemExit(f"fedmom_server: {flag} is more than the {gb(avail)} this machine has available: lower "
                         "--memory-gb (what does not fit goes to --outer-dir, on disk)")
    mem, disk = b.split()
    free = fedmom_merge.free_bytes()
    if shared and free is not None and mem + b.scratch_bytes() > free:
        fit = b.minimum() + max(0, free - b.scratch_bytes())
        raise SystemExit(f"fedmom_server: {flag} puts {gb(mem)} of outer state in shared memory "
                         f"({fedmom_merge.shm_dir()}, {gb(free)} free; {gb(b.scratch_bytes())} of update scratch too): "
                         f"lower --memory-gb to {fit / GB:.2f}, or enlarge it (mount -o remount,size=... "
                         f"{fedmom_merge.shm_dir()}, or ${fedmom_merge.SHM_ENV})")
    if disk:
        os.makedirs(outer_dir, exist_ok=True)
        dfree = fedmom_merge.free_bytes(outer_dir)
        if dfree is not None and disk > dfree:
            raise SystemExit(f"fedmom_server: {flag} leaves {gb(disk)} of outer state on disk and --outer-dir "
                             f"{outer_dir} has {gb(dfree)} free: point --outer-dir at a larger disk, or raise "
                             "--memory-gb")


def gb(n):
    """Bytes as GB (10^9), or MB below one GB, for messages."""
    return f"{n / GB:.2f} GB" if n >= GB else f"{n / 1e6:.1f} MB"


def describe_fixed(b):
    return ", ".join(f"{k} {gb(v)}" for k, v in b.fixed().items() if v)


def describe(b, outer_dir):
    """One line for the start's log: the budget and where the outer state went."""
    mem, disk = b.split()
    where = {k: f"{len(b.shapes) - len(v)}/{len(b.shapes)}" for k, v in b.placement().items()}
    return (f"memory budget {gb(b.memory)}: fixed {gb(b.minimum())} ({describe_fixed(b)}); outer state "
            f"{gb(b.state_bytes())}, {gb(mem)} in memory, {gb(disk)} on disk"
            + (f" in {outer_dir}" if disk else "") + " (tensors in memory: "
            + ", ".join(f"{k} {v}" for k, v in where.items()) + ")")


def make_store(shapes, kinds, codec, procs, memory_gb, outer_dir, say):
    """At a start, once the shapes are known: the budget (memory_gb, or the machine's:
    default_memory), the checks of RAM, shared memory and outer_dir against it (a one-line
    SystemExit naming the flag), what a dead aggregator left in outer_dir swept, and the Store
    the outer state is loaded into -> (Budget, Store). say(line): the start's log."""
    budget_for = lambda g: Budget(g, shapes, kinds, codec, procs)
    if memory_gb is not None:
        memory, why = int(memory_gb * GB), "--memory-gb"
    else:
        memory, why = default_memory(budget_for, procs > 0)
    b = budget_for(memory)
    fedmom_merge.sweep_stale(outer_dir)
    check_machine(b, procs > 0, outer_dir, memory_gb is not None)
    say(f"{describe(b, outer_dir)}; budget from {why}")
    return b, Store(shapes, b.placement(), outer_dir, procs > 0)


# ---------------------------------------------------------------- the blocks

class Store:
    """The outer state's blocks as a Budget places them: for each of ARRAYS one
    fedmom_merge.BlockArrays, made on first use (its memory or disk taken then, at once) and
    reused by every load, round and rebuild after. shared: the memory part in shared memory
    (a round on merge workers), else private. A kind the placement does not name (kept by a
    logged round only) goes to disk whole."""

    def __init__(self, shapes, placement, outer_dir, shared):
        self.shapes, self.placement, self.dir, self.shared = dict(shapes), placement, outer_dir, shared
        self.made = {}

    def arrays(self, kind):
        if kind not in self.made:
            disk = self.placement.get(kind, set(self.shapes))
            if disk:
                os.makedirs(self.dir, exist_ok=True)
            self.made[kind] = fedmom_merge.BlockArrays(self.shapes, on_disk=disk, disk_dir=self.dir,
                                                     shared=self.shared)
        return self.made[kind]

    def sync(self):
        for a in self.made.values():
            a.sync()

    def bytes(self):
        """(memory, disk) bytes of the blocks made so far."""
        return (sum(a.memory_bytes() for a in self.made.values()), sum(a.disk_bytes() for a in self.made.values()))

    def release(self):
        for a in self.made.values():
            a.release()
        self.made = {}


# ---------------------------------------------------------------- the plan of a run

# Rates bench/scale_round.py measured (`--flavor 0.6B --rounds 4`, both arms, 2 cores shared
# with other work; `plan --rates FILE` takes a run's --json instead): the merge's CPU seconds
# per parameter (all its workers) with the outer state in memory and on disk, one delta's
# acceptance and the publish per parameter projected to a 16-core VM (bench/scale_round.py's
# project()), the one-core sha256 of theta per byte, the checkpoint's fsync'd write rate.
RATES = {"source": "bench/scale_round.py --flavor 0.6B --rounds 4 (2 cores)", "merge_cpu_s_per_param": 1.34e-8,
         "merge_disk_cpu_s_per_param": 1.77e-8, "accept_s_per_param": 9.0e-10, "publish_s_per_param": 1.03e-9,
         "sha256_s_per_byte": 7.4e-10, "checkpoint_write_bps": 0.37e9}
NVME = {"read_bps": 3.0e9, "write_bps": 2.0e9}      # a VM's local NVMe disk, assumed (plan --disk-gbs)


def rates_from(path=None):
    """RATES from a bench/scale_round.py --json file (its "rates"); None: RATES. The round's
    exchange (plan's serial and pipelined figures) takes three more, measured by the same
    bench since its pipelined arm, when the file has them, else those of its 0.6B run: the
    link's rate down (blob_client over loopback TLS), a site's apply per parameter, and what
    the pipeline adds to its slowest stage per value of the largest tensor (its tail)."""
    exchange = {"link_bps": 0.40e9, "apply_s_per_param": 1.21e-8, "tail_s_per_largest": 4.4e-8,
                "exchange_source": "bench/scale_round.py --flavor 0.6B --rounds 3 (2 cores)"}
    if path is None:
        return {**exchange, **RATES}
    with open(path) as f:
        got = json.load(f).get("rates")
    if not isinstance(got, dict) or not set(RATES) <= set(got):
        raise SystemExit(f"plan: {path} holds no \"rates\" (write it with bench/scale_round.py --json)")
    return {**exchange, **got, "exchange_source": got["source"] if "link_bps" in got else exchange["exchange_source"]}


def round_seconds(b, sites, cores, rates, disk, update_bytes=None):
    """Central seconds of one round at this budget: the acceptances, the merge (its CPU over
    the cores, or the disk's reads and writes of the part on disk, whichever is longer, and
    never under the one-core theta digest), the publish. With update_bytes (and the exchange's
    rates: rates_from), the exchange after the last delta's last byte: serial = its
    acceptance + merge + publish + the update's download at link_bps + a site's apply, one
    after another; pipelined = the slowest of merge, download and apply (they overlap, tensor
    by tensor) + the tail (tail_s_per_largest x the largest tensor's values)."""
    P, (in_mem, on_disk) = b.params, b.split()
    f = on_disk / max(in_mem + on_disk, 1)
    cpu = P * (rates["merge_cpu_s_per_param"] * (1 - f) + rates["merge_disk_cpu_s_per_param"] * f) / cores
    io = on_disk / disk["read_bps"] + on_disk / disk["write_bps"]
    merge = max(cpu, io, rates["sha256_s_per_byte"] * 4 * P)
    out = {"accept": sites * rates["accept_s_per_param"] * P, "merge": merge, "merge_io": io,
           "publish": rates["publish_s_per_param"] * P}
    if update_bytes is not None and "link_bps" in rates:
        down, apply = update_bytes / rates["link_bps"], rates["apply_s_per_param"] * P
        tail = rates["tail_s_per_largest"] * b.largest
        out.update(download=down, apply=apply, tail=tail,
                   serial=out["accept"] / sites + merge + out["publish"] + down + apply,
                   pipelined=max(merge, down, apply) + tail)
    return out


def disk_needs(P, sites, codec_bytes, delta_bytes, checkpoint_rounds, keep_rounds, kinds):
    """{what: bytes} on disk: the state dir (checkpoint, the logged rounds' deltas, the open
    round's, one update, one segment more while a checkpoint is written) and the blob store
    (K + 1 updates, a delta per site in transit); RUNBOOK.md, "First-time setup" has the formula."""
    M, D, U = 4 * P, sites * delta_bytes * P, codec_bytes * P
    return {"checkpoint": len(kinds) * M + 3 * (64 << 20), "deltas logged + open": (checkpoint_rounds + 1) * D,
            "update": U, "blob store": (keep_rounds + 1) * U + D}


def payload_per_param(codec):
    """Bytes per parameter of one delta or update in a wire format (wire.Codec; None: f32)."""
    if codec is None or codec.fmt == "f32":
        return 4.0
    if codec.fmt == "bf16":
        return 2.0
    if codec.fmt == "topk":
        return codec.topk_k * (codec.topk_bits + codec.index_bits) / 8 / codec.topk_chunk + 2 / codec.topk_chunk
    return {"int8": 8, "int4": 4, "int2": 2}[codec.fmt] / 8 + 2 / codec.block


def plan(shapes, how, sites, wire_codec, down_codec, memory_gb, procs, cores, outer_momentum, checkpoint_rounds,
         keep_rounds, rates, disk):
    """What a run needs -> the lines `fedmom_server.py plan` prints: RAM at the budget, the
    disk, and the central seconds of a round in memory, at the budget and with nothing in
    memory (round_seconds, from `rates`: bench/scale_round.py's)."""
    kinds = kinds_of(outer_momentum, down_codec)
    at = lambda g: Budget(int(g), shapes, kinds, down_codec, procs, bool(wire_codec and wire_codec.fmt == "topk"))
    low = at(0).minimum()
    full = low + at(0).state_bytes()
    b = at(memory_gb * GB if memory_gb is not None else full)
    P, M = b.params, 4 * b.params
    mem, disk_b = b.split()
    fmt = lambda c: c.fmt if c else "f32"
    out = [f"plan: {P / 1e9:.3f}G parameters (M = {gb(M)} fp32), largest tensor {b.largest / 1e6:.1f}M values ({how}); "
           f"{sites} site(s) sending {fmt(wire_codec)} deltas; --down-wire {fmt(down_codec)}; {procs} merge workers "
           f"on {cores} cores; --checkpoint-rounds {checkpoint_rounds}, --keep-rounds {keep_rounds}",
           f"memory, --memory-gb {b.memory / GB:.2f}{'' if memory_gb is not None else ' (all in memory)'}: "
           f"fixed {gb(low)} ({describe_fixed(b)})",
           f"  outer state {gb(b.state_bytes())} ({', '.join(kinds)}: {4 * len(kinds)} B/param): {gb(mem)} in memory"
           + (f" (shared memory: {gb(mem + b.scratch_bytes())})" if procs else "") + f", {gb(disk_b)} on disk "
           "(--outer-dir)",
           f"  RAM: {gb(b.memory)} at this budget; all in memory {gb(full)}; nothing in memory {gb(low)}"]
    D, U = payload_per_param(wire_codec), (payload_per_param(down_codec) if down_codec else 0.0)
    needs = disk_needs(P, sites, U, D, checkpoint_rounds, keep_rounds, kinds)
    needs = {"--outer-dir (file blocks, scratch)": disk_b, "state dir: checkpoint": needs["checkpoint"],
             f"state dir: deltas of {checkpoint_rounds} logged rounds + the open one": needs["deltas logged + open"],
             "state dir: the update": needs["update"], "blob store": needs["blob store"]}
    out.append(f"disk ({sites} x {D:.3f} B/param of deltas a round, {U:.3f} B/param of update):")
    out += [f"  {k:<58} {gb(v):>11}" for k, v in needs.items() if v]
    out.append(f"  {'in all':<58} {gb(sum(needs.values())):>11}")
    out.append(f"seconds per round, central (rates: {rates['source']}; {cores} cores; disk read "
               f"{disk['read_bps'] / GB:.1f} GB/s, write {disk['write_bps'] / GB:.1f} GB/s):")
    out.append(f"  {'mode':<26} {'in memory':>10} {f'accept x{sites}':>9} {'merge':>8} {'(disk)':>8} {'publish':>8} "
               f"{'central':>8}")
    modes = [("all in memory", at(full)), (f"--memory-gb {b.memory / GB:.2f}", b), ("nothing in memory", at(low))]
    for name, m in modes:
        r = round_seconds(m, sites, cores, rates, disk)
        out.append(f"  {name:<26} {gb(m.split()[0]):>10} {r['accept']:9.1f} {r['merge']:8.1f} {r['merge_io']:8.1f} "
                   f"{r['publish']:8.1f} {r['accept'] + r['merge'] + r['publish']:8.1f}")
    ck = needs["state dir: checkpoint"] / disk["write_bps"]
    out.append(f"  the checkpoint, every {checkpoint_rounds} rounds after its round is published: {ck:.0f} s "
               f"({gb(needs['state dir: checkpoint'])} at the disk's {disk['write_bps'] / GB:.1f} GB/s; measured "
               f"{rates['checkpoint_write_bps'] / GB:.2f} GB/s where the rates were)")
    if down_codec is not None and "link_bps" in rates:
        r = round_seconds(b, sites, cores, rates, disk, U * P)
        out.append(f"the exchange, last delta's last byte -> every site holding the next theta, at --memory-gb "
                   f"{b.memory / GB:.2f} (rates: {rates['exchange_source']}; the link {rates['link_bps'] / GB:.2f} "
                   f"GB/s, a site's apply {rates['apply_s_per_param'] * 1e9:.1f} ns/param, the tail "
                   f"{rates['tail_s_per_largest'] * 1e9:.1f} ns x the largest tensor's {b.largest / 1e6:.0f}M values):")
        out.append(f"  serial:    accept {r['accept'] / sites:.1f} + merge {r['merge']:.1f} + publish {r['publish']:.1f} "
                   f"+ download {r['download']:.1f} ({gb(U * P)}) + apply {r['apply']:.1f} = {r['serial']:.1f} s")
        out.append(f"  pipelined: max(merge {r['merge']:.1f}, download {r['download']:.1f}, apply {r['apply']:.1f}) "
                   f"+ tail {r['tail']:.1f} = {r['pipelined']:.1f} s ({r['pipelined'] / r['serial']:.2f} x serial)")
    return out


# ==== the outer state in use: OuterKeeper =========================================================
# The arrays belong to `mem_lock`: a merge, a checkpoint and writing a copy hold it, for seconds
# to minutes; the bookkeeping beside them (the round, the checkpoint's record, the log of Steps,
# the update) is the Ledger's, under its lock (fedmom_state.Ledger). mem_lock is always taken
# BEFORE the Ledger's lock, never after it.
# The robust merge: each delta is scaled to at most --clip-factor x the median delta norm of the
# round and of the last rounds' merged deltas (fedmom_merge.clip_scales); a merge whose theta or
# momentum would not be finite is redone from the rebuilt arrays, without the largest
# contribution (excluded), or with the momentum reset when the old momentum alone overflows.

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
    """theta of round 0 (OuterState, no momentum or residual yet) from the init
    file, every tensor as fp32 straight into its place (the store's blocks), checked: floating
    point and finite."""
    shapes = init_shapes(init_path)
    theta = alloc(shapes, store, "theta", False)
    with tensorio.TensorReader(init_path) as r:
        for n in r.names:
            fill(theta[n], r, n)
            if not all(np.isfinite(c).all() for c in fedmom_merge.chunks(theta[n])):
                raise SystemExit(f"--init {init_path}: tensor {n!r} holds NaN or Inf; a global model "
                                 "must start finite")
    return OuterState(shapes, theta, store=store)


def init_theta(init_path, out_path, fsync=True):
    """theta-0 from the init file as one fp32 tensor file (init_outer's checks)."""
    init_outer(init_path).write("theta", out_path, fsync=fsync)


def init_id(init_path, specs):
    """What state.json records of the model a run started from, to recognise it at a restart."""
    st = os.stat(init_path)
    return {"sha256": file_sha256(init_path), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "structure": structure_digest(specs)}


class OuterKeeper:
    """The outer state of the ledger's round: `outer` (OuterState) and what is done
    to it. `clock` is the monotonic clock (the checkpoint's retry, a merge's seconds)."""

    def __init__(self, cfg, state_dir, ledger, clock=time.monotonic):
        self.cfg, self.dir, self.ledger, self.clock = cfg, state_dir, ledger, clock
        self.outer = None             # theta, momentum, residual of the ledger's round, in its store's blocks
        self.specs = {}               # tensor -> shape
        self.budget = self.store = None   # Budget and Store, once the shapes are known (place())
        self.outer_dir = cfg.outer_dir or os.path.join(state_dir, OUTER_DIR)
        self.mem_lock = threading.Lock()
        self.checkpointing = False    # a checkpoint holds mem_lock (writing the arrays out)
        self.replay_error = None      # a rebuild that gave other bits than the round recorded: merges stop
        self.last_checkpoint = None   # {"round", "seconds", "bytes"} of the last one written
        self.checkpoint_retry_at = 0.0
        self.merge_pause_s = float(os.environ.get(MERGE_PAUSE_ENV, "0") or 0)
        self._pool = None             # fedmom_merge.Pool, started at the first round or replay that needs it
        self.growing = None           # tensorio.Growing: the update of the round being merged (or the last one)
        fedmom_merge.sweep_stale()      # the shared arrays of an aggregator killed here before

    def procs(self):
        """The merge workers a round runs on (0: in this process): --merge-procs, for a model
        of POOL_MIN_PARAMS or more (a smaller one runs faster here than through the pipes)."""
        procs = self.cfg.merge_procs or os.cpu_count() or 1
        params = sum(math.prod(sh) for sh in self.specs.values())
        return procs if procs > 1 and params >= fedmom_merge.min_params() else 0

    def pool(self):
        """The round's worker processes (None: this process), started on first use: an
        aggregator that never merges starts none."""
        if not self.procs():
            return None
        if self._pool is None:
            self._pool = fedmom_merge.Pool(self.procs(), worker_argv())
        return self._pool

    def place(self, kinds=None):
        """Once the shapes are known, at a start: the budget, the start's checks and the store
        the outer state is loaded into (make_store), for the arrays of `kinds`
        (default: those this run keeps)."""
        cfg = self.cfg
        kinds = kinds or kinds_of(cfg.outer_momentum, cfg.down_codec())
        self.budget, self.store = make_store(self.specs, kinds, cfg.down_codec(), self.procs(),
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
        return write_checkpoint(self.outer, self.dir, None, self.cfg.fsync)

    def read_shapes(self):
        self.specs = read_shapes(self.dir, self.ledger.ckpt)
        self.place()

    def logged_files(self):
        """The spool files of the rounds logged since the checkpoint (a restart replays them)."""
        return {os.path.join(self.dir, f) for s in self.ledger.log for f in step_files(s)}

    def clean_dir(self):
        """Remove what a crash left in the state dir: temp files, files of other rounds, a
        checkpoint of the older layout that a newer one replaced."""
        ckpt, update = self.ledger.ckpt, self.ledger.update
        keep = set(checkpoint_files(self.dir, ckpt)) | {"state.json", "rounds.jsonl", "spool"}
        if update:
            keep.add(update["file"])
        for fn in os.listdir(self.dir):
            if fn not in keep and (fn.startswith(("theta-", "momentum-", "merged-", "update-", "residual-"))
                                   or durable.is_tmp(fn)):
                os.unlink(os.path.join(self.dir, fn))
        for d in os.listdir(self.dir):
            path = os.path.join(self.dir, d)
            if not (d.startswith(CKPT_DIR) and os.path.isdir(path)):
                continue
            for fn in os.listdir(path):          # a segment a killed checkpoint was writing, or every
                if durable.is_tmp(fn) or d != ckpt.get("dir"):          # file of a checkpoint not named
                    os.unlink(os.path.join(path, fn))
            if d != ckpt.get("dir"):
                os.rmdir(path)

    def rebuild(self, at_start=False):
        """`outer` from the checkpoint's files and the Steps logged since, each replayed and
        checked against the theta digest it published (rebuild). At the start
        a mismatch stops the server; later (rebuilding after a failed merge) it stops the merges
        and shows on /status. The caller holds mem_lock (or is starting)."""
        c, steps, rnd, t0 = self.ledger.ckpt, self.ledger.log, self.ledger.table.round, time.monotonic()
        if self.outer is not None and self.outer.dirty:
            # the failed round's arrays are the store's blocks: the checkpoint is loaded into
            # them again (the caller dropped the failed try's frames), the state held once
            self.outer.drop()
        try:
            outer = rebuild(self.dir, c, steps, self.cfg.threads, pool=self.pool_for(steps),
                                              store=self.store, delta_bytes=self.budget.delta_bytes())
        except Exception as e:         # a mismatch, a missing or damaged file, a non-finite replay, a disk
            if self.outer is not None:
                self.outer.dirty = True    # whatever it holds is not a durable round: never served
            if isinstance(e, (fedmom_merge.WorkerDied, fedmom_merge.DiskError)) and not at_start:
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
        """The merge of `batch` (fedmom_round.Pending) into round + 1, robustly (the comment
        above OuterKeeper); `history`: the delta norms of the last rounds, for the clip. The caller
        holds mem_lock; the arrays become round + 1's (apply_round), and a failed
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
            step = Step(new, [(os.path.relpath(p.path, self.dir), w * c)
                                          for p, w, c in zip(live, shares, scales)],
                                    cfg.outer_lr, mu, bool(reset) or mu == 0 or self.outer.momentum is None, codec)
            t0, tag = self.clock(), {"round": new, "base_digest": self.outer.digest, "id": secrets.token_hex(6)}
            try:
                stats = apply_round(
                    self.outer, resolved(step, self.dir),
                    codec and os.path.join(self.dir, f"update-{new}.safetensors"), {"round": str(new)}, cfg.fsync,
                    cfg.threads, after_tensor=self._after_tensor, pool=self.pool_for([step]),
                    delta_bytes=self.budget.delta_bytes(), on_update=lambda w: self._offer(w, tag))
            except fedmom_merge.NonFinite as e:
                traceback.clear_frames(e.__traceback__)     # the failed try's arrays, let go before the rebuild
                self.rebuild()                      # the arrays are half merged: back to round rnd
                if not step.fresh and momentum_alone_overflows(self.outer, e.name, cfg.outer_lr, mu):
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
                                "id": tag["id"], **stats["published"]}
            stats.update(merge_s=self.clock() - t0, weights=shares, scales=scales, clip=clip, momentum_reset=reset,
                         update=update, step=step, outer_lr=cfg.outer_lr, outer_momentum=mu)
            return stats, live, dropped
        return None, [], dropped

    def _offer(self, writer, tag):
        """apply_round's on_update: the update being written becomes the one sites may follow
        (the one before is withdrawn; its readers finish from their own descriptors)."""
        g = tensorio.Growing(writer, {**tag, "offered": testhooks.wall_time()})
        with self.ledger.lock:
            old, self.growing = self.growing, g
            self.ledger.wake()                      # a site waiting in follow_update
        if old is not None:
            old.close()
        return g

    def withdraw(self, why):
        """The round being merged will not become durable as written (its save failed): its
        readers are cut, and none starts."""
        if self.growing is not None:
            self.growing.fail(why)

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
        ckpt = set(checkpoint_files(self.dir, self.ledger.ckpt))
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
        over the last checkpoint's (write_checkpoint: the disk holds one
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
                record = write_checkpoint(self.outer, self.dir, L.ckpt, self.cfg.fsync,
                                                            after_file=lambda: testhooks.fault_point("fedmom.checkpoint"))
            finally:
                with L.lock:
                    self.checkpointing = False
            with L.lock:
                mark, old, covered = L.mark(), L.ckpt, [s for s in L.log if s.round <= rnd]
                L.ckpt, L.log = record, [s for s in L.log if s.round > rnd]
                L.save_or_rewind(mark)
                gone = [os.path.join(self.dir, f)                         # clean_dir's, after a crash
                        for f in stale_files(self.dir, old, record)]
                gone += bury([os.path.join(self.dir, f) for s in covered
                                           for f in step_files(s)])
                nbytes = sum(os.path.getsize(os.path.join(self.dir, f))
                             for f in checkpoint_files(self.dir, record))
                self.last_checkpoint = {"round": rnd, "seconds": round(time.monotonic() - t0, 3), "bytes": nbytes}
        log(f"fedmom: checkpoint of round {rnd}: {nbytes / 2**30:.2f} GiB in {self.last_checkpoint['seconds']:.1f} s; "
            f"{len(covered)} logged round(s) covered")
        remove(gone)
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
                segs = checkpoint_files(self.dir, L.ckpt)
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


if __name__ == "__main__":
    if sys.argv[1:] != ["--merge-worker"]:
        sys.exit("outer_state.py is a module; the aggregator runs it as `outer_state.py --merge-worker`, its "
                 "merge workers (fedmom_server.py --merge-procs)")
    fedmom_merge.serve(WorkerSession())
