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
