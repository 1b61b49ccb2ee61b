"""fedmom_state.py - the aggregator's durable state and round protocol, with no HTTP server in it.

Runs on: the central VM, imported by fedmom_server.py (which owns the routes, the round
and DARL loops, the status page and the command line; its docstring says how to start
it and what each endpoint does). Python standard library + numpy + tensorio.py +
fedmom_merge.py + wire.py (a compressed delta is checked and merged as its decoded values) + darl_table.py
(its position sets), and httpc.py's client call for the DARL custody calls (DarlLink);
never imports torch.

FedMomState holds the outer state, the round number, membership, the deltas
spooled for the open round, the DARL commits and aborts still owed and the violation
counters. Its methods (join,
heartbeat, leave, check_delta_meta, accept_delta, tick, darl_tick, status, ...) take and
return plain values and raise Refused(status, reason, **extra) for a request they refuse;
fedmom_server.py turns that into the HTTP reply. ServerConfig is the aggregator's one
config, validated once; errors name the flag to change.


State dir (everything replaced atomically: temp file, fsync, rename, fsync the dir).
The outer state (theta_global, momentum, the residual of --down-wire) lives in memory
(outer_state.OuterState, 4 B/param each); what is durable is what a restart needs to
rebuild it bit for bit:
    ckpt-<r>/                 the checkpoint: theta_global, momentum and residual, fp32, in
                              segments of 64 MiB per array (fedmom_checkpoint.py), each with
                              its round; written every --checkpoint-rounds rounds (and round 0
                              from --init) over the last one's, one segment at a time (<r>: the
                              round the directory was first written at); momentum absent before
                              the first merge and with --outer-momentum 0, residual without
                              --down-wire. An older aggregator's checkpoint, theta-<c>,
                              momentum-<c>, residual-<c>.safetensors, is read and replaced
    state.json                the round and the checkpoint's files, and "log": the Step of
                              every round since (outer_state.Step: its deltas' spool files and
                              the weights they merged with, the outer lr and momentum, the
                              codec and the theta digest it published); a round is durable
                              when its Step is. Also the aggregator's identity and epoch,
                              membership, recent events, the DARL commits and aborts still owed
                              and the violation counters; written LAST, so a SIGKILL at any
                              instant leaves round r or r+1. It records the outer step too
                              (--outer-lr, --outer-momentum: a restart with others is refused
                              unless --accept-config-change), whether DARL custody was used (then
                              a start without --darl is refused) and DARL's block-space digest
    update-<r>.safetensors    with --down-wire: round r's update in that wire format, what a
                              site holding theta of round r-1 downloads instead of theta
                              (theta of round r IS theta of r-1 + its decoded values); state.json's
                              "update" names it with the digests of both thetas (wire.Digest)
    theta-<r>.safetensors     a copy of the current theta, written from memory (not fsync'd) when
                              something asks for it (GET /theta, a blob, theta_file); never needed
                              to restart
    rounds.jsonl              one JSON line per merge (loss, perplexity, drift, outcomes, ...); a
                              start cuts an unfinished last line (a crash mid-append) before
                              state.json's copy of the last record is appended again
    lock                      flock'd by the running fedmom_server (one process per state dir)
    spool/                    deltas accepted for the current round: r<round>_<cluster>_<inc>
                              .safetensors + .json (the .json, written last, is the
                              acceptance; it records the delta's custody state). They
                              survive a restart and are merged then. A compressed delta
                              is kept as it came (its own bytes, not 4 B/param). A merged
                              delta stays while the log names it.
A start loads the checkpoint and replays the log (_rebuild; a replay that ends at another
digest than the round published stops the start; segments of two rounds, from a checkpoint
cut short, are each replayed from their own). A checkpoint, once durable (state.json names
it), removes the deltas of the rounds it covers; a round removes the round before's update
and copy of theta; both remove files after the state lock is released (_remove; a crash
first leaves them to the next start's _clean_dir). The state dir therefore holds one
checkpoint (and one segment more while the next is written), at most --checkpoint-rounds
rounds of deltas, one update and the open round's spool; what is kept and why: kept_files(). The
blob store's copies of theta and the updates are fedmom_server.BlobRetention's (blob_plan,
--keep-rounds).

Custody (with --darl; the aggregator is the coordinator of a two-phase commit, DARL the
participant, darl_server.py's docstring the calls). The aggregator has an identity
(made with the state dir) and an epoch that DARL issues: at start the aggregator
makes a random claim durable, then fences (last epoch held, the process it was bound
to, its durable round, the claim); DARL gives the next epoch only to the state holding
the current one (that epoch unconfirmed or confirmed by that process, and no custody
committed for a round this state lacks), so a stale copy of the state is refused at
every start. The issued epoch is durable with this process's random id (the holder)
before the process confirms it (/fence/confirm) and before any call names it; every
DARL call names both, and DARL refuses any other epoch ("fenced": this process then
stops). A delta accepted for the round is spooled with custody
"unconfirmed", then DARL is asked to take the leases it names into custody for it:
  - held: custody "confirmed"; those blocks are the aggregator's until it commits or
    aborts them; no TTL, steal or site release can touch them.
  - refused (409 lease_lost, custody_aborted): the delta is never merged: refused at
    upload (nothing stored), or excluded and named if the answer comes later.
  - no definitive answer (DARL down, 401/403/404/5xx, a timeout): the delta stays
    unconfirmed and the request is re-sent every --darl-retry-s at most. The round
    rule: a round merges only when every delta in it is confirmed; while one is not,
    the round WAITS for DARL (it never merges around it, and never guesses), and the
    status shows the alarm. Liveness therefore needs DARL back; safety never bends.
A merge makes the round durable together with a commit owed for every merged delta;
an excluded delta whose custody may be held owes an abort. Both are kept in
state.json and re-sent, oldest first, until DARL answers definitively. A commit DARL
refuses (its custody was aborted, or never taken) is counted (refused_commits,
blocks_trained_twice) and shown on /status, the page and the status CLI (exit 1);
an abort DARL performs is counted (aborted_custody), one it refuses because the custody
is committed too (refused_aborts: blocks committed that no merged delta holds). Independently of DARL, a merged
delta whose positions overlap an earlier merged delta's is counted as
blocks_trained_twice from the aggregator's own records. After a restart the
aggregator is issued its new epoch, then aborts any custody DARL holds for it that its
state no longer names (a spool entry lost with the disk).
"""
import collections
import dataclasses
import hashlib
import http.client
import json
import math
import os
import re
import secrets
import threading
import time
import urllib.parse

import numpy as np

import darl_table
import durable
import fedmom_checkpoint
import fedmom_merge
import httpc
import outer_state
import testhooks
from outer_defaults import OUTER_LR, OUTER_MOMENTUM
from fedmom_checkpoint import STATE_FORMAT, write_json
import tensorio
import wire

RECORD_VERSION = 3             # 2: per-delta "outcomes" with their leases; 3: + "delta" and DARL "pieces"
VIOLATIONS = darl_table.VIOLATIONS
EVENTS_KEPT = 500             # membership events kept in state.json (for the page and status)
RECORDS_KEPT = 200            # round records kept in memory (the file keeps all)
CLIP_HISTORY_ROUNDS = 4       # the clip's median also counts the deltas merged in these last rounds
ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
KEEP_ROUNDS = 3               # --keep-rounds default: blobs of the current round and the 2 before it
BUSY_RETRY_S = 5              # Retry-After of a 503 busy: a copy of theta waits for a merge or checkpoint
CHECKPOINT_ROUNDS = 4         # --checkpoint-rounds default: theta, momentum, residual written every 4 rounds
MERGE_PAUSE_ENV = "PWW_FEDMOM_MERGE_PAUSE_S"   # tests: sleep after each merged tensor
KEEP_DELTAS_ENV = "PWW_TEST_KEEP_DELTAS_DIR"   # bench/chaos.py: a hard link of every accepted delta,
                                               # <custody id>.safetensors, for its replay of the merges
METRIC_KEYS = ("loss", "tokens_per_s", "mfu", "tflops_per_rank", "peak_mem_gib", "inner_s",
               "heldout_loss", "heldout_round")     # held-out: the site's last eval of theta_global <round>


def log(msg):
    print(time.strftime("%Y-%m-%d %H:%M:%S ") + msg, flush=True)

# ---------------------------------------------------------------- config

@dataclasses.dataclass
class ServerConfig:
    state_dir: str
    init: str | None = None
    outer_lr: float = OUTER_LR
    outer_momentum: float = OUTER_MOMENTUM
    round_deadline_s: float = 1800.0
    member_timeout_s: float = 300.0
    blob_url: str | None = None
    darl: str | None = None
    darl_retry_s: float = 10.0
    fsync: bool = True
    accept_config_change: bool = False
    ca_file: str | None = None        # CA for https:// darl and blob_url
    clip_factor: float = 10.0         # a delta is scaled to at most this x the median norm (0 = off)
    down_wire: str = "f32"            # f32: sites download theta; else each round's update in this format
    down_wire_block: int = 128        # int8/int4 block of the update (wire.Codec)
    keep_rounds: int = KEEP_ROUNDS    # the blob store keeps this many rounds' theta/update blobs
    checkpoint_rounds: int = CHECKPOINT_ROUNDS   # the outer state is written whole every this many rounds
    threads: int | None = None        # the merge's and the codec's threads (None: $WIRE_THREADS or every core)

    def down_codec(self):
        """The update's wire.Codec, or None (--down-wire f32: sites download the full theta)."""
        if self.down_wire == "f32":
            return None
        try:
            return wire.Codec(self.down_wire, block=self.down_wire_block).validate()
        except ValueError as e:
            raise SystemExit(str(e).replace("--wire", "--down-wire")) from None

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
        if not self.darl_retry_s > 0:
            raise SystemExit(f"--darl-retry-s {self.darl_retry_s} must be > 0 seconds")
        if not (self.clip_factor == 0 or self.clip_factor >= 1) or not math.isfinite(self.clip_factor):
            raise SystemExit(f"--clip-factor {self.clip_factor} must be 0 (off) or >= 1 (10: clip a delta "
                             "to 10 x the median norm)")
        self.down_codec()
        if not (_is_int(self.keep_rounds) and self.keep_rounds >= 1):
            raise SystemExit(f"--keep-rounds {self.keep_rounds} must be an integer >= 1 (default {KEEP_ROUNDS}: the "
                             "blob store keeps the theta and update blobs of the current round and the "
                             f"{KEEP_ROUNDS - 1} before it)")
        if not (_is_int(self.checkpoint_rounds) and self.checkpoint_rounds >= 1):
            raise SystemExit(f"--checkpoint-rounds {self.checkpoint_rounds} must be an integer >= 1 (default "
                             f"{CHECKPOINT_ROUNDS}: theta, momentum and residual are written whole every "
                             f"{CHECKPOINT_ROUNDS} rounds, the rounds between replayed at a restart)")
        if self.threads is not None and not (_is_int(self.threads) and self.threads >= 1):
            raise SystemExit(f"--threads {self.threads} must be an integer >= 1 (default: every core)")
        if self.init is not None and not os.path.isfile(self.init):
            raise SystemExit(f"--init {self.init}: no such file")
        if self.init is not None:          # before the state dir exists: a bad --init leaves nothing behind
            try:
                tensorio.TensorReader(self.init).close()
            except tensorio.FormatError as e:
                raise SystemExit(f"--init {e}; pass the file `train.py --export-init` wrote") from None
        return self


