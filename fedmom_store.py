"""fedmom_store.py - what the aggregator keeps on disk besides its arrays: state.json and
rounds.jsonl (Ledger), and the spool of accepted deltas (Spool).

Runs on: the central VM, imported by fedmom_state.py (FedMomState builds one of each) and the
modules under it; Python standard library + durable.py + fedmom_checkpoint.py (the state
file's format and its record of the checkpoint) + fedmom_round.py; never torch, no HTTP.
fedmom_state.py's docstring has the whole state dir: what each file holds, when it is
written and removed.

Ledger: the protocol's books (fedmom_round.RoundTable) and the outer state's durable record
(the checkpoint, the Steps of the rounds logged since, the update of --down-wire) are ONE
state.json, guarded by one lock. change() is the only way the books change: under the
lock, and if the change is durable (RoundTable.changes moved) state.json says it before
the lock is released; a save that fails puts the books back as they were and raises, so
nothing is ever acknowledged that a restart would not find. rounds.jsonl is appended after
state.json (which holds the last record too, so a crash between them loses nothing).

Spool: spool/r<round>_<cluster>_<incarnation>.safetensors as it came ("_" is in no id, so
no two deltas share a name), and its acceptance record .json (fedmom_round.Pending, written
last: the acceptance itself). An upload is written to a part file first (.part-<hex>),
which is the acceptance's file once its checks passed, or removed.

Files no round needs are renamed aside under the lock (bury: a rename frees nothing, so it
costs nothing) and unlinked once it is released (remove: freeing a multi-GB file takes the
file system seconds, which heartbeats and GET /status would wait out).
"""
import contextlib
import dataclasses
import json
import os
import secrets
import threading
import time

import durable
import fedmom_checkpoint
import testhooks
from fedmom_checkpoint import STATE_FORMAT, write_json
from fedmom_round import Pending

KEEP_DELTAS_ENV = "PWW_TEST_KEEP_DELTAS_DIR"   # bench/chaos.py: a hard link of every accepted delta,
                                               # <custody id>.safetensors, for its replay of the merges


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


class Ledger:
    """state.json and rounds.jsonl, and the lock (`lock`, `cond`) that guards what they hold:
    `table` (fedmom_round.RoundTable), `ckpt`, `log`, `update` (fedmom_checkpoint's record of
    the outer state), `init_id` and `outer_step` (what this run was started from and with)."""

    def __init__(self, state_dir, table, fsync=True):
        self.dir, self.table, self.fsync = state_dir, table, fsync
        self.path = os.path.join(state_dir, "state.json")
        self.rounds_path = os.path.join(state_dir, "rounds.jsonl")
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        self.ckpt, self.log, self.update = None, [], None
        self.init_id, self.outer_step = None, (None, None)     # (--outer-lr, --outer-momentum) saved
        self.records_owed = []        # round records not yet in rounds.jsonl (its append failed)

    def read(self):
        """state.json -> its dict, the outer state's record taken from it (a file that is not
        this code's is a SystemExit saying what to do)."""
        try:
            with open(self.path) as f:
                st = json.load(f)
        except ValueError as e:
            raise SystemExit(f"{self.path} is not valid JSON ({e}); restore it from a backup")
        try:
            self.ckpt, self.log = fedmom_checkpoint.read_record(st, self.path)
        except ValueError as e:
            raise SystemExit(str(e)) from None
        self.update, self.init_id = st.get("update"), st["init"]
        return st

    def save(self):
        """state.json, atomically; the caller holds the lock (or is starting the state)."""
        lr, mu = self.outer_step
        write_json(self.path, {"format": STATE_FORMAT, **self.table.to_json(), "checkpoint": self.ckpt,
                               "log": [s.to_json() for s in self.log], "init": self.init_id,
                               "outer_lr": lr, "outer_momentum": mu, "update": self.update}, self.fsync)

    def mark(self):
        return self.table.mark(), self.ckpt, list(self.log), self.update

    def rewind(self, m):
        table, self.ckpt, self.log, self.update = m
        self.table.rewind(table)

    def save_or_rewind(self, mark):
        """save(); if it fails, everything as it was at `mark` (mark()) and the failure raised."""
        try:
            self.save()
        except BaseException:
            self.rewind(mark)
            raise

    @contextlib.contextmanager
    def change(self):
        """with ledger.change() as table: ... - under the lock; a durable change is saved when
        the block ends (also when it raises a refusal), or undone if the save fails; waiters
        (long-polls, the loops) are woken after a save."""
        with self.lock:
            mark, before = self.mark(), self.table.changes
            try:
                yield self.table
            finally:
                if self.table.changes != before:
                    self.save_or_rewind(mark)
                    self.cond.notify_all()

    def wake(self):
        """Wake the waiters on the lock's condition (the caller holds the lock)."""
        self.cond.notify_all()

    # ---- rounds.jsonl

    def read_records(self):
        """rounds.jsonl at a start: an unfinished last line (a crash mid-append) cut, the records
        handed to the books, and state.json's last record appended if the file lacks it."""
        torn = durable.cut_torn_line(self.rounds_path)
        if torn:
            log(f"fedmom: cut the unfinished last line of {self.rounds_path} ({torn} bytes: a crash mid-append; "
                "state.json, written first, puts that round's record back)")
        lost = self.table.restore_records(durable.read_jsonl(self.rounds_path))
        if lost:
            durable.append_json_line(self.rounds_path, lost, self.fsync, sort_keys=True)

    def append_record(self, rec=None):
        """rounds.jsonl after the round is durable (state.json holds it as last_record). A
        failed append (a full disk) is owed, appended before the next one."""
        if rec is not None:
            self.records_owed.append(rec)
        while self.records_owed:
            try:
                durable.append_json_line(self.rounds_path, self.records_owed[0], self.fsync, sort_keys=True)
            except OSError as e:
                log(f"fedmom: cannot append to {self.rounds_path} ({e}); {len(self.records_owed)} record(s) "
                    "kept for later (the rounds themselves are durable in state.json)")
                return
            self.records_owed.pop(0)


