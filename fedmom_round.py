"""fedmom_round.py - the aggregator's round and custody protocol with no I/O: who is a member,
what the open round accepts, when it merges, what became of each delta, what is owed to DARL;
and the round records.

Used on the central VM by fedmom_state.FedMomState, which does everything this file does not:
the files, the merge arithmetic, the DARL calls and the locks; fedmom_server.py's status CLI
prints the records. Standard library + darl_table.py (its position sets): no files, sockets,
threads, numpy or torch. Not run on its own; tested alone in tests/test_fedmom_round.py.

Time comes in as arguments: `now` (monotonic seconds: timeouts, the deadline) and `wall`
(epoch seconds, stamped into events and records); random ids come in too (a delta's custody
id). The same calls with the same arguments give the same books, replies, refusals and log
lines (`say`), so a RoundTable can be replayed.

Its parts, in reading order:
  - the protocol's words: Custody and CUSTODY_MOVES (the custody steps; move() refuses any
    other loudly), Phase (where the open round stands), Refused (a request refused: status,
    reason), DARL's answers (Answer: only a 2xx or a 409 with a DEFINITIVE code decides);
  - the members and deltas: Member, Pending (an accepted delta, as its spool record keeps it),
    parse_delta_meta (a delta's metadata checked);
  - CustodyBooks: the identity and DARL-issued epoch (fencing), the commits and aborts owed,
    oldest first, the violation counters (VIOLATIONS) and DARL's silence (the alarm);
  - Roster: the live members, one incarnation per cluster, and the run's events;
  - RoundTable: the open round: acceptance, when it closes, each delta's custody and fate,
    the repair after a start (restore, reconcile); its rules are the comment above it;
  - the round records: outcome() (one delta's fate: pending, merged or excluded), History
    (the last RECORDS_KEPT records, every position merged: blocks_trained_twice counted from
    our own records), Quorum (when a round closes early), round_record, format_record.

The durable part of the books (round, members, events, the calls owed, the violations, the
identity and epoch, the last record) is to_json()'s, and every change of it bumps `changes`:
the caller makes state.json say it before it lets anyone see the change, or puts the books
back with mark()/rewind(). The open round's deltas are the spool's, handed back at a start
through restore(). A record is one line of rounds.jsonl ("v": RECORD_VERSION), appended by
fedmom_state.Ledger; its fields are FEDERATION_GUIDE.md, "Reading the metrics".

The protocol is taught in FEDERATION_GUIDE.md, "Leases (DARL)" (custody, fencing, violations)
and "A round, from the site's side"; DARL's half of custody is darl_table.py's.
"""
import collections
import dataclasses
import math
import re

import darl_table

VIOLATIONS = darl_table.VIOLATIONS
EVENTS_KEPT = 500             # membership events kept in state.json (for the page and status)
MERGE_RETRY_S = 30.0          # a merge that failed (a full disk) is tried again after this
ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


class Custody:
    """A delta's custody state (strings: the spool's acceptance records keep the first three)."""
    NONE = "none"                 # no --darl: no custody, nothing owed
    UNCONFIRMED = "unconfirmed"   # spooled; DARL not asked yet, or no definitive answer
    CONFIRMED = "confirmed"       # DARL holds its leases for this aggregator
    REFUSED = "refused"           # DARL does not hold them for us: never merged, nothing owed
    COMMIT_OWED = "commit_owed"   # merged into a durable round: the commit is owed
    COMMITTED = "committed"       # DARL answered the commit
    ABORT_OWED = "abort_owed"     # excluded while DARL may hold it: the abort is owed
    ABORTED = "aborted"           # DARL answered the abort


SPOOLED = (Custody.NONE, Custody.UNCONFIRMED, Custody.CONFIRMED)     # what an acceptance record may say
# The custody steps (none: no --darl, nothing to hold):
#   unconfirmed -> confirmed     DARL holds its leases for this aggregator
#   unconfirmed -> refused       DARL's definitive no (lease_lost, custody_aborted): at upload
#                                nothing stays stored, later the delta is excluded, named
#   unconfirmed -> abort_owed    excluded (its spool entry damaged): DARL may hold it
#   confirmed -> commit_owed     merged: the round and its commit owed are durable together
#   confirmed -> abort_owed      excluded at the merge (not finite), or its spool entry damaged
#   confirmed -> refused         restored, but DARL no longer holds it: excluded, never merged
#   commit_owed -> committed     DARL's definitive answer; a refusal is counted
#   abort_owed -> aborted        DARL's definitive answer; custody it returns is counted
CUSTODY_MOVES = {
    Custody.UNCONFIRMED: (Custody.CONFIRMED, Custody.REFUSED, Custody.ABORT_OWED),
    Custody.CONFIRMED: (Custody.COMMIT_OWED, Custody.ABORT_OWED, Custody.REFUSED),
    Custody.COMMIT_OWED: (Custody.COMMITTED,),
    Custody.ABORT_OWED: (Custody.ABORTED,),
}                              # none, refused, committed, aborted: final


class Phase:
    """Where the open round stands (RoundTable.phase); only READY closes it."""
    EMPTY = "empty"                          # no delta yet: nothing to merge
    COLLECTING = "collecting"                # live members still owe a delta, the deadline not passed
    WAITING_CUSTODY = "waiting_custody"      # a delta's custody is unconfirmed: waits for DARL's word
    WAITING_RECONCILE = "waiting_reconcile"  # deltas restored from the spool not checked with DARL yet
    BACKING_OFF = "backing_off"              # the last merge failed: tried again at retry_merge_at
    FENCED = "fenced"                        # DARL fenced this process: nothing merges any more
    READY = "ready"                          # closes at the next tick
    MERGING = "merging"                      # closed: its deltas are being merged into round + 1


class IllegalMove(AssertionError):
    """A step the protocol does not have (a bug, never a site's mistake): loud, never absorbed."""


def move(state, to, what="a delta"):
    """The custody state after `state` -> `to`, or IllegalMove when CUSTODY_MOVES has no such step."""
    if to not in CUSTODY_MOVES.get(state, ()):
        raise IllegalMove(f"custody of {what}: {state} -> {to} is not a step of the protocol "
                          f"(from {state}: {', '.join(CUSTODY_MOVES.get(state, ())) or 'none, it is final'})")
    return to


class Refused(Exception):
    """A request the protocol refuses: HTTP status, one-line reason, extra reply fields."""

    def __init__(self, status, reason, **extra):
        super().__init__(reason)
        self.status, self.reason, self.extra = status, reason, extra


# ---------------------------------------------------------------- DARL's answers

OK, REFUSED, UNKNOWN = "ok", "refused", "unknown"
DEFINITIVE = frozenset({"lease_lost", "custody_aborted", "unknown_custody", "custody_committed", "fenced"})


