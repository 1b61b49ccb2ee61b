"""fedmom_checkpoint.py - the aggregator's outer state on disk: its checkpoint, the log of the
rounds since, and the rebuild from them.

Runs on: the central VM, imported by fedmom_state.py (the running aggregator) and
fedmom_server.py's `export` / `checkpoint` commands (a stopped one); standard library +
numpy + outer_state.py; never torch. Not started on its own. Tested in tests/test_replay.py.

state.json names a checkpoint {"round", "theta", "momentum", "residual"} (file names in the
state dir; momentum/residual None when none is kept) and a "log": the outer_state.Step of
every round since, its delta paths relative to the state dir. The outer state of the
current round is the checkpoint's files with the logged Steps replayed on top, each
checked against the theta digest it published (rebuild). fedmom_state.py's docstring has
the whole state dir and when each file is written and removed.

    ckpt, log = read_record(json.load(open("state.json")), "state.json")
    outer = rebuild(state_dir, ckpt, log)                    # raises on a mismatch or a bad file
    files = write_checkpoint(outer, state_dir, fsync=True)   # theta-<r>, momentum-<r>, residual-<r>
"""
import dataclasses
import json
import os

import durable
import outer_state

STATE_FORMAT = "pww-fedmom-state/3"   # 2: identity, epoch, custody owed, violations; 3: checkpoint + log
READS_FORMATS = ("pww-fedmom-state/2", STATE_FORMAT)   # a /2 state is a checkpoint of its round, no log
ARRAYS = ("theta", "momentum", "residual")


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


def rebuild(state_dir, ckpt, log, threads=None):
    """The outer state the checkpoint and the logged Steps make (outer_state.replay: each
    Step checked against its digest). Raises what went wrong (ReplayMismatch, a missing or
    damaged file, a NonFinite replay)."""
    path = lambda fn: fn and os.path.join(state_dir, fn)
    outer = outer_state.OuterState.load(path(ckpt["theta"]), path(ckpt["momentum"]), path(ckpt["residual"]),
                                        ckpt["round"])
    return outer_state.replay(outer, [resolved(s, state_dir) for s in log], threads)


def write_checkpoint(outer, state_dir, fsync=True, after_file=None):
    """theta, momentum and residual of outer's round written whole -> the checkpoint's
    {"theta", "momentum", "residual"} file names (None: not kept). after_file(): called after
    each file (the aggregator's fault point)."""
    files = {}
    for which in ARRAYS:
        files[which] = getattr(outer, which) is not None and f"{which}-{outer.round}.safetensors" or None
        if files[which]:
            outer.write(which, os.path.join(state_dir, files[which]), fsync=fsync)
            if after_file is not None:
                after_file()
    return files


def _read_state(sd):
    try:
        with open(os.path.join(sd, "state.json")) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{sd}: no readable state.json ({e})") from None


def load_outer(state_dir, threads=None):
    """The outer state (outer_state.OuterState) of a stopped aggregator's state dir: rebuild
    from what its state.json names. Reads only (a running aggregator removes logged files as
    it checkpoints: download its theta with GET /theta). Raises ValueError naming the problem."""
    sd = os.path.abspath(state_dir)
    st = _read_state(sd)
    ckpt, log = read_record(st, f"{sd}/state.json")
    try:
        outer = rebuild(sd, ckpt, log, threads)
    except Exception as e:
        raise ValueError(f"{sd}: the outer state of round {st['round']} cannot be rebuilt: "
                         f"{type(e).__name__}: {e}") from None
    if outer.round != st["round"]:
        raise ValueError(f"{sd}: state.json is at round {st['round']}, its checkpoint and log reach {outer.round}")
    return outer


def checkpoint_offline(state_dir, threads=None, fsync=True):
    """Make the current round of a stopped aggregator's state dir its checkpoint (load_outer,
    write_checkpoint, state.json's log emptied, the files it no longer needs removed): a
    restart then replays nothing. -> the round."""
    sd = os.path.abspath(state_dir)
    outer = load_outer(sd, threads)
    st = _read_state(sd)
    old, logged = read_record(st, f"{sd}/state.json")
    files = write_checkpoint(outer, sd, fsync)
    st.update(format=STATE_FORMAT, checkpoint={"round": outer.round, **files}, log=[])
    for k in ("theta", "momentum"):
        st.pop(k, None)
    if st.get("update"):
        st["update"].pop("residual", None)
    write_json(os.path.join(sd, "state.json"), st, fsync)
    for fn in [old[k] for k in ARRAYS if old[k] and old[k] not in files.values()] + \
            [f for s in logged for f in step_files(s)]:
        durable.unlink(os.path.join(sd, fn))
    return outer.round
