"""fedmom_state.py - the aggregator: its protocol core driven with its files, its outer state,
the blob store and DARL; no HTTP server in it.

Used on the central VM by fedmom_server.py, which owns the routes, the round and DARL loops,
the status page and the command line (its docstring says how to start the aggregator;
FEDERATION_GUIDE.md, "Endpoints", what each endpoint does). Standard library + numpy (through outer_state.py); never torch.
Not run on its own.

Its parts, in reading order:
  - ServerConfig, the aggregator's one config, validated once (errors name the flag), and the
    checks a start makes of a state dir (custody mode, the outer step, --init);
  - FedMomState: each route's one call (join, heartbeat, leave, check_delta_meta,
    receive_delta, fetch_delta, accept_delta, tick, darl_tick, status, ...) asks the
    fedmom_round.RoundTable for the decision and does the I/O it needs; plain values in and
    out, fedmom_round.Refused for a refusal (fedmom_server.py makes it the HTTP reply). The
    outer state (theta, momentum, residual) is its outer_state.OuterKeeper's;
  - the books on disk: Ledger (state.json, rounds.jsonl, the lock over the books) and Spool
    (the accepted deltas' files);
  - the blob store: BlobLink (a delta blob fetched, theta and updates published) and
    BlobRetention (the blobs no site can use deleted, --keep-rounds);
  - DARL custody: DarlLink (the calls) and Custodian (what the books owe, sent until answered).

The state dir (every file replaced atomically: temp file, fsync, rename, fsync of the dir):
    state.json    the books (round, members, events, DARL calls owed, violations, identity
                  and epoch), the outer step and flags a restart must match, the checkpoint's
                  record, and "log": the outer_state.Step of every round since it. Written
                  LAST: a SIGKILL at any instant leaves round r or r+1
    ckpt-<r>/     the checkpoint, every --checkpoint-rounds: fp32 segments (outer_state.py)
    rounds.jsonl  one record per merge (fedmom_round.py)
    spool/        the open round's deltas (Spool, below); a merged one stays while the log names it
    update-<r>.safetensors   --down-wire's update of round r, which a site of round r-1 applies
    theta-<r>.safetensors    a copy of theta for downloads, never needed to restart
    lock          flock'd by the running aggregator (one process per state dir)
A start loads the checkpoint and replays the log (OuterKeeper.rebuild). A durable checkpoint
removes the deltas of the rounds it covers, a round the update and theta copy before it, both
after the lock is released; kept_files() says what is kept and why.

The protocol: FEDERATION_GUIDE.md, "Leases (DARL)" (custody: the two-phase commit this
aggregator coordinates, fencing) and "A round, from the site's side".
"""
import collections
import contextlib
import dataclasses
import http.client
import json
import math
import os
import re
import secrets
import threading
import time
import traceback
import urllib.parse

import blob_client
import durable
import fedmom_merge
import fedmom_round
import httpc
import outer_state
import tensorio
import testhooks
import wire
from fedmom_round import DEFINITIVE, OK, REFUSED, UNKNOWN, Answer, Custody, Pending, Refused, format_record
from outer_state import OUTER_LR, OUTER_MOMENTUM, STATE_FORMAT, log, write_json

KEEP_ROUNDS = 3               # --keep-rounds default: blobs of the current round and the 2 before it
CHECKPOINT_ROUNDS = 4         # --checkpoint-rounds default: theta, momentum, residual written every 4 rounds
QUORUM_WITH_PHASE = 0.25      # --quorum default once --phase-s is given (without it: 1, wait for everyone):
                              # the stall of a site of up to 3/4 of the tokens still closes the round
GRACE_FRAC = 0.2              # --grace-frac default: the grace is a fifth of the recent round length


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


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
    down_wire_block: int = 128        # int8/int4/int2 block of the update (wire.Codec)
    keep_rounds: int = KEEP_ROUNDS    # the blob store keeps this many rounds' theta/update blobs
    checkpoint_rounds: int = CHECKPOINT_ROUNDS   # the outer state is written whole every this many rounds
    threads: int | None = None        # the merge's and the codec's threads (None: $WIRE_THREADS or every core)
    merge_procs: int | None = None    # the round's worker processes (fedmom_merge.py; None: every core; 1: none)
    phase_s: float | None = None      # the round cadence offered to every site (None: not offered)
    quorum: float | None = None       # fraction of a round's expected tokens that closes it after the grace
    grace_frac: float = GRACE_FRAC    # the quorum's grace, as a fraction of the recent round length
    memory_gb: float | None = None    # what the aggregator and its workers may hold (None: the machine's)
    outer_dir: str | None = None      # the outer state's file blocks (None: outer_state.OUTER_DIR in the state dir)

    def round_quorum(self):
        """--quorum as the rounds use it: given, else QUORUM_WITH_PHASE with --phase-s (sites on a cadence:
        a straggler costs the others a grace, not a round), else 1 (wait for every live member)."""
        if self.quorum is not None:
            return self.quorum
        return QUORUM_WITH_PHASE if self.phase_s is not None else 1.0

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
        self.validate_cadence()
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
        if self.memory_gb is not None and not (self.memory_gb > 0 and math.isfinite(self.memory_gb)):
            raise SystemExit(f"--memory-gb {self.memory_gb} must be a positive number of GB (default: 3/4 of the "
                             "machine's memory; `fedmom_server.py plan` says what a run needs)")
        if self.merge_procs is not None and not (_is_int(self.merge_procs) and self.merge_procs >= 1):
            raise SystemExit(f"--merge-procs {self.merge_procs} must be an integer >= 1 (default: every core; 1 "
                             "runs the round in the aggregator's own process)")
        if self.init is not None and not os.path.isfile(self.init):
            raise SystemExit(f"--init {self.init}: no such file")
        if self.init is not None:          # before the state dir exists: a bad --init leaves nothing behind
            try:
                tensorio.TensorReader(self.init).close()
            except tensorio.FormatError as e:
                raise SystemExit(f"--init {e}; pass the file `train.py --export-init` wrote") from None
        return self

    def validate_cadence(self):
        """--phase-s, --quorum, --grace-frac (the quorum rule: fedmom_round.Quorum)."""
        if self.phase_s is not None and not (self.phase_s > 0 and math.isfinite(self.phase_s)):
            raise SystemExit(f"--phase-s {self.phase_s} must be a positive number of seconds (the round cadence "
                             "offered to every site), or left out")
        if self.quorum is not None and not 0 < self.quorum <= 1:
            raise SystemExit(f"--quorum {self.quorum} must be a fraction in (0, 1] of the tokens a round expects "
                             f"(default {QUORUM_WITH_PHASE} with --phase-s, else 1: wait for every live member)")
        if not 0 < self.grace_frac <= 1:
            raise SystemExit(f"--grace-frac {self.grace_frac} must be in (0, 1] (default {GRACE_FRAC}: the grace "
                             "after a round's quorum is that fraction of the recent round length)")


# ---------------------------------------------------------------- a start: what a state dir may be resumed with

def check_custody_mode(books, darl, path):
    """A state that used DARL custody keeps using it: without --darl its owed commits would
    never be sent and new deltas would merge with no custody at all."""
    if books.used and darl is None:
        raise SystemExit(f"fedmom_server: {path} was run with --darl (DARL custody; {len(books.commits)} "
                         f"commit(s) and {len(books.aborts)} abort(s) owed): restart with --darl URL of the same "
                         "DARL coordinator; without it the owed calls are never sent and new deltas merge with "
                         "no custody")


