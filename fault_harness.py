"""fault_harness.py - exactly-once under fault schedules: real servers, fake sites, an oracle.

Runs on: this machine (CPU; Python + numpy, never torch), imported by bench/fault_schedule.py
(500 random schedules, its command line) and tests/test_fault_schedule.py (fixed ones).
For each schedule it starts real darl_server.py, fedmom_server.py (--darl) and
blobstore.py processes on 127.0.0.1 (their own state dir under the work dir) and 2-3 fake
sites: this file run as `python fault_harness.py site ...` (started by Run itself, never
by hand), a torch-free loop over the real clients (darl_client.LeaseSession,
fedmom_client) that trains nothing but sends small seeded random deltas for real leases,
and records what it sent. A schedule then injects faults at protocol phases, and an
oracle judges the outcome.

    res = fault_harness.run_schedule(seed, work_dir)               # the seed's random schedule
    res = fault_harness.run_schedule(seed, work_dir, sched=Schedule(...))   # a fixed one
    res.findings                  # [] = the oracle found nothing; describe_failure(res) says what

The faults (the servers' fault points are testhooks.py's: a process stops at the
named phase, and is SIGKILLed there):
    darl_kill       DARL SIGKILLed at darl.append (decided, not logged), darl.torn (half a
                    log line written), darl.synced (logged, not answered), after 0-3 hits
    fedmom_kill     the aggregator SIGKILLed at fedmom.received (mid-upload),
                    fedmom.spooled, fedmom.custody_held (DARL holds it, the spool does not
                    say so), fedmom.merge (mid-merge), fedmom.round_durable (between a
                    durable round and its commits), fedmom.committed, fedmom.epoch_durable (its
                    new epoch and holder durable, the confirm not sent); back after 0-2 s
    fedmom_outage   the aggregator down for 2 x the longest lease TTL, then back
    blob_kill       the blob store SIGKILLed mid-upload (blob.chunk)
    site_kill       a site SIGKILLed at site.trained (its delta not sent) or site.sent (its
                    delta accepted, its outcome unknown); requeued as a new incarnation
    site_stop       a site SIGSTOPped past its lease TTL at site.trained or at site.checked
                    (its lease checked, its delta not yet sent: the race a site's own check
                    cannot close), then SIGCONTed; with a newcomer, a new site starts once
                    the stopped site's lease has expired, so it may lease and train those
                    blocks while the stopped site's delta is still for the open round
Some sites (chosen by the seed) skip the lease check before sending, as a careless or
older client would: the servers must be safe whatever a site does. Some (chosen by the
seed too) are overlapped, as train.py --overlap: a delta's round trip runs on a thread
while the site leases and "trains" its next span, whose delta then names the round the
round trip ended on as its base; a kill or stop of such a site may come while a delta is
in flight and the next span is being trained. Some (drawn after the rest, so older seeds
keep their schedules) send int4 deltas, as train.py --wire int4 (wire.WireWriter, with
error feedback), and half the seeds run the aggregator with --down-wire int4. Every site
holds theta_global as a real site's rank 0 does: after each round trip it downloads it
with fedsite.FedSite's own code (the update added to the theta it holds and checked by
its digest, or on 409 no_update the whole theta), and notes the digest it now holds.
    darl_flag       DARL restarted with --max-attempts or --max-grant changed: it must
                    refuse, naming the flag; then restarted with --accept-config-change
    clock_step      the servers' wall clock stepped by +-1 h (PWW_TEST_CLOCK_OFFSET_FILE),
                    DARL SIGKILLed and restarted across the step
    token_rotation  new tokens, the sites' and the aggregator's: DARL restarted with them (the
                    aggregator's calls get 401 and must stay owed), then the aggregator and
                    the blob store; reached once a site met the 401 and was requeued with the
                    new token
    stale_aggregator  the aggregator's state copied while it is stopped (a standby's copy, a
                    restored backup); the live one restarts and DARL issues it the next epoch;
                    then the stale copy is started beside it 1-3 times, as a supervisor would:
                    DARL must fence it at every start (exit 3), the live one going on
The oracle, from the sites' records and the final durable state of both servers:
    - audit.py's judgement (every block inside exactly one merged delta, or quarantined
      and said; custody committed; rounds consecutive; no violation counter above 0);
    - every merged delta is one a site sent, its DARL positions the ones it trained;
      every position inside exactly one of them by the sites' own records;
    - no acknowledged commit lost (custody DARL reported committed during the run is
      still committed) and no merge a site was told of lost;
    - theta_global, the momentum and (--down-wire) the residual equal, bit for bit, a
      float32 replay by the aggregator's rule (fedmom_merge.merge_files with the recorded
      weights, clip scales and momentum resets, then fedmom_merge.publish with the
      residual) from the initial model and the delta files the sites wrote, an int4 one
      decoded by wire.py; every theta a site fetched has the replay's digest for its
      round, and no update failed its digest; with an f32 aggregator theta_global also
      equals a float64 replay of the rule written out here (within 1e-5);
    - the changed-flag restart was refused naming the flag; no site crashed.
A failing schedule keeps its directory (the servers' state and logs, the sites' records).
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
import types

import numpy as np

import audit
import darl_client
import durable
import fedmom_checkpoint
import fedmom_client
import fedmom_merge
import fedmom_records
import fedsite
import httpc
import tensorio
import testhooks
import wire

ROOT = os.path.dirname(os.path.abspath(__file__))
SHAPES = {"w": (48,), "b": (4, 3)}
TTL = (3.0, 4.0)                  # DARL --min-ttl / --max-ttl: every lease lives 3-4 s unless renewed
MEMBER_TIMEOUT_S, ROUND_DEADLINE_S = 10, 20   # longer than a stop, so a stopped site's round waits for it
PORTS = (12000, 28000)            # server ports: below the kernel's ephemeral range, so no other socket takes a
                                  # killed server's port before it comes back on it
LR, MU = 0.7, 0.9
SCHEDULE_DEADLINE_S = 300         # a schedule still running after this is a stall (a liveness failure)
KINDS = ("darl_kill", "fedmom_kill", "fedmom_outage", "blob_kill", "site_kill", "site_stop", "darl_flag",
         "clock_step", "token_rotation", "stale_aggregator")
WEIGHTS = (3, 4, 2, 1, 3, 2, 1, 1, 1, 1)
EXIT_FENCED = 3                   # fedmom_server's exit status when DARL fenced it
POINTS = {"darl_kill": ("darl.append", "darl.torn", "darl.synced"),
          "fedmom_kill": ("fedmom.received", "fedmom.spooled", "fedmom.custody_held", "fedmom.merge",
                          "fedmom.round_durable", "fedmom.committed", "fedmom.epoch_durable"),
          "blob_kill": ("blob.chunk",), "site_kill": ("site.trained", "site.sent"),
          "site_stop": ("site.trained", "site.checked")}
EXIT_TOKEN = 3                    # a fake site's exit status when a server refused its token
CALL_S = 180.0                    # a fake site's call to a server: s without progress before it gives up
STOP = threading.Event()          # SIGTERM / Ctrl-C: every running schedule stops its processes and ends


class Interrupted(BaseException):
    """The whole run is being stopped (not a finding)."""


# ---------------------------------------------------------------- schedules

@dataclasses.dataclass
class Fault:
    kind: str
    after: int                    # inject once the sites have sent this many deltas in all
    point: str | None = None
    target: str | None = None     # a site's name (site faults)
    skip: int = 0                 # hits of the point to let pass first
    pause: float = 0.0            # seconds down before the restart
    value: object = None          # darl_flag: (flag, new value); clock_step: +-3600

    def describe(self):
        bits = [self.kind] + [f"{k}={v}" for k, v in (("point", self.point), ("target", self.target),
                                                       ("skip", self.skip), ("pause", self.pause),
                                                       ("value", self.value)) if v not in (None, 0, 0.0)]
        return f"after {self.after} sends: " + " ".join(bits)


@dataclasses.dataclass
class Schedule:
    seed: int
    sites: list                   # [(name, transport)]
    blocks: int
    span: int
    max_attempts: int
    faults: list
    careless: list = dataclasses.field(default_factory=list)   # sites that send without checking the lease
    overlapped: list = dataclasses.field(default_factory=list)  # sites that train on while a delta is in flight
    int4: list = dataclasses.field(default_factory=list)        # sites that send int4 deltas (train.py --wire int4)
    down_wire: str = "f32"        # the aggregator's --down-wire: f32 (sites download theta) or int4 (updates)

    @property
    def checkpoint_rounds(self):
        """The aggregator's --checkpoint-rounds, 1 to 4 by seed: kills land between checkpoints
        (a restart replays the rounds since) and on them."""
        return 1 + self.seed % 4

    def describe(self):
        head = (f"seed {self.seed}: sites {self.sites}, {self.blocks} blocks, span {self.span}, "
                f"--max-attempts {self.max_attempts}" + (f", careless {self.careless}" if self.careless else "")
                + (f", overlapped {self.overlapped}" if self.overlapped else "")
                + (f", int4 {self.int4}" if self.int4 else "")
                + (f", aggregator --down-wire {self.down_wire}" if self.down_wire != "f32" else "")
                + f", --checkpoint-rounds {self.checkpoint_rounds}")
        return "\n".join([head] + [f"  {i + 1}. {f.describe()}" for i, f in enumerate(self.faults)])


def make_schedule(seed):
    rng = random.Random(seed)
    n_sites = rng.choice((2, 2, 3))
    sites = [(name, rng.choice(("inline", "inline", "blob"))) for name in ("alpha", "beta", "gamma")[:n_sites]]
    careless = sorted(name for name, _ in sites if rng.random() < 0.3)
    blocks, span = rng.randint(18, 30), rng.choice((2, 3))
    transports = {t for _, t in sites}
    faults, after = [], 0
    for _ in range(rng.randint(2, 4)):
        kind = rng.choices(KINDS, WEIGHTS)[0]
        if kind == "blob_kill" and "blob" not in transports:
            kind = "fedmom_kill"
        after += rng.randint(0, 1)
        f = Fault(kind, after)
        if kind in POINTS:
            points = [x for x in POINTS[kind] if x != "fedmom.received" or "inline" in transports]
            f.point, f.skip = rng.choice(points), rng.randint(0, 2)
        if kind in ("site_kill", "site_stop"):
            f.target = rng.choice(sites)[0]
        if kind in ("fedmom_kill", "darl_kill", "blob_kill", "site_kill"):
            f.pause = round(rng.uniform(0.0, 2.0), 2)
        if kind == "fedmom_outage":
            f.pause = round(rng.uniform(2.0, 3.0) * TTL[1], 2)
        if kind == "darl_flag":
            f.value = rng.choice((("--max-attempts", rng.choice((0, 2, 4))), ("--max-grant", rng.choice((0, 1, 5)))))
        if kind == "clock_step":
            f.value = rng.choice((3600, -3600))
        if kind == "stale_aggregator":
            f.value = rng.randint(1, 3)
        if kind == "site_stop" and f.point == "site.checked" and rng.random() < 0.6:
            f.value = "newcomer"
        faults.append(f)
    attempts = rng.choice((0, 3))
    overlapped = sorted(name for name, _ in sites if rng.random() < 0.4)     # drawn after the rest: older
    int4 = sorted(name for name, _ in sites if rng.random() < 0.4)           # seeds keep their schedules
    down_wire = rng.choice(("f32", "int4"))
    return Schedule(seed, sites, blocks, span, attempts, faults, careless, overlapped, int4, down_wire)


# ---------------------------------------------------------------- the fake site

def delta_arrays(seed, incarnation, lease, start, base):
    rng = np.random.default_rng([seed, int(incarnation, 16), lease, start, base])
    return {k: (0.01 * rng.standard_normal(s)).astype(np.float32) for k, s in SHAPES.items()}


INT4 = wire.Codec("int4")           # a site's --wire int4, default block


class Residual:
    """An int4 site's error feedback, diloco.Residual's rules in memory (a new incarnation
    starts with nothing owed, as a restart that cannot know whether its delta merged):
    send x = delta + owed, next = x - decode(encode(x)); merged: next becomes owed; not
    merged: next is dropped; outcome unknown: both reset."""

    def __init__(self):
        self.owed, self.next = None, None

    def write(self, path, arrays, base):
        x = {k: v + self.owed[k] if self.owed else v for k, v in arrays.items()}
        self.next = {}
        with wire.WireWriter(path, [(k, v.shape) for k, v in x.items()], INT4, {"base_round": str(base)},
                             fsync=False) as w:
            for k, v in x.items():
                self.next[k] = v - w.write(k, v)

    def settle(self, outcome):
        if outcome == "merged":
            self.owed = self.next
        elif outcome == "unknown":
            self.owed = None
        self.next = None


class SiteTheta:
    """theta_global as a site's rank 0 holds it, fetched by fedsite.FedSite's own download
    code: with the aggregator's --down-wire, a site holding the previous round downloads the
    update (GET /theta_update, or /theta_update_blob for a blob site) and adds it, checked by
    the digest the aggregator published (wire.apply_update); else (409 no_update: new,
    behind, or an f32 aggregator) it downloads the whole theta. Each fetch is noted with
    its round, how it came and the digest of what the site now holds; the oracle checks
    that digest against its replay of that round. An update that failed its digest (FedSite
    logs it and falls back to the whole theta) is noted as update_mismatch: a finding."""

    def __init__(self, a, fed, inc, note):
        cfg = types.SimpleNamespace(cluster=a.cluster, token_file=a.token_file, darl_url=a.darl, ca_file=None,
                                    federation=a.fedmom, blob_url=a.blob, transport=a.transport)
        self.site = fedsite.FedSite(cfg, None, 0, self._log)
        self.site.fed, self.site.theta_transport = fed, a.transport
        home = os.path.join(a.records, "theta", f"{a.cluster}-{inc}")    # a site's own dir: FedSite puts
        os.makedirs(home, exist_ok=True)                                 # the update beside theta
        self.path = os.path.join(home, "theta.safetensors")
        self.note, self.round = note, None

    def _log(self, msg):
        self.note("update_mismatch" if msg.startswith("!!!") else "site_log", msg=msg)

    def fetch(self):
        """Download theta_global now, as FedSite does at the end of every round trip -> its round."""
        self.round = _call("theta", lambda d: self.site._fetch(self.path, d))
        self.note("theta", round=self.round, via=self.site.down.get("via"), digest=self.site.held[1])
        return self.round

    def current(self):
        """The round of the theta held, fetched first if the aggregator has moved past it
        (a phase trains from the newest theta it can get)."""
        if self.round is None or _call("round", lambda d: self.site.fed.current_round(deadline=d)) != self.round:
            self.fetch()
        return self.round


def write_tensors(path, arrays):
    with tensorio.TensorWriter(path, [(k, "F32", a.shape) for k, a in arrays.items()], fsync=False) as w:
        for k, a in arrays.items():
            w.write(k, a)


class TokenRefused(Exception):
    pass


def site_main(a):
    """One incarnation of a fake site: the protocol of train.py's FedSite, no torch."""
    token = httpc.load_token(a.token_file)
    inc = secrets.token_hex(6)
    records = open(os.path.join(a.records, f"{a.cluster}-{inc}.jsonl"), "a", buffering=1)

    lock = threading.Lock()          # an overlapped site notes from its round trip's thread too

    def note(event, **kw):
        with lock:
            records.write(json.dumps({"event": event, "t": time.time(), "cluster": a.cluster, "incarnation": inc,
                                      **kw}) + "\n")
    note("start")
    try:
        try:
            code = _site_loop(a, token, inc, note)
        except httpc.CallError as e:      # a 401 from any call: the token was rotated
            if e.status != 401:
                raise
            raise TokenRefused(str(e))
    except TokenRefused as e:
        note("exit", code=EXIT_TOKEN, why=str(e))
        return EXIT_TOKEN
    note("exit", code=code)
    return code