@dataclasses.dataclass
class Answer:
    """DARL's answer to one custody call: OK (the reply), REFUSED (a 409 whose code DARL
    gives only for a decided lease state: DEFINITIVE) or UNKNOWN (anything else: DARL down,
    a rotated token, a proxy's 404 or 5xx, a timeout) - never a decision."""
    kind: str
    reply: dict
    error: str = ""

    @property
    def code(self):
        return self.reply.get("code")


# ---------------------------------------------------------------- members and deltas

@dataclasses.dataclass
class Member:
    incarnation: str
    joined: float          # wall time
    last_seen: float       # `now` of its last call
    metrics: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Pending:
    """A delta accepted for the open round; its spool acceptance record is dataclasses.asdict of it."""
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
    custody: str = Custody.NONE
    pieces: list = dataclasses.field(default_factory=list)   # DARL's [[lease, start, end]] once confirmed
    size: int = -1         # bytes of the spooled file, checked at a restart
    norm: float | None = None     # L2 norm of the delta (float64), measured at acceptance
    accept_s: float = 0.0  # seconds its checks took at acceptance (decoding a compressed delta)
    custody_s: float = 0.0 # seconds DARL took to take its leases into custody at upload (not kept)
    arrived_s: float | None = None   # seconds after its round opened that it was admitted (restored: 0)
    landed: float | None = None      # wall time its last byte landed here (a followed blob: as the store finished it)

    @classmethod
    def from_json(cls, m):
        """An acceptance record read back; TypeError/ValueError when it is not one."""
        p = cls(**m)
        if p.custody not in SPOOLED:
            raise ValueError(f"custody {p.custody!r} is not one an acceptance records ({', '.join(SPOOLED)})")
        return p

    def ident(self):
        return {"cluster": self.cluster, "incarnation": self.incarnation, "base_round": self.base_round,
                "tokens": self.tokens, "leases": self.leases}


def check_id(value, what):
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
    out = {"cluster": check_id(meta.get("cluster"), "cluster"),
           "incarnation": check_id(meta.get("incarnation"), "incarnation")}
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
    try:
        out["metrics"] = clean_metrics(metrics, strict=True)
    except ValueError as e:
        raise Refused(400, str(e))
    return out


# ---------------------------------------------------------------- the books owed to DARL

class CustodyBooks:
    """The coordinator's side of custody: the aggregator's identity and DARL-issued epoch,
    the commits and aborts owed (each entry a dict, oldest first, until DARL answers
    definitively), the violation counters, and DARL's silence (the alarm)."""

    def __init__(self, retry_s=10.0, say=None):
        self.retry_s, self.say = retry_s, say or (lambda msg: None)
        self.aggregator, self.epoch, self.holder, self.loaded_epoch = None, 0, None, 0
        self.fence_claim = None       # the epoch request in flight (durable before it is sent)
        self.epoch_held = False       # DARL confirmed this process's epoch: calls may name it
        self.fenced = None            # DARL's reason, once it refused this epoch: the process stops
        self.darl_digest = None       # DARL's block-space digest, from its first fence reply
        self.used = False             # sticky: once DARL held custody, always --darl
        self.alarm = None             # {"since", "error", "calls"} while DARL gives no definitive answer
        self.commits, self.aborts = [], []
        self.violations = {k: 0 for k in VIOLATIONS}
        self.changes = 0

    def load(self, st):
        self.aggregator, self.epoch = st["aggregator"], st["epoch"]
        self.holder = st.get("holder")               # None: a state written before holders were kept
        self.loaded_epoch = self.epoch
        self.fence_claim = st.get("fence_claim")     # an ask whose answer may have been lost: repeat it
        self.used = self.used or bool(st.get("custody") or st.get("pending_commits") or st.get("pending_aborts"))
        self.darl_digest = st.get("darl_digest")
        self.commits, self.aborts = st.get("pending_commits", []), st.get("pending_aborts", [])
        self.violations = {k: int(st.get("violations", {}).get(k, 0)) for k in VIOLATIONS}

    def to_json(self):
        return {"aggregator": self.aggregator, "epoch": self.epoch, "holder": self.holder,
                "fence_claim": self.fence_claim, "pending_commits": list(self.commits),
                "pending_aborts": list(self.aborts), "violations": dict(self.violations), "custody": self.used,
                "darl_digest": self.darl_digest}

    def mark(self):
        return (self.changes, self.epoch, self.holder, self.fence_claim, self.darl_digest, self.used,
                list(self.commits), list(self.aborts), dict(self.violations))

    def rewind(self, m):
        (self.changes, self.epoch, self.holder, self.fence_claim, self.darl_digest, self.used,
         self.commits, self.aborts, self.violations) = m

    def shown_epoch(self, custody):
        """The epoch this process holds once DARL confirmed it; until then the one its state had."""
        return self.epoch if self.epoch_held or not custody else self.loaded_epoch

    # ---- what is owed

    def owe_commit(self, p, rnd, wall):
        move(p.custody, Custody.COMMIT_OWED, f"{p.cluster}'s delta {p.delta_id}")
        self.commits.append({"delta": p.delta_id, "round": rnd, "cluster": p.cluster, "incarnation": p.incarnation,
                             "blocks": sum(x[2] - x[1] for x in p.pieces), "since": round(wall, 3)})
        self.changes += 1

    def owe_abort(self, delta, cluster, incarnation, why, wall):
        self.aborts.append({"delta": delta, "cluster": cluster, "incarnation": incarnation, "why": why,
                            "since": round(wall, 3)})
        self.changes += 1

    def settle(self, kind, entry, ans):
        """DARL answered the commit or abort `entry` (kind "commit" | "abort") definitively:
        commit_owed -> committed, abort_owed -> aborted (the entry leaves the books); a
        refusal, or custody returned to the pool, is counted."""
        books = "commits" if kind == "commit" else "aborts"
        setattr(self, books, [c for c in getattr(self, books) if c["delta"] != entry["delta"]])
        self.heard()
        c, why = entry, ans.reply.get("error", ans.error)
        if kind == "commit" and ans.kind == REFUSED:
            self.violations["refused_commits"] += 1
            self.violations["blocks_trained_twice"] += int(ans.reply.get("blocks") or 0)
            self.say(f"fedmom: !!! DARL REFUSED the commit of {c['cluster']}'s delta {c['delta']} merged into round "
                     f"{c['round']}: {why} (refused_commits)")
        elif kind == "abort" and ans.kind == REFUSED:     # custody_committed: DARL counted blocks no round holds
            self.violations["refused_aborts"] += 1
            self.say(f"fedmom: !!! DARL refused to abort delta {c['delta']}: {why}; "
                     "its blocks are committed but inside no merged delta (refused_aborts)")
        elif kind == "abort" and ans.reply.get("returned"):
            self.violations["aborted_custody"] += 1
            self.say(f"fedmom: !!! aborted custody of {c['cluster']}'s delta {c['delta']}: {ans.reply['returned']} "
                     f"blocks went back to the pool ({c['why']}) (aborted_custody)")
        self.changes += 1

    def silent(self, what, error, wall):
        """No definitive answer from DARL: nothing is decided, the call stays owed, the alarm is up."""
        if self.alarm is None:
            self.alarm = {"since": round(wall, 3), "calls": 0}
            self.say(f"fedmom: !!! DARL gives no definitive answer to the {what}: {error}; kept, re-sent every "
                     f"{self.retry_s:g} s at most; no round with an unconfirmed delta merges meanwhile")
        self.alarm.update(error=f"{what}: {error}", calls=self.alarm["calls"] + 1)

    def heard(self):
        if self.alarm is not None:
            self.say(f"fedmom: DARL answers again (after {self.alarm['calls']} unanswered call(s))")
            self.alarm = None

    # ---- the epoch (darl_table.CustodyTable.fence has DARL's side)

    def not_fenced(self, ans):
        """DARL has no epoch for us (it was restarted on another state dir): ask for one again."""
        if ans.code == "not_fenced":
            self.epoch_held = False

    def fence_request(self, new_claim):
        """(last_epoch, claim, last_holder) of the next /fence: the claim in flight, or `new_claim`
        (durable before it is sent: a change)."""
        if self.fence_claim is None:
            self.fence_claim = new_claim
            self.changes += 1
        return self.epoch, self.fence_claim, self.holder

    def fence_issued(self, epoch, digest, holder, where):
        """DARL issued `epoch`: it and `holder` (this process) are durable before the confirm.
        False (and fenced) when DARL's block space is not the one this state's custody is with."""
        if digest and self.darl_digest and digest != self.darl_digest:
            self.stop(f"DARL at {where} leases block space {digest}, but this state's custody is "
                      f"with a DARL of block space {self.darl_digest}: restart with --darl URL of that DARL")
            return False
        self.epoch, self.holder, self.fence_claim = epoch, holder, None
        self.darl_digest = self.darl_digest or digest
        self.changes += 1
        return True

    def fence_confirmed(self, held):
        self.epoch_held = True
        self.say(f"fedmom: DARL knows aggregator {self.aggregator} at epoch {self.epoch} "
                 f"({held} custody record(s) held)")

    def stop(self, why):
        if self.fenced is None:
            self.fenced = why
            self.say(f"fedmom: !!! FENCED by DARL: {why}. This process stops; everything it owes DARL stays in "
                     "state.json for the aggregator that replaced it")


