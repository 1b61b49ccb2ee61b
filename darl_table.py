"""darl_table.py - DARL's lease table with no I/O: the books of every block position, the sites'
calls on them, and the aggregator's custody and fencing on the same books.

Used on the central VM by darl_server.py (the table it serves and replays its write-ahead log
through is a CustodyTable) and audit.py; the aggregator (fedmom_round.py, fedmom_server.py) and
status_page.py use its Intervals, the violation counters' names and their status line.
Standard library only; never torch. Not run on its own; tested in tests/test_darl.py.

A pure state machine over positions [0, M): UNASSIGNED -> LEASED -> COMMITTED, or QUARANTINED
after repeated expiries; a leased run the aggregator accepted a delta for goes LEASED -> IN
CUSTODY -> COMMITTED, or back to UNASSIGNED on an abort. Every position is in exactly one
place, and verify() checks it. No file, socket or thread: time comes in as `now` (or an
injected clock), so a replay through the same methods at the logged times, under the logged
TableConfig, gives the same table back. Which samples a position means is block_space.py's.

Its parts, in reading order:
  - what the books are made of: LeaseError (a refusal: status, one-line reason; a `counted`
    one raises the violation counters, VIOLATIONS, whose loud status line is
    violations_line), Intervals (disjoint position runs), Lease, Cluster and Custody records,
    TableConfig (the leasing flags, each error naming its flag), the checks of a request;
  - LeaseTable: the sites' calls (register, acquire, heartbeat, commit, release) and the
    coordinator's (expire, restore, set_config); verify(), status(), and to_dict/from_dict
    (the table in a snapshot);
  - CustodyTable: the aggregator's calls, fence/confirm_fence (the epochs that fence its
    processes) and take_custody/commit_custody/abort_custody/abort_orphaned (custody of an
    accepted delta's positions, its two-phase commit).

    table = CustodyTable(space.num_blocks, TableConfig(), clock=time.time)
    table.register("lumi", "inc-1"); table.acquire("lumi", "inc-1", blocks=8); table.verify()
    epoch = table.fence("agg", 0, "claim-1")["epoch"]
    table.confirm_fence("agg", epoch, "claim-1", "proc-1")
    table.take_custody("agg", epoch, "delta-1", "lumi", "inc-1", [{"lease": 1}])
    table.commit_custody("agg", epoch, "delta-1", round=1)      # or abort_custody(...)

The protocol: FEDERATION_GUIDE.md, "Leases (DARL)" and "Endpoints".
"""
import bisect
import collections
import dataclasses
import math
import operator
import time


class LeaseError(Exception):
    """A refused request: HTTP status + one-line reason. The table is unchanged, except for
    a `counted` refusal (a commit that cannot stand), which the violation counters record."""

    def __init__(self, status, reason, counted=False, **extra):
        super().__init__(reason)
        self.status, self.reason, self.extra, self.counted = status, reason, extra, counted


class InvariantError(AssertionError):
    """verify() found the books inconsistent: a bug, never a client's fault."""


class Intervals:
    """Disjoint half-open position runs [start, end), sorted, each with a tag
    (the reclaim count for the free pool). Adjacent runs with the same tag merge,
    so the list stays about as long as the number of leases, not M."""

    def __init__(self, items=()):
        self.starts, self.items, self.total = [], [], 0
        for s, e, tag in items:
            self.add(s, e, tag)

    def add(self, start, end, tag=0):
        if start >= end:
            return
        i = bisect.bisect_left(self.starts, start)
        if (i > 0 and self.items[i - 1][1] > start) or (i < len(self.items) and self.items[i][0] < end):
            raise InvariantError(f"run [{start}, {end}) overlaps one already in the set")
        self.total += end - start
        if i > 0 and self.items[i - 1][1] == start and self.items[i - 1][2] == tag:
            i -= 1
            start = self.items[i][0]
            del self.starts[i], self.items[i]
        if i < len(self.items) and self.items[i][0] == end and self.items[i][2] == tag:
            end = self.items[i][1]
            del self.starts[i], self.items[i]
        self.starts.insert(i, start)
        self.items.insert(i, (start, end, tag))

    def covers(self, start, end):
        """True when every position of [start, end) is in the set."""
        i = bisect.bisect_right(self.starts, start) - 1
        while start < end:
            if i < 0 or i >= len(self.items) or not self.items[i][0] <= start < self.items[i][1]:
                return False
            start, i = self.items[i][1], i + 1
        return True

    def count(self, start, end):
        """How many positions of [start, end) are in the set."""
        i, n = max(0, bisect.bisect_right(self.starts, start) - 1), 0
        while i < len(self.items) and self.items[i][0] < end:
            n += max(0, min(end, self.items[i][1]) - max(start, self.items[i][0]))
            i += 1
        return n

    def union(self, start, end, tag=0):
        """Add the positions of [start, end) not in the set yet; returns how many already were."""
        i, pos, gaps = max(0, bisect.bisect_right(self.starts, start) - 1), start, []
        while i < len(self.items) and self.items[i][0] < end:
            s, e, _ = self.items[i]
            if s > pos:
                gaps.append((pos, s))
            pos, i = max(pos, e), i + 1
        if pos < end:
            gaps.append((pos, end))
        for a, b in gaps:
            self.add(a, b, tag)
        return (end - start) - sum(b - a for a, b in gaps)

    def take(self, start, end):
        """Remove [start, end), which covers() must hold for; the runs cut keep their tags."""
        if not self.covers(start, end):
            raise InvariantError(f"run [{start}, {end}) is not wholly in the set")
        while start < end:
            i = bisect.bisect_right(self.starts, start) - 1
            s, e, tag = self.items[i]
            del self.starts[i], self.items[i]
            for a, b in ((s, start), (min(e, end), e)):
                if a < b:
                    j = bisect.bisect_left(self.starts, a)
                    self.starts.insert(j, a)
                    self.items.insert(j, (a, b, tag))
            self.total -= min(e, end) - start
            start = min(e, end)

    def pop_front(self, n):
        """Take up to n positions from the lowest run: (start, end, tag) or None."""
        if not self.items:
            return None
        s, e, tag = self.items[0]
        take = min(n, e - s)
        if s + take == e:
            del self.starts[0], self.items[0]
        else:
            self.starts[0] = s + take
            self.items[0] = (s + take, e, tag)
        self.total -= take
        return s, s + take, tag

    def pop_fit(self, n):
        """Take n positions from the lowest run that holds n, else as many as the longest run
        holds (the lowest of equals): (start, end, tag) or None. A short run left by a phase
        the clock ended (a released tail) is not handed to someone who asked for more."""
        if not self.items:
            return None
        i = next((k for k, (s, e, _) in enumerate(self.items) if e - s >= n), None)
        if i is None:
            i = max(range(len(self.items)), key=lambda k: (self.items[k][1] - self.items[k][0], -k))
        s, e, tag = self.items[i]
        take = min(n, e - s)
        if s + take == e:
            del self.starts[i], self.items[i]
        else:
            self.starts[i] = s + take
            self.items[i] = (s + take, e, tag)
        self.total -= take
        return s, s + take, tag

    def __iter__(self):
        return iter(self.items)

    def __len__(self):
        return len(self.items)