def _call(what, fn):
    """fn(deadline): one httpc.Deadline of CALL_S per call, short pauses (the faults last
    seconds); the client under fn repeats by httpc's rule, a 409 not_member joining again
    inside it, as for a real site. A 401 is TokenRefused."""
    try:
        return fn(httpc.Deadline(CALL_S, what=what, max_wait_s=0.2, log=httpc.quiet))
    except httpc.CallError as e:
        if e.status == 401:
            raise TokenRefused(f"{what}: {e}")
        raise


def _site_loop(a, token, inc, note):
    client = darl_client.LeaseClient(a.darl, token=token, timeout=5.0)
    digest = _call("DARL status", lambda d: client.status(deadline=d))["digest"]
    _call("register", lambda d: client.register(a.cluster, inc, digest, deadline=d))   # waits out a predecessor
    session = darl_client.LeaseSession(client, a.cluster, digest, incarnation=inc, span_blocks=a.span,
                                       lease_blocks=a.span, prefetch=False, phase_s=a.phase_s, log=lambda m: None)
    session.start(register=False)
    fed = fedmom_client.FedMomClient(a.fedmom, a.cluster, inc, token=token, blob_url=a.blob, timeout=10.0)
    member = Membership(fed)
    member.join()
    a.theta, a.residual = SiteTheta(a, fed, inc, note), Residual() if a.wire == "int4" else None
    try:
        _span_loop(a, fed, member, session, note)
        session.close()
        member.leave()
        return 0
    finally:
        member.stop()