# ---------------------------------------------------------------- durable files

def append_record(path, rec, fsync=True):
    """One line of rounds.jsonl (durable.append_json_line, keys sorted)."""
    durable.append_json_line(path, rec, fsync, sort_keys=True)


def file_sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def init_outer(init_path):
    """theta of round 0 (outer_state.OuterState, no momentum or residual yet) from the init
    file, every tensor as fp32, checked: floating point and finite."""
    with tensorio.TensorReader(init_path) as r:
        bad = [n for n in r.names if r.specs[n][0] not in tensorio.FLOAT_DTYPES]
        if bad:
            raise SystemExit(f"--init {init_path}: tensors {bad[:5]} are not floating point; "
                             "only float tensors can be merged (save the parameters alone)")
        shapes, theta = {n: tuple(r.specs[n][1]) for n in r.names}, {}
        for n in r.names:
            t = np.ascontiguousarray(r.read(n, as_float32=True), np.float32).reshape(-1)
            if not np.isfinite(t).all():
                raise SystemExit(f"--init {init_path}: tensor {n!r} holds NaN or Inf; a global model "
                                 "must start finite")
            theta[n] = t
    return outer_state.OuterState(shapes, theta)


def init_theta(init_path, out_path, fsync=True):
    """theta-0 from the init file as one fp32 tensor file (init_outer's checks)."""
    init_outer(init_path).write("theta", out_path, fsync=fsync)


def structure_digest(specs):
    return hashlib.sha256(json.dumps(sorted((n, list(s)) for n, s in specs.items())).encode()).hexdigest()


# ---------------------------------------------------------------- retention: what the central VM keeps

BLOB_KINDS = ("theta", "update")


def blob_name(aggregator, kind, rnd):
    """The blob store id under which this aggregator publishes round `rnd`'s theta or update:
    its own id first, so runs sharing a store never collide, nor delete each other's blobs."""
    return f"{aggregator}.{kind}-{rnd}"


def blob_plan(ids, aggregator, round_, keep_rounds):
    """The retention rule for the blobs `aggregator` published, at durable round `round_`:
    round s's theta and update are kept while s > round_ - keep_rounds (--keep-rounds), so a
    download that began up to keep_rounds - 1 merges ago can finish or resume; older ones no
    site can use (the server serves only the current round's update, and a site further
    behind takes the full theta: 409 no_update) and go. A round after round_ is kept: one
    published since round_ was read (or, after a state dir was restored from an older copy,
    one this run will replace under its name: fedmom_server's to_blob). Other ids (other
    aggregators', the sites' deltas) are not this aggregator's to judge and are left out.
    -> [{"blob", "kind", "round", "keep", "why"}], oldest round first."""
    pat = re.compile(rf"{re.escape(aggregator)}\.({'|'.join(BLOB_KINDS)})-(\d+)")
    out = []
    for i in ids:
        m = pat.fullmatch(i)
        if not m:
            continue
        kind, s = m.group(1), int(m.group(2))
        if s > round_:
            keep, why = True, f"newer than round {round_}, which this sweep read"
        elif s == round_:
            keep, why = True, f"the current round's {kind}"
        elif s > round_ - keep_rounds:
            keep, why = True, (f"{kind} of one of the last {keep_rounds} rounds (--keep-rounds): a download "
                               f"begun before round {s + 1} merged can finish")
        else:
            keep, why = False, (f"older than the last {keep_rounds} rounds (--keep-rounds): no site can use it, "
                                "one that far behind takes the full theta")
        out.append({"blob": i, "kind": kind, "round": s, "keep": keep, "why": why})
    return sorted(out, key=lambda b: (b["round"], b["kind"]))


# ---------------------------------------------------------------- DARL, the custody participant

DEFINITIVE = frozenset({"lease_lost", "custody_aborted", "unknown_custody", "custody_committed", "fenced"})


@dataclasses.dataclass
class Answer:
    """DARL's answer to one custody call: "ok" (the reply), "refused" (a 409 whose code DARL
    gives only for a decided lease state) or "unknown" (anything else: DARL down, a
    rotated token, a proxy's 404 or 5xx, a timeout) - never a decision."""
    kind: str
    reply: dict
    error: str = ""

    @property
    def code(self):
        return self.reply.get("code")


class DarlLink:
    """The custody calls the aggregator makes (darl_server.py's protocol), each answered
    with an Answer; nothing here retries: the aggregator re-sends what it still owes."""

    def __init__(self, url, token=None, timeout=30.0, ca_file=None):
        self.url, self.token, self.timeout, self.ca_file = url, token, timeout, ca_file

    def _ask(self, method, path, body, key, want):
        try:
            reply = httpc.call(self.url, method, path, body, token=self.token, timeout=self.timeout,
                               ca_file=self.ca_file)
        except httpc.CallError as e:
            if e.status == 409 and e.reply.get("code") in DEFINITIVE:
                return Answer("refused", e.reply, str(e))
            return Answer("unknown", e.reply, f"HTTP {e.status}: {e.reply.get('error', e.reply)}")
        except (OSError, http.client.HTTPException, ValueError, httpc.TLSConfigError) as e:
            return Answer("unknown", {}, f"{type(e).__name__}: {e}")
        if not isinstance(reply, dict) or reply.get(key) != want:
            return Answer("unknown", {}, f"{path}: the reply is not DARL's ({str(reply)[:120]})")
        return Answer("ok", reply)

    def fence(self, aggregator, last_epoch, claim, last_holder=None, round=None):
        body = {"aggregator": aggregator, "last_epoch": last_epoch, "claim": claim}
        body.update({k: v for k, v in (("last_holder", last_holder), ("round", round)) if v is not None})
        return self._ask("POST", "/fence", body,
                         "aggregator", aggregator)

    def confirm_fence(self, aggregator, epoch, claim, holder):
        return self._ask("POST", "/fence/confirm", {"aggregator": aggregator, "epoch": epoch, "claim": claim,
                                                    "holder": holder}, "aggregator", aggregator)

    def custody(self, aggregator, epoch, delta, cluster, incarnation, leases):
        body = {"aggregator": aggregator, "epoch": epoch, "delta": delta, "cluster": cluster,
                "incarnation": incarnation,
                "leases": [{k: v for k, v in (("lease", l["id"]), ("start", l.get("start")), ("end", l.get("end")))
                            if v is not None} for l in leases]}
        return self._ask("POST", "/custody", body, "state", "held")

    def commit(self, aggregator, epoch, delta, round=None):
        body = {"aggregator": aggregator, "epoch": epoch, "delta": delta}
        if round is not None:
            body["round"] = round
        return self._ask("POST", "/custody/commit", body,
                         "state", "committed")

    def abort(self, aggregator, epoch, delta, why):
        return self._ask("POST", "/custody/abort", {"aggregator": aggregator, "epoch": epoch, "delta": delta,
                                                    "why": why[:200]}, "state", "aborted")

    def held(self, aggregator):
        """The custody DARL holds for `aggregator`: an Answer whose reply has "custody"."""
        query = urllib.parse.urlencode({"aggregator": aggregator, "state": "held"})
        try:
            reply = httpc.call(self.url, "GET", f"/custody?{query}", token=self.token, timeout=self.timeout,
                               ca_file=self.ca_file)
        except httpc.CallError as e:
            return Answer("unknown", e.reply, f"HTTP {e.status}: {e.reply.get('error', e.reply)}")
        except (OSError, http.client.HTTPException, ValueError, httpc.TLSConfigError) as e:
            return Answer("unknown", {}, f"{type(e).__name__}: {e}")
        if not isinstance(reply, dict) or not isinstance(reply.get("custody"), list):
            return Answer("unknown", {}, "GET /custody: the reply is not DARL's")
        return Answer("ok", reply)


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
    delta_id: str = ""     # the custody key at DARL: r<round>.<random>
    custody: str = "none"  # none (no --darl) | unconfirmed | confirmed
    pieces: list = dataclasses.field(default_factory=list)   # DARL's [[lease, start, end]] once confirmed
    size: int = -1         # bytes of the spooled file, checked at a restart
    norm: float | None = None     # L2 norm of the delta (float64), measured at acceptance
    accept_s: float = 0.0  # seconds its checks took at acceptance (decoding a compressed delta)
    custody_s: float = 0.0 # seconds DARL took to take its leases into custody at upload (not kept)


class Refused(Exception):
    """A request the state refuses: HTTP status, one-line reason, extra reply fields."""

    def __init__(self, status, reason, **extra):
        super().__init__(reason)
        self.status, self.reason, self.extra = status, reason, extra


def _check_id(value, what):
    if not isinstance(value, str) or not ID_RE.fullmatch(value):
        raise Refused(400, f"{what} must match [A-Za-z0-9][A-Za-z0-9._-]{{0,127}}, got {value!r}")
    return value


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def _lease_id(lease):
    v = lease.get("id", lease.get("lease"))
    return v if _is_int(v) else None


