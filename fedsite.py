"""fedsite.py - the site side of the round protocol: rank 0's DARL leases, FedMom membership
and each delta's round trip, and the leased windows every rank derives from them.

Runs on: compute nodes, inside `train.py --federation`; on its own only as the central check
(`python fedsite.py check`: the job's calls, clients and environment, from a compute node).
FedSite lives on global rank 0 only; LeasedSource on every rank. Torch-free (stdlib, numpy,
darl_client, fedmom_client, data, wire): the collectives that share rank 0's answers are
fedphase.on_rank0's, called by fedphase.py, the torch half of a site's round. No port, no
state of its own: the delta and theta files are the carrier's (runs/<run>/federation/).

Callers: fedphase.py's loop and its FedMomCarrier, in this order per run:
    site = FedSite(cfg, windows, model_bytes, log)            # rank 0
    block_size, seed, _, outer, phase_s = on_rank0(lambda: site.connect(per_step))
    source = LeasedSource(cfg, windows, block_size, seed, rank, world)
    while (span := on_rank0(lambda: site.next_span())) is not None:
        phase = source.phase(*span)                            # every rank, no traffic
        ... train phase.steps steps, write the checkpoint ...
        carrier's outer step -> on_rank0(lambda: site.round_trip(delta, base, handoff, theta))
    on_rank0(lambda: site.finish())
With --overlap the carrier calls site.start_round_trip(...) instead (the same round trip
on a Background thread), the loop asks next_span(busy) while it runs, and the carrier's
settle() waits for it once it has ended or at the next phase's end (--overlap-fold).
Once its delta is in, round_trip follows the next round's update while it is merged (Follow)
and adopts the theta built only once the round is durable with that digest (Follow.adopt).
Under --encode-on device the carrier passes defer_update=True: an int8/int4/int2 update comes
back unapplied (RoundResult.update) for the devices, then site.check_behind(theta) checks the
file's addition and digest on a thread the next round_trip and fetch_theta join first.
Every method that can wait is a generator that yields while it waits: on_rank0 turns each
yield into a small broadcast, so the other ranks never sit in one collective long enough
to time out. Each call to the central VM gets ONE httpc.Deadline, made here (FedSite._call):
httpc.RETRY_S (900 s) without progress, --register-wait-s for the first register and join.

The protocol these calls follow: FEDERATION_GUIDE.md, "Identity", "Leases (DARL)", "A round,
from the site's side" (with "Overlap" and "What a site repeats, and for how long"); the path
of a delta through fedphase.py, diloco.py, here and fedmom_client.py: ARCHITECTURE.md, "The
path of one delta".
"""
import argparse
import dataclasses
import http.client
import math
import os
import re
import secrets
import sys
import tempfile
import threading
import time

import blob_client
import block_space
import darl_client
import data
import durable
import fedmom_client
import httpc
import tensorio
import testhooks
import wire

SETTLE = "settle"           # next_span under --overlap: the round trip ended before DARL gave a span
POLL_S = 5.0                # rank 0 reports "still waiting" to the other ranks this often
OVERLAP_POLL_S = 0.2        # --overlap: how often a wait for a span looks whether the round trip ended
MIX_BLOCKS = 8              # a timed phase's runs of positions shuffled together (small steps only)
MORE_WAIT_S = 2.0           # a phase measured in time waits this long for one more span, then ends
TRANSPORT_ERRORS = (OSError, http.client.HTTPException)


class CorpusMismatch(ValueError):
    """This site's manifest gives another block space than the coordinator's: the run cannot
    start (train.py reports it like a flag error)."""


@dataclasses.dataclass
class Handoff:
    """What a finished phase hands over with its delta: the tokens it trained (the merge
    weight), its metrics (sent to the aggregator; None values are dropped) and the step
    of the phase's last optimizer step, at which the local checkpoint was written
    before the delta left."""
    tokens: int
    metrics: dict
    step: int


@dataclasses.dataclass
class RoundResult:
    """What became of one delta. round: the theta_global the site now holds (the newest,
    whatever became of the delta); merged_into: the round it went into, when merged;
    reason: why not, otherwise. The span it trained, and the Handoff's step and tokens,
    come back with it; theta_via ("update" or "full"), down_bytes and down_s say how the
    new theta_global came down (FedSite.fetch_theta). update: the path of an int8/int4/int2
    update downloaded but not applied (round_trip(defer_update=True)): the caller adds it
    to the theta it holds on its devices, then calls FedSite.check_behind; None when the
    theta file was brought up to date here."""
    base_round: int
    round: int = None
    merged: bool = False
    merged_into: int = None
    reason: str = None
    lease: int = None
    start: int = None
    end: int = None
    step: int = None
    tokens: int = None
    send_s: float = 0.0
    wait_s: float = 0.0
    theta_via: str = None
    down_bytes: int = None
    down_s: float = 0.0
    update: str = None
    sent_at: float = None        # time.monotonic() when the aggregator accepted the delta (None: not sent)
    spans: list = None           # (lease, start, end) of every span the phase trained (lease..end: the first and last)
    waiting_on: list = None      # the members the round still waited for, as the last wait saw them


