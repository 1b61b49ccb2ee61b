"""fault_site.py - a fake site of the fault schedules: the round protocol of train.py's FedSite
on the real clients, without torch, training nothing.

Runs on: this machine (CPU; Python + numpy, never torch), as a process that
fault_harness.Run starts, one per incarnation of a site (a killed site is requeued as a
new one); never by hand:

    python -m testbed.fault_site --cluster alpha --darl URL --fedmom URL --blob URL --token-file F \
        --records DIR --transport inline --seed 7 --span 2 [--careless] [--overlap] [--wire int4] \
        [--step-s 0.12]

It leases spans from DARL over the real darl_client.LeaseSession, sends a small seeded
random delta for each real lease over the real fedmom_client.FedMomClient (inline or through
the blob store), waits for the delta's outcome and settles the lease as FedSite does, and
records every step as one JSON line in <records>/<cluster>-<incarnation>.jsonl (what it
trained, sent, was told; the exit code), which fault_oracle.py reads. It stops at the fault
points site.trained, site.checked, site.sent and (fedsite.Follow's) site.follow
(testhooks.py) where the schedule arms them.

Kinds of site (chosen by the schedule): a careless one skips the lease check before sending,
as an older client would (the servers must be safe whatever a site does); an overlapped one
keeps train.py --overlap's order (a delta's round trip on a thread while the next span is
leased and "trained", that span's delta then naming as its base the round the trip ended
on); an int4 one sends int4 deltas with error feedback (wire.WireWriter, as train.py --wire
int4); a time-budgeted one (--step-s, train.py --diloco-phase-s under the aggregator's
--phase-s offer) sizes each lease from that offer and its measured step time, and when its
clock runs out first trains only a prefix of the span and trims it (LeaseSession.trim: the
tail back to DARL's pool, the delta naming the prefix only; PhaseClock). Every site holds
theta_global as a real site's rank 0 does, with fedsite.FedSite's own code: once its delta
is in it follows the next round's update while it is merged (fedsite.Follow), and adopts
the theta built only if its digest is the durable round's (the heartbeat's "update"); else
it downloads the update, or on 409 no_update the whole theta. It notes each theta it holds
and the digest of the one each span trained from. A token
the servers refuse (401; 403: its credential revoked) ends it with EXIT_TOKEN, and the harness requeues it with the new
token.
"""
import argparse
import dataclasses
import http.client
import json
import math
import os
import secrets
import sys
import threading
import time
import types
import zlib

import numpy as np

import darl_client
import fedmom_client
import fedsite
import httpc
import tensorio
import testhooks
import wire

SHAPES = {"w": (48,), "b": (4, 3)}   # the model: the deltas here, the initial theta the harness writes
EXIT_TOKEN = 3                    # a fake site's exit status when a server refused its token
CALL_S = 180.0                    # a fake site's call to a server: s without progress before it gives up


def delta_arrays(seed, incarnation, lease, start, base):
    rng = np.random.default_rng([seed, int(incarnation, 16), lease, start, base])
    return {k: (0.01 * rng.standard_normal(s)).astype(np.float32) for k, s in SHAPES.items()}


INT4 = wire.Codec("int4")           # a site's --wire int4, default block


