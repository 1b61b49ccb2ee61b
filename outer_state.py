"""outer_state.py - the aggregator's outer state in memory, one round applied to it, and its replay.

Runs on: the central VM, inside fedmom_server.py (numpy + tensorio.py + wire.py +
fedmom_merge.py; never torch). Not started on its own. Tested bit for bit against
fedmom_merge.merge_files + Publisher (the file-to-file merge) in tests/test_replay.py.

OuterState holds what a round changes: theta_global (what the sites hold), the Nesterov
momentum and, with --down-wire, the residual the updates rounded away (owed to the next
update): one flat float32 array per tensor each, in memory (4 B/param each, 12 at most).

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
    state.save(dirname, fsync=True)       # a checkpoint: theta-9, momentum-9, residual-9

What the state dir keeps and when it is written (round by round, the checkpoint every
--checkpoint-rounds) is fedmom_state.py's docstring.

A round that raises part way (NonFinite, a full disk) leaves the arrays half merged:
state.dirty is set and the caller rebuilds the state from its checkpoint and the Steps
since (fedmom_outer.OuterKeeper.rebuild).
"""
import dataclasses
import math
import os

import numpy as np

import fedmom_merge
import tensorio
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
    theta's wire.Digest. A round changes them in place (apply_round)."""

    def __init__(self, shapes, theta, momentum=None, residual=None, round=0, digest=None):
        self.shapes = dict(shapes)
        self.theta, self.momentum, self.residual = theta, momentum, residual
        self.round, self.dirty = round, False
        self.digest = digest if digest is not None else self.theta_digest()

    @classmethod
    def load(cls, theta_path, momentum_path=None, residual_path=None, round=0):
        """The arrays from a checkpoint's files (momentum/residual None: not kept)."""
        with tensorio.TensorReader(theta_path) as r:
            shapes = {n: tuple(r.specs[n][1]) for n in r.names}
        arrays = [_read_all(p, shapes) if p else None for p in (theta_path, momentum_path, residual_path)]
        return cls(shapes, *arrays, round=round)

    @property
    def names(self):
        return list(self.shapes)

    def nbytes(self):
        return sum(a.nbytes for d in (self.theta, self.momentum, self.residual) if d for a in d.values())

    def theta_digest(self):
        d = wire.Digest()
        for n, sh in self.shapes.items():
            d.add(n, self.theta[n].reshape(sh))
        return d.hexdigest()

    def write(self, which, path, metadata=None, fsync=True):
        """One of "theta", "momentum", "residual" as an F32 tensor file (atomic; durable with fsync)."""
        arrays = getattr(self, which)
        specs = [(n, "F32", sh) for n, sh in self.shapes.items()]
        meta = {"round": str(self.round), **{k: str(v) for k, v in (metadata or {}).items()}}
        with tensorio.TensorWriter(path, specs, meta, fsync=fsync) as w:
            for n, sh in self.shapes.items():
                w.write(n, arrays[n].reshape(sh))
        return path

    def copy(self):
        """A deep copy (tests)."""
        dup = lambda d: d and {n: a.copy() for n, a in d.items()}
        return OuterState(self.shapes, dup(self.theta), dup(self.momentum), dup(self.residual), self.round,
                          self.digest)


def _read_all(path, shapes):
    out = {}
    with tensorio.TensorReader(path) as r:
        if sorted(r.names) != sorted(shapes):
            raise ValueError(f"{path}: its tensors are not theta's")
        for n in shapes:
            a = np.empty(math.prod(shapes[n]), np.float32)
            wire.read_f32(r, n, out=a)
            out[n] = a
    return out