class RoundAge:
    """How long the open round has been open: each aggregator reply says (round, round_age_s)
    as it was made; the monotonic clock adds what passed since."""

    def __init__(self):
        self.last = None             # (round, its age in s, time.monotonic() then)

    def heard(self, reply):
        if isinstance(reply.get("round_age_s"), (int, float)):
            self.last = (reply["round"], float(reply["round_age_s"]), time.monotonic())

    def of(self, rnd):
        """Seconds round `rnd` has been open now (from the last reply that saw it open), or None."""
        if self.last is None or self.last[0] != rnd:
            return None
        return self.last[1] + time.monotonic() - self.last[2]


class FedSite:
    """Rank 0's side of a federated site: one DARL LeaseSession (this stream's leases),
    FedMom membership, and the round trip of each delta.

    cfg: train_config.Config (reads cluster, federation, darl_url, blob_url, token_file,
    transport, data, diloco_inner_steps, register_wait_s). windows: the site's
    data.TokenWindows. model_bytes picks the transport of theta under --transport auto.

    Lease lifecycle (FEDERATION_GUIDE.md, "Leases (DARL)"): the site never commits in DARL.
    Accepted: the aggregator takes the span into custody at DARL, out of reach of our
    TTL, steals and releases; the session's heartbeats see the lease "done" and drop it.
    Merged: the aggregator commits that custody. Not merged: the site releases the lease
    (what is still the site's goes back to the pool). Unknown: the site lets go and the
    aggregator decides.
    """

    def __init__(self, cfg, windows, model_bytes, log, retry_s=httpc.RETRY_S):
        self.cfg, self.windows, self.log, self.retry_s = cfg, windows, log, retry_s
        self.cluster, self.incarnation = cfg.cluster, secrets.token_hex(6)
        if getattr(cfg, "proxy", None):
            httpc.set_proxy(cfg.proxy, "--proxy")    # every later connection of this process
        token = httpc.load_token(cfg.token_file)
        self.darl = darl_client.LeaseClient(cfg.darl_url, token=token, ca_file=cfg.ca_file)
        self.fed = fedmom_client.FedMomClient(cfg.federation, self.cluster, self.incarnation, token=token,
                                              blob_url=cfg.blob_url, ca_file=cfg.ca_file)
        self.theta_transport = "blob" if cfg.transport == "blob" or (
            cfg.transport == "auto" and cfg.blob_url and model_bytes >= fedmom_client.AUTO_BLOB_BYTES) else "inline"
        self.session, self.span, self.keepalive, self.member = None, None, None, False
        self.spans = []              # every span of the phase now training (the last: self.span)
        self._said = {}
        self.held = None             # (round, wire.Digest) of the theta file we hold, once known
        self.down = {}               # how the last theta came: {"via": "update" | "full", "bytes": n}
        self.deferred = None         # (round, digest, update path): downloaded, applied by the caller
        self.checking = None         # the Background of check_behind, until joined
        self.follow, self.publishes = None, True    # Follow: the next theta built during the merge; join says if any
        self.last_update = None      # the heartbeat's {"round", "base_digest", "digest"} of the durable update
        self.seen = {}               # the last round's exchange as this site saw it: sent with the next delta
        self.phase_s = None          # the aggregator's offered cadence (fedmom_server.py --phase-s), if any
        self.age = RoundAge()        # how long the open round has been open, from the last reply

    def say(self, msg, every_s=0.0):
        """Log a repeated waiting message at most once per every_s seconds (per message kind:
        the text before its first "(" or digit)."""
        kind = re.split(r"[(0-9]", msg, maxsplit=1)[0]
        if time.monotonic() - self._said.get(kind, -math.inf) >= every_s:
            self._said[kind] = time.monotonic()
            self.log(msg)

    def _deadline(self, what, seconds=None):
        """The one Deadline of a call: `seconds` (default retry_s) without progress; every
        repeat under it is said at most every 10 s."""
        return httpc.Deadline(self.retry_s if seconds is None else seconds, what=what, log=self._said_retry)

    def _said_retry(self, what, err, left):
        if isinstance(err, httpc.CallError) and err.reply.get("code") == httpc.INCARNATION_CONFLICT:
            server = "DARL: {!r} is still held by the previous incarnation; waiting for the previous " \
                     "incarnation's leases to expire" if what.startswith("DARL") else \
                     "FedMom: {!r} is still live as the previous incarnation; waiting for it to time out"
            self.say(f"{server.format(self.cluster)} ({left:.0f} s left)", every_s=10.0)
        else:
            self.say(f"{what}: {err}; retrying ({left:.0f} s left)", every_s=10.0)

    def _call(self, what, fn, seconds=None):
        """fn(deadline) with this call's one Deadline (_deadline), on a thread while this yields
        every POLL_S: a theta download or a delta upload may outlast the process group's
        timeout, the other ranks' polls do not. The client under fn repeats what fails."""
        deadline = self._deadline(what, seconds)
        return (yield from _in_background(lambda: fn(deadline)))

    # -- start: the block space, DARL registration, FedMom membership
    def connect(self, per_step):
        """-> (block size, seed, blocks per phase) of the coordinator's space, checked
        against our own manifest, and the aggregator's outer step as its join answer gives it
        ({"lr", "momentum", "nesterov"}; None from an aggregator that does not say it);
        registered at DARL, a member at FedMom."""
        self.log(f"central VM route: {httpc.route(self.cfg.darl_url).describe()}")
        st = yield from self._call("DARL status", lambda d: self.darl.status(deadline=d))
        sp = st["space"]
        space = block_space.BlockSpace(self.windows.train_windows, sp["block_size"], sp["seed"],
                                       manifest_digest=self.windows.digest)
        if space.digest() != st["digest"]:
            raise CorpusMismatch(f"--data {self.cfg.data}: this corpus gives block space {space.describe()}, "
                                 f"the coordinator has {sp}; start darl_server.py --manifest with the same "
                                 "manifest.json (both sides tokenized alike: same digest)")
        blocks = data.blocks_per_phase(self.cfg.diloco_inner_steps, per_step, sp["block_size"])
        self.session = darl_client.LeaseSession(
            self.darl, self.cluster, space.digest(), incarnation=self.incarnation, span_blocks=blocks,
            lease_blocks=blocks, prefetch=False, log=lambda m: self.log(f"darl: {m}"))
        yield from self._call("DARL register", lambda d: self.darl.register(
            self.cluster, self.incarnation, space.digest(), deadline=d), self.cfg.register_wait_s)
        self.session.start(register=False)
        reply = yield from self.join()
        self.log(f"site {self.cluster} (incarnation {self.incarnation}): DARL {space.num_blocks} blocks of "
                 f"{sp['block_size']} windows, {blocks} per phase; FedMom round {self.fed_round}")
        return sp["block_size"], sp["seed"], blocks, reply.get("outer"), self.phase_s

    def join(self):
        """Join FedMom's rounds, waiting up to --register-wait-s (a previous incarnation
        timing out, the aggregator unreachable); start the keepalive."""
        reply = yield from self._call("FedMom join", lambda d: self.fed.join(deadline=d), self.cfg.register_wait_s)
        self.fed_round, self.member = reply["round"], True
        self.phase_s, self.publishes = reply.get("phase_s"), reply.get("down_wire", "f32") != "f32"
        self.age.heard(reply)
        if self.keepalive is None:
            self.keepalive = self.fed.keepalive()
            self.keepalive.__enter__()
        return reply

    def round_age(self, rnd):
        return self.age.of(rnd)

    def leave(self):
        if self.keepalive is not None:
            self.keepalive.__exit__(None, None, None)
            self.keepalive = None
        if self.member:
            self.member = False
            try:
                self.fed.leave()
            except (httpc.CallError, *TRANSPORT_ERRORS) as e:
                self.log(f"FedMom leave: {e} (the aggregator drops silent members on its own)")

    # -- per phase
    def next_span(self, busy=None, blocks=None):
        """-> (lease, start, end) of the next span, or None when DARL has no blocks left.
        While every block is leased elsewhere, the site leaves FedMom's rounds (the others must
        not wait for a delta that cannot come) and joins again with work. busy: the round trip
        in flight (--overlap): meanwhile only DARL is asked; if it ends first -> SETTLE (the
        caller takes its theta in, then asks again). blocks: what to lease (a timed phase's plan)."""
        if blocks is not None:
            self.session.span_blocks = self.session.lease_blocks = max(1, int(blocks))
        if busy is not None:
            got = yield from self._span_while(busy)
            return self._took(got, False) if got != SETTLE else got
        while True:
            try:
                span = self.session.next_span(timeout=POLL_S)
                break
            except TimeoutError:
                if self.session.starved and self.member:
                    self.log("DARL: every remaining block is leased by others; leaving FedMom's rounds "
                             "until blocks come back (or the epoch ends)")
                    self.leave()
                yield
        if span is None:
            return None
        if not self.member:
            yield from self.join()
        return self._took(span.as_ints(), False)

    def _took(self, got, more):
        if got is not None:
            self.span = darl_client.Span(*got)
            self.spans = [*self.spans, self.span] if more else [self.span]
        return got

    def _span_while(self, busy):
        while True:
            try:
                span = self.session.next_span(timeout=OVERLAP_POLL_S)
                break
            except TimeoutError:
                if busy.done():
                    return SETTLE
                yield
        return None if span is None else span.as_ints()

    def current_round(self):
        return (yield from self._call("FedMom round", lambda d: self.fed.current_round(deadline=d)))

    def fetch_theta(self, path, defer_update=False):
        """theta_global of the current round into `path` -> its round: the theta followed during
        the merge (Follow.adopt), else with --down-wire the update added to the previous round's theta
        (checked by its digest), else the whole file (FEDERATION_GUIDE.md, "Compressed downstream").
        defer_update: an int8/int4/int2 update is only checked against the theta's names and
        shapes; the caller adds it on its devices, then check_behind() (joined first) checks the file."""
        yield from self.join_check()
        return (yield from self._call("download theta_global", lambda d: self._fetch(path, d, defer_update)))

    def _fetch(self, path, deadline=None, defer_update=False):
        held = self.held if self.held is not None else _held(path)
        self.deferred = None
        fol, self.follow = self.follow, None
        got = fol.adopt(self, path, defer_update) if fol is not None else None
        if got is not None:
            return got
        if held is not None:
            upd = os.path.join(os.path.dirname(os.path.abspath(path)), "theta-update.safetensors")
            keep = False
            try:
                got = self.fed.download_update(upd, *held, transport=self.theta_transport, deadline=deadline)
                if got is not None:
                    size = os.path.getsize(upd)
                    if defer_update and _device_update(upd, path):
                        # theta is the file's until the check behind says otherwise: no held digest meanwhile
                        self.held, self.deferred, keep = None, (got[0], got[1], upd), True
                    else:
                        wire.apply_update(path, upd, path, got[1], {"round": str(got[0])})
                        self.held = got
                    self.down = {"via": "update", "bytes": size}
                    return got[0]
            except (wire.WireError, tensorio.FormatError) as e:
                self.log(f"!!! the update of theta_global did not give the aggregator's theta ({e}); "
                         "downloading the whole theta_global")
            finally:
                if not keep:
                    durable.unlink(upd)
        self.held = None
        rnd = self.fed.download_theta(path, transport=self.theta_transport, deadline=deadline)
        self.held, self.down = (rnd, wire.theta_digest(path)), {"via": "full", "bytes": os.path.getsize(path)}
        return rnd

    def check_behind(self, path):
        """After the caller added the deferred update to its theta on its devices: the same
        float32 addition file to file on a thread (wire.apply_update), checked against the
        aggregator's digest; join_check() waits for it before the next send and download."""
        rnd, digest, upd, *checked = self.deferred
        self.deferred = None
        if checked:                           # followed: the host built and checked this theta already
            durable.unlink(upd)
            self.held = (rnd, digest)
            return

        def check():
            testhooks.fault_point("site.check")  # test hook (testhooks.py): the device holds the update, the file not yet
            try:
                wire.apply_update(path, upd, path, digest, {"round": str(rnd)})
            finally:
                durable.unlink(upd)
            return rnd, digest
        self.checking = Background(_call(check))

    def join_check(self):
        """Generator: wait for check_behind's thread -> None, or why the check failed. A
        failure is said loudly: the theta the site holds on its devices is not the
        aggregator's, so nothing trained from it may be sent, and the next theta_global is
        downloaded whole (held is None)."""
        if self.checking is None:
            return None
        try:
            self.held = yield from self.checking.wait()
            return None
        except (wire.WireError, tensorio.FormatError, OSError) as e:
            self.held = None
            self.log(f"!!! theta_global as updated on the devices failed its check on the host ({e}): the site "
                     "holds a theta that is not the aggregator's; nothing trained from it is sent, and "
                     "theta_global is downloaded whole")
            return f"{type(e).__name__}: {e}"
        finally:
            self.checking = None

    def _outcome(self, reply, base):
        """Our delta of `base_round` in a join/heartbeat reply's "deltas": merged |
        excluded | pending, or None (the aggregator never accepted it)."""
        for o in reply.get("deltas") or ():
            if o.get("incarnation") == self.incarnation and o.get("base_round") == base:
                return o
        return None

    def start_round_trip(self, delta_path, base, handoff, theta_path, defer_update=False):
        """--overlap: round_trip() of the span just trained, on a thread of its own while
        the site trains its next phase. -> the Background handle (wait() for the RoundResult)."""
        return Background(self.round_trip(delta_path, base, handoff, theta_path, list(self.spans), defer_update))

    def round_trip(self, delta_path, base, handoff, theta_path, spans=None, defer_update=False):
        """Send the delta file (theta_i - theta_global of round `base`) with the Handoff's
        tokens and metrics, wait for its round to pass, settle its lease, download
        theta_global to theta_path (defer_update: as fetch_theta). spans: the ones the delta
        trained (default: the phase's, next_span and more_span's). -> RoundResult.
        A delta trained from a theta whose check behind failed (join_check) is not sent:
        its lease is released, as for a delta not merged, and theta_global comes whole."""
        spans = list(spans or self.spans)
        span = spans[0]
        out = RoundResult(base_round=base, lease=span.lease, start=span.start, end=spans[-1].end,
                          step=handoff.step, tokens=handoff.tokens, spans=[s.as_ints() for s in spans])
        t0 = time.monotonic()
        sent = False
        testhooks.fault_point("site.trained")           # test hook (testhooks.py): checkpointed, nothing sent
        bad = yield from self.join_check()
        if bad is not None:
            out.reason = (f"not sent: it was trained from a theta_global that failed its check ({bad}); its "
                          "blocks are trained again")
            for sp in spans:
                self.session.span_done(sp)
                self.session.release(sp)
            yield from self._fetch_into(out, theta_path, defer_update)
            return out
        try:
            self.session.refresh()                   # the coordinator's word on the lease, now
        except (httpc.CallError, *TRANSPORT_ERRORS) as e:
            self.log(f"DARL heartbeat before sending: {e}")
        lost = [sp.lease for sp in spans if sp.lease not in self.session.held()]
        if lost:
            # reclaimed (expired) while we trained: its blocks are back in the pool and may be
            # someone else's already, so merging this delta would train them twice; the phase's
            # other leases go back to the pool too (their blocks are trained again)
            out.reason = (f"lease {', '.join(map(str, lost))} lost at DARL before the send: delta dropped, its "
                          "blocks are trained again")
            self.log(out.reason)
            for sp in spans:
                self.session.span_done(sp)
                if sp.lease not in lost:
                    yield from self._call("DARL release", lambda d, sp=sp: self.session.release(sp, deadline=d))
            yield from self._fetch_into(out, theta_path, defer_update)
            return out
        try:
            yield from self._call("send delta", lambda d: self.fed.send_delta(
                delta_path, base, handoff.tokens, commit_records(self.session, spans),
                {**{k: v for k, v in handoff.metrics.items() if v is not None}, **self.seen}, transport=self.cfg.transport,
                deadline=d))
            sent = True
            out.sent_at = time.monotonic()
            testhooks.fault_point("site.sent")          # test hook: accepted, its outcome not known here yet
            self.follow = Follow.start(self, base, theta_path)    # the next theta while it is merged
        except fedmom_client.StaleRound as e:
            out.reason = f"stale: {e}"
        except httpc.CallError as e:                  # refused (a bad delta): never merged
            out.reason = f"refused: {e.reply.get('error', e)}"
        out.send_s = round(time.monotonic() - t0, 3)
        while True:          # until the round passed and the aggregator's books say what became of it
            reply = yield from self._call("wait for the round", lambda d: self.fed.heartbeat(
                wait_round_after=base, wait_s=min(POLL_S * 4, self.fed.heartbeat_s), deadline=d))
            got = self._outcome(reply, base)
            state = got and got.get("outcome")
            if reply["round"] <= base and reply.get("waiting_on") is not None:
                out.waiting_on = reply["waiting_on"]
            self.age.heard(reply)
            self.last_update = reply.get("update")
            if state == "pending" or (sent and got is None and reply["round"] <= base):
                self.say(f"round {base}: waiting for the other sites' deltas (members {reply.get('members')})",
                         every_s=30.0)
                yield
                continue
            break
        out.wait_s = round(time.monotonic() - t0 - out.send_s, 3)
        durable_seen = time.monotonic()
        # the lease TTL we ask for follows this whole time (phase + round trip), not the phase
        for sp in spans:
            self.session.span_done(sp)
        if state == "merged":
            out.merged, out.merged_into = True, got.get("merged_into")
        elif state == "excluded" or not sent:
            out.reason = out.reason or f"excluded: {got.get('why')}"
            for sp in spans:                           # back to the pool
                yield from self._call("DARL release", lambda d, sp=sp: self.session.release(sp, deadline=d))
        else:                                        # accepted, then no record: the aggregator decides
            out.reason = "outcome unknown: lease left to the aggregator (commit if merged, else expiry)"
            for sp in spans:
                self.session.forget(sp)
        yield from self._fetch_into(out, theta_path, defer_update)
        held_at = time.monotonic()
        # on the round record's time line (fedmom_round.exchange): how long after the round was
        # durable this site held its theta, and its whole wait from its delta's acceptance
        self.seen = {"exchange_round": out.round, "held_lag_s": round(held_at - durable_seen, 3),
                     "exchange_wait_s": round(held_at - out.sent_at, 3) if sent else None}
        return out

    def _fetch_into(self, out, theta_path, defer_update=False):
        t0 = time.monotonic()
        out.round = yield from self.fetch_theta(theta_path, defer_update)
        out.theta_via, out.down_bytes = self.down.get("via"), self.down.get("bytes")
        out.update = self.deferred[2] if self.deferred is not None else None
        out.down_s = round(time.monotonic() - t0, 3)

    # -- end
    def finish(self):
        """DARL is done: wait until every lease handed to the aggregator has left this
        session (in custody or committed: "done"), then leave."""
        deadline = httpc.Deadline(self.retry_s)        # a wait for the aggregator, not a retry
        while self.session.held() and deadline.left() > 0:
            try:
                self.session.refresh()
            except (httpc.CallError, *TRANSPORT_ERRORS) as e:
                self.say(f"DARL heartbeat: {e}", every_s=10.0)
            if self.session.held():
                self.say(f"waiting for the aggregator to take leases {sorted(self.session.held())} into custody "
                         "in DARL", every_s=10.0)
                yield
                time.sleep(1.0)
        unsettled = self.session.held()
        self.session.close(release=not unsettled)    # never release what the aggregator may still commit
        self.leave()
        self.darl.close()
        if unsettled:
            self.log(f"leases {sorted(unsettled)} were still uncommitted after {self.retry_s:.0f} s; left to expire")
        return True

    def abort(self):
        """On an error: stop talking, release nothing (the aggregator may still commit)."""
        if self.follow is not None:
            self.follow.discard(wait=False)
        try:
            if self.session is not None:
                self.session.close(release=False)
        finally:
            if self.keepalive is not None:
                self.keepalive.__exit__(None, None, None)
                self.keepalive = None
            self.darl.close()


