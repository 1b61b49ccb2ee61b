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
since (fedmom_state.FedMomState._rebuild).
"""
import dataclasses
import math
import os

import numpy as np

import fedmom_merge
import tensorio
import wire


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


class _ArrayInputs(fedmom_merge.Inputs):
    """fedmom_merge.Inputs with theta and momentum in memory: merge_tensor's reads of
    inputs 0 and 1 come from `arrays` (the tensor being merged), copied only when the
    merge's output is another buffer (the old theta kept for the update)."""

    def __init__(self, delta_paths, fresh):
        super().__init__(None, None, delta_paths)
        self.first, self.arrays = fresh, None

    def read(self, k, name, lo, hi, out=None, scratch=None):
        if k >= 2:
            return super().read(k, name, lo, hi, out=out, scratch=scratch)
        src = self.arrays[k][lo:hi]
        if out is None:
            return src, "F32"
        if out.__array_interface__["data"][0] != src.__array_interface__["data"][0]:
            np.copyto(out, src)
        return out, "F32"


def apply_round(state, step, out_update=None, metadata=None, fsync=True, threads=None, after_tensor=None):
    """Merge step's deltas into `state` in place (module docstring). out_update: where the
    round's update goes (step.codec given); None writes nothing (a replay). after_tensor(name):
    called after each tensor (the aggregator's fault point). Raises fedmom_merge.NonFinite
    (its cause is only a guess here: the old values are gone; see momentum_alone_overflows),
    or ReplayMismatch when step.digest is set and the result differs; either way state.dirty.
    -> {"theta_norm" (of the old theta), "delta_norms", "bytes_read", "bytes_written",
        "published": {"base_digest", "digest", "update_bytes", "residual_norm"} or None}."""
    threads = wire.resolve_threads(threads)
    codec, mu, shapes = step.codec, step.mu, state.shapes
    fresh = step.fresh or state.momentum is None or mu == 0
    state.dirty = True
    inputs, uw = None, None
    try:
        inputs = _ArrayInputs([p for p, _ in step.deltas], fresh)
        _check_deltas(inputs, shapes)
        if mu > 0 and state.momentum is None:
            state.momentum = {n: np.empty(math.prod(sh), np.float32) for n, sh in shapes.items()}
        if mu == 0:
            state.momentum = None
        if codec is not None and out_update is not None:
            meta = {k: str(v) for k, v in (metadata or {}).items()}
            uw = wire.WireWriter(out_update, list(shapes.items()), codec, meta, fsync=fsync, threads=threads)
        owed, new_residual = state.residual, ({} if codec is not None else None)
        largest = max((math.prod(sh) for sh in shapes.values()), default=1)
        merged_buf = np.empty(largest, np.float32) if codec is not None else None
        work = [np.empty(min(fedmom_merge.CHUNK, largest), np.float32) for _ in range(2)]
        weights = [w for _, w in step.deltas]
        sums = {"theta": 0.0, "delta": [0.0] * len(weights)}
        base_digest, digest, rsq = state.digest, wire.Digest(), 0.0
        for n, sh in shapes.items():
            T = state.theta[n]
            M = state.momentum[n] if state.momentum is not None else None
            merged = merged_buf[:T.size] if codec is not None else T
            inputs.arrays = (T, M)
            inputs.prefetch(n)
            fedmom_merge.merge_tensor(inputs, n, merged, M, weights, step.lr, mu, sums, work, threads)
            if codec is not None:
                x = merged                                   # Publisher.write, in place:
                np.subtract(x, T, out=x)                     # x = (merged - prev) + residual
                if owed is not None:
                    x += owed[n]
                if uw is not None:
                    sent = uw.write(n, x.reshape(sh))
                else:
                    sent = codec.encode(x.reshape(sh), threads)[1]
                wire.add_into(T, np.asarray(sent, np.float32).reshape(-1), threads)   # theta = prev + sent
                if not np.isfinite(T).all():
                    raise fedmom_merge.NonFinite("theta", n, "deltas")
                x -= sent.reshape(-1)
                rsq += fedmom_merge.sq_norm(x)
                r = owed[n] if owed is not None else np.empty(T.size, np.float32)
                np.copyto(r, x)
                new_residual[n] = r
            digest.add(n, T.reshape(sh))
            if after_tensor is not None:
                after_tensor(n)
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
                "bytes_read": inputs.nread, "bytes_written": published and published["update_bytes"] or 0,
                "published": published}
    finally:
        if uw is not None:
            uw.abort()
        if inputs is not None:
            inputs.close()


def _check_deltas(inputs, shapes):
    """Each delta holds every tensor of theta with its element count (fedmom_merge's check;
    the aggregator checked more at acceptance)."""
    for r in inputs.deltas:
        for n, sh in shapes.items():
            dtype, shape = r.specs.get(n, (None, None))
            if dtype not in fedmom_merge.DELTA_DTYPES or math.prod(shape) != math.prod(sh):
                raise ValueError(f"{r.path}: tensor {n!r} is {dtype} {shape}; the merge needs "
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
