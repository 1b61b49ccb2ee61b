"""darl_client.py - the site side of DARL: lease RPCs and a leasing session.

Where: on a site, in the one process per stream that talks to the
coordinator (rank 0 of a replica; it broadcasts three integers per span:
lease id, start, end). Python standard library only, never torch; the block space
whose positions a lease holds is block_space.py's.

Use from code:
    space = block_space.BlockSpace(num_samples=N, block_size=K, seed=S)
    client = LeaseClient("http://central:29510", token=token)   # client.close() (or `with`) at the end
    with LeaseSession(client, "lumi", space.digest(), span_blocks=B) as session:
        while (span := session.next_span()) is not None:      # None: the epoch is done
            ... train on space.samples_of(space.block_at(p)) for p in span.positions()
            ... make the update durable (checkpoint, or merge at the aggregator)
            session.commit(span)          # or hand session.commit_record(span) to the aggregator
    # federated (train.py --federation): the aggregator takes an accepted delta's span into
    # custody at DARL and commits it once merged; the session heartbeats the lease until
    # DARL reports it "done" (in custody or committed, then drops it quietly);
    # session.release(span) gives back a span whose delta was not merged, session.forget(span)
    # leaves one to the aggregator; session.held() / refresh() show what is still held;
    # session.starved is True while every remaining block is leased by someone else

The end-to-end check of these two against a real coordinator is darl_simulate.py.

Who may call the coordinator: anyone holding the shared token
(--token-file / $PWW_TOKEN); the coordinator's URL comes from the central VM.
"""
import collections
import dataclasses
import http.client
import secrets
import sys
import threading
import time

import httpc

TTL_PHASE_FACTOR, TTL_RTT_FACTOR = 2.5, 10.0   # TTL = 2.5 x phase time + 10 x RTT


class LeaseLost(Exception):
    """The coordinator reclaimed (expired) or never granted what was trained on:
    discard that work; the blocks went back to the pool and will be trained again."""


# ------------------------------------------------------------------ RPCs