def more_span(site, busy, blocks):
    """One more span of `blocks` for the phase now training (its last span ended with time
    left; the delta names them all: FedSite.spans) -> (lease, start, end); SETTLE (--overlap: the
    round trip in flight ended first); or None when DARL has none within MORE_WAIT_S (or is
    done): the phase ends. It never waits longer mid-phase: the spans it trained stay
    unsent meanwhile, and two sites each waiting on the other's blocks would wait forever."""
    site.session.span_blocks = site.session.lease_blocks = max(1, int(blocks))
    deadline = time.monotonic() + MORE_WAIT_S
    while True:
        try:
            span = site.session.next_span(timeout=max(0.0, min(OVERLAP_POLL_S, deadline - time.monotonic())))
            break
        except TimeoutError:
            if busy is not None and busy.done():
                return SETTLE
            if time.monotonic() >= deadline:
                return None
            yield
    return None if span is None else site._took(span.as_ints(), True)


def close_phase(site, cut=None):
    """Rank 0, at the end of a phase measured in time: what its leases hold past what it
    trained goes back to DARL's pool now (LeaseSession.trim): [cut, ...) of its last span when
    the clock ended it on block `cut`, and the rest of any lease it drew a span from. So the
    delta names only what it trained, and no lease outlives its phase (a lease two phases
    drew from would be released with the first one's delta while the second trains on it)."""
    if cut is not None:
        last = site.spans[-1]
        site.span = site.spans[-1] = yield from site._call(
            "DARL release (the tail the clock left)", lambda d: site.session.trim(last, cut, deadline=d))
    for i, sp in enumerate(site.spans):
        end = site.session.lease_end(sp.lease)
        if end is not None and end > sp.end and all(x.lease != sp.lease for x in site.spans[i + 1:]):
            yield from site._call("DARL release (a lease's untrained rest)",
                                  lambda d, sp=sp: site.session.trim(sp, sp.end, deadline=d))
    return [s.as_ints() for s in site.spans]


