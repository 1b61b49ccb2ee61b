"""darl_server.py - DARL, the dataset-leasing coordinator (central VM, :29510).

What: the one map of which data blocks are UNASSIGNED, LEASED, COMMITTED or
QUARANTINED. Sites lease contiguous runs of block *positions* under a TTL,
keep them alive with heartbeats and commit them once the update trained on
them is durable, so the corpus is covered exactly once even though sites
start late, run at different speeds and die at walltime. The bookkeeping
itself (BlockSpace, LeaseTable, verify) is darl_table.py, which does no I/O;
this file makes it durable (write-ahead log, snapshots) and serves it.

Where: the central VM (or a login node): it must outlive every job that
leases from it. Python standard library only; never imports torch.

Run:
    python darl_server.py --num-samples 1000000 --block-size 10000 --seed 0 \\
        --state-dir runs/central
    python darl_server.py --manifest /tmp/manifest.json --block-size 64 --seed 0
        # N = the manifest's TRAINING windows (num_windows - heldout_windows):
        # the held-out tail is never leased (darl_table.py says how positions map)
    python darl_server.py status --url http://127.0.0.1:29510

Bind/port: 127.0.0.1:29510 by default. A non-loopback --host needs a token
(--token-file or $PWW_TOKEN) or --insecure. Every endpoint but /health needs
`Authorization: Bearer <token>` when a token is set.

State: <state-dir>/darl/wal.jsonl (one JSON line per state change, each with
"v": 1, fsync'd before the reply) and <state-dir>/darl/snapshot.json (every
--snapshot-every changes; LeaseTable.verify() runs before each one is
written). A restart loads the snapshot, replays the log (a torn last line,
i.e. a crash mid-write, is dropped) and gives every lease alive at the crash
--restore-grace seconds, so sites training through the outage lose nothing.

Callers: darl_client.py (one LeaseSession per stream, i.e. per replica) and
fedmom_server.py, which commits blocks on a cluster's behalf once the update
trained on them is merged into a durable round.

Protocol (POST, JSON bodies; replies are JSON; errors are 4xx with
{"error": "one line"} and change nothing):
    /register  {cluster, incarnation, digest}
               -> {cluster, incarnation, num_blocks, digest, space}; a wrong digest
                  is a 409 whose reply also carries the coordinator's digest and space;
                  a cluster held by another live incarnation is a 409 with
                  "code": "incarnation_conflict" and "retry_after_s" (until its leases expire)
    /acquire   {cluster, incarnation, blocks?, ttl?, request_id?}
               -> {"status": "ok", "lease": {...}} | {"status": "wait", "retry_after"}
                  | {"status": "done"}  (nothing left to lease, ever)
    /heartbeat {cluster, incarnation, leases: [{"lease", "cursor"?}], ttl?, throughput?}
               -> {"leases": [{"lease", "valid", "start", "claimed", "end", "ttl_left"}], "ttl"}
               The reply is an instruction: `end` may have shrunk (stolen tail)
               and valid=false means the lease was reclaimed: stop using it.
               `cursor` claims [start, cursor): the coordinator never steals
               a claimed position, and a client must not touch an unclaimed one.
               ttl_left (live leases only) is what remains after this heartbeat;
               the aggregator heartbeats again within a third of it.
    /commit    {cluster, incarnation, lease, end?}   commits [lease.start, end); a lease
               that EXPIRED still commits while every position of that range sits
               unleased in the pool (or quarantine): nobody else trained them, so they
               are taken back; if any was leased or committed again it is a 409 (a
               released lease is always a 409: its holder gave the blocks back)
    /release   {cluster, incarnation, leases: [...], leave?}
    GET /status  progress, per-cluster books, and the space: {"digest", "space":
                 {num_samples, block_size, seed, num_blocks, algorithm, manifest_digest}}
                 so a site can build the same BlockSpace from its own manifest
    GET /health
"""
import dataclasses
import json
import os
import signal
import sys
import threading
import time

import darl_table
import httpd

DEFAULT_PORT = 29510
WAL_VERSION = 1
# fdatasync flushes the appended bytes and the new file size, skipping the
# mtime update; measured here 0.25 ms against 0.2-16 ms for fsync on a busy disk.
_datasync = getattr(os, "fdatasync", os.fsync)


# ------------------------------------------------------------------ durability