# ---------------------------------------------------------------- the round

# ---------------------------------------------------------------- the members

class Roster:
    """The live members (one incarnation per cluster) and the events of the run (joins,
    leaves, drops, exclusions), both durable."""

    def __init__(self, member_timeout_s, say):
        self.timeout_s, self.say = member_timeout_s, say
        self.members = {}                         # cluster -> Member
        self.events = collections.deque(maxlen=EVENTS_KEPT)
        self.changes = 0

    def event(self, kind, cluster, incarnation, rnd, wall, why=""):
        self.events.append({"t": round(wall, 3), "event": kind, "cluster": cluster,
                            "incarnation": incarnation, "why": why, "round": rnd})

    def join(self, cluster, incarnation, rnd, now, wall):
        """A new member (durable), or a live one heard again; 409 incarnation_conflict while
        another incarnation of the cluster is live."""
        check_id(cluster, "cluster"), check_id(incarnation, "incarnation")
        m = self.members.get(cluster)
        if m and m.incarnation != incarnation:
            ago = now - m.last_seen
            raise Refused(409, f"cluster {cluster!r} is live as incarnation {m.incarnation} (heard "
                               f"{ago:.0f} s ago): a second job at a site needs its own --replica; "
                               f"a requeued job may join once the old one times out",
                          code="incarnation_conflict", retry_after_s=round(max(0.0, self.timeout_s - ago), 1))
        if m is not None:
            m.last_seen = now
            return
        self.members[cluster] = Member(incarnation, wall, now)
        self.event("join", cluster, incarnation, rnd, wall)
        self.changes += 1
        self.say(f"fedmom: {cluster} ({incarnation}) joined at round {rnd}; "
                 f"{len(self.members)} live: {sorted(self.members)}")

    def leave(self, cluster, incarnation, rnd, wall):
        self.member(cluster, incarnation, rnd)
        del self.members[cluster]
        self.event("leave", cluster, incarnation, rnd, wall)
        self.changes += 1
        self.say(f"fedmom: {cluster} ({incarnation}) left; {len(self.members)} live: {sorted(self.members)}")

    def member(self, cluster, incarnation, rnd):
        """The live member (cluster, incarnation) or a 409 saying what to do."""
        m = self.members.get(cluster)
        if m is None:
            raise Refused(409, f"{cluster!r} is not a member (never joined, left, or dropped after "
                               f"{self.timeout_s:.0f} s without a heartbeat): join again",
                          code="not_member", round=rnd)
        if m.incarnation != incarnation:
            raise Refused(409, f"{cluster!r} is live as incarnation {m.incarnation}, not {incarnation}: "
                               "this process was replaced; stop it", code="stale_incarnation", round=rnd)
        return m

    def drop_silent(self, rnd, now, wall):
        """Members silent for --member-timeout-s leave (durable) -> [{"cluster", "incarnation", "why"}]."""
        out = []
        for c, m in list(self.members.items()):
            if now - m.last_seen > self.timeout_s:
                why = f"no heartbeat for {now - m.last_seen:.0f} s (--member-timeout-s {self.timeout_s:g})"
                del self.members[c]
                self.event("drop", c, m.incarnation, rnd, wall, why)
                out.append({"cluster": c, "incarnation": m.incarnation, "why": why})
                self.changes += 1
                self.say(f"fedmom: dropped {c} ({m.incarnation}): {why}")
        return out


# ---------------------------------------------------------------- the round
# The rules RoundTable enforces:
#   Acceptance: only from the live incarnation of a member (409 not_member, stale_incarnation),
#     only trained from the current round (409 stale_round), never once the round closed, never
#     in a fenced process (503); with DARL custody a delta must name its leases. A delta of 0
#     tokens is refused AND counts as the member's answer (excluded); a retried upload the round
#     holds gets its first reply again (duplicate); a delta whose checks fail is excluded, named.
#   Membership: a member silent for --member-timeout-s is dropped (its delta, if sent, stays).
#   Closing (phase()): the round holds a delta and every live member has sent one (or had it
#     excluded), or --round-deadline-s passed since its first delta, or the quorum's grace
#     passed (Quorum); and only when every delta is in confirmed custody (the round WAITS for
#     DARL, past the deadline too), the deltas restored from the spool were reconciled with
#     DARL's custody, the last failed merge backed off MERGE_RETRY_S, and the process is not
#     fenced. No delta, no round; a straggler's delta is stale.
#   Repair after a start: a spooled delta whose file is gone or cut short is excluded and its
#     abort owed; an unreadable acceptance record is excluded by its file's name; once DARL lists
#     the custody it holds for us, custody no delta of ours names is aborted, and a restored
#     delta DARL no longer holds is excluded, never merged.
#   Fencing: the epoch claim is durable before it is asked for, the issued epoch and this process
#     as its holder before it is confirmed; a reply from a DARL of another block space, or a
#     refusal, fences this process: it merges nothing more.

