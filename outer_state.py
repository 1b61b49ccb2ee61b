"""outer_state.py - the aggregator's outer state, one round applied to it, and its replay.

Runs on: the central VM, inside fedmom_server.py (numpy + tensorio.py + wire.py +
fedmom_merge.py + merge_pool.py; never torch), and as the aggregator's merge workers:
`python outer_state.py --merge-worker`, started by merge_pool.Pool (fedmom_server.py
--merge-procs), answering the Tasks of a round on stdin. Tested bit for bit against
fedmom_merge.merge_files + Publisher (the file-to-file merge) in tests/test_replay.py, and
on worker processes against one thread in tests/test_merge_pool.py.

OuterState holds what a round changes: theta_global (what the sites hold), the Nesterov
momentum and, with --down-wire, the residual the updates rounded away (owed to the next
update): one flat float32 array per tensor each (4 B/param each, 12 at most). Where each
lives is its store's (outer_budget.Store, from fedmom_server.py --memory-gb): in memory,
shared with the merge workers (merge_pool.BlockArrays), or in a file block on disk, read and
written a piece at a time by the same code; without a store, private arrays, which share()
moves into shared memory for a round on workers.

A round is a pure function of that state and of its Step, the round's recorded inputs:
the accepted deltas' files with the weight each was merged with (token share x clip
scale), the outer lr and momentum, whether the momentum starts afresh, and the
downstream codec. apply_round(state, step) merges the deltas into the arrays in place
and, given a path, writes the round's update file; the arithmetic is fedmom_merge.py's
(its docstring states the rule once), in the same float32 operations in the same order,
so the bits equal the file-to-file merge's. Replaying a Step gives the same bits again;
each Step carries the theta digest (wire.Digest) of its first run, and a replay that
ends elsewhere raises ReplayMismatch.

    state = OuterState.load("theta-8.safetensors", "momentum-8.safetensors", "residual-8.safetensors", 8)
    stats = apply_round(state, Step(9, [("spool/a", 0.25), ("spool/b", 0.75)], 0.7, 0.9, False,
                                    wire.Codec("int4")), out_update="update-9.safetensors")
    state.write("theta", "theta-9.safetensors")        # (fedmom_checkpoint.write_checkpoint: all three)

What the state dir keeps and when it is written (round by round, the checkpoint every
--checkpoint-rounds) is fedmom_state.py's docstring.

A round that raises part way (NonFinite, a full disk, merge_pool.DiskError) leaves the
arrays half merged: state.dirty is set and the caller rebuilds the state from its checkpoint
and the Steps since (fedmom_outer.OuterKeeper.rebuild).
"""
import dataclasses
import math
import os
import sys

import numpy as np

