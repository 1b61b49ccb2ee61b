"""darl_custody.py - the aggregator's side of DARL's table: custody of the positions an accepted
delta trained on (its two-phase commit), and the epochs that fence aggregator processes.

Runs on: the central VM, inside darl_server.py (the table DARL runs is a CustodyTable) and
darl_log.py's replay of the write-ahead log. Python standard library only; never torch. Not
run on its own. Like darl_table.py, a pure state machine: no file, no socket, no thread,
time comes in as `now` (or the injected clock), and a replay through the same methods at
the logged times gives the same table back.

What: CustodyTable is darl_table.LeaseTable (the books, where every position is in exactly
one place, custody records included, and the sites' calls) with the aggregator's calls on
the same books (darl_server.py's docstring has the endpoints):
  - take_custody() moves the positions a delta trained on out of their lease into a
    record owned by one aggregator. Nothing but that aggregator's commit_custody() or
    abort_custody() (or an operator's abort_orphaned()) ends it: no TTL, no steal, no
    release, no new incarnation touches it.
  - Epochs are DARL's to issue: fence() gives an aggregator process the next one (one more
    than any issued), but only to the state that holds the current one: it names it as
    last_epoch, with the process it bound that epoch to (durable before that process's
    confirm_fence) as last_holder, and that epoch was never confirmed or was confirmed by
    that process; and its round is not below the highest round the aggregator committed
    custody for (a state missing merges DARL committed). So a stale copy of that state, or
    one taken while a fence was in flight, can never get in however often it restarts;
    every other call must name the current epoch, anything else is refused (code "fenced").
  - A commit that cannot stand (its custody was aborted, or never taken) is refused and
    COUNTED in the table's `counters`, the loud books of what went wrong (refused_commits,
    aborted_custody, blocks_trained_twice; an abort of committed custody: refused_aborts),
    kept in the snapshot and rebuilt by the log replay.

Use:
    table = darl_custody.CustodyTable(space.num_blocks, darl_table.TableConfig(), clock=time.time)
    epoch = table.fence("agg", 0, "claim-1")["epoch"]; table.confirm_fence("agg", epoch, "claim-1", "proc-1")
    table.take_custody("agg", epoch, "delta-1", "lumi", "inc-1", [{"lease": 1}])
    table.commit_custody("agg", epoch, "delta-1", round=1)      # or abort_custody(...)
"""
import collections

import darl_table
from darl_table import Custody, LeaseError, check_name, is_int


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


class CustodyTable(darl_table.LeaseTable):
    """darl_table.LeaseTable with the aggregator's calls: custody and fencing (module docstring)."""

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