def _span_loop(a, fed, member, session, note):
    """Spans until DARL is done. A plain site trains, sends and waits for each in turn
    (_phase). An overlapped one keeps train.py --overlap's order: the round trip of span k
    on a thread while span k+1 is leased and trained; span k+1's delta is written once
    round trip k ended, with the round it ended on as its base. Nothing leaves or joins
    FedMom while a trip is in flight."""
    flight = None                                  # (thread, box) of the round trip in flight
    while True:
        try:
            span = session.next_span(timeout=0.2 if flight else 1.0)
        except TimeoutError:
            if flight is not None and not flight[0].is_alive():
                _join(flight)                      # it ended before a span came: settle it first
                flight = None
            elif flight is None and session.starved and member.member:
                member.leave()                     # every block is someone else's: leave the rounds
            continue
        except httpc.CallError as e:
            if e.status == 401:
                raise TokenRefused(f"DARL: {e}")
            raise
        if span is None:
            break
        in_flight = flight is not None and flight[0].is_alive()
        if flight is None:
            if not member.member:
                member.join()
            if not a.overlap:
                _phase(a, fed, member, session, span, note)
                continue
            base = a.theta.current()
        time.sleep(a.train_s)                      # "train" span k+1 while delta k is in flight
        if flight is not None:
            base = _join(flight)
        key, path, tokens = _train(a, session, span, base, note, while_in_flight=in_flight)
        testhooks.fault_point("site.trained")
        box = {}
        t = threading.Thread(target=_trip, args=(a, fed, member, session, span, key, path, tokens, note, box),
                             daemon=True)
        flight = (t, box)
        t.start()
    if flight is not None:
        _join(flight)


def _join(flight):
    """Wait for a round trip's thread: the round it ended on (its exception, re-raised here)."""
    t, box = flight
    t.join()
    if "err" in box:
        raise box["err"]
    return box["out"]


class Membership:
    """FedMom membership with its keepalive, as train.py's FedSite keeps it: leaving stops
    the heartbeats (which would otherwise join again)."""

    def __init__(self, fed):
        self.fed, self.keepalive, self.member = fed, None, False

    def join(self):
        _call("join", lambda d: self.fed.join(deadline=d))
        self.member = True
        if self.keepalive is None:
            self.keepalive = self.fed.keepalive(interval_s=0.5)
            self.keepalive.__enter__()

    def stop(self):
        if self.keepalive is not None:
            self.keepalive.__exit__(None, None, None)
            self.keepalive = None

    def leave(self):
        self.stop()
        if self.member:
            self.member = False
            try:
                _call("leave", lambda d: self.fed.leave(deadline=d))
            except httpc.CallError as e:
                if e.status != 409:          # not a member any more: nothing to leave
                    raise


def _phase(a, fed, member, session, span, note):
    """Train (sleep), send the delta for `span`, learn what became of it, settle the lease."""
    base = a.theta.current()
    key, path, tokens = _train(a, session, span, base, note)
    time.sleep(a.train_s)
    testhooks.fault_point("site.trained")
    _round_trip(a, fed, member, session, span, key, path, tokens, note)


def _train(a, session, span, base, note, **extra):
    key = dict(lease=span.lease, start=span.start, end=span.end, base_round=base)
    path = os.path.join(a.records, f"{a.cluster}-{session.incarnation}-l{span.lease}-s{span.start}-r{base}.safetensors")
    arrays = delta_arrays(a.seed, session.incarnation, span.lease, span.start, base)
    if a.residual is not None:
        a.residual.write(path, arrays, base)
    else:
        write_tensors(path, arrays)
    tokens = 100 * len(span)
    note("trained", file=os.path.basename(path), tokens=tokens, wire=a.wire, **key, **extra)
    return key, path, tokens