class LeaseClient:
    """The coordinator's RPCs over one keep-alive connection per thread.

    Every call takes `deadline`, an httpc.Deadline: under it a failed call is repeated by
    httpc.retry's rule (transport errors, 5xx; a register also waits out a live previous
    incarnation's 409); without it, one attempt. Every call is safe to repeat: commit and
    release are idempotent, heartbeat only extends, and acquire carries a request id the
    coordinator answers a second time with the same lease.
    A connection idle for REUSE_IDLE_S is not reused: the server closes keep-alive
    connections idle for --idle-timeout-s (60 s), and a request sent into one that
    is closing fails and costs a retry.
    """
    REUSE_IDLE_S = 30.0

    def __init__(self, url, token=None, timeout=10.0, ca_file=None):
        self.url, self.token, self.timeout, self.ca_file = url, token, timeout, ca_file
        self.rtt_s = None                   # smoothed round-trip time of successful calls
        self._local = threading.local()
        self._open = set()                  # every thread's connection: close() closes them all

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        """Close every thread's keep-alive connection (a later call opens a new one)."""
        for conn in list(self._open):
            self._open.discard(conn)
            conn.close()

    def _conn(self):
        conn = getattr(self._local, "conn", None)
        if conn is not None and (conn not in self._open
                                 or time.monotonic() - self._local.used > self.REUSE_IDLE_S):
            self._drop_conn()               # closed by close(), or idle long enough to be closing
            conn = None
        if conn is None:
            conn = self._local.conn = httpc.connect(self.url, self.timeout, self.ca_file)
            self._open.add(conn)
        self._local.used = time.monotonic()
        return conn

    def _drop_conn(self):
        conn, self._local.conn = getattr(self._local, "conn", None), None
        if conn is not None:
            self._open.discard(conn)
            conn.close()

    def _rpc(self, method, path, body=None, deadline=None, waits=()):
        return httpc.retry(f"DARL {path}", lambda: self._once(method, path, body, deadline), deadline, waits)

    def _once(self, method, path, body, deadline):
        t0 = time.monotonic()
        try:
            conn = self._conn()
            conn.timeout = httpc.io_timeout(self.timeout, deadline)
            if conn.sock is not None:        # None after a reply that closed it: http.client reconnects
                conn.sock.settimeout(conn.timeout)
            reply = httpc.call(self.url, method, path, body, token=self.token, conn=conn)
        except (OSError, http.client.HTTPException):
            self._drop_conn()               # its state is unknown: the next attempt opens a new one
            raise
        self._local.used = time.monotonic()
        rtt = time.monotonic() - t0
        self.rtt_s = rtt if self.rtt_s is None else 0.8 * self.rtt_s + 0.2 * rtt
        return reply

    def register(self, cluster, incarnation, digest, deadline=None):
        """Under a deadline this also waits while another live incarnation holds the cluster."""
        return self._rpc("POST", "/register", {"cluster": cluster, "incarnation": incarnation, "digest": digest},
                         deadline, waits=(httpc.INCARNATION_CONFLICT,))

    def acquire(self, cluster, incarnation, blocks=None, ttl=None, request_id=None, deadline=None):
        """{"status": "ok", "lease": {...}} | {"status": "wait", "retry_after": s} | {"status": "done"}.
        A repeat with the same request_id gets the same lease (one id for all the attempts)."""
        body = {"cluster": cluster, "incarnation": incarnation,
                "request_id": request_id or secrets.token_hex(8), "blocks": blocks, "ttl": ttl}
        return self._rpc("POST", "/acquire", {k: v for k, v in body.items() if v is not None}, deadline)

    def heartbeat(self, cluster, incarnation, leases=(), ttl=None, throughput=None, deadline=None):
        """leases: ids or {"lease": id, "cursor": pos} claims. The reply is an instruction."""
        body = {"cluster": cluster, "incarnation": incarnation, "leases": list(leases),
                "ttl": ttl, "throughput": throughput}
        return self._rpc("POST", "/heartbeat", {k: v for k, v in body.items() if v is not None}, deadline)

    def commit(self, cluster, incarnation, lease_id, end=None, deadline=None):
        body = {"cluster": cluster, "incarnation": incarnation, "lease": lease_id, "end": end}
        return self._rpc("POST", "/commit", {k: v for k, v in body.items() if v is not None}, deadline)

    def release(self, cluster, incarnation, lease_ids=(), leave=False, deadline=None):
        """lease_ids: ids, or {"lease": id, "from": pos} to give back only [pos, end) of one."""
        return self._rpc("POST", "/release", {"cluster": cluster, "incarnation": incarnation,
                                              "leases": list(lease_ids), "leave": leave}, deadline)

    def status(self, deadline=None):
        return self._rpc("GET", "/status", deadline=deadline)

    def health(self, deadline=None):
        return self._rpc("GET", "/health", deadline=deadline)


# ------------------------------------------------------------------ session

@dataclasses.dataclass(frozen=True)
class Span:
    """Positions [start, end) of lease `lease`, claimed: safe to train on."""
    lease: int
    start: int
    end: int

    def positions(self):
        return range(self.start, self.end)

    def __len__(self):
        return self.end - self.start

    def as_ints(self):
        """The three integers the stream leader broadcasts to its ranks."""
        return self.lease, self.start, self.end


@dataclasses.dataclass
class _Held:
    start: int       # first uncommitted position (coordinator's word)
    claimed: int     # coordinator has promised [start, claimed) to us
    end: int         # authoritative end: shrinks when a tail is stolen
    handed: int      # spans up to here were given to the caller


