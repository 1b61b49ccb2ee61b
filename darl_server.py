"""darl_server.py - DARL, the dataset-leasing coordinator (central VM, :29510).

Sites lease contiguous runs of block positions under a TTL and keep them alive with
heartbeats; the aggregator takes the leases of every delta it accepts into custody and
commits them once that delta is inside a durable round. So the corpus is trained on exactly
once though sites start late, run at different speeds and die at walltime. The table
(darl_table.CustodyTable) does no I/O: this server keeps it behind one lock, logs every
change before it answers, snapshots it and serves it. Standard library only; never torch.

Run it where it outlives every job that leases from it (the central VM or a login node):
    python darl_server.py --num-samples 1000000 --block-size 10000 --seed 0 --state-dir runs/central
    python darl_server.py --manifest /tmp/manifest.json --block-size 64 --seed 0
        # N = the manifest's training windows; the held-out tail is never leased
    python darl_server.py status --url https://127.0.0.1:29510 --ca-file runs/central/tls/ca.pem
        # exit 1 while anything is wrong
    python darl_server.py abort-custody --aggregator ID --reason "state dir lost" [--yes --expect LISTING]
It binds 127.0.0.1:29510; a non-loopback --host needs a token (--token-file or $PWW_TOKEN),
TLS (--tls-cert, --tls-key) and --aggregator-token-file, or --insecure. Every endpoint but
/health needs `Authorization: Bearer <token>`; with --aggregator-token-file (central.sh gives
it) /fence and /custody* take the aggregator's own token instead, so the token every site
holds cannot fence the aggregator, abort its custody or retire it.

Its parts, in reading order: the state on disk (WriteAheadLog, the snapshot, load_state: the
replay, which audit.py also runs read-only); the Coordinator (the table behind its lock,
TableClock, group commit, snapshots, a full disk); the HTTP routes; the status and
abort-custody commands; serve().

State, in <state-dir>/darl/:
    wal.jsonl      one line per change: `<JSON record><TAB><crc32 of the JSON, 8 hex>`; a header
                   {"v", "op": "header", "seq", "log", "t", "digest", "space", "config"}, then
                   {"v", "seq", "t", "op", "args", "out"}: a table call, its time, what it decided
    snapshot.json  {"v", "seq", "log", "t", "digest", "space", "config", "table", "crc"}: the
                   table at change `seq`, naming the log ("log") that continues it
    lock           flock'd while the server runs: a second one on the dir exits naming its pid
A restart loads the snapshot and replays the log; a torn last line is dropped and said, and
anything else that does not read back stops the start, naming the file, the byte offset and
the fix. Leasing flags other than the recorded ones stop it too, unless --accept-config-change.

The protocol: FEDERATION_GUIDE.md, "Leases (DARL)"; every endpoint: its "Endpoints".
"""
import dataclasses
import errno
import json
import os
import secrets
import signal
import sys
import threading
import time
import urllib.parse
import zlib

import block_space
import darl_table
import durable
import httpc
import httpd
import testhooks

DEFAULT_PORT = 29510
DISK_MARGIN = 64 << 10         # a change is refused (507) while the log's disk has less free


# ==== the state on disk: the write-ahead log, the snapshot, the replay ============================
# load_state reads the snapshot, then replays every later record through the same CustodyTable
# method at its logged time under the flags logged before it; a record that decides otherwise
# than its `out`, or does not follow the one before (seq + 1), is a LogError naming the file,
# the byte offset and what to do. A line is one write(), its newline last, and a reply waits
# for its fsync: only the bytes after the last newline are a crash mid-write (measured, left
# out); a complete line that fails its checksum may have been acknowledged, so it is damage.
# The snapshot and the log's header carry the same log id: a snapshot without its log, or a log
# of a missing or another snapshot, stops the read; a log the snapshot does not name is taken
# only as its predecessor (a crash between writing a snapshot and restarting the log), its
# records after the snapshot replayed. audit.py reads a state dir here, read-only.

WAL_VERSION = 2                # 2: checksummed lines, a config header, recorded outcomes, custody
# The table's methods a record may name (darl_table.LeaseTable's, darl_table.CustodyTable's): replay
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
    table: darl_table.CustodyTable
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
            table = darl_table.CustodyTable.from_dict(snap["table"], config)
        else:
            table = darl_table.CustodyTable(base["space"]["num_blocks"], config)
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