def _trip(a, fed, member, session, span, key, path, tokens, note, box):
    """An overlapped site's round trip (its thread): box["out"], the round it ended on, or box["err"]."""
    try:
        box["out"] = _round_trip(a, fed, member, session, span, key, path, tokens, note)
    except BaseException as e:
        box["err"] = e


def _round_trip(a, fed, member, session, span, key, path, tokens, note):
    """Check the lease, send, wait for the outcome, settle the lease and the residual,
    download theta_global (as FedSite.round_trip) -> the round of that theta."""
    state = _send_and_wait(a, fed, member, session, span, key, path, tokens, note)
    if a.residual is not None:
        a.residual.settle(state)
    return a.theta.fetch()


def _send_and_wait(a, fed, member, session, span, key, path, tokens, note):
    """-> what became of the delta: merged, unknown, or another word for not merged."""
    base = key["base_round"]
    if not a.careless:                            # FedSite.round_trip's check (a careless site skips it)
        try:
            session.refresh()
        except (httpc.CallError, OSError, http.client.HTTPException):
            pass
        if span.lease not in session.held():
            note("lost", why="lease lost at DARL before the send", **key)
            session.span_done(span)
            return "lost"
    testhooks.fault_point("site.checked")
    record = {"id": span.lease, "start": span.start, "end": span.end}
    try:
        reply = _call("send", lambda d: fed.send_delta(path, base, tokens, [record], {"loss": 1.0},
                                                       transport=a.transport, deadline=d))
    except fedmom_client.StaleRound as e:
        note("stale", why=str(e), **key)
        _call("release", lambda d: session.release(span, deadline=d))
        return "stale"
    except httpc.CallError as e:
        if e.status == 401:
            raise TokenRefused(f"send: {e}")
        note("refused", status=e.status, code=e.reply.get("code"), why=e.reply.get("error"), **key)
        _call("release", lambda d: session.release(span, deadline=d))
        return "refused"
    note("sent", custody=reply.get("custody"), duplicate=bool(reply.get("duplicate")), **key)
    testhooks.fault_point("site.sent")
    while True:
        got = _call("outcome", lambda d: fed.heartbeat(wait_round_after=base, wait_s=1.0, deadline=d))
        mine = [o for o in got.get("deltas") or () if o.get("incarnation") == session.incarnation
                and o.get("base_round") == base]
        state = mine[0]["outcome"] if mine else None
        if state == "pending" or (state is None and got["round"] <= base):
            continue
        break
    session.span_done(span)
    if state == "merged":
        note("merged", merged_into=mine[0]["merged_into"], **key)
    elif state == "excluded":
        note("excluded", why=mine[0].get("why"), **key)
        _call("release", lambda d: session.release(span, deadline=d))
    else:
        note("unknown", round=got["round"], **key)
        session.forget(span)
        state = "unknown"
    return state


# ---------------------------------------------------------------- one schedule's processes

class Proc:
    """One server or site process, in its own session, with its own fault-point dir."""

    def __init__(self, run, name, cmd):
        self.run, self.name, self.cmd = run, name, cmd
        self.faults = os.path.join(run.dir, "faults", name)
        os.makedirs(self.faults, exist_ok=True)
        self.log_path = os.path.join(run.dir, "logs", f"{name}.log")
        self.p = None

    def start(self, cmd=None, wait_url=True):
        mark = os.path.getsize(self.log_path) if os.path.exists(self.log_path) else 0
        env = {**os.environ, testhooks.FAULT_DIR_ENV: self.faults, testhooks.CLOCK_OFFSET_ENV: self.run.clock_file,
               "PYTHONPATH": ROOT, "PWW_TOKEN": ""}
        with open(self.log_path, "ab") as log:
            self.p = subprocess.Popen(cmd or self.cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True)
        if not wait_url:
            return None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with open(self.log_path, errors="replace") as f:
                f.seek(mark)
                for line in f:
                    if " listening on " in line:
                        return line.split()[-1]
            if self.p.poll() is not None:
                raise RuntimeError(f"{self.name} exited {self.p.returncode} at start; see {self.log_path}")
            time.sleep(0.02)
        raise RuntimeError(f"{self.name} did not listen within 60 s; see {self.log_path}")

    def alive(self):
        return self.p is not None and self.p.poll() is None

    def signal(self, sig):
        if self.alive():
            os.kill(self.p.pid, sig)

    def kill(self):
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGKILL)
        if self.p is not None:
            self.p.wait()

    def term(self, timeout=30):
        self.signal(signal.SIGTERM)
        try:
            self.p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    def arm(self, point, skip):
        with open(os.path.join(self.faults, point), "w") as f:
            f.write(str(skip))

    def hit(self, point):
        return os.path.exists(os.path.join(self.faults, point + ".hit"))

    def release(self, point):
        """Let a process stopped at `point` go on (it removes the .hit as it leaves)."""
        durable.unlink(os.path.join(self.faults, point))

    def disarm(self, point):
        for suffix in ("", ".hit"):
            durable.unlink(os.path.join(self.faults, point + suffix))


