"""darl_client.py - the site side of DARL: lease RPCs, a leasing session, and
an end-to-end simulation that audits exactly-once coverage.

Where: on a site, in the one process per stream that talks to the
coordinator (rank 0 of a replica; it broadcasts three integers per span:
lease id, start, end). Python standard library only; imports darl_table for
BlockSpace, never torch.

Use from code:
    space = darl_table.BlockSpace(num_samples=N, block_size=K, seed=S)
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

Run the end-to-end check (a real coordinator and one process per cluster):
    python darl_client.py simulate --clusters 4 --kill 1 --late 1 [--blocks 1000]
It prints a per-cluster table and `PASS: coverage is exactly once` (exit 0),
or the duplicated and missing blocks (exit 1).

Who may call the coordinator: anyone holding the shared token
(--token-file / $PWW_TOKEN); the coordinator's URL comes from the central VM.
"""
import argparse
import collections
import dataclasses
import http.client
import json
import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import darl_table
import httpc
import httpd

BlockSpace = darl_table.BlockSpace
TTL_PHASE_FACTOR, TTL_RTT_FACTOR = 2.5, 10.0   # TTL = 2.5 x phase time + 10 x RTT


class LeaseLost(Exception):
    """The coordinator reclaimed (expired) or never granted what was trained on:
    discard that work; the blocks went back to the pool and will be trained again."""


# ------------------------------------------------------------------ RPCs

