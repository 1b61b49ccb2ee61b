"""fedmom_records.py - the aggregator's round records: what became of a delta (outcome), the
history of merged rounds, and a record's one log line.

Runs on: the central VM, imported by fedmom_round.py (the protocol core) and fedmom_server.py
(the status CLI prints records). Python standard library + darl_table.py (its position sets);
no I/O: rounds.jsonl itself is written by fedmom_store.py and read by status_page.py,
rounds_export.py and audit.py. Not run on its own.

A record (rounds.jsonl, one line per merge, "v": RECORD_VERSION; its fields are
fedmom_server.py's docstring) lists every delta of its round as one outcome; History keeps
the last RECORDS_KEPT records in memory, and every DARL position inside a merged delta,
so a round merging a position an earlier merged delta holds is counted
(blocks_trained_twice, from the aggregator's own records, whatever DARL says).
"""
import collections
import math

import darl_table

RECORD_VERSION = 3             # 2: per-delta "outcomes" with their leases; 3: + "delta" and DARL "pieces"
RECORDS_KEPT = 200            # round records kept in memory (the file keeps all)
CLIP_HISTORY_ROUNDS = 4       # the clip's median also counts the deltas merged in these last rounds
METRIC_KEYS = ("loss", "tokens_per_s", "mfu", "tflops_per_rank", "peak_mem_gib", "inner_s",
               "heldout_loss", "heldout_round",     # held-out: the site's last eval of theta_global <round>
               "steps", "step_s", "budget_s", "cycle_s", "util", "wait_s")     # a time-budgeted phase's figures
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
    view of a round is History.quorum's, made by fedmom_round.RoundTable."""

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
    """Round `new`'s record: its merged deltas (`batch`, fedmom_round.Pending) with the merge's
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