class Run:
    """The servers, the sites and the records of one schedule; apply() injects one fault."""

    def __init__(self, sched, workdir, log=None):
        self.s, self.dir, self.log = sched, workdir, log or (lambda msg: None)
        for sub in ("logs", "records", "faults", "central"):
            os.makedirs(os.path.join(workdir, sub), exist_ok=True)
        self.central, self.records = os.path.join(workdir, "central"), os.path.join(workdir, "records")
        self.clock_file = os.path.join(workdir, "clock_offset")
        open(self.clock_file, "w").close()
        self.token_file = os.path.join(workdir, "token")
        self.agg_token_file = os.path.join(workdir, "aggregator.token")    # the custody endpoints' own credential
        self._write_token()
        self.darl_flags = {"--max-attempts": sched.max_attempts, "--max-grant": 0}
        self.procs, self.sites, self.requeue, self.transports = {}, {}, {}, dict(sched.sites)
        self.findings, self.injected = [], collections.Counter()
        self.committed_seen, self.max_round_seen = set(), 0
        self.token_exits = 0              # site exits for a refused token (the 401 a rotation promises)
        self.t0 = time.monotonic()

    def _write_token(self):
        """A new sites' token and a new aggregator token (written, not yet read by any server)."""
        self.token, self.agg_token = secrets.token_hex(16), secrets.token_hex(16)
        for path, token in ((self.token_file, self.token), (self.agg_token_file, self.agg_token)):
            durable.write_text(path, token + "\n", fsync=False)

    # -- processes
    def darl_cmd(self, port, accept=False):
        flags = [x for k, v in self.darl_flags.items() for x in (k, str(v))]
        return [sys.executable, "darl_server.py", "--num-samples", str(self.s.blocks), "--block-size", "1",
                "--seed", str(self.s.seed % 1000), "--state-dir", self.central, "--port", str(port),
                "--token-file", self.token_file, "--aggregator-token-file", self.agg_token_file,
                "--min-ttl", str(TTL[0]), "--default-ttl", str(TTL[0]),
                "--max-ttl", str(TTL[1]), "--restore-grace", str(2 * TTL[1]), "--snapshot-every", "25", *flags] + (
            ["--accept-config-change"] if accept else [])

    def start_servers(self):
        init = os.path.join(self.dir, "init.safetensors")
        rng = np.random.default_rng(self.s.seed)
        write_tensors(init, {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()})
        self.init = init
        self.darl_port = pick_port()
        self.procs["darl"] = Proc(self, "darl", self.darl_cmd(self.darl_port))
        self.darl = self.procs["darl"].start()
        self.procs["blob"] = Proc(self, "blob", [sys.executable, "blobstore.py", "--root",
                                                 os.path.join(self.central, "blobs"), "--port", str(pick_port()),
                                                 "--token-file", self.token_file])
        self.blob = self.procs["blob"].start()
        fed = [sys.executable, "fedmom_server.py", "--state-dir", os.path.join(self.central, "fedmom"),
               "--init", init, "--darl", self.darl, "--blob-url", self.blob, "--token-file", self.token_file,
               "--darl-token-file", self.agg_token_file,
               "--outer-lr", str(LR), "--outer-momentum", str(MU), "--round-deadline-s", str(ROUND_DEADLINE_S),
               "--member-timeout-s", str(MEMBER_TIMEOUT_S), "--darl-retry-s", "0.5", "--port", str(pick_port()),
               "--down-wire", self.s.down_wire, "--checkpoint-rounds", str(self.s.checkpoint_rounds)]
        self.procs["fedmom"] = Proc(self, "fedmom", fed)
        self.fedmom = self.procs["fedmom"].start()

    def start_site(self, name):
        transport = self.transports.setdefault(name, "inline")
        cmd = [sys.executable, os.path.abspath(__file__), "site", "--cluster", name, "--darl", self.darl,
               "--fedmom", self.fedmom, "--blob", self.blob, "--token-file", self.token_file,
               "--records", self.records, "--seed", str(self.s.seed), "--span", str(self.s.span),
               "--transport", transport, "--train-s", "0.15", "--phase-s", "0.5"] + (
            ["--careless"] if name in self.s.careless else []) + (
            ["--overlap"] if name in self.s.overlapped else []) + (
            ["--wire", "int4"] if name in self.s.int4 else [])
        proc = self.sites.get(name) or Proc(self, f"site-{name}", cmd)
        proc.cmd = cmd
        proc.start(wait_url=False)
        self.sites[name] = proc
        self.requeue.pop(name, None)

    def restart(self, name, cmd=None):
        """Start a server again on its own port (tried a few times: a socket another process
        closes late may hold the port for a moment)."""
        for attempt in range(5):
            try:
                url = self.procs[name].start(cmd)
                break
            except RuntimeError:
                if attempt == 4:
                    raise
                self.wait(lambda: False, 1.0)
        assert url == getattr(self, name), (url, getattr(self, name))

    # -- watching
    def sends(self):
        n = 0
        for fn in os.listdir(self.records):
            if fn.endswith(".jsonl"):
                with open(os.path.join(self.records, fn)) as f:
                    n += sum(1 for line in f if '"event": "sent"' in line)
        return n

    def trained(self, name):
        """Has (any incarnation of) site `name` trained a span yet?"""
        for fn in os.listdir(self.records):
            if fn.startswith(f"{name}-") and fn.endswith(".jsonl"):
                with open(os.path.join(self.records, fn)) as f:
                    if any('"event": "trained"' in line for line in f):
                        return True
        return False

    def supervise(self):
        """Requeue sites that stopped for a token refusal or a kill; note a site that crashed."""
        if STOP.is_set():
            raise Interrupted()
        now = time.monotonic()
        for name, proc in self.sites.items():
            if name in self.requeue:
                if now >= self.requeue[name]:
                    self.start_site(name)
                continue
            rc = proc.p.poll()
            if rc is None or rc == 0:
                continue
            if rc == EXIT_TOKEN:
                self.token_exits += 1
                self.requeue[name] = now + 0.3
            elif rc < 0:                 # killed by us: the fault that did it set the requeue time
                self.requeue.setdefault(name, now)
            else:
                self.findings.append(f"site {name} crashed (exit {rc}); see {proc.log_path}")
                self.requeue[name] = now + 0.5
        if now - self.t0 > SCHEDULE_DEADLINE_S:
            raise Stalled(f"still running after {SCHEDULE_DEADLINE_S} s")

    def finished(self):
        return not self.requeue and all(p.p.poll() == 0 for p in self.sites.values())

    def wait(self, cond, bound_s=None):
        """Poll cond() while supervising the sites; False when the run finished first (or bound_s passed)."""
        end = None if bound_s is None else time.monotonic() + bound_s
        while not cond():
            self.supervise()
            self.observe()
            if self.finished() or (end is not None and time.monotonic() > end):
                return False
            time.sleep(0.05)
        return True

    def observe(self, every_s=1.0):
        """What DARL acknowledged as committed and the rounds the aggregator announced, now."""
        if time.monotonic() - getattr(self, "_observed", 0.0) < every_s:
            return
        self._observed = time.monotonic()
        try:
            got = httpc.call(self.darl, "GET", "/custody?state=committed", token=self.agg_token, timeout=2)
            self.committed_seen |= {c["delta"] for c in got["custody"]}
            self.max_round_seen = max(self.max_round_seen,
                                      httpc.call(self.fedmom, "GET", "/round", token=self.token, timeout=2)["round"])
        except (OSError, http.client.HTTPException, httpc.CallError, ValueError):
            pass

    # -- faults
    def apply(self, f):
        if not self.wait(lambda: self.sends() >= f.after):
            return False
        if f.kind in ("darl_kill", "fedmom_kill", "blob_kill"):
            return self._kill_at(self.procs[f.kind.split("_")[0]], f)
        if f.kind == "fedmom_outage":
            self.procs["fedmom"].kill()
            self.wait(lambda: False, f.pause)
            self.restart("fedmom")
            return True
        if f.kind == "site_kill":
            return self._site_kill(f)
        if f.kind == "site_stop":
            return self._site_stop(f)
        if f.kind == "darl_flag":
            return self._darl_flag(f)
        if f.kind == "clock_step":
            with open(self.clock_file) as fh:
                now = float(fh.read().strip() or 0)
            with open(self.clock_file, "w") as fh:
                fh.write(str(now + f.value))
            self.procs["darl"].kill()
            self.restart("darl")
            return True
        if f.kind == "token_rotation":
            self._write_token()
            exits = self.token_exits
            self.procs["darl"].term()
            self.restart("darl")
            # the aggregator's calls (and the sites' DARL calls) get 401 meanwhile
            self.wait(lambda: self.token_exits > exits or "401" in self._fedmom_alarm(), bound_s=5.0)
            for name in ("fedmom", "blob"):
                self.procs[name].term()
                self.restart(name)
            return self.wait(lambda: self.token_exits > exits, bound_s=60)    # a site met the 401, requeued
        if f.kind == "stale_aggregator":
            return self._stale_aggregator(f)
        raise ValueError(f.kind)

    def _kill_at(self, proc, f):
        proc.arm(f.point, f.skip)
        reached = self.wait(lambda: proc.hit(f.point) or not proc.alive())
        if not reached:
            proc.disarm(f.point)
            return False
        proc.kill()
        proc.disarm(f.point)
        self.wait(lambda: False, f.pause)
        self.restart(proc.name)
        return True

    def _site_kill(self, f):
        proc = self.sites[f.target]
        proc.arm(f.point, f.skip)
        reached = self.wait(lambda: proc.hit(f.point) or f.target in self.requeue)
        proc.disarm(f.point)
        if not reached or f.target in self.requeue:
            return False
        self.requeue[f.target] = time.monotonic() + f.pause
        proc.kill()
        return True

    def _site_stop(self, f):
        proc = self.sites[f.target]
        proc.arm(f.point, f.skip)
        reached = self.wait(lambda: proc.hit(f.point) or f.target in self.requeue)
        if not reached or f.target in self.requeue:
            proc.disarm(f.point)
            return False
        proc.signal(signal.SIGSTOP)
        proc.release(f.point)                 # it goes on at once when continued
        reached = True
        if f.value == "newcomer":             # its lease expires; then someone new leases and trains those blocks
            t0 = time.monotonic()
            self.wait(lambda: False, TTL[1] + 0.5)
            name = f"newcomer{len(self.sites)}"
            self.start_site(name)
            # continued once the newcomer trained (the stopped site then meets the refusal), and
            # before the stopped site's membership times out (its delta would only be stale)
            reached = self.wait(lambda: self.trained(name), MEMBER_TIMEOUT_S - 1.0 - (time.monotonic() - t0))
        else:
            self.wait(lambda: False, 1.5 * TTL[1] + 1.0)
        proc.signal(signal.SIGCONT)
        # it has left the point before the next fault may arm it again (else it stays stopped
        # there, taking the new arming for the old one)
        self.wait(lambda: not proc.hit(f.point) or not proc.alive() or f.target in self.requeue)
        proc.disarm(f.point)
        return reached                        # a newcomer that never trained: its headline case not reached

    def _stale_aggregator(self, f):
        live = self.procs["fedmom"]
        live.term()
        src, copy = os.path.join(self.central, "fedmom"), os.path.join(self.dir, "fedmom-stale")
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(src, copy, ignore=shutil.ignore_patterns("lock"))
        with open(os.path.join(copy, "state.json")) as fh:
            copied = json.load(fh)["epoch"]
        self.restart("fedmom")
        deadline = time.monotonic() + 60          # the live one is issued its epoch first (sites done or not)
        while self._fedmom_epoch() <= copied:
            if time.monotonic() > deadline:
                self.findings.append(f"the restarted aggregator was not issued an epoch above {copied} in 60 s")
                return True
            self.supervise()
            time.sleep(0.05)
        port = pick_port()
        cmd = [copy if x == src else x for x in live.cmd]
        cmd[cmd.index("--port") + 1] = str(port)
        stale = Proc(self, "fedmom-stale", cmd)
        try:
            for i in range(f.value):
                stale.start(wait_url=False)
                try:
                    rc = stale.p.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    rc = None
                if rc != EXIT_FENCED:
                    self.findings.append(f"a stale copy of the aggregator's state (epoch {copied}) started beside "
                                         f"the live one was not fenced at start {i + 1} (exit {rc}); see "
                                         f"{stale.log_path}")
                    return True
        finally:
            stale.kill()
            with PORT_LOCK:
                PORTS_TAKEN.discard(port)
        return True

    def _fedmom_alarm(self):
        try:
            alarm = httpc.call(self.fedmom, "GET", "/status", token=self.token, timeout=5)["darl"]["alarm"]
        except (OSError, http.client.HTTPException, httpc.CallError, KeyError):
            return ""
        return (alarm or {}).get("error", "")

    def _fedmom_epoch(self):
        try:
            return httpc.call(self.fedmom, "GET", "/status", token=self.token, timeout=5)["epoch"]
        except (OSError, http.client.HTTPException, httpc.CallError, KeyError):
            return -1

    def _darl_flag(self, f):
        flag, value = f.value
        if self.darl_flags[flag] == value:
            value = value + 1
        self.procs["darl"].term()
        self.darl_flags[flag] = value
        refused = subprocess.run(self.darl_cmd(self.darl_port), cwd=ROOT, capture_output=True, text=True,
                                 timeout=60, env={**os.environ, testhooks.CLOCK_OFFSET_ENV: self.clock_file})
        if refused.returncode == 0 or flag not in refused.stderr + refused.stdout:
            self.findings.append(f"DARL restarted with {flag} {value} changed: not refused naming the flag "
                                 f"(exit {refused.returncode}: {(refused.stderr or refused.stdout)[-300:]})")
        self.restart("darl", self.darl_cmd(self.darl_port, accept=True))
        self.procs["darl"].cmd = self.darl_cmd(self.darl_port)     # later restarts: the new flags, logged
        return True

    def wait_end(self):
        self.wait(lambda: self.finished())
        ok = self.wait(lambda: self._settled(), bound_s=60)
        if not ok:
            self.findings.append("the aggregator never settled: commits or aborts still owed, or a delta pending")

    def _settled(self):
        self.supervise()
        try:
            st = httpc.call(self.fedmom, "GET", "/status", token=self.token, timeout=5)
            darl = httpc.call(self.darl, "GET", "/status", token=self.token, timeout=5)
        except (OSError, http.client.HTTPException, httpc.CallError):
            return False
        return st["pending_commits"] == 0 and st["pending_aborts"] == 0 and not st["pending"] and darl["done"]

    def stop(self):
        for p in self.sites.values():
            p.kill()
        for name in ("fedmom", "blob", "darl"):
            if name in self.procs and self.procs[name].alive():
                self.procs[name].term()
        for proc in self.procs.values():
            port = httpc.split_url(getattr(self, proc.name, "http://x:0"))[2]
            with PORT_LOCK:
                PORTS_TAKEN.discard(port)