def check_outer_step(st, cfg, path, rnd):
    """--outer-lr and --outer-momentum are part of the run: a silent change mid-run would change
    the outer step; --accept-config-change takes the new values from now on -> the change
    accepted ("" for none)."""
    changes = [(flag, st.get(key), new) for flag, key, new in (("--outer-lr", "outer_lr", cfg.outer_lr),
                                                                ("--outer-momentum", "outer_momentum",
                                                                 cfg.outer_momentum))
               if st.get(key) is not None and st[key] != new]
    if not changes:
        return ""
    diff = "; ".join(f"{flag} was {old}, this start has {new}" for flag, old, new in changes)
    if not cfg.accept_config_change:
        keep = " ".join(f"{flag} {old}" for flag, old, _ in changes)
        raise SystemExit(f"fedmom_server: {path} was run with another outer step ({diff}): restart "
                         f"with {keep}, or add --accept-config-change to apply the new values from round "
                         f"{rnd} on")
    log(f"fedmom: --accept-config-change: {diff}; applies from round {rnd} on")
    return diff


def check_init_matches(init, recorded, state_dir, rnd):
    """--init at a restart must be the model the state dir was started from (then it is ignored)."""
    with tensorio.TensorReader(init) as r:
        specs = {n: r.specs[n][1] for n in r.names}
    st = os.stat(init)
    same = outer_state.structure_digest(specs) == recorded["structure"] and (
        (st.st_size, st.st_mtime_ns) == (recorded["size"], recorded["mtime_ns"])
        or outer_state.file_sha256(init) == recorded["sha256"])
    if not same:
        raise SystemExit(f"--init {init} is not the model {state_dir} was started from "
                         f"(sha256 {recorded['sha256'][:12]}...): drop --init to resume this run, "
                         "or use a new --state-dir for a new one")
    log(f"fedmom: --init matches the model this state started from; ignored (resuming round {rnd})")


# ---------------------------------------------------------------- the aggregator

def _part(path, doc):
    """A read-only attribute kept in one of the state's parts: _part("table.round", ...)."""
    owner, name = path.split(".")
    return property(lambda self: getattr(getattr(self, owner), name), doc=doc)