class RoundTable:
    """The round: its deltas and their custody, when it closes, its record; with `roster`
    (the members), `books` (what is owed to DARL) and `history` (the merged rounds), all the
    aggregator decides. The caller serialises the calls (one lock) and does the I/O each
    decision asks for; the rules are the comment above."""

    def __init__(self, member_timeout_s=300.0, round_deadline_s=1800.0, custody=False, retry_s=10.0, say=None,
                 quorum=1.0, grace_frac=0.2, phase_s=None):
        self.round_deadline_s = round_deadline_s
        self.q = Quorum(quorum, grace_frac, phase_s)
        self.custody = custody            # --darl: every delta's leases go into DARL custody
        self.say = say or (lambda msg: None)
        self.roster = Roster(member_timeout_s, self.say)
        self.books = CustodyBooks(retry_s, self.say)
        self.books.used = custody
        self.history = History()
        self.round, self.merging, self.last_record = 0, False, None
        self.pending = {}                 # (cluster, incarnation) -> Pending
        self.excluded, self.dropped = [], []
        self.first_delta_at, self.retry_merge_at, self.round_opened_at = None, 0.0, 0.0
        self.last_closed_at = None        # when the last merged round closed (None: none since this start)
        self.closing_at = None            # close time of the round finish() made a record of
        self.inherited = set()            # confirmed delta ids restored from the spool, not yet reconciled
        self.requesting = set()           # delta ids whose custody an upload is asking DARL for now
        self.reconciled = False
        self._changes = 0

    @property
    def members(self):
        return self.roster.members

    # ---- the durable part

    def load(self, st, now):
        """The books of a state.json dict; its members are heard from `now` on."""
        self.round, self.last_record = st["round"], st.get("last_record")
        self.roster.members = {c: Member(m["incarnation"], m["joined"], now) for c, m in st["members"].items()}
        self.roster.events.extend(st.get("events", []))
        self.books.load(st)

    def to_json(self):
        return {"round": self.round, "last_record": self.last_record, "events": list(self.roster.events),
                "members": {c: {"incarnation": m.incarnation, "joined": m.joined} for c, m in self.members.items()},
                **self.books.to_json()}

    @property
    def changes(self):
        """Bumped by every change to_json() would show."""
        return self._changes + self.roster.changes + self.books.changes

    def mark(self):
        r = self.roster
        return (self._changes, self.round, self.last_record, r.changes, dict(r.members), list(r.events),
                self.reconciled, set(self.inherited), self.books.mark())

    def rewind(self, m):
        """The durable part as it was at mark() (its save failed), and whether DARL's custody was
        reconciled: a reconciliation whose save failed runs again (it finds what it left out)."""
        r = self.roster
        self._changes, self.round, self.last_record, r.changes, r.members, events, \
            self.reconciled, self.inherited, books = m
        r.events = collections.deque(events, maxlen=EVENTS_KEPT)
        self.books.rewind(books)

    def event(self, kind, cluster, incarnation, wall, why=""):
        self.roster.event(kind, cluster, incarnation, self.round, wall, why)

    # ---- membership

    def join(self, cluster, incarnation, now, wall):
        check_id(cluster, "cluster"), check_id(incarnation, "incarnation")
        self.drop_silent(now, wall)
        self.roster.join(cluster, incarnation, self.round, now, wall)
        return {**self.reply(cluster, now), "phase_s": self.phase_s}

    def heartbeat(self, cluster, incarnation, now, metrics=None):
        """A member's heartbeat -> its Member (the caller may wait for the round while it stays one)."""
        m = self.roster.member(cluster, incarnation, self.round)
        m.last_seen = now
        if isinstance(metrics, dict):
            m.metrics = clean_metrics(metrics, strict=False)
        return m

    def leave(self, cluster, incarnation, wall):
        self.roster.leave(cluster, incarnation, self.round, wall)
        return {"round": self.round, "left": True}

    def drop_silent(self, now, wall):
        self.dropped += self.roster.drop_silent(self.round, now, wall)

    def reply(self, cluster, now):
        """What a member's join or heartbeat is told (it may have left while its heartbeat waited);
        round_age_s and waiting_on let a site time its phase and see who the round waits for."""
        return {"round": self.round, "merging": self.merging, "members": sorted(self.members),
                "sent": cluster in self.members and self.responded(cluster),
                "heartbeat_s": round(self.roster.timeout_s / 4, 3),
                "round_age_s": round(now - self.round_opened_at, 3),
                "waiting_on": [] if self.merging else self.waiting(),
                "deltas": self.history.outcomes_of(cluster) + [o for o in self.open_outcomes()
                                                               if o["cluster"] == cluster]}

    def waiting(self):
        """The live members that have not answered the open round, sorted."""
        return sorted(c for c in self.members if not self.responded(c))

    def responded(self, cluster):
        """Has the live incarnation of `cluster` sent this round's delta (or had it excluded)?"""
        inc = self.members[cluster].incarnation
        return (cluster, inc) in self.pending or any(
            e["cluster"] == cluster and e["incarnation"] == inc for e in self.excluded)

    def open_outcomes(self):
        """The current round's deltas so far: accepted ("pending") or "excluded"."""
        out = [outcome(p.cluster, p.incarnation, p.base_round, p.tokens, p.leases, "pending")
               for p in self.pending.values()]
        return out + [outcome(e["cluster"], e["incarnation"], e["base_round"], e["tokens"], e["leases"],
                              "excluded", why=e["why"]) for e in self.excluded]

    # ---- deltas

    def check_delta(self, meta, now, wall):
        """Everything about a delta that can be checked before its bytes arrive -> its clean
        metadata. A delta of 0 tokens is refused AND counted as this member's answer."""
        meta = parse_delta_meta(meta)
        self.check_current(meta, now)
        if meta["tokens"] == 0:
            why = "tokens is 0: a delta that trained on nothing has no weight"
            self.exclude(meta, why, wall)
            self.q.note(now, self.quorum_view())
            raise Refused(400, f"{why}; do not send it (this round no longer waits for it)",
                          code="bad_delta", round=self.round)
        if self.custody and not meta["leases"]:
            raise Refused(400, "leases is empty: with --darl every delta names the DARL leases it trained on "
                               "(DARL takes them into custody before the delta can be merged)")
        return meta

    def check_current(self, meta, now):
        m = self.roster.member(meta["cluster"], meta["incarnation"], self.round)
        m.last_seen = now
        if meta["base_round"] != self.round:
            raise Refused(409, f"stale delta: based on round {meta['base_round']}, the current round is "
                               f"{self.round}; load theta_global of round {self.round} and train again",
                          code="stale_round", round=self.round)
        if self.merging:
            raise Refused(409, f"round {self.round} is closed and being merged; wait for round "
                               f"{self.round + 1}", code="stale_round", round=self.round)
        if self.books.fenced:
            raise Refused(503, f"this aggregator process was fenced by DARL ({self.books.fenced}) and is stopping; "
                               "send to the aggregator that replaced it")

    def duplicate(self, meta):
        """The reply for a retried delta this round already holds (its first reply was lost), or None."""
        dup = self.pending.get((meta["cluster"], meta["incarnation"]))
        if dup is None:
            return None
        return {"accepted": True, "duplicate": True, "round": self.round, "custody": dup.custody}

    def new_pending(self, meta, token, path, meta_path, size, norm, accept_s, wall):
        """The acceptance of a checked delta (the caller spools it, then admit()s it); `token`
        makes its custody id."""
        return Pending(meta["cluster"], meta["incarnation"], meta["base_round"], meta["tokens"], meta["leases"],
                       meta["metrics"], path, meta_path, wall, delta_id=f"r{self.round}.{token}",
                       custody=Custody.UNCONFIRMED if self.custody else Custody.NONE, size=size, norm=norm,
                       accept_s=round(accept_s, 3))

    def admit(self, p, now):
        """p (spooled) is in the round; its upload asks DARL for its custody itself, until asked()."""
        p.arrived_s = round(now - self.round_opened_at, 3)
        self.pending[(p.cluster, p.incarnation)] = p
        self.requesting.add(p.delta_id)
        if self.first_delta_at is None:
            self.first_delta_at = now
        self.q.note(now, self.quorum_view())

    def asked(self, p):
        self.requesting.discard(p.delta_id)

    def accepted(self, p):
        """The upload's reply (once its custody was asked for)."""
        waiting = self.waiting()
        self.say(f"fedmom: delta from {p.cluster} for round {self.round}: {p.tokens:,} tokens, "
                 f"{len(p.leases)} lease(s), custody {p.custody}; waiting for {waiting or 'nobody'}")
        return {"accepted": True, "round": self.round, "waiting_for": waiting, "custody": p.custody}

    def exclude(self, meta, why, wall):
        """A delta that will never be merged, named in the round (a retry of it counted once)."""
        if any(e["cluster"] == meta["cluster"] and e["incarnation"] == meta["incarnation"] and e["why"] == why
               for e in self.excluded):
            return
        self.excluded.append({"cluster": meta["cluster"], "incarnation": meta["incarnation"], "why": why,
                              "base_round": meta["base_round"], "tokens": meta["tokens"], "leases": meta["leases"]})
        self.event("excluded", meta["cluster"], meta["incarnation"], wall, why)
        self.say(f"fedmom: EXCLUDED delta from {meta['cluster']} ({meta['incarnation']}) for round {self.round}: {why}")

    def exclude_spooled(self, p, why, wall):
        """An accepted delta that will never be merged: excluded, named, and the custody its
        leases may be in owed an abort (its blocks go back to the pool)."""
        self.exclude(p.ident(), why, wall)
        if p.custody != Custody.NONE:
            p.custody = move(p.custody, Custody.ABORT_OWED, f"{p.cluster}'s delta {p.delta_id}")
            self.books.owe_abort(p.delta_id, p.cluster, p.incarnation, why, wall)

    def _take_out(self, p):
        del self.pending[(p.cluster, p.incarnation)]
        if not self.pending:
            self.first_delta_at = None

    # ---- a start: the spool and the records handed back

    def started(self, now):
        """A start: the open round counts from `now`, the deltas restore() handed back arrived then."""
        self.round_opened_at = now
        for p in self.pending.values():
            p.arrived_s = 0.0

    def restore(self, p, now):
        """A delta the spool kept for this round, whole: it merges, live member or not; one whose
        custody was confirmed merges only once reconcile() saw DARL still holds it (started()
        then dates its arrival)."""
        self.pending[(p.cluster, p.incarnation)] = p
        if p.custody == Custody.CONFIRMED and self.custody:
            self.inherited.add(p.delta_id)
        if self.first_delta_at is None:
            self.first_delta_at = now

    def restore_unreadable(self, fn, error, wall):
        """A spool acceptance that cannot be read back (written atomically, so disk damage): its
        delta is excluded and named from the file name, r<round>_<cluster>_<incarnation>.json
        ("_" is in no id); custody DARL holds for it is aborted by reconcile()."""
        parts = fn[:-len(".json")].split("_")
        rnd = parts[0][1:] if len(parts) == 3 and parts[0].startswith("r") else ""
        if not rnd.isdigit() or int(rnd) != self.round:
            self.say(f"fedmom: !!! unreadable spool entry {fn} of another round removed "
                     f"({type(error).__name__}: {error})")
            return
        self.exclude({"cluster": parts[1], "incarnation": parts[2], "base_round": self.round, "tokens": 0,
                      "leases": []}, f"its spool entry {fn} cannot be read ({type(error).__name__}: {error}); "
                                     "any custody DARL holds for it is aborted", wall)

    def restore_records(self, records):
        """rounds.jsonl's records -> state.json's last record if they lack it (the caller appends it)."""
        for rec in records:
            self.history.add(rec)
        lost = self.history.missing(self.last_record)
        if lost:
            self.history.add(lost)
        return lost

    # ---- custody (the DARL calls are the caller's; these settle a delta by DARL's answer)

    def unconfirmed(self):
        """Deltas whose custody DARL must be asked for (not by their upload, which asks itself)."""
        return [p for p in self.pending.values()
                if p.custody == Custody.UNCONFIRMED and p.delta_id not in self.requesting]

    def custody_waiting(self):
        return sorted(p.cluster for p in self.pending.values() if p.custody == Custody.UNCONFIRMED)

    def custody_held(self, p, pieces):
        """DARL holds p's leases -> True when p is still in the round (its acceptance record then says so)."""
        if self.pending.get((p.cluster, p.incarnation)) is not p:
            return False
        p.custody = move(p.custody, Custody.CONFIRMED, f"{p.cluster}'s delta {p.delta_id}")
        p.pieces = [list(x[:3]) for x in pieces]
        return True

    def custody_refused(self, p, why, at_upload, wall):
        """DARL will not hold p's leases: p leaves the round (at upload its refusal is the reply;
        later it is excluded, named) -> True when it was still in the round (its files go)."""
        if self.pending.get((p.cluster, p.incarnation)) is not p:
            return False
        p.custody = move(p.custody, Custody.REFUSED, f"{p.cluster}'s delta {p.delta_id}")
        self._take_out(p)
        if not at_upload:
            self.exclude(p.ident(), why, wall)
        return True

    def reconcile(self, held, wall):
        """DARL's list of the custody it holds for us (once, after a start) against our books ->
        the restored deltas DARL no longer holds (another process of this aggregator, from
        which this state was copied, aborted them since): excluded, never merged, their files
        to go. Custody our books no longer name (a spool entry lost with a disk) would be held
        forever: its abort is owed."""
        ids = {c["delta"] for c in held}
        gone = [p for p in self.pending.values() if p.delta_id in self.inherited and p.delta_id not in ids]
        for p in gone:
            p.custody = move(p.custody, Custody.REFUSED, f"{p.cluster}'s delta {p.delta_id}")
            self._take_out(p)
            self.exclude(p.ident(), "DARL no longer holds this delta's custody (another process of this "
                                    "aggregator aborted it; its blocks went back to the pool)", wall)
        known = ({p.delta_id for p in self.pending.values()} | {c["delta"] for c in self.books.commits}
                 | {c["delta"] for c in self.books.aborts})
        for c in held:
            if c["delta"] not in known:
                self.books.owe_abort(c["delta"], c["cluster"], c["incarnation"], "the aggregator's state no longer "
                                     "names this delta (its spool entry is gone)", wall)
                self.say(f"fedmom: !!! DARL holds custody of delta {c['delta']} ({c['cluster']}, {c['blocks']} "
                         "blocks) that this aggregator has no record of: aborting it, its blocks go back to the pool")
        self._changes += bool(gone)
        self.reconciled, self.inherited = True, set()
        return gone

    # ---- the quorum rule (Quorum)
    phase_s = property(lambda self: self.q.phase_s)
    quorum_at = property(lambda self: self.q.at)

    def quorum_view(self):
        return self.q.view(self.history, self.members, self.waiting(), sum(p.tokens for p in self.pending.values()))

    # ---- closing, merging, finishing a round

    def phase(self, now):
        """Where the round stands (Phase), checked in the order of the rules."""
        if self.merging:
            return Phase.MERGING
        self.q.note(now, self.quorum_view())
        if not self.pending:
            return Phase.EMPTY
        if now < self.retry_merge_at:
            return Phase.BACKING_OFF
        if self.books.fenced:
            return Phase.FENCED
        if self.custody_waiting():
            return Phase.WAITING_CUSTODY
        if self.inherited and not self.reconciled:
            return Phase.WAITING_RECONCILE
        if (self.waiting() and now - self.first_delta_at < self.round_deadline_s
                and not self.q.passed(now, self.quorum_view())):
            return Phase.COLLECTING
        return Phase.READY

    def ready(self, now):
        """Why the round may merge now, or None (see phase())."""
        if self.phase(now) != Phase.READY:
            return None
        waiting = self.waiting()
        if not waiting:
            return "every live member sent its delta"
        if now - self.first_delta_at >= self.round_deadline_s:
            return f"deadline of {self.round_deadline_s:g} s passed without {waiting}"
        return Quorum.reason(self.quorum_view(), waiting)

    def close(self, now):
        """READY -> MERGING: (its deltas, the members that sent none, `now`)."""
        if self.phase(now) != Phase.READY:
            raise IllegalMove(f"round {self.round} closed in phase {self.phase(now)}, not {Phase.READY}")
        self.merging = True
        self.q.close(self.quorum_view())
        return list(self.pending.values()), self.waiting(), now

    def drop_at_merge(self, p, why, wall):
        """A delta the merge left out (it would make theta not finite): excluded, its custody aborted."""
        self.exclude_spooled(p, why, wall)
        self._take_out(p)

    def reopen(self):
        """MERGING -> open, the same round: nothing was left to merge; its quorum is counted anew."""
        self.merging, self.q.at = False, None
        if not self.pending:
            self.first_delta_at = None

    def merge_failed(self, now):
        """MERGING -> open, the same round, tried again MERGE_RETRY_S from `now`."""
        self.merging, self.retry_merge_at = False, now + MERGE_RETRY_S

    def finish(self, batch, stats, reason, late, closed_at, wall):
        """The round's merge of `batch` gave `stats`: round + 1, its record, a commit owed for
        every delta in confirmed custody, positions merged twice counted -> the record. Durable
        once the caller saved it (else rewind()); then opened() starts the next round."""
        for p in batch:
            if p.custody not in (Custody.NONE, Custody.CONFIRMED):
                move(p.custody, Custody.COMMIT_OWED, f"{p.cluster}'s delta {p.delta_id}")   # raises
        new = self.round + 1
        period = None if self.last_closed_at is None else round(closed_at - self.last_closed_at, 3)
        rec = round_record(new, batch, stats, reason, late, round(closed_at - self.round_opened_at, 3), wall,
                           self.excluded, self.dropped, sorted(self.members), period, self.q.closing)
        self.closing_at = closed_at
        self.books.violations["blocks_trained_twice"] += self.history.trained_twice(rec)
        for p in batch:
            if p.custody == Custody.CONFIRMED:
                self.books.owe_commit(p, new, wall)
        self.round, self.last_record = new, rec
        self._changes += 1
        return rec

    def opened(self, rec, now):
        """The record's round is durable: it is the open round now, empty."""
        twice = self.history.trained_twice(rec)
        self.history.add(rec)
        if twice:
            self.say(f"fedmom: !!! round {rec['round']} merged {twice} DARL position(s) that an earlier merged delta "
                     "already holds: those blocks are trained twice (blocks_trained_twice)")
        for p in self.pending.values():      # the merged deltas (no delta joins a closed round)
            if p.custody == Custody.CONFIRMED:
                p.custody = move(p.custody, Custody.COMMIT_OWED)
        self.pending, self.excluded, self.dropped = {}, [], []
        self.first_delta_at, self.merging, self.round_opened_at = None, False, now
        self.q.at, self.last_closed_at = None, self.closing_at


