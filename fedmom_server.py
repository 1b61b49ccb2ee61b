"""fedmom_server.py - the central FedMom aggregator: one global model, merged from the sites' deltas.

Runs on: the central VM (CPU only). Python standard library + numpy; never imports
torch, so copying httpd.py, tensorio.py, fedmom_merge.py (the merge arithmetic and the
delta checks) and this file onto a bare Python 3 with numpy is the whole install
(blobstore.py too for the blob transport).

    # first start: the initial model (any float dtype; theta_global is kept in fp32)
    python fedmom_server.py --state-dir state/fedmom --init init.safetensors
    # every later start resumes from the state dir (--init is then optional)
    python fedmom_server.py --state-dir state/fedmom [--outer-lr 0.7 --outer-momentum 0.9
        --round-deadline-s 1800 --member-timeout-s 300 --blob-url http://127.0.0.1:29512
        --darl http://127.0.0.1:29510 --token-file FILE]
    # what is it doing?
    python fedmom_server.py status --url http://127.0.0.1:29511 [--token-file FILE]

Port 29511, bound to 127.0.0.1 unless --host says otherwise (a non-loopback bind
needs a token or --insecure). Callers: the sites' outer step (diloco.py's HTTP
carrier, through fedmom_client.FedMomClient) and operators (`status`, a browser on GET /).
Every endpoint needs `Authorization: Bearer <token>` when a token is set, except
GET /health and GET / : the page is read-only, shows round numbers, cluster ids and
metrics only (no token, no path, nothing a caller could write with), and a browser
cannot send a bearer header. --private-page puts GET / behind the token as well.

The outer step (DESIGN.md): deltas arrive as d_i = theta_i - theta_global with the
tokens each site trained on; p_i = tokens_i / sum(tokens); the pseudo-gradient is
g = theta_global - sum_i p_i theta_i = -sum_i p_i d_i, and theta_global takes one
step of torch.optim.SGD(lr, momentum=mu, nesterov=True, dampening=0) with grad = g:
    buf = g (first step) or mu * buf + g;   theta -= lr * (g + mu * buf)
lr 1 / momentum 0 is exact FedAvg. The merge (fedmom_merge.py) streams one tensor at
a time from the delta files into tensorio writers for the new theta and momentum, so
its memory is a few times the largest tensor, not the model.

Round protocol (POST bodies and replies are JSON; errors are 4xx {"error": "..."}):
    POST /join       {cluster, incarnation}          -> {round, heartbeat_s, ...}; 409 if
                     another incarnation of that cluster is live (second job: --replica)
    POST /heartbeat  {cluster, incarnation, metrics?, wait_round_after?, wait_s?}
                     -> {round, deltas, ...}; with wait_round_after it long-polls until the round
                     passes it (or wait_s). 409 {"code": "not_member"}: join again.
    POST /leave      {cluster, incarnation}
    POST /delta_check  the delta's metadata alone: the same 4xx a real upload would get
    PUT  /delta      body = the delta file; metadata in the X-Delta-Meta header (JSON):
                     {cluster, incarnation, base_round, tokens, leases: [...], metrics: {...}}
    POST /delta_blob {...the same metadata..., blob, sha256}: the delta sits in blobstore
    GET  /theta      the current theta_global file (X-Round header names its round)
    GET  /theta_blob publishes it to the blob store once per round -> {blob, sha256, round}
    GET  /round, GET /status (JSON), GET / (HTML page), GET /health
A delta whose base_round is not the current round gets 409 {"error", "round": current}.
With --darl, an arriving delta's leases are heartbeated in DARL before it is spooled:
a lease DARL no longer holds for that incarnation (it expired and its blocks are back
in the pool) is a 409 {"error", "code": "lease_lost", "leases": [...]} and nothing is
stored; the site discards that work. DARL unreachable at that moment: the delta is
accepted (the commit after the merge is retried, and DARL takes a late commit while
nobody has leased those blocks again).
A round closes when every live member has sent its delta, or --round-deadline-s after
its first delta; it merges what arrived. A member silent for --member-timeout-s is
dropped (it may join again). No live member, or a round with no delta, is normal:
nothing is merged and the round number stays.

What became of a delta (so a site knows whether to release its leases, and an audit
can check that every DARL block was committed through exactly one merged round):
each delta is one outcome object
    {"cluster", "incarnation", "base_round", "tokens", "leases": [{"id", "end"}],
     "outcome": "merged" | "excluded" | "pending", "merged_into": <round> | null,
     "why": "<reason>" (excluded only)}
  - rounds.jsonl, one record per merge (v 2): "outcomes" lists every delta of that
    round, merged ones with merged_into = the record's round, and those excluded
    (NaN/Inf, wrong names, shapes or dtypes) with why; "excluded" keeps its v1 shape
    plus base_round, tokens and leases. Records of v 1 have no "outcomes".
  - POST /join and /heartbeat replies: "deltas" = this cluster's outcomes in the last
    merged round that had one, then the current round's (pending or excluded). After
    wait_round_after(base_round) returns, the entry with that base_round says merged
    (the server commits its leases in DARL) or excluded (the site releases its leases
    in DARL, so the blocks are trained again).
  - GET /status: "outcomes" of the current round, and "recent" round records.
An excluded delta is also refused at upload (400 or 422, code "bad_delta"); that reply
is the first word, since an exclusion not yet in a record lives in memory only.

State dir (everything replaced atomically: temp file, fsync, rename, fsync the dir):
    theta-<r>.safetensors     theta_global after r merges, fp32
    momentum-<r>.safetensors  the Nesterov buffer (absent before the first merge
                              and when --outer-momentum is 0)
    state.json                names the round and its files, membership, recent
                              events, the DARL commits still to send; written LAST,
                              so a SIGKILL at any instant leaves round r or r+1
    rounds.jsonl              one JSON line per merge (loss, perplexity, drift, outcomes, ...)
    spool/                    deltas accepted for the current round: r<round>-<cluster>
                              .safetensors + .json (the .json, written last, is the
                              acceptance). They survive a restart and are merged then.
After a merge is durable the server commits the merged deltas' DARL leases on the
clusters' behalf (--darl), idempotently, re-sending after a restart until DARL
acknowledges; until then it heartbeats those leases so they do not expire: every
--darl-heartbeat-s at most, and every third of the shortest TTL left that DARL's
heartbeat reply names ("ttl_left"), since a site may ask for DARL's 10 s minimum.
"""
import collections
import dataclasses
import hashlib
import html
import http.client
import json
import math
import os
import re
import secrets
import sys
import threading
import time

import numpy as np

import httpd
import fedmom_merge
import tensorio

DEFAULT_PORT = 29511
STATE_FORMAT = "pww-fedmom-state/1"
RECORD_VERSION = 2             # 2: per-delta "outcomes" with their leases
EVENTS_KEPT = 500             # membership events kept in state.json (for the page and status)
RECORDS_KEPT = 200            # round records kept in memory (the file keeps all)
ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
BLOB_ID_RE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,199}")
MERGE_PAUSE_ENV = "PWW_FEDMOM_MERGE_PAUSE_S"   # tests: sleep after each merged tensor
METRIC_KEYS = ("loss", "tokens_per_s", "mfu", "tflops_per_rank", "peak_mem_gb", "inner_s")


def log(msg):
    print(time.strftime("%Y-%m-%d %H:%M:%S ") + msg, flush=True)


# ---------------------------------------------------------------- config