class FedMomState:
    """The aggregator: its books (`table`, a fedmom_round.RoundTable, under `ledger`), its spool,
    its outer state (`keeper`) and, with --darl, its custodian. Plain methods, no HTTP;
    `clock` (monotonic seconds) and `wall` are injectable."""

    round = _part("table.round", "the current (open) round")
    merging = _part("table.merging", "its deltas are being merged")
    members = _part("table.members", "cluster -> fedmom_round.Member")
    pending = _part("table.pending", "(cluster, incarnation) -> fedmom_round.Pending of the open round")
    excluded = _part("table.excluded", "the open round's excluded deltas")
    records = _part("history.records", "the last round records")
    violations = _part("books.violations", "the violation counters")
    pending_commits = _part("books.commits", "the DARL commits owed, oldest first")
    pending_aborts = _part("books.aborts", "the DARL aborts owed, oldest first")
    fenced = _part("books.fenced", "DARL's reason, once it fenced this process")
    epoch = _part("books.epoch", "the epoch DARL issued")
    aggregator_id = _part("books.aggregator", "this aggregator's identity (made with the state dir)")
    lock = _part("ledger.lock", "the lock over the books")
    cond = _part("ledger.cond", "its condition: a round, a delta, a member changed")
    rounds_path = _part("ledger.rounds_path", "rounds.jsonl")
    ckpt = _part("ledger.ckpt", "the checkpoint's record")
    log = _part("ledger.log", "the Step of every round since the checkpoint")
    outer = _part("keeper.outer", "theta, momentum and residual of the round, in memory")
    replay_error = _part("keeper.replay_error", "a rebuild that failed: merges stop")

    def __init__(self, cfg, clock=time.monotonic, wall=testhooks.wall_time, darl=None):
        self.cfg, self.clock, self.wall, self.darl = cfg, clock, wall, darl
        self.dir = os.path.abspath(cfg.state_dir)
        self.table = fedmom_round.RoundTable(cfg.member_timeout_s, cfg.round_deadline_s, custody=darl is not None,
                                             retry_s=cfg.darl_retry_s, say=log, quorum=cfg.round_quorum(),
                                             grace_frac=cfg.grace_frac, phase_s=cfg.phase_s)
        self.books, self.history = self.table.books, self.table.history
        self.ledger = Ledger(self.dir, self.table, cfg.fsync)
        self.ledger.outer_step = (cfg.outer_lr, cfg.outer_momentum)
        self.spool = Spool(os.path.join(self.dir, "spool"), cfg.fsync,
                                        os.environ.get(KEEP_DELTAS_ENV) or None)
        self.keeper = outer_state.OuterKeeper(cfg, self.dir, self.ledger, clock)
        self.custodian = None if darl is None else Custodian(darl, self.ledger, self.spool, wall)
        self.merge_error = None       # the last merge's failure (a full disk), until one succeeds
        # the checks of deltas: weighed in bytes against the budget's share (CheckBudget)
        self.checks = CheckBudget(outer_state.CHECK_BYTES)
        self.follows = Follows()              # POST /delta_blob's fetches and follows, by blob
        if os.path.exists(self.ledger.path):
            self._load()
        else:
            self._create()
        self.keeper.clean_dir()
        self.spool.clean({f for p in self.pending.values() for f in (p.path, p.meta_path)}
                         | self.keeper.logged_files())
        if self.outer is None:                # (a new state dir holds it already: round 0 from --init)
            self.keeper.rebuild(at_start=True)
        self.ledger.read_records()
        self.table.started(self.clock())
        if darl is not None:
            self.books.fence_request(secrets.token_hex(8))
        self.ledger.save()          # the fence claim is durable before DARL is asked for an epoch

    # ---- a start

    def _create(self):
        if not self.cfg.init:
            raise SystemExit(f"{self.dir} holds no state yet: pass --init MODEL.safetensors for the first start")
        L = self.ledger
        L.ckpt, L.log = self.keeper.create(self.cfg.init), []
        L.init_id = outer_state.init_id(self.cfg.init, self.keeper.specs)
        self.books.aggregator = f"fedmom-{secrets.token_hex(6)}"     # DARL issues epoch 1
        self.table.event("init", "-", "-", self.wall(), f"theta-0 from {os.path.basename(self.cfg.init)}")
        L.save()
        log(f"fedmom: new state in {self.dir}: {len(self.keeper.specs)} tensors, "
            f"{sum(math.prod(s) for s in self.keeper.specs.values()):,} parameters, round 0")

    def _load(self):
        st, t = self.ledger.read(), self.table
        t.load(st, self.clock())
        check_custody_mode(self.books, self.darl, self.ledger.path)
        diff = check_outer_step(st, self.cfg, self.ledger.path, t.round)
        if diff:
            t.event("config", "-", "-", self.wall(), f"--accept-config-change: {diff}")
        self.keeper.read_shapes()
        if self.cfg.init:
            check_init_matches(self.cfg.init, self.ledger.init_id, self.dir, t.round)
        self._restore_spool()
        log(f"fedmom: resumed {self.dir} at round {t.round} as aggregator {self.books.aggregator} epoch "
            f"{self.books.epoch}: {len(t.members)} member(s) {sorted(t.members)}, {len(t.pending)} spooled "
            f"delta(s), {len(self.books.commits)} DARL commit(s) and {len(self.books.aborts)} abort(s) to send")

    def _restore_spool(self):
        """Accepted deltas of the current round come back; anything else in spool/ goes. An
        accepted delta whose file is gone or cut short is excluded, and the custody its
        leases may be in is aborted (owed to DARL)."""
        t, now, wall = self.table, self.clock(), self.wall()
        for fn, p in self.spool.accepted():
            if isinstance(p, Exception):
                t.restore_unreadable(fn, p, wall)
            elif p.base_round == t.round:
                size = os.path.getsize(p.path) if os.path.exists(p.path) else -2
                if size >= 0 and (p.size < 0 or size == p.size):     # accepted: merge it, live or not
                    if p.norm is None:                # spooled before norms were kept
                        p.norm = fedmom_merge.delta_norm(p.path)
                    t.restore(p, now)
                else:
                    t.exclude_spooled(p, f"its spooled file {p.path} is missing or damaged ({size} bytes, "
                                         f"accepted with {p.size})", wall)
        if t.pending:
            log(f"fedmom: {len(t.pending)} delta(s) for round {t.round} restored from spool at "
                f"{time.strftime('%H:%M:%S', time.localtime(wall))}: {sorted(c for c, _ in t.pending)}")

    # ---- membership

    def join(self, cluster, incarnation):
        """POST /join: the member's reply, and the outer step the merge takes (a site's
        --overlap-fold eager repeats it locally: FEDERATION_GUIDE.md, "Overlap")."""
        with self.ledger.change() as t:
            reply = self._with_update(t.join(cluster, incarnation, self.clock(), self.wall()))
        return {**reply, "outer": {"lr": self.cfg.outer_lr, "momentum": self.cfg.outer_momentum, "nesterov": True}}

    def heartbeat(self, cluster, incarnation, metrics=None, wait_round_after=None, wait_s=0.0):
        """A member's heartbeat; with wait_round_after it long-polls until the round passes it,
        or wait_s (at most a third of --member-timeout-s)."""
        deadline = self.clock() + min(max(0.0, wait_s), self.cfg.member_timeout_s / 3)
        with self.ledger.lock:
            t = self.table
            m = t.heartbeat(cluster, incarnation, self.clock(), metrics)
            while wait_round_after is not None and t.round <= wait_round_after:
                left = deadline - self.clock()
                if left <= 0 or t.members.get(cluster) is not m:
                    break
                self.ledger.cond.wait(timeout=min(left, 1.0))
            if t.members.get(cluster) is m:
                m.last_seen = self.clock()
            return self._with_update(t.reply(cluster, self.clock()))

    def _with_update(self, reply):
        """A member's reply, with the durable round's update when it has one: {"round",
        "base_digest", "digest"}: a site that followed it (follow_update) while it was merged
        holds exactly that theta when its digest is this one (FEDERATION_GUIDE.md section 4)."""
        u, reply["down_wire"] = self.ledger.update, self.cfg.down_wire      # f32: no update to follow
        if u is not None and u["round"] == reply["round"]:
            reply["update"] = {k: u[k] for k in ("round", "base_digest", "digest")}
        return reply

    def leave(self, cluster, incarnation):
        with self.ledger.change() as t:
            return t.leave(cluster, incarnation, self.wall())

    # ---- deltas: PUT /delta, POST /delta_blob, then accept_delta

    def check_delta_meta(self, meta):
        """The delta's metadata, checked before its bytes arrive (POST /delta_check too)."""
        with self.ledger.change() as t:
            try:
                return t.check_delta(meta, self.clock(), self.wall())
            except Refused:
                self.ledger.wake()           # a refused delta may be its member's answer: the round may close
                raise

    def receive_delta(self, meta, chunks):
        """PUT /delta: the metadata checked first (a refusal reads none of the body), then the
        body (an iterable of bytes) spooled to a part file and accepted (accept_delta)."""
        meta = self.check_delta_meta(meta)
        part = self.spool.receive(chunks)
        return self.accept_delta(meta, part, landed=self.wall())

    def fetch_delta(self, meta, blob, sha256, blobs):
        """POST /delta_blob (post_delta_blob)."""
        return post_delta_blob(self, meta, blob, sha256, blobs)

    def duplicate(self, meta):
        """The reply for a retried delta this round already holds (its first reply was lost), or None."""
        with self.ledger.lock:
            self.table.check_current(meta, self.clock())
            return self.table.duplicate(meta)

    def accept_delta(self, meta, part, checked=None, landed=None):
        """The delta file is fully spooled at `part`: check it (unless `checked` = (its norm,
        the monotonic time of its last byte): a follow checked it as it landed), spool it,
        take its leases into DARL custody. On a refusal the file is removed and nothing stored
        changes. `landed`: the wall time its last byte landed (Pending.landed)."""
        t = self.table
        try:
            dup = self.duplicate(meta)
            if dup is not None:
                return dup
            t0 = time.monotonic() if checked is None else checked[1]
            norm = check_whole(self, meta, part) if checked is None else checked[0]
            with self.ledger.lock:
                t.check_current(meta, self.clock())          # the round may have closed while we read the file
                dup = t.duplicate(meta)
                if dup is not None:
                    return dup
                path, meta_path = self.spool.names(t.round, meta["cluster"], meta["incarnation"])
                p = t.new_pending(meta, secrets.token_hex(8), path, meta_path, os.path.getsize(part), norm,
                                  time.monotonic() - t0, self.wall())
                p.landed = self.wall() if landed is None else landed
                self.spool.keep(part, p)
                part = None
                t.admit(p, self.clock())
            try:
                testhooks.fault_point("fedmom.spooled")     # accepted on disk, custody not asked yet
                t0 = time.monotonic()
                if p.custody == Custody.UNCONFIRMED:
                    self.custodian.take(p, at_upload=True)
                p.custody_s = time.monotonic() - t0
            finally:
                with self.ledger.lock:
                    t.asked(p)
                    self.ledger.wake()
            with self.ledger.lock:
                return t.accepted(p)
        finally:
            self.spool.discard(part)

    # ---- rounds

    def tick(self):
        """Drop silent members; close and merge the round if it is ready. Returns the new
        round record after a merge, else None. Called by one thread at a time."""
        with self.ledger.change() as t:
            self.ledger.append_record()
            t.drop_silent(self.clock(), self.wall())
            ready = None if self.keeper.replay_error else t.ready(self.clock())
            due = not ready and not t.merging and self.keeper.checkpoint_due()
            if not ready and not due:
                return None
            if ready:
                batch, late, closed_at = t.close(self.clock())
                walls = {"closed": self.wall()}
        if due:
            self.keeper.checkpoint_when_due()    # due at a start (killed before it was written)
            return None
        with self.keeper.mem_lock:
            rec = self._merge_and_finish(batch, ready, late, closed_at, walls)
        with self.ledger.lock:
            due = rec is not None and self.keeper.checkpoint_due()
        if due:
            self.keeper.checkpoint_when_due()
        return rec

    def _merge_and_finish(self, batch, reason, late, closed_at, walls):
        """tick's merge, under mem_lock: the arrays become the new round's, or are rebuilt."""
        walls["merge_start"] = self.wall()
        try:
            stats, merged, dropped = self.keeper.merge(batch, self.history.clip_norms())
            walls["merged"] = self.wall()
        except Exception as e:
            traceback.clear_frames(e.__traceback__)     # the failed try's arrays, let go before the rebuild
            return self._merge_failed(e)
        gone = []                            # files no round needs: unlinked once the lock is released
        try:
            with self.ledger.lock:
                self.merge_error = None
                for p, why in dropped:           # excluded at the merge: never merged, its custody aborted
                    self.table.drop_at_merge(p, why, self.wall())
                    gone += outer_state.bury([p.path, p.meta_path])
                if dropped:
                    try:
                        self.ledger.save()       # the aborts owed
                    except OSError as e:         # a restart aborts the custody its state no longer names anyway
                        log(f"fedmom: cannot save state.json ({e}); the aborts owed are kept in memory")
                if not merged:
                    self.table.reopen()
                    self.ledger.wake()
                    return None
                try:
                    return self._finish(merged, stats, reason, late, closed_at, gone, walls)
                except Exception as e:  # not durable (state.json on a full disk): as a failed merge
                    self.outer.dirty = True
                    failed = e
        finally:
            outer_state.remove(gone)
        return self._merge_failed(failed)

    def _finish(self, batch, stats, reason, late, closed_at, gone, walls):
        """Under the ledger's lock: round + 1 becomes durable (state.json, with its Step in the
        log and its commits owed); the round before's update and copies of theta/momentum are
        appended to `gone`, for the caller to unlink once it has released the lock (a crash
        before that leaves them to the next start's clean-up). The merged deltas stay in the
        spool, logged, until a checkpoint covers them."""
        L, t = self.ledger, self.table
        mark, old_update = L.mark(), L.update
        rec = t.finish(batch, stats, reason, late, closed_at, self.wall())
        L.log.append(stats["step"])
        L.update = stats["update"]
        L.save_or_rewind(mark)                             # the round becomes durable here
        testhooks.fault_point("fedmom.round_durable")   # durable with its commits owed, none sent yet
        g = self.keeper.growing
        offered = g.tag["offered"] if g is not None and g.tag["round"] == rec["round"] else None
        rec["exchange"] = fedmom_round.exchange(batch, {**walls, "offered": offered, "durable": self.wall()})
        t.opened(rec, self.clock())
        L.append_record(rec)
        log(format_record(rec))
        gone += self.keeper.past_files(rec["round"], old_update)
        L.wake()
        return rec

    def _merge_failed(self, e):
        """A merge, or the save that makes it durable, failed: the arrays go back to the durable
        round, /status says why, and the round is tried again in fedmom_round.MERGE_RETRY_S."""
        self.keeper.withdraw(f"{type(e).__name__}: {e}")
        if self.outer.dirty:
            try:
                self.keeper.rebuild()
            except Exception:               # replay_error is set: no merge runs until a restart
                pass
        with self.ledger.lock:
            self.table.merge_failed(self.clock())
            self.merge_error = f"{type(e).__name__}: {e}"
            self.ledger.wake()
        log(f"fedmom: merge of round {self.round} FAILED ({type(e).__name__}: {e}); "
            f"state unchanged, retrying in {fedmom_round.MERGE_RETRY_S:g} s")
        return None

    def checkpoint(self, force=False):
        """The outer state of the current round as the checkpoint (OuterKeeper.checkpoint) -> its round."""
        return self.keeper.checkpoint(force)

    def darl_tick(self):
        """One pass of the custody calls owed (Custodian.tick); True without --darl."""
        return self.custodian is None or self.custodian.tick()

    # ---- reading

    def open_theta(self):
        return self.keeper.open_theta()

    def open_update(self, base_round, base_digest):
        return self.keeper.open_update(base_round, base_digest)

    def follow_update(self, base_round, base_digest, wait_s=0.0):
        """GET /theta_update_next: the update from round `base_round` (a theta whose
        wire.Digest is `base_digest`) to the next round, as soon as there are bytes of it:
        ("file", open file, round, digest) once that round is durable (open_update), or
        ("growing", tensorio.Growing) while it is being merged: its bytes as they are written,
        not yet durable (the site checks the digest the round's heartbeat reply names before it
        uses them). None after wait_s (at most a third of --member-timeout-s) with neither."""
        deadline = self.clock() + min(max(0.0, wait_s), self.cfg.member_timeout_s / 3)
        with self.ledger.lock:
            while True:
                u, g = self.ledger.update, self.keeper.growing
                if self.table.round != base_round or (u is not None and u["round"] == base_round + 1):
                    break                                # durable (or past): the file, or no_update
                if g is not None and g.tag["round"] == base_round + 1 and not (g.failed or g.closed):
                    if g.tag["base_digest"] != base_digest:
                        raise Refused(409, f"your theta of round {base_round} is not the one the update being "
                                           f"merged applies to (digest {str(base_digest)[:12]}... != "
                                           f"{g.tag['base_digest'][:12]}...): download the full theta_global",
                                      code="no_update", round=base_round)
                    return "growing", g
                left = deadline - self.clock()
                if left <= 0:
                    return None
                self.ledger.cond.wait(timeout=min(left, 1.0))
        return ("file", *self.open_update(base_round, base_digest))

    @property
    def theta_file(self):
        """theta_global of the current round as a file of the state dir (written on demand)."""
        return self.keeper.copy("theta")[0]

    @property
    def momentum_file(self):
        """The momentum buffer of the current round as a file (on demand; None when none is kept)."""
        return self.keeper.copy("momentum")[0]

    def publish_theta(self, blobs):
        """GET /theta_blob: the current theta in the blob store (`blobs`, BlobLink)."""
        f, rnd = self.open_theta()
        return blobs.publish(blob_name(self.aggregator_id, "theta", rnd), f, rnd)

    def publish_update(self, base_round, base_digest, blobs):
        """GET /theta_update_blob: the update open_update names, in the blob store."""
        f, rnd, digest = self.open_update(base_round, base_digest)
        return {**blobs.publish(blob_name(self.aggregator_id, "update", rnd), f, rnd), "digest": digest}

    def kept_files(self):
        return self.keeper.kept_files()

    def wait(self, timeout, round=None):
        """Until something changes (a round, a delta, a member, DARL's answer) or `timeout`; with
        `round`, not at all once the round is past it."""
        with self.ledger.lock:
            if round is None or self.table.round == round:
                self.ledger.cond.wait(timeout=timeout)

    def round_info(self):
        with self.ledger.lock:
            return {"round": self.table.round, "merging": self.table.merging}

    def status(self):
        """GET /status, less what the server adds (the blob store's retention)."""
        cfg = self.cfg
        with self.ledger.lock:
            return {**fedmom_round.round_status(self.table, self.clock()), **self.keeper.status(), "merge_error": self.merge_error,
                    "config": {"outer_lr": cfg.outer_lr, "outer_momentum": cfg.outer_momentum,
                               "round_deadline_s": cfg.round_deadline_s, "member_timeout_s": cfg.member_timeout_s,
                               "phase_s": cfg.phase_s, "quorum": cfg.round_quorum(), "grace_frac": cfg.grace_frac,
                               "blob": bool(cfg.blob_url), "darl": bool(cfg.darl),
                               "darl_retry_s": cfg.darl_retry_s, "down_wire": cfg.down_wire}}