@dataclasses.dataclass
class Lease:
    id: int
    cluster: str
    incarnation: str
    first: int            # where the lease began; [first, start) is committed
    start: int            # first uncommitted position
    claimed: int          # [start, claimed) the holder has started: never stolen
    end: int              # authoritative end; shrinks when a tail is stolen
    granted_end: int      # end at grant time: tells "stolen" from "never yours"
    expires: float
    attempts: int         # reclaims its positions had before this grant
    granted_at: float
    progress_at: float    # last commit (or the grant): the commit-rate clock
    state: str = "live"   # live | done | released | expired

    def wire(self, now=None):
        out = {"id": self.id, "lease": self.id, "cluster": self.cluster, "start": self.start,
               "claimed": self.claimed, "end": self.end, "first": self.first, "state": self.state,
               "valid": self.state == "live", "attempts": self.attempts}
        if now is not None and self.state == "live":
            out["ttl_left"] = round(self.expires - now, 3)
        return out


@dataclasses.dataclass
class Cluster:
    name: str
    incarnation: str
    last_seen: float
    ttl: float
    first_acquire: float | None = None
    last_commit: float | None = None
    rate: float | None = None       # blocks/s used to size grants and to pick steal victims
    reported: bool = False          # rate is the client's own measurement, not inferred
    committed: int = 0
    lost: int = 0                   # positions reclaimed from it on expiry
    stolen: int = 0                 # positions other clusters took from its tails
    left: bool = False
    last_request: str | None = None
    last_lease: int | None = None


@dataclasses.dataclass
class Custody:
    """Positions an aggregator holds for one accepted delta, until it commits or aborts them."""
    aggregator: str
    delta: str
    epoch: int
    cluster: str
    incarnation: str
    pieces: list          # [[lease, start, end, tag, pool]]: where an abort returns [start, end)
    state: str            # held | committed | aborted
    t: float
    why: str | None = None

    @property
    def blocks(self):
        return sum(p[2] - p[1] for p in self.pieces)

    def wire(self):
        out = {"aggregator": self.aggregator, "delta": self.delta, "epoch": self.epoch, "cluster": self.cluster,
               "incarnation": self.incarnation, "state": self.state,
               "pieces": [[p[0], p[1], p[2]] for p in self.pieces], "blocks": self.blocks}
        if self.why:
            out["why"] = self.why
        return out


VIOLATIONS = ("refused_commits", "aborted_custody", "blocks_trained_twice", "refused_aborts")


def violations_line(v):
    """The loud status line for violation counters above 0 (DARL's or the aggregator's), or None."""
    if not v or not any(v.values()):
        return None
    return ("!!! EXACTLY-ONCE VIOLATED: " + ", ".join(f"{k} {n}" for k, n in v.items())
            + " (FEDERATION_GUIDE.md section 7 says what each means; `python audit.py` names the blocks)")


_LEASE_ROW = operator.attrgetter(*(f.name for f in dataclasses.fields(Lease)))
_CUSTODY_ROW = operator.attrgetter(*(f.name for f in dataclasses.fields(Custody)))
_CUSTODY_PIECES = [f.name for f in dataclasses.fields(Custody)].index("pieces")


def _custody_row(C):
    """A Custody as a snapshot row, its pieces copied (the record keeps changing)."""
    row = list(_CUSTODY_ROW(C))
    row[_CUSTODY_PIECES] = [list(p) for p in C.pieces]
    return row


@dataclasses.dataclass
class TableConfig:
    max_attempts: int = 3           # --max-attempts: reclaims before a run is quarantined; 0 = never
    min_ttl: float = 10.0           # --min-ttl s
    max_ttl: float = 3600.0         # --max-ttl s
    default_ttl: float = 120.0      # --default-ttl s, when a client names none
    grant_seconds: float = 600.0    # --grant-seconds: a grant is this much of the holder's measured work
    initial_grant: int = 1          # --initial-grant blocks, before a cluster's rate is known
    max_grant: int = 0              # --max-grant blocks; 0 = no cap
    fit_grants: bool = True         # a grant comes from the lowest free run that holds it (False: the
                                    # lowest run, cut short; what a log written before this field did)

    def validate(self):
        checks = [(self.max_attempts >= 0, "--max-attempts must be >= 0 (0 = never quarantine)"),
                  (0 < self.min_ttl <= self.default_ttl <= self.max_ttl,
                   "need 0 < --min-ttl <= --default-ttl <= --max-ttl"),
                  (self.grant_seconds > 0, "--grant-seconds must be > 0"),
                  (self.initial_grant >= 1, "--initial-grant must be >= 1 block"),
                  (self.max_grant >= 0, "--max-grant must be >= 0 (0 = no cap)")]
        for ok, msg in checks:
            if not ok:
                raise ValueError(msg)
        return self

    def to_dict(self):
        d = dataclasses.asdict(self)
        if not self.fit_grants:      # as a log from before the key said it: its recorded outcomes replay
            del d["fit_grants"]
        return d

    @classmethod
    def from_dict(cls, d):
        names = {f.name for f in dataclasses.fields(cls)}
        if isinstance(d, dict) and "fit_grants" not in d:
            d = {**d, "fit_grants": False}        # logged before grants were fitted: replayed as decided then
        if not isinstance(d, dict) or set(d) != names:
            raise ValueError(f"a table config needs exactly the keys {sorted(names)}, got {d!r}")
        return cls(**d).validate()

    def changes(self, other):
        """[(flag, value here, value in other)] for every field that differs."""
        return [("--" + f.name.replace("_", "-"), getattr(self, f.name), getattr(other, f.name))
                for f in dataclasses.fields(self) if getattr(self, f.name) != getattr(other, f.name)
                and f.name != "fit_grants"]      # no flag: a run keeps the rule its log began with