# ------------------------------------------------------------------ the coordinator
# Every change is appended and fsync'd before its reply (group commit: one fdatasync covers every
# record written before it); a failed fsync ends the process (exit 75) before it answers.
# A snapshot is due after --snapshot-every changes once the log is as large as the last snapshot
# (and at SIGTERM): the table is copied under the lock after verify(), written outside it, and the
# log restarts with a new header and the records written meanwhile; a failed one changes nothing
# (`snapshot_error` on /status, retried later). A full disk: a change is refused with 507 while
# less than DISK_MARGIN is free; an append that still fails is cut from the log and the table is
# rebuilt from the disk. Leases alive at a crash get --restore-grace more seconds.
# Test hooks (testhooks.py): darl.append (decided, not written), darl.torn (half a line written),
# darl.synced (durable, not answered); the wall clock is read at start through testhooks.wall_time.

class ConfigChanged(SystemExit):
    """The flags that decide leases differ from the ones the state was written with."""


class TableClock:
    """DARL's time: wall-clock seconds at the start, then only what the monotonic clock
    adds, so a step of the wall clock (NTP, an operator, a VM resume) neither expires
    nor extends a lease. It starts at the wall clock or the last logged change,
    whichever is later, so it never runs backwards across restarts; a forward step
    while DARL was down is absorbed by --restore-grace (leases alive at the crash get
    that long from the restart)."""

    def __init__(self, floor=0.0, wall=testhooks.wall_time, monotonic=time.monotonic):
        self.monotonic = monotonic
        self.base, self.mono0 = max(wall(), floor), monotonic()

    def __call__(self):
        return self.base + (self.monotonic() - self.mono0)