# ==== the books on disk: Ledger (state.json, rounds.jsonl) and Spool ==============================
# Ledger: the protocol's books (RoundTable) and the outer state's durable record (the checkpoint,
# the Steps logged since it, the --down-wire update) are ONE state.json under one lock. change()
# is the only way the books change: under the lock, and when the change is durable (`changes`
# moved) state.json says it before the lock is released; a failed save puts the books back and
# raises, so nothing is acknowledged that a restart would not find. rounds.jsonl is appended
# after state.json, which holds the last record too: a crash between them loses nothing.
# Spool: spool/r<round>_<cluster>_<incarnation>.safetensors as it came ("_" is in no id, so no
# two deltas share a name) and its acceptance record .json (fedmom_round.Pending), written last:
# the acceptance itself. An upload goes to a part file (.part-<hex>) first, which becomes the
# delta's file once its checks passed, or is removed. Files no round needs are renamed aside
# under the lock (outer_state.bury) and unlinked once it is released (outer_state.remove).

KEEP_DELTAS_ENV = "PWW_TEST_KEEP_DELTAS_DIR"   # bench/chaos.py: a hard link of every accepted delta,
                                               # <custody id>.safetensors, for its replay of the merges


class Ledger:
    """state.json and rounds.jsonl, and the lock (`lock`, `cond`) that guards what they hold:
    `table` (fedmom_round.RoundTable), `ckpt`, `log`, `update` (outer_state's record of
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
            self.ckpt, self.log = outer_state.read_record(st, self.path)
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


# ==== the blob store: a delta blob fetched, theta published, retention ============================
# Names: round r's theta and update are published as <aggregator id>.theta-<r> and
# <aggregator id>.update-<r> (blob_name): the aggregator's id first, so runs sharing a store
# never collide nor delete each other's blobs. A site's delta blob has the site's name; once
# fetched (or refused for good) the aggregator deletes it. fedmom_server.py builds a BlobLink
# and a BlobRetention from --blob-url; blobstore.py's docstring has the store's protocol.

BLOB_KINDS = ("theta", "update")
BLOB_ID_RE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,199}")
BLOB_FETCH_S = 4.0            # POST /delta_blob's download from the store: s without progress, then 502 (the
                              # site holds the request open and repeats a 502 under its own deadline)
BLOB_PUBLISH_S = 90.0         # a theta/update blob put into the store: s without progress (a site's GET waits)
SWEEP_RETRY_S = 30.0          # a sweep of the blob store that failed (store down) is tried again this often
BLOB_CALL_TIMEOUT_S = 30.0    # one listing or DELETE of a sweep; on its own thread, so it delays no merge


def blob_name(aggregator, kind, rnd):
    """The blob store id under which this aggregator publishes round `rnd`'s theta or update."""
    return f"{aggregator}.{kind}-{rnd}"