class Residual:
    """An int4 site's error feedback, error_feedback.Residual's rules in memory (a new incarnation
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
    code: with the aggregator's --down-wire, a site whose delta is in follows the next
    round's update as it is merged (fedsite.Follow.start) and adopts the theta built
    once the round is durable, if its digest is the heartbeat's (Follow.adopt); else (or
    with no follow) a site holding the previous round downloads the
    update (GET /theta_update, or /theta_update_blob for a blob site) and adds it, checked by
    the digest the aggregator published (wire.apply_update); else (409 no_update: new,
    behind, or an f32 aggregator) it downloads the whole theta. Each fetch is noted with
    its round, how it came and the digest of what the site now holds; the oracle checks
    that digest against its replay of that round. An update that failed its digest (FedSite
    logs it and falls back to the whole theta) is noted as update_mismatch: a finding."""

    def __init__(self, a, fed, inc, note):
        cfg = types.SimpleNamespace(cluster=a.cluster, token_file=a.token_file, darl_url=a.darl, ca_file=None,
                                    federation=a.fedmom, blob_url=a.blob, transport=a.transport)
        self.site = fedsite.FedSite(cfg, None, 0, self._log, retry_s=CALL_S)
        self.site.fed, self.site.theta_transport = fed, a.transport
        self.following = None            # the round whose update FedSite's Follow builds now, if any
        home = os.path.join(a.records, "theta", f"{a.cluster}-{inc}")    # a site's own dir: FedSite puts
        os.makedirs(home, exist_ok=True)                                 # the update beside theta
        self.path = os.path.join(home, "theta.safetensors")
        self.note, self.round = note, None

    def _log(self, msg):
        self.note("update_mismatch" if msg.startswith("!!!") else "site_log", msg=msg)

    def follow(self, base):
        """The delta is in: follow round base + 1's update while it is merged
        (fedsite.Follow.start, after site.sent as in FedSite.round_trip; none unless we hold `base`)."""
        self.site.follow = fedsite.Follow.start(self.site, base, self.path)
        self.following = base + 1 if self.site.follow is not None else None

    def heard(self, reply):
        """A heartbeat reply: its "update" (the durable round's digests) is what Follow.adopt compares."""
        self.site.last_update = reply.get("update")

    def fetch(self):
        """Download theta_global now, as FedSite does at the end of every round trip -> its round:
        the followed theta adopted when its digest is the durable round's (Follow.adopt), else
        the update or the whole theta; a follow not adopted is noted as discarded."""
        followed, self.following = self.following, None
        self.round = _call("theta", lambda d: self.site._fetch(self.path, d))
        via = self.site.down.get("via")
        self.note("theta", round=self.round, via=via, digest=self.site.held[1],
                  **({"follow_discarded": followed} if followed is not None and via != "followed" else {}))
        return self.round

    def current(self):
        """The round of the theta held, fetched first if the aggregator has moved past it
        (a phase trains from the newest theta it can get)."""
        if self.round is None or _call("round", lambda d: self.site.fed.current_round(deadline=d)) != self.round:
            self.fetch()
        return self.round