def parse_delta_meta(meta):
    """Check the metadata that comes with a delta; returns a clean dict or raises Refused(400)."""
    if not isinstance(meta, dict):
        raise Refused(400, "delta metadata must be a JSON object")
    out = {"cluster": _check_id(meta.get("cluster"), "cluster"),
           "incarnation": _check_id(meta.get("incarnation"), "incarnation")}
    for key in ("base_round", "tokens"):
        v = meta.get(key)
        if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < 2 ** 63:
            raise Refused(400, f"{key} must be a non-negative integer below 2**63, got {v!r}")
        out[key] = v
    leases = meta.get("leases", [])
    if not isinstance(leases, list) or not all(isinstance(x, dict) and _lease_id(x) is not None
                                               and all(x.get(k) is None or _is_int(x[k]) for k in ("start", "end"))
                                               for x in leases):
        raise Refused(400, "leases must be a list of DARL lease objects, each with an integer 'id' (or 'lease'), "
                           "an optional integer 'start' and an optional integer 'end'")
    out["leases"] = [{"id": _lease_id(x), "end": x.get("end"), **({"start": x["start"]} if _is_int(x.get("start"))
                                                                   else {})} for x in leases]
    if len({l["id"] for l in out["leases"]}) != len(out["leases"]):
        raise Refused(400, "a lease is named twice in one delta's leases")
    metrics = meta.get("metrics")
    metrics = {} if metrics is None else metrics     # absent or null; [] or "" is refused below
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

    def __init__(self, cfg, clock=time.monotonic, wall=testhooks.wall_time, darl=None):
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
        self.checkpointing = False     # a checkpoint holds mem_lock (writing the arrays out)
        self.pending_commits, self.pending_aborts, self.last_record = [], [], None
        self.violations = {k: 0 for k in VIOLATIONS}
        self.inherited = set()        # confirmed delta ids restored from the spool, not yet reconciled
        self.requesting = set()       # delta ids whose custody an upload thread is asking for now
        self.darl_alarm = None        # {"since", "error", "calls"} while DARL gives no definitive answer
        self.fenced = None            # DARL's reason, once it refused this epoch: the process stops
        self.fenced_epoch = self.reconciled = False
        self.process_id = secrets.token_hex(8)   # binds DARL's epoch to this process (/fence/confirm)
        self.custody_used = darl is not None   # sticky in state.json: once DARL held custody, always --darl
        self.fence_claim = None       # the epoch request in flight (durable before it is sent)
        self.fence_lock = threading.Lock()   # one fence at a time: the upload threads and the DARL loop
        self.darl_digest = None       # DARL's block-space digest, from its first fence reply
        self.published = {}           # this round's blobs: name -> {"blob", "sha256", "round"}
        self.update = None            # with --down-wire: {"file", "round", "format", "base_digest", "digest", ...}
        self.ckpt = None              # the checkpoint: {"round", "theta", "momentum", "residual"} (file names)
        self.log = []                 # outer_state.Step of every round since the checkpoint (paths relative)
        self.outer = None             # outer_state.OuterState: theta, momentum, residual of self.round, in memory
        self.mem_lock = threading.Lock()   # the arrays: held by a merge, a checkpoint, writing theta out;
                                           # taken BEFORE self.lock, never after it
        self.replay_error = None      # a rebuild that gave other bits than the round recorded: merges stop
        self.last_checkpoint = None   # {"round", "seconds", "bytes"} of the last one written
        self.checkpoint_retry_at = 0.0    # after a failed checkpoint (a full disk): not before this clock()
        self.publish_lock = threading.Lock()
        self.merge_pause_s = float(os.environ.get(MERGE_PAUSE_ENV, "0") or 0)
        self.keep_deltas = os.environ.get(KEEP_DELTAS_ENV) or None
        self.merge_error = None       # the last merge's failure (a full disk), until one succeeds
        self.records_owed = []        # round records not yet in rounds.jsonl (its append failed)
        os.makedirs(self.spool, exist_ok=True)
        if os.path.exists(self.state_path):
            self._load()
        else:
            self._create()
        self._clean_dir()
        if self.outer is None:                # (a new state dir holds it already: round 0 from --init)
            self._rebuild(at_start=True)
        torn = durable.cut_torn_line(self.rounds_path)
        if torn:
            log(f"fedmom: cut the unfinished last line of {self.rounds_path} ({torn} bytes: a crash mid-append; "
                "state.json, written first, puts that round's record back)")
        records = durable.read_jsonl(self.rounds_path)
        self.merged_positions = darl_table.Intervals()      # every DARL position inside a merged delta
        for rec in records:
            self._add_merged(rec)
        self.records = collections.deque(records, maxlen=RECORDS_KEPT)
        self._repair_rounds_log()
        self.round_opened_at = self.clock()
        if self.darl is not None and self.fence_claim is None:
            self.fence_claim = secrets.token_hex(8)
        self._save()          # the fence claim is durable before DARL is asked for an epoch

    # ---- start-up

    def _create(self):
        if not self.cfg.init:
            raise SystemExit(f"{self.dir} holds no state yet: pass --init MODEL.safetensors for the first start")
        self.outer = init_outer(self.cfg.init)          # the rebuild at the start finds it (no second copy)
        ckpt = fedmom_checkpoint.write_checkpoint(self.outer, self.dir, None, self.cfg.fsync)
        self.round, self.ckpt, self.log = 0, ckpt, []
        self.aggregator_id, self.epoch = f"fedmom-{secrets.token_hex(6)}", 0    # DARL issues epoch 1
        self.holder = None            # the process the state's epoch is bound to (durable before its confirm)
        self.loaded_epoch = 0
        self.specs = dict(self.outer.shapes)
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
        try:
            self.ckpt, self.log = fedmom_checkpoint.read_record(st, self.state_path)
        except ValueError as e:
            raise SystemExit(str(e)) from None
        self.round, self.update = st["round"], st.get("update")
        self._check_custody_mode(st)
        self._check_outer_step(st)
        self.aggregator_id, self.epoch = st["aggregator"], st["epoch"]
        self.holder = st.get("holder")                # None: a state written before holders were kept
        self.loaded_epoch = self.epoch
        self.fence_claim = st.get("fence_claim")      # an ask whose answer may have been lost: repeat it
        self.specs = fedmom_checkpoint.read_shapes(self.dir, self.ckpt)
        self.init_id = st["init"]
        now = self.clock()
        self.members = {c: Member(m["incarnation"], m["joined"], now) for c, m in st["members"].items()}
        self.events.extend(st.get("events", []))
        self.pending_commits = st.get("pending_commits", [])
        self.pending_aborts = st.get("pending_aborts", [])
        self.violations = {k: int(st.get("violations", {}).get(k, 0)) for k in VIOLATIONS}
        self.last_record = st.get("last_record")
        if self.cfg.init:
            self._check_init_matches()
        self._restore_spool()
        log(f"fedmom: resumed {self.dir} at round {self.round} as aggregator {self.aggregator_id} epoch "
            f"{self.epoch}: {len(self.members)} member(s) {sorted(self.members)}, {len(self.pending)} spooled "
            f"delta(s), {len(self.pending_commits)} DARL commit(s) and {len(self.pending_aborts)} abort(s) to send")

    def _check_custody_mode(self, st):
        """A state that used DARL custody keeps using it: without --darl its owed commits would
        never be sent and new deltas would merge with no custody at all."""
        used = st.get("custody") or st.get("pending_commits") or st.get("pending_aborts")
        self.custody_used = self.custody_used or bool(used)
        self.darl_digest = st.get("darl_digest")
        if used and self.darl is None:
            raise SystemExit(f"fedmom_server: {self.state_path} was run with --darl (DARL custody; "
                             f"{len(st.get('pending_commits', []))} commit(s) and {len(st.get('pending_aborts', []))} "
                             "abort(s) owed): restart with --darl URL of the same DARL coordinator; without it "
                             "the owed calls are never sent and new deltas merge with no custody")

    def _check_outer_step(self, st):
        """--outer-lr and --outer-momentum are part of the run: a silent change mid-run would
        change the outer step; --accept-config-change takes the new values from now on."""
        changes = [(flag, st.get(key), new) for flag, key, new in (("--outer-lr", "outer_lr", self.cfg.outer_lr),
                                                                    ("--outer-momentum", "outer_momentum",
                                                                     self.cfg.outer_momentum))
                   if st.get(key) is not None and st[key] != new]
        if not changes:
            return
        diff = "; ".join(f"{flag} was {old}, this start has {new}" for flag, old, new in changes)
        if not self.cfg.accept_config_change:
            keep = " ".join(f"{flag} {old}" for flag, old, _ in changes)
            raise SystemExit(f"fedmom_server: {self.state_path} was run with another outer step ({diff}): restart "
                             f"with {keep}, or add --accept-config-change to apply the new values from round "
                             f"{self.round} on")
        self.event("config", "-", "-", f"--accept-config-change: {diff}")
        log(f"fedmom: --accept-config-change: {diff}; applies from round {self.round} on")

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
        """Accepted deltas of the current round come back; anything else in spool/ goes. An
        accepted delta whose file is gone or cut short is excluded, and the custody its
        leases may be in is aborted (owed to DARL)."""
        now = self.wall()
        for fn in sorted(os.listdir(self.spool)):
            if not fn.endswith(".json"):
                continue
            try:
                with open(os.path.join(self.spool, fn)) as f:
                    m = json.load(f)
                p = Pending(**m)
            except (ValueError, TypeError) as e:
                self._exclude_unreadable(fn, e)
                continue
            if p.base_round != self.round:
                continue
            size = os.path.getsize(p.path) if os.path.exists(p.path) else -2
            if size >= 0 and (p.size < 0 or size == p.size):     # accepted: merge it, live or not
                if p.norm is None:                # spooled before norms were kept
                    p.norm = fedmom_merge.delta_norm(p.path)
                self.pending[(p.cluster, p.incarnation)] = p
                if p.custody == "confirmed" and self.darl is not None:
                    self.inherited.add(p.delta_id)   # merged only once _reconcile saw DARL still holds it
                continue
            why = f"its spooled file {p.path} is missing or damaged ({size} bytes, accepted with {p.size})"
            self._exclude_spooled(p, why, now)
        if self.pending:
            self.first_delta_at = self.clock()
            log(f"fedmom: {len(self.pending)} delta(s) for round {self.round} restored from spool at "
                f"{time.strftime('%H:%M:%S', time.localtime(now))}: {sorted(c for c, _ in self.pending)}")

    def _exclude_unreadable(self, fn, error):
        """A spool acceptance that cannot be read back (written atomically, so disk damage): its
        delta is excluded and named from the file name, r<round>_<cluster>_<incarnation>.json
        ("_" is in no id); custody DARL holds for it is aborted by the reconciliation."""
        parts = fn[:-len(".json")].split("_")
        rnd = parts[0][1:] if len(parts) == 3 and parts[0].startswith("r") else ""
        if not rnd.isdigit() or int(rnd) != self.round:
            log(f"fedmom: !!! unreadable spool entry {fn} of another round removed ({type(error).__name__}: {error})")
            return
        self._exclude({"cluster": parts[1], "incarnation": parts[2], "base_round": self.round, "tokens": 0,
                       "leases": []}, f"its spool entry {fn} cannot be read ({type(error).__name__}: {error}); "
                                      "any custody DARL holds for it is aborted")

    def _clean_dir(self):
        """Remove what a crash left behind: temp files, files of other rounds, stale spool entries,
        a checkpoint of the older layout that a newer one replaced."""
        keep = set(fedmom_checkpoint.checkpoint_files(self.dir, self.ckpt)) | {"state.json", "rounds.jsonl", "spool"}
        if self.update:
            keep.add(self.update["file"])
        for fn in os.listdir(self.dir):
            if fn not in keep and (fn.startswith(("theta-", "momentum-", "merged-", "update-", "residual-"))
                                   or durable.is_tmp(fn)):
                os.unlink(os.path.join(self.dir, fn))
        for d in os.listdir(self.dir):
            path = os.path.join(self.dir, d)
            if not (d.startswith(fedmom_checkpoint.CKPT_DIR) and os.path.isdir(path)):
                continue
            for fn in os.listdir(path):          # a segment a killed checkpoint was writing, or every
                if durable.is_tmp(fn) or d != self.ckpt.get("dir"):      # file of a checkpoint not named
                    os.unlink(os.path.join(path, fn))
            if d != self.ckpt.get("dir"):
                os.rmdir(path)
        live = {p.path for p in self.pending.values()} | {p.meta_path for p in self.pending.values()}
        live |= {os.path.join(self.dir, f) for s in self.log for f in fedmom_checkpoint.step_files(s)}
        for fn in os.listdir(self.spool):
            path = os.path.join(self.spool, fn)
            if path not in live:
                os.unlink(path)

    def _append_record(self, rec=None):
        """rounds.jsonl after the round is durable (state.json holds it as last_record). A
        failed append (a full disk) is owed, appended before the next one."""
        if rec is not None:
            self.records_owed.append(rec)
        while self.records_owed:
            try:
                append_record(self.rounds_path, self.records_owed[0], self.cfg.fsync)
            except OSError as e:
                log(f"fedmom: cannot append to {self.rounds_path} ({e}); {len(self.records_owed)} record(s) "
                    "kept for later (the rounds themselves are durable in state.json)")
                return
            self.records_owed.pop(0)

    def _repair_rounds_log(self):
        """state.json lands before rounds.jsonl: a crash between them loses the line; put it back."""
        rec = self.last_record
        if rec and (not self.records or self.records[-1].get("round", -1) < rec["round"]):
            append_record(self.rounds_path, rec, self.cfg.fsync)
            self.records.append(rec)

    def _save(self):
        """state.json, atomically; the caller holds the lock (or is the constructor)."""
        st = {"format": STATE_FORMAT, "round": self.round, "checkpoint": self.ckpt,
              "log": [s.to_json() for s in self.log], "init": self.init_id,
              "aggregator": self.aggregator_id, "epoch": self.epoch, "holder": self.holder,
              "fence_claim": self.fence_claim,
              "members": {c: {"incarnation": m.incarnation, "joined": m.joined} for c, m in self.members.items()},
              "events": list(self.events), "pending_commits": self.pending_commits,
              "pending_aborts": self.pending_aborts, "violations": self.violations,
              "last_record": self.last_record, "custody": self.custody_used, "darl_digest": self.darl_digest,
              "outer_lr": self.cfg.outer_lr, "outer_momentum": self.cfg.outer_momentum,
              "update": self.update}
        write_json(self.state_path, st, self.cfg.fsync)

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
                try:
                    self._save()
                except BaseException:       # not durable (a full disk): not a member either
                    del self.members[cluster]
                    self.events.pop()
                    raise
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
            m = self._member(cluster, incarnation)
            del self.members[cluster]
            self.event("leave", cluster, incarnation)
            try:
                self._save()
            except BaseException:           # not durable (a full disk): still a member
                self.members[cluster] = m
                self.events.pop()
                raise
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
        # `cluster` may have left or been dropped while its heartbeat long-polled
        return {"round": self.round, "merging": self.merging, "members": sorted(self.members),
                "sent": cluster in self.members and self._responded(cluster),
                "heartbeat_s": round(self.cfg.member_timeout_s / 4, 3),
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
        """Everything about a delta that can be checked before its bytes arrive. A delta of
        0 tokens is refused AND counted as this member's answer (excluded), so the round
        does not wait for it until the deadline."""
        meta = parse_delta_meta(meta)
        with self.lock:
            self._check_current(meta)
            if meta["tokens"] == 0:
                why = "tokens is 0: a delta that trained on nothing has no weight"
                self._exclude(meta, why)
                self.cond.notify_all()
                raise Refused(400, f"{why}; do not send it (this round no longer waits for it)",
                              code="bad_delta", round=self.round)
        if self.darl is not None and not meta["leases"]:
            raise Refused(400, "leases is empty: with --darl every delta names the DARL leases it trained on "
                               "(DARL takes them into custody before the delta can be merged)")
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
        if self.fenced:
            raise Refused(503, f"this aggregator process was fenced by DARL ({self.fenced}) and is stopping; "
                               "send to the aggregator that replaced it")

    def accept_delta(self, meta, part_path):
        """The delta file is fully spooled at `part_path`: check it, spool it, take its leases
        into DARL custody. On a refusal the file is removed and nothing stored changes."""
        try:
            dup = self.duplicate(meta)
            if dup is not None:
                return dup
            t0 = time.monotonic()
            try:
                # a compressed delta is checked as its decoded values and spooled as it came
                norm = fedmom_merge.check_delta_file(part_path, self.specs, self.cfg.threads)
            except fedmom_merge.DeltaRejected as e:
                with self.lock:
                    self._exclude(meta, e.reason)
                raise Refused(e.status, e.reason, code="bad_delta", round=self.round)
            with self.lock:
                self._check_current(meta)               # the round may have closed while we read the file
                dup = self._duplicate(meta)
                if dup is not None:
                    return dup
                p = self._spool(meta, part_path, norm, accept_s=time.monotonic() - t0)
                part_path = None
                self.pending[(p.cluster, p.incarnation)] = p
                self.requesting.add(p.delta_id)
                if self.first_delta_at is None:
                    self.first_delta_at = self.clock()
            try:
                testhooks.fault_point("fedmom.spooled")     # accepted on disk, custody not asked yet
                t0 = time.monotonic()
                if p.custody == "unconfirmed" and (self.fenced_epoch or self._fence()):
                    self._take_custody(p, at_upload=True)
                p.custody_s = time.monotonic() - t0
            finally:
                with self.lock:
                    self.requesting.discard(p.delta_id)
                    self.cond.notify_all()
            with self.lock:
                waiting = sorted(c for c in self.members if not self._responded(c))
                log(f"fedmom: delta from {p.cluster} for round {self.round}: {p.tokens:,} tokens, "
                    f"{len(p.leases)} lease(s), custody {p.custody}; waiting for {waiting or 'nobody'}")
                return {"accepted": True, "round": self.round, "waiting_for": waiting, "custody": p.custody}
        finally:
            if part_path and os.path.exists(part_path):
                os.unlink(part_path)

    def duplicate(self, meta):
        """The reply for a retried delta this round already holds (its first reply was lost), or None."""
        with self.lock:
            self._check_current(meta)
            return self._duplicate(meta)

    def _duplicate(self, meta):
        dup = self.pending.get((meta["cluster"], meta["incarnation"]))
        if dup is None:
            return None
        return {"accepted": True, "duplicate": True, "round": self.round, "custody": dup.custody}

    def _take_custody(self, p, at_upload=False):
        """Ask DARL to hold p's leases for this aggregator; settle p by the answer. At upload a
        refusal is the upload's 409 (nothing stays stored); later it excludes p, named."""
        ans = self.darl.custody(self.aggregator_id, self.epoch, p.delta_id, p.cluster, p.incarnation, p.leases)
        if ans.kind == "ok":
            testhooks.fault_point("fedmom.custody_held")   # DARL holds it, our spool does not say so yet
            with self.lock:
                if self.pending.get((p.cluster, p.incarnation)) is p:
                    p.custody, p.pieces = "confirmed", [x[:3] for x in ans.reply.get("pieces", [])]
                    write_json(p.meta_path, dataclasses.asdict(p), self.cfg.fsync)
                self._darl_answered()
                self.cond.notify_all()
            return
        if ans.kind == "unknown":
            self._not_fenced(ans)
            self._darl_failed(f"custody of {p.cluster}'s delta {p.delta_id}", ans.error)
            return
        why = ans.reply.get("error") or ans.error
        if ans.code == "fenced":
            self._stop_fenced(why)
            if not at_upload:
                return              # the newer process of this aggregator finds the spooled delta
        with self.lock:
            self._darl_answered()
            if self.pending.get((p.cluster, p.incarnation)) is not p:
                return
            del self.pending[(p.cluster, p.incarnation)]
            gone = self._bury([p.path, p.meta_path])
            if not self.pending:
                self.first_delta_at = None
            self.cond.notify_all()
            if not at_upload:
                self._exclude(dataclasses.asdict(p), why)
        self._remove(gone)
        if at_upload and ans.code == "fenced":      # this process is stopping: the upload never happened
            raise Refused(503, f"this aggregator process was fenced by DARL ({why}); send again")
        if at_upload:
            raise Refused(409, why, code="lease_lost", leases=ans.reply.get("leases", [l["id"] for l in p.leases]))

    def _responded(self, cluster):
        """Has the live incarnation of `cluster` sent this round's delta (or had it excluded)?"""
        inc = self.members[cluster].incarnation
        return (cluster, inc) in self.pending or any(
            e["cluster"] == cluster and e["incarnation"] == inc for e in self.excluded)

    def _exclude(self, meta, why):
        if any(e["cluster"] == meta["cluster"] and e["incarnation"] == meta["incarnation"] and e["why"] == why
               for e in self.excluded):
            return                     # the same refusal again (a retry): counted once
        self.excluded.append({"cluster": meta["cluster"], "incarnation": meta["incarnation"], "why": why,
                              "base_round": meta["base_round"], "tokens": meta["tokens"],
                              "leases": meta["leases"]})
        self.event("excluded", meta["cluster"], meta["incarnation"], why)
        log(f"fedmom: EXCLUDED delta from {meta['cluster']} ({meta['incarnation']}) for round {self.round}: {why}")

    def _exclude_spooled(self, p, why, now=None):
        """An accepted delta that will never be merged: excluded, named, and the custody its
        leases may be in owed an abort to DARL (its blocks go back to the pool)."""
        self._exclude({"cluster": p.cluster, "incarnation": p.incarnation, "base_round": p.base_round,
                       "tokens": p.tokens, "leases": p.leases}, why)
        if p.custody != "none":
            self.pending_aborts.append({"delta": p.delta_id, "cluster": p.cluster, "incarnation": p.incarnation,
                                        "why": why, "since": round(self.wall() if now is None else now, 3)})

    def _spool(self, meta, part_path, norm=None, accept_s=0.0):
        # "_" is in no id (ID_RE), so no two (cluster, incarnation) pairs share a name
        base = os.path.join(self.spool, f"r{self.round}_{meta['cluster']}_{meta['incarnation']}")
        p = Pending(meta["cluster"], meta["incarnation"], meta["base_round"], meta["tokens"], meta["leases"],
                    meta["metrics"], base + ".safetensors", base + ".json", self.wall(),
                    delta_id=f"r{self.round}.{secrets.token_hex(8)}",
                    custody="none" if self.darl is None else "unconfirmed", size=os.path.getsize(part_path),
                    norm=norm, accept_s=round(accept_s, 3))
        os.replace(part_path, p.path)
        if self.keep_deltas:           # linked before the acceptance is written: no merged delta without it
            os.makedirs(self.keep_deltas, exist_ok=True)
            try:
                os.link(p.path, os.path.join(self.keep_deltas, p.delta_id + ".safetensors"))
            except FileExistsError:
                pass
        try:
            write_json(p.meta_path, dataclasses.asdict(p), self.cfg.fsync)   # the acceptance
        except BaseException:          # not accepted (a full disk): no delta file left behind either
            durable.unlink(p.path)
            raise
        return p

    def new_part_path(self):
        return os.path.join(self.spool, f".part-{secrets.token_hex(8)}")

    # ---- rounds

    def tick(self):
        """Drop silent members; close and merge the round if it is ready. Returns the new
        round record after a merge, else None. Called by one thread at a time."""
        with self.lock:
            self._append_record()
            self._drop_silent()
            ready = self._ready()
            due = not ready and not self.merging and self._checkpoint_due()
            if not ready and not due:
                return None
            if ready:
                batch, self.merging = list(self.pending.values()), True
            late = sorted(c for c in self.members if not self._responded(c))
            closed_at = self.clock()
        if not due:
            with self.mem_lock:
                rec = self._merge_and_finish(batch, ready, late, closed_at)
            if rec is None or not self._checkpoint_due():
                return rec
        try:                                 # after a round, or due at a start (killed before it was written)
            self.checkpoint()
        except Exception as e:               # the rounds are durable without it: tried again in 30 s
            self.checkpoint_retry_at = self.clock() + 30.0
            log(f"fedmom: checkpoint of round {self.round} FAILED ({type(e).__name__}: {e}); the rounds since "
                f"the last one (round {self.ckpt['round']}) stay logged and are replayed at a restart")
        return None if due else rec

    def _merge_and_finish(self, batch, ready, late, closed_at):
        """tick's merge, under mem_lock: the arrays become the new round's, or are rebuilt."""
        try:
            result, merged, dropped = self._merge(batch)
        except Exception as e:
            return self._merge_failed(e)
        gone = []                            # files no round needs: unlinked once the lock is released
        try:
            with self.lock:
                self.merge_error = None
                for p, why in dropped:           # excluded at the merge: never merged, its custody aborted
                    self._exclude_spooled(p, why)
                    del self.pending[(p.cluster, p.incarnation)]
                    gone += self._bury([p.path, p.meta_path])
                if dropped:
                    try:
                        self._save()             # the aborts owed
                    except OSError as e:         # a restart aborts the custody its state no longer names anyway
                        log(f"fedmom: cannot save state.json ({e}); the aborts owed are kept in memory")
                if merged:
                    try:
                        return self._finish(merged, result, ready, late, closed_at, gone)
                    except Exception as e:  # not durable (state.json on a full disk): as a failed merge
                        self.outer.dirty = True
                        failed = e
                else:
                    self.merging = False
                    if not self.pending:
                        self.first_delta_at = None
                    self.cond.notify_all()
                    return None
        finally:
            self._remove(gone)
        return self._merge_failed(failed)

    def _merge_failed(self, e):
        """A merge, or the save that makes it durable, failed: the arrays go back to the durable
        round, /status says why, and the round is tried again in 30 s."""
        if self.outer.dirty:
            try:
                self._rebuild()
            except Exception:               # replay_error is set: no merge runs until a restart
                pass
        with self.lock:
            self.merging, self.retry_merge_at = False, self.clock() + 30.0
            self.merge_error = f"{type(e).__name__}: {e}"
            self.cond.notify_all()
        log(f"fedmom: merge of round {self.round} FAILED ({type(e).__name__}: {e}); "
            "state unchanged, retrying in 30 s")
        return None

    def _ready(self):
        """Why the round may merge now, or None. Never while a delta's custody is unconfirmed:
        the round waits for DARL's word on it (see the module docstring)."""
        if (self.merging or not self.pending or self.clock() < self.retry_merge_at or self.fenced
                or self.replay_error):
            return None
        if self._custody_waiting():
            return None
        if self.inherited and not self.reconciled:
            return None             # a delta spooled by an earlier process, which DARL may no longer hold
        waiting = [c for c in self.members if not self._responded(c)]
        if not waiting:
            return "every live member sent its delta"
        if self.clock() - self.first_delta_at >= self.cfg.round_deadline_s:
            return f"deadline of {self.cfg.round_deadline_s:g} s passed without {sorted(waiting)}"
        return None

    def _custody_waiting(self):
        return sorted(p.cluster for p in self.pending.values() if p.custody == "unconfirmed")

    def _clip(self, batch):
        """The robust rule (fedmom_merge.clip_scales): scale per delta and the record's "clip"."""
        history = [c["delta_norm"] for rec in list(self.records)[-CLIP_HISTORY_ROUNDS:]
                   for c in rec.get("clusters", {}).values() if c.get("delta_norm")]
        scales, limit = fedmom_merge.clip_scales([p.norm or 0.0 for p in batch], history, self.cfg.clip_factor)
        clipped = [{"cluster": p.cluster, "incarnation": p.incarnation, "norm": p.norm, "scale": round(c, 6)}
                   for p, c in zip(batch, scales) if c < 1.0]
        for c in clipped:
            log(f"fedmom: CLIPPED delta from {c['cluster']} ({c['incarnation']}) for round {self.round}: "
                f"norm {c['norm']:.4g} > {self.cfg.clip_factor:g} x the median norm; scaled by {c['scale']:.4g}")
        return scales, {"factor": self.cfg.clip_factor, "limit": limit, "clipped": clipped}

    def _merge(self, batch):
        """The merge, robustly: deltas clipped to the limit, and merged again while the
        merged theta or momentum would not be finite - without the largest contribution,
        or with the momentum reset when the old momentum alone overflows. The caller holds
        mem_lock; the arrays in memory (self.outer) become round+1's (outer_state.apply_round),
        and a failed try rebuilds them first (_rebuild).
        -> (stats or None, the deltas merged, [(delta, why excluded)])."""
        live, dropped, reset = list(batch), [], None
        new, mu = self.round + 1, self.cfg.outer_momentum
        codec = self.cfg.down_codec()
        while live:
            total = sum(p.tokens for p in live)
            shares = [p.tokens / total for p in live]
            scales, clip = self._clip(live)
            step = outer_state.Step(new, [(os.path.relpath(p.path, self.dir), w * c)
                                          for p, w, c in zip(live, shares, scales)],
                                    self.cfg.outer_lr, mu, bool(reset) or mu == 0 or self.outer.momentum is None, codec)
            t0 = self.clock()
            try:
                stats = outer_state.apply_round(
                    self.outer, fedmom_checkpoint.resolved(step, self.dir), codec and os.path.join(self.dir, f"update-{new}.safetensors"),
                    {"round": str(new)}, self.cfg.fsync, self.cfg.threads, after_tensor=self._after_tensor)
            except fedmom_merge.NonFinite as e:
                self._rebuild()                     # the arrays are half merged: back to round self.round
                if not step.fresh and outer_state.momentum_alone_overflows(self.outer, e.name, self.cfg.outer_lr, mu):
                    reset = (f"{e}, with every delta zero: the momentum buffer of round {self.round} is reset "
                             "(this round steps as the first one did)")
                    log(f"fedmom: MOMENTUM RESET at the merge of round {self.round}: {reset}")
                    continue
                worst = max(zip(live, shares, scales), key=lambda x: x[1] * x[2] * (x[0].norm or 0.0))[0]
                why = (f"{e}: this delta (norm {worst.norm:.4g}), the largest contribution, is excluded "
                       "and the round merged without it")
                log(f"fedmom: EXCLUDED delta from {worst.cluster} ({worst.incarnation}) at the merge of round "
                    f"{self.round}: {why}")
                live.remove(worst)
                dropped.append((worst, why))
                continue
            step.digest = self.outer.digest
            update = codec and {"file": f"update-{new}.safetensors", "round": new, "format": codec.fmt,
                                **stats["published"]}
            stats.update(merge_s=self.clock() - t0, weights=shares, scales=scales, clip=clip, momentum_reset=reset,
                         update=update, step=step)
            return stats, live, dropped
        return None, [], dropped

    def _after_tensor(self, name):
        if self.merge_pause_s:
            time.sleep(self.merge_pause_s)
        testhooks.fault_point("fedmom.merge")

    def _rebuild(self, at_start=False):
        """self.outer from the checkpoint's files and the Steps logged since, each replayed and
        checked against the theta digest it published (fedmom_checkpoint.rebuild). At the start
        a mismatch stops the server; later (rebuilding after a failed merge) it stops the merges
        and shows on /status."""
        c, t0 = self.ckpt, time.monotonic()
        try:
            outer = fedmom_checkpoint.rebuild(self.dir, c, self.log, self.cfg.threads)
        except Exception as e:         # a mismatch, a missing or damaged file, a non-finite replay
            if self.outer is not None:
                self.outer.dirty = True    # whatever it holds is not a durable round: never served
            why = (f"the outer state of round {self.round} cannot be rebuilt from the checkpoint of round "
                   f"{c['round']} and the {len(self.log)} round(s) logged since: {type(e).__name__}: {e}")
            if at_start:
                raise SystemExit(f"fedmom_server: !!! {why}. Nothing was changed; restore the state dir from a "
                                 "backup, or keep it for a bug report")
            log(f"fedmom: !!! {why}; merges stop")
            self.replay_error = why
            raise
        if outer.round != self.round:
            raise SystemExit(f"fedmom_server: !!! state.json is at round {self.round} but its checkpoint "
                             f"(round {c['round']}) and log reach round {outer.round}")
        self.outer = outer
        if self.log:
            log(f"fedmom: replayed rounds {self.log[0].round}-{self.log[-1].round} from the checkpoint of round "
                f"{c['round']} in {time.monotonic() - t0:.1f} s; theta digest {outer.digest[:12]}... as recorded")

    def _copy(self, which):
        """(file name or None, round) of `which` ("theta", "momentum") of the current round as a
        file of the state dir: one already on disk (the checkpoint's, or a copy), else written
        from memory (not durable, not needed for a restart: a copy to read; None when no
        momentum is kept). Never waits for the arrays: a merge or a checkpoint holds mem_lock for
        seconds to minutes, and a download waiting there would hold an HTTP worker all that time
        (enough of them and heartbeats and /status wait too): while one runs (self.merging,
        self.checkpointing), 503 busy, and the client retries; the bookkeeping around them and
        another copy being written are waited for. The copy is written holding mem_lock (the
        arrays and the round cannot change) but not the state lock."""
        with self.lock:
            rnd, fn = self.round, f"{which}-{self.round}.safetensors"
            if os.path.exists(os.path.join(self.dir, fn)):
                return fn, rnd
        while not self.mem_lock.acquire(timeout=0.05):   # held by a merge, a checkpoint, or their bookkeeping
            with self.lock:
                if self.merging or self.checkpointing:
                    raise Refused(503, f"the {which} of round {rnd} is not on disk and the outer state is busy "
                                       f"({'a merge' if self.merging else 'a checkpoint'}); retry in a few seconds",
                                  code="busy", round=rnd, retry_after_s=BUSY_RETRY_S)
        try:
            with self.lock:
                rnd, fn = self.round, f"{which}-{self.round}.safetensors"
                if self.outer is None or self.outer.dirty or self.outer.round != rnd:
                    raise Refused(503, f"the outer state of round {rnd} is not in memory "
                                       f"({self.replay_error or 'being rebuilt'}); see GET /status",
                                  code="unavailable", round=rnd)
                if which == "momentum" and self.outer.momentum is None:
                    return None, rnd
            if not os.path.exists(os.path.join(self.dir, fn)):
                self.outer.write(which, os.path.join(self.dir, fn), fsync=False)
            return fn, rnd
        finally:
            self.mem_lock.release()

    @property
    def theta_file(self):
        """theta_global of the current round as a file of the state dir (written on demand; _copy)."""
        return self._copy("theta")[0]

    @property
    def momentum_file(self):
        """The momentum buffer of the current round as a file (on demand; None when none is kept)."""
        return self._copy("momentum")[0]

    def _checkpoint_due(self):
        return (self.outer is not None and not self.outer.dirty and self.outer.round == self.round
                and self.clock() >= self.checkpoint_retry_at
                and self.round - self.ckpt["round"] >= self.cfg.checkpoint_rounds)

    def checkpoint(self, force=False):
        """Write theta, momentum and residual of the current round, durable, segment by segment
        over the last checkpoint's (fedmom_checkpoint.write_checkpoint: the disk holds one
        checkpoint and one segment more); once every segment is written, state.json names the
        new checkpoint and the logged rounds' deltas it covers are removed (outside the locks).
        Called after a round when due. -> its round."""
        gone = []
        with self.mem_lock:
            with self.lock:
                if not (force or self._checkpoint_due()) or self.outer.dirty:
                    return None
                rnd, self.checkpointing = self.round, True
            t0 = time.monotonic()
            try:
                record = fedmom_checkpoint.write_checkpoint(self.outer, self.dir, self.ckpt, self.cfg.fsync,
                                                            after_file=lambda: testhooks.fault_point("fedmom.checkpoint"))
            finally:
                with self.lock:
                    self.checkpointing = False
            with self.lock:
                old, old_log = self.ckpt, self.log
                self.ckpt, self.log = record, [s for s in self.log if s.round > rnd]
                try:
                    self._save()
                except BaseException:
                    self.ckpt, self.log = old, old_log
                    raise
                covered = [s for s in old_log if s.round <= rnd]
                gone = [os.path.join(self.dir, f)                         # _clean_dir's, after a crash
                        for f in fedmom_checkpoint.stale_files(self.dir, old, record)]
                gone += self._bury([os.path.join(self.dir, f) for s in covered
                                    for f in fedmom_checkpoint.step_files(s)])
                nbytes = sum(os.path.getsize(os.path.join(self.dir, f))
                             for f in fedmom_checkpoint.checkpoint_files(self.dir, record))
                self.last_checkpoint = {"round": rnd, "seconds": round(time.monotonic() - t0, 3), "bytes": nbytes}
        log(f"fedmom: checkpoint of round {rnd}: {nbytes / 2**30:.2f} GiB in {self.last_checkpoint['seconds']:.1f} s; "
            f"{len(covered)} logged round(s) covered")
        self._remove(gone)
        return rnd

    def _finish(self, batch, stats, reason, late, closed_at, gone):
        """Round `new` becomes durable (state.json, with its Step in the log); the round before's
        update and copies of theta/momentum are appended to `gone`, for the caller to unlink
        once it has released the lock (a crash before that leaves them to _clean_dir at the
        next start). The merged deltas stay in the spool, logged, until a checkpoint covers them."""
        new, old_commits, old_update = self.round + 1, list(self.pending_commits), self.update
        rec = self._record(batch, stats, reason, late, closed_at, new)
        old_violations = dict(self.violations)
        twice = self._count_trained_twice(rec)
        self.log.append(stats["step"])
        self.pending_commits += [{"delta": p.delta_id, "round": new, "cluster": p.cluster,
                                  "incarnation": p.incarnation, "blocks": sum(x[2] - x[1] for x in p.pieces),
                                  "since": round(self.wall(), 3)} for p in batch if p.custody == "confirmed"]
        self.round, old_record, self.last_record = new, self.last_record, rec
        self.update = stats["update"]
        try:
            self._save()                                   # the round becomes durable here
        except BaseException:
            self.round, self.last_record, self.merging, self.update = new - 1, old_record, False, old_update
            self.pending_commits, self.violations = old_commits, old_violations
            self.log.pop()
            raise
        self._add_merged(rec)
        if twice:
            log(f"fedmom: !!! round {new} merged {twice} DARL position(s) that an earlier merged delta already "
                "holds: those blocks are trained twice (blocks_trained_twice)")
        testhooks.fault_point("fedmom.round_durable")   # durable with its commits owed, none sent yet
        self.records.append(rec)
        self._append_record(rec)
        log(format_record(rec))
        ckpt = set(fedmom_checkpoint.checkpoint_files(self.dir, self.ckpt))   # the last round's copies of theta and momentum,
        for fn in [f"theta-{new - 1}.safetensors", f"momentum-{new - 1}.safetensors"] + (    # and its update
                [old_update["file"]] if old_update else []):
            if fn not in ckpt and os.path.exists(os.path.join(self.dir, fn)):
                gone.append(os.path.join(self.dir, fn))
        self.pending, self.excluded, self.dropped = {}, [], []
        self.first_delta_at, self.merging = None, False
        self.round_opened_at = self.clock()
        self.published = {}
        self.cond.notify_all()
        return rec

    def _bury(self, paths):
        """Under the lock: take `paths` off their names at once (a rename frees nothing, so it
        costs nothing) -> the new names, for _remove once the lock is released. A spool entry
        must be gone before the state that no longer names it is saved."""
        out = []
        for path in paths:
            tomb = os.path.join(os.path.dirname(path), f".gone-{secrets.token_hex(8)}")
            try:
                os.replace(path, tomb)
            except FileNotFoundError:
                continue
            out.append(tomb)
        return out

    def _remove(self, paths):
        """Unlink files no round needs any more, OUTSIDE the state lock: freeing a multi-GB
        file takes the file system seconds, which heartbeats and GET /status would wait out."""
        for path in paths:
            testhooks.fault_point("fedmom.unlink")
            if os.path.isdir(path):          # an old checkpoint's directory, its files removed before it
                os.rmdir(path)
            else:
                durable.unlink(path)

    def _record(self, batch, stats, reason, late, closed_at, new):
        total = sum(p.tokens for p in batch)
        clusters = {}
        for p, w, c, dn in zip(batch, stats["weights"], stats["scales"], stats["delta_norms"]):
            drift = dn / stats["theta_norm"] if stats["theta_norm"] > 0 else None
            key = p.cluster if p.cluster not in clusters else f"{p.cluster}@{p.incarnation}"
            clusters[key] = {"incarnation": p.incarnation, "tokens": p.tokens, "weight": round(w, 6),
                             "drift": drift, "delta_norm": p.norm, "clip_scale": round(c, 6), **p.metrics}
        losses = [(p.tokens, p.metrics["loss"]) for p in batch if "loss" in p.metrics]
        ltok = sum(t for t, _ in losses)
        loss = sum(t * l for t, l in losses) / ltok if ltok else None
        drifts = [c["drift"] for c in clusters.values() if c["drift"] is not None]
        tps = [p.metrics["tokens_per_s"] for p in batch if "tokens_per_s" in p.metrics]
        outcomes = [_outcome(p.cluster, p.incarnation, p.base_round, p.tokens, p.leases, "merged", merged_into=new,
                             delta=p.delta_id, pieces=p.pieces)
                    for p in batch]
        outcomes += [o for o in self._open_outcomes() if o["outcome"] == "excluded"]
        return {"v": RECORD_VERSION, "round": new, "base_round": new - 1, "time": round(self.wall(), 3),
                "reason": reason, "tokens": total, "clusters": clusters,
                "loss": loss, "perplexity": _safe_exp(loss),
                "drift_mean": sum(drifts) / len(drifts) if drifts else None,
                "drift_max": max(drifts) if drifts else None,
                "tokens_per_s": sum(tps) if tps else None,
                "wall_s": round(closed_at - self.round_opened_at, 3), "merge_s": round(stats["merge_s"], 3),
                "timings": {"accept_s": [p.accept_s for p in batch], "custody_s": [round(p.custody_s, 3) for p in batch],
                            "merge_s": round(stats["merge_s"], 3)},
                "outcomes": outcomes, "clip": stats["clip"], "momentum_reset": stats["momentum_reset"],
                "excluded": list(self.excluded), "dropped": list(self.dropped), "late": late,
                "members": sorted(self.members), "outer_lr": self.cfg.outer_lr,
                "outer_momentum": self.cfg.outer_momentum,
                "bytes_read": stats["bytes_read"], "bytes_written": stats["bytes_written"],
                "down_wire": stats["update"] and stats["update"]["format"],
                "update_bytes": stats["update"] and stats["update"]["update_bytes"],
                "down_residual_norm": stats["update"] and stats["update"]["residual_norm"]}

    # ---- DARL: custody, commits, aborts (see the module docstring)

    def darl_tick(self):
        """One pass over what DARL still owes an answer to, oldest first: this epoch's fence,
        then (once) the reconciliation of DARL's custody with our books, the custody of
        unconfirmed deltas, the aborts and the commits owed. True when everything owed was
        answered definitively; False when DARL must be asked again later."""
        if self.darl is None or self.fenced:
            return self.darl is None
        if not self.fenced_epoch and not self._fence():
            return False
        if not self.reconciled and not self._reconcile():
            return False
        with self.lock:
            unconfirmed = [p for p in self.pending.values()
                           if p.custody == "unconfirmed" and p.delta_id not in self.requesting]
        for p in unconfirmed:
            self._take_custody(p)
            if p.custody == "unconfirmed" and self.pending.get((p.cluster, p.incarnation)) is p:
                return False
        return self._send_owed("pending_aborts", self._abort_one) and self._send_owed("pending_commits",
                                                                                       self._commit_one)

    def _fence(self):
        """Ask DARL for this process's epoch (DARL issues it; see darl_table.fence)."""
        with self.fence_lock:
            return self.fenced_epoch or self._ask_epoch()

    def _ask_epoch(self):
        if self.fenced:
            return False
        with self.lock:
            if self.fence_claim is None:      # DARL forgot us (not_fenced): a new ask, durable first
                self.fence_claim = secrets.token_hex(8)
                self._save()
            last_epoch, last_holder, durable_round = self.epoch, self.holder, self.round
        ans = self.darl.fence(self.aggregator_id, last_epoch, self.fence_claim, last_holder, durable_round)
        digest = ans.reply.get("digest") if ans.kind == "ok" else None
        if digest and self.darl_digest and digest != self.darl_digest:
            self._stop_fenced(f"DARL at {self.darl.url} leases block space {digest}, but this state's custody is "
                              f"with a DARL of block space {self.darl_digest}: restart with --darl URL of that DARL")
            return False
        if ans.kind == "ok":
            claim = self.fence_claim
            with self.lock:
                self.epoch, self.holder, self.fence_claim = ans.reply["epoch"], self.process_id, None
                self.darl_digest = self.darl_digest or digest
                self._save()              # the issued epoch and its holder are durable before the confirm
            testhooks.fault_point("fedmom.epoch_durable")   # epoch and holder durable, the confirm not sent
            # then bind it to this process: a copy of our state taken while the ask was in
            # flight holds the same claim and may have been given the same epoch. This state
            # names this process as the holder from now on, so if the copy confirms first,
            # DARL fences this state at every later ask (darl_table.fence)
            ans = self.darl.confirm_fence(self.aggregator_id, self.epoch, claim, self.process_id)
            if ans.kind == "refused":
                self._stop_fenced(ans.reply.get("error", ans.error))
                return False
            if ans.kind != "ok":          # asked again later: a new claim; the next epoch unless another
                #                             process confirmed this one
                self._darl_failed("confirm the fence", ans.error)
                return False
            self.fenced_epoch = True
            log(f"fedmom: DARL knows aggregator {self.aggregator_id} at epoch {self.epoch} "
                f"({ans.reply.get('held', 0)} custody record(s) held)")
            return True
        if ans.kind == "refused":
            self._stop_fenced(ans.reply.get("error", ans.error))
        else:
            self._darl_failed("fence", ans.error)
        return False

    def _reconcile(self):
        """Custody DARL holds for us that our state no longer names (a spool entry lost with
        the disk) would be held forever: abort it. And the converse: a spooled delta our state
        says DARL holds, but DARL does not (another process of this aggregator, from which this
        state was copied, aborted it since: its blocks are back in the pool), is never merged."""
        ans = self.darl.held(self.aggregator_id)
        if ans.kind != "ok":
            self._darl_failed("list our custody", ans.error)
            return False
        with self.lock:
            held = {c["delta"] for c in ans.reply["custody"]}
            tombs, gone = [], [p for p in self.pending.values() if p.delta_id in self.inherited and p.delta_id not in held]
            for p in gone:
                why = ("DARL no longer holds this delta's custody (another process of this aggregator aborted it; "
                       "its blocks went back to the pool)")
                del self.pending[(p.cluster, p.incarnation)]
                tombs += self._bury([p.path, p.meta_path])
                self._exclude(dataclasses.asdict(p), why)
            if gone and not self.pending:
                self.first_delta_at = None
            known = ({p.delta_id for p in self.pending.values()} | {c["delta"] for c in self.pending_commits}
                     | {c["delta"] for c in self.pending_aborts})
            lost = [c for c in ans.reply["custody"] if c["delta"] not in known]
            for c in lost:
                why = "the aggregator's state no longer names this delta (its spool entry is gone)"
                self.pending_aborts.append({"delta": c["delta"], "cluster": c["cluster"],
                                            "incarnation": c["incarnation"], "why": why,
                                            "since": round(self.wall(), 3)})
                log(f"fedmom: !!! DARL holds custody of delta {c['delta']} ({c['cluster']}, {c['blocks']} blocks) "
                    "that this aggregator has no record of: aborting it, its blocks go back to the pool")
            if lost or gone:
                self._save()
            self.reconciled, self.inherited = True, set()
            self.cond.notify_all()
        self._remove(tombs)
        return True

    def _send_owed(self, kind, send):
        """Send the owed entries of self.<kind> in order until one gets no definitive answer."""
        with self.lock:
            todo = list(getattr(self, kind))
        for entry in todo:
            if not send(entry):
                return False
            with self.lock:
                setattr(self, kind, [c for c in getattr(self, kind) if c["delta"] != entry["delta"]])
                self._save()
        return True

    def _definitive(self, ans, what):
        """Does DARL's answer settle the call? Else it stays owed (the alarm goes up), or
        this process was fenced and stops."""
        if ans.kind == "unknown":
            self._not_fenced(ans)
            self._darl_failed(what, ans.error)
            return False
        if ans.code == "fenced":
            self._stop_fenced(ans.reply.get("error", ans.error))
            return False
        return True

    def _commit_one(self, c):
        ans = self.darl.commit(self.aggregator_id, self.epoch, c["delta"], c.get("round"))
        if not self._definitive(ans, f"commit of {c['cluster']}'s delta {c['delta']} (round {c['round']})"):
            return False
        testhooks.fault_point("fedmom.committed")      # DARL committed it, our state still owes it
        with self.lock:
            self._darl_answered()
            if ans.kind == "refused":
                self.violations["refused_commits"] += 1
                self.violations["blocks_trained_twice"] += int(ans.reply.get("blocks") or 0)
                log(f"fedmom: !!! DARL REFUSED the commit of {c['cluster']}'s delta {c['delta']} merged into round "
                    f"{c['round']}: {ans.reply.get('error', ans.error)} (refused_commits)")
        return True

    def _abort_one(self, c):
        ans = self.darl.abort(self.aggregator_id, self.epoch, c["delta"], c["why"])
        if not self._definitive(ans, f"abort of {c['cluster']}'s delta {c['delta']}"):
            return False
        with self.lock:
            self._darl_answered()
            if ans.kind == "refused":       # custody_committed: DARL counted blocks no round holds
                self.violations["refused_aborts"] += 1
                log(f"fedmom: !!! DARL refused to abort delta {c['delta']}: {ans.reply.get('error', ans.error)}; "
                    "its blocks are committed but inside no merged delta (refused_aborts)")
            elif ans.reply.get("returned"):
                self.violations["aborted_custody"] += 1
                log(f"fedmom: !!! aborted custody of {c['cluster']}'s delta {c['delta']}: {ans.reply['returned']} "
                    f"blocks went back to the pool ({c['why']}) (aborted_custody)")
        return True

    def _not_fenced(self, ans):
        """DARL has no epoch for us (it was restarted on another state dir): ask for one again."""
        if ans.code == "not_fenced":
            self.fenced_epoch = False

    def _darl_failed(self, what, error):
        """No definitive answer from DARL: nothing is decided, the call stays owed, the alarm is up."""
        with self.lock:
            if self.darl_alarm is None:
                self.darl_alarm = {"since": round(self.wall(), 3), "calls": 0}
                log(f"fedmom: !!! DARL gives no definitive answer to the {what}: {error}; kept, re-sent every "
                    f"{self.cfg.darl_retry_s:g} s at most; no round with an unconfirmed delta merges meanwhile")
            self.darl_alarm.update(error=f"{what}: {error}", calls=self.darl_alarm["calls"] + 1)

    def _darl_answered(self):
        if self.darl_alarm is not None:
            log(f"fedmom: DARL answers again (after {self.darl_alarm['calls']} unanswered call(s))")
            self.darl_alarm = None

    def _stop_fenced(self, why):
        with self.lock:
            if self.fenced is None:
                self.fenced = why
                log(f"fedmom: !!! FENCED by DARL: {why}. This process stops; everything it owes DARL stays in "
                    f"{self.state_path} for the aggregator that replaced it")
            self.cond.notify_all()

    def _count_trained_twice(self, rec):
        """Positions of this record's merged deltas already inside an earlier merged delta,
        or named twice in it (from our own records, whatever DARL says); counted."""
        seen, twice = darl_table.Intervals(), 0
        for o in rec["outcomes"]:
            for _, a, b in o.get("pieces") or ():
                twice += self.merged_positions.count(a, b) + seen.union(a, b)
        self.violations["blocks_trained_twice"] += twice
        return twice

    def _add_merged(self, rec):
        for o in rec.get("outcomes", ()):
            if o.get("outcome") == "merged":
                for _, a, b in o.get("pieces") or ():
                    self.merged_positions.union(a, b)

    # ---- reading

    def open_theta(self):
        """(open file, round) of the current theta_global, written from memory first if no copy
        of this round is on disk (503 busy while a merge or checkpoint holds the arrays: _copy);
        the open file stays readable after the next round removes it."""
        while True:
            fn, rnd = self._copy("theta")
            try:
                return open(os.path.join(self.dir, fn), "rb"), rnd
            except FileNotFoundError:        # removed by a round that ended just now: its successor's
                continue

    def open_update(self, base_round, base_digest):
        """(open file, round, digest) of the update from round `base_round` to the current
        round, for a site whose theta of base_round has wire.Digest `base_digest`; the site
        adds it to that theta and gets `digest` (wire.apply_update). Refused 409 no_update
        (download the full theta) unless exactly that update exists."""
        with self.lock:
            u = self.update
            if u is None or u["round"] != self.round:
                why = ("this aggregator publishes no updates (--down-wire f32)" if self.cfg.down_codec() is None
                       else f"round {self.round} has no update (its merge ran without --down-wire)")
            elif base_round != u["round"] - 1:
                why = f"the update of round {u['round']} applies to round {u['round'] - 1}, not {base_round}"
            elif base_digest != u["base_digest"]:
                why = (f"your theta of round {base_round} is not the one the update applies to (digest "
                       f"{str(base_digest)[:12]}... != {u['base_digest'][:12]}...)")
            else:
                return open(os.path.join(self.dir, u["file"]), "rb"), u["round"], u["digest"]
        raise Refused(409, f"{why}: download the full theta_global (GET /theta)", code="no_update",
                      round=self.round)

    def kept_files(self):
        """What the state dir holds and why -> [{"file", "bytes", "why"}]: the checkpoint, the
        deltas of the rounds logged since (a restart replays them), the current round's update
        and copy of theta (when one was written), and the open round's spooled deltas; anything
        else is removed once a later round or checkpoint is durable (module docstring)."""
        out = []
        with self.lock:
            c = self.ckpt["round"]
            if "dir" in self.ckpt:                 # the segments, as one entry
                segs = fedmom_checkpoint.checkpoint_files(self.dir, self.ckpt)
                size = sum(os.path.getsize(os.path.join(self.dir, f)) for f in segs
                           if os.path.exists(os.path.join(self.dir, f)))
                out.append({"file": self.ckpt["dir"] + "/", "bytes": size,
                            "why": f"checkpoint of round {c}: theta_global, the momentum buffer and what the "
                                   f"updates rounded away, in {len(segs)} segments"})
                named = []
            else:
                named = [(self.ckpt["theta"], f"checkpoint of round {c}: theta_global"),
                         (self.ckpt["momentum"], f"checkpoint of round {c}: the momentum buffer"),
                         (self.ckpt["residual"], f"checkpoint of round {c}: what its update rounded away")]
            named += [(p, f"round {s.round}'s merged delta, replayed from the checkpoint at a restart")
                      for s in self.log for p, _ in s.deltas]
            if self.update and self.update["round"] == self.round:
                named += [(self.update["file"], "the current round's update (--down-wire)")]
            named += [(f"theta-{self.round}.safetensors", "a copy of the current theta_global, for downloads")]
            named += [(os.path.relpath(p.path, self.dir), f"{p.cluster}'s delta for the open round {self.round}")
                      for p in self.pending.values()]
        for fn, why in named:
            try:
                out.append({"file": fn, "bytes": os.path.getsize(os.path.join(self.dir, fn)), "why": why})
            except (TypeError, OSError):        # no momentum yet, or a file just replaced
                continue
        return out

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
                    "pending_commits": len(self.pending_commits), "pending_aborts": len(self.pending_aborts),
                    "merge_error": self.merge_error, "replay_error": self.replay_error,
                    "checkpoint": {"round": self.ckpt["round"], "every": self.cfg.checkpoint_rounds,
                                   "logged_rounds": [s.round for s in self.log], "last": self.last_checkpoint},
                    "aggregator": self.aggregator_id, "violations": dict(self.violations),
                    # the epoch this process holds once DARL confirmed it; until then the one its state had
                    "epoch": self.epoch if self.fenced_epoch or self.darl is None else self.loaded_epoch,
                    "darl": {"alarm": self.darl_alarm, "fenced": self.fenced,
                             "custody_waiting": self._custody_waiting() if self.darl else [],
                             "commits_owed": [dict(c) for c in self.pending_commits[:50]],
                             "aborts_owed": [dict(c) for c in self.pending_aborts[:50]]},
                    "parameters": sum(int(np.prod(s)) for s in self.specs.values()),
                    "tensors": len(self.specs),
                    "config": {"outer_lr": self.cfg.outer_lr, "outer_momentum": self.cfg.outer_momentum,
                               "round_deadline_s": self.cfg.round_deadline_s,
                               "member_timeout_s": self.cfg.member_timeout_s,
                               "blob": bool(self.cfg.blob_url), "darl": bool(self.cfg.darl),
                               "darl_retry_s": self.cfg.darl_retry_s, "down_wire": self.cfg.down_wire},
                    "update": self.update and {k: self.update[k] for k in ("round", "format", "update_bytes",
                                                                          "residual_norm")},
                    "recent": list(self.records)[-RECORDS_KEPT:], "events": list(self.events)[-100:]}