def blob_plan(ids, aggregator, round_, keep_rounds):
    """The retention rule for the blobs `aggregator` published, at durable round `round_`:
    round s's theta and update are kept while s > round_ - keep_rounds (--keep-rounds), so a
    download that began up to keep_rounds - 1 merges ago can finish or resume; older ones no
    site can use (the server serves only the current round's update, and a site further
    behind takes the full theta: 409 no_update) and go. A round after round_ is kept: one
    published since round_ was read (or, after a state dir was restored from an older copy,
    one this run will replace under its name: BlobLink.publish). Other ids (other
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


def unlink_with_parts(path):
    """`path` and the temp files a download made beside it (path.part-...)."""
    d, base = os.path.split(path)
    for fn in os.listdir(d):
        if fn == base or fn.startswith(base + "."):
            durable.unlink(os.path.join(d, fn))


class CheckBudget:
    """The delta checks running at once, weighed in bytes: take(n) waits while the checks
    running hold more than `cap` - n (one always runs). cap: --memory-gb's share for "a
    delta's check" (outer_state.Budget.fixed, CHECK_BYTES, 32 MiB). A followed delta takes
    one tensor's span at a time (fedmom_merge.DeltaCheck.cost: an int4 span of CHECK_SPAN
    values ~11 MB + 256 KiB a thread), so two or three deltas are checked at once; a whole
    file (check_delta_file) takes all of it, one at a time as before."""

    def __init__(self, cap):
        self.cap, self.used, self.running, self.cond = cap, 0, 0, threading.Condition()

    @contextlib.contextmanager
    def take(self, n):
        with self.cond:
            while self.running and self.used + n > self.cap:
                self.cond.wait()
            self.used, self.running = self.used + n, self.running + 1
        try:
            yield
        finally:
            with self.cond:
                self.used, self.running = self.used - n, self.running - 1
                self.cond.notify_all()


class Follows:
    """POST /delta_blob's fetches and follows running now, by (blob, sha256), and the last KEEP
    follows' answers: a second request of a blob (the site's fallback POST after its follow
    was cut) waits for the first one's answer and gets it (a refusal as it was, an acceptance
    as a duplicate), never a second fetch; when the first was cut (502/503), it fetches."""
    KEEP = 64

    def __init__(self):
        self.cond, self.running, self.answers = threading.Condition(), set(), collections.OrderedDict()

    def claim(self, blob):
        with self.cond:
            if blob in self.running or blob in self.answers:
                return False
            self.running.add(blob)
            return True

    def done(self, blob, out=None, error=None, keep=True):
        with self.cond:
            self.running.discard(blob)
            if keep and (error is None or isinstance(error, Refused) and error.status not in (502, 503)):
                self.answers[blob] = (out, error)
                while len(self.answers) > self.KEEP:
                    self.answers.popitem(last=False)
            self.cond.notify_all()

    def run(self, blob, fetch, again, keep):
        """fetch() -> its answer, unless a request of `blob` (id, sha256) runs or, one that
        followed it (`keep`), ran: then that one's."""
        if not self.claim(blob):
            return self.join(blob, again)
        try:
            out = fetch()
        except BaseException as e:
            self.done(blob, error=e, keep=keep)
            raise
        self.done(blob, out, keep=keep)
        return out

    def join(self, blob, again):
        with self.cond:
            while blob in self.running:
                self.cond.wait()
            got = self.answers.get(blob)
        if got is None:
            return again()
        if got[1] is not None:
            raise got[1]
        return {**got[0], "duplicate": True}


BLOB_FOLLOW_S = 60.0          # a follow's read timeout: the store sends a keep-alive every 20 s (FOLLOW_IDLE_S)