def commit_records(session, spans):
    """A delta's leases for the aggregator's custody: one record per lease, a lease's spans of
    one phase joined (they follow each other: the session hands them in order)."""
    out = []
    for sp in spans:
        if out and out[-1]["lease"] == sp.lease and out[-1]["end"] == sp.start:
            out[-1]["end"] = sp.end
        else:
            out.append(session.commit_record(sp))
    return out


class Follow:
    """The next round's theta, built while the aggregator merges it: the update comes down as
    it is written (fedmom_client.FollowedUpdate) and each tensor is added to our theta as its
    bytes are in (wire.apply_update's `ready`), into theta-next.safetensors. Used only once the
    round is durable and its digest is the round's (Follow.adopt; FEDERATION_GUIDE.md section 4)."""

    def __init__(self, fed, theta_path, held, retry_s):
        d = os.path.dirname(os.path.abspath(theta_path))
        self.upd = os.path.join(d, "theta-followed.safetensors")
        self.cand = os.path.join(d, "theta-next.safetensors")
        self.f = fedmom_client.FollowedUpdate(fed, self.upd, *held)
        self.deadline = httpc.Deadline(retry_s, what="follow the update of theta_global", log=httpc.quiet)
        self.theta_path, self.box = theta_path, {}
        self.thread = threading.Thread(target=self._run, name="follow-update", daemon=True)
        self.thread.start()

    def _run(self):
        fetch = threading.Thread(target=self.f.run, args=(self.deadline,), name="follow-download", daemon=True)
        fetch.start()
        try:
            self.f.wait_for(8)
            testhooks.fault_point("site.follow")    # test hook: the followed update's first bytes are in, not applied
            digest = wire.apply_update(self.theta_path, self.upd, self.cand, None, {"round": str(self.f.round)},
                                       ready=self.f.wait_for)
            self.box["out"] = (self.f.round, digest)
        except Exception as e:               # UpdateGone, a cut that did not resume, a bad file: not ours
            self.box["err"] = e
            self.f.stop.set()
        finally:
            fetch.join()

    @classmethod
    def start(cls, site, base, theta_path):
        """site's delta of round `base` is in -> a Follow of round base + 1's update if the aggregator
        publishes updates, site holds round `base` and PWW_FOLLOW_UPDATE is not 0; else None."""
        if site.follow is not None:
            site.follow.discard()
        held = site.held
        if held is not None and held[0] == base and site.publishes and os.environ.get("PWW_FOLLOW_UPDATE") != "0":
            return cls(site.fed, theta_path, held, site.retry_s)
        return None

    def adopt(self, site, path, defer_update):
        """The round is durable: the theta built becomes site's if its digest is the one the
        heartbeat named (site.last_update) -> its round, else None (the usual download follows)."""
        want, held = site.last_update, site.held      # no wait unless round base + 1 is durable (ours excluded)
        got = self.result() if want is not None and want["round"] == self.f.base + 1 else None
        if None in (got, held) or got != (want["round"], want["digest"]) or want["base_digest"] != held[1]:
            if got is not None:
                site.log(f"the update followed during the merge ({got[0]}) is not the durable round's "
                         f"({want and want['round']}): taking it the usual way")
            self.discard()
            return None
        durable.rename(self.cand, path, True)
        site.held, site.down = got, {"via": "followed", "bytes": self.f.total}
        if defer_update and _device_update(self.upd, path):
            site.deferred = (got[0], got[1], self.upd, "checked")   # the devices add it; the host already did
        else:
            durable.unlink(self.upd)
        return got[0]

    def result(self):
        """(round, digest) of the theta built, or None (why is in self.box["err"])."""
        self.thread.join()
        return self.box.get("out")

    def discard(self, wait=True):
        self.f.cancel()
        if wait:
            self.thread.join()
            durable.unlink(self.upd)
            durable.unlink(self.cand)