def round_status(t, now):
    """The round's part of GET /status (RoundTable.status)."""
    b = t.books
    members = [{"cluster": c, "incarnation": m.incarnation, "heard_s_ago": round(now - m.last_seen, 1),
                "sent": t.responded(c), "metrics": m.metrics} for c, m in sorted(t.members.items())]
    deadline = None if t.first_delta_at is None else round(t.first_delta_at + t.round_deadline_s - now, 1)
    q = t.q.status(now, t.quorum_view())
    return {"round": t.round, "merging": t.merging, "members": members,
            "pending": sorted(c for c, _ in t.pending), "deadline_in_s": deadline,
            "phase_s": t.phase_s, "quorum": q, "round_age_s": round(now - t.round_opened_at, 1),
            "outcomes": t.open_outcomes(), "excluded": list(t.excluded), "dropped": list(t.dropped),
            "pending_commits": len(b.commits), "pending_aborts": len(b.aborts),
            "aggregator": b.aggregator, "violations": dict(b.violations), "epoch": b.shown_epoch(t.custody),
            "darl": {"alarm": b.alarm, "fenced": b.fenced,
                     "custody_waiting": t.custody_waiting() if t.custody else [],
                     "commits_owed": [dict(c) for c in b.commits[:50]],
                     "aborts_owed": [dict(c) for c in b.aborts[:50]]},
            "recent": list(t.history.records), "events": list(t.roster.events)[-100:]}