@dataclasses.dataclass
class ServerConfig:
    state_dir: str
    init: str | None = None
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    round_deadline_s: float = 1800.0
    member_timeout_s: float = 300.0
    blob_url: str | None = None
    darl: str | None = None
    darl_heartbeat_s: float = 30.0
    fsync: bool = True

    def validate(self):
        if not self.state_dir:
            raise SystemExit("--state-dir is required")
        if not (self.outer_lr > 0 and math.isfinite(self.outer_lr)):
            raise SystemExit(f"--outer-lr {self.outer_lr} must be a positive number (0.7 for DiLoCo, 1.0 for FedAvg)")
        if not 0 <= self.outer_momentum < 1:
            raise SystemExit(f"--outer-momentum {self.outer_momentum} must be in [0, 1) (0.9 for DiLoCo, 0 for FedAvg)")
        if not self.round_deadline_s > 0:
            raise SystemExit(f"--round-deadline-s {self.round_deadline_s} must be > 0 seconds")
        if not self.member_timeout_s > 0:
            raise SystemExit(f"--member-timeout-s {self.member_timeout_s} must be > 0 seconds")
        if not self.darl_heartbeat_s > 0:
            raise SystemExit(f"--darl-heartbeat-s {self.darl_heartbeat_s} must be > 0 seconds")
        if self.init is not None and not os.path.isfile(self.init):
            raise SystemExit(f"--init {self.init}: no such file")
        return self


# ---------------------------------------------------------------- durable files

def fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(path, obj, fsync=True):
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.write("\n")
        f.flush()
        if fsync:
            os.fsync(f.fileno())
    os.replace(tmp, path)
    if fsync:
        fsync_dir(os.path.dirname(os.path.abspath(path)))


def append_line(path, obj, fsync=True):
    with open(path, "a") as f:
        f.write(json.dumps(obj, sort_keys=True) + "\n")
        f.flush()
        if fsync:
            os.fsync(f.fileno())


def read_records(path):
    """Every complete line of rounds.jsonl (a torn last line, from a crash mid-append, is skipped)."""
    out = []
    try:
        with open(path) as f:
            for line in f:
                try:
                    out.append(json.loads(line))
                except ValueError:
                    pass
    except FileNotFoundError:
        pass
    return out


def file_sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def init_theta(init_path, out_path, fsync=True):
    """theta-0 from the init file, every tensor as fp32."""
    with tensorio.TensorReader(init_path) as r:
        bad = [n for n in r.names if r.specs[n][0] not in tensorio.FLOAT_DTYPES]
        if bad:
            raise SystemExit(f"--init {init_path}: tensors {bad[:5]} are not floating point; "
                             "only float tensors can be merged (save the parameters alone)")
        specs = [(n, "F32", r.specs[n][1]) for n in r.names]
        with tensorio.TensorWriter(out_path, specs, {"round": "0"}, fsync=fsync) as w:
            for n in r.names:
                w.write(n, r.read(n, as_float32=True).astype(np.float32, copy=False))


def structure_digest(specs):
    return hashlib.sha256(json.dumps(sorted((n, list(s)) for n, s in specs.items())).encode()).hexdigest()


# ---------------------------------------------------------------- DARL, on the clusters' behalf

class DarlLink:
    """The two DARL calls the aggregator makes for a cluster (darl_server.py's protocol):
    heartbeat the leases of accepted-but-unmerged deltas, and commit them after the merge."""

    def __init__(self, url, token=None, timeout=30.0):
        self.url, self.token, self.timeout = url, token, timeout

    def heartbeat(self, cluster, incarnation, lease_ids):
        body = {"cluster": cluster, "incarnation": incarnation, "leases": [{"lease": i} for i in lease_ids]}
        return httpd.call(self.url, "POST", "/heartbeat", body, token=self.token, timeout=self.timeout)

    def commit(self, cluster, incarnation, lease_id, end=None):
        body = {"cluster": cluster, "incarnation": incarnation, "lease": lease_id}
        if end is not None:
            body["end"] = end
        return httpd.call(self.url, "POST", "/commit", body, token=self.token, timeout=self.timeout)


# ---------------------------------------------------------------- the state (no HTTP in here)

@dataclasses.dataclass
class Member:
    incarnation: str
    joined: float          # wall time
    last_seen: float       # clock() time
    metrics: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Pending:
    cluster: str
    incarnation: str
    base_round: int
    tokens: int
    leases: list
    metrics: dict
    path: str
    meta_path: str
    received: float        # wall time


class Refused(Exception):
    """A request the state refuses: HTTP status, one-line reason, extra reply fields."""

    def __init__(self, status, reason, **extra):
        super().__init__(reason)
        self.status, self.reason, self.extra = status, reason, extra


def _check_id(value, what):
    if not isinstance(value, str) or not ID_RE.fullmatch(value):
        raise Refused(400, f"{what} must match [A-Za-z0-9][A-Za-z0-9._-]{{0,127}}, got {value!r}")
    return value


def _lease_id(lease):
    v = lease.get("id", lease.get("lease"))
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def parse_delta_meta(meta):
    """Check the metadata that comes with a delta; returns a clean dict or raises Refused(400)."""
    if not isinstance(meta, dict):
        raise Refused(400, "delta metadata must be a JSON object")
    out = {"cluster": _check_id(meta.get("cluster"), "cluster"),
           "incarnation": _check_id(meta.get("incarnation"), "incarnation")}
    for key in ("base_round", "tokens"):
        v = meta.get(key)
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise Refused(400, f"{key} must be a non-negative integer, got {v!r}")
        out[key] = v
    if out["tokens"] == 0:
        raise Refused(400, "tokens is 0: a delta that trained on nothing has no weight; do not send it")
    leases = meta.get("leases", [])
    if not isinstance(leases, list) or not all(isinstance(x, dict) and _lease_id(x) is not None for x in leases):
        raise Refused(400, "leases must be a list of DARL lease objects, each with an integer 'id' (or 'lease')")
    out["leases"] = [{"id": _lease_id(x), "end": x.get("end")} for x in leases]
    metrics = meta.get("metrics", {}) or {}
    if not isinstance(metrics, dict):
        raise Refused(400, "metrics must be a JSON object")
    clean = {}
    for k in METRIC_KEYS:
        v = metrics.get(k)
        if v is None:
            continue
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
            raise Refused(400, f"metrics.{k} must be a finite number, got {v!r}")
        clean[k] = float(v)
    out["metrics"] = clean
    return out