def _device_update(upd, theta_path):
    """True if the update file is int8/int4/int2 (a site's devices add those: wire_torch) and fits
    the theta file's names and shapes; WireError if it does not fit."""
    with wire.WireReader(upd, threads=1) as r:
        if r.codec is None or r.codec.fmt not in wire.LEVELS:
            return False
        with tensorio.TensorReader(theta_path) as t:
            wire.check_shapes(r, {n: t.specs[n][1] for n in t.names})
    return True


def _call(fn):
    """fn() as a generator that returns its value (for Background)."""
    return fn()
    yield                                      # unreachable: makes this a generator function


def _held(path):
    """(round, wire.Digest) of a theta file a previous job of this run left, or None."""
    try:
        with tensorio.TensorReader(path) as r:
            rnd = int(r.metadata["round"])
        return rnd, wire.theta_digest(path)
    except (OSError, KeyError, ValueError):       # absent, unreadable, not ours: download it whole
        return None


def _in_background(fn, poll_s=POLL_S):
    """Generator: run fn() on a thread, yield every poll_s until it ends, return its value
    (or raise its exception)."""
    box = {}

    def run():
        try:
            box["out"] = fn()
        except BaseException as e:
            box["err"] = e
    t = threading.Thread(target=run, name="federation-call", daemon=True)
    t.start()
    while True:
        t.join(poll_s)
        if not t.is_alive():
            break
        yield
    if "err" in box:
        raise box["err"]
    return box["out"]


