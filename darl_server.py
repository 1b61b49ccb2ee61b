"""darl_server.py - DARL, the dataset-leasing coordinator (central VM, :29510).

What: the one map of which data blocks are UNASSIGNED, LEASED, COMMITTED or
QUARANTINED. Sites lease contiguous runs of block *positions* under a TTL,
keep them alive with heartbeats and commit them once the update trained on
them is durable, so the corpus is covered exactly once even though sites
start late, run at different speeds and die at walltime.

Where: the central VM (or a login node): it must outlive every job that
leases from it. Python standard library only; never imports torch.

Run:
    python darl_server.py --num-samples 1000000 --block-size 10000 --seed 0 \\
        --state-dir runs/central
    python darl_server.py --manifest /tmp/manifest.json --block-size 64 --seed 0
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
    /acquire   {cluster, incarnation, blocks?, ttl?, request_id?}
               -> {"status": "ok", "lease": {...}} | {"status": "wait", "retry_after"}
                  | {"status": "done"}  (nothing left to lease, ever)
    /heartbeat {cluster, incarnation, leases: [{"lease", "cursor"?}], ttl?, throughput?}
               -> {"leases": [{"lease", "valid", "start", "claimed", "end"}]}
               The reply is an instruction: `end` may have shrunk (stolen tail)
               and valid=false means the lease was reclaimed: stop using it.
               `cursor` claims [start, cursor): the coordinator never steals
               a claimed position, and a client must not touch an unclaimed one.
    /commit    {cluster, incarnation, lease, end?}   commits [lease.start, end)
    /release   {cluster, incarnation, leases: [...], leave?}
    GET /status, GET /health
"""
import bisect
import dataclasses
import hashlib
import json
import math
import os
import signal
import sys
import threading
import time

import httpd

DEFAULT_PORT = 29510
WAL_VERSION = 1
PERMUTATION_VERSION = "feistel-splitmix64/1"
MASK64 = (1 << 64) - 1
# fdatasync flushes the appended bytes and the new file size, skipping the
# mtime update; measured here 0.25 ms against 0.2-16 ms for fsync on a busy disk.
_datasync = getattr(os, "fdatasync", os.fsync)


# ------------------------------------------------------------------ block space

def splitmix64(x):
    """One step of SplitMix64 (Steele, Lea, Flood 2014): a fixed, portable 64-bit mix."""
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