class _Tensor:
    """What every piece of one tensor's round shares: the arrays, the deltas, the outputs.
    A piece is (lo, hi, first, owed): first, the momentum starts afresh there (buf = g); owed,
    a residual is owed there (added to the update's x)."""

    def __init__(self, name, shape, state, step, deltas, mu):
        self.name, self.shape, self.n = name, shape, math.prod(shape)
        self.T = state.theta[name]
        self.M = state.momentum[name] if state.momentum is not None and mu > 0 else None
        self.owed = state.residual[name] if state.residual is not None else None
        self.deltas, self.weights = deltas, [w for _, w in step.deltas]
        self.lr, self.mu, self.codec = step.lr, mu, step.codec
        self.blocks = self.codec is not None and self.codec.fmt in wire.LEVELS
        self.codes = self.sbits = self.x = None
        if self.blocks:                                    # the update's parts, filled piece by piece
            R, C, nb = wire_kernels.as_blocks(shape, self.codec.block)
            self.codes = (np.empty(wire_kernels.packed_bytes(self.n, 4), np.uint8) if self.codec.fmt == "int4"
                          else np.empty((R, C), np.int8))
            self.sbits, self.C = np.empty((R, nb), np.uint16), C
        elif self.codec is not None:                       # another format: encoded whole, after the merge
            self.x = np.empty(self.n, np.float32)
        self.residual = None
        if self.codec is not None:
            self.residual = self.owed if self.owed is not None else np.empty(self.n, np.float32)

    def run(self, pieces):
        """Merge (and publish) pieces [(lo, hi, first, owed)] in order, with this thread's own
        buffers. -> [(||old theta||^2, [||delta_i||^2], ||residual||^2, None or "theta"/"momentum")]."""
        k = len(self.deltas)
        size = max(p[1] - p[0] for p in pieces)
        s, tmp, mg, sent = (np.empty(size, np.float32) for _ in range(4))
        dbuf = [np.empty(size, np.float32) for _ in range(k)]
        out = []
        for lo, hi, first, owed in pieces:
            n = hi - lo
            out.append(self._piece(lo, hi, first, owed, s[:n], tmp[:n], mg[:n], sent[:n], dbuf))
            if out[-1][3]:
                break
        return out

    def _piece(self, lo, hi, first, owed, s, tmp, mg, sent, dbuf):
        T, M = self.T[lo:hi], (self.M[lo:hi] if self.M is not None else None)
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
            if self.codec is None:
                return tsq, dsq, rsq, None
            # Publisher.write, piece by piece. A non-finite merged value needs no check of its
            # own here: x is then Inf or NaN, so is its block's scale, and theta's check below fails
            x = mg
            np.subtract(x, T, out=x)                                 # x = (merged - prev) + residual
            if owed:
                x += self.owed[lo:hi]
            if not self.blocks:                                      # encoded whole after the merge
                if not np.isfinite(x).all():
                    return tsq, dsq, rsq, "theta"
                np.copyto(self.x[lo:hi], x)
                return tsq, dsq, rsq, None
            a, b = lo // self.C, hi // self.C
            codes = self.codes[lo // 2:] if self.codec.fmt == "int4" else self.codes[a:b]
            wire_kernels.encode_span(x.reshape(b - a, self.C), 0, b - a, self.codec, codes, self.sbits[a:b],
                                     sent.reshape(b - a, self.C))
            np.add(T, sent, out=T)                                   # theta = prev + sent (wire.add_update)
            if not np.isfinite(T).all():
                return tsq, dsq, rsq, "theta"
            res = self.residual[lo:hi]
            np.subtract(x, sent, out=res)                            # residual = x - sent
            rsq = fedmom_merge.sq_norm(res)
        return tsq, dsq, rsq, None

    def publish_whole(self, lo, hi, threads):
        """A format encoded whole (bf16, topk), elements [lo, hi) (the whole tensor, or a run of
        its topk chunks): the rest of Publisher.write on self.x -> (parts, ||residual||^2)."""
        x = self.x[lo:hi]
        parts, sent = self.codec.encode(x.reshape(self.shape) if hi - lo == self.n else x, threads)
        sent = np.asarray(sent, np.float32).reshape(-1)
        wire.add_into(self.T[lo:hi], sent, threads)
        if not np.isfinite(self.T[lo:hi]).all():
            raise fedmom_merge.NonFinite("theta", self.name, "deltas")
        x -= sent
        np.copyto(self.residual[lo:hi], x)
        return parts, fedmom_merge.sq_norm(x)

    def update_parts(self):
        """The int8/int4 update of this tensor, as Codec.encode returns its parts."""
        rows, cols = wire_kernels.rows_cols(self.shape)
        codes = self.codes if self.codec.fmt == "int4" else self.codes.reshape(self.shape)
        return {"": codes, wire.SCALE: self.sbits.reshape(rows, -(-cols // self.codec.block))}


def apply_round(state, step, out_update=None, metadata=None, fsync=True, threads=None, after_tensor=None,
                only=None):
    """Merge step's deltas into `state` in place (module docstring). out_update: where the
    round's update goes (step.codec given); None writes nothing (a replay). after_tensor(name):
    called after each tensor (the aggregator's fault point). Raises fedmom_merge.NonFinite
    (its cause is only a guess here: the old values are gone; see momentum_alone_overflows),
    or ReplayMismatch when step.digest is set and the result differs; either way state.dirty.
    -> {"theta_norm" (of the old theta), "delta_norms", "bytes_read", "bytes_written",
        "published": {"base_digest", "digest", "update_bytes", "residual_norm"} or None}.

    Each tensor is cut into pieces on the block boundaries of every codec involved
    (fedmom_merge.piece_unit), and each piece goes through the whole round while it is in
    cache: the deltas' blocks decoded, the weighted sum, the Nesterov step, and with a block
    --down-wire the update's blocks encoded, theta advanced by what they decode to and the
    residual kept; the pieces run on wire.py's thread pool, their norms added in piece order.
    Every value is computed by the same float32 operations as fedmom_merge.merge_files +
    Publisher, so the bits are theirs whatever the pieces or threads (tests/test_replay.py);
    the norms (float64 sums of float32 dots, reported only) may differ from theirs in the
    last digits. The theta digest (one sha256, serial) and the update file's writes run
    behind, on a thread of their own, while the next tensor merges.

    only: {name: [(lo, hi, has_momentum, owed)]}: the round applied to those runs of elements
    alone (a checkpoint's segments still behind this round: fedmom_checkpoint.rebuild), each
    with what it holds at the round before (a momentum buffer, a residual owed); the rest is
    left as it is, nothing is written and no digest is made or checked (the state's round and
    digest are the caller's to set). Each run must start and end on a whole row (a pair of
    rows when a row is odd) and, with a topk --down-wire, on a chunk of it."""
    threads = wire_kernels.resolve_threads(threads)
    codec, mu, shapes = step.codec, step.mu, state.shapes
    fresh = step.fresh or state.momentum is None or mu == 0
    if only is not None and out_update is not None:
        raise ValueError("apply_round: a round applied to part of the state (only=) writes no update")
    state.dirty = True
    deltas, uw, behind = [], None, None
    try:
        for p, _ in step.deltas:
            deltas.append(fedmom_merge.DeltaReader(p))
        _check_deltas(deltas, shapes)
        zeros = lambda: {n: np.zeros(math.prod(sh), np.float32) for n, sh in shapes.items()}
        if only is None:
            if mu > 0 and state.momentum is None:
                state.momentum = {n: np.empty(math.prod(sh), np.float32) for n, sh in shapes.items()}
            if mu == 0:
                state.momentum = None
            runs = {n: [(0, math.prod(sh), fresh, state.residual is not None)] for n, sh in shapes.items()}
        else:
            if mu > 0 and state.momentum is None:
                state.momentum = zeros()
            if codec is not None and state.residual is None:
                state.residual = zeros()
            runs = {n: [(lo, hi, step.fresh or not has_m or mu == 0, owed) for lo, hi, has_m, owed in only[n]]
                    for n in shapes if n in only}
        if codec is not None and out_update is not None:
            meta = {k: str(v) for k, v in (metadata or {}).items()}
            uw = wire.WireWriter(out_update, list(shapes.items()), codec, meta, fsync=fsync, threads=threads)
        new_residual = {} if codec is not None else None
        sums = {"theta": 0.0, "delta": [0.0] * len(deltas)}
        base_digest, digest, rsq = state.digest, wire.Digest(), 0.0
        behind, pending = wire_kernels.Behind(), []
        for n, sh in shapes.items():
            if n not in runs:
                continue
            for d in deltas:
                d.load(n, sh)
            t = _Tensor(n, sh, state, step, deltas, mu)
            unit = fedmom_merge.piece_unit(sh, [d.codec for d in deltas if d.blocks] + [codec if t.blocks else None])
            step_n = max(unit, fedmom_merge.STEP // unit * unit)
            pieces = [(lo, min(lo + step_n, hi), first, owed)
                      for a, hi, first, owed in runs[n] for lo in range(a, hi, step_n)]
            results = [None] * len(pieces)

            def run(a, b, t=t, pieces=pieces, results=results):
                done = t.run(pieces[a:b])                  # shorter after a bad piece: the rest stay None
                results[a:a + len(done)] = done
            wire_kernels.run_spans(run, len(pieces), 1, step_n, threads)
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
            if t.x is not None:
                for lo, hi, _, _ in runs[n]:
                    parts, r_sq = t.publish_whole(lo, hi, threads)
                    rsq += r_sq
            elif t.blocks:
                parts = t.update_parts()
            if codec is not None:
                new_residual[n] = t.residual
            if only is None:
                pending.append(behind.submit(digest.add, n, t.T.reshape(sh)))
            if uw is not None:
                pending.append(behind.submit(uw.write_parts, n, parts))
            pending = [f for f in pending if not f.done() or f.result()]   # re-raise a failure behind
            if after_tensor is not None:
                after_tensor(n)
        for f in pending:
            f.result()
        if only is not None:
            state.dirty = False
            return {"theta_norm": math.sqrt(sums["theta"]), "delta_norms": [math.sqrt(s) for s in sums["delta"]],
                    "bytes_read": sum(d.nread for d in deltas), "bytes_written": 0, "published": None}
        if uw is not None:
            uw.close()
            uw = None
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
    with np.errstate(over="ignore", invalid="ignore"):
        return fedmom_merge._momentum_alone_overflows(state.theta[name].copy(), state.momentum[name].copy(), lr, mu)


def replay(state, steps, threads=None, progress=None):
    """Apply recorded Steps to a checkpoint's state, each checked against its digest."""
    for s in steps:
        if s.round != state.round + 1:
            raise ReplayMismatch(f"the log's round {s.round} does not follow the state's round {state.round}")
        apply_round(state, s, threads=threads)
        if progress is not None:
            progress(s)
    return state