class PhaseClock:
    """A time-budgeted site's phases (--step-s), fedphase.Cadence's rule without its measured
    send time: a phase that starts `age` s into the open round (the last reply that said
    it) may spend T - age, T with --overlap or no age known, never below MIN_SHARE x T; T is
    the aggregator's --phase-s offer (the join reply). The lease is sized from that budget
    over the measured step time, one fake step per block. Each step sleeps the site's step
    time x the phase's speed, drawn per site from the seed (every incarnation replays its
    site's speeds): a SLOW share of phases run 1.5-2.5x slow, as on a shared node. After a
    step, if the next one would overrun the budget, the phase ends on that block boundary:
    the rest of the span goes back to DARL (LeaseSession.trim) and the delta names the
    prefix (data.LeasedPhase.cut_point's rule)."""
    MIN_SHARE, SLOW = 0.25, 0.4

    def __init__(self, a, phase_s):
        if not phase_s:
            raise SystemExit(f"fault_site.py --step-s: the aggregator offers no --phase-s ({phase_s!r}); a "
                             "time-budgeted site needs one (fault_harness starts it with the schedule's phase_s)")
        self.a, self.phase_s, self.step_s = a, float(phase_s), a.step_s
        self.rng = np.random.default_rng([a.seed, zlib.crc32(a.cluster.encode())])
        self.est = None                 # measured s per step, running mean over phases
        self.age = fedsite.RoundAge()   # how long the open round has been open, from the last reply
        self.heard = self.age.heard

    def budget(self, held_round):
        age = None if self.a.overlap else self.age.of(held_round)
        if age is None:
            return self.phase_s
        return max(self.phase_s - age, self.MIN_SHARE * self.phase_s)

    def plan(self, session, held_round):
        """Before the lease: size the next span from the budget (--span until a step was measured)."""
        blocks = self.a.span if self.est is None else max(1, math.floor(self.budget(held_round) / self.est))
        session.span_blocks = session.lease_blocks = blocks

    def run(self, session, span, held_round):
        """The phase's fake steps -> (the span trained, trimmed where the clock ended it; its figures)."""
        budget = self.budget(held_round)
        speed = self.rng.uniform(1.5, 2.5) if self.rng.random() < self.SLOW else self.rng.uniform(0.8, 1.05)
        t0, n, cut = time.monotonic(), 0, None
        while True:
            time.sleep(self.step_s * speed * self.rng.uniform(0.9, 1.1))
            n += 1
            elapsed = time.monotonic() - t0
            if n >= len(span):
                break
            if elapsed + elapsed / n > budget:
                cut = span.start + n
                break
        self.est = elapsed / n if self.est is None else 0.5 * self.est + 0.5 * elapsed / n
        figures = {"steps": n, "step_s": elapsed / n, "inner_s": elapsed, "budget_s": budget,
                   "ended_by": "lease" if cut is None else "clock"}
        if cut is not None:
            span = _call("trim", lambda d: session.trim(span, cut, deadline=d))
        return span, figures


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
        except httpc.CallError as e:      # a 401 or 403 from any call: the token was rotated or revoked
            if e.status not in (401, 403):
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
    inside it, as for a real site. A 401 or 403 is TokenRefused."""
    try:
        return fn(httpc.Deadline(CALL_S, what=what, max_wait_s=0.2, log=httpc.quiet))
    except httpc.CallError as e:
        if e.status in (401, 403):
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
    joined = member.join()
    a.clock = None
    if a.step_s:
        a.clock = PhaseClock(a, joined.get("phase_s"))
        member.heard = a.clock.heard
        a.clock.heard(joined)
    a.theta, a.residual = SiteTheta(a, fed, inc, note), Residual() if a.wire == "int4" else None
    a.theta.site.publishes = joined.get("down_wire", "f32") != "f32"     # as FedSite.join: no follow with f32
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
    FedMom while a trip is in flight. A time-budgeted site sizes each lease before asking
    for it (PhaseClock.plan)."""
    flight = None                                  # (thread, box) of the round trip in flight
    planned = False
    while True:
        if a.clock is not None and not planned:
            a.clock.plan(session, a.theta.round)
            planned = True
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
            if e.status in (401, 403):
                raise TokenRefused(f"DARL: {e}")
            raise
        if span is None:
            break
        planned = False
        in_flight = flight is not None and flight[0].is_alive()
        if flight is None:
            if not member.member:
                member.join()
            if not a.overlap:
                _phase(a, fed, member, session, span, note)
                continue
            base = a.theta.current()
        span, steps = _steps(a, session, span, None)   # "train" span k+1 while delta k is in flight
        if flight is not None:
            base = _join(flight)
        done = _train(a, session, span, base, note, steps, while_in_flight=in_flight)
        testhooks.fault_point("site.trained")
        box = {}
        t = threading.Thread(target=_trip, args=(a, fed, member, session, span, done, note, box), daemon=True)
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
        self.heard = lambda reply: None          # a time-budgeted site's PhaseClock.heard

    def join(self):
        reply = _call("join", lambda d: self.fed.join(deadline=d))
        self.heard(reply)
        self.member = True
        if self.keepalive is None:
            self.keepalive = self.fed.keepalive(interval_s=0.5)
            self.keepalive.__enter__()
        return reply

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
    """Train (sleep, or a time-budgeted site's steps), send the delta for `span` (or for the
    part of it the clock left), learn what became of it, settle the lease."""
    base = a.theta.current()
    span, steps = _steps(a, session, span, base)
    done = _train(a, session, span, base, note, steps)
    testhooks.fault_point("site.trained")
    _round_trip(a, fed, member, session, span, done, note)