class Coordinator:
    """The table (darl_table.CustodyTable) behind one lock, with every change logged before the reply.

    call(op, args) applies a table method at the current time, appends
    {op, args, t, out} to the log and waits for the fsync; replaying the same
    records at the same times under the same logged config rebuilds the same
    table, because the table is a pure function of its calls, their times and
    its config, and `out` proves it record by record.
    """
    OPS = OPS

    def __init__(self, space, config=None, state_dir=None, snapshot_every=1000, restore_grace=120.0,
                 fsync=True, clock=None, wall=testhooks.wall_time, monotonic=time.monotonic,
                 accept_config_change=False, disk_margin=DISK_MARGIN):
        self.space, self.digest = space, space.digest()
        self.config = (config or darl_table.TableConfig()).validate()
        self.snapshot_every, self.lock = snapshot_every, threading.Lock()
        self.invariant_error, self.torn_bytes = None, 0
        self.table, self.seq = darl_table.CustodyTable(space.num_blocks, self.config), 0
        self.dir = self.wal = None
        self.log_id = secrets.token_hex(8)
        self.state_dir = state_dir
        # snapshots: the change and log size of the last one, its bytes, whether one is being
        # written (outside the lock), and what went wrong with the last attempt (on /status)
        self.snap_seq, self.snap_bytes, self.snap_busy, self.snapshot_error = 0, 0, False, None
        self.snap_done = threading.Condition(self.lock)
        self.disk_margin = disk_margin
        loaded = None
        if state_dir:
            self.dir = os.path.join(state_dir, "darl")
            lock_fd = durable.lock_state_dir(self.dir, "darl_server")   # before reading anything
            try:
                loaded = self._open(state_dir, fsync, lock_fd, accept_config_change, wall, monotonic, clock)
            except BaseException:
                os.close(lock_fd)
                raise
        else:
            self.clock = clock or TableClock(0.0, wall, monotonic)
            self.table.clock = self.clock
        if loaded is not None and self.table.leases:
            self.call("restore", {"grace": restore_grace})

    def _open(self, state_dir, fsync, lock_fd, accept_config_change, wall, monotonic, clock):
        """Load <state_dir>/darl/ (under the lock), check its flags, open the log for appending."""
        last_t, changes = 0.0, []
        for name in os.listdir(self.dir):              # a snapshot or log replacement killed mid-write
            if durable.is_tmp(name):
                durable.unlink(os.path.join(self.dir, name))
        loaded = load_state(state_dir)
        if loaded is not None:
            if loaded.digest != self.digest:
                raise LogError(f"{self.dir} belongs to another block space (digest {loaded.digest}, space "
                               f"{loaded.space}); this server has {self.space.describe()}. Use the same "
                               "--num-samples/--manifest, --block-size and --seed, or a new --state-dir")
            self.table, self.seq, last_t, self.torn_bytes = loaded.table, loaded.seq, loaded.t, loaded.torn_bytes
            self.log_id = loaded.log_id
            changes = self.table.config.changes(self.config)
            if changes and not accept_config_change:
                raise ConfigChanged(config_refusal(self.dir, changes))
        self.clock = clock or TableClock(last_t, wall, monotonic)
        self.table.clock = self.clock
        if self.torn_bytes:
            sys.stderr.write(f"darl_server: dropping the torn tail of {self.dir}/wal.jsonl "
                             f"({self.torn_bytes} bytes after the last newline: a crash mid-write, never "
                             "acknowledged)\n")
        self.wal = WriteAheadLog(os.path.join(self.dir, "wal.jsonl"), fsync,
                                          keep=loaded.good_bytes if loaded else 0,
                                          header=self._header(), lock_fd=lock_fd)
        self.wal.written = self.wal.durable = self.seq
        if loaded is not None and loaded.stale_log:
            # the crash came between the snapshot and the log's restart: the new log starts at the
            # snapshot and carries over the records the old one holds after it (written meanwhile)
            self.wal.restart(self._header(seq=loaded.snapshot_seq), loaded.stale_cut)
        # the log since the last snapshot counts towards the next one, across restarts too
        self.snap_seq = loaded.snapshot_seq if loaded else self.seq
        snap_path = os.path.join(self.dir, "snapshot.json")
        self.snap_bytes = os.path.getsize(snap_path) if os.path.exists(snap_path) else 0
        if changes:
            self.call("set_config", {"config": self.config.to_dict()})
            sys.stderr.write("darl_server: --accept-config-change: logged " + ", ".join(
                f"{flag} {old} -> {new}" for flag, old, new in changes) + "; it applies from now on\n")
        return loaded

    def _header(self, seq=None, log_id=None):
        """The log's first line: the change it continues (default: this one) and its log id."""
        return {"v": WAL_VERSION, "op": "header", "seq": self.seq if seq is None else seq,
                "log": log_id or self.log_id, "t": self.clock(),
                "digest": self.digest, "space": self.space.describe(), "config": self.table.config.to_dict()}

    def call(self, op, args):
        """Apply one change; return its reply once it is durable. LeaseError = refused, nothing
        logged, except a counted refusal (a commit that cannot stand), which is logged too."""
        if op == "register" and args.get("digest") != self.digest:
            raise darl_table.LeaseError(409, f"block-space digest mismatch: client {args.get('digest')!r}, "
                                             f"coordinator {self.digest!r} ({self.space.describe()}); both sides "
                                             "must use the same --num-samples/--manifest, --block-size and --seed",
                                        digest=self.digest, space=self.space.describe())
        refused, capture = None, None
        with self.lock:
            if self.wal is not None:
                self._check_space()
            now = self.clock()
            table_args = {k: v for k, v in args.items() if k != "digest"}
            try:
                reply = getattr(self.table, op)(**table_args, now=now)
            except darl_table.LeaseError as e:
                if not e.counted:
                    raise
                refused, reply = e, None
            self.seq += 1
            if self.wal is not None:
                rec = {"v": WAL_VERSION, "seq": self.seq, "t": now, "op": op, "args": table_args,
                       "out": outcome_digest(reply, refused)}
                testhooks.fault_point("darl.append")       # decided, nothing written: as if it never happened
                try:
                    self.wal.append(rec)
                except OSError as e:
                    self._undo(op, e)
                    raise                   # a full disk: httpd answers 507 naming it
                capture = self._capture() if self._snapshot_due() else None
            seq = self.seq
        if self.wal is not None:
            self.wal.sync_or_exit(seq)
            testhooks.fault_point("darl.synced")           # durable, the reply not sent: the client retries
            if capture is not None:
                self._write_snapshot(capture)          # outside the lock: the other calls go on
        if refused is not None:
            raise refused
        if op == "register":        # what a site needs to build the same BlockSpace and check it
            reply = {**reply, "digest": self.digest, "space": self.space.describe()}
        elif op == "fence":         # the aggregator records which DARL holds its custody
            reply = {**reply, "digest": self.digest}
        return reply

    def _undo(self, op, err):
        """The log refused a record (a full disk) after the table applied it: the record is
        cut from the log (WriteAheadLog._write) and the table rebuilt from what the disk
        holds, so memory never runs ahead of the log. Under the lock. If even that fails,
        exit: a restart replays the disk."""
        try:
            loaded = load_state(self.state_dir)
            self.table, self.seq = loaded.table, loaded.seq
            self.table.clock = self.clock
        except BaseException as e:
            sys.stderr.write(f"darl_server: cannot append to the log ({err}) nor rebuild the table from it "
                             f"({e}); exiting so a restart replays a consistent state\n")
            os._exit(75)
        sys.stderr.write(f"darl_server: {op} refused, the log cannot grow ({err}); nothing of it was kept\n")

    def _check_space(self):
        """Refuse a change before it is applied while the log's disk has less than
        disk_margin free: the cheap answer to a full disk (_undo is the one that holds
        whatever the margin: a rebuild from the log, which costs a replay)."""
        if not self.disk_margin:
            return
        st = os.statvfs(self.dir)
        free = (st.f_bfree if os.geteuid() == 0 else st.f_bavail) * st.f_frsize   # root may use the reserve
        if free < self.disk_margin:
            raise OSError(errno.ENOSPC, f"{free} bytes free, the log needs {self.disk_margin}")

    def _snapshot_due(self):
        """--snapshot-every changes since the last snapshot, and a log at least as large as that
        snapshot: writing snapshots costs no more than the log itself, however large the
        table grows (closed leases are kept), and a restart replays at most that much log."""
        return (self.wal is not None and not self.snap_busy and self.seq - self.snap_seq >= self.snapshot_every
                and self.wal.size >= self.snap_bytes)

    def _capture(self):
        """The table as plain values at this change, and where the log stands. Under the lock;
        the rest (JSON, checksum, the write) happens outside it, in _write_snapshot."""
        self.snap_busy = True
        try:
            self.table.verify()
        except darl_table.InvariantError as e:
            self.invariant_error = str(e)
            sys.stderr.write(f"darl_server: INVARIANT VIOLATED, snapshot skipped: {e}\n")
            self.snap_busy, self.snap_seq = False, self.seq
            return None
        header = self._header(log_id=secrets.token_hex(8))     # the log that continues this snapshot
        snap = {"v": WAL_VERSION, "seq": self.seq, "log": header["log"], "t": header["t"],
                "digest": self.digest,
                "space": self.space.describe(), "config": header["config"], "table": self.table.to_dict()}
        return snap, header, self.wal.size

    def _write_snapshot(self, capture):
        """Write a captured snapshot atomically, then start the log afresh from it (the
        records written since the capture are carried over). A failure (a full disk) changes
        nothing: the log still holds every change, the next attempt comes --snapshot-every
        changes later, and /status shows snapshot_error."""
        if capture is None:
            return False
        snap, header, cut = capture
        try:
            size = write_snapshot(os.path.join(self.dir, "snapshot.json"), snap)
            with self.lock:
                self.wal.restart(header, cut)
                self.log_id = header["log"]
                self.snap_seq, self.snap_bytes, self.snapshot_error = snap["seq"], size, None
            return True
        except OSError as e:
            with self.lock:
                self.snap_seq, self.snapshot_error = snap["seq"], f"{type(e).__name__}: {e}"
            sys.stderr.write(f"darl_server: snapshot at change {snap['seq']} failed ({e}); the log keeps every "
                             "change, retrying later\n")
            return False
        finally:
            with self.lock:
                self.snap_busy = False
                self.snap_done.notify_all()

    def snapshot(self):
        """Verify the books, write them atomically, then start the log afresh (after the one
        being written, if any). Not under the lock."""
        with self.lock:
            while self.snap_busy:
                self.snap_done.wait()
            capture = self._capture()
        return self._write_snapshot(capture)

    def status(self):
        with self.lock:
            try:
                out = self.table.status(self.clock())
            except darl_table.InvariantError as e:
                self.invariant_error = str(e)
                out = {"violations": dict(self.table.counters)}
            return {**out, "digest": self.digest, "space": self.space.describe(), "seq": self.seq,
                    "config": self.table.config.to_dict(), "torn_bytes_dropped": self.torn_bytes,
                    "invariant_error": self.invariant_error, "snapshot_error": self.snapshot_error}

    def custody(self, aggregator=None, state=None):
        with self.lock:
            return {"custody": self.table.custody_records(aggregator, state),
                    "aggregators": self.table.status(self.clock())["aggregators"]}

    def close(self):
        if self.wal is None:
            return
        self.snapshot()
        with self.lock:
            if self.wal is not None:
                self.wal.close()
                self.wal = None