class LogError(SystemExit):
    """The state directory cannot be read back: names the file and the fix."""


class WriteAheadLog:
    """JSON lines, one per state change, each {"v": 1, "seq", "t", "op", "args"}.

    Group commit: a record is written under the coordinator's lock, then the
    caller waits in sync() until an fsync covers it; one fsync serves every
    record written before it, so concurrent clients share the disk flush.
    """

    def __init__(self, path, fsync=True):
        self.path, self.fsync = path, fsync
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.sync_lock = threading.Lock()
        self.written = self.durable = 0

    @staticmethod
    def read(path):
        """Records in order; a torn last line (crash mid-write) is cut off the file."""
        if not os.path.exists(path):
            return []
        with open(path, "rb") as f:
            data = f.read()
        records, offset = [], 0
        *complete, tail = data.split(b"\n")     # tail: bytes after the last newline (a torn write)
        for i, line in enumerate(complete):
            try:
                rec = json.loads(line)
            except ValueError:
                if i < len(complete) - 1 or tail:
                    raise LogError(f"{path}: line {i + 1} is corrupt and is not the last line, so the log "
                                   "cannot be replayed past it; keep a copy of the state directory and ask "
                                   "whether losing the changes after that line is acceptable")
                tail = line
                break
            if not isinstance(rec, dict) or rec.get("v") != WAL_VERSION:
                got = rec.get("v") if isinstance(rec, dict) else None
                raise LogError(f"{path}: line {i + 1} has version {got!r}; this darl_server reads "
                               f"v={WAL_VERSION}: run the darl_server.py that wrote it")
            records.append(rec)
            offset += len(line) + 1
        if tail:
            sys.stderr.write(f"darl_server: dropping the torn last line of {path} ({len(tail)} bytes)\n")
            with open(path, "r+b") as f:
                f.truncate(offset)
        return records

    def append(self, record):
        os.write(self.fd, (json.dumps(record, separators=(",", ":")) + "\n").encode())
        self.written = record["seq"]

    def sync(self, seq):
        if not self.fsync:
            return
        with self.sync_lock:
            if self.durable >= seq:
                return
            target = self.written
            _datasync(self.fd)
            self.durable = target

    def truncate(self, seq):
        """Everything up to `seq` is in a durable snapshot: start the log afresh."""
        with self.sync_lock:
            os.ftruncate(self.fd, 0)
            if self.fsync:
                os.fsync(self.fd)
            self.durable = max(self.durable, seq)

    def close(self):
        if self.fsync:
            os.fsync(self.fd)
        os.close(self.fd)


def _write_atomic(path, obj):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, separators=(",", ":"))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dfd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