def check_name(kind, value):
    ok = isinstance(value, str) and 0 < len(value) <= 64 and all(ch.isalnum() or ch in "._-" for ch in value)
    if not ok:
        raise LeaseError(400, f"{kind} must be 1-64 characters of [A-Za-z0-9._-], got {value!r}")


def is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def _lease_items(leases, key="cursor"):
    """[id | {"lease": id, key: pos}] -> [(id, pos or None)], or a 400 (key: a heartbeat's
    "cursor", a release's "from")."""
    if not isinstance(leases, list):
        raise LeaseError(400, f"field 'leases' must be a list of lease ids or {{lease, {key}}} objects")
    out = []
    for item in leases:
        lid, pos = (item.get("lease"), item.get(key)) if isinstance(item, dict) else (item, None)
        if not is_int(lid) or (pos is not None and not is_int(pos)):
            raise LeaseError(400, f"bad lease entry {item!r}: want an integer id and optional integer {key}")
        out.append((lid, pos))
    return out


def _give_back_tail(free, L, cut):
    """[cut, L.end) of live lease L back to the free pool; the lease goes on, shorter. -> how many."""
    if cut >= L.end:
        return 0
    n = L.end - cut
    free.add(cut, L.end, L.attempts)
    L.end, L.claimed = cut, min(L.claimed, cut)
    return n