def _steps(a, session, span, base):
    """A phase's "training" -> (the span trained, the phase's figures): a plain site sleeps
    --train-s (no figures); a time-budgeted one takes its steps (PhaseClock.run), and the
    span comes back trimmed where its clock ended it."""
    if a.clock is None:
        time.sleep(a.train_s)
        return span, None
    cut, figures = a.clock.run(session, span, base)
    return cut, {**figures, "trimmed": span.end if cut.end < span.end else None}


@dataclasses.dataclass
class Trained:
    """A span's delta, written: what the notes name it by, its file, its tokens, its metrics."""
    key: dict
    path: str
    tokens: int
    metrics: dict


def _train(a, session, span, base, note, steps=None, **extra):
    key = dict(lease=span.lease, start=span.start, end=span.end, base_round=base)
    path = os.path.join(a.records, f"{a.cluster}-{session.incarnation}-l{span.lease}-s{span.start}-r{base}.safetensors")
    arrays = delta_arrays(a.seed, session.incarnation, span.lease, span.start, base)
    if a.residual is not None:
        a.residual.write(path, arrays, base)
    else:
        write_tensors(path, arrays)
    tokens = 100 * len(span)
    metrics = {"loss": 1.0}
    if steps is not None:            # a time-budgeted phase: its figures go with the delta, as train.py's do
        extra.update(trimmed=steps["trimmed"], ended_by=steps["ended_by"], budget_s=round(steps["budget_s"], 3))
        metrics.update({k: v for k, v in steps.items() if k != "trimmed"})
    # the bits this span "trained" from, read from the file: the oracle checks them against the
    # durable round `base` (a followed theta adopted before its round was durable would differ)
    note("trained", file=os.path.basename(path), tokens=tokens, wire=a.wire, held_digest=wire.theta_digest(a.theta.path),
         **key, **extra)
    return Trained(key, path, tokens, metrics)


def _trip(a, fed, member, session, span, done, note, box):
    """An overlapped site's round trip (its thread): box["out"], the round it ended on, or box["err"]."""
    try:
        box["out"] = _round_trip(a, fed, member, session, span, done, note)
    except BaseException as e:
        box["err"] = e


def _round_trip(a, fed, member, session, span, done, note):
    """Check the lease, send, wait for the outcome, settle the lease and the residual,
    download theta_global (as FedSite.round_trip) -> the round of that theta."""
    state = _send_and_wait(a, fed, member, session, span, done, note)
    if a.residual is not None:
        a.residual.settle(state)
    return a.theta.fetch()


def _send_and_wait(a, fed, member, session, span, done, note):
    """-> what became of the delta: merged, unknown, or another word for not merged."""
    key, base = done.key, done.key["base_round"]
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
        reply = _call("send", lambda d: fed.send_delta(done.path, base, done.tokens, [record], done.metrics,
                                                       transport=a.transport, deadline=d))
    except fedmom_client.StaleRound as e:
        note("stale", why=str(e), **key)
        _call("release", lambda d: session.release(span, deadline=d))
        return "stale"
    except httpc.CallError as e:
        if e.status in (401, 403):
            raise TokenRefused(f"send: {e}")
        note("refused", status=e.status, code=e.reply.get("code"), why=e.reply.get("error"), **key)
        _call("release", lambda d: session.release(span, deadline=d))
        return "refused"
    note("sent", custody=reply.get("custody"), duplicate=bool(reply.get("duplicate")), **key)
    testhooks.fault_point("site.sent")
    a.theta.follow(base)
    while True:
        got = _call("outcome", lambda d: fed.heartbeat(wait_round_after=base, wait_s=1.0, deadline=d))
        member.heard(got)
        a.theta.heard(got)
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


def main(argv):
    """One incarnation of a fake site (Run.start_site starts this file)."""
    p = argparse.ArgumentParser(prog="python -m testbed.fault_site", description="a fake site of fault_harness.py's schedules "
                                "(started by the harness; the schedules run from bench/fault_schedule.py)")
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
    p.add_argument("--step-s", type=float, default=None,
                   help="a time-budgeted site: each fake inner step (one block) takes about this many s, each "
                        "phase the aggregator's --phase-s offer (PhaseClock; default: none, --train-s a span)")
    return site_main(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