class LeaseClient:
    """The coordinator's RPCs over one keep-alive connection per thread.

    Transport failures and 5xx replies are retried with exponential backoff
    (with jitter); every call is safe to repeat: commit and release are
    idempotent, heartbeat only extends, and acquire carries a request id the
    coordinator answers a second time with the same lease. 4xx are not retried.
    A connection idle for REUSE_IDLE_S is not reused: the server closes keep-alive
    connections idle for --idle-timeout-s (60 s), and a request sent into one that
    is closing fails and costs a retry.
    """
    REUSE_IDLE_S = 30.0

    def __init__(self, url, token=None, timeout=10.0, retries=6, backoff_s=0.2, max_backoff_s=4.0, ca_file=None):
        self.url, self.token, self.timeout, self.ca_file = url, token, timeout, ca_file
        self.retries, self.backoff_s, self.max_backoff_s = retries, backoff_s, max_backoff_s
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

    def _rpc(self, method, path, body=None):
        for attempt in range(self.retries + 1):
            t0 = time.monotonic()
            try:
                reply = httpc.call(self.url, method, path, body, token=self.token, timeout=self.timeout,
                                   conn=self._conn())
                self._local.used = time.monotonic()
                rtt = time.monotonic() - t0
                self.rtt_s = rtt if self.rtt_s is None else 0.8 * self.rtt_s + 0.2 * rtt
                return reply
            except httpc.CallError as e:
                if e.status < 500 or attempt == self.retries:
                    raise
            except (OSError, http.client.HTTPException):
                self._drop_conn()
                if attempt == self.retries:
                    raise
            delay = min(self.max_backoff_s, self.backoff_s * 2 ** attempt)
            time.sleep(delay * (0.5 + 0.5 * random.random()))
        raise AssertionError("unreachable")

    def register(self, cluster, incarnation, digest):
        return self._rpc("POST", "/register", {"cluster": cluster, "incarnation": incarnation, "digest": digest})

    def acquire(self, cluster, incarnation, blocks=None, ttl=None, request_id=None):
        """{"status": "ok", "lease": {...}} | {"status": "wait", "retry_after": s} | {"status": "done"}."""
        body = {"cluster": cluster, "incarnation": incarnation,
                "request_id": request_id or secrets.token_hex(8), "blocks": blocks, "ttl": ttl}
        return self._rpc("POST", "/acquire", {k: v for k, v in body.items() if v is not None})

    def heartbeat(self, cluster, incarnation, leases=(), ttl=None, throughput=None):
        """leases: ids or {"lease": id, "cursor": pos} claims. The reply is an instruction."""
        body = {"cluster": cluster, "incarnation": incarnation, "leases": list(leases),
                "ttl": ttl, "throughput": throughput}
        return self._rpc("POST", "/heartbeat", {k: v for k, v in body.items() if v is not None})

    def commit(self, cluster, incarnation, lease_id, end=None):
        body = {"cluster": cluster, "incarnation": incarnation, "lease": lease_id, "end": end}
        return self._rpc("POST", "/commit", {k: v for k, v in body.items() if v is not None})

    def release(self, cluster, incarnation, lease_ids=(), leave=False):
        return self._rpc("POST", "/release", {"cluster": cluster, "incarnation": incarnation,
                                              "leases": list(lease_ids), "leave": leave})

    def status(self):
        return self._rpc("GET", "/status")

    def health(self):
        return self._rpc("GET", "/health")


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

    # ---- lifecycle

    def start(self, register=True):
        """Register (unless the caller already did, e.g. while waiting out an older
        incarnation) and start the background heartbeat/prefetch thread."""
        if register:
            self.client.register(self.cluster, self.incarnation, self.digest)
        self._thread = threading.Thread(target=self._run, name=f"darl-{self.cluster}", daemon=True)
        self._thread.start()
        return self

    def __enter__(self):
        return self.start() if self._thread is None else self

    def __exit__(self, *exc):
        self.close()

    def close(self, release=True):
        """Stop heartbeating; give back everything not committed and leave, so a
        requeued job can register the stream at once."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=60)
        if release and self._error is None:
            try:
                self.client.release(self.cluster, self.incarnation, list(self._held), leave=True)
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

    def commit(self, span):
        """Commit [lease start, span.end); raises LeaseLost if the lease was reclaimed."""
        t0 = self._handed_at.pop(span, None)
        if t0 is not None:
            self.end_phase(time.monotonic() - t0, len(span))
        try:
            reply = self.client.commit(self.cluster, self.incarnation, span.lease, span.end)
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

    def span_done(self, span):
        """Feed the TTL estimate with the time the span has been out (handed out until now),
        for a span that is not committed here: under federation its lease must outlive the
        inner phase AND the round trip to the aggregator, not the inner phase alone."""
        t0 = self._handed_at.pop(span, None)
        if t0 is not None:
            self.end_phase(time.monotonic() - t0, len(span))

    def release(self, span):
        """Give back what is uncommitted of the span's lease (a delta that was not merged:
        its blocks return to the pool and are trained again). Stop heartbeating it."""
        with self._cond:
            held = self._held.pop(span.lease, None)
            self._handed_at.pop(span, None)
        if held is None:
            return {"released": 0}
        try:
            return self.client.release(self.cluster, self.incarnation, [span.lease])
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

    def refresh(self):
        """One heartbeat now (applied like the background ones): a lease the aggregator
        took into custody or committed meanwhile leaves held()."""
        self._heartbeat()

    # ---- the background thread

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
            except httpc.CallError as e:     # 4xx: this incarnation is refused (stale, unknown): fatal
                self._fail(e)
                return
            except (OSError, http.client.HTTPException) as e:
                self.log(f"coordinator unreachable ({e}); holding on to the spans already claimed")
                next_beat = time.monotonic() + 0.5
                with self._cond:
                    self._cond.wait(0.5)

    def _fail(self, err):
        with self._cond:
            self._error = err
            self._cond.notify_all()

    def _heartbeat(self, claim=None):
        """One heartbeat for every held lease; `claim` = (lease, cursor). Applies the reply."""
        with self._rpc_lock:
            with self._cond:
                ids = list(self._held)
            items = [{"lease": i, "cursor": claim[1]} if claim and claim[0] == i else i for i in ids]
            reply = self.client.heartbeat(self.cluster, self.incarnation, items, ttl=self.ttl_s,
                                          throughput=self.throughput)
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
            reply = self.client.acquire(self.cluster, self.incarnation, blocks=self.lease_blocks, ttl=self.ttl_s)
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


# ------------------------------------------------------------------ simulate

def start_coordinator(state_dir, num_blocks, seed, extra=(), log_path=None):
    """A real darl_server.py process on a free loopback port: (Popen, url)."""
    log_path = log_path or os.path.join(state_dir, "coordinator.log")
    out = open(log_path, "ab")
    cmd = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "darl_server.py"),
           "--num-samples", str(num_blocks), "--block-size", "1", "--seed", str(seed),
           "--state-dir", state_dir, "--port", "0", *map(str, extra)]
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    out.close()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with open(log_path, "rb") as f:
            for line in f.read().decode(errors="replace").splitlines():
                if line.startswith("darl_server listening on "):
                    return proc, line.split()[-1]
        if proc.poll() is not None:
            raise RuntimeError(f"coordinator exited with {proc.returncode}; see {log_path}")
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"coordinator did not start within 60 s; see {log_path}")


def sim_worker(a):
    """One simulated cluster: trains `rate` blocks/s, reporting every span and commit."""
    space = BlockSpace(a.blocks, 1, a.seed)
    report = open(a.report, "a", buffering=1)

    def note(event, span=None, **kw):
        rec = {"event": event, "t": time.time(), **kw}
        if span is not None:
            rec.update(lease=span.lease, start=span.start, end=span.end)
        report.write(json.dumps(rec) + "\n")

    time.sleep(a.delay)                                   # queued behind other jobs
    client = LeaseClient(a.url, retries=8)
    session = LeaseSession(client, a.cluster, space.digest(), span_blocks=a.span, phase_s=a.span / a.rate,
                           log=lambda m: None)
    with session:
        note("start", incarnation=session.incarnation)
        commits = 0
        while (span := session.next_span(timeout=120)) is not None:
            note("span", span)
            if a.hold_after is not None and commits >= a.hold_after:
                note("hold", span)                        # mid-lease: wait here for the SIGKILL
                while True:
                    time.sleep(3600)
            time.sleep(len(span) / a.rate)                # "training"
            try:
                session.commit(span)
            except LeaseLost as e:
                note("lost", span, reason=str(e))
                continue
            note("commit", span, blocks=[space.block_at(p) for p in span.positions()])
            commits += 1
    note("exit")
    return 0


def read_reports(paths):
    """{cluster: [events]} from the workers' own report files."""
    out = {}
    for name, path in paths.items():
        events = []
        if os.path.exists(path):
            with open(path) as f:
                for line in f:
                    if line.endswith("\n"):
                        events.append(json.loads(line))
        out[name] = events
    return out