class Background:
    """A FedSite generator (a round trip) run to its end on a thread of its own: its yields
    (still waiting) are not shared with anyone, its value or exception is kept for wait()."""

    def __init__(self, gen):
        self.box = {}

        def run():
            try:
                while True:
                    next(gen)
            except StopIteration as e:
                self.box["out"] = e.value
            except BaseException as e:
                self.box["err"] = e
        self.thread = threading.Thread(target=run, name="federation-round-trip", daemon=True)
        self.thread.start()

    def done(self):
        return not self.thread.is_alive()

    def wait(self, poll_s=POLL_S):
        """Generator (for fedphase.on_rank0): yields every poll_s until the thread ended, then
        returns its value (or raises its exception)."""
        while True:
            self.thread.join(poll_s)
            if self.done():
                break
            yield
        if "err" in self.box:
            raise self.box["err"]
        return self.box["out"]


class LeasedSource:
    """The training windows of one DARL span per outer phase, the same on every rank: from
    the (lease, start, end) rank 0 shared, every rank derives the windows (positions ->
    blocks -> window indices, shuffled from --seed and the lease) and its own slice of
    each step (data.LeasedPhase). No traffic, no state beyond the block space."""

    def __init__(self, cfg, windows, block_size, seed, rank, world):
        self.cfg, self.windows, self.rank, self.world = cfg, windows, rank, world
        self.space = block_space.BlockSpace(windows.train_windows, block_size, seed,
                                            manifest_digest=windows.digest)
        self.per_step = cfg.batch_size * world * cfg.grad_accum
        # a phase measured in time shuffles runs of MIX_BLOCKS positions together when a step
        # holds fewer than MIX_BLOCKS blocks' windows: a step of one block is one stretch of text
        self.group = MIX_BLOCKS if self.per_step < MIX_BLOCKS * block_size else 1

    def phase(self, lease, start, end, timed=False, mix=True):
        """The phase of span (lease, start, end); timed (a phase the clock may end): its windows in
        runs of positions, so that it can end where a run ends (data.span_windows_blocked); mix:
        runs of self.group positions before the last quarter (False: single positions, for a
        phase whose step time is not known yet, which the clock may end anywhere)."""
        if timed:
            w, bounds, ends = data.span_windows_blocked(self.space, start, end, self.cfg.seed, lease,
                                                        self.group if mix else 1)
        else:
            w, bounds, ends = data.span_windows(self.space, start, end, self.cfg.seed, lease), None, None
        return data.LeasedPhase(lease, start, end, w, self.per_step, self.world, self.rank, self.cfg.batch_size,
                                bounds=bounds, ends=ends)


