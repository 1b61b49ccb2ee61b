"""fedmom_state.py - the aggregator: its protocol core driven with its durable state, its
outer state and its calls to DARL; no HTTP server in it.

Runs on: the central VM, imported by fedmom_server.py (which owns the routes, the round
and DARL loops, the status page and the command line; its docstring says how to start
it and what each endpoint does). Python standard library + numpy (through the modules
below); never imports torch. ServerConfig is the aggregator's one config, validated once;
errors name the flag to change.

FedMomState is put together from (ARCHITECTURE.md section 2 draws it):
    fedmom_round.RoundTable   the protocol, pure: membership, what the open round accepts, when
                              it closes, each delta's custody and outcome, what is owed to DARL,
                              the violation counters (its docstring states the rules)
    fedmom_store.Ledger       state.json and rounds.jsonl, and the lock over the books
    fedmom_store.Spool        the accepted deltas' files
    fedmom_outer.OuterKeeper  theta, momentum and residual (in memory, or on disk past --memory-gb):
                              merged, checkpointed, rebuilt
    fedmom_darl.Custodian     the custody calls to DARL (with --darl)
Each of its methods (join, heartbeat, leave, check_delta_meta, receive_delta, fetch_delta,
accept_delta, tick, darl_tick, status, ...) asks the RoundTable for the decision and does
the I/O the decision needs; they take and return plain values and raise
fedmom_round.Refused(status, reason, **extra) for a request they refuse, which
fedmom_server.py turns into the HTTP reply.

State dir (everything replaced atomically: temp file, fsync, rename, fsync the dir).
The outer state (theta_global, momentum, the residual of --down-wire; outer_state.OuterState,
4 B/param each) lives in memory as far as --memory-gb goes and in scratch file blocks in
--outer-dir (default outer/ here) beyond it (outer_budget.py); what is durable is what a
restart needs to rebuild it bit for bit:
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
A start loads the checkpoint and replays the log (OuterKeeper.rebuild; a replay that ends at
another digest than the round published stops the start; segments of two rounds, from a
checkpoint cut short, are each replayed from their own). A checkpoint, once durable
(state.json names it), removes the deltas of the rounds it covers; a round removes the round
before's update and copy of theta; both remove files after the state lock is released
(fedmom_store.remove; a crash first leaves them to the next start's clean-up). The state dir
therefore holds one checkpoint (and one segment more while the next is written), at most
--checkpoint-rounds rounds of deltas, one update and the open round's spool; what is kept and
why: kept_files(). The blob store's copies of theta and the updates are
fedmom_blobs.BlobRetention's (blob_plan, --keep-rounds).

Custody (with --darl): the aggregator is the coordinator of a two-phase commit, DARL the
participant. A delta accepted for the round is spooled with custody "unconfirmed", then DARL
is asked to take the leases it names into custody for this aggregator; the round merges
only deltas in confirmed custody, and the merge makes the round durable together with a
commit owed for every merged delta; an excluded delta whose custody may be held owes an
abort; both are kept in state.json and re-sent, oldest first, until DARL answers
definitively. DARL issues the aggregator's epoch (fencing) and refuses any call naming
another. The states, the fencing, the repair after a restart and the violation counters
are fedmom_round.py's docstring; darl_server.py's docstring has DARL's calls.

Test hooks (testhooks.fault_point; fedmom_server.py's docstring lists them all): fedmom.spooled
(a delta accepted on disk, its custody not asked yet) and fedmom.round_durable (a round
durable with its commits owed, none sent) are here; the others are in the module that does
that step (fedmom_store, fedmom_outer, fedmom_darl, fedmom_blobs).
"""
import dataclasses
import math
import os
import secrets
import threading
import time
import traceback