class LeaseSession:
    """One per stream (a replica): registers, leases, claims spans, heartbeats.

    A background thread heartbeats every TTL/3 and prefetches the next span.
    A span is claimed through a heartbeat before it is handed out, and the
    reply is applied first: the coordinator never steals a claimed position,
    and the session never hands out an unclaimed one, so a shrunk lease end
    cannot be overrun. Requested TTL = 2.5 x measured phase time + 10 x RTT,
    so a cluster that slows down asks for longer leases.

    span_blocks: blocks per span (None: a whole lease per span, one span per phase).
    lease_blocks: blocks asked per acquire (None: the coordinator sizes it from our rate).
    Commit spans in the order next_span() returned them.
    """

    def __init__(self, client, cluster, digest, incarnation=None, span_blocks=None, lease_blocks=None,
                 prefetch=True, phase_s=30.0, log=None):
        if span_blocks is not None and span_blocks < 1:
            raise ValueError(f"span_blocks must be >= 1 or None, got {span_blocks}")
        self.client, self.cluster, self.digest = client, cluster, digest
        self.incarnation = incarnation or secrets.token_hex(6)
        self.span_blocks, self.lease_blocks, self.prefetch = span_blocks, lease_blocks, prefetch
        self.phase_s, self.throughput = float(phase_s), None
        self.granted_ttl = None
        self.log = log or (lambda msg: sys.stderr.write(f"darl[{cluster}] {msg}\n"))
        self._held, self._ready, self._handed_at = {}, collections.deque(), {}
        self._cond = threading.Condition()
        self._rpc_lock = threading.Lock()      # heartbeat replies are applied in the order they were asked
        self._waiting = 0
        self.starved = False       # the coordinator said "wait": every block is leased elsewhere
        self._done = self._stop = False
        self._error = None
        self._thread = None
        self._acquire_id = None                # an acquire not answered yet: sent again with this id
        self._said_unreachable = -1e9

    # ---- lifecycle

    def start(self, register=True, deadline=None):
        """Register (unless the caller already did, e.g. while waiting out an older
        incarnation; under `deadline` repeated by httpc's rule) and start the background
        heartbeat/prefetch thread."""
        if register:
            self.client.register(self.cluster, self.incarnation, self.digest, deadline=deadline)
        self._thread = threading.Thread(target=self._run, name=f"darl-{self.cluster}", daemon=True)
        self._thread.start()
        return self

    def __enter__(self):
        return self.start() if self._thread is None else self

    def __exit__(self, *exc):
        self.close()

    def close(self, release=True, deadline=None):
        """Stop heartbeating; give back everything not committed and leave, so a
        requeued job can register the stream at once (one attempt, or repeated under
        `deadline`; if it fails the leases expire on their TTL)."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=60)
        if release and self._error is None:
            try:
                self.client.release(self.cluster, self.incarnation, list(self._held), leave=True,
                                    deadline=deadline)
            except (OSError, http.client.HTTPException, httpc.CallError) as e:
                self.log(f"release at close failed ({e}); the leases will expire on their TTL")

    # ---- the caller's side

    @property
    def ttl_s(self):
        rtt = self.client.rtt_s or 0.0
        return TTL_PHASE_FACTOR * self.phase_s + TTL_RTT_FACTOR * rtt

    def next_span(self, timeout=None):
        """The next claimed span, or None once the coordinator says the epoch is done."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            self._waiting += 1
            self._cond.notify_all()
            try:
                while not self._ready:
                    if self._error is not None:
                        raise self._error
                    if self._done or self._stop:
                        return None
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        raise TimeoutError(f"no span from the coordinator within {timeout} s")
                    self._cond.wait(left)
                span = self._ready.popleft()
            finally:
                self._waiting -= 1
            self._handed_at[span] = time.monotonic()
            self._cond.notify_all()          # wake the prefetcher for the span after this one
            return span

    def end_phase(self, seconds, blocks=None):
        """Feed the TTL and throughput estimates: a slowdown shows at once, a speed-up slowly."""
        self.phase_s = max(seconds, 0.5 * self.phase_s + 0.5 * seconds)
        if blocks:
            rate = blocks / max(seconds, 1e-6)
            self.throughput = rate if self.throughput is None else 0.5 * self.throughput + 0.5 * rate

    def commit_record(self, span):
        """What the aggregator needs to take this span into custody and commit it on our behalf."""
        return {"cluster": self.cluster, "incarnation": self.incarnation, "lease": span.lease,
                "start": span.start, "end": span.end}

    def commit(self, span, deadline=None):
        """Commit [lease start, span.end); raises LeaseLost if the lease was reclaimed.
        deadline: an httpc.Deadline to repeat it under (None: one attempt)."""
        t0 = self._handed_at.pop(span, None)
        if t0 is not None:
            self.end_phase(time.monotonic() - t0, len(span))
        try:
            reply = self.client.commit(self.cluster, self.incarnation, span.lease, span.end, deadline=deadline)
        except httpc.CallError as e:
            if e.status in (404, 409):
                raise LeaseLost(f"span {span.as_ints()}: {e.reply.get('error')}") from e
            raise
        with self._cond:
            h = self._held.get(span.lease)
            if h is not None:
                h.start = max(h.start, span.end)
                if h.start >= h.end:
                    del self._held[span.lease]
        return reply

    def trim(self, span, end, deadline=None):
        """The phase trained only [span.start, end) of `span` (train.py --diloco-phase-s: the
        clock ended it on a block boundary): give [end, span's lease end) back to the pool
        now (DARL's release with "from"), keep [span.start, end) live in the lease, and
        -> that Span, to send and settle in the span's place. Nobody trained the tail, so
        it may be anybody's next; the part kept is settled like any span (custody and commit
        by the aggregator, or released). deadline: as commit's."""
        if not span.start < end <= span.end:
            raise ValueError(f"trim: {end} is not inside span {span.as_ints()}")
        cut = Span(span.lease, span.start, end)
        with self._cond:
            t0 = self._handed_at.pop(span, None)
            if t0 is not None:
                self._handed_at[cut] = t0
        # under the heartbeat lock: a heartbeat answered before the release and applied after it
        # would put the old end back, and next_span would hand out blocks already in the pool
        with self._rpc_lock:
            with self._cond:
                if span.lease not in self._held:     # lost meanwhile: nothing of it is ours to give back
                    return cut
            try:
                self.client.release(self.cluster, self.incarnation, [{"lease": span.lease, "from": end}],
                                    deadline=deadline)
            except httpc.CallError as e:
                if e.status not in (404, 409):       # expired or closed: the tail is in the pool anyway
                    raise
            with self._cond:
                h = self._held.get(span.lease)
                if h is not None:
                    h.end, h.claimed, h.handed = min(h.end, end), min(h.claimed, end), min(h.handed, end)
                self._ready = collections.deque(s for s in self._ready if s.lease != span.lease)
        return cut

    def lease_end(self, lease):
        """Where a held lease ends now (None: not held)."""
        with self._cond:
            h = self._held.get(lease)
            return None if h is None else h.end

    def span_done(self, span):
        """Feed the TTL estimate with the time the span has been out (handed out until now),
        for a span that is not committed here: under federation its lease must outlive the
        inner phase AND the round trip to the aggregator, not the inner phase alone."""
        t0 = self._handed_at.pop(span, None)
        if t0 is not None:
            self.end_phase(time.monotonic() - t0, len(span))

    def release(self, span, deadline=None):
        """Give back what is uncommitted of the span's lease (a delta that was not merged:
        its blocks return to the pool and are trained again). Stop heartbeating it."""
        with self._cond:
            held = self._held.pop(span.lease, None)
            self._handed_at.pop(span, None)
        if held is None:
            return {"released": 0}
        try:
            return self.client.release(self.cluster, self.incarnation, [span.lease], deadline=deadline)
        except httpc.CallError as e:
            if e.status in (404, 409):     # already expired or closed: nothing of ours left to give back
                return {"released": 0, "error": e.reply.get("error")}
            raise

    def forget(self, span):
        """Stop heartbeating the span's lease without telling the coordinator: for a lease
        another party (the aggregator) may still commit; if nobody does, it expires."""
        with self._cond:
            self._held.pop(span.lease, None)
            self._handed_at.pop(span, None)

    def held(self):
        """Ids of the leases this session still heartbeats (not yet committed, expired or released)."""
        with self._cond:
            return set(self._held)

    def refresh(self, deadline=None):
        """One heartbeat now (applied like the background ones): a lease the aggregator
        took into custody or committed meanwhile leaves held(). deadline: as commit's."""
        self._heartbeat(deadline=deadline)

    # ---- the background thread: the renewal loop. Its calls are single attempts (the loop
    # itself comes back 0.5 s later), and an acquire that failed is sent again with the same
    # request id, so a lease granted to a lost reply is the one the next attempt gets.

    def _run(self):
        next_beat = 0.0
        while True:
            with self._cond:
                want = (self.prefetch or self._waiting) and len(self._ready) < 1 and not self._done
                if self._stop or self._error is not None:
                    return
                if not want:
                    self._cond.wait(max(0.0, next_beat - time.monotonic()))
                    if self._stop:
                        return
            try:
                if want:
                    self._fetch()
                if time.monotonic() >= next_beat:
                    self._heartbeat()
                    next_beat = time.monotonic() + max(0.1, (self.granted_ttl or self.ttl_s) / 3)
            except (httpc.CallError, OSError, http.client.HTTPException) as e:
                if not httpc.repeatable(e):  # a 4xx: this incarnation is refused (stale, unknown): fatal
                    self._fail(e)
                    return
                if time.monotonic() - self._said_unreachable >= 10.0:
                    self._said_unreachable = time.monotonic()
                    self.log(f"coordinator unreachable ({e}); holding on to the spans already claimed")
                next_beat = time.monotonic() + 0.5
                with self._cond:
                    self._cond.wait(0.5)

    def _fail(self, err):
        with self._cond:
            self._error = err
            self._cond.notify_all()

    def _heartbeat(self, claim=None, deadline=None):
        """One heartbeat for every held lease; `claim` = (lease, cursor). Applies the reply."""
        with self._rpc_lock:
            with self._cond:
                ids = list(self._held)
            items = [{"lease": i, "cursor": claim[1]} if claim and claim[0] == i else i for i in ids]
            reply = self.client.heartbeat(self.cluster, self.incarnation, items, ttl=self.ttl_s,
                                          throughput=self.throughput, deadline=deadline)
            with self._cond:
                self.granted_ttl = reply.get("ttl")
                for r in reply["leases"]:
                    h = self._held.get(r["lease"])
                    if h is None:
                        continue
                    if r.get("valid"):
                        h.start, h.claimed, h.end = r["start"], r["claimed"], r["end"]
                        h.handed = min(h.handed, h.end)     # never hand out past a stolen boundary
                    else:
                        if r.get("state") != "done":      # done = committed, or in the aggregator's custody: normal
                            self.log(f"lease {r['lease']} is no longer ours: {r.get('reason')}")
                        del self._held[r["lease"]]
                        self._ready = collections.deque(s for s in self._ready if s.lease != r["lease"])

    def _fetch(self):
        """Claim the next span of a held lease, acquiring a lease first if none has any left."""
        with self._cond:
            todo = [(i, h) for i, h in self._held.items() if h.handed < h.end]
        if not todo:
            self._acquire_id = self._acquire_id or secrets.token_hex(8)
            reply = self.client.acquire(self.cluster, self.incarnation, blocks=self.lease_blocks, ttl=self.ttl_s,
                                        request_id=self._acquire_id)
            self._acquire_id = None
            if reply["status"] == "done":
                if reply.get("quarantined"):
                    self.log(f"epoch done with {reply['quarantined']} blocks QUARANTINED")
                with self._cond:
                    self._done = True
                    self._cond.notify_all()
                return
            if reply["status"] == "wait":
                with self._cond:
                    self.starved = True
                    self._cond.wait(reply["retry_after"])
                return
            L = reply["lease"]
            with self._cond:
                self.starved = False
                self._held.setdefault(L["id"], _Held(L["start"], L["claimed"], L["end"], L["start"]))
            return
        lid, h = todo[0]
        target = h.end if self.span_blocks is None else min(h.end, h.handed + self.span_blocks)
        self._heartbeat(claim=(lid, target))
        with self._cond:
            h = self._held.get(lid)
            if h is not None and h.claimed > h.handed:
                span = Span(lid, h.handed, min(h.claimed, target))
                h.handed = span.end
                self._ready.append(span)
                self._cond.notify_all()