import fedmom_merge
import merge_pool
import tensorio
import testhooks
import wire
import wire_kernels


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

    store: where the arrays live (outer_budget.Store: in memory, shared with the merge
    workers, or in file blocks on disk, as --memory-gb places each tensor): the arrays are
    its merge_pool.BlockArrays, made once and reused by every load, round and rebuild, and a
    tensor on disk is a merge_pool.FileTensor, read and written a piece at a time. None:
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
            d.add_chunks(n, sh, merge_pool.chunks(self.theta[n]))
        return d.hexdigest()

    def write(self, which, path, metadata=None, fsync=True):
        """One of "theta", "momentum", "residual" as an F32 tensor file (atomic; durable with
        fsync); a tensor on disk is copied a bounded piece at a time."""
        arrays = getattr(self, which)
        specs = [(n, "F32", sh) for n, sh in self.shapes.items()]
        meta = {"round": str(self.round), **{k: str(v) for k, v in (metadata or {}).items()}}
        with tensorio.TensorWriter(path, specs, meta, fsync=fsync) as w:
            for n in self.shapes:
                w.write_chunks(n, merge_pool.chunks(arrays[n]))
        return path

    def share(self):
        """theta, momentum and residual into shared memory (merge_pool.BlockArrays), for a
        round on worker processes; arrays already in blocks (a store's) stay as they are."""
        self.theta = merge_pool.share(self.theta, self.shapes)
        self.momentum = merge_pool.share(self.momentum, self.shapes)
        self.residual = merge_pool.share(self.residual, self.shapes)
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
        dup = lambda d: d and {n: merge_pool.whole(a).copy() for n, a in d.items()}
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
        return merge_pool.BlockArrays(shapes, zero)
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
    [lo, lo + its size) of dest, a flat float32 array or merge_pool.FileTensor: an F32
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
        step = merge_pool.CHUNK_BYTES // 4
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
        merge_pool.FileTensors (a tensor on disk: each piece read, merged, written back);
        codes/sbits: where the update's parts go, flat uint8/uint16 (None: new arrays)."""
        self.name, self.shape, self.n = name, shape, math.prod(shape)
        self.T, self.M, self.owed = T, M, owed
        self.deltas, self.weights = deltas, weights
        self.lr, self.mu, self.codec = lr, mu, codec
        self.blocks = self.codec is not None and self.codec.fmt in wire.LEVELS
        self.codes = self.sbits = self.x = None
        if self.blocks:                                    # the update's parts, filled piece by piece
            R, C, nb = wire_kernels.as_blocks(shape, self.codec.block)
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
        self.on_disk = any(isinstance(a, merge_pool.FileTensor) for a in (T, M, owed, self.residual))

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
        T = merge_pool.piece(self.T, lo, hi, tb)
        M = merge_pool.piece(self.M, lo, hi, mb) if self.M is not None else None
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
                merge_pool.put(self.M, lo, hi, M)
            if self.codec is None:
                merge_pool.put(self.T, lo, hi, T)
                return tsq, dsq, rsq, None
            # Publisher.write, piece by piece. A non-finite merged value needs no check of its
            # own here: x is then Inf or NaN, so is its block's scale, and theta's check below fails
            x = mg
            np.subtract(x, T, out=x)                                 # x = (merged - prev) + residual
            if owed:
                x += merge_pool.piece(self.owed, lo, hi, ob)
            if not self.blocks:                                      # encoded whole after the merge
                if not np.isfinite(x).all():
                    return tsq, dsq, rsq, "theta"
                np.copyto(self.x[lo:hi], x)
                return tsq, dsq, rsq, None
            a, b = lo // self.C, hi // self.C
            fmt = self.codec.fmt
            codes = self.codes[wire_kernels.code_start(fmt, lo):] if fmt != "int8" else self.codes[a:b]
            wire_kernels.encode_span(x.reshape(b - a, self.C), 0, b - a, self.codec, codes, self.sbits[a:b],
                                     sent.reshape(b - a, self.C))
            np.add(T, sent, out=T)                                   # theta = prev + sent (wire.add_update)
            if not np.isfinite(T).all():
                return tsq, dsq, rsq, "theta"
            res = merge_pool.piece(self.residual, lo, hi, rb)        # (its old values are not read)
            np.subtract(x, sent, out=res)                            # residual = x - sent
            rsq = fedmom_merge.sq_norm(res)
            merge_pool.put(self.T, lo, hi, T)
            merge_pool.put(self.residual, lo, hi, res)
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
        T = merge_pool.piece(self.T, lo, hi, None)
        wire.add_into(T, sent, threads)
        if not np.isfinite(T).all():
            raise fedmom_merge.NonFinite("theta", self.name, "deltas")
        merge_pool.put(self.T, lo, hi, T)
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
    return wire_kernels.packed_bytes(n, wire_kernels.CODE_BITS[codec.fmt])


