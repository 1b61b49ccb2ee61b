"""fedmom_checkpoint.py - the aggregator's outer state on disk: its checkpoint, the log of the
rounds since, and the rebuild from them.

Runs on: the central VM, imported by fedmom_outer.py and fedmom_store.py (the running aggregator) and
fedmom_server.py's `export` / `checkpoint` commands (a stopped one); standard library +
numpy + outer_state.py + merge_pool.py; never torch. Not started on its own. Tested in
tests/test_replay.py and tests/test_outer_budget.py.

state.json names a checkpoint and a "log": the outer_state.Step of every round since, its
delta paths relative to the state dir. The outer state of the current round is the
checkpoint with the logged Steps replayed on top (rebuild), the result checked against the
theta digest the last of them published. The segments are read straight into the arrays'
blocks (a store's: in memory, or file blocks on disk past --memory-gb; outer_budget.py), a
bounded piece at a time, never into private arrays first. fedmom_state.py's docstring has
the whole state dir and when each file is written and removed.

The checkpoint is a directory of segments, ckpt/<tensor>-<part>.safetensors: each holds
theta, momentum and residual (those kept) of one tensor, or of a run of its whole rows
(SEGMENT_BYTES of fp32 each at most), with its round in the metadata. A new checkpoint
replaces the segments one at a time (written aside, fsync'd, renamed over the old one), so
the disk holds one checkpoint and one segment more, never two checkpoints (3 M, not 6 M,
with momentum and residual). A checkpoint cut short (a crash, a full disk) leaves segments of
two rounds: the rebuild replays each segment from its own round, which it can because a
round is elementwise (outer_state.apply_round's `only`), and checks the digest once every
segment has caught up. state.json's record {"round", "dir", "digest"} names the round every
segment has reached at least; the log keeps every Step since it, so a segment of that round
still finds the rounds it needs.
A checkpoint of the older layout {"round", "theta", "momentum", "residual"} (whole files,
named in state.json) is still read; the next checkpoint writes segments and removes them.

    ckpt, log = read_record(json.load(open("state.json")), "state.json")
    outer = rebuild(state_dir, ckpt, log, store=store)       # raises on a mismatch or a bad file
    record = write_checkpoint(outer, state_dir, fsync=True)  # ckpt/*: every segment at outer.round
"""
import dataclasses
import json
import math
import os

import durable
import merge_pool
import outer_state
import tensorio

STATE_FORMAT = "pww-fedmom-state/3"   # 2: identity, epoch, custody owed, violations; 3: checkpoint + log
READS_FORMATS = ("pww-fedmom-state/2", STATE_FORMAT)   # a /2 state is a checkpoint of its round, no log
ARRAYS = ("theta", "momentum", "residual")
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
        return st["checkpoint"], [outer_state.Step.from_json(x) for x in st["log"]]
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
    lies inside one segment and a segment can be replayed alone (outer_state.apply_round's
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
    kept = {k: outer_state.alloc(shapes, store, k, False) if any(k in g.arrays for g in segs) else None
            for k in ARRAYS}
    for g in segs:
        with tensorio.TensorReader(os.path.join(state_dir, g.fn)) as r:
            for k, arrays in kept.items():
                if arrays is None:
                    continue
                if k in g.arrays:
                    outer_state.fill(arrays[g.tensor], r, k, g.lo)
                else:
                    merge_pool.zero(arrays[g.tensor], g.lo, g.hi)
    outer = outer_state.OuterState(shapes, kept["theta"], kept["momentum"], kept["residual"], ckpt["round"],
                                   digest="", store=store)
    return outer, segs


def rebuild(state_dir, ckpt, log, threads=None, pool=None, store=None, delta_bytes=None):
    """The outer state the checkpoint and the logged Steps make (outer_state.replay: each
    Step checked against its digest; a checkpoint of segments of two rounds replays each from
    its own and checks the digest once they have met), in `store`'s blocks when given
    (outer_budget.Store). Raises what went wrong (ReplayMismatch, a missing or damaged file,
    a NonFinite replay, an OSError of a file block)."""
    path = lambda fn: fn and os.path.join(state_dir, fn)
    steps = [resolved(s, state_dir) for s in log]
    if "dir" not in ckpt:
        outer = outer_state.OuterState.load(path(ckpt["theta"]), path(ckpt["momentum"]), path(ckpt["residual"]),
                                            ckpt["round"], store=store)
        return outer_state.replay(outer, steps, threads, pool=pool, delta_bytes=delta_bytes)
    outer, segs = _load_segments(state_dir, ckpt, store)
    rounds = {s.round for s in segs}
    behind = min(rounds)
    for s in steps:
        if s.round <= behind:
            continue
        if s.round != behind + 1:
            raise outer_state.ReplayMismatch(f"the log's round {s.round} does not follow round {behind}")
        todo = [g for g in segs if g.round < s.round]
        if len(todo) == len(segs) and len({frozenset(g.arrays) for g in segs}) == 1:
            outer.round = s.round - 1
            outer.momentum = outer.momentum if "momentum" in segs[0].arrays else None
            outer.residual = outer.residual if "residual" in segs[0].arrays else None
            outer_state.apply_round(outer, s, threads=threads, pool=pool, delta_bytes=delta_bytes)   # digest checked
        else:
            only = {}
            for g in todo:
                only.setdefault(g.tensor, []).append((g.lo, g.hi, "momentum" in g.arrays, "residual" in g.arrays))
            outer_state.apply_round(outer, dataclasses.replace(s, digest=None), threads=threads, only=only,
                                    pool=pool, delta_bytes=delta_bytes)
        for g in todo:
            g.round = s.round
            g.arrays = {"theta"} | ({"momentum"} if s.mu > 0 else set()) | ({"residual"} if s.codec else set())
        behind = s.round
    if len({g.round for g in segs}) != 1:
        raise outer_state.ReplayMismatch(f"the checkpoint's segments reach rounds {sorted({g.round for g in segs})}: "
                                         "the log does not bring them to one round")
    if len({frozenset(g.arrays) for g in segs}) != 1:
        raise outer_state.ReplayMismatch("the checkpoint's segments keep different arrays at one round")
    outer.round = segs[0].round
    outer.momentum = outer.momentum if "momentum" in segs[0].arrays else None
    outer.residual = outer.residual if "residual" in segs[0].arrays else None
    outer.digest = outer.theta_digest()
    want = log[-1].digest if log else ckpt.get("digest")
    if want is not None and want != outer.digest:
        raise outer_state.ReplayMismatch(f"the checkpoint and log rebuild round {outer.round} to theta digest "
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
                w.write_chunks(k, merge_pool.chunks(getattr(outer, k)[name], lo, hi))
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
    """The outer state (outer_state.OuterState) of a stopped aggregator's state dir: rebuild
    from what its state.json names (into `store`'s blocks when given: outer_budget.Store). Reads
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