class Spool:
    """spool/: the open round's accepted deltas and their acceptance records; uploads' part files."""

    def __init__(self, spool_dir, fsync=True, keep_dir=None):
        self.dir, self.fsync = spool_dir, fsync
        self.keep_dir = keep_dir      # $PWW_TEST_KEEP_DELTAS_DIR: a hard link of every accepted delta
        os.makedirs(self.dir, exist_ok=True)

    def part(self):
        return os.path.join(self.dir, f".part-{secrets.token_hex(8)}")

    def receive(self, chunks):
        """An upload's body (an iterable of bytes) -> the part file it is in, fsync'd; nothing
        is left behind when the body breaks off or the disk is full (the error is raised)."""
        part = self.part()
        try:
            with open(part, "wb") as f:
                for chunk in chunks:
                    f.write(chunk)
                    testhooks.fault_point("fedmom.received")    # mid-upload: part of the body on disk
                f.flush()
                if self.fsync:
                    os.fsync(f.fileno())
        except BaseException:
            durable.unlink(part)
            raise
        return part

    def discard(self, part):
        if part and os.path.exists(part):
            os.unlink(part)

    def names(self, rnd, cluster, incarnation):
        """(delta file, acceptance record) of a delta of round `rnd`."""
        base = os.path.join(self.dir, f"r{rnd}_{cluster}_{incarnation}")
        return base + ".safetensors", base + ".json"

    def keep(self, part, p):
        """The part file becomes p's delta file, then p's acceptance record is written (the
        acceptance); a failure (a full disk) leaves neither and raises."""
        os.replace(part, p.path)
        if self.keep_dir:              # linked before the acceptance is written: no merged delta without it
            os.makedirs(self.keep_dir, exist_ok=True)
            try:
                os.link(p.path, os.path.join(self.keep_dir, p.delta_id + ".safetensors"))
            except FileExistsError:
                pass
        try:
            self.record(p)
        except BaseException:
            durable.unlink(p.path)
            raise

    def record(self, p):
        """p's acceptance record, as it stands now (its custody)."""
        write_json(p.meta_path, dataclasses.asdict(p), self.fsync)

    def accepted(self):
        """Every acceptance record -> [(file name, Pending or the error reading it)], by name."""
        out = []
        for fn in sorted(os.listdir(self.dir)):
            if not fn.endswith(".json"):
                continue
            try:
                with open(os.path.join(self.dir, fn)) as f:
                    out.append((fn, Pending.from_json(json.load(f))))
            except (ValueError, TypeError) as e:
                out.append((fn, e))
        return out

    def clean(self, live):
        """Remove every spool file but those in `live` (full paths): part files of uploads a
        crash cut, entries of other rounds, tombs of bury()."""
        for fn in os.listdir(self.dir):
            path = os.path.join(self.dir, fn)
            if path not in live:
                os.unlink(path)