class BlockSpace:
    """M = ceil(N/K) blocks of K consecutive samples, visited in a seeded order.

    Position p (what leases are made of) maps to block block_at(p). The order
    is a Feistel network over the smallest even-bit domain >= M, with cycle
    walking to stay inside [0, M): O(1) per lookup, no O(M) table, and the
    same on every Python version and machine (random.shuffle promises neither).
    """
    ROUNDS = 6

    def __init__(self, num_samples, block_size, seed, manifest_digest=None):
        if num_samples < 1:
            raise ValueError(f"--num-samples must be >= 1, got {num_samples}")
        if block_size < 1:
            raise ValueError(f"--block-size must be >= 1, got {block_size}")
        self.num_samples, self.block_size, self.seed = int(num_samples), int(block_size), int(seed)
        self.manifest_digest = manifest_digest
        self.num_blocks = -(-self.num_samples // self.block_size)
        bits = max(2, (self.num_blocks - 1).bit_length())
        self._half = (bits + 1) // 2
        self._mask = (1 << self._half) - 1
        self._keys = [splitmix64((self.seed & MASK64) ^ splitmix64(r + 1)) for r in range(self.ROUNDS)]

    def _feistel(self, x):
        left, right = x >> self._half, x & self._mask
        for key in self._keys:
            left, right = right, left ^ (splitmix64(key ^ right) & self._mask)
        return (left << self._half) | right

    def _feistel_inverse(self, x):
        left, right = x >> self._half, x & self._mask
        for key in reversed(self._keys):
            left, right = right ^ (splitmix64(key ^ left) & self._mask), left
        return (left << self._half) | right

    def block_at(self, position):
        """The block visited at `position` (0 <= position < num_blocks)."""
        if not 0 <= position < self.num_blocks:
            raise IndexError(f"position {position} outside [0, {self.num_blocks})")
        x = self._feistel(position)
        while x >= self.num_blocks:      # cycle walking: < 4 steps on average (domain < 4M)
            x = self._feistel(x)
        return x

    def position_of(self, block):
        """Inverse of block_at."""
        if not 0 <= block < self.num_blocks:
            raise IndexError(f"block {block} outside [0, {self.num_blocks})")
        x = self._feistel_inverse(block)
        while x >= self.num_blocks:
            x = self._feistel_inverse(x)
        return x

    def samples_of(self, block):
        """Sample indices of a block: range(block*K, min(N, (block+1)*K))."""
        if not 0 <= block < self.num_blocks:
            raise IndexError(f"block {block} outside [0, {self.num_blocks})")
        return range(block * self.block_size, min(self.num_samples, (block + 1) * self.block_size))

    def describe(self):
        return {"num_samples": self.num_samples, "block_size": self.block_size, "seed": self.seed,
                "num_blocks": self.num_blocks, "algorithm": PERMUTATION_VERSION,
                "manifest_digest": self.manifest_digest}

    def digest(self):
        """Everything that decides which samples a position means, hashed."""
        blob = json.dumps(self.describe(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:32]

    @classmethod
    def from_manifest(cls, path, block_size, seed):
        """N from a tokenized corpus' manifest.json ({"num_windows": int, "digest": str, ...})."""
        try:
            with open(path) as f:
                m = json.load(f)
        except (OSError, ValueError) as e:
            raise ValueError(f"--manifest {path}: cannot read it as JSON ({e})")
        n, d = m.get("num_windows"), m.get("digest")
        if not isinstance(n, int) or isinstance(n, bool) or n < 1 or not isinstance(d, str):
            raise ValueError(f"--manifest {path}: needs an integer 'num_windows' >= 1 and a string "
                             "'digest' (written by tokenize_corpus.py)")
        return cls(n, block_size, seed, manifest_digest=d)


# ------------------------------------------------------------------ lease table

class LeaseError(Exception):
    """A refused request: HTTP status + one-line reason. The table is unchanged."""

    def __init__(self, status, reason):
        super().__init__(reason)
        self.status, self.reason = status, reason


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
class TableConfig:
    max_attempts: int = 3           # --max-attempts: reclaims before a run is quarantined; 0 = never
    min_ttl: float = 10.0           # --min-ttl s
    max_ttl: float = 3600.0         # --max-ttl s
    default_ttl: float = 120.0      # --default-ttl s, when a client names none
    grant_seconds: float = 600.0    # --grant-seconds: a grant is this much of the holder's measured work
    initial_grant: int = 1          # --initial-grant blocks, before a cluster's rate is known
    max_grant: int = 0              # --max-grant blocks; 0 = no cap

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


def _check_name(kind, value):
    ok = isinstance(value, str) and 0 < len(value) <= 64 and all(ch.isalnum() or ch in "._-" for ch in value)
    if not ok:
        raise LeaseError(400, f"{kind} must be 1-64 characters of [A-Za-z0-9._-], got {value!r}")


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def _lease_items(leases):
    """[id | {"lease": id, "cursor": pos}] -> [(id, cursor or None)], or a 400."""
    if not isinstance(leases, list):
        raise LeaseError(400, "field 'leases' must be a list of lease ids or {lease, cursor} objects")
    out = []
    for item in leases:
        lid, cursor = (item.get("lease"), item.get("cursor")) if isinstance(item, dict) else (item, None)
        if not _is_int(lid) or (cursor is not None and not _is_int(cursor)):
            raise LeaseError(400, f"bad lease entry {item!r}: want an integer id and optional integer cursor")
        out.append((lid, cursor))
    return out


class LeaseTable:
    """The lease state machine over positions [0, M). No I/O, no threads; time
    comes from `now` (or the injected clock), so tests and log replay drive it.

    Every position is in exactly one place: the free pool (UNASSIGNED, tagged
    with its reclaim count), a live lease (LEASED), `committed` or `quarantined`.
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
        _check_name("cluster", cluster)
        _check_name("incarnation", incarnation)
        self.expire(now)
        c = self.clusters.get(cluster)
        if c is not None and c.incarnation != incarnation and self._live(c, now):
            wait = max(c.last_seen + c.ttl, max((self.leases[i].expires for i in self.held.get(cluster, ())),
                                                default=0)) - now
            raise LeaseError(409, f"cluster id {cluster!r} is held by live incarnation {c.incarnation!r} "
                                  f"({len(self.held.get(cluster, ()))} leases); a second job on the same stream "
                                  f"would train the same data twice: start it with --replica (its own stream, "
                                  f"e.g. --replica b -> {cluster}-b), or wait {wait:.0f} s for the old leases to expire")
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
        if blocks is not None and (not _is_int(blocks) or blocks < 1):
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
            start, end, attempts = self.free.pop_front(min(want, share))
            lease = self._new_lease(c, start, end, attempts, now, ttl)
        else:
            lease = self._steal(c, want, now, ttl)
        if lease is None:
            if self.leases:
                soonest = min(L.expires for L in self.leases.values())
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
        ttl = ttl or c.ttl          # the aggregator heartbeats for a site without naming its TTL
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
        if not _is_int(lease) or (end is not None and not _is_int(end)):
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
        if L.state != "live":
            raise LeaseError(409, f"lease {lease} was {L.state} before [{L.start}, {end}) was committed; those "
                                  "blocks went back to the pool: discard the work done on them")
        if end > L.end:
            why = "were stolen (the heartbeat reply shrank this lease)" if end <= L.granted_end else "were never in it"
            raise LeaseError(409, f"cannot commit lease {lease} up to {end}: positions [{L.end}, {end}) {why}")
        n = end - L.start
        self.committed.add(L.start, end)
        c = self.clusters[cluster]
        c.committed += n
        c.last_commit = now
        if not c.reported:
            sample = n / max(now - L.progress_at, 1e-3)
            c.rate = sample if c.rate is None else 0.5 * c.rate + 0.5 * sample
        L.start, L.claimed, L.progress_at = end, max(L.claimed, end), now
        if L.start == L.end:
            self._close(L, "done")
        return {"lease": lease, "committed": n, "start": L.start, "end": L.end}

    def release(self, cluster, incarnation, leases=(), leave=False, now=None):
        """Give back the uncommitted part of leases (no attempt counted); leave=True
        also ends the incarnation, so a requeued job can register at once."""
        now = self.clock() if now is None else now
        ids = [lid for lid, _ in _lease_items(list(leases))]
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
            if L is not None:
                returned += L.end - L.start
                self._close(L, "released")
                self.free.add(L.start, L.end, L.attempts)
        c.last_seen = now
        c.left = bool(leave)
        return {"released": returned, "left": c.left}

    def _close(self, L, state):
        del self.leases[L.id]
        self.held[L.cluster].discard(L.id)
        L.state = state
        self.closed[L.id] = L

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
        done = not self.free.total and not self.leases
        return {"num_blocks": self.num_blocks, "committed": self.committed.total,
                "quarantined": self.quarantined.total, "free": self.free.total,
                "leased": sum(L.end - L.start for L in self.leases.values()),
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
                "leases": [L.wire(now) for L in list(self.leases.values())[:200]]}

    # ---- snapshot form

    def to_dict(self):
        return {"num_blocks": self.num_blocks, "next_id": self.next_id,
                "free": [list(x) for x in self.free], "committed": [list(x) for x in self.committed],
                "quarantined": [list(x) for x in self.quarantined],
                "leases": [dataclasses.astuple(L) for L in self.leases.values()],
                "closed": [dataclasses.astuple(L) for L in self.closed.values()],
                "clusters": [dataclasses.asdict(c) for c in self.clusters.values()]}

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
        return t


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
    """The LeaseTable behind one lock, with every change logged before the reply.

    call(op, args) applies a LeaseTable method at the current time, appends
    {op, args, t} to the log and waits for the fsync; replaying the same
    records at the same times rebuilds the same table, because the table is a
    pure function of its calls and their times.
    """
    OPS = ("register", "acquire", "heartbeat", "commit", "release", "restore")

    def __init__(self, space, config=None, state_dir=None, snapshot_every=1000, restore_grace=120.0,
                 fsync=True, clock=time.time):
        self.space, self.digest, self.clock = space, space.digest(), clock
        self.config = config or TableConfig()
        self.snapshot_every, self.lock = snapshot_every, threading.Lock()
        self.invariant_error = None
        self.table, self.seq = LeaseTable(space.num_blocks, self.config, clock), 0
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
            self.table = LeaseTable.from_dict(snap["table"], self.config, self.clock)
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
            except LeaseError as e:
                raise LogError(f"{self.dir}/wal.jsonl: record {rec['seq']} no longer applies ({e.reason})")
            self.seq = rec["seq"]

    def call(self, op, args):
        """Apply one change; return its reply once it is durable. LeaseError = refused, nothing logged."""
        if op == "register" and args.get("digest") != self.digest:
            raise LeaseError(409, f"block-space digest mismatch: client {args.get('digest')!r}, coordinator "
                                  f"{self.digest!r} ({self.space.describe()}); both sides must use the same "
                                  "--num-samples/--manifest, --block-size and --seed")
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
        return reply

    def snapshot(self):
        """Verify the books, write them atomically, then start the log afresh. Call under the lock."""
        try:
            self.table.verify()
        except InvariantError as e:
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
            except InvariantError as e:
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
            except LeaseError as e:
                raise httpd.HTTPError(e.status, e.reason)
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
    table: TableConfig

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
            return BlockSpace.from_manifest(self.manifest, self.block_size, self.seed)
        return BlockSpace(self.num_samples, self.block_size, self.seed)


def serve_parser():
    p = httpd.base_parser(__doc__)
    s = p.add_argument_group("block space")
    s.add_argument("--num-samples", type=int, help="N, samples (or windows) in the corpus")
    s.add_argument("--manifest", help="tokenized corpus manifest.json: N = its num_windows, its digest joins ours")
    s.add_argument("--block-size", type=int, default=1, help="K, samples per block (default 1)")
    s.add_argument("--seed", type=int, default=0, help="permutation seed (default 0)")
    t = p.add_argument_group("leasing")
    d = TableConfig()
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
        cfg = ServerConfig(a.num_samples, a.manifest, a.block_size, a.seed, a.state_dir, a.snapshot_every,
                           a.restore_grace, TableConfig(a.max_attempts, a.min_ttl, a.max_ttl, a.default_ttl,
                                                        a.grant_seconds, a.initial_grant, a.max_grant)).validate()
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