def config_refusal(state_dir, changes):
    """The one message for a restart under other decision flags: each flag, both values, both ways out."""
    diff = "; ".join(f"{flag} was {old}, this start has {new}" for flag, old, new in changes)
    keep = " ".join(f"{flag} {old}" for flag, old, _ in changes)
    return (f"darl_server: {state_dir} was written under other leasing flags ({diff}). Its log replays and goes "
            f"on under the flags it recorded, so a silent change would re-decide what is already decided. Restart "
            f"with {keep}, or add --accept-config-change to log the change: it applies from now on, never to what "
            "is already logged")


# ------------------------------------------------------------------ HTTP

def _fields(body, spec):
    """Pick the named fields with httpd.field's type check: {name: (kind, required)}."""
    return {name: httpd.field(body, name, kind, required) for name, (kind, required) in spec.items()
            if required or body.get(name) is not None}


ID = {"cluster": (str, True), "incarnation": (str, True)}
AGG = {"aggregator": (str, True), "epoch": (int, True)}
NUM = (int, float)
REQUESTS = {            # op -> (path, {field: (type, required)})
    "register": ("/register", {**ID, "digest": (str, True)}),
    "acquire": ("/acquire", {**ID, "blocks": (int, False), "ttl": (NUM, False), "request_id": (str, False)}),
    "heartbeat": ("/heartbeat", {**ID, "leases": (list, False), "ttl": (NUM, False), "throughput": (NUM, False)}),
    "commit": ("/commit", {**ID, "lease": (int, True), "end": (int, False)}),
    "release": ("/release", {**ID, "leases": (list, False), "leave": (bool, False)}),
    "fence": ("/fence", {"aggregator": (str, True), "last_epoch": (int, True), "claim": (str, True),
                         "last_holder": (str, False), "round": (int, False)}),
    "confirm_fence": ("/fence/confirm", {"aggregator": (str, True), "epoch": (int, True), "claim": (str, True),
                                         "holder": (str, True)}),
    "take_custody": ("/custody", {**AGG, "delta": (str, True), **ID, "leases": (list, True)}),
    "commit_custody": ("/custody/commit", {**AGG, "delta": (str, True), "round": (int, False)}),
    "abort_custody": ("/custody/abort", {**AGG, "delta": (str, True), "why": (str, False)}),
    "abort_orphaned": ("/custody/abort_orphaned", {"aggregator": (str, True), "reason": (str, True),
                                                   "expect": (list, False)}),
}