def _outcome(cluster, incarnation, base_round, tokens, leases, outcome, merged_into=None, why=None,
             delta=None, pieces=None):
    """One delta's fate, as round records, GET /status and heartbeat replies carry it."""
    out = {"cluster": cluster, "incarnation": incarnation, "base_round": base_round, "tokens": tokens,
           "leases": [{"id": l["id"], "end": l.get("end"), **({"start": l["start"]} if "start" in l else {})}
                      for l in leases],
           "outcome": outcome, "merged_into": merged_into}
    if delta:
        out["delta"] = delta
    if pieces is not None:
        out["pieces"] = [list(x) for x in pieces]
    if why is not None:
        out["why"] = why
    return out


def unlink_with_parts(path):
    """`path` and the temp files a download made beside it (path.part-...)."""
    d, base = os.path.split(path)
    for fn in os.listdir(d):
        if fn == base or fn.startswith(base + "."):
            durable.unlink(os.path.join(d, fn))


def _safe_exp(x):
    if x is None:
        return None
    try:
        return math.exp(x)
    except OverflowError:
        return math.inf


def fmt_num(v, spec):
    return "-" if v is None else format(v, spec)


def format_record(rec):
    """The one readable log line per merge."""
    per = "; ".join(
        f"{c}: {d['tokens']:,} tok, loss {fmt_num(d.get('loss'), '.4f')}, drift {fmt_num(d.get('drift'), '.4f')}, "
        f"{fmt_num(d.get('tokens_per_s'), ',.0f')} tok/s, MFU {fmt_num(d.get('mfu'), '.3f')}, "
        f"{fmt_num(d.get('tflops_per_rank'), '.1f')} TFLOP/s/rank, peak {fmt_num(d.get('peak_mem_gib'), '.1f')} GiB"
        for c, d in sorted(rec["clusters"].items()))
    out = [f"fedmom: merge round {rec['round']}: loss {fmt_num(rec['loss'], '.4f')} "
           f"ppl {fmt_num(rec['perplexity'], '.2f')} tokens {rec['tokens']:,} "
           f"drift mean {fmt_num(rec['drift_mean'], '.4f')} max {fmt_num(rec['drift_max'], '.4f')} "
           f"tok/s {fmt_num(rec['tokens_per_s'], ',.0f')} wall {rec['wall_s']:.1f} s merge {rec['merge_s']:.1f} s "
           f"({rec['reason']}) | {per}"]
    for d in rec["excluded"]:
        out.append(f"excluded {d['cluster']}: {d['why']}")
    for d in rec["dropped"]:
        out.append(f"dropped {d['cluster']}: {d['why']}")
    if rec["late"]:
        out.append(f"late (not merged) {', '.join(rec['late'])}")
    return " | ".join(out)