class FedMomState:
    """theta_global, momentum, round, membership, pending deltas and DARL commits.
    Plain methods, no HTTP; `clock` (monotonic seconds) and `wall` are injectable."""

    def __init__(self, cfg, clock=time.monotonic, wall=time.time, darl=None):
        self.cfg, self.clock, self.wall, self.darl = cfg, clock, wall, darl
        self.dir = os.path.abspath(cfg.state_dir)
        self.spool = os.path.join(self.dir, "spool")
        self.state_path = os.path.join(self.dir, "state.json")
        self.rounds_path = os.path.join(self.dir, "rounds.jsonl")
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        self.members, self.pending = {}, {}
        self.events = collections.deque(maxlen=EVENTS_KEPT)
        self.excluded, self.dropped = [], []
        self.first_delta_at, self.merging, self.retry_merge_at = None, False, 0.0
        self.pending_commits, self.last_record = [], None
        self.published = {}           # round -> {"blob", "sha256", "round"}
        self.publish_lock = threading.Lock()
        self.darl_heartbeat_at = -math.inf   # clock() time the next DARL heartbeat is due
        self.merge_pause_s = float(os.environ.get(MERGE_PAUSE_ENV, "0") or 0)
        os.makedirs(self.spool, exist_ok=True)
        if os.path.exists(self.state_path):
            self._load()
        else:
            self._create()
        self._clean_dir()
        self.records = collections.deque(read_records(self.rounds_path), maxlen=RECORDS_KEPT)
        self._repair_rounds_log()
        self.round_opened_at = self.clock()

    # ---- start-up

    def _create(self):
        if not self.cfg.init:
            raise SystemExit(f"{self.dir} holds no state yet: pass --init MODEL.safetensors for the first start")
        theta = "theta-0.safetensors"
        init_theta(self.cfg.init, os.path.join(self.dir, theta), self.cfg.fsync)
        self.round, self.theta_file, self.momentum_file = 0, theta, None
        with tensorio.TensorReader(os.path.join(self.dir, theta)) as r:
            self.specs = {n: r.specs[n][1] for n in r.names}
        st = os.stat(self.cfg.init)
        self.init_id = {"sha256": file_sha256(self.cfg.init), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
                        "structure": structure_digest(self.specs)}
        self.event("init", "-", "-", f"theta-0 from {os.path.basename(self.cfg.init)}")
        self._save()
        log(f"fedmom: new state in {self.dir}: {len(self.specs)} tensors, "
            f"{sum(int(np.prod(s)) for s in self.specs.values()):,} parameters, round 0")

    def _load(self):
        try:
            with open(self.state_path) as f:
                st = json.load(f)
        except ValueError as e:
            raise SystemExit(f"{self.state_path} is not valid JSON ({e}); restore it from a backup")
        if st.get("format") != STATE_FORMAT:
            raise SystemExit(f"{self.state_path}: format {st.get('format')!r}, this server reads "
                             f"{STATE_FORMAT!r}; use the fedmom_server.py that wrote it")
        self.round, self.theta_file, self.momentum_file = st["round"], st["theta"], st["momentum"]
        with tensorio.TensorReader(os.path.join(self.dir, self.theta_file)) as r:
            self.specs = {n: r.specs[n][1] for n in r.names}
        self.init_id = st["init"]
        now = self.clock()
        self.members = {c: Member(m["incarnation"], m["joined"], now) for c, m in st["members"].items()}
        self.events.extend(st.get("events", []))
        self.pending_commits = st.get("pending_commits", [])
        self.last_record = st.get("last_record")
        if self.cfg.init:
            self._check_init_matches()
        self._restore_spool()
        log(f"fedmom: resumed {self.dir} at round {self.round}: {len(self.members)} member(s) "
            f"{sorted(self.members)}, {len(self.pending)} spooled delta(s), "
            f"{len(self.pending_commits)} DARL commit(s) to send")

    def _check_init_matches(self):
        with tensorio.TensorReader(self.cfg.init) as r:
            specs = {n: r.specs[n][1] for n in r.names}
        st = os.stat(self.cfg.init)
        same = structure_digest(specs) == self.init_id["structure"] and (
            (st.st_size, st.st_mtime_ns) == (self.init_id["size"], self.init_id["mtime_ns"])
            or file_sha256(self.cfg.init) == self.init_id["sha256"])
        if not same:
            raise SystemExit(f"--init {self.cfg.init} is not the model {self.dir} was started from "
                             f"(sha256 {self.init_id['sha256'][:12]}...): drop --init to resume this run, "
                             "or use a new --state-dir for a new one")
        log(f"fedmom: --init matches the model this state started from; ignored (resuming round {self.round})")

    def _restore_spool(self):
        """Accepted deltas of the current round come back; anything else in spool/ goes."""
        now = self.wall()
        for fn in sorted(os.listdir(self.spool)):
            if not fn.endswith(".json"):
                continue
            try:
                with open(os.path.join(self.spool, fn)) as f:
                    m = json.load(f)
                p = Pending(**m)
            except (ValueError, TypeError):
                continue
            if p.base_round == self.round and os.path.exists(p.path):   # accepted: merge it, live or not
                self.pending[(p.cluster, p.incarnation)] = p
        if self.pending:
            self.first_delta_at = self.clock()
            log(f"fedmom: {len(self.pending)} delta(s) for round {self.round} restored from spool at "
                f"{time.strftime('%H:%M:%S', time.localtime(now))}: {sorted(c for c, _ in self.pending)}")

    def _clean_dir(self):
        """Remove what a crash left behind: temp files, files of other rounds, stale spool entries."""
        keep = {self.theta_file, self.momentum_file, "state.json", "rounds.jsonl", "spool"}
        for fn in os.listdir(self.dir):
            if fn not in keep and (fn.startswith(("theta-", "momentum-")) or ".tmp-" in fn):
                os.unlink(os.path.join(self.dir, fn))
        live = {p.path for p in self.pending.values()} | {p.meta_path for p in self.pending.values()}
        for fn in os.listdir(self.spool):
            path = os.path.join(self.spool, fn)
            if path not in live:
                os.unlink(path)

    def _repair_rounds_log(self):
        """state.json lands before rounds.jsonl: a crash between them loses the line; put it back."""
        rec = self.last_record
        if rec and (not self.records or self.records[-1].get("round", -1) < rec["round"]):
            append_line(self.rounds_path, rec, self.cfg.fsync)
            self.records.append(rec)

    def _save(self):
        """state.json, atomically; the caller holds the lock (or is the constructor)."""
        st = {"format": STATE_FORMAT, "round": self.round, "theta": self.theta_file,
              "momentum": self.momentum_file, "init": self.init_id,
              "members": {c: {"incarnation": m.incarnation, "joined": m.joined} for c, m in self.members.items()},
              "events": list(self.events), "pending_commits": self.pending_commits,
              "last_record": self.last_record,
              "outer_lr": self.cfg.outer_lr, "outer_momentum": self.cfg.outer_momentum}
        write_json_atomic(self.state_path, st, self.cfg.fsync)

    def event(self, kind, cluster, incarnation, why=""):
        self.events.append({"t": round(self.wall(), 3), "event": kind, "cluster": cluster,
                            "incarnation": incarnation, "why": why, "round": self.round})

    # ---- membership

    def join(self, cluster, incarnation):
        _check_id(cluster, "cluster"), _check_id(incarnation, "incarnation")
        with self.lock:
            self._drop_silent()
            m = self.members.get(cluster)
            if m and m.incarnation != incarnation:
                ago = self.clock() - m.last_seen
                raise Refused(409, f"cluster {cluster!r} is live as incarnation {m.incarnation} (heard "
                                   f"{ago:.0f} s ago): a second job at a site needs its own --replica; "
                                   f"a requeued job may join once the old one times out",
                              code="incarnation_conflict",
                              retry_after_s=round(max(0.0, self.cfg.member_timeout_s - ago), 1))
            if m is None:
                self.members[cluster] = Member(incarnation, self.wall(), self.clock())
                self.event("join", cluster, incarnation)
                self._save()
                log(f"fedmom: {cluster} ({incarnation}) joined at round {self.round}; "
                    f"{len(self.members)} live: {sorted(self.members)}")
            else:
                m.last_seen = self.clock()
            return self._member_reply(cluster)

    def heartbeat(self, cluster, incarnation, metrics=None, wait_round_after=None, wait_s=0.0):
        deadline = self.clock() + min(max(0.0, wait_s), self.cfg.member_timeout_s / 3)
        with self.lock:
            m = self._member(cluster, incarnation)
            m.last_seen = self.clock()
            if isinstance(metrics, dict):
                m.metrics = {k: v for k, v in metrics.items() if k in METRIC_KEYS and isinstance(v, (int, float))}
            while wait_round_after is not None and self.round <= wait_round_after:
                left = deadline - self.clock()
                if left <= 0 or self.members.get(cluster) is not m:
                    break
                self.cond.wait(timeout=min(left, 1.0))
            if self.members.get(cluster) is m:
                m.last_seen = self.clock()
            return self._member_reply(cluster)

    def leave(self, cluster, incarnation):
        with self.lock:
            self._member(cluster, incarnation)
            del self.members[cluster]
            self.event("leave", cluster, incarnation)
            self._save()
            self.cond.notify_all()
            log(f"fedmom: {cluster} ({incarnation}) left; {len(self.members)} live: {sorted(self.members)}")
            return {"round": self.round, "left": True}

    def _member(self, cluster, incarnation):
        """The live member (cluster, incarnation) or a 409 saying what to do."""
        m = self.members.get(cluster)
        if m is None:
            raise Refused(409, f"{cluster!r} is not a member (never joined, left, or dropped after "
                               f"{self.cfg.member_timeout_s:.0f} s without a heartbeat): join again",
                          code="not_member", round=self.round)
        if m.incarnation != incarnation:
            raise Refused(409, f"{cluster!r} is live as incarnation {m.incarnation}, not {incarnation}: "
                               "this process was replaced; stop it", code="stale_incarnation", round=self.round)
        return m

    def _member_reply(self, cluster):
        return {"round": self.round, "merging": self.merging, "members": sorted(self.members),
                "sent": self._responded(cluster), "heartbeat_s": round(self.cfg.member_timeout_s / 4, 3),
                "deltas": self._outcomes_of(cluster)}

    def _open_outcomes(self):
        """The current round's deltas so far: accepted ("pending") or "excluded"."""
        out = [_outcome(p.cluster, p.incarnation, p.base_round, p.tokens, p.leases, "pending")
               for p in self.pending.values()]
        return out + [_outcome(e["cluster"], e["incarnation"], e["base_round"], e["tokens"], e["leases"],
                               "excluded", why=e["why"]) for e in self.excluded]

    def _outcomes_of(self, cluster):
        """What became of `cluster`'s deltas: those of the last merged round that had one
        (from the round records), then those of the current round."""
        out = [o for o in self._open_outcomes() if o["cluster"] == cluster]
        for rec in reversed(self.records):
            mine = [o for o in rec.get("outcomes", ()) if o["cluster"] == cluster]
            if mine:
                return mine + out
        return out

    def _drop_silent(self):
        """Members silent for --member-timeout-s leave the round (their sent delta stays)."""
        now, changed = self.clock(), False
        for c, m in list(self.members.items()):
            if now - m.last_seen > self.cfg.member_timeout_s:
                why = f"no heartbeat for {now - m.last_seen:.0f} s (--member-timeout-s {self.cfg.member_timeout_s:g})"
                del self.members[c]
                self.event("drop", c, m.incarnation, why)
                self.dropped.append({"cluster": c, "incarnation": m.incarnation, "why": why})
                log(f"fedmom: dropped {c} ({m.incarnation}): {why}")
                changed = True
        if changed:
            self._save()
            self.cond.notify_all()

    # ---- deltas

    def check_delta_meta(self, meta):
        """Everything about a delta that can be checked before its bytes arrive."""
        meta = parse_delta_meta(meta)
        with self.lock:
            self._check_current(meta)
        return meta

    def _check_current(self, meta):
        m = self._member(meta["cluster"], meta["incarnation"])
        m.last_seen = self.clock()
        if meta["base_round"] != self.round:
            raise Refused(409, f"stale delta: based on round {meta['base_round']}, the current round is "
                               f"{self.round}; load theta_global of round {self.round} and train again",
                          code="stale_round", round=self.round)
        if self.merging:
            raise Refused(409, f"round {self.round} is closed and being merged; wait for round "
                               f"{self.round + 1}", code="stale_round", round=self.round)

    def accept_delta(self, meta, part_path):
        """The delta file is fully spooled at `part_path`: check it, then make it pending.
        On any refusal the file is removed and nothing stored changes."""
        try:
            with self.lock:
                self._check_current(meta)
                if (meta["cluster"], meta["incarnation"]) in self.pending:   # a retry whose reply was lost
                    return {"accepted": True, "duplicate": True, "round": self.round}
            try:
                fedmom_merge.check_delta_file(part_path, self.specs)
            except fedmom_merge.DeltaRejected as e:
                with self.lock:
                    self._exclude(meta, e.reason)
                raise Refused(e.status, e.reason, code="bad_delta", round=self.round)
            self.darl_hold(meta)                # a lease reclaimed meanwhile: 409 lease_lost, nothing spooled
            with self.lock:
                self._check_current(meta)       # the round may have closed while we read the file
                if (meta["cluster"], meta["incarnation"]) in self.pending:
                    return {"accepted": True, "duplicate": True, "round": self.round}
                p = self._spool(meta, part_path)
                part_path = None
                self.pending[(p.cluster, p.incarnation)] = p
                if self.first_delta_at is None:
                    self.first_delta_at = self.clock()
                self.cond.notify_all()
                waiting = sorted(c for c in self.members if not self._responded(c))
                log(f"fedmom: delta from {p.cluster} for round {self.round}: {p.tokens:,} tokens, "
                    f"{len(p.leases)} lease(s); waiting for {waiting or 'nobody'}")
                return {"accepted": True, "round": self.round, "waiting_for": waiting}
        finally:
            if part_path and os.path.exists(part_path):
                os.unlink(part_path)

    def _responded(self, cluster):
        """Has the live incarnation of `cluster` sent this round's delta (or had it excluded)?"""
        inc = self.members[cluster].incarnation
        return (cluster, inc) in self.pending or any(
            e["cluster"] == cluster and e["incarnation"] == inc for e in self.excluded)

    def _exclude(self, meta, why):
        self.excluded.append({"cluster": meta["cluster"], "incarnation": meta["incarnation"], "why": why,
                              "base_round": meta["base_round"], "tokens": meta["tokens"],
                              "leases": meta["leases"]})
        self.event("excluded", meta["cluster"], meta["incarnation"], why)
        log(f"fedmom: EXCLUDED delta from {meta['cluster']} ({meta['incarnation']}) for round {self.round}: {why}")

    def _spool(self, meta, part_path):
        base = os.path.join(self.spool, f"r{self.round}-{meta['cluster']}-{meta['incarnation']}")
        p = Pending(meta["cluster"], meta["incarnation"], meta["base_round"], meta["tokens"], meta["leases"],
                    meta["metrics"], base + ".safetensors", base + ".json", self.wall())
        os.replace(part_path, p.path)
        write_json_atomic(p.meta_path, dataclasses.asdict(p), self.cfg.fsync)   # the acceptance
        return p

    def new_part_path(self):
        return os.path.join(self.spool, f".part-{secrets.token_hex(8)}")

    # ---- rounds

    def tick(self):
        """Drop silent members; close and merge the round if it is ready. Returns the new
        round record after a merge, else None. Called by one thread at a time."""
        with self.lock:
            self._drop_silent()
            ready = self._ready()
            if not ready:
                return None
            batch, self.merging = list(self.pending.values()), True
            late = sorted(c for c in self.members if not self._responded(c))
            closed_at = self.clock()
        try:
            result = self._merge(batch)
        except Exception as e:
            with self.lock:
                self.merging, self.retry_merge_at = False, self.clock() + 30.0
                self.cond.notify_all()
            log(f"fedmom: merge of round {self.round} FAILED ({type(e).__name__}: {e}); "
                "state unchanged, retrying in 30 s")
            return None
        with self.lock:
            return self._finish(batch, result, ready, late, closed_at)

    def _ready(self):
        if self.merging or not self.pending or self.clock() < self.retry_merge_at:
            return None
        waiting = [c for c in self.members if not self._responded(c)]
        if not waiting:
            return "every live member sent its delta"
        if self.clock() - self.first_delta_at >= self.cfg.round_deadline_s:
            return f"deadline of {self.cfg.round_deadline_s:g} s passed without {sorted(waiting)}"
        return None

    def _merge(self, batch):
        total = sum(p.tokens for p in batch)
        weights = [p.tokens / total for p in batch]
        new = self.round + 1
        mu = self.cfg.outer_momentum
        t0 = self.clock()
        stats = fedmom_merge.merge_files(
            os.path.join(self.dir, self.theta_file),
            os.path.join(self.dir, self.momentum_file) if self.momentum_file else None,
            [(p.path, w) for p, w in zip(batch, weights)],
            os.path.join(self.dir, f"theta-{new}.safetensors"),
            os.path.join(self.dir, f"momentum-{new}.safetensors") if mu > 0 else None,
            self.cfg.outer_lr, mu, {"round": str(new)}, self.cfg.fsync, self.merge_pause_s)
        stats["merge_s"] = self.clock() - t0
        stats["weights"] = weights
        return stats

    def _finish(self, batch, stats, reason, late, closed_at):
        new, old_files, old_commits = self.round + 1, (self.theta_file, self.momentum_file), list(self.pending_commits)
        rec = self._record(batch, stats, reason, late, closed_at, new)
        self.theta_file = f"theta-{new}.safetensors"
        self.momentum_file = f"momentum-{new}.safetensors" if self.cfg.outer_momentum > 0 else None
        self.pending_commits += [{"round": new, "cluster": p.cluster, "incarnation": p.incarnation,
                                  "lease": l["id"], "end": l.get("end")} for p in batch for l in p.leases]
        self.round, old_record, self.last_record = new, self.last_record, rec
        try:
            self._save()                                   # the round becomes durable here
        except BaseException:
            self.round, self.last_record, self.merging = new - 1, old_record, False
            self.theta_file, self.momentum_file = old_files
            self.pending_commits = old_commits
            raise
        append_line(self.rounds_path, rec, self.cfg.fsync)
        self.records.append(rec)
        log(format_record(rec))
        for fn in old_files:
            if fn and fn not in (self.theta_file, self.momentum_file):
                _unlink(os.path.join(self.dir, fn))
        for p in batch:
            _unlink(p.path), _unlink(p.meta_path)
        self.pending, self.excluded, self.dropped = {}, [], []
        self.first_delta_at, self.merging = None, False
        self.round_opened_at = self.clock()
        self.published = {}
        self.cond.notify_all()
        return rec

    def _record(self, batch, stats, reason, late, closed_at, new):
        total = sum(p.tokens for p in batch)
        clusters = {}
        for p, w, dn in zip(batch, stats["weights"], stats["delta_norms"]):
            drift = dn / stats["theta_norm"] if stats["theta_norm"] > 0 else None
            key = p.cluster if p.cluster not in clusters else f"{p.cluster}@{p.incarnation}"
            clusters[key] = {"incarnation": p.incarnation, "tokens": p.tokens, "weight": round(w, 6),
                                   "drift": drift, **p.metrics}
        losses = [(p.tokens, p.metrics["loss"]) for p in batch if "loss" in p.metrics]
        ltok = sum(t for t, _ in losses)
        loss = sum(t * l for t, l in losses) / ltok if ltok else None
        drifts = [c["drift"] for c in clusters.values() if c["drift"] is not None]
        tps = [p.metrics["tokens_per_s"] for p in batch if "tokens_per_s" in p.metrics]
        outcomes = [_outcome(p.cluster, p.incarnation, p.base_round, p.tokens, p.leases, "merged", merged_into=new)
                    for p in batch]
        outcomes += [o for o in self._open_outcomes() if o["outcome"] == "excluded"]
        return {"v": RECORD_VERSION, "round": new, "base_round": new - 1, "time": round(self.wall(), 3),
                "reason": reason, "tokens": total, "clusters": clusters,
                "loss": loss, "perplexity": _safe_exp(loss),
                "drift_mean": sum(drifts) / len(drifts) if drifts else None,
                "drift_max": max(drifts) if drifts else None,
                "tokens_per_s": sum(tps) if tps else None,
                "wall_s": round(closed_at - self.round_opened_at, 3), "merge_s": round(stats["merge_s"], 3),
                "outcomes": outcomes,
                "excluded": list(self.excluded), "dropped": list(self.dropped), "late": late,
                "members": sorted(self.members), "outer_lr": self.cfg.outer_lr,
                "outer_momentum": self.cfg.outer_momentum,
                "bytes_read": stats["bytes_read"], "bytes_written": stats["bytes_written"]}

    # ---- DARL

    def darl_tick(self, force=False):
        """Send the DARL commits still owed (oldest first), and heartbeat the leases of
        accepted deltas so they survive until their round is durable. False if DARL failed."""
        if self.darl is None:
            return True
        with self.lock:
            todo = list(self.pending_commits)
            hb_due = force or self.clock() >= self.darl_heartbeat_at
            held = {}
            if hb_due:
                self.darl_heartbeat_at = self.clock() + self.cfg.darl_heartbeat_s
                for p in self.pending.values():
                    held.setdefault((p.cluster, p.incarnation), []).extend(l["id"] for l in p.leases)
                for c in todo:
                    held.setdefault((c["cluster"], c["incarnation"]), []).append(c["lease"])
        done, ok = [], True
        for c in todo:
            try:
                self.darl.commit(c["cluster"], c["incarnation"], c["lease"], c.get("end"))
                done.append(c)
            except httpd.CallError as e:
                if 400 <= e.status < 500 and e.status not in (408, 429):
                    log(f"fedmom: DARL refused commit of lease {c['lease']} for {c['cluster']} "
                        f"(round {c['round']}): {e}; not retried")
                    done.append(c)
                else:
                    ok = False
                    break
            except (OSError, http.client.HTTPException) as e:
                log(f"fedmom: DARL unreachable ({e}); {len(todo) - len(done)} commit(s) kept for later")
                ok = False
                break
        for (cluster, inc), ids in held.items():
            if ids:
                try:
                    reply = self.darl.heartbeat(cluster, inc, ids)
                except (httpd.CallError, OSError, http.client.HTTPException) as e:
                    log(f"fedmom: DARL heartbeat for {cluster}'s leases failed: {e}")
                    continue
                self._darl_heartbeat_due(reply)
                lost = [x.get("lease") for x in reply.get("leases", ()) if not x.get("valid")]
                if lost:
                    log(f"fedmom: DARL says {cluster}'s lease(s) {lost} are no longer held; their commit "
                        "still stands if nobody has leased the blocks since")
        if done:
            with self.lock:
                self.pending_commits = [c for c in self.pending_commits if c not in done]
                self._save()
        return ok

    def _darl_heartbeat_due(self, reply):
        """Bring the next heartbeat forward to a third of the shortest TTL left in a
        DARL heartbeat reply, so a lease the aggregator holds never expires (a site may
        ask for DARL's 10 s minimum while --darl-heartbeat-s is 30 s)."""
        left = [x["ttl_left"] for x in reply.get("leases", ()) if x.get("valid") and "ttl_left" in x]
        if not left and reply.get("ttl"):
            left = [reply["ttl"]]
        if left:
            with self.lock:
                self.darl_heartbeat_at = min(self.darl_heartbeat_at, self.clock() + max(min(left), 0.0) / 3)

    def darl_heartbeat_in(self):
        """Seconds until the next DARL heartbeat is due (0 if overdue)."""
        with self.lock:
            return max(0.0, self.darl_heartbeat_at - self.clock())

    def darl_hold(self, meta):
        """Heartbeat an arriving delta's leases in DARL before it is accepted. A lease DARL
        no longer holds for the cluster (expired and reclaimed) is a 409 "lease_lost": its
        blocks are back in the pool, so merging the delta could train them twice; the site
        drops the work. If DARL cannot be reached the delta is accepted all the same: the
        commit after the merge is retried until DARL answers, and a late commit still
        stands while nobody has leased those blocks again (darl_table.LeaseTable.commit)."""
        ids = [l["id"] for l in meta["leases"]]
        if self.darl is None or not ids:
            return
        try:
            reply = self.darl.heartbeat(meta["cluster"], meta["incarnation"], ids)
        except httpd.CallError as e:
            if e.status == 409:         # a stale or departed incarnation: none of its leases stand
                raise Refused(409, f"DARL no longer holds leases {ids} for {meta['cluster']}: {e.reply.get('error', e)}; "
                                   "discard this delta, its blocks are trained again", code="lease_lost",
                              leases=ids) from None
            log(f"fedmom: DARL heartbeat for {meta['cluster']}'s new delta failed ({e}); accepted anyway")
            return
        except (OSError, http.client.HTTPException) as e:
            log(f"fedmom: DARL unreachable for {meta['cluster']}'s new delta ({e}); accepted anyway")
            return
        lost = [x for x in reply.get("leases", ()) if not x.get("valid")]
        if lost:
            why = "; ".join(f"lease {x.get('lease')}: {x.get('reason') or x.get('state')}" for x in lost)
            raise Refused(409, f"DARL no longer holds this delta's leases ({why}): their blocks went back to "
                               "the pool; discard this delta, they are trained again", code="lease_lost",
                          leases=[x.get("lease") for x in lost])
        self._darl_heartbeat_due(reply)

    # ---- reading

    def open_theta(self):
        """(open file, round) of the current theta_global; the file stays readable after a merge."""
        with self.lock:
            return open(os.path.join(self.dir, self.theta_file), "rb"), self.round

    def status(self):
        with self.lock:
            now = self.clock()
            members = [{"cluster": c, "incarnation": m.incarnation, "heard_s_ago": round(now - m.last_seen, 1),
                        "sent": self._responded(c), "metrics": m.metrics} for c, m in sorted(self.members.items())]
            deadline = (None if self.first_delta_at is None
                        else round(self.first_delta_at + self.cfg.round_deadline_s - now, 1))
            return {"round": self.round, "merging": self.merging, "members": members,
                    "pending": sorted(c for c, _ in self.pending), "deadline_in_s": deadline,
                    "outcomes": self._open_outcomes(),
                    "excluded": list(self.excluded), "dropped": list(self.dropped),
                    "pending_commits": len(self.pending_commits),
                    "parameters": sum(int(np.prod(s)) for s in self.specs.values()),
                    "tensors": len(self.specs),
                    "config": {"outer_lr": self.cfg.outer_lr, "outer_momentum": self.cfg.outer_momentum,
                               "round_deadline_s": self.cfg.round_deadline_s,
                               "member_timeout_s": self.cfg.member_timeout_s,
                               "blob": bool(self.cfg.blob_url), "darl": bool(self.cfg.darl)},
                    "recent": list(self.records)[-RECORDS_KEPT:], "events": list(self.events)[-100:]}