class Coordinator:
    """The LeaseTable (darl_table.py) behind one lock, with every change logged before the reply.

    call(op, args) applies a LeaseTable method at the current time, appends
    {op, args, t} to the log and waits for the fsync; replaying the same
    records at the same times rebuilds the same table, because the table is a
    pure function of its calls and their times.
    """
    OPS = ("register", "acquire", "heartbeat", "commit", "release", "restore")

    def __init__(self, space, config=None, state_dir=None, snapshot_every=1000, restore_grace=120.0,
                 fsync=True, clock=time.time):
        self.space, self.digest, self.clock = space, space.digest(), clock
        self.config = config or darl_table.TableConfig()
        self.snapshot_every, self.lock = snapshot_every, threading.Lock()
        self.invariant_error = None
        self.table, self.seq = darl_table.LeaseTable(space.num_blocks, self.config, clock), 0
        self.dir = self.wal = None
        if state_dir:
            self.dir = os.path.join(state_dir, "darl")
            os.makedirs(self.dir, exist_ok=True)
            self._load()
            self.wal = WriteAheadLog(os.path.join(self.dir, "wal.jsonl"), fsync)
            self.wal.written = self.wal.durable = self.seq
        if self.table.leases:
            self.call("restore", {"grace": restore_grace})

    def _load(self):
        snap_path = os.path.join(self.dir, "snapshot.json")
        if os.path.exists(snap_path):
            try:
                with open(snap_path) as f:
                    snap = json.load(f)
            except ValueError as e:
                raise LogError(f"{snap_path}: unreadable snapshot ({e}); snapshots are written atomically, so "
                               "this is disk damage: restore the file from a backup")
            if snap.get("v") != WAL_VERSION:
                raise LogError(f"{snap_path}: version {snap.get('v')!r}, this darl_server reads v={WAL_VERSION}")
            if snap["digest"] != self.digest:
                raise LogError(f"{self.dir} belongs to another block space (digest {snap['digest']}, "
                               f"space {snap.get('space')}); this server has {self.space.describe()}. "
                               "Use the same --num-samples/--manifest, --block-size and --seed, or a new --state-dir")
            self.table = darl_table.LeaseTable.from_dict(snap["table"], self.config, self.clock)
            self.seq = snap["seq"]
        for rec in WriteAheadLog.read(os.path.join(self.dir, "wal.jsonl")):
            if rec["seq"] <= self.seq:
                continue                       # already inside the snapshot
            if rec["seq"] != self.seq + 1 or rec["op"] not in self.OPS:
                raise LogError(f"{self.dir}/wal.jsonl: record {rec['seq']} ({rec['op']!r}) does not follow "
                               f"{self.seq}; the log is not this snapshot's continuation")
            if rec["op"] == "register" and rec.get("digest", self.digest) != self.digest:
                raise LogError(f"{self.dir} belongs to another block space: use a new --state-dir")
            try:
                getattr(self.table, rec["op"])(**rec["args"], now=rec["t"])
            except darl_table.LeaseError as e:
                raise LogError(f"{self.dir}/wal.jsonl: record {rec['seq']} no longer applies ({e.reason})")
            self.seq = rec["seq"]

    def call(self, op, args):
        """Apply one change; return its reply once it is durable. LeaseError = refused, nothing logged."""
        if op == "register" and args.get("digest") != self.digest:
            raise darl_table.LeaseError(409, f"block-space digest mismatch: client {args.get('digest')!r}, "
                                             f"coordinator {self.digest!r} ({self.space.describe()}); both sides "
                                             "must use the same --num-samples/--manifest, --block-size and --seed",
                                        digest=self.digest, space=self.space.describe())
        with self.lock:
            now = self.clock()
            table_args = {k: v for k, v in args.items() if k != "digest"}
            reply = getattr(self.table, op)(**table_args, now=now)
            self.seq += 1
            if self.wal is not None:
                rec = {"v": WAL_VERSION, "seq": self.seq, "t": now, "op": op, "args": table_args}
                if op == "register":
                    rec["digest"] = self.digest
                try:
                    self.wal.append(rec)
                except OSError as e:        # memory and disk now disagree: stop rather than serve
                    sys.stderr.write(f"darl_server: cannot append to the log ({e}); exiting so a restart "
                                     "replays a consistent state\n")
                    os._exit(75)
                if self.seq % self.snapshot_every == 0:
                    self.snapshot()
            seq = self.seq
        if self.wal is not None:
            self.wal.sync(seq)
        if op == "register":        # what a site needs to build the same BlockSpace and check it
            reply = {**reply, "digest": self.digest, "space": self.space.describe()}
        return reply

    def snapshot(self):
        """Verify the books, write them atomically, then start the log afresh. Call under the lock."""
        try:
            self.table.verify()
        except darl_table.InvariantError as e:
            self.invariant_error = str(e)
            sys.stderr.write(f"darl_server: INVARIANT VIOLATED, snapshot skipped: {e}\n")
            return False
        _write_atomic(os.path.join(self.dir, "snapshot.json"),
                      {"v": WAL_VERSION, "seq": self.seq, "t": self.clock(), "digest": self.digest,
                       "space": self.space.describe(), "table": self.table.to_dict()})
        self.wal.truncate(self.seq)
        return True

    def status(self):
        with self.lock:
            try:
                out = self.table.status(self.clock())
            except darl_table.InvariantError as e:
                self.invariant_error = str(e)
                out = {}
            return {**out, "digest": self.digest, "space": self.space.describe(), "seq": self.seq,
                    "invariant_error": self.invariant_error}

    def close(self):
        with self.lock:
            if self.wal is not None:
                self.snapshot()
                self.wal.close()
                self.wal = None


# ------------------------------------------------------------------ HTTP

def _fields(body, spec):
    """Pick the named fields with httpd.field's type check: {name: (kind, required)}."""
    return {name: httpd.field(body, name, kind, required) for name, (kind, required) in spec.items()
            if required or body.get(name) is not None}