class Follower:
    """A delta blob followed as it lands (BlobLink.follow) into the part file `part`,
    preallocated to `size`: each range written at its offset, the sha256 of the prefix hashed
    as it grows (blob_client.PrefixHasher), the header checked once its bytes are in and each
    tensor once all of its bytes are (fedmom_merge.DeltaCheck, one tensor's span at a time
    within `checks`, a CheckBudget); nothing is read or checked twice. run() returns once the
    store said the upload is complete and the sha256 matched: .norm, .landed (wall time of
    the last byte), .last_byte (monotonic), .checked and .early (tensors checked while bytes
    of the delta were still missing here)."""

    def __init__(self, blobs, blob, part, size, sha256, specs, threads, checks, wall):
        self.blobs, self.blob, self.part, self.size, self.sha256 = blobs, blob, part, size, sha256
        self.specs, self.threads, self.checks, self.wall = specs, threads, checks, wall
        self.covered, self.complete, self.checked, self.early = [], False, 0, 0
        self.norm = self.landed = self.last_byte = None

    def run(self):
        fd = os.open(self.part, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        hasher = None
        try:
            _preallocate(fd, self.size)
            hasher = blob_client.PrefixHasher(self.part, self.size)
            with fedmom_merge.DeltaCheck(self.part, self.specs, self.threads) as c:
                end = self._receive(fd, hasher, c)
                self.landed, self.last_byte, self.complete = self.wall(), time.monotonic(), True
                self._end(end, hasher)
                self._advance(fd, c)
                if c.d is None:
                    c.open()
                for name in c.names:
                    self._check(c, name)
                self.norm = c.norm()
        finally:
            if hasher is not None:
                hasher.close()
            os.close(fd)

    def _receive(self, fd, hasher, c):
        for kind, off, data in self.blobs.follow(self.blob):
            if kind == b"E":
                return data
            if off + len(data) > self.size:
                raise Refused(400, f"blob {self.blob!r} is larger than the request's size {self.size}")
            view, done = memoryview(data), 0
            while done < len(view):
                done += os.pwrite(fd, view[done:], off + done)
            self.covered = blob_client.add_range(self.covered, off, off + len(data))
            hasher.feed(off, view)
            self._advance(fd, c)
        raise Refused(502, f"blob store {self.blobs.url}: the follow of {self.blob!r} ended without its end")

    def _end(self, end, hasher):
        if "gone" in end:
            raise Refused(502, f"blob {self.blob!r}: its upload was {end['gone']} while followed; send it again")
        if end.get("size") != self.size or blob_client.prefix_end(self.covered) < self.size:
            raise Refused(400, f"blob {self.blob!r} has {end.get('size')} bytes, the request says {self.size}")
        got = hasher.result()
        if got != self.sha256 or end.get("sha256") != got:
            raise Refused(400, f"blob {self.blob!r} has sha256 {got[:16]}..., the request says {self.sha256[:16]}...")

    def _advance(self, fd, c):
        """Open the header once its bytes landed, then check each tensor whose bytes all did."""
        if c.d is None:
            have = blob_client.prefix_end(self.covered)
            if have < 8 or have < c.header_bytes(os.pread(fd, 8, 0)):
                return
            c.open()
        for name in c.names:
            if name not in c.sq and not any(blob_client.gaps(self.covered, a, b) for a, b in c.spans[name]):
                self._check(c, name)

    def _check(self, c, name):
        if name in c.sq:
            return
        with self.checks.take(c.cost(name)):
            c.check(name)
        self.checked += 1
        self.early += blob_client.prefix_end(self.covered) < self.size
        testhooks.fault_point("fedmom.check_stream")    # test hook: killed mid-way through a followed check


def post_delta_blob(state, meta, blob, sha256, blobs):
    """POST /delta_blob: the metadata checked first, then the delta fetched from the blob
    store (`blobs`, BlobLink) and accepted (fetch_whole), or with "follow": true (and
    "size") followed while the site uploads it (follow_delta); the blob is deleted once
    fetched, accepted or refused. A retry of a delta this round holds is a duplicate; one
    while a request of the same blob runs gets that one's answer (Follows)."""
    blobs.check_id(blob)
    follow, size = meta.get("follow") is True, meta.get("size")
    if follow and not _is_int(size):
        raise Refused(400, "\"follow\": true needs \"size\": the delta file's bytes")
    meta = state.check_delta_meta(meta)
    dup = state.duplicate(meta)
    if dup is not None:
        return dup
    return state.follows.run((blob, sha256), lambda: (follow_delta if follow else fetch_whole)(
        state, meta, blob, sha256, size, blobs), lambda: post_delta_blob(state, meta, blob, sha256, blobs), follow)


def bad_delta(state, meta, e):
    """The Refused (bad_delta) a fedmom_merge.DeltaRejected answers; the delta is excluded."""
    with state.ledger.lock:
        state.table.exclude(meta, e.reason, state.wall())
    return Refused(e.status, e.reason, code="bad_delta", round=state.table.round)


def check_whole(state, meta, part):
    """check_delta_file of a spooled delta -> its norm. A compressed delta is checked as its
    decoded values and spooled as it came; a whole file takes the check budget's whole share
    (each check already uses every core), so these run one at a time, as before."""
    try:
        with state.checks.take(state.checks.cap):
            return fedmom_merge.check_delta_file(part, state.keeper.specs, state.cfg.threads)
    except fedmom_merge.DeltaRejected as e:
        raise bad_delta(state, meta, e) from None


def fetch_whole(state, meta, blob, sha256, size, blobs):
    """POST /delta_blob after the upload: the whole blob fetched, then checked and accepted."""
    part = state.spool.part()
    got = blobs.fetch(blob, part)
    try:
        if got != sha256:
            state.spool.discard(part)
            raise Refused(400, f"blob {blob!r} has sha256 {got[:16]}..., the request says {sha256[:16]}...")
        return state.accept_delta(meta, part, landed=state.wall())
    finally:                            # fetched: its bytes are in the spool, or refused for good
        blobs.delete(blob)

def follow_delta(state, meta, blob, sha256, size, blobs):
    """POST /delta_blob {"follow": true}: the blob followed and checked as it lands (Follower);
    a bad tensor refuses at once, a cut follow (502) leaves the blob for the site's fallback."""
    part = state.spool.part()
    f = Follower(blobs, blob, part, size, sha256, state.keeper.specs, state.cfg.threads, state.checks,
                 state.wall)
    try:
        try:
            f.run()
        except fedmom_merge.DeltaRejected as e:          # a bad tensor refuses before the last byte
            raise bad_delta(state, meta, e) from None
    except BaseException as e:
        unlink_with_parts(part)
        if not (isinstance(e, Refused) and e.status in (502, 503)):
            blobs.delete(blob)          # refused for good; a cut follow leaves it to the site's fallback
        raise
    try:
        out = state.accept_delta(meta, part, checked=(f.norm, f.last_byte), landed=f.landed)
    finally:
        blobs.delete(blob)
    return {**out, "streamed": {"tensors": f.checked, "before_last_byte": f.early}}


def _preallocate(fd, size):
    if size:
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as e:
            if durable.is_disk_full(e):
                raise
            os.ftruncate(fd, size)          # a file system without fallocate: a sparse file


class BlobLink:
    """The aggregator's calls to the blob store at `url` (--blob-url): fetch a delta blob,
    delete it, publish a file of a round once per name. `retention` (a BlobRetention, or
    None) is told of every blob published."""

    def __init__(self, url, token=None, ca_file=None, retention=None):
        self.url, self.token, self.ca_file, self.retention = url, token, ca_file, retention
        self.published = {}               # blob -> {"blob", "sha256", "round"}, this round and newer
        self.publish_lock = threading.Lock()

    @staticmethod
    def check_id(blob):
        if not BLOB_ID_RE.fullmatch(blob):
            raise Refused(400, f"blob id {blob!r} must match [A-Za-z0-9_-][A-Za-z0-9._-]{{0,199}}")

    def fetch(self, blob, part):
        """Download `blob` into the part file `part` -> its sha256; on any failure nothing is
        left and the refusal says why (502: the store unreachable, send again; 503 disk_full:
        the store's disk; 400: no such blob). A short deadline (BLOB_FETCH_S without progress):
        the site holds this request open and repeats a 502 under its own."""
        try:
            return blob_client.get_file(self.url, blob, part, token=self.token, ca_file=self.ca_file,
                                        deadline=httpc.Deadline(BLOB_FETCH_S, what=f"fetch blob {blob}",
                                                                log=_said))
        except BaseException as e:
            unlink_with_parts(part)
            refusal = self._refusal(blob, e.last if isinstance(e, httpc.GaveUp) else e)
            if refusal is None:
                raise
            raise refusal from None

    def follow(self, blob):
        """The records of `blob` as it lands (blob_client.follow); a failure is the refusal
        fetch() would answer (502: the store unreachable or the stream cut, send again)."""
        try:
            yield from blob_client.follow(self.url, blob, token=self.token, ca_file=self.ca_file,
                                          timeout=BLOB_FOLLOW_S)
        except (httpc.CallError, OSError, http.client.HTTPException, ValueError) as e:
            refusal = self._refusal(blob, e)
            if refusal is None:
                raise
            raise refusal from None

    def _refusal(self, blob, e):
        """The answer to a delta blob the store would not give (what it said last), or None:
        raise `e` as it is (our own spool's full disk is a 507 naming our disk; anything else
        unexpected is a 500)."""
        if isinstance(e, httpc.CallError) and e.status == 507:
            return Refused(503, f"blob store: {e.reply.get('error')}", headers={"Retry-After": "30"},
                           code="disk_full", retry_after_s=30)
        if isinstance(e, (httpc.CallError, ValueError)):
            return Refused(400 if isinstance(e, ValueError) or e.status == 404 else 502, f"blob {blob!r}: {e}")
        if isinstance(e, (OSError, http.client.HTTPException)) and not durable.is_disk_full(e):
            return Refused(502, f"blob store {self.url} unreachable fetching {blob!r} ({type(e).__name__}: {e}); "
                                "nothing was stored, send it again")
        return None

    def delete(self, blob):
        """Delete a fetched delta's blob; best effort (the site's next delta has another name)."""
        try:
            httpc.call(self.url, "DELETE", f"/blobs/{blob}", token=self.token, ca_file=self.ca_file)
        except (httpc.CallError, OSError, http.client.HTTPException):
            pass

    def publish(self, blob, opened, rnd):
        """Put `opened` (a file of round `rnd`, opened by the state) into the store as `blob`,
        once per name -> {blob, sha256, round}; the file is closed."""
        with self.publish_lock, opened as f:
            if blob in self.published:
                return self.published[blob]
            # put_file reads by path; /proc/self/fd keeps it on the file that was opened
            path = f"/proc/self/fd/{f.fileno()}"
            try:
                info = blob_client.put_file(self.url, blob, path, token=self.token, ca_file=self.ca_file,
                                            deadline=_publish_deadline(blob))
            except httpc.CallError as e:
                if e.status in (401, 403):    # a 502 naming the fix, not a 500: this VM's setup, not the site's
                    raise Refused(502, f"the blob store refused the aggregator's token ({e}): give blobstore.py "
                                       "--aggregator-token-file and fedmom_server.py --blob-token-file the same "
                                       "token (central.sh does)") from None
                if e.status != 409 or e.reply.get("retry"):
                    raise
                # a blob of this name with other bytes: left by a run of this state dir that was
                # rolled back (restored from an older copy); this round's file replaces it
                log(f"fedmom: blob {blob} holds other bytes than round {rnd}'s file (a restored state dir?); "
                    "replacing it")
                httpc.call(self.url, "DELETE", f"/blobs/{blob}", token=self.token, ca_file=self.ca_file)
                info = blob_client.put_file(self.url, blob, path, token=self.token, ca_file=self.ca_file,
                                            deadline=_publish_deadline(blob))
            out = {"blob": blob, "sha256": info["sha256"], "round": rnd}
            if self.retention is not None:
                self.retention.published(blob, rnd, info["size"])
            self.published = {b: v for b, v in self.published.items() if v["round"] >= rnd}
            self.published[blob] = out
            return out


def _said(what, err, left):
    log(f"fedmom: {what}: {type(err).__name__}: {err}; retrying ({left:.1f} s left)")


def _publish_deadline(blob):
    return httpc.Deadline(BLOB_PUBLISH_S, what=f"publish blob {blob}", log=_said)


class BlobRetention:
    """The blob store side of the retention rule (blob_plan): after each durable round, and
    once at start, list the store (GET /blobs) and DELETE this aggregator's theta and update
    blobs no site can use. Working from the listing makes it idempotent and leak-free across
    crashes: nothing needs recording before a delete, a blob already gone is a 404 that counts
    as done, and a start sweeps what the last process left. Only the round number is read from
    the state; every call here is made outside the state lock. Test hook (testhooks.fault_point):
    fedmom.blob_delete, each DELETE of a sweep."""

    def __init__(self, url, aggregator, keep_rounds, token=None, ca_file=None):
        self.url, self.aggregator, self.keep = url, aggregator, keep_rounds
        self.token, self.ca_file = token, ca_file
        self.swept_round, self.retry_at = None, 0.0
        self.deleted, self.recent, self.error, self.kept = 0, collections.deque(maxlen=20), None, []
        self.lock = threading.Lock()         # kept: written by the sweep and by publish's thread

    def _call(self, method, path):
        return httpc.call(self.url, method, path, token=self.token, ca_file=self.ca_file,
                          timeout=BLOB_CALL_TIMEOUT_S)

    def due(self, round_, now):
        return round_ != self.swept_round and now >= self.retry_at

    def sweep(self, round_, now=None):
        """One pass at durable round `round_`; True when every blob the rule drops is gone."""
        now = time.monotonic() if now is None else now
        try:
            listing = self._call("GET", "/blobs")
            sizes = {b["id"]: b["size"] for b in listing["blobs"]}
            sizes.update({u["id"]: u["total"] for u in listing["uploads"] if u["id"] not in sizes})
            plan = blob_plan(sizes, self.aggregator, round_, self.keep)
            for b in plan:
                b["bytes"] = sizes[b["blob"]]
                if not b["keep"]:
                    self._delete(b)
        except (httpc.CallError, OSError, http.client.HTTPException, ValueError, KeyError, TypeError) as e:
            self.error, self.retry_at = f"{type(e).__name__}: {e}", now + SWEEP_RETRY_S
            log(f"fedmom: retention sweep of the blob store at round {round_} failed ({self.error}); "
                f"tried again in {SWEEP_RETRY_S:g} s")
            return False
        with self.lock:
            self.kept = [b for b in plan if b["keep"]]
        self.swept_round, self.error = round_, None
        return True

    def _delete(self, b):
        testhooks.fault_point("fedmom.blob_delete")        # test hook: a deletion held mid-sweep
        try:
            self._call("DELETE", f"/blobs/{b['blob']}")
        except httpc.CallError as e:
            if e.status == 409:                        # still being uploaded: judged again next round
                return
            if e.status != 404:                        # 404: already gone (a crash after the delete)
                raise
        self.deleted += 1
        self.recent.append({"blob": b["blob"], "bytes": b["bytes"], "why": b["why"]})
        log(f"fedmom: deleted blob {b['blob']} ({b['bytes'] / 2**20:.1f} MiB): {b['why']}")

    def published(self, blob, rnd, size):
        """publish put `blob` of round `rnd` into the store: shown as kept until the next sweep judges it."""
        with self.lock:
            if all(b["blob"] != blob for b in self.kept):
                plan = blob_plan([blob], self.aggregator, rnd, self.keep)
                self.kept = self.kept + [{**b, "bytes": size} for b in plan]

    def view(self):
        """/status "retention" "blobs": what the store keeps of ours and why, what went."""
        with self.lock:
            kept = [dict(b) for b in self.kept]
        return {"keep_rounds": self.keep, "swept_round": self.swept_round, "error": self.error, "kept": kept,
                "deleted": self.deleted, "recent_deleted": list(self.recent)}


# ==== DARL custody: the calls (DarlLink) and what is owed (Custodian) =============================
# Each DarlLink call returns a fedmom_round.Answer and never retries. The Custodian asks, the
# books (fedmom_round) decide what the answer means, and whatever is still owed is asked again by
# the next tick (fedmom_server.py's DARL loop: every --darl-retry-s at most while DARL is silent).
# Every decision an answer brings is durable (Ledger.change) before the next call goes out.
# Test hooks (testhooks.fault_point): fedmom.custody_held (DARL holds a delta, the spool does not
# say so yet), fedmom.epoch_durable (the issued epoch durable, not confirmed), fedmom.committed
# (DARL committed, the books still owe it). DARL's endpoints: FEDERATION_GUIDE.md, "Endpoints".

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
                return Answer(REFUSED, e.reply, str(e))
            return Answer(UNKNOWN, e.reply, f"HTTP {e.status}: {e.reply.get('error', e.reply)}")
        except (OSError, http.client.HTTPException, ValueError, httpc.TLSConfigError) as e:
            return Answer(UNKNOWN, {}, f"{type(e).__name__}: {e}")
        if not isinstance(reply, dict) or reply.get(key) != want:
            return Answer(UNKNOWN, {}, f"{path}: the reply is not DARL's ({str(reply)[:120]})")
        return Answer(OK, reply)

    def fence(self, aggregator, last_epoch, claim, last_holder=None, round=None):
        body = {"aggregator": aggregator, "last_epoch": last_epoch, "claim": claim}
        body.update({k: v for k, v in (("last_holder", last_holder), ("round", round)) if v is not None})
        return self._ask("POST", "/fence", body, "aggregator", aggregator)

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
        return self._ask("POST", "/custody/commit", body, "state", "committed")

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
            return Answer(UNKNOWN, e.reply, f"HTTP {e.status}: {e.reply.get('error', e.reply)}")
        except (OSError, http.client.HTTPException, ValueError, httpc.TLSConfigError) as e:
            return Answer(UNKNOWN, {}, f"{type(e).__name__}: {e}")
        if not isinstance(reply, dict) or not isinstance(reply.get("custody"), list):
            return Answer(UNKNOWN, {}, "GET /custody: the reply is not DARL's")
        return Answer(OK, reply)


class Custodian:
    """Asks DARL what the books (ledger.table: fedmom_round.RoundTable and its CustodyBooks)
    need asked, settles the books by each answer, and removes the spool files of a delta DARL
    refused. `wall` is the wall clock of the records."""

    def __init__(self, link, ledger, spool, wall):
        self.link, self.ledger, self.spool, self.wall = link, ledger, spool, wall
        self.table, self.books = ledger.table, ledger.table.books
        self.process_id = secrets.token_hex(8)   # binds DARL's epoch to this process (/fence/confirm)
        self.fence_lock = threading.Lock()       # one fence at a time: the upload threads and the DARL loop

    def tick(self):
        """One pass over what DARL still owes an answer to, oldest first: this epoch's fence,
        then (once) the reconciliation of DARL's custody with our books, the custody of
        unconfirmed deltas, the aborts and the commits owed. True when everything owed was
        answered definitively; False when DARL must be asked again later."""
        if self.books.fenced:
            return False
        if not self.books.epoch_held and not self.fence():
            return False
        if not self.table.reconciled and not self.reconcile():
            return False
        with self.ledger.lock:
            unconfirmed = self.table.unconfirmed()
        for p in unconfirmed:
            self.take(p)
            if p.custody == Custody.UNCONFIRMED and self.table.pending.get((p.cluster, p.incarnation)) is p:
                return False
        return self.send_owed("abort") and self.send_owed("commit")

    def take(self, p, at_upload=False):
        """Ask DARL to hold p's leases for this aggregator; settle p by the answer. At upload a
        refusal is the upload's 409 (nothing stays stored); later it excludes p, named."""
        if not (self.books.epoch_held or self.fence()):
            return
        ans = self.link.custody(self.books.aggregator, self.books.epoch, p.delta_id, p.cluster, p.incarnation,
                                p.leases)
        if ans.kind == OK:
            testhooks.fault_point("fedmom.custody_held")   # DARL holds it, our spool does not say so yet
            with self.ledger.lock:
                if self.table.custody_held(p, ans.reply.get("pieces", [])):
                    self.spool.record(p)
                self.books.heard()
                self.ledger.wake()
            return
        if ans.kind == UNKNOWN:
            self._definitive(ans, f"custody of {p.cluster}'s delta {p.delta_id}")
            return
        why = ans.reply.get("error") or ans.error
        if ans.code == "fenced":
            self._stop(why)
            if not at_upload:
                return              # the newer process of this aggregator finds the spooled delta
        with self.ledger.lock:
            self.books.heard()
            if not self.table.custody_refused(p, why, at_upload, self.wall()):
                return
            gone = outer_state.bury([p.path, p.meta_path])
            self.ledger.wake()
        outer_state.remove(gone)
        if at_upload and ans.code == "fenced":      # this process is stopping: the upload never happened
            raise Refused(503, f"this aggregator process was fenced by DARL ({why}); send again")
        if at_upload:
            raise Refused(409, why, code="lease_lost", leases=ans.reply.get("leases", [l["id"] for l in p.leases]))

    def fence(self):
        """Ask DARL for this process's epoch (DARL issues it; see darl_table.CustodyTable.fence)."""
        with self.fence_lock:
            return self.books.epoch_held or self._ask_epoch()

    def _ask_epoch(self):
        if self.books.fenced:
            return False
        with self.ledger.change():        # a new claim is durable before it is sent
            last_epoch, claim, last_holder = self.books.fence_request(secrets.token_hex(8))
            durable_round = self.table.round
        ans = self.link.fence(self.books.aggregator, last_epoch, claim, last_holder, durable_round)
        if ans.kind == REFUSED:
            return self._stop(ans.reply.get("error", ans.error))
        if ans.kind != OK:
            with self.ledger.lock:
                self.books.silent("fence", ans.error, self.wall())
            return False
        with self.ledger.change():        # the issued epoch and its holder are durable before the confirm
            issued = self.books.fence_issued(ans.reply["epoch"], ans.reply.get("digest"), self.process_id,
                                             self.link.url)
        if not issued:
            return self._stop(None)
        testhooks.fault_point("fedmom.epoch_durable")   # epoch and holder durable, the confirm not sent
        # then bind it to this process: a copy of our state taken while the ask was in
        # flight holds the same claim and may have been given the same epoch. This state
        # names this process as the holder from now on, so if the copy confirms first,
        # DARL fences this state at every later ask (darl_table.CustodyTable.fence)
        ans = self.link.confirm_fence(self.books.aggregator, self.books.epoch, claim, self.process_id)
        if ans.kind == REFUSED:
            return self._stop(ans.reply.get("error", ans.error))
        if ans.kind != OK:          # asked again later: a new claim; the next epoch unless another
            #                         process confirmed this one
            with self.ledger.lock:
                self.books.silent("confirm the fence", ans.error, self.wall())
            return False
        with self.ledger.lock:
            self.books.fence_confirmed(ans.reply.get("held", 0))
        return True

    def reconcile(self):
        """Once after a start: DARL's list of what it holds for us against our books
        (fedmom_round.RoundTable.reconcile); the deltas it no longer holds leave the spool."""
        ans = self.link.held(self.books.aggregator)
        if ans.kind != OK:
            with self.ledger.lock:
                self.books.silent("list our custody", ans.error, self.wall())
            return False
        with self.ledger.change():
            gone = self.table.reconcile(ans.reply["custody"], self.wall())
            tombs = outer_state.bury([f for p in gone for f in (p.path, p.meta_path)])
        outer_state.remove(tombs)
        return True

    def send_owed(self, kind):
        """Send the owed commits or aborts (kind "commit" | "abort") oldest first, until one gets
        no definitive answer; each answer is durable before the next call."""
        with self.ledger.lock:
            todo = list(self.books.commits if kind == "commit" else self.books.aborts)
        for c in todo:
            if kind == "commit":
                ans = self.link.commit(self.books.aggregator, self.books.epoch, c["delta"], c.get("round"))
                what = f"commit of {c['cluster']}'s delta {c['delta']} (round {c['round']})"
            else:
                ans = self.link.abort(self.books.aggregator, self.books.epoch, c["delta"], c["why"])
                what = f"abort of {c['cluster']}'s delta {c['delta']}"
            if not self._definitive(ans, what):
                return False
            if kind == "commit":
                testhooks.fault_point("fedmom.committed")      # DARL committed it, our state still owes it
            with self.ledger.change():
                self.books.settle(kind, c, ans)
        return True

    def _definitive(self, ans, what):
        """Does DARL's answer settle the call? Else it stays owed (the alarm goes up), or this
        process was fenced and stops."""
        if ans.kind == UNKNOWN:
            with self.ledger.lock:
                self.books.not_fenced(ans)
                self.books.silent(what, ans.error, self.wall())
            return False
        if ans.code == "fenced":
            self._stop(ans.reply.get("error", ans.error))
            return False
        return True

    def _stop(self, why):
        """DARL fenced this process (`why`; None: the books stopped it already) -> False."""
        with self.ledger.lock:
            if why is not None:
                self.books.stop(why)
            self.ledger.wake()
        return False