import fedmom_darl
import fedmom_merge
import fedmom_outer
import fedmom_round
import fedmom_store
import testhooks
import tensorio
import wire
from fedmom_blobs import blob_name
from fedmom_records import format_record
from fedmom_round import Custody, Refused
from fedmom_store import KEEP_DELTAS_ENV, log
from outer_defaults import OUTER_LR, OUTER_MOMENTUM

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
    merge_procs: int | None = None    # the round's worker processes (merge_pool.py; None: every core; 1: none)
    phase_s: float | None = None      # the round cadence offered to every site (None: not offered)
    quorum: float | None = None       # fraction of a round's expected tokens that closes it after the grace
    grace_frac: float = GRACE_FRAC    # the quorum's grace, as a fraction of the recent round length
    memory_gb: float | None = None    # what the aggregator and its workers may hold (None: the machine's)
    outer_dir: str | None = None      # the outer state's file blocks (None: outer_budget.OUTER_DIR in the state dir)

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
        """--phase-s, --quorum, --grace-frac (the quorum rule: fedmom_round.py's docstring)."""
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
    same = fedmom_outer.structure_digest(specs) == recorded["structure"] and (
        (st.st_size, st.st_mtime_ns) == (recorded["size"], recorded["mtime_ns"])
        or fedmom_outer.file_sha256(init) == recorded["sha256"])
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
        self.ledger = fedmom_store.Ledger(self.dir, self.table, cfg.fsync)
        self.ledger.outer_step = (cfg.outer_lr, cfg.outer_momentum)
        self.spool = fedmom_store.Spool(os.path.join(self.dir, "spool"), cfg.fsync,
                                        os.environ.get(KEEP_DELTAS_ENV) or None)
        self.keeper = fedmom_outer.OuterKeeper(cfg, self.dir, self.ledger, clock)
        self.custodian = None if darl is None else fedmom_darl.Custodian(darl, self.ledger, self.spool, wall)
        self.merge_error = None       # the last merge's failure (a full disk), until one succeeds
        self.check_lock = threading.Lock()
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
        L.init_id = fedmom_outer.init_id(self.cfg.init, self.keeper.specs)
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
        --overlap-fold eager repeats it locally: FEDERATION_GUIDE.md section 4, "Overlap")."""
        with self.ledger.change() as t:
            reply = t.join(cluster, incarnation, self.clock(), self.wall())
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
            return t.reply(cluster, self.clock())

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
        return self.accept_delta(meta, self.spool.receive(chunks))

    def fetch_delta(self, meta, blob, sha256, blobs):
        """POST /delta_blob: the metadata checked first, then the delta fetched from the blob
        store (`blobs`, fedmom_blobs.BlobLink) into a part file and accepted; once fetched the
        blob is deleted, accepted or refused. A retry of a delta this round holds is a
        duplicate (its blob is already gone)."""
        blobs.check_id(blob)
        meta = self.check_delta_meta(meta)
        dup = self.duplicate(meta)
        if dup is not None:
            return dup
        part = self.spool.part()
        got = blobs.fetch(blob, part)
        try:
            if got != sha256:
                self.spool.discard(part)
                raise Refused(400, f"blob {blob!r} has sha256 {got[:16]}..., the request says {sha256[:16]}...")
            return self.accept_delta(meta, part)
        finally:                            # fetched: its bytes are in the spool, or refused for good
            blobs.delete(blob)

    def duplicate(self, meta):
        """The reply for a retried delta this round already holds (its first reply was lost), or None."""
        with self.ledger.lock:
            self.table.check_current(meta, self.clock())
            return self.table.duplicate(meta)

    def accept_delta(self, meta, part):
        """The delta file is fully spooled at `part`: check it, spool it, take its leases into
        DARL custody. On a refusal the file is removed and nothing stored changes."""
        t = self.table
        try:
            dup = self.duplicate(meta)
            if dup is not None:
                return dup
            t0 = time.monotonic()
            try:
                # a compressed delta is checked as its decoded values and spooled as it came; one
                # at a time: --memory-gb counts one check's parts (outer_budget.CHECK_BYTES), and
                # each already uses every core
                with self.check_lock:
                    norm = fedmom_merge.check_delta_file(part, self.keeper.specs, self.cfg.threads)
            except fedmom_merge.DeltaRejected as e:
                with self.ledger.lock:
                    t.exclude(meta, e.reason, self.wall())
                raise Refused(e.status, e.reason, code="bad_delta", round=t.round)
            with self.ledger.lock:
                t.check_current(meta, self.clock())          # the round may have closed while we read the file
                dup = t.duplicate(meta)
                if dup is not None:
                    return dup
                path, meta_path = self.spool.names(t.round, meta["cluster"], meta["incarnation"])
                p = t.new_pending(meta, secrets.token_hex(8), path, meta_path, os.path.getsize(part), norm,
                                  time.monotonic() - t0, self.wall())
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
        if due:
            self.keeper.checkpoint_when_due()    # due at a start (killed before it was written)
            return None
        with self.keeper.mem_lock:
            rec = self._merge_and_finish(batch, ready, late, closed_at)
        with self.ledger.lock:
            due = rec is not None and self.keeper.checkpoint_due()
        if due:
            self.keeper.checkpoint_when_due()
        return rec

    def _merge_and_finish(self, batch, reason, late, closed_at):
        """tick's merge, under mem_lock: the arrays become the new round's, or are rebuilt."""
        try:
            stats, merged, dropped = self.keeper.merge(batch, self.history.clip_norms())
        except Exception as e:
            traceback.clear_frames(e.__traceback__)     # the failed try's arrays, let go before the rebuild
            return self._merge_failed(e)
        gone = []                            # files no round needs: unlinked once the lock is released
        try:
            with self.ledger.lock:
                self.merge_error = None
                for p, why in dropped:           # excluded at the merge: never merged, its custody aborted
                    self.table.drop_at_merge(p, why, self.wall())
                    gone += fedmom_store.bury([p.path, p.meta_path])
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
                    return self._finish(merged, stats, reason, late, closed_at, gone)
                except Exception as e:  # not durable (state.json on a full disk): as a failed merge
                    self.outer.dirty = True
                    failed = e
        finally:
            fedmom_store.remove(gone)
        return self._merge_failed(failed)

    def _finish(self, batch, stats, reason, late, closed_at, gone):
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
        t.opened(rec, self.clock())
        L.append_record(rec)
        log(format_record(rec))
        gone += self.keeper.past_files(rec["round"], old_update)
        L.wake()
        return rec

    def _merge_failed(self, e):
        """A merge, or the save that makes it durable, failed: the arrays go back to the durable
        round, /status says why, and the round is tried again in fedmom_round.MERGE_RETRY_S."""
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
        """One pass of the custody calls owed (fedmom_darl.Custodian.tick); True without --darl."""
        return self.custodian is None or self.custodian.tick()

    # ---- reading

    def open_theta(self):
        return self.keeper.open_theta()

    def open_update(self, base_round, base_digest):
        return self.keeper.open_update(base_round, base_digest)

    @property
    def theta_file(self):
        """theta_global of the current round as a file of the state dir (written on demand)."""
        return self.keeper.copy("theta")[0]

    @property
    def momentum_file(self):
        """The momentum buffer of the current round as a file (on demand; None when none is kept)."""
        return self.keeper.copy("momentum")[0]

    def publish_theta(self, blobs):
        """GET /theta_blob: the current theta in the blob store (`blobs`, fedmom_blobs.BlobLink)."""
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
