"""darl_log.py - DARL's durable state on disk: the write-ahead log, the snapshot, and the
replay that rebuilds the lease table from them.

Runs on: the central VM, imported by darl_server.py (which appends and snapshots) and by
audit.py (which replays a state directory read-only, the servers running or not).
Python standard library only, with darl_table.py, darl_custody.py and durable.py; no HTTP, no
port, never torch. Files, under <state-dir>/darl/:

    wal.jsonl      one line per state change: `<JSON record><TAB><crc32 of the JSON, 8 hex>`.
                   The first line is a header {"v", "op": "header", "seq" (the snapshot the
                   log continues), "log" (its random id), "t", "digest", "space", "config"
                   (the leasing flags, darl_table.TableConfig)}; every other line is
                   {"v", "seq", "t", "op", "args", "out"}: a table call (OPS), its
                   time, and outcome_digest() of what it decided.
    snapshot.json  {"v", "seq", "log", "t", "digest", "space", "config", "table", "crc"}:
                   the table at change `seq`, naming the log ("log") that continues it.

    loaded = darl_log.load_state(state_dir)      # None for a fresh dir; LogError names the fix
    wal = darl_log.WriteAheadLog(path, header=...); wal.append(rec); wal.sync(seq)
    size = darl_log.write_snapshot(path, snap)   # atomic, with its checksum

Reading back (load_state): the snapshot, then every record after it, each replayed
through the same CustodyTable method at its logged time under the flags logged before it;
a record that decides otherwise than its `out`, or that does not follow the one before
(seq + 1), stops the read with a LogError naming the file, the byte offset and what to
do. Only the bytes after the last newline are a crash mid-write (a line is one write(),
its newline last, and a reply waits for its fsync): they are measured and left out. A
complete line that fails its checksum may have been acknowledged, so it is damage, never
dropped. The snapshot and the log's header carry the same log id: a snapshot without
its log, a log that continues a missing snapshot, or a log of another snapshot stops the
read; a log the snapshot does not name is accepted only as its predecessor (a crash
between writing a snapshot and restarting the log), its records after the snapshot
replayed. What the server does around these files (group commit, when it snapshots, a
full disk, exit 75 on a failed fsync) is darl_server.py's docstring.
"""
import dataclasses
import json
import os
import sys
import threading
import zlib

import darl_custody
import darl_table
import durable
import testhooks

WAL_VERSION = 2                # 2: checksummed lines, a config header, recorded outcomes, custody
# The table's methods a record may name (darl_table.LeaseTable's, darl_custody.CustodyTable's): replay
# calls them by name.
OPS = ("register", "acquire", "heartbeat", "commit", "release", "restore", "set_config", "fence",
       "confirm_fence", "take_custody", "commit_custody", "abort_custody", "abort_orphaned")
# fdatasync flushes the appended bytes and the new file size, skipping the
# mtime update; measured here 0.25 ms against 0.2-16 ms for fsync on a busy disk.
_datasync = getattr(os, "fdatasync", os.fsync)


class LogError(SystemExit):
    """The state directory cannot be read back: names the file, the byte offset and the fix."""


def _crc(payload):
    return format(zlib.crc32(payload), "08x")


def _line(rec):
    payload = json.dumps(rec, separators=(",", ":")).encode()
    return payload + b"\t" + _crc(payload).encode() + b"\n"


def _parse_line(raw, path, offset):
    """One log line -> its record. ValueError = damaged (checksum, JSON); LogError = a line
    that is intact but not ours to read (another version)."""
    payload, tab, crc = raw.rpartition(b"\t")
    if not tab:
        try:
            old = json.loads(raw)
        except ValueError:
            old = None
        if isinstance(old, dict) and old.get("v") == 1:
            raise LogError(f"{path}: written by an older darl_server.py (log v1, no checksums); finish that run "
                           "with the darl_server.py that wrote it, or start this one on a new --state-dir")
        raise ValueError("no checksum")
    if _crc(payload).encode() != crc:
        raise ValueError("checksum mismatch")
    rec = json.loads(payload)
    if not isinstance(rec, dict):
        raise ValueError("not a JSON object")
    if rec.get("v") != WAL_VERSION:
        raise LogError(f"{path}: byte {offset} has log version {rec.get('v')!r}; this darl_server reads "
                       f"v={WAL_VERSION}: run the darl_server.py that wrote it")
    return rec


def outcome_digest(reply=None, refused=None):
    """What a logged call decided, in 8 hex digits: replay must decide the same."""
    obj = {"refused": refused.status, "code": refused.extra.get("code")} if refused is not None else reply
    return _crc(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode())