def audit(num_blocks, reports):
    """Coverage from what the clients said they committed: (rows, duplicates, missing)."""
    seen = collections.Counter()
    rows = []
    for name, events in reports.items():
        committed = [b for e in events if e["event"] == "commit" for b in e["blocks"]]
        seen.update(committed)
        spans = {(e["lease"], e["start"], e["end"]) for e in events if e["event"] == "span"}
        done = {(e["lease"], e["start"], e["end"]) for e in events if e["event"] == "commit"}
        lost = sum(end - start for _, start, end in spans - done)
        t = [e["t"] for e in events if e["event"] in ("span", "commit")]
        bps = len(committed) / (max(t) - min(t)) if len(t) > 1 and max(t) > min(t) else 0.0
        rows.append({"cluster": name, "committed": len(committed), "lost": lost, "blocks_per_s": bps,
                     "exited": any(e["event"] == "exit" for e in events)})
    duplicates = sorted(b for b, n in seen.items() if n > 1)
    missing = sorted(set(range(num_blocks)) - set(seen))
    return rows, duplicates, missing


@dataclasses.dataclass
class SimConfig:
    clusters: int
    kill: int
    late: int
    blocks: int
    span: int
    fastest: float
    spread: float
    delay: float
    seed: int
    timeout: float

    def validate(self):
        if self.clusters < 1:
            raise ValueError("--clusters must be >= 1")
        if self.kill < 0 or self.late < 0 or self.kill + self.late >= self.clusters + (self.kill == 0):
            raise ValueError(f"--kill {self.kill} and --late {self.late} must leave at least one cluster "
                             f"that is neither killed nor late, of --clusters {self.clusters}")
        if self.blocks < 1 or self.span < 1 or self.fastest <= 0 or self.spread < 1:
            raise ValueError("--blocks, --span and --fastest must be positive, --spread >= 1")
        return self

    def rates(self):
        n = self.clusters
        return [self.fastest / self.spread ** (i / (n - 1)) if n > 1 else self.fastest for i in range(n)]


def simulate(cfg):
    """Coordinator + one process per cluster; kill some, delay some; audit; 0 = PASS."""
    rates = cfg.rates()
    names = [f"sim-{i}" for i in range(cfg.clusters)]
    killed = names[1:1 + cfg.kill] if cfg.clusters > 1 else names[:cfg.kill]
    late = [n for n in names if n not in killed and n != names[0]][:cfg.late]
    work = tempfile.mkdtemp(prefix="darl-sim-")
    coord, url = start_coordinator(work, cfg.blocks, cfg.seed,
                                   ["--min-ttl", 2, "--default-ttl", 4, "--grant-seconds", 1,
                                    "--initial-grant", 2 * cfg.span, "--max-attempts", 0])
    reports = {n: os.path.join(work, f"{n}.jsonl") for n in names}
    procs = {}
    t0 = time.monotonic()
    try:
        for n, rate in zip(names, rates):
            cmd = [sys.executable, os.path.abspath(__file__), "simulate-worker", "--url", url, "--cluster", n,
                   "--rate", str(rate), "--blocks", str(cfg.blocks), "--seed", str(cfg.seed),
                   "--span", str(cfg.span), "--report", reports[n], "--delay", str(cfg.delay if n in late else 0)]
            if n in killed:       # after 2 commits it takes its next span and waits there for the kill
                cmd += ["--hold-after", "2"]
            procs[n] = subprocess.Popen(cmd)
        pending_kill = set(killed)
        while any(p.poll() is None for p in procs.values()):
            if time.monotonic() - t0 > cfg.timeout:
                raise TimeoutError(f"simulation did not finish within {cfg.timeout:.0f} s (--timeout)")
            for n in list(pending_kill):      # SIGKILL mid-lease: holding a claimed span it never commits
                ev = read_reports({n: reports[n]})[n]
                if ev and ev[-1]["event"] == "hold":
                    procs[n].send_signal(signal.SIGKILL)
                    pending_kill.discard(n)
            time.sleep(0.01)
        killed = [n for n in killed if procs[n].returncode == -signal.SIGKILL]
        books = LeaseClient(url).status()
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
        coord.send_signal(signal.SIGTERM)
        coord.wait(timeout=30)
    elapsed = time.monotonic() - t0
    rows, duplicates, missing = audit(cfg.blocks, read_reports(reports))
    rc = print_audit(cfg, rows, rates, killed, late, books, duplicates, missing, elapsed)
    if len(killed) != cfg.kill:
        print(f"FAIL: --kill {cfg.kill} asked for {cfg.kill} cluster(s) SIGKILLed mid-lease, {len(killed)} were "
              "(a cluster ran out of blocks before its third span: use more --blocks)")
        rc = 1
    if rc == 0:
        shutil.rmtree(work, ignore_errors=True)
    else:
        print(f"reports and the coordinator's log and state are kept in {work}")
    return rc