class Stalled(Exception):
    pass


PORTS_TAKEN, PORT_LOCK = set(), threading.Lock()


def pick_port():
    """A free loopback port in PORTS that no running schedule of this process holds."""
    import socket
    with PORT_LOCK:
        for _ in range(1000):
            port = random.randrange(*PORTS)
            if port in PORTS_TAKEN:
                continue
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
            PORTS_TAKEN.add(port)
            return port
    raise RuntimeError(f"no free port in {PORTS}")


# ---------------------------------------------------------------- the oracle

def read_site_records(records_dir):
    out = []
    for fn in sorted(os.listdir(records_dir)):
        if fn.endswith(".jsonl"):
            out += durable.read_jsonl(os.path.join(records_dir, fn))
    return out


def oracle(run):
    """Everything the final state must satisfy; a list of findings (empty = no violation)."""
    out = list(run.findings)
    report = audit.audit(run.central)
    if not report.ok:
        out += [f"audit: {line}" for line in report.lines if line.startswith(("  !!", "FAIL"))]
    fed_dir = os.path.join(run.central, "fedmom")
    records = durable.read_jsonl(os.path.join(fed_dir, "rounds.jsonl"))
    events = read_site_records(run.records)
    trained = {(e["incarnation"], e["base_round"], e["lease"]): e for e in events if e["event"] == "trained"}
    positions = collections.Counter()
    merged = []
    for r in records:
        for o in r.get("outcomes", ()):
            if o["outcome"] != "merged":
                continue
            lease = o["leases"][0]
            site = trained.get((o["incarnation"], o["base_round"], lease["id"]))
            if site is None:
                out.append(f"round {r['round']} merged a delta no site sent: {o['cluster']} {o['incarnation']} "
                           f"base {o['base_round']} lease {lease['id']}")
                continue
            darl_pos = sorted(p for _, a, b in o.get("pieces") or () for p in range(a, b))
            if darl_pos != list(range(site["start"], site["end"])):
                out.append(f"round {r['round']}: {o['cluster']}'s delta trained positions [{site['start']}, "
                           f"{site['end']}), DARL's custody holds {darl_pos}")
            positions.update(range(site["start"], site["end"]))
            merged.append((r["round"], site, o))
    doubled = sorted(p for p, k in positions.items() if k > 1)
    if doubled:
        out.append(f"by the sites' own records, positions {doubled[:20]} are inside more than one merged delta")
    quarantined = {p for p, s in report.status.items() if s == "quarantined"}
    unmerged = sorted(set(range(run.s.blocks)) - set(positions) - quarantined)
    if report.status and unmerged:
        out.append(f"by the sites' own records, positions {unmerged[:20]} are inside no merged delta")
    ids = {(o.get("delta")) for _, _, o in merged}
    lost = sorted(run.committed_seen - ids)
    if lost:
        out.append(f"custody DARL acknowledged as committed is no longer a merged delta's: {lost[:5]}")
    for e in events:
        if e["event"] == "merged":
            rec = next((r for r in records if r["round"] == e["merged_into"]), None)
            if rec is None or not any(o["incarnation"] == e["incarnation"] and o["base_round"] == e["base_round"]
                                      and o["outcome"] == "merged" for o in rec["outcomes"]):
                out.append(f"{e['cluster']} was told its delta merged into round {e['merged_into']}; the round "
                           "records do not hold it")
    if records and run.max_round_seen > records[-1]["round"]:
        out.append(f"the aggregator announced round {run.max_round_seen}, its records end at {records[-1]['round']}")
    out += _theta_check(run, fed_dir, records, merged)
    return out