CUSTODY_PATHS = ("/fence", "/fence/confirm", "/custody", "/custody/commit", "/custody/abort", "/custody/abort_orphaned")


def make_routes(coord):
    def rpc(op, path, spec):
        def route(req):
            args = _fields(req.json(), spec)
            if path not in CUSTODY_PATHS:          # a site's own request: its credential must be that cluster's
                req.acts_as(args["cluster"])
            try:
                return coord.call(op, args)
            except darl_table.LeaseError as e:
                raise httpd.HTTPError(e.status, e.reason, **e.extra)
        return route

    routes = {("POST", path): rpc(op, path, spec) for op, (path, spec) in REQUESTS.items()}
    routes[("GET", "/status")] = lambda req: coord.status()
    routes[("GET", "/custody")] = lambda req: coord.custody(req.query.get("aggregator"), req.query.get("state"))
    routes[("GET", "/health")] = lambda req: {"ok": True, "service": "darl", "digest": coord.digest,
                                              "num_blocks": coord.space.num_blocks}
    return routes


# ------------------------------------------------------------------ status and operator CLIs

def format_status(st):
    lines = []
    n = st.get("num_blocks", 0)
    pct = 100.0 * st.get("committed", 0) / n if n else 0.0
    lines.append(f"space: {st['space']}  digest {st['digest']}")
    lines.append(f"progress: {st.get('committed', 0)}/{n} blocks committed ({pct:.1f}%), "
                 f"{st.get('leased', 0)} leased, {st.get('in_custody', 0)} in custody, "
                 f"{st.get('free', 0)} unassigned" + ("  -- EPOCH DONE" if st.get("done") else ""))
    lines.append(f"{'cluster':<16} {'live':>5} {'committed':>10} {'leased':>8} {'lost':>6} {'blocks/s':>9}")
    for c in st.get("clusters", []):
        bps = "-" if c["blocks_per_s"] is None else f"{c['blocks_per_s']:.3f}"
        lines.append(f"{c['cluster']:<16} {'yes' if c['live'] else 'no':>5} {c['committed']:>10} "
                     f"{c['leased']:>8} {c['lost']:>6} {bps:>9}")
    cu = st.get("custody") or {}
    lines.append(f"custody: {cu.get('held', 0)} held, {cu.get('committed', 0)} committed, "
                 f"{cu.get('aborted', 0)} aborted")
    for a in st.get("aggregators", []):
        lines.append(f"  aggregator {a['aggregator']} epoch {a['epoch']}: {a['held']} held ({a['held_blocks']} "
                     "blocks)" + (f"  RETIRED by the operator: {a['retired']}" if a.get("retired") else ""))
    if st.get("quarantined"):
        lines.append(f"!!! {st['quarantined']} BLOCKS QUARANTINED: dropped from this epoch after repeated "
                     f"failures; position runs {st['quarantined_runs']}")
    loud = darl_table.violations_line(st.get("violations"))
    if loud:
        lines.append(loud)
    if st.get("invariant_error"):
        lines.append(f"!!! INVARIANT VIOLATED: {st['invariant_error']}")
    if st.get("snapshot_error"):
        lines.append(f"!!! SNAPSHOT FAILED: {st['snapshot_error']}; the log keeps every change and grows until a "
                     "retry (every --snapshot-every changes) succeeds: free space on the state dir")
    return "\n".join(lines)