def update_parts(codec, shape, codes, sbits):
    """{part suffix: array} of one tensor's int8/int4 update, as Codec.encode returns them."""
    rows, cols = wire_kernels.rows_cols(shape)
    codes = codes.reshape(-1)[:update_codes_size(codec, math.prod(shape))]
    codes = codes if codec.fmt != "int8" else codes.view(np.int8).reshape(shape)
    nb = -(-cols // codec.block)
    return {"": codes, wire.SCALE: sbits.reshape(-1)[:rows * nb].reshape(rows, nb)}


# ---------------------------------------------------------------- the round on worker processes

@dataclasses.dataclass
class Task:
    """One worker's share of one tensor of a round (merge_pool.py): the step, where the arrays
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
                only=None, pool=None, delta_bytes=None):
    """Merge step's deltas into `state` in place (module docstring). out_update: where the
    round's update goes (step.codec given); None writes nothing (a replay). after_tensor(name):
    called after each tensor (the aggregator's fault point). Raises fedmom_merge.NonFinite
    (its cause is only a guess here: the old values are gone; see momentum_alone_overflows),
    ReplayMismatch when step.digest is set and the result differs, or merge_pool.DiskError (a
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

    delta_bytes: the most the deltas' parts may hold in memory at once (outer_budget.Budget:
    the merge's share of --memory-gb); a tensor whose parts of every delta would hold more
    runs in waves of pieces that fit, each wave's parts read then dropped. None: one wave.

    only: {name: [(lo, hi, has_momentum, owed)]}: the round applied to those runs of elements
    alone (a checkpoint's segments still behind this round: fedmom_checkpoint.rebuild), each
    with what it holds at the round before (a momentum buffer, a residual owed); the rest is
    left as it is, nothing is written and no digest is made or checked (the state's round and
    digest are the caller's to set). Each run must start and end on a whole row (a pair of
    rows when a row is odd) and, with a topk --down-wire, on a chunk of it.

    pool: a merge_pool.Pool of 2 or more workers: the pieces of each wave run in those
    processes, one contiguous run each, on the state's arrays in blocks they share (a
    store's, or private arrays moved into shared memory: state.share()); the same bits. A
    topk or bf16 --down-wire is encoded whole, here."""
    threads = wire_kernels.resolve_threads(threads)
    codec, mu, shapes = step.codec, step.mu, state.shapes
    fresh = step.fresh or state.momentum is None or mu == 0
    if only is not None and out_update is not None:
        raise ValueError("apply_round: a round applied to part of the state (only=) writes no update")
    use_pool = pool is not None and pool.procs > 1 and (codec is None or codec.fmt in wire.LEVELS)
    state.dirty = True
    deltas, uw, behind, scratch = [], None, None, None
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
        if use_pool and codec is not None:
            scratch = _Scratch(codec, shapes)
        new_residual = {} if codec is not None else None
        sums = {"theta": 0.0, "delta": [0.0] * len(deltas)}
        base_digest, digest, rsq = state.digest, wire.Digest(), 0.0
        behind, pending = wire_kernels.Behind(), []
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
                pending.append(behind.submit(lambda n=n, sh=sh: digest.add_chunks(n, sh, merge_pool.chunks(
                    state.theta[n]))))
            if uw is not None:
                pending.append(behind.submit(uw.write_parts, n, parts))
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
        if uw is not None:
            uw.abort()
        for d in deltas:
            d.close()


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
    wire_kernels.run_spans(run, len(pieces), 1, step_n, threads)
    return results


class _Scratch:
    """Two slots of shared memory for one tensor's update parts (codes, scale bits), the
    largest tensor's size: the workers fill one while the other is still being written out."""

    class Slot:
        def __init__(self, codes_bytes, sbits_count):
            self.block = merge_pool.Block(codes_bytes + 2 * sbits_count)
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
        nb = lambda sh: wire_kernels.as_blocks(sh, codec.block)
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
    step = merge_pool.CHUNK_BYTES // 4                     # elementwise: a piece at a time, never a whole copy
    tb, mb = np.empty(min(step, max(T.size, 1)), np.float32), np.empty(min(step, max(T.size, 1)), np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        for lo in range(0, T.size, step):
            hi = min(lo + step, T.size)
            t, m = tb[:hi - lo], mb[:hi - lo]
            np.copyto(t, merge_pool.piece(T, lo, hi, t))
            np.copyto(m, merge_pool.piece(M, lo, hi, m))
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
    """The command of a merge worker (merge_pool.Pool): this file, serving Tasks."""
    return [sys.executable, os.path.abspath(__file__), "--merge-worker"]


if __name__ == "__main__":
    if sys.argv[1:] != ["--merge-worker"]:
        sys.exit("outer_state.py is a module; the aggregator runs it as `outer_state.py --merge-worker`, its "
                 "merge workers (fedmom_server.py --merge-procs)")
    merge_pool.serve(WorkerSession())