# ==== the round records ===========================================================================
# A record is one line of rounds.jsonl per merge ("v": RECORD_VERSION): the round's stats and
# every delta of it as one outcome() ("merged" with merged_into, or "excluded" with why); the
# members' replies ("deltas") and GET /status carry outcomes too, "pending" while the round is
# open. History keeps the last RECORDS_KEPT records in memory (the file keeps all) and every
# DARL position inside a merged delta, so a round merging a position an earlier merged delta
# holds is counted (blocks_trained_twice, whatever DARL says). Nothing here writes the file:
# fedmom_state.Ledger appends it; status_page.py, rounds_export.py and audit.py read it.

RECORD_VERSION = 3             # 2: per-delta "outcomes" with their leases; 3: + "delta" and DARL "pieces"
RECORDS_KEPT = 200            # round records kept in memory (the file keeps all)
CLIP_HISTORY_ROUNDS = 4       # the clip's median also counts the deltas merged in these last rounds
METRIC_KEYS = ("loss", "tokens_per_s", "mfu", "tflops_per_rank", "peak_mem_gib", "inner_s",
               "heldout_loss", "heldout_round",     # held-out: the site's last eval of theta_global <round>
               "steps", "step_s", "budget_s", "cycle_s", "util", "wait_s",     # a time-budgeted phase's figures
               "exchange_round", "held_lag_s", "exchange_wait_s")   # the last exchange as the site saw it