def _cli_parser(doc):
    p = httpd.base_parser(doc)
    p.prog = " ".join(doc.split()[:2])               # "darl_server.py status", not "darl_server.py"
    p.add_argument("--url", default=f"http://127.0.0.1:{DEFAULT_PORT}",
                   help=f"coordinator URL, https://... under TLS (default http://127.0.0.1:{DEFAULT_PORT})")
    httpc.add_client_args(p)
    return p


def status_main(argv):
    p = _cli_parser("darl_server.py status - print a running coordinator's progress; exit 1 while blocks are "
                    "quarantined, a violation counter is non-zero or the books are inconsistent.")
    p.add_argument("--json", action="store_true", help="print the raw JSON")
    a = p.parse_args(argv)
    try:
        st = httpc.call(a.url, "GET", "/status", token=httpc.load_token(a.token_file), timeout=10,
                        ca_file=a.ca_file)
    except (OSError, httpc.CallError, httpc.TLSConfigError) as e:
        raise SystemExit(f"cannot read {a.url}/status: {e}")
    if not isinstance(st, dict) or "num_blocks" not in st:
        raise SystemExit(f"status: {a.url} is not the DARL coordinator (its /status has no num_blocks): point "
                         f"--url at darl_server.py, port {DEFAULT_PORT} by default")
    print(json.dumps(st, indent=1) if a.json else format_status(st))
    bad = st.get("quarantined") or st.get("invariant_error") or any((st.get("violations") or {}).values())
    return 1 if bad else 0