def _outcome(cluster, incarnation, base_round, tokens, leases, outcome, merged_into=None, why=None):
    """One delta's fate, as round records, GET /status and heartbeat replies carry it."""
    out = {"cluster": cluster, "incarnation": incarnation, "base_round": base_round, "tokens": tokens,
           "leases": [{"id": l["id"], "end": l.get("end")} for l in leases], "outcome": outcome,
           "merged_into": merged_into}
    if why is not None:
        out["why"] = why
    return out


def _unlink(path):
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _unlink_prefix(path):
    """`path` and the temp files a download made beside it (path.part-...)."""
    d, base = os.path.split(path)
    for fn in os.listdir(d):
        if fn == base or fn.startswith(base + "."):
            _unlink(os.path.join(d, fn))


def _safe_exp(x):
    if x is None:
        return None
    try:
        return math.exp(x)
    except OverflowError:
        return math.inf


def _fmt(v, spec):
    return "-" if v is None else format(v, spec)


def format_record(rec):
    """The one readable log line per merge."""
    per = "; ".join(
        f"{c}: {d['tokens']:,} tok, loss {_fmt(d.get('loss'), '.4f')}, drift {_fmt(d.get('drift'), '.4f')}, "
        f"{_fmt(d.get('tokens_per_s'), ',.0f')} tok/s, MFU {_fmt(d.get('mfu'), '.3f')}, "
        f"{_fmt(d.get('tflops_per_rank'), '.1f')} TFLOP/s/rank, peak {_fmt(d.get('peak_mem_gb'), '.1f')} GB"
        for c, d in sorted(rec["clusters"].items()))
    out = [f"fedmom: merge round {rec['round']}: loss {_fmt(rec['loss'], '.4f')} "
           f"ppl {_fmt(rec['perplexity'], '.2f')} tokens {rec['tokens']:,} "
           f"drift mean {_fmt(rec['drift_mean'], '.4f')} max {_fmt(rec['drift_max'], '.4f')} "
           f"tok/s {_fmt(rec['tokens_per_s'], ',.0f')} wall {rec['wall_s']:.1f} s merge {rec['merge_s']:.1f} s "
           f"({rec['reason']}) | {per}"]
    for d in rec["excluded"]:
        out.append(f"excluded {d['cluster']}: {d['why']}")
    for d in rec["dropped"]:
        out.append(f"dropped {d['cluster']}: {d['why']}")
    if rec["late"]:
        out.append(f"late (not merged) {', '.join(rec['late'])}")
    return " | ".join(out)