def _theta_check(run, fed_dir, records, merged):
    """theta_global against two replays of the recorded merges from the initial model, each
    merged delta read from the file its site wrote (an int4 one decoded by wire.py):
      - float32, by the aggregator's own rule (fedmom_merge.merge_files with the recorded
        weights, clip scales and momentum resets, then with --down-wire fedmom_merge.publish
        with the residual the last round left): theta, momentum and residual bit for bit,
        and every theta a site fetched (its digest) equal to the replay's of that round;
      - float64, the merge rule written out here (f32 aggregators: with --down-wire theta
        is theta_r + decode(encode(step)), within a residual of it, not near it)."""
    by_round = collections.defaultdict(list)
    for rnd, site, o in merged:
        by_round[rnd].append((site, o))
    for rec in records:
        if not by_round.get(rec["round"]):
            return [f"round {rec['round']} has no merged delta a site sent: cannot replay"]
    try:                        # rebuilt from its checkpoint and log, each round against its digest
        outer = fedmom_checkpoint.load_outer(fed_dir)
    except ValueError as e:
        return [f"the final theta_global cannot be read: {e}"]
    final = {k: {n: a.reshape(outer.shapes[n]) for n, a in getattr(outer, k).items()}
             for k in ("theta", "momentum", "residual") if getattr(outer, k) is not None}
    out = []
    with tempfile.TemporaryDirectory(prefix="replay-", dir=run.dir) as tmp:
        try:
            got, digests, why = _replay_f32(run, records, by_round, tmp)
        except Exception as e:          # records it cannot follow (a delta's entry missing, a bad file): a finding
            return [f"the float32 replay of the recorded merges failed: {type(e).__name__}: {e}"]
        out += why
        for what, arrays in final.items():
            want = got.get(what)
            bad = sorted(k for k in arrays if want is None or k not in want
                         or not np.array_equal(arrays[k].view(np.uint32), want[k].view(np.uint32)))
            if bad or (want is not None and set(want) != set(arrays)):
                out.append(f"{what} differs from the float32 replay of {len(records)} recorded merges by the "
                           f"aggregator's rule (--down-wire {run.s.down_wire}), bit for bit: tensors {bad}")
        if "residual" in got and "residual" not in final:
            out.append("the replay owes a residual; the aggregator's state names none")
    for e in read_site_records(run.records):
        if e["event"] == "theta" and digests.get(e["round"]) != e["digest"]:
            out.append(f"{e['cluster']} ({e['incarnation']}) fetched a theta_global of round {e['round']} (via "
                       f"{e['via']}) with digest {e['digest'][:12]}..., the replay's is "
                       f"{str(digests.get(e['round']))[:12]}...")
        if e["event"] == "update_mismatch":
            out.append(f"{e['cluster']} ({e['incarnation']}): {e['msg']}")
    if run.s.down_wire == "f32":
        out += _theta_check_f64(run, records, by_round, final["theta"])
    return out


def _read_f32(path):
    with tensorio.TensorReader(path) as r:
        return {k: np.asarray(r.read(k, as_float32=True), np.float32) for k in r.names}


def _replay_f32(run, records, by_round, tmp):
    """The aggregator's float32 rounds again, in files under tmp -> ({"theta", "momentum",
    "residual": arrays} after the last round, {round: wire.Digest of its theta}, findings)."""
    codec = None if run.s.down_wire == "f32" else wire.Codec(run.s.down_wire)
    theta, momentum, residual, why = run.init, None, None, []
    digests = {records[0]["round"] - 1 if records else 0: wire.theta_digest(run.init)}
    for i, rec in enumerate(records):
        rnd, batch = rec["round"], by_round[rec["round"]]
        paths = []
        for j, (site, o) in enumerate(batch):
            path = os.path.join(run.records, site["file"])
            if wire.is_wire(path):
                plain = os.path.join(tmp, f"decoded-{rnd}-{j}.safetensors")
                wire.decode_file(path, plain, fsync=False)
                path = plain
            paths.append(path)
        total = sum(o["tokens"] for _, o in batch)
        shares = [o["tokens"] / total for _, o in batch]
        entry = {c["incarnation"]: c for c in rec["clusters"].values()}
        norms = [entry[o["incarnation"]]["delta_norm"] for _, o in batch]
        history = [c["delta_norm"] for r in records[max(0, i - fedmom_records.CLIP_HISTORY_ROUNDS):i]
                   for c in r.get("clusters", {}).values() if c.get("delta_norm")]
        scales, _ = fedmom_merge.clip_scales(norms, history, rec["clip"]["factor"])
        recorded = [entry[o["incarnation"]]["clip_scale"] for _, o in batch]
        if [round(c, 6) for c in scales] != recorded:
            why.append(f"round {rnd}: the clip scales {recorded} recorded are not the rule's {scales}")
        merged = os.path.join(tmp, f"merged-{rnd}.safetensors")
        mom = os.path.join(tmp, f"momentum-{rnd}.safetensors") if rec["outer_momentum"] > 0 else None
        fedmom_merge.merge_files(theta, None if rec.get("momentum_reset") else momentum,
                                 [(p, w * c) for p, w, c in zip(paths, shares, scales)], merged, mom,
                                 rec["outer_lr"], rec["outer_momentum"], fsync=False)
        momentum = mom
        if codec is not None:
            new, res = os.path.join(tmp, f"theta-{rnd}.safetensors"), os.path.join(tmp, f"residual-{rnd}.safetensors")
            fedmom_merge.publish(theta, merged, residual, codec, new, os.path.join(tmp, f"update-{rnd}.safetensors"),
                                 res, fsync=False)
            theta, residual = new, res
        else:
            theta = merged
        digests[rnd] = wire.theta_digest(theta)
    got = {"theta": _read_f32(theta)}
    if momentum:
        got["momentum"] = _read_f32(momentum)
    if residual:
        got["residual"] = _read_f32(residual)
    return got, digests, why