def abort_custody_main(argv):
    p = _cli_parser("""darl_server.py abort-custody - return to the pool the custody of an aggregator that will
never resolve it (its state directory is lost), and retire that aggregator's identity.

Without --yes it only lists what it would return. With --yes every block that aggregator
holds in custody goes back to the pool, to be trained again, and DARL refuses anything
that identity sends from then on. If the aggregator did merge one of these deltas, its
blocks are then trained twice: DARL counts the aborts (aborted_custody) and
`darl_server.py status` exits 1 from then on. Find the identity in `status` ("aggregator
... epoch ...") or on the aggregator's own status page. --yes needs --expect, the listing id
the dry run prints: DARL then aborts exactly the records that were listed, or nothing.
The custody endpoints take the aggregator's credential (--aggregator-token-file, central.sh:
STATE/aggregator.token) where DARL was started with one.""")
    p.add_argument("--aggregator", required=True, help="the aggregator identity whose custody to abort")
    p.add_argument("--reason", required=True, help="why no aggregator will resolve it (logged with the abort)")
    p.add_argument("--yes", action="store_true", help="do it (default: only list what would be returned)")
    p.add_argument("--expect", help="with --yes: the listing id the dry run printed (what you saw is what goes)")
    p.add_argument("--aggregator-token-file", default=os.environ.get("PWW_AGGREGATOR_TOKEN_FILE"),
                   help="the aggregator's credential (default $PWW_AGGREGATOR_TOKEN_FILE; none: --token-file)")
    a = p.parse_args(argv)
    if a.yes and not a.expect:
        raise SystemExit("abort-custody: --yes needs --expect LISTING: run it without --yes first, check the list, "
                         "then repeat with the --yes --expect it prints")
    token = httpc.load_token(a.aggregator_token_file, env=None) or httpc.load_token(a.token_file)
    query = urllib.parse.urlencode({"aggregator": a.aggregator, "state": "held"})
    try:
        held = httpc.call(a.url, "GET", f"/custody?{query}", token=token, timeout=30, ca_file=a.ca_file)["custody"]
        listing = listing_id(held)
        if not a.yes:
            blocks = sum(c["blocks"] for c in held)
            print(f"aggregator {a.aggregator} holds {len(held)} custody record(s), {blocks} blocks:")
            for c in held:
                print(f"  delta {c['delta']} of {c['cluster']} ({c['incarnation']}): positions {c['pieces']}")
            print(f"dry run: nothing changed; add --yes --expect {listing} to return exactly these blocks to the "
                  "pool and retire the identity")
            return 2
        if a.expect != listing:
            raise SystemExit(f"abort-custody: aggregator {a.aggregator} holds other custody now (listing {listing}, "
                             f"you were shown {a.expect}): nothing aborted; run the dry run again")
        reply = httpc.call(a.url, "POST", "/custody/abort_orphaned",
                           {"aggregator": a.aggregator, "reason": a.reason, "expect": [c["delta"] for c in held]},
                           token=token, timeout=30, ca_file=a.ca_file)
    except (OSError, httpc.CallError, httpc.TLSConfigError) as e:
        raise SystemExit(f"abort-custody: {a.url}: {e}")
    print(f"!!! ABORTED {len(reply['aborted'])} custody record(s) of aggregator {a.aggregator}: "
          f"{reply['returned']} blocks went back to the pool and will be trained again; that identity is retired")
    for c in reply["aborted"]:
        print(f"!!!   delta {c['delta']} of {c['cluster']} ({c['incarnation']}): positions {c['pieces']}")
    return 0


def listing_id(held):
    """8 hex digits naming a set of custody records (their delta ids): the dry run's listing."""
    return format(zlib.crc32(json.dumps(sorted(c["delta"] for c in held)).encode()), "08x")


# ------------------------------------------------------------------ serve

@dataclasses.dataclass
class ServerConfig:
    num_samples: int | None
    manifest: str | None
    block_size: int
    seed: int
    state_dir: str
    snapshot_every: int
    restore_grace: float
    table: darl_table.TableConfig

    def validate(self):
        if (self.num_samples is None) == (self.manifest is None):
            raise ValueError("give exactly one of --num-samples N or --manifest manifest.json")
        if self.snapshot_every < 1:
            raise ValueError("--snapshot-every must be >= 1 change")
        if self.restore_grace < 0:
            raise ValueError("--restore-grace must be >= 0 s")
        self.table.validate()
        return self

    def space(self):
        if self.manifest:
            return block_space.BlockSpace.from_manifest(self.manifest, self.block_size, self.seed)
        return block_space.BlockSpace(self.num_samples, self.block_size, self.seed)