# ---------------------------------------------------------------- HTTP

def _refusal(fn):
    """Route wrapper: Refused from the state becomes the HTTP error it names."""
    def wrapped(req):
        try:
            return fn(req)
        except Refused as e:
            raise httpd.HTTPError(e.status, e.reason, **e.extra)
    wrapped.__name__ = fn.__name__
    return wrapped


def make_routes(state, blob_token=None):
    cfg = state.cfg

    def ident(body):
        return httpd.field(body, "cluster", str), httpd.field(body, "incarnation", str)

    def join(req):
        return state.join(*ident(req.json()))

    def heartbeat(req):
        b = req.json()
        after = httpd.field(b, "wait_round_after", int, required=False)
        wait = httpd.field(b, "wait_s", (int, float), required=False, default=0.0)
        return state.heartbeat(*ident(b), b.get("metrics"), after, float(wait))

    def leave(req):
        return state.leave(*ident(req.json()))

    def delta_check(req):
        meta = state.check_delta_meta(req.json())
        return {"ok": True, "round": state.round, "cluster": meta["cluster"]}

    def put_delta(req):
        raw = req.headers.get("X-Delta-Meta")
        if not raw:
            raise httpd.HTTPError(400, "missing X-Delta-Meta header (JSON: cluster, incarnation, base_round, "
                                       "tokens, leases, metrics)")
        try:
            meta = json.loads(raw)
        except ValueError as e:
            raise httpd.HTTPError(400, f"X-Delta-Meta is not JSON: {e}")
        meta = state.check_delta_meta(meta)
        req.content_length()
        part = state.new_part_path()
        try:
            with open(part, "wb") as f:
                for chunk in req.stream():
                    f.write(chunk)
                f.flush()
                if cfg.fsync:
                    os.fsync(f.fileno())
        except BaseException:
            _unlink(part)
            raise
        return state.accept_delta(meta, part)

    def delta_blob(req):
        b = req.json()
        if not cfg.blob_url:
            raise httpd.HTTPError(400, "this server has no blob store: start it with --blob-url, or send inline")
        blob, sha = httpd.field(b, "blob", str), httpd.field(b, "sha256", str)
        if not BLOB_ID_RE.fullmatch(blob):
            raise httpd.HTTPError(400, f"blob id {blob!r} must match [A-Za-z0-9_-][A-Za-z0-9._-]{{0,199}}")
        meta = state.check_delta_meta(b)
        import blobstore
        part = state.new_part_path()
        try:
            got = blobstore.get_file(cfg.blob_url, blob, part, token=blob_token)
        except (httpd.CallError, ValueError) as e:
            _unlink_prefix(part)
            status = 400 if isinstance(e, ValueError) or e.status == 404 else 502
            raise httpd.HTTPError(status, f"blob {blob!r}: {e}")
        except BaseException:
            _unlink_prefix(part)
            raise
        if got != sha:
            _unlink(part)
            raise httpd.HTTPError(400, f"blob {blob!r} has sha256 {got[:16]}..., the request says {sha[:16]}...")
        reply = state.accept_delta(meta, part)
        try:
            httpd.call(cfg.blob_url, "DELETE", f"/blobs/{blob}", token=blob_token)
        except (httpd.CallError, OSError, http.client.HTTPException):
            pass
        return reply

    def theta(req):
        f, rnd = state.open_theta()
        return httpd.Response(file=f, headers={"X-Round": str(rnd)})

    def theta_blob(req):
        if not cfg.blob_url:
            raise httpd.HTTPError(400, "this server has no blob store: start it with --blob-url, or use GET /theta")
        import blobstore
        with state.publish_lock:
            f, rnd = state.open_theta()
            with f:
                if rnd in state.published:
                    return state.published[rnd]
                blob = f"theta-{rnd}"
                # put_file reads by path; /proc/self/fd keeps it on the file we opened under the lock
                info = blobstore.put_file(cfg.blob_url, blob, f"/proc/self/fd/{f.fileno()}", token=blob_token)
            out = {"blob": blob, "sha256": info["sha256"], "round": rnd}
            with state.lock:
                if state.round == rnd:
                    state.published[rnd] = out
            return out

    def round_(req):
        with state.lock:
            return {"round": state.round, "merging": state.merging}

    def page(req):
        return httpd.Response(body=render_page(state.status()).encode(), content_type="text/html; charset=utf-8")

    routes = {("GET", "/health"): lambda req: {"ok": True, "round": state.round},
              ("GET", "/"): page, ("GET", "/status"): lambda req: state.status(), ("GET", "/round"): round_,
              ("POST", "/join"): join, ("POST", "/heartbeat"): heartbeat, ("POST", "/leave"): leave,
              ("POST", "/delta_check"): delta_check, ("PUT", "/delta"): put_delta,
              ("POST", "/delta_blob"): delta_blob, ("GET", "/theta"): theta, ("GET", "/theta_blob"): theta_blob}
    return {k: _refusal(v) for k, v in routes.items()}