ENDED_BY = ("clock", "lease", "data", "steps")     # metrics.ended_by: what ended the site's phase (a string)
QUORUM_RECORDS = 8            # the grace is a fraction of the median round length of this many last records
QUORUM_MIN_RECORDS = 3        # fewer records than this: the grace is a fraction of --phase-s, if given


def outcome(cluster, incarnation, base_round, tokens, leases, fate, merged_into=None, why=None,
            delta=None, pieces=None):
    """One delta's fate ("pending" | "merged" | "excluded"), as round records, GET /status and
    heartbeat replies carry it."""
    out = {"cluster": cluster, "incarnation": incarnation, "base_round": base_round, "tokens": tokens,
           "leases": [{"id": l["id"], "end": l.get("end"), **({"start": l["start"]} if "start" in l else {})}
                      for l in leases],
           "outcome": fate, "merged_into": merged_into}
    if delta:
        out["delta"] = delta
    if pieces is not None:
        out["pieces"] = [list(x) for x in pieces]
    if why is not None:
        out["why"] = why
    return out


class History:
    """The merged rounds: their last RECORDS_KEPT records, and every position merged."""

    def __init__(self):
        self.records = collections.deque(maxlen=RECORDS_KEPT)
        self.merged = darl_table.Intervals()      # every DARL position inside a merged delta

    def add(self, rec):
        for o in rec.get("outcomes", ()):
            if o.get("outcome") == "merged":
                for _, a, b in o.get("pieces") or ():
                    self.merged.union(a, b)
        self.records.append(rec)

    def missing(self, last):
        """`last` (state.json's last record) when the records lack it: rounds.jsonl is appended
        after state.json, so a crash between them loses its line. None otherwise."""
        if last and (not self.records or self.records[-1].get("round", -1) < last["round"]):
            return last
        return None

    def last_tokens(self, cluster):
        """The tokens of `cluster`'s merged delta in the last record that merged one, or None
        (the quorum rule's expectation of what it brings to a round)."""
        for rec in reversed(self.records):
            mine = [o["tokens"] for o in rec.get("outcomes", ()) if o["cluster"] == cluster
                    and o.get("outcome") == "merged"]
            if mine:
                return mine[-1]
        return None

    def expected_tokens(self, members):
        """cluster -> the tokens each of `members` is expected to bring to a round: those of its
        delta in the last record that merged one, else the mean of the members known so; None
        when none has a merged delta on record (the quorum rule cannot apply)."""
        known = {c: t for c in members if (t := self.last_tokens(c)) is not None}
        if not known:
            return None
        mean = sum(known.values()) / len(known)
        return {c: known.get(c, mean) for c in members}

    def grace_s(self, frac, phase_s):
        """The quorum's grace: `frac` (--grace-frac) x the median length of the last QUORUM_RECORDS
        records, once QUORUM_MIN_RECORDS exist; before, x `phase_s` (--phase-s); else None."""
        lengths = sorted(self.round_lengths(QUORUM_RECORDS))
        if len(lengths) >= QUORUM_MIN_RECORDS:
            n = len(lengths)
            return frac * (lengths[n // 2] + lengths[(n - 1) // 2]) / 2
        return None if phase_s is None else frac * phase_s

    def quorum(self, members, waiting, arrived, fraction, grace_frac, phase_s):
        """The quorum rule for an open round whose `waiting` members still owe a delta and whose
        deltas hold `arrived` tokens: {"fraction", "grace_s", "expected_tokens" (arrived + what
        each waiting member is expected to bring), "arrived_tokens", "reached"}, or None where it
        does not apply (--quorum 1, no grace known yet, no member on record)."""
        grace, expect = (self.grace_s(grace_frac, phase_s), self.expected_tokens(members)) \
            if fraction < 1.0 else (None, None)
        if grace is None or expect is None:
            return None
        total = arrived + sum(expect[c] for c in waiting)
        return {"fraction": fraction, "grace_s": round(grace, 3), "expected_tokens": round(total),
                "arrived_tokens": arrived, "reached": arrived > 0 and arrived >= fraction * total}

    def round_lengths(self, last):
        """Seconds each of the last `last` records took from its round's opening to its merge's
        end (wall_s + merge_s); records without wall_s are skipped."""
        return [r["wall_s"] + (r.get("merge_s") or 0.0) for r in list(self.records)[-last:]
                if isinstance(r.get("wall_s"), (int, float))]

    def outcomes_of(self, cluster):
        """`cluster`'s outcomes in the last merged round that had one of its deltas."""
        for rec in reversed(self.records):
            mine = [o for o in rec.get("outcomes", ()) if o["cluster"] == cluster]
            if mine:
                return mine
        return []

    def clip_norms(self):
        """The delta norms merged in the last CLIP_HISTORY_ROUNDS rounds (the clip's median counts them)."""
        return [c["delta_norm"] for rec in list(self.records)[-CLIP_HISTORY_ROUNDS:]
                for c in rec.get("clusters", {}).values() if c.get("delta_norm")]

    def trained_twice(self, rec):
        """Positions of `rec`'s merged deltas already inside an earlier merged delta, or named
        twice in it."""
        seen, twice = darl_table.Intervals(), 0
        for o in rec["outcomes"]:
            for _, a, b in o.get("pieces") or ():
                twice += self.merged.count(a, b) + seen.union(a, b)
        return twice


def _finite(v):
    try:
        return math.isfinite(v)
    except OverflowError:            # an int too large for a float: not a figure we keep
        return False


def clean_metrics(metrics, strict):
    """The metrics we keep of a site's dict: METRIC_KEYS as floats and "ended_by" as one of
    ENDED_BY; anything else is left out. strict (a delta's metadata): a known key with a bad
    value is a ValueError naming what it may be; else (a heartbeat) it is left out too."""
    clean = {}
    for k in METRIC_KEYS:
        v = metrics.get(k)
        if v is None:
            continue
        if isinstance(v, (int, float)) and not isinstance(v, bool) and _finite(v):
            clean[k] = float(v)
        elif strict:
            raise ValueError(f"metrics.{k} must be a finite number, got {v!r}")
    v = metrics.get("ended_by")
    if v in ENDED_BY:
        clean["ended_by"] = v
    elif v is not None and strict:
        raise ValueError(f"metrics.ended_by must be one of {', '.join(ENDED_BY)}, got {v!r}")
    return clean


class Quorum:
    """The quorum rule (--quorum `fraction`, --grace-frac, --phase-s): when the open round reached
    its quorum (`at`), whether its grace has passed, and what the record says of it. Pure: the
    view of a round is History.quorum's, made by RoundTable."""

    def __init__(self, fraction=1.0, grace_frac=0.2, phase_s=None):
        self.fraction, self.grace_frac, self.phase_s = fraction, grace_frac, phase_s
        self.at = None               # when the open round last reached its quorum (None: not reached)
        self.closing = None          # the rule as it stood at close(): the record's "quorum"

    def view(self, history, members, waiting, arrived):
        return history.quorum(members, waiting, arrived, self.fraction, self.grace_frac, self.phase_s)

    def note(self, now, view):
        """`at`: `now` when the round reaches its quorum, kept while it holds, None once it does not
        (a delta gone, a member joined); called on every arrival and at every phase()."""
        if not (view and view["reached"]):
            self.at = None
        elif self.at is None:
            self.at = now

    def passed(self, now, view):
        return self.at is not None and view is not None and now >= self.at + view["grace_s"]

    def close(self, view):
        self.closing = view and {k: view[k] for k in ("fraction", "grace_s", "expected_tokens")}

    def status(self, now, view):
        if view is not None:
            view["reached_s_ago"] = None if self.at is None else round(now - self.at, 1)
        return view

    @staticmethod
    def reason(q, waiting):
        return (f"quorum: {100 * q['arrived_tokens'] / q['expected_tokens']:.0f}% of the "
                f"{q['expected_tokens']:,} tokens expected arrived; grace {round(q['grace_s'], 2):g} s "
                f"passed without {waiting}")


def round_record(new, batch, stats, reason, late, wall_s, wall, excluded, dropped, members, period_s=None,
                 quorum=None):
    """Round `new`'s record: its merged deltas (`batch`, Pending) with the merge's
    `stats`, why it closed, the live members that sent nothing (`late`), the seconds it was
    open, the deltas it excluded and the members it dropped; the seconds since the round
    before closed (`period_s`, None for the first round of a process) and the quorum rule
    it closed under (`quorum`, None when the rule did not apply)."""
    clusters = {}
    for p, w, c, dn in zip(batch, stats["weights"], stats["scales"], stats["delta_norms"]):
        drift = dn / stats["theta_norm"] if stats["theta_norm"] > 0 else None
        key = p.cluster if p.cluster not in clusters else f"{p.cluster}@{p.incarnation}"
        waited = None if p.arrived_s is None else round(max(0.0, wall_s - p.arrived_s), 3)
        clusters[key] = {"incarnation": p.incarnation, "tokens": p.tokens, "weight": round(w, 6),
                         "drift": drift, "delta_norm": p.norm, "clip_scale": round(c, 6),
                         "arrived_s": p.arrived_s, "waited_s": waited, **p.metrics}
    losses = [(p.tokens, p.metrics["loss"]) for p in batch if "loss" in p.metrics]
    ltok = sum(t for t, _ in losses)
    loss = sum(t * l for t, l in losses) / ltok if ltok else None
    drifts = [c["drift"] for c in clusters.values() if c["drift"] is not None]
    tps = [p.metrics["tokens_per_s"] for p in batch if "tokens_per_s" in p.metrics]
    outcomes = [outcome(p.cluster, p.incarnation, p.base_round, p.tokens, p.leases, "merged", merged_into=new,
                        delta=p.delta_id, pieces=p.pieces) for p in batch]
    outcomes += [outcome(e["cluster"], e["incarnation"], e["base_round"], e["tokens"], e["leases"], "excluded",
                         why=e["why"]) for e in excluded]
    update = stats["update"]
    return {"v": RECORD_VERSION, "round": new, "base_round": new - 1, "time": round(wall, 3),
            "reason": reason, "tokens": sum(p.tokens for p in batch), "clusters": clusters,
            "loss": loss, "perplexity": safe_exp(loss),
            "drift_mean": sum(drifts) / len(drifts) if drifts else None,
            "drift_max": max(drifts) if drifts else None,
            "tokens_per_s": sum(tps) if tps else None,
            "wall_s": wall_s, "merge_s": round(stats["merge_s"], 3), "period_s": period_s, "quorum": quorum,
            "timings": {"accept_s": [p.accept_s for p in batch], "custody_s": [round(p.custody_s, 3) for p in batch],
                        "merge_s": round(stats["merge_s"], 3)},
            "outcomes": outcomes, "clip": stats["clip"], "momentum_reset": stats["momentum_reset"],
            "excluded": list(excluded), "dropped": list(dropped), "late": late, "members": members,
            "outer_lr": stats["outer_lr"], "outer_momentum": stats["outer_momentum"],
            "bytes_read": stats["bytes_read"], "bytes_written": stats["bytes_written"],
            "down_wire": update and update["format"], "update_bytes": update and update["update_bytes"],
            "down_residual_norm": update and update["residual_norm"]}


def exchange(batch, walls):
    """The round's exchange on one time line (the record's "exchange"): seconds after the
    last delta's last byte landed (`landed_at`, wall) until it was accepted (checked,
    spooled), the round closed, its merge started, the first bytes of its update were offered
    to the sites (the update is read while it is merged), the merge ended and the round was
    durable. `walls`: the wall times of those steps, None where there was none. Each site's
    own view (how long after this it held the new theta, and the wait it saw) comes with its
    next delta's metrics: "held_lag_s", "exchange_wait_s" (fedsite.FedSite.round_trip)."""
    t0 = max(p.received if p.landed is None else p.landed for p in batch)
    at = lambda w: None if w is None else round(w - t0, 3)
    return {"landed_at": round(t0, 3), "accepted_s": at(max(p.received for p in batch)),
            **{f"{k}_s": at(walls.get(k)) for k in ("closed", "merge_start", "offered", "merged", "durable")}}


def safe_exp(x):
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