class LeaseTable:
    """The lease state machine over positions [0, M). No I/O, no threads; time
    comes from `now` (or the injected clock), so tests and log replay drive it.

    Every position is in exactly one place: the free pool (UNASSIGNED, tagged
    with its reclaim count), a live lease (LEASED), a custody record (IN CUSTODY: the
    calls that make and end one are CustodyTable's, the table DARL runs),
    `committed` or `quarantined`.
    Every method validates before it changes anything, so a refused call
    (LeaseError) leaves the books as they were, apart from expiring leases
    whose time is up, which any call may do and which depends only on time.
    """

    def __init__(self, num_blocks, config=None, clock=time.time):
        self.num_blocks = int(num_blocks)
        self.config = (config or TableConfig()).validate()
        self.clock = clock
        self.free = Intervals([(0, self.num_blocks, 0)])
        self.committed = Intervals()
        self.quarantined = Intervals()
        self.leases, self.closed, self.clusters, self.held = {}, {}, {}, {}
        self.next_id = 1
        self.custody = {}             # (aggregator, delta) -> Custody
        self.custody_held = set()     # keys of custody still held
        self.aggregators = {}         # aggregator -> {"epoch": the one issued last, "retired": None | why,
        #     "claim": the fence ask it answered, until that epoch acts, "holder": the process that
        #     confirmed it (None: not yet), "round": the highest round it committed custody for}
        self.counters = {k: 0 for k in VIOLATIONS}

    # ---- identity

    def _member(self, cluster, incarnation):
        c = self.clusters.get(cluster)
        if c is None:
            raise LeaseError(404, f"unknown cluster {cluster!r}: call /register first")
        if c.incarnation != incarnation:
            raise LeaseError(409, f"stale incarnation {incarnation!r} of cluster {cluster!r}: incarnation "
                                  f"{c.incarnation!r} registered after it; this process must stop using its leases")
        if c.left:
            raise LeaseError(409, f"incarnation {incarnation!r} of cluster {cluster!r} has left: register again")
        return c

    def _live(self, c, now):
        return not c.left and (now < c.last_seen + c.ttl or bool(self.held.get(c.name)))

    def _ttl(self, ttl):
        if ttl is None:
            return self.config.default_ttl
        if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not math.isfinite(ttl) or ttl <= 0:
            raise LeaseError(400, f"ttl must be a positive number of seconds, got {ttl!r}")
        return min(max(float(ttl), self.config.min_ttl), self.config.max_ttl)

    def register(self, cluster, incarnation, now=None):
        now = self.clock() if now is None else now
        check_name("cluster", cluster)
        check_name("incarnation", incarnation)
        self.expire(now)
        c = self.clusters.get(cluster)
        if c is not None and c.incarnation != incarnation and self._live(c, now):
            wait = max(c.last_seen + c.ttl, max((self.leases[i].expires for i in self.held.get(cluster, ())),
                                                default=0)) - now
            raise LeaseError(409, f"cluster id {cluster!r} is held by live incarnation {c.incarnation!r} "
                                  f"({len(self.held.get(cluster, ()))} leases); a second job on the same stream "
                                  f"would train the same data twice: start it with --replica (its own stream, "
                                  f"e.g. --replica b -> {cluster}-b), or wait {wait:.0f} s for the old leases to expire",
                             code="incarnation_conflict", retry_after_s=round(max(wait, 0.0), 3))
        if c is None:
            c = self.clusters[cluster] = Cluster(cluster, incarnation, now, self.config.default_ttl)
            self.held[cluster] = set()
        elif c.incarnation != incarnation:      # the old process is gone: a requeue takes the stream over
            c.incarnation, c.last_request, c.last_lease = incarnation, None, None
        c.left, c.last_seen = False, now
        return {"cluster": cluster, "incarnation": incarnation, "num_blocks": self.num_blocks}

    # ---- granting

    def _rate(self, name):
        r = self.clusters[name].rate
        if r:
            return r
        known = [c.rate for c in self.clusters.values() if c.rate]
        return sum(known) / len(known) if known else 1.0

    def _grant_size(self, c, blocks):
        if blocks is not None:
            want = blocks
        elif c.rate:
            want = max(1, round(c.rate * self.config.grant_seconds))
        else:
            want = self.config.initial_grant
        return min(want, self.config.max_grant) if self.config.max_grant else want

    def _new_lease(self, c, start, end, attempts, now, ttl):
        lease = Lease(self.next_id, c.name, c.incarnation, start, start, start, end, end,
                      now + ttl, attempts, now, now)
        self.next_id += 1
        self.leases[lease.id] = lease
        self.held[c.name].add(lease.id)
        if c.first_acquire is None:
            c.first_acquire = now
        return lease

    def _steal(self, thief, want, now, ttl):
        """Split the unstarted tail of the lease that will finish last, in
        proportion to the two clusters' rates, so both end at about the same time."""
        rt = self._rate(thief.name)
        candidates = [L for L in self.leases.values() if L.cluster != thief.name and L.end > L.claimed]
        candidates.sort(key=lambda L: ((L.end - L.start) / self._rate(L.cluster), -L.id), reverse=True)
        for victim in candidates:
            unstarted = victim.end - victim.claimed
            rv = self._rate(victim.cluster)
            n = min(want, math.floor(unstarted * rt / (rt + rv)))
            if victim.claimed == victim.start:
                n = min(n, unstarted - 1)        # the victim keeps at least one block to work on
            if n < 1:
                continue
            cut = victim.end - n
            lease = self._new_lease(thief, cut, victim.end, victim.attempts, now, ttl)
            victim.end = cut
            self.clusters[victim.cluster].stolen += n
            return lease
        return None

    def acquire(self, cluster, incarnation, blocks=None, ttl=None, request_id=None, now=None):
        now = self.clock() if now is None else now
        if blocks is not None and (not is_int(blocks) or blocks < 1):
            raise LeaseError(400, f"blocks must be a positive integer, got {blocks!r}")
        if request_id is not None and not isinstance(request_id, str):
            raise LeaseError(400, "request_id must be a string")
        ttl = self._ttl(ttl)
        self.expire(now)
        c = self._member(cluster, incarnation)
        c.last_seen, c.ttl = now, ttl
        if request_id is not None and request_id == c.last_request:    # a retried call: same answer
            lease = self.leases.get(c.last_lease) or self.closed[c.last_lease]
            return {"status": "ok", "lease": lease.wire(now), "repeat": True}
        want = self._grant_size(c, blocks)
        lease = None
        if self.free.total:
            idle = sum(1 for x in self.clusters.values()
                       if x is not c and not self.held[x.name] and self._live(x, now))
            share = -(-self.free.total // (1 + idle))          # leave some for every idle cluster that is up
            pop = self.free.pop_fit if self.config.fit_grants else self.free.pop_front
            start, end, attempts = pop(min(want, share))
            lease = self._new_lease(c, start, end, attempts, now, ttl)
        else:
            lease = self._steal(c, want, now, ttl)
        if lease is None:
            if self.leases or self.custody_held:      # an expiry or a custody abort may return blocks
                soonest = min((L.expires for L in self.leases.values()), default=now + 1.0)
                return {"status": "wait", "retry_after": round(min(5.0, max(0.1, soonest - now)), 3)}
            return self._done_reply()
        c.last_request, c.last_lease = request_id, lease.id
        return {"status": "ok", "lease": lease.wire(now)}

    def _done_reply(self):
        out = {"status": "done", "committed": self.committed.total, "quarantined": self.quarantined.total}
        if self.quarantined.total:
            out["warning"] = (f"{self.quarantined.total} blocks were QUARANTINED after "
                              f"{self.config.max_attempts} failed attempts and are missing from this epoch")
        return out

    # ---- holding

    def heartbeat(self, cluster, incarnation, leases=(), ttl=None, throughput=None, now=None):
        now = self.clock() if now is None else now
        items = _lease_items(list(leases))
        ttl = None if ttl is None else self._ttl(ttl)
        if throughput is not None and (isinstance(throughput, bool) or not isinstance(throughput, (int, float))
                                       or not math.isfinite(throughput) or throughput < 0):
            raise LeaseError(400, f"throughput must be a finite number >= 0 (blocks/s), got {throughput!r}")
        self.expire(now)
        c = self._member(cluster, incarnation)
        ttl = ttl or c.ttl          # a heartbeat that names no TTL keeps the site's
        c.last_seen, c.ttl = now, ttl
        if throughput:
            c.rate, c.reported = float(throughput), True
        out = []
        for lid, cursor in items:
            L = self.leases.get(lid)
            if L is not None and L.cluster == cluster and L.incarnation == incarnation:
                L.expires = max(L.expires, now + ttl)      # a heartbeat never shortens a lease
                if cursor is not None:
                    L.claimed = max(L.claimed, min(cursor, L.end))
                out.append(L.wire(now))
                continue
            old = self.closed.get(lid) or L
            if old is None:
                out.append({"lease": lid, "valid": False, "reason": "unknown lease"})
            elif old.cluster != cluster or old.incarnation != incarnation:
                out.append({"lease": lid, "valid": False, "reason": "not held by this incarnation"})
            else:
                out.append({**old.wire(), "reason": f"lease is {old.state}"})
        return {"leases": out, "ttl": ttl}

    def commit(self, cluster, incarnation, lease, end=None, now=None):
        """Commit [lease.start, end): the update trained on them is durable."""
        now = self.clock() if now is None else now
        if not is_int(lease) or (end is not None and not is_int(end)):
            raise LeaseError(400, "lease and end must be integers")
        self.expire(now)
        L = self.leases.get(lease) or self.closed.get(lease)
        if L is None:
            raise LeaseError(404, f"unknown lease {lease}")
        if L.cluster != cluster or L.incarnation != incarnation:
            raise LeaseError(409, f"lease {lease} is not held by cluster {cluster!r} incarnation {incarnation!r}")
        end = L.end if end is None else end
        if end <= L.start:                        # already committed: a repeat is a no-op
            return {"lease": lease, "committed": 0, "repeat": True, "start": L.start, "end": L.end}
        if end > L.end:
            why = "were stolen (the heartbeat reply shrank this lease)" if end <= L.granted_end else "were never in it"
            raise LeaseError(409, f"cannot commit lease {lease} up to {end}: positions [{L.end}, {end}) {why}")
        pieces = [] if L.state == "live" else self._unclaimed(L.start, end) if L.state == "expired" else None
        if pieces is None:
            why = ("went back to the pool and were leased or committed again since"
                   if L.state == "expired" else "went back to the pool")
            raise LeaseError(409, f"lease {lease} was {L.state} before [{L.start}, {end}) was committed; those "
                                  f"blocks {why}: discard the work done on them")
        for pool, a, b, _ in pieces:    # a late commit takes them back from the free pool (or quarantine)
            pool.take(a, b)
        n = end - L.start
        self.committed.add(L.start, end)
        c = self.clusters[cluster]
        c.committed += n
        c.last_commit = now
        if not c.reported:
            sample = n / max(now - L.progress_at, 1e-3)
            c.rate = sample if c.rate is None else 0.5 * c.rate + 0.5 * sample
        L.start, L.claimed, L.progress_at = end, max(L.claimed, end), now
        if L.state != "live":
            L.claimed = end             # the rest of an expired lease is in the pool, not claimed by it
            if L.start == L.end:
                L.state = "done"
        elif L.start == L.end:
            self._close(L, "done")
        return {"lease": lease, "committed": n, "start": L.start, "end": L.end}

    def _unclaimed(self, start, end):
        """[(pool, a, b, tag)] covering [start, end) when every position is in the free pool
        or quarantine (nobody leased, committed or took it into custody since), else None.
        An expired lease's work may still be committed then: nobody else trained those blocks."""
        pieces = []
        while start < end:
            for pool in (self.free, self.quarantined):
                i = bisect.bisect_right(pool.starts, start) - 1
                if i >= 0 and start < pool.items[i][1]:
                    b = min(end, pool.items[i][1])
                    pieces.append((pool, start, b, pool.items[i][2]))
                    start = b
                    break
            else:
                return None
        return pieces

    def release(self, cluster, incarnation, leases=(), leave=False, now=None):
        """Give back the uncommitted part of leases (no attempt counted; {"lease": id, "from": pos}:
        [pos, end) only, _give_back_tail); leave=True also ends the incarnation (a requeue registers at once)."""
        now = self.clock() if now is None else now
        items = _lease_items(list(leases), "from")
        cuts, ids = {lid: cut for lid, cut in items if cut is not None and not leave}, [lid for lid, _ in items]
        self.expire(now)
        c = self._member(cluster, incarnation)
        for lid in ids:
            L = self.leases.get(lid) or self.closed.get(lid)
            if L is None or L.cluster != cluster or L.incarnation != incarnation:
                raise LeaseError(404 if L is None else 409, f"lease {lid} is not held by this incarnation")
        if leave:
            ids = sorted(set(ids) | self.held[cluster])
        returned = 0
        for lid in ids:
            L = self.leases.get(lid)
            if L is not None and cuts.get(lid, L.start) > L.start:
                returned += _give_back_tail(self.free, L, cuts[lid])
            elif L is not None:
                returned += L.end - L.start
                self._close(L, "released")
                self.free.add(L.start, L.end, L.attempts)
        c.last_seen, c.left = now, bool(leave)
        return {"released": returned, "left": c.left}

    def _close(self, L, state):
        del self.leases[L.id]
        self.held[L.cluster].discard(L.id)
        L.state = state
        self.closed[L.id] = L

    def set_config(self, config, now=None):
        """A logged change of the decision flags (darl_server.py --accept-config-change)."""
        try:
            self.config = TableConfig.from_dict(config)
        except (TypeError, ValueError) as e:
            raise LeaseError(400, f"bad table config: {e}")
        return {"config": self.config.to_dict()}

    def expire(self, now):
        """Reclaim every lease whose TTL ran out: its uncommitted part returns to
        the pool, the started part with one more attempt (or to quarantine)."""
        for L in [L for L in self.leases.values() if L.expires <= now]:
            self._close(L, "expired")
            self.clusters[L.cluster].lost += L.end - L.start
            tried = L.attempts + 1
            if self.config.max_attempts and tried >= self.config.max_attempts:
                self.quarantined.add(L.start, L.claimed)
            else:
                self.free.add(L.start, L.claimed, tried)
            self.free.add(L.claimed, L.end, L.attempts)

    def restore(self, grace, now=None):
        """After a coordinator restart: leases alive at the crash get `grace` more seconds."""
        now = self.clock() if now is None else now
        for L in self.leases.values():
            L.expires = max(L.expires, now + grace)
        return {"restored": len(self.leases)}

    # ---- books

    def verify(self):
        """Raise InvariantError unless: every position is in exactly one place
        (free, one live lease, committed, quarantined) so no two holders share
        one; per-cluster committed counts sum to the committed total; and once
        nothing is free or leased, committed + quarantined is the whole space."""
        runs = [(s, e, "free") for s, e, _ in self.free] + [(s, e, "committed") for s, e, _ in self.committed]
        runs += [(s, e, "quarantined") for s, e, _ in self.quarantined]
        for L in self.leases.values():
            if not L.first <= L.start <= L.claimed <= L.end <= L.granted_end or L.start == L.end:
                raise InvariantError(f"lease {L.id} has inconsistent bounds {L.wire()}")
            runs.append((L.start, L.end, f"lease {L.id} ({L.cluster})"))
        for key in self.custody_held:
            C = self.custody[key]
            if C.state != "held":
                raise InvariantError(f"custody of delta {C.delta!r} is {C.state} but counted as held")
            runs += [(a, b, f"custody of delta {C.delta!r} ({C.aggregator})") for _, a, b, _, _ in C.pieces]
        runs.sort()
        pos, prev = 0, "the start"
        for s, e, owner in runs:
            if s < pos:
                raise InvariantError(f"disjointness: positions [{s}, {min(e, pos)}) are both {prev} and {owner}")
            if s > pos:
                raise InvariantError(f"completeness: positions [{pos}, {s}) belong to nobody")
            pos, prev = e, owner
        if pos != self.num_blocks:
            raise InvariantError(f"completeness: positions [{pos}, {self.num_blocks}) belong to nobody")
        per_cluster = sum(c.committed for c in self.clusters.values())
        if per_cluster != self.committed.total:
            raise InvariantError(f"duplication: clusters committed {per_cluster} blocks in all, "
                                 f"the committed set holds {self.committed.total}")
        done = not self.free.total and not self.leases and not self.custody_held
        return {"num_blocks": self.num_blocks, "committed": self.committed.total,
                "quarantined": self.quarantined.total, "free": self.free.total,
                "leased": sum(L.end - L.start for L in self.leases.values()),
                "in_custody": sum(self.custody[k].blocks for k in self.custody_held),
                "done": done, "complete": self.committed.total == self.num_blocks}

    def status(self, now=None):
        now = self.clock() if now is None else now
        self.expire(now)
        books = self.verify()
        rows = []
        for c in self.clusters.values():
            span = (c.last_commit - c.first_acquire) if c.last_commit and c.first_acquire else 0
            rows.append({"cluster": c.name, "incarnation": c.incarnation, "live": self._live(c, now),
                         "committed": c.committed, "lost": c.lost, "stolen_from": c.stolen,
                         "leased": sum(self.leases[i].end - self.leases[i].start for i in self.held[c.name]),
                         "blocks_per_s": round(c.committed / span, 3) if span > 0 else None,
                         "rate": c.rate, "last_seen_s": round(now - c.last_seen, 1)})
        return {**books, "clusters": rows, "quarantined_runs": [[s, e] for s, e, _ in self.quarantined][:50],
                "leases": [L.wire(now) for L in list(self.leases.values())[:200]],
                "violations": dict(self.counters)}

    # ---- snapshot form

    def to_dict(self):
        """The table as plain values, sharing nothing mutable with it (darl_server serializes
        it outside its lock). Rows by attrgetter: dataclasses.astuple deep-copies field by
        field, ~10x slower, and closed leases are kept for good, so this grows with the run."""
        return {"num_blocks": self.num_blocks, "next_id": self.next_id,
                "free": [list(x) for x in self.free], "committed": [list(x) for x in self.committed],
                "quarantined": [list(x) for x in self.quarantined],
                "leases": [_LEASE_ROW(L) for L in self.leases.values()],
                "closed": [_LEASE_ROW(L) for L in self.closed.values()],
                "clusters": [dict(vars(c)) for c in self.clusters.values()],
                "custody": [_custody_row(C) for C in self.custody.values()],
                "aggregators": {k: dict(v) for k, v in self.aggregators.items()}, "counters": dict(self.counters)}

    @classmethod
    def from_dict(cls, d, config=None, clock=time.time):
        t = cls(d["num_blocks"], config, clock)
        t.next_id = d["next_id"]
        t.free, t.committed, t.quarantined = (Intervals(map(tuple, d[k])) for k in ("free", "committed", "quarantined"))
        t.clusters = {c["name"]: Cluster(**c) for c in d["clusters"]}
        t.held = {name: set() for name in t.clusters}
        t.leases = {row[0]: Lease(*row) for row in d["leases"]}
        t.closed = {row[0]: Lease(*row) for row in d["closed"]}
        for L in t.leases.values():
            t.held[L.cluster].add(L.id)
        t.custody = {(row[0], row[1]): Custody(*row) for row in d.get("custody", [])}
        t.custody_held = {k for k, C in t.custody.items() if C.state == "held"}
        t.aggregators = {k: dict(v) for k, v in d.get("aggregators", {}).items()}
        t.counters = {k: int(d.get("counters", {}).get(k, 0)) for k in VIOLATIONS}
        return t


# ==== the aggregator's calls: custody and fencing (CustodyTable) ==================================
# take_custody() moves the positions a delta trained on out of their lease into a record owned by
# one aggregator; only that aggregator's commit_custody() or abort_custody() (or the operator's
# abort_orphaned()) ends it: no TTL, steal, release or new incarnation touches it.
# Epochs are DARL's to issue: fence() gives the next one (one more than any issued) only to the
# state that holds the current one, naming it as last_epoch with the process it bound it to as
# last_holder (never confirmed, or confirmed by that holder), and whose round is not below the
# highest round this aggregator committed custody for. A stale copy of the state, or one taken
# while a fence was in flight, never gets in; every other call must name the current epoch
# (code "fenced" otherwise). A commit that cannot stand (custody aborted or never taken) is
# refused and COUNTED in `counters` (refused_commits, aborted_custody, blocks_trained_twice; an
# abort of committed custody: refused_aborts), kept in the snapshot and rebuilt by the replay.

def _custody_items(leases):
    """[{"lease": id, "start"?: pos, "end"?: pos}] -> [(id, start|None, end|None)], or a 400."""
    if not isinstance(leases, list) or not leases:
        raise LeaseError(400, "field 'leases' must be a non-empty list of {lease, start?, end?} objects")
    out = []
    for item in leases:
        if not isinstance(item, dict) or not is_int(item.get("lease")) or not all(
                item.get(k) is None or is_int(item[k]) for k in ("start", "end")):
            raise LeaseError(400, f"bad lease entry {item!r}: want an integer 'lease' and optional integer "
                                  "'start' and 'end'")
        out.append((item["lease"], item.get("start"), item.get("end")))
    if len({lid for lid, _, _ in out}) != len(out):
        raise LeaseError(400, "a lease is named twice in one custody request")
    return out


def _epoch(epoch):
    if not is_int(epoch) or epoch < 0:
        raise LeaseError(400, f"epoch must be an integer >= 0, got {epoch!r}")
    return epoch


def _round(round):
    if not is_int(round) or round < 0:
        raise LeaseError(400, f"round must be an integer >= 0, got {round!r}")
    return round


class CustodyTable(LeaseTable):
    """LeaseTable with the aggregator's calls: custody and fencing (the comment above)."""

    def fence(self, aggregator, last_epoch, claim, last_holder=None, round=None, now=None):
        """A starting aggregator process asks for an epoch. `last_epoch` is the one its state
        held (0: none yet), `last_holder` the process its state bound that epoch to (written
        durably before that process confirmed it; None from a state written before holders
        existed), `round` the state's durable round, `claim` a random string it made durable
        before asking. The next epoch goes only to the state that holds the current one:
        it names it, and that epoch was never confirmed or was confirmed by `last_holder`.
        A state naming it that some other process confirmed is a copy taken while that
        epoch's fence was in flight (its own confirm refused or lost): fenced, at every
        start. A state whose round is below the highest round whose custody commits DARL
        took from this aggregator lacks merges whose blocks are committed (a copy taken
        before them): fenced. A repeat of the same claim gets the same epoch until that
        epoch is confirmed or used (the answer to the first ask was lost)."""
        check_name("aggregator", aggregator)
        last_epoch = _epoch(last_epoch)
        check_name("claim", claim)
        if last_holder is not None:
            check_name("last_holder", last_holder)
        if round is not None:
            round = _round(round)
        a = self.aggregators.get(aggregator)
        if a is not None and a["retired"]:
            self._check_fence(aggregator, a["epoch"])
        if a is None:                 # first ask (or a DARL that never heard of it): nothing to compare
            a = {"epoch": last_epoch, "retired": None, "claim": None}
        repeat = a.get("claim") == claim and a["epoch"] == last_epoch + 1 and not a.get("holder")
        if not repeat and a["epoch"] != last_epoch:
            raise LeaseError(409, f"aggregator {aggregator!r}: this state last held epoch {last_epoch}, DARL issued "
                                  f"epoch {a['epoch']} since: a newer copy of this aggregator's state runs (or ran); "
                                  "this one is stale and must stop", code="fenced")
        if not repeat and a.get("holder") and last_holder is not None and a["holder"] != last_holder:
            raise LeaseError(409, f"aggregator {aggregator!r}: epoch {last_epoch} is held by process "
                                  f"{a['holder']}, and this state names process {last_holder}, whose confirm DARL "
                                  "refused or never received: it is a copy of the state taken while that epoch's "
                                  "fence was in flight; this one is stale and must stop", code="fenced")
        if round is not None and round < a.get("round", 0):
            raise LeaseError(409, f"aggregator {aggregator!r}: this state is at round {round}, but DARL committed "
                                  f"custody for round {a['round']} of it: a copy of the state taken before those "
                                  "merges; it lacks them and must stop", code="fenced")
        self.aggregators[aggregator] = a
        if not repeat:
            a["epoch"], a["claim"], a["holder"] = last_epoch + 1, claim, None
        held = [self.custody[k] for k in self.custody_held if k[0] == aggregator]
        return {"aggregator": aggregator, "epoch": a["epoch"], "held": len(held),
                "held_blocks": sum(C.blocks for C in held)}

    def confirm_fence(self, aggregator, epoch, claim, holder, now=None):
        """The process that fence() answered, its epoch now durable in its state, binds the
        epoch to itself (`holder`: a random id of that process) before using it. A copy of
        the aggregator's state taken while the ask was in flight holds the same claim and
        may have been given the same epoch; whichever of the two confirms first holds it,
        the other is fenced here, so two processes never act under one epoch. A repeat by
        the holder gets the same answer (its answer was lost)."""
        check_name("aggregator", aggregator)
        epoch = _epoch(epoch)
        check_name("claim", claim)
        check_name("holder", holder)
        self._check_fence(aggregator, epoch)
        a = self.aggregators[aggregator]
        if a.get("holder") != holder:
            if a.get("holder") or a.get("claim") != claim:
                raise LeaseError(409, f"aggregator {aggregator!r}: epoch {epoch} is held by another process of this "
                                      "aggregator (a copy of its state started beside it); this one must stop",
                                 code="fenced")
            a["holder"], a["claim"] = holder, None
        return {"aggregator": aggregator, "epoch": epoch}

    def take_custody(self, aggregator, epoch, delta, cluster, incarnation, leases, now=None):
        """Move [lease start, end) of every named lease into one custody record, all or
        nothing. A live lease of (cluster, incarnation) gives its positions; an expired or
        released one only while every position still sits unleased in the pool (nobody else
        holds or trained them). A repeat (same aggregator and delta) gets the same answer."""
        now = self.clock() if now is None else now
        for kind, value in (("aggregator", aggregator), ("delta", delta), ("cluster", cluster),
                            ("incarnation", incarnation)):
            check_name(kind, value)
        epoch, items = _epoch(epoch), _custody_items(leases)
        self.expire(now)
        self._check_fence(aggregator, epoch)
        C = self.custody.get((aggregator, delta))
        if C is not None:
            if C.state == "aborted":
                raise LeaseError(409, f"custody of delta {delta!r} was aborted ({C.why}); its blocks went back "
                                      "to the pool: discard the delta", code="custody_aborted")
            return {**C.wire(), "repeat": True}
        plan, lost = [], []
        for lid, start, end in items:
            try:
                plan.append(self._custody_plan(lid, start, end, cluster, incarnation))
            except LeaseError as e:
                lost.append((lid, e.reason))
        runs = sorted((a, b) for _, _, src in plan for _, a, b, _ in src)
        if any(b > a2 for (_, b), (a2, _) in zip(runs, runs[1:])):
            lost.append((items[0][0], "the named leases cover the same positions"))
        if lost:
            raise LeaseError(409, "DARL cannot take this delta's leases into custody ("
                             + "; ".join(f"lease {lid}: {why}" for lid, why in lost)
                             + "): those blocks are not this delta's to merge; discard it",
                             code="lease_lost", leases=[lid for lid, _ in lost])
        pieces = []
        for L, end, src in plan:
            for pool, a, b, tag in src:
                if pool is not None:
                    pool.take(a, b)
                pieces.append([L.id, a, b, tag, "quarantined" if pool is self.quarantined else "free"])
            self._advance(L, end, now)
        C = self.custody[(aggregator, delta)] = Custody(aggregator, delta, epoch, cluster, incarnation, pieces,
                                                        "held", now)
        self.custody_held.add((aggregator, delta))
        self._used(aggregator)
        return C.wire()

    def _custody_plan(self, lid, start, end, cluster, incarnation):
        """(lease, end, [(pool or None, a, b, tag)]) for one lease of a custody request, or LeaseError."""
        L = self.leases.get(lid) or self.closed.get(lid)
        if L is None:
            raise LeaseError(409, "unknown lease")
        if (L.cluster, L.incarnation) != (cluster, incarnation):
            raise LeaseError(409, f"held by {L.cluster!r} incarnation {L.incarnation!r}")
        end = L.end if end is None else end
        if start is not None and start != L.start:
            why = (f"[{start}, {L.start}) is committed or in custody already" if start < L.start else
                   f"[{L.start}, {start}) comes first and is in no custody yet")
            raise LeaseError(409, f"the delta starts at {start}, the lease's uncommitted part at {L.start}: {why}")
        if end <= L.start:
            raise LeaseError(409, f"nothing of it is left to take: [{L.first}, {L.start}) is committed or in custody")
        if end > L.end:
            why = "were stolen (the heartbeat reply shrank this lease)" if end <= L.granted_end else "were never in it"
            raise LeaseError(409, f"positions [{L.end}, {end}) {why}")
        if L.state == "live":
            return L, end, [(None, L.start, end, L.attempts)]
        src = self._unclaimed(L.start, end) if L.state in ("expired", "released") else None
        if src is None:
            raise LeaseError(409, f"the lease is {L.state} and positions of [{L.start}, {end}) were leased, "
                                  "committed or taken into custody again since")
        return L, end, src

    def _advance(self, L, end, now):
        """[L.start, end) left the lease for a custody record: the lease goes on after it."""
        c = self.clusters[L.cluster]
        if not c.reported:              # the commit-rate clock: the site finished these blocks now
            sample = (end - L.start) / max(now - L.progress_at, 1e-3)
            c.rate = sample if c.rate is None else 0.5 * c.rate + 0.5 * sample
        L.start, L.progress_at = end, now
        L.claimed = max(L.claimed, end) if L.state == "live" else end
        if L.start == L.end:
            if L.state == "live":
                self._close(L, "done")
            else:
                L.state = "done"

    def commit_custody(self, aggregator, epoch, delta, round=None, now=None):
        """The aggregator's round with this delta is durable: its positions are COMMITTED.
        `round`: the round that merged it (durable in the aggregator's state before this
        call); the highest one is kept as the aggregator's watermark (see fence). A commit
        of custody that was aborted, or never taken, is refused and counted."""
        now = self.clock() if now is None else now
        check_name("aggregator", aggregator)
        check_name("delta", delta)
        epoch = _epoch(epoch)
        if round is not None:
            round = _round(round)
        self.expire(now)
        self._check_fence(aggregator, epoch)
        C = self.custody.get((aggregator, delta))
        if C is None or C.state == "aborted":
            self.counters["refused_commits"] += 1
            if C is None:
                raise LeaseError(409, f"no custody of delta {delta!r} by aggregator {aggregator!r}: DARL never "
                                      "reserved its blocks for it, so they may be in other deltas too",
                                 counted=True, code="unknown_custody", blocks=0)
            self.counters["blocks_trained_twice"] += C.blocks
            raise LeaseError(409, f"custody of delta {delta!r} was aborted ({C.why}): its {C.blocks} blocks went "
                                  "back to the pool, so a merged delta holds blocks that are trained again",
                             counted=True, code="custody_aborted", blocks=C.blocks)
        if round is not None:
            a = self.aggregators[aggregator]
            a["round"] = max(a.get("round", 0), round)
        if C.state == "committed":
            return {**C.wire(), "repeat": True}
        for _, a, b, _, _ in C.pieces:
            self.committed.add(a, b)
        c = self.clusters[C.cluster]
        c.committed += C.blocks
        c.last_commit = now
        C.state = "committed"
        self.custody_held.discard((aggregator, delta))
        self._used(aggregator)
        return C.wire()

    def abort_custody(self, aggregator, epoch, delta, why=None, now=None):
        """The aggregator will never merge this delta: its positions go back to the pool.
        An abort of custody never taken leaves a tombstone, so a late custody request for
        that delta (still in flight) is refused rather than held forever."""
        now = self.clock() if now is None else now
        check_name("aggregator", aggregator)
        check_name("delta", delta)
        epoch = _epoch(epoch)
        why = why or "aborted by the aggregator"
        self.expire(now)
        self._check_fence(aggregator, epoch)
        C = self.custody.get((aggregator, delta))
        if C is not None and C.state == "committed":
            self.counters["refused_aborts"] += 1      # committed blocks the aggregator says no round holds
            raise LeaseError(409, f"custody of delta {delta!r} is committed: its blocks are counted and an abort "
                                  "cannot take them back", counted=True, code="custody_committed", blocks=C.blocks)
        if C is None:
            C = self.custody[(aggregator, delta)] = Custody(aggregator, delta, epoch, "-", "-", [], "aborted", now,
                                                            why)
            self._used(aggregator)
            return {**C.wire(), "returned": 0}
        if C.state == "aborted":
            return {**C.wire(), "returned": 0, "repeat": True}
        self._return(C, why)
        self._used(aggregator)
        return {**C.wire(), "returned": C.blocks}

    def abort_orphaned(self, aggregator, reason, expect=None, now=None):
        """Operator: no aggregator will ever resolve `aggregator`'s custody (its state dir
        is lost). Every custody it holds goes back to the pool, and the identity is retired:
        whatever it sends from now on is refused (code "fenced"). `expect`: the delta ids the
        operator was shown; if DARL holds another set now, nothing is done (code
        "custody_changed")."""
        now = self.clock() if now is None else now
        check_name("aggregator", aggregator)
        if not isinstance(reason, str) or not reason.strip():
            raise LeaseError(400, "reason must say why no aggregator will resolve this custody")
        if aggregator not in self.aggregators:
            raise LeaseError(404, f"no aggregator {aggregator!r} ever took custody here; known: "
                                  f"{sorted(self.aggregators)}")
        held = sorted((self.custody[k] for k in self.custody_held if k[0] == aggregator), key=lambda C: C.t)
        if expect is not None and sorted(expect) != sorted(C.delta for C in held):
            raise LeaseError(409, f"aggregator {aggregator!r} holds other custody now than the listing shown "
                                  f"({len(held)} record(s)): nothing aborted; list it again", code="custody_changed")
        for C in held:
            self._return(C, f"aborted by the operator: {reason}")
        self.aggregators[aggregator]["retired"] = reason
        return {"aggregator": aggregator, "retired": reason, "aborted": [C.wire() for C in held],
                "returned": sum(C.blocks for C in held)}

    def _return(self, C, why):
        for _, a, b, tag, pool in C.pieces:
            getattr(self, pool).add(a, b, tag)
        C.state, C.why = "aborted", why
        self.custody_held.discard((C.aggregator, C.delta))
        self.counters["aborted_custody"] += 1

    def _check_fence(self, aggregator, epoch):
        """Only the current epoch DARL issued to `aggregator` may act for it."""
        a = self.aggregators.get(aggregator)
        if a is None:
            raise LeaseError(409, f"aggregator {aggregator!r} has no epoch here: POST /fence first (a DARL "
                                  "restarted on another state dir also answers this)", code="not_fenced")
        if a["retired"]:
            raise LeaseError(409, f"aggregator {aggregator!r} was retired by the operator ({a['retired']}) and "
                                  "its custody aborted: this aggregator must stop", code="fenced")
        if epoch != a["epoch"]:
            raise LeaseError(409, f"aggregator {aggregator!r} epoch {epoch} is not epoch {a['epoch']}, the one DARL "
                                  "issued last: a newer process of this aggregator runs; this one must stop",
                             code="fenced")

    def _used(self, aggregator):
        """The current epoch acted: its claim can no longer be repeated (by a copy of the state
        taken while the fence was in flight)."""
        self.aggregators[aggregator]["claim"] = None

    def status(self, now=None):
        """LeaseTable.status, and each aggregator's epoch and custody."""
        out = super().status(now)
        aggs = []
        for name, a in sorted(self.aggregators.items()):
            held = [self.custody[k] for k in self.custody_held if k[0] == name]
            aggs.append({"aggregator": name, "epoch": a["epoch"], "holder": a.get("holder"),
                         "round": a.get("round", 0), "retired": a["retired"], "held": len(held),
                         "held_blocks": sum(C.blocks for C in held)})
        states = collections.Counter(C.state for C in self.custody.values())
        return {**out, "aggregators": aggs,
                "custody": {"held": len(self.custody_held), "committed": states["committed"],
                            "aborted": states["aborted"]},
                "custody_held": [self.custody[k].wire() for k in sorted(self.custody_held)][:200]}

    def custody_records(self, aggregator=None, state=None):
        """Custody records (GET /custody), oldest first, optionally of one aggregator and state."""
        return [C.wire() for C in sorted(self.custody.values(), key=lambda C: C.t)
                if (aggregator is None or C.aggregator == aggregator) and (state is None or C.state == state)]