ID = {"cluster": (str, True), "incarnation": (str, True)}
NUM = (int, float)
REQUESTS = {
    "register": {**ID, "digest": (str, True)},
    "acquire": {**ID, "blocks": (int, False), "ttl": (NUM, False), "request_id": (str, False)},
    "heartbeat": {**ID, "leases": (list, False), "ttl": (NUM, False), "throughput": (NUM, False)},
    "commit": {**ID, "lease": (int, True), "end": (int, False)},
    "release": {**ID, "leases": (list, False), "leave": (bool, False)},
}


def make_routes(coord):
    def rpc(op):
        def route(req):
            args = _fields(req.json(), REQUESTS[op])
            try:
                return coord.call(op, args)
            except darl_table.LeaseError as e:
                raise httpd.HTTPError(e.status, e.reason, **e.extra)
        return route

    routes = {("POST", "/" + op): rpc(op) for op in REQUESTS}
    routes[("GET", "/status")] = lambda req: coord.status()
    routes[("GET", "/health")] = lambda req: {"ok": True, "service": "darl", "digest": coord.digest,
                                              "num_blocks": coord.space.num_blocks}
    return routes


# ------------------------------------------------------------------ status CLI

def format_status(st):
    lines = []
    n = st.get("num_blocks", 0)
    pct = 100.0 * st.get("committed", 0) / n if n else 0.0
    lines.append(f"space: {st['space']}  digest {st['digest']}")
    lines.append(f"progress: {st.get('committed', 0)}/{n} blocks committed ({pct:.1f}%), "
                 f"{st.get('leased', 0)} leased, {st.get('free', 0)} unassigned"
                 + ("  -- EPOCH DONE" if st.get("done") else ""))
    lines.append(f"{'cluster':<16} {'live':>5} {'committed':>10} {'leased':>8} {'lost':>6} {'blocks/s':>9}")
    for c in st.get("clusters", []):
        bps = "-" if c["blocks_per_s"] is None else f"{c['blocks_per_s']:.3f}"
        lines.append(f"{c['cluster']:<16} {'yes' if c['live'] else 'no':>5} {c['committed']:>10} "
                     f"{c['leased']:>8} {c['lost']:>6} {bps:>9}")
    if st.get("quarantined"):
        lines.append(f"!!! {st['quarantined']} BLOCKS QUARANTINED: dropped from this epoch after repeated "
                     f"failures; position runs {st['quarantined_runs']}")
    if st.get("invariant_error"):
        lines.append(f"!!! INVARIANT VIOLATED: {st['invariant_error']}")
    return "\n".join(lines)


def status_main(argv):
    p = httpd.base_parser("darl_server.py status - print a running coordinator's progress.")
    p.add_argument("--url", default=f"http://127.0.0.1:{DEFAULT_PORT}", help="coordinator URL")
    p.add_argument("--token-file", default=os.environ.get("PWW_TOKEN_FILE"),
                   help="bearer token file (default $PWW_TOKEN_FILE or $PWW_TOKEN)")
    p.add_argument("--json", action="store_true", help="print the raw JSON")
    a = p.parse_args(argv)
    try:
        st = httpd.call(a.url, "GET", "/status", token=httpd.load_token(a.token_file), timeout=10)
    except (OSError, httpd.CallError) as e:
        raise SystemExit(f"cannot read {a.url}/status: {e}")
    print(json.dumps(st, indent=1) if a.json else format_status(st))
    return 1 if st.get("quarantined") or st.get("invariant_error") else 0


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
            return darl_table.BlockSpace.from_manifest(self.manifest, self.block_size, self.seed)
        return darl_table.BlockSpace(self.num_samples, self.block_size, self.seed)


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
    st.add_argument("--snapshot-every", type=int, default=1000, help="changes between snapshots (default 1000)")
    st.add_argument("--restore-grace", type=float, default=120.0,
                    help="after a restart, leases alive at the crash live at least this long, s (default 120)")
    httpd.add_server_args(p, DEFAULT_PORT)
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
    # bind first: a refused bind (public address, no token) must not create or replay state
    server = httpd.make_server({}, a.host, a.port, httpd.load_token(a.token_file), a.insecure,
                               max_body=int(a.max_body_mb * 2**20), quiet=not a.verbose)
    coord = Coordinator(space, cfg.table, cfg.state_dir, cfg.snapshot_every, cfg.restore_grace)
    server.RequestHandlerClass.routes.update(make_routes(coord))

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
    return serve(serve_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
