"""fault_oracle.py - the judge of one fault schedule: what the final durable state of the
servers, and the sites' own records, must satisfy after any faults.

Runs on: this machine (CPU; Python + numpy, never torch), imported by fault_harness.py (each
schedule's end) and tests/test_fault_schedule.py (a clean run, and the same run tampered
with, must be judged so). Nothing to run from the shell; no server, no port. It reads a
finished run's directory only (and replays into a temporary directory under it):

    findings = fault_oracle.oracle(run)      # [] = nothing found; else one line per violation

`run` is a fault_harness.Run once its processes stopped: .central (the servers' state
dirs), .records (the fake sites' JSON lines and delta files, fault_site.py), .init (the
initial model), .s (the Schedule: .blocks, .down_wire), .dir, .findings (what the run
itself found), .committed_seen and .max_round_seen (what DARL and the aggregator announced
while it ran).

What it checks:
    - audit.py's judgement (every block inside exactly one merged delta, or quarantined
      and said; custody committed; rounds consecutive; no violation counter above 0);
    - every merged delta is one a site sent, its DARL positions the ones it trained (a
      span its clock trimmed: the prefix only), from the round before the one it merged
      into (a delta that came after its round closed, by quorum or otherwise, is stale);
      every position inside exactly one of them by the sites' own records;
    - no acknowledged commit lost (custody DARL reported committed during the run is
      still committed) and no merge a site was told of lost;
    - theta_global, the momentum and (--down-wire) the residual equal, bit for bit, a
      float32 replay by the aggregator's rule (fedmom_merge.merge_files with the recorded
      weights, clip scales and momentum resets, then fedmom_merge.publish with the
      residual) from the initial model and the delta files the sites wrote, an int4 one
      decoded by wire.py; every theta a site fetched (the followed one it adopted too) and
      every theta a span trained from (its file's digest, round the delta's base) has the
      replay's digest of that durable round, and no update failed its digest; with an f32
      aggregator theta_global also
      equals a float64 replay of the rule written out here (within 1e-5), with the outer
      LR and MU below, the ones the harness starts the aggregator with.
"""
import collections
import os
import tempfile

import numpy as np

import audit
import durable
import fedmom_merge
import fedmom_round
import outer_state
import tensorio
import wire

LR, MU = 0.7, 0.9                 # the aggregator's --outer-lr / --outer-momentum in every schedule


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
            if o["base_round"] != r["round"] - 1:
                out.append(f"round {r['round']} merged {o['cluster']}'s delta trained from round {o['base_round']}: "
                           "a delta of a round already closed must be refused (409 stale_round)")
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
        and every theta a site fetched or trained from (its digest) equal to the replay's of
        that durable round (a site never trains on a round that is not durable);
      - float64, the merge rule written out here (f32 aggregators: with --down-wire theta
        is theta_r + decode(encode(step)), within a residual of it, not near it)."""
    by_round = collections.defaultdict(list)
    for rnd, site, o in merged:
        by_round[rnd].append((site, o))
    for rec in records:
        if not by_round.get(rec["round"]):
            return [f"round {rec['round']} has no merged delta a site sent: cannot replay"]
    try:                        # rebuilt from its checkpoint and log, each round against its digest
        outer = outer_state.load_outer(fed_dir)
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
        if e["event"] == "trained" and "held_digest" in e and digests.get(e["base_round"]) != e["held_digest"]:
            out.append(f"{e['cluster']} ({e['incarnation']}) trained lease {e['lease']} from a theta_global of round "
                       f"{e['base_round']} with digest {e['held_digest'][:12]}..., the durable round's is "
                       f"{str(digests.get(e['base_round']))[:12]}...: it trained on a round that is not durable")
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
        history = [c["delta_norm"] for r in records[max(0, i - fedmom_round.CLIP_HISTORY_ROUNDS):i]
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