@dataclasses.dataclass
class LogContents:
    header: dict | None
    records: list          # every record after the header, each with "_at" = its byte offset
    good_bytes: int        # the log up to the end of its last intact line
    torn_bytes: int        # bytes after it: a crash mid-write, never acknowledged


class WriteAheadLog:
    """Lines of `<JSON record><TAB><crc32 of the JSON, 8 hex>`, one per state change.

    The first line is a header: {"v", "op": "header", "seq" (the snapshot the log
    continues), "t", "digest", "space", "config"}; every other line is
    {"v", "seq", "t", "op", "args", "out"}, `out` being outcome_digest() of what the
    call decided. Group commit: a record is written under the coordinator's lock, then
    the caller waits in sync() until an fsync covers it; one fsync serves every record
    written before it, so concurrent clients share the disk flush.
    """

    def __init__(self, path, fsync=True, keep=None, header=None, lock_fd=None):
        self.path, self.fsync, self.lock_fd = path, fsync, lock_fd
        if keep is not None and os.path.exists(path) and os.path.getsize(path) > keep:
            with open(path, "r+b") as f:        # drop the torn tail before appending after it
                f.truncate(keep)
                f.flush()
                os.fsync(f.fileno())
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.sync_lock = threading.Lock()
        self.written = self.durable = 0
        self.size = os.fstat(self.fd).st_size          # bytes in the log: where the next record starts
        if header is not None and self.size == 0:
            self._write(_line(header))
            if fsync:
                os.fsync(self.fd)

    @staticmethod
    def read(path):
        """The header and records, changing nothing; None when there is no log file. Only
        the bytes after the last newline can be a torn write (a line is one write(), its
        newline last, and the reply waits for its fsync): they are left out and measured.
        A complete line that fails its checksum may have been acknowledged, so it is a
        LogError naming the file and the byte offset, never dropped."""
        if not os.path.exists(path):
            return None
        with open(path, "rb") as f:
            data = f.read()
        lines = data.split(b"\n")
        lines.pop()                             # after the last newline: b"" or an unfinished line
        records, offset = [], 0
        for i, raw in enumerate(lines):
            try:
                rec = _parse_line(raw, path, offset)
            except ValueError as e:
                raise LogError(
                    f"{path}: byte {offset} (line {i + 1}): {e} in a complete line, so this is damage, not a crash "
                    f"mid-write, and the change may have been acknowledged. Keep a copy of {os.path.dirname(path)}, "
                    f"then restore it from a backup, or cut the log there (truncate -s {offset} {path}) and "
                    "restart: the changes logged from that byte on are lost, and sites may hold leases DARL no "
                    "longer knows (restart them)") from None
            rec["_at"] = offset
            records.append(rec)
            offset += len(raw) + 1
        good_end = offset
        header = records.pop(0) if records and records[0].get("op") == "header" else None
        if records and header is None:
            raise LogError(f"{path}: byte 0: the log has no header line (the config and space it was written "
                           "under); it was not written by this darl_server.py: use a new --state-dir")
        return LogContents(header, records, good_end, len(data) - good_end)

    def append(self, record):
        line = _line(record)
        # darl.torn: half the line reaches the file, then the process is killed (a torn write);
        # the test that arms it always kills there, never lets the thread go on
        testhooks.fault_point("darl.torn", on_stop=lambda: os.write(self.fd, line[:len(line) // 2]))
        self._write(line)
        self.written = record["seq"]

    def _write(self, data):
        """All of `data` at the end of the log, or none of it: a full disk can take part of a
        line (a short write) before it refuses; the part is cut away again, so no damaged
        line ever sits before a good one (which a restart would refuse as damage)."""
        start = self.size
        try:
            done = os.write(self.fd, data)
            while done < len(data):
                done += os.write(self.fd, data[done:])     # raises ENOSPC once nothing fits
        except OSError:
            os.ftruncate(self.fd, start)
            raise
        self.size = start + len(data)

    def tail_from(self, offset):
        """The log's bytes from `offset` to its end (the records after a snapshot's cut)."""
        with open(self.path, "rb") as f:
            f.seek(offset)
            return f.read()

    def sync(self, seq):
        if not self.fsync:
            return
        with self.sync_lock:
            if self.durable >= seq:
                return
            target = self.written
            _datasync(self.fd)
            self.durable = target

    def restart(self, header, cut=None):
        """Everything up to header["seq"] is in a durable snapshot: a log of the header, then
        the records written after byte `cut` (those after the snapshot; none when `cut` is
        None), replaces this one atomically (a crash leaves the old log, whose records the
        snapshot already holds, or the new one). The caller holds the coordinator's lock,
        so nothing is appended meanwhile; the copied records are durable once it returns.
        A failure (a full disk) leaves the old log in place and no temp file. A failure
        after the rename (the directory's fsync: EIO) ends the process (exit 75): the new
        log is in place but may not survive a power cut, and appending to either file would
        acknowledge changes a restart might not find."""
        with self.sync_lock:
            data = _line(header) + (self.tail_from(cut) if cut is not None else b"")
            try:
                durable.write_bytes(self.path, data, self.fsync)
            except OSError as e:
                if not os.path.samestat(os.stat(self.path), os.fstat(self.fd)):     # renamed, not durable
                    sys.stderr.write(f"darl_server: the restarted log {self.path} may not be durable ({e}); "
                                     "exiting so a restart reads what is on disk\n")
                    os._exit(75)
                raise
            os.close(self.fd)
            self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
            self.size = len(data)
            self.durable = max(self.durable, self.written if cut is not None else header["seq"])

    def sync_or_exit(self, seq):
        """sync(), or stop the process: after a failed fsync (EIO) the change is in memory and
        maybe not on disk, so serving on would answer from a state a restart cannot rebuild."""
        try:
            self.sync(seq)
        except OSError as e:
            sys.stderr.write(f"darl_server: cannot flush the log to disk ({e}); exiting so a restart "
                             "replays what is durable\n")
            os._exit(75)

    def close(self):
        if self.fsync:
            os.fsync(self.fd)
        os.close(self.fd)
        if self.lock_fd is not None:        # the state dir is free for the next process
            os.close(self.lock_fd)
            self.lock_fd = None


def _snapshot_crc(snap):
    return _crc(json.dumps({k: v for k, v in snap.items() if k != "crc"}, sort_keys=True,
                           separators=(",", ":")).encode())


def _read_snapshot(path):
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            snap = json.load(f)
    except ValueError as e:
        raise LogError(f"{path}: unreadable snapshot ({e}); snapshots are written atomically, so this is disk "
                       "damage: restore the file from a backup")
    if not isinstance(snap, dict) or snap.get("v") != WAL_VERSION:
        got = snap.get("v") if isinstance(snap, dict) else None
        raise LogError(f"{path}: snapshot version {got!r}, this darl_server reads v={WAL_VERSION}: run the "
                       "darl_server.py that wrote it, or start on a new --state-dir")
    if snap.get("crc") != _snapshot_crc(snap):
        raise LogError(f"{path}: the snapshot's checksum does not match its contents (disk damage): restore the "
                       "file from a backup")
    return snap


@dataclasses.dataclass
class Loaded:
    """DARL's durable state as load_state() rebuilt it."""
    table: darl_custody.CustodyTable
    seq: int
    t: float               # the time of the last change: the table clock never goes below it
    digest: str
    space: dict
    torn_bytes: int
    good_bytes: int
    log_id: str            # the id the log's header must carry (the snapshot names it)
    stale_log: bool        # the log predates the snapshot (a crash between the two): restart it from the snapshot
    stale_cut: int | None = None  # in a stale log: the byte where the changes after the snapshot start
    snapshot_seq: int = 0  # the change the snapshot (or a fresh log) starts from: the log replays after it


def load_state(state_dir):
    """Rebuild the table from <state_dir>/darl/ (snapshot, then the log after it), each
    record under the config logged before it; changes no file. None for a fresh dir.
    Raises LogError naming the file, the byte offset and what to do.

    The snapshot names the log that continues it (a random id in both): a log with
    another id is the one a crash left between writing the snapshot and starting the
    log afresh: it must start inside the snapshot, and the changes it holds after the
    snapshot's (written while the snapshot was written) are replayed; a missing file, or
    a log that needs a snapshot which is not there, stops the start instead of serving
    an old table."""
    d = os.path.join(state_dir, "darl")
    wal_path, snap_path = os.path.join(d, "wal.jsonl"), os.path.join(d, "snapshot.json")
    snap = _read_snapshot(snap_path)
    log = WriteAheadLog.read(wal_path)
    _check_pair(snap, log, snap_path, wal_path)
    if snap is None and (log is None or log.header is None):
        return None
    base = snap or log.header
    try:
        config = darl_table.TableConfig.from_dict(base["config"])
        if snap:
            table = darl_custody.CustodyTable.from_dict(snap["table"], config)
        else:
            table = darl_custody.CustodyTable(base["space"]["num_blocks"], config)
        seq, t, digest, space, log_id = base["seq"], base["t"], base["digest"], base["space"], base["log"]
        snapshot_seq = seq
    except (KeyError, TypeError, ValueError) as e:
        where = snap_path if snap else f"{wal_path}: byte 0"
        raise LogError(f"{where}: cannot read it back ({type(e).__name__}: {e}); restore the state directory "
                       "from a backup, or start on a new --state-dir")
    stale = snap is not None and log.header.get("log") != log_id
    records, stale_cut = log.records, None
    if stale:
        records, stale_cut = _after_snapshot(log, seq, wal_path)
    for rec in records:        # every record follows the one before: seq + 1, no gap, no repeat
        seq, t = _replay(table, rec, seq, wal_path), rec["t"]
    return Loaded(table, seq, t, digest, space, log.torn_bytes, log.good_bytes, log_id, stale, stale_cut,
                  snapshot_seq)


def _check_pair(snap, log, snap_path, wal_path):
    """The snapshot and the log belong together, or the start stops naming what is missing."""
    restore = "restore the state directory from a backup (both files), or start on a new --state-dir"
    if snap is None:
        if log is not None and log.header is not None and log.header.get("seq", 0) > 0:
            raise LogError(f"{snap_path} is missing, and {wal_path} continues snapshot {log.header['seq']}: the "
                           f"changes up to it are lost, and starting from an empty table would lease committed "
                           f"blocks again; {restore}")
        return
    if log is None or log.header is None:
        raise LogError(f"{wal_path} is missing (or empty) beside {snap_path} (change {snap['seq']}): the changes "
                       f"logged after the snapshot, custody among them, would be lost silently; {restore}")
    if log.header.get("digest") != snap.get("digest"):
        raise LogError(f"{wal_path}: byte 0: the log belongs to block space {log.header.get('digest')}, the "
                       f"snapshot to {snap.get('digest')}; the two files are from different runs: {restore}")
    if log.header.get("log") == snap.get("log") and log.header.get("seq") != snap.get("seq"):
        raise LogError(f"{wal_path}: byte 0: the log continues change {log.header.get('seq')}, its snapshot "
                       f"holds changes up to {snap.get('seq')}; {restore}")


def _after_snapshot(log, snap_seq, path):
    """A log the snapshot does not name: only the previous log, starting inside the snapshot,
    every change following the one before. Returns its records after the snapshot and the
    byte where they start (the log's end when there are none)."""
    seq = log.header.get("seq", 0)
    if seq >= snap_seq:
        raise LogError(f"{path}: byte 0: the log (id {log.header.get('log')}, from change {seq}) is not the one "
                       f"the snapshot (change {snap_seq}) names; the changes after the snapshot are lost: restore "
                       "the state directory from a backup (both files)")
    for i, rec in enumerate(log.records):
        if rec.get("seq", 0) > snap_seq and seq == snap_seq:
            return log.records[i:], rec["_at"]
        if rec.get("seq") != seq + 1:
            raise LogError(f"{path}: byte {rec['_at']} (change {rec.get('seq')}) does not follow change {seq} "
                           f"(snapshot change {snap_seq}); this log is not the snapshot's predecessor: "
                           "restore the state directory from a backup (both files)")
        seq = rec["seq"]
    return [], log.good_bytes


def _replay(table, rec, seq, path):
    where = f"{path}: byte {rec['_at']} (change {rec.get('seq')}, {rec.get('op')!r})"
    if rec.get("seq") != seq + 1 or rec.get("op") not in OPS:
        raise LogError(f"{where} does not follow change {seq}; the log is not this state's continuation: "
                       "restore the state directory from a backup")
    try:
        reply = getattr(table, rec["op"])(**rec["args"], now=rec["t"])
        got = outcome_digest(reply)
    except darl_table.LeaseError as e:
        got = outcome_digest(refused=e)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise LogError(f"{where} cannot be replayed ({type(e).__name__}: {e}); the log was damaged or written by "
                       "another darl_server.py: restore the state directory from a backup")
    if got != rec.get("out"):
        raise LogError(f"{where} replays to another outcome than the one it recorded; this log was written by "
                       "another darl_server.py version: run that version, or start on a new --state-dir")
    return rec["seq"]



def write_snapshot(path, snap):
    """Write `snap` (a dict without "crc") atomically with its checksum; -> its size in bytes.
    A failure (a full disk) leaves the previous snapshot in place and raises."""
    snap["crc"] = _snapshot_crc(snap)
    text = json.dumps(snap, separators=(",", ":")) + "\n"   # json.dump would encode in Python, ~10x slower
    durable.write_text(path, text)
    return len(text)