def serve_parser():
    p = httpd.base_parser(__doc__)
    s = p.add_argument_group("block space")
    s.add_argument("--num-samples", type=int, help="N, samples (or windows) in the corpus")
    s.add_argument("--manifest", help="tokenized corpus manifest.json: N = its training windows "
                   "(num_windows - heldout_windows); its digest joins ours")
    s.add_argument("--block-size", type=int, default=1, help="K, samples per block (default 1)")
    s.add_argument("--seed", type=int, default=0, help="permutation seed (default 0)")
    t = p.add_argument_group("leasing")
    d = darl_table.TableConfig()
    t.add_argument("--max-attempts", type=int, default=d.max_attempts,
                   help=f"expiries before a block run is QUARANTINED; 0 = never (default {d.max_attempts})")
    t.add_argument("--min-ttl", type=float, default=d.min_ttl, help=f"shortest lease TTL, s (default {d.min_ttl:g})")
    t.add_argument("--max-ttl", type=float, default=d.max_ttl, help=f"longest lease TTL, s (default {d.max_ttl:g})")
    t.add_argument("--default-ttl", type=float, default=d.default_ttl,
                   help=f"TTL when a client names none, s (default {d.default_ttl:g})")
    t.add_argument("--grant-seconds", type=float, default=d.grant_seconds,
                   help=f"size a grant to this many seconds of the cluster's measured rate (default {d.grant_seconds:g})")
    t.add_argument("--initial-grant", type=int, default=d.initial_grant,
                   help=f"blocks granted before a cluster's rate is known (default {d.initial_grant})")
    t.add_argument("--max-grant", type=int, default=d.max_grant, help="largest grant, blocks; 0 = no cap (default 0)")
    st = p.add_argument_group("state")
    st.add_argument("--state-dir", default="runs/central", help="WAL and snapshots go to STATE_DIR/darl/ (default runs/central)")
    st.add_argument("--snapshot-every", type=int, default=1000, help="changes between snapshots, at least; also waits until the log is as large as "
                         "the last snapshot (default 1000)")
    st.add_argument("--restore-grace", type=float, default=120.0,
                    help="after a restart, leases alive at the crash live at least this long, s (default 120)")
    st.add_argument("--accept-config-change", action="store_true",
                    help="the leasing flags differ from those the state was written with: log the change (it "
                         "applies from now on) instead of refusing to start")
    httpd.add_server_args(p, DEFAULT_PORT)
    p.add_argument("--aggregator-token-file", default=os.environ.get("PWW_AGGREGATOR_TOKEN_FILE"),
                   help="the aggregator's and operator's own bearer token for /fence and /custody* (default "
                        "$PWW_AGGREGATOR_TOKEN_FILE; none: those take the sites' token)")
    return p


def serve(a):
    try:
        table = darl_table.TableConfig(a.max_attempts, a.min_ttl, a.max_ttl, a.default_ttl,
                                       a.grant_seconds, a.initial_grant, a.max_grant)
        cfg = ServerConfig(a.num_samples, a.manifest, a.block_size, a.seed, a.state_dir, a.snapshot_every,
                           a.restore_grace, table).validate()
        space = cfg.space()
    except ValueError as e:
        raise SystemExit(f"darl_server: {e}")
    # bind first: a refused bind (public address, no token or TLS) must not create or replay state
    agg_token = httpc.load_token(a.aggregator_token_file, env=None)
    token = httpc.load_token(a.token_file)
    if agg_token and agg_token == token:
        raise SystemExit("darl_server: --aggregator-token-file holds the sites' token; give the aggregator its own "
                         "(central.sh makes STATE/aggregator.token)")
    server = httpd.server_from_args(a, disk=cfg.state_dir, operator_paths=CUSTODY_PATHS,
                                    scoped={p: agg_token for p in CUSTODY_PATHS} if agg_token else None)
    if token and not agg_token:
        if not httpd.is_loopback(a.host) and not a.insecure:
            raise SystemExit(f"darl_server: refusing to listen on {a.host!r} without --aggregator-token-file: every "
                             "site holding the token could fence the aggregator and abort its custody; pass the "
                             "aggregator's own token file (central.sh makes STATE/aggregator.token), or --insecure")
        sys.stderr.write("darl_server: no --aggregator-token-file: every holder of the sites' token may fence the "
                         "aggregator and abort its custody\n")
    if cfg.state_dir:
        httpd.writable_dir(cfg.state_dir, "--state-dir")
    try:
        coord = Coordinator(space, cfg.table, cfg.state_dir, cfg.snapshot_every, cfg.restore_grace,
                            accept_config_change=a.accept_config_change)
    except OSError as e:             # a full disk: the start logs the restore of live leases
        raise SystemExit(f"darl_server: cannot start on {cfg.state_dir}: {e.strerror or e}; free space on its "
                         "disk and start again")
    server.RequestHandlerClass.routes.update(httpd.with_http_stats(make_routes(coord), server))

    def on_term(signum, frame):      # SIGTERM: stop serving, then flush and snapshot below
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, on_term)
    print(f"darl_server: {space.num_blocks} blocks, digest {space.digest()}, state {coord.dir}", flush=True)
    try:
        httpd.serve_forever(server, "darl_server")
    finally:
        coord.close()
    return 0


def main(argv):
    if argv[:1] == ["status"]:
        return status_main(argv[1:])
    if argv[:1] == ["abort-custody"]:
        return abort_custody_main(argv[1:])
    return serve(serve_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