def round_loop(state, stop, interval_s=0.5):
    """Background thread 1: drop silent members, close and merge rounds."""
    while not stop.is_set():
        try:
            state.tick()
        except Exception as e:       # keep the loop alive; the log says what went wrong
            log(f"fedmom: round loop error: {type(e).__name__}: {e}")
        with state.lock:
            state.cond.wait(timeout=interval_s)


def darl_loop(state, stop, interval_s=1.0, backoff_s=10.0):
    """Background thread 2: DARL commits and lease heartbeats. Apart from the round loop,
    so an unreachable coordinator (30 s timeouts) never delays a merge."""
    while not stop.is_set():
        ok = True
        try:
            ok = state.darl_tick()
        except Exception as e:
            log(f"fedmom: DARL loop error: {type(e).__name__}: {e}")
            ok = False
        # a backoff never skips a heartbeat that is due: leases may have a 10 s TTL
        stop.wait(interval_s if ok else max(interval_s, min(backoff_s, state.darl_heartbeat_in())))


# ---------------------------------------------------------------- the status page

def _svg_lines(series, width=560, height=160, title=""):
    """Inline SVG: one polyline per (label, color, [(x, y)]); nothing but the stdlib."""
    pts = [p for _, _, ps in series for p in ps if p[1] is not None]
    head = f'<svg width="{width}" height="{height + 30}" xmlns="http://www.w3.org/2000/svg">'
    head += f'<text x="4" y="14" font-size="13">{html.escape(title)}</text>'
    if not pts:
        return head + '<text x="4" y="40" font-size="12">no merges yet</text></svg>'
    x0, x1 = min(p[0] for p in pts), max(p[0] for p in pts)
    y0, y1 = min(p[1] for p in pts), max(p[1] for p in pts)
    sx = (width - 70) / ((x1 - x0) or 1)
    sy = (height - 20) / ((y1 - y0) or 1)
    xy = lambda x, y: (60 + (x - x0) * sx, 20 + height - 20 - (y - y0) * sy)
    body = [f'<text x="2" y="{24}" font-size="11">{y1:.4g}</text>',
            f'<text x="2" y="{height}" font-size="11">{y0:.4g}</text>',
            f'<text x="60" y="{height + 16}" font-size="11">round {x0:g}</text>',
            f'<text x="{width - 80}" y="{height + 16}" font-size="11">round {x1:g}</text>']
    for i, (label, color, ps) in enumerate(series):
        coords = " ".join("%.1f,%.1f" % xy(x, y) for x, y in ps if y is not None)
        body.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{coords}"/>')
        body.append(f'<text x="{width - 150 + 75 * i}" y="14" font-size="11" fill="{color}">{html.escape(label)}</text>')
    return head + "".join(body) + "</svg>"