def print_audit(cfg, rows, rates, killed, late, books, duplicates, missing, elapsed):
    leased = {c["cluster"]: c["leased"] for c in books.get("clusters", [])}
    print(f"{'cluster':<8} {'committed':>9} {'leased':>7} {'lost':>5} {'blk/s':>8}   "
          f"({cfg.blocks:,} blocks, one epoch, {elapsed:.1f} s)")
    for r, rate in zip(rows, rates):
        tag = (["<- SIGKILLed mid-lease"] if r["cluster"] in killed else []) + \
              ([f"<- started {cfg.delay:g} s late"] if r["cluster"] in late else [])
        print(f"{r['cluster']:<8} {r['committed']:>9} {leased.get(r['cluster'], 0):>7} {r['lost']:>5} "
              f"{r['blocks_per_s']:>8.3f}   trains at {rate:.1f} blk/s {' '.join(tag)}")
    covered = cfg.blocks - len(missing)
    print(f"blocks covered {covered:,} of {cfg.blocks:,}  duplicates {len(duplicates)}  missing {len(missing)}"
          f"  (coordinator's own books: {books.get('committed')} committed, {books.get('seq')} logged changes)")
    if duplicates or missing or books.get("committed") != cfg.blocks:
        print(f"FAIL: duplicated blocks {duplicates[:50]}; missing blocks {missing[:50]}"
              + ("" if books.get("committed") == cfg.blocks else
                 f"; the coordinator counts {books.get('committed')} committed"))
        return 1
    print("PASS: coverage is exactly once")
    return 0


def main(argv):
    p = httpd.base_parser(__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("simulate", help="end-to-end: real coordinator, one process per cluster, coverage audit")
    s.add_argument("--clusters", type=int, default=4, help="simulated clusters (default 4)")
    s.add_argument("--kill", type=int, default=1, help="clusters SIGKILLed mid-lease (default 1)")
    s.add_argument("--late", type=int, default=1, help="clusters that start --delay s late (default 1)")
    s.add_argument("--blocks", type=int, default=1000, help="blocks in the space (default 1000)")
    s.add_argument("--span", type=int, default=4, help="blocks per claimed span (default 4)")
    s.add_argument("--fastest", type=float, default=60.0, help="fastest cluster's rate, blocks/s (default 60)")
    s.add_argument("--spread", type=float, default=8.0, help="fastest/slowest rate ratio (default 8)")
    s.add_argument("--delay", type=float, default=2.0, help="late clusters' start delay, s (default 2)")
    s.add_argument("--seed", type=int, default=0, help="block-space seed (default 0)")
    s.add_argument("--timeout", type=float, default=120.0, help="give up after this many s (default 120)")
    w = sub.add_parser("simulate-worker", help="(used by simulate) one simulated cluster")
    w.add_argument("--url", required=True)
    w.add_argument("--cluster", required=True)
    w.add_argument("--rate", type=float, required=True, help="blocks/s")
    w.add_argument("--blocks", type=int, required=True)
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--span", type=int, default=4)
    w.add_argument("--delay", type=float, default=0.0, help="s before starting")
    w.add_argument("--report", required=True, help="JSON-lines file of spans and commits")
    w.add_argument("--hold-after", type=int, help="after this many commits, take the next span and wait "
                   "(for simulate's SIGKILL) instead of training it")
    a = p.parse_args(argv)
    if a.cmd == "simulate-worker":
        return sim_worker(a)
    try:
        cfg = SimConfig(a.clusters, a.kill, a.late, a.blocks, a.span, a.fastest, a.spread, a.delay, a.seed,
                        a.timeout).validate()
    except ValueError as e:
        raise SystemExit(f"simulate: {e}")
    return simulate(cfg)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