# ------------------------------------------------------------------ the central check

CHECK_MIB = 64              # the transfer `fedsite.py check` times through the blob store
CHECK_RTTS = 5              # GET /health round trips on one connection; the median is printed


def check_central(urls, token, ca_file, cluster, mib=CHECK_MIB, tmp_dir=None, out=print):
    """The calls a job makes, with the job's clients and environment, from where it runs:
    per service (urls: {"DARL": url, "FedMom": url, "blob store": url}, None: not set) the
    route (direct or which proxy, from which variable), TLS, auth, the round trip, and for
    the blob store a `mib` MiB upload and download. Returns the failures (empty: all OK)."""
    failures = []
    for name, url in urls.items():
        out(f"{name:<10} {url or '(not set)'}")
        if not url:
            out("  skipped   no URL (set it as the job does: central.sh url's export lines)")
            continue
        for step, fn in _check_steps(name, url, token, ca_file, cluster, mib, tmp_dir):
            try:
                out(f"  {step:<9} {fn()}")
            except Exception as e:                       # a diagnostic: every failure is one line
                msg = str(e) or type(e).__name__
                if isinstance(e, httpc.CallError) and e.status == 401:
                    msg += ("; fix: the token file (--token-file / $PWW_TOKEN_FILE) must hold the central "
                            "VM's token (central.sh url names it)")
                out(f"  {step:<9} FAILED: {msg}")
                failures.append(f"{name} ({step})")
                break
    return failures