def _svg_membership(events, now, width=560, row=18):
    """One lane per cluster: a bar for each stretch it was a live member."""
    spans, open_ = {}, {}
    for e in events:
        c = e["cluster"]
        if e["event"] == "join":
            open_[c] = e["t"]
        elif e["event"] in ("leave", "drop") and c in open_:
            spans.setdefault(c, []).append((open_.pop(c), e["t"]))
    for c, t in open_.items():
        spans.setdefault(c, []).append((t, now))
    if not spans:
        return '<p>no membership events yet</p>'
    t0 = min(a for s in spans.values() for a, _ in s)
    sx = (width - 110) / ((now - t0) or 1)
    h = row * len(spans) + 24
    out = [f'<svg width="{width}" height="{h}" xmlns="http://www.w3.org/2000/svg">']
    for i, (c, s) in enumerate(sorted(spans.items())):
        y = 4 + i * row
        out.append(f'<text x="2" y="{y + 12}" font-size="11">{html.escape(c)}</text>')
        for a, b in s:
            out.append(f'<rect x="{100 + (a - t0) * sx:.1f}" y="{y}" width="{max(1.0, (b - a) * sx):.1f}" '
                       f'height="{row - 4}" fill="#4a8"/>')
    out.append(f'<text x="100" y="{h - 4}" font-size="11">{time.strftime("%m-%d %H:%M", time.localtime(t0))}</text>')
    out.append(f'<text x="{width - 80}" y="{h - 4}" font-size="11">now</text></svg>')
    return "".join(out)