def _theta_check_f64(run, records, by_round, final):
    """theta_global against a float64 replay of the recorded merges, the rule written out."""
    with tensorio.TensorReader(run.init) as r:
        theta = {k: r.read(k, as_float32=True).astype(np.float64) for k in r.names}
    buf = None
    for rec in records:
        batch = by_round[rec["round"]]
        total = sum(o["tokens"] for _, o in batch)
        g = {k: np.zeros_like(v) for k, v in theta.items()}
        for site, o in batch:
            with wire.WireReader(os.path.join(run.records, site["file"])) as r:
                for k in g:
                    g[k] -= (o["tokens"] / total) * r.read(k).astype(np.float64)
        buf = g if buf is None else {k: MU * buf[k] + g[k] for k in g}
        theta = {k: theta[k] - LR * (g[k] + MU * buf[k]) for k in theta}
    got = {k: v.astype(np.float64) for k, v in final.items()}
    err = max(float(np.max(np.abs(got[k] - theta[k]) / (1.0 + np.abs(theta[k])))) for k in theta)
    return [] if err < 1e-5 else [f"theta_global differs from the float64 replay of {len(records)} recorded merges "
                                  f"(max relative error {err:.2e})"]


# ---------------------------------------------------------------- running schedules

@dataclasses.dataclass
class Result:
    seed: int
    findings: list
    injected: collections.Counter
    armed: collections.Counter
    rounds: int = 0
    quarantined: int = 0
    seconds: float = 0.0
    workdir: str = ""
    seen: collections.Counter = dataclasses.field(default_factory=collections.Counter)   # site events by kind
    kinds: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # sites by kind


SITE_EVENTS = ("sent", "merged", "excluded", "refused", "stale", "lost", "unknown")


def run_schedule(seed, work_root, keep=False, sched=None):
    """Run one schedule (make_schedule(seed), or `sched`) under work_root; a Result."""
    sched = sched or make_schedule(seed)
    workdir = tempfile.mkdtemp(prefix=f"seed{seed}-", dir=work_root)
    run = Run(sched, workdir)
    injected, armed = collections.Counter(), collections.Counter()
    t0 = time.monotonic()
    try:
        run.start_servers()
        for name, _ in sched.sites:
            run.start_site(name)
        for f in sched.faults:
            armed[f.kind] += 1
            if run.apply(f):
                injected[f.kind] += 1
        run.wait_end()
    except Stalled as e:
        run.findings.append(f"STALLED: {e}")
    except Exception as e:          # the harness itself failed: a finding, with the schedule to replay it
        run.findings.append(f"harness error: {type(e).__name__}: {e}")
    finally:
        run.stop()                  # also on Interrupted, which then goes on up
    findings = run.findings if any(f.startswith("harness error") for f in run.findings) else oracle(run)
    recs = durable.read_jsonl(os.path.join(run.central, "fedmom", "rounds.jsonl"))
    report_q = 0
    if not findings:
        report_q = sum(1 for s in audit.audit(run.central).status.values() if s == "quarantined")
    seen = collections.Counter(e["event"] for e in read_site_records(run.records) if e["event"] in SITE_EVENTS)
    seen["incarnations"] = sum(1 for e in read_site_records(run.records) if e["event"] == "start")
    events = read_site_records(run.records)
    seen["trained_in_flight"] = sum(1 for e in events if e["event"] == "trained" and e.get("while_in_flight"))
    sent = {(e["incarnation"], e["base_round"], e["lease"]) for e in events if e["event"] == "sent"}
    seen["sent_int4"] = sum(1 for e in events if e["event"] == "trained" and e.get("wire") == "int4"
                            and (e["incarnation"], e["base_round"], e["lease"]) in sent)
    for e in events:
        if e["event"] == "theta":
            seen[f"theta_via_{e['via']}"] += 1
    names = [n for n, _ in sched.sites]
    kinds = collections.Counter(f32=sum(n not in sched.int4 for n in names), int4=sum(n in sched.int4 for n in names),
                                overlapped=sum(n in sched.overlapped for n in names),
                                down_wire_int4=int(sched.down_wire == "int4"))
    res = Result(seed, findings, injected, armed, len(recs), report_q, time.monotonic() - t0, workdir, seen, kinds)
    if not findings and not keep:
        shutil.rmtree(workdir, ignore_errors=True)
    return res


def describe_failure(res, sched=None):
    return "\n".join([f"VIOLATION in seed {res.seed} (kept: {res.workdir}); replay with "
                      f"`python bench/fault_schedule.py --replay {res.seed}`:",
                      (sched or make_schedule(res.seed)).describe()] + [f"  !! {x}" for x in res.findings])


def main(argv):
    """The fake site's process (Run.start_site starts this file with `site ...`)."""
    if argv[:1] != ["site"]:
        raise SystemExit("fault_harness.py is started by itself as a fake site (`site ...`); the fault schedules "
                         "run from bench/fault_schedule.py")
    p = argparse.ArgumentParser(prog="fault_harness.py site")
    for flag in ("--cluster", "--darl", "--fedmom", "--blob", "--token-file", "--records", "--transport"):
        p.add_argument(flag, required=True)
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--span", type=int, required=True)
    p.add_argument("--train-s", type=float, default=0.15)
    p.add_argument("--phase-s", type=float, default=0.5)
    p.add_argument("--careless", action="store_true", help="send without checking the lease first")
    p.add_argument("--overlap", action="store_true",
                   help="train the next span while the delta's round trip runs (train.py --overlap)")
    p.add_argument("--wire", choices=("f32", "int4"), default="f32",
                   help="the deltas' wire format (train.py --wire): int4 with error feedback")
    return site_main(p.parse_args(argv[1:]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