def _check_steps(name, url, token, ca_file, cluster, mib, tmp_dir):
    """(step, fn) for one service, in the order a job meets them; fn() -> the line's text."""
    route = ("route", lambda: httpc.route(url).describe())
    tls = ("TLS", lambda: _check_tls(url, ca_file))
    rtt = ("rtt", lambda: _check_rtt(url, ca_file))
    if name == "DARL":
        client = darl_client.LeaseClient(url, token=token, ca_file=ca_file)
        auth = ("auth", lambda: f"ok (GET /status: {client.status().get('num_blocks', '?')} blocks)")
        return [route, tls, auth, rtt]
    if name == "FedMom":
        fed = fedmom_client.FedMomClient(url, cluster, "check", token=token, ca_file=ca_file)
        auth = ("auth", lambda: f"ok (GET /round: round {fed.current_round()})")
        return [route, tls, auth, rtt]
    auth = ("auth", lambda: f"ok (GET /blobs: {len(httpc.call(url, 'GET', '/blobs', token=token, ca_file=ca_file)['blobs'])} blobs)")
    move = (f"{mib} MiB", lambda: _check_transfer(url, token, ca_file, cluster, mib, tmp_dir))
    return [route, tls, auth, rtt, move]


def _check_tls(url, ca_file):
    conn = httpc.connect(url, 15.0, ca_file)
    try:
        if httpc.split_url(url)[0] != "https":
            return "none: http:// (only for a test; the sites' URLs are https://)"
        return (f"ok: {conn.sock.version()}, the certificate names {httpc.split_url(url)[1]}, signed by "
                f"{ca_file or 'a CA of the system'}")
    finally:
        conn.close()


def _check_rtt(url, ca_file):
    conn = httpc.connect(url, 15.0, ca_file)
    times = []
    try:
        for _ in range(CHECK_RTTS):
            t0 = time.perf_counter()
            httpc.call(url, "GET", "/health", conn=conn)
            times.append(time.perf_counter() - t0)
    finally:
        conn.close()
    return f"{sorted(times)[len(times) // 2] * 1e3:.1f} ms (median of {CHECK_RTTS} GET /health on one connection)"


def _check_transfer(url, token, ca_file, cluster, mib, tmp_dir):
    """Up and down through the blob store, as a delta and a theta move: a random file, put_file
    and get_file (their own stream counts), the copy compared, the blob deleted."""
    blob_id = f"check.{cluster}.{secrets.token_hex(4)}"      # the site's own (credentials.blob_owner)
    with tempfile.TemporaryDirectory(prefix="pww-check-", dir=tmp_dir) as tmp:
        src, back = os.path.join(tmp, "up"), os.path.join(tmp, "down")
        with open(src, "wb") as f:
            for _ in range(mib):
                f.write(os.urandom(1 << 20))
        t0 = time.perf_counter()
        sent = blob_client.put_file(url, blob_id, src, token=token, ca_file=ca_file, progress=False)
        t1 = time.perf_counter()
        try:
            got = blob_client.get_file(url, blob_id, back, token=token, ca_file=ca_file, progress=False)
            t2 = time.perf_counter()
        finally:
            httpc.call(url, "DELETE", f"/blobs/{blob_id}", token=token, ca_file=ca_file)
        if got != sent["sha256"]:
            raise ValueError(f"the copy that came back differs (sha256 {got[:12]}, sent {sent['sha256'][:12]})")
    size = mib << 20
    return f"up {size / (t1 - t0) / 1e6:.0f} MB/s, down {size / (t2 - t1) / 1e6:.0f} MB/s (checksums match)"


def check_main(argv=None):
    """`python fedsite.py check`: the central check from a compute node (RUNBOOK.md section 2)."""
    p = argparse.ArgumentParser(
        prog="fedsite.py check",
        description="From where a job runs (srun on a compute node), make the calls the job makes, with its "
                    "clients and environment (the URLs, the token, the CA, https_proxy/no_proxy or $PWW_PROXY), "
                    "and print per service the route, TLS, auth, the round trip and a transfer's rate. "
                    "Exit 0 when every service answered as a job needs, 1 otherwise.")
    p.add_argument("check")
    p.add_argument("--darl-url", default=os.environ.get("PWW_DARL_URL"), help="default $PWW_DARL_URL")
    p.add_argument("--fedmom-url", default=os.environ.get("PWW_FEDMOM_URL"), help="default $PWW_FEDMOM_URL")
    p.add_argument("--blob-url", default=os.environ.get("PWW_BLOB_URL"), help="default $PWW_BLOB_URL")
    p.add_argument("--site", default=os.environ.get("PWW_SITE") or os.uname().nodename.split(".")[0],
                   help="the name the check's test blob carries (default $PWW_SITE, else the host name)")
    p.add_argument("--mib", type=int, default=CHECK_MIB, help=f"MiB moved up and down (default {CHECK_MIB})")
    p.add_argument("--tmp-dir", default=None, help="where the test file is written (default $TMPDIR or /tmp)")
    httpc.add_client_args(p)
    a = p.parse_args(argv)
    token = httpc.load_token(a.token_file)
    urls = {"DARL": a.darl_url, "FedMom": a.fedmom_url, "blob store": a.blob_url}
    if not any(urls.values()):
        p.error("no URL: set PWW_DARL_URL, PWW_FEDMOM_URL and PWW_BLOB_URL (central.sh url's export lines)")
    print(f"central check from {os.uname().nodename} (the job's clients and environment)")
    failures = check_central(urls, token, a.ca_file, a.site, a.mib, a.tmp_dir)
    print(f"FAIL: {', '.join(failures)}: the lines above say why and what to do" if failures
          else "PASS: a job here reaches every service set")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(check_main())