def render_page(st):
    recs = st["recent"]
    loss = _svg_lines([("loss", "#c33", [(r["round"], r.get("loss")) for r in recs])], title="token-weighted loss")
    drift = _svg_lines([("mean", "#36c", [(r["round"], r.get("drift_mean")) for r in recs]),
                        ("max", "#c63", [(r["round"], r.get("drift_max")) for r in recs])], title="drift")
    esc = html.escape
    members = "".join(f"<tr><td>{esc(m['cluster'])}</td><td>{esc(m['incarnation'])}</td>"
                      f"<td>{m['heard_s_ago']}</td><td>{'yes' if m['sent'] else 'no'}</td></tr>"
                      for m in st["members"]) or '<tr><td colspan="4">none (waiting for a site)</td></tr>'
    rows = "".join(f"<tr><td>{r['round']}</td><td>{r['tokens']:,}</td><td>{_fmt(r.get('loss'), '.4f')}</td>"
                   f"<td>{_fmt(r.get('perplexity'), '.2f')}</td><td>{_fmt(r.get('drift_mean'), '.4f')}</td>"
                   f"<td>{_fmt(r.get('drift_max'), '.4f')}</td><td>{r['wall_s']:.0f}</td>"
                   f"<td>{esc(', '.join(sorted(r['clusters'])))}</td>"
                   f"<td>{esc('; '.join(d['cluster'] + ': ' + d['why'] for d in r['excluded'] + r['dropped']))}</td></tr>"
                   for r in reversed(recs[-20:]))
    return f"""<!doctype html><html><head><meta charset="utf-8"><meta http-equiv="refresh" content="10">
<title>fedmom round {st['round']}</title><style>body{{font-family:sans-serif;margin:1em}}
td,th{{padding:2px 8px;text-align:left}} table{{border-collapse:collapse}} tr:nth-child(even){{background:#f4f4f4}}</style>
</head><body><h2>FedMom aggregator: round {st['round']}{' (merging)' if st['merging'] else ''}</h2>
<p>{st['parameters']:,} parameters in {st['tensors']} tensors; outer lr {st['config']['outer_lr']},
momentum {st['config']['outer_momentum']}; deltas waiting: {esc(', '.join(st['pending']) or 'none')};
DARL commits owed: {st['pending_commits']}</p>
<h3>members</h3><table><tr><th>cluster</th><th>incarnation</th><th>heard (s ago)</th><th>sent</th></tr>{members}</table>
<div>{loss}</div><div>{drift}</div><h3>membership over time</h3>{_svg_membership(st['events'], time.time())}
<h3>last merges</h3><table><tr><th>round</th><th>tokens</th><th>loss</th><th>ppl</th><th>drift mean</th>
<th>drift max</th><th>wall s</th><th>clusters</th><th>excluded / dropped</th></tr>{rows}</table>
</body></html>"""


def print_status(url, token=None, last=10):
    st = httpd.call(url, "GET", "/status", token=token)
    print(f"round {st['round']}{' (merging)' if st['merging'] else ''}; {st['parameters']:,} parameters; "
          f"outer lr {st['config']['outer_lr']} momentum {st['config']['outer_momentum']}; "
          f"DARL commits owed {st['pending_commits']}")
    print(f"members ({len(st['members'])}):" + ("" if st["members"] else " none"))
    for m in st["members"]:
        print(f"  {m['cluster']:<16} {m['incarnation']:<20} heard {m['heard_s_ago']:>6.1f} s ago  "
              f"{'sent' if m['sent'] else 'training'}")
    if st["deadline_in_s"] is not None:
        print(f"round closes by deadline in {st['deadline_in_s']:.0f} s")
    print("last merges:")
    for r in st["recent"][-last:]:
        print("  " + format_record(r).removeprefix("fedmom: "))


# ---------------------------------------------------------------- main

def serve(cfg, host, port, token, insecure, verbose, private_page, max_body):
    darl = DarlLink(cfg.darl, token) if cfg.darl else None
    state = FedMomState(cfg, darl=darl)
    public = ("/health",) if private_page else ("/health", "/")
    server = httpd.make_server(make_routes(state, blob_token=token), host, port, token, insecure,
                               public=public, max_body=max_body, quiet=not verbose)
    stop = threading.Event()
    threading.Thread(target=round_loop, args=(state, stop), name="fedmom-rounds", daemon=True).start()
    threading.Thread(target=darl_loop, args=(state, stop), name="fedmom-darl", daemon=True).start()
    try:
        httpd.serve_forever(server, f"fedmom round {state.round}")
    finally:
        stop.set()


def _server_parser():
    p = httpd.base_parser(__doc__)
    p.add_argument("--state-dir", required=True, help="where theta, momentum, state.json, rounds.jsonl live")
    p.add_argument("--init", help="initial model (.safetensors, any float dtype); needed on the first start only")
    p.add_argument("--outer-lr", type=float, default=0.7, help="outer learning rate (default 0.7; 1.0 = FedAvg)")
    p.add_argument("--outer-momentum", type=float, default=0.9,
                   help="Nesterov momentum (default 0.9; 0 = FedAvg)")
    p.add_argument("--round-deadline-s", type=float, default=1800.0,
                   help="seconds after a round's first delta before it merges without the rest (default 1800)")
    p.add_argument("--member-timeout-s", type=float, default=300.0,
                   help="seconds without a heartbeat before a member is dropped (default 300)")
    p.add_argument("--blob-url", help="blob store URL (blobstore.py, :29512) for the blob transport (default: none)")
    p.add_argument("--darl", help="DARL coordinator URL (:29510): commit merged leases there (default: none)")
    p.add_argument("--darl-heartbeat-s", type=float, default=30.0,
                   help="longest gap between DARL heartbeats for leases of unmerged deltas, s; a lease "
                        "with a shorter TTL is heartbeated every third of the TTL it has left (default 30)")
    p.add_argument("--private-page", action="store_true", help="require the token for GET / too (default: public)")
    httpd.add_server_args(p, DEFAULT_PORT)
    return p


def main(argv):
    if argv[:1] == ["status"]:
        p = httpd.base_parser(__doc__)
        p.add_argument("status")
        p.add_argument("--url", default=f"http://127.0.0.1:{DEFAULT_PORT}",
                       help=f"aggregator URL (default http://127.0.0.1:{DEFAULT_PORT})")
        p.add_argument("--token-file", default=os.environ.get("PWW_TOKEN_FILE"),
                       help="file holding the bearer token (default: $PWW_TOKEN_FILE, or $PWW_TOKEN)")
        p.add_argument("--last", type=int, default=10, help="how many recent merges to print (default 10)")
        a = p.parse_args(argv)
        try:
            return print_status(a.url, httpd.load_token(a.token_file), a.last)
        except (httpd.CallError, OSError) as e:
            raise SystemExit(f"status: {a.url}: {e}")
    a = _server_parser().parse_args(argv)
    cfg = ServerConfig(a.state_dir, a.init, a.outer_lr, a.outer_momentum, a.round_deadline_s,
                       a.member_timeout_s, a.blob_url, a.darl, a.darl_heartbeat_s).validate()
    serve(cfg, a.host, a.port, httpd.load_token(a.token_file), a.insecure, a.verbose, a.private_page,
          int(a.max_body_mb * 2**20))


if __name__ == "__main__":
    main(sys.argv[1:])
