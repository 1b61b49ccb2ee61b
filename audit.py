"""audit.py - the run audit: is every block of the corpus inside exactly one merged delta?

Runs on: the central VM (or any copy of its state directory), with the servers running or
stopped. Python + numpy, with darl_server.py, darl_table.py, block_space.py and durable.py
(and what they import) beside it, as central.sh has them; never torch. It reads and changes nothing but what it prints:
    <state-dir>/darl/       DARL's snapshot and log, replayed read-only as a restart would
    <state-dir>/fedmom/     the aggregator's state.json and rounds.jsonl

    python audit.py --state-dir runs/central              # the summary and every problem block
    python audit.py --state-dir runs/central --blocks     # one line per block
    python audit.py --state-dir runs/central --partial    # a run still going: open blocks are not failures
    ./central.sh audit                                    # the same, on central.sh's state dir

How a block is judged. The aggregator's round records name every merged delta by its
custody id at DARL; DARL's custody record of that id names the positions the delta was
trained on. A position is then inside 0, 1 or more merged deltas:
    once         inside exactly one merged delta whose custody DARL committed   (ok)
    doubled      inside two or more merged deltas                                (FAIL)
    quarantined  inside none, dropped by DARL after --max-attempts failures      (said, ok)
    open         inside none, still free, leased or in custody                   (FAIL; ok with --partial)
    missing      inside none, and committed or otherwise settled at DARL         (FAIL)
Also FAIL: a merged delta DARL holds no custody for, or whose custody was aborted; a
custody DARL committed for no merged delta; DARL's positions and the aggregator's copy
of them disagreeing; rounds missing or repeated; a violation counter above 0 on either
side; DARL's books inconsistent; with a manifest (default <state-dir>/manifest.json,
which central.sh keeps), merged tokens differing from training windows x seq_len.
A custody held with its commit still owed by the aggregator is "commit owed": ok with
--partial. Exit 0 = PASS, 1 = FAIL.
"""
import argparse
import collections
import dataclasses
import json
import os
import sys

import block_space
import darl_server
import darl_table
import durable

MERGED = "once"


@dataclasses.dataclass
class Report:
    ok: bool
    lines: list                              # what the CLI prints (the summary, then the problems)
    status: dict                             # position -> once | doubled | quarantined | open | missing
    deltas: list                             # [(round, outcome, custody record or None)] of merged deltas
    num_blocks: int = 0
    space: dict = None

    def block_lines(self):
        """One line per block, in position order."""
        sp = self.space
        bs = block_space.BlockSpace(sp["num_samples"], sp["block_size"], sp["seed"])
        where = {}
        for rnd, o, c in self.deltas:
            for _, a, b in (c or {}).get("pieces", ()):
                for p in range(a, b):
                    where.setdefault(p, []).append(f"round {rnd} delta {o.get('delta')} of {o['cluster']}")
        return [f"block {bs.block_at(p)} (position {p}): {self.status[p]}"
                + (f" - {'; '.join(where[p])}" if p in where else "") for p in range(self.num_blocks)]


def runs_of(positions):
    """[p, ...] -> "[a, b), [c, d)" (sorted, merged)."""
    out, start, prev = [], None, None
    for p in sorted(positions):
        if start is None:
            start = prev = p
        elif p == prev + 1:
            prev = p
        else:
            out.append((start, prev + 1))
            start = prev = p
    if start is not None:
        out.append((start, prev + 1))
    return ", ".join(f"[{a}, {b})" for a, b in out[:20]) + (f" ... ({len(out)} runs)" if len(out) > 20 else "")


def audit(state_dir, partial=False, manifest=None):
    """The audit of a state dir: a Report (nothing printed, nothing changed)."""
    problems, notes = [], []
    try:
        loaded = darl_server.load_state(state_dir)
    except SystemExit as e:                     # LogError: the message names the file and the fix
        return Report(False, [f"FAIL: DARL's state cannot be read: {e}"], {}, [])
    if loaded is None:
        return Report(False, [f"FAIL: no DARL state in {os.path.join(state_dir, 'darl')}"], {}, [])
    table, n = loaded.table, loaded.table.num_blocks
    try:
        books = table.verify()
    except darl_table.InvariantError as e:
        problems.append(f"DARL's books are inconsistent: {e}")
        books = {}
    fed_dir = os.path.join(state_dir, "fedmom")
    try:
        with open(os.path.join(fed_dir, "state.json")) as f:
            fed = json.load(f)
    except (OSError, ValueError) as e:
        return Report(False, [f"FAIL: no aggregator state in {fed_dir} ({e})"], {}, [])
    agg, records = fed.get("aggregator"), durable.read_jsonl(os.path.join(fed_dir, "rounds.jsonl"))
    owed = {c["delta"] for c in fed.get("pending_commits", [])}

    rounds = [r["round"] for r in records]
    if rounds != list(range(1, len(rounds) + 1)) or (rounds and fed.get("round") != rounds[-1]):
        problems.append(f"rounds lost or repeated: rounds.jsonl holds {rounds[:10]}{'...' if len(rounds) > 10 else ''}"
                        f", state.json says round {fed.get('round')}")
    deltas, counts, named = [], bytearray(n), collections.Counter()
    for r in records:
        for o in r.get("outcomes", ()):
            if o.get("outcome") != "merged":
                continue
            c = table.custody.get((agg, o.get("delta")))
            deltas.append((r["round"], o, c.wire() if c else None))
            named[o.get("delta")] += 1
            who = f"round {r['round']}: {o['cluster']}'s delta {o.get('delta')}"
            if c is None:
                problems.append(f"{who} is merged, but DARL holds no custody of it: its blocks were never reserved")
                continue
            if c.state == "aborted":
                problems.append(f"{who} is merged, but DARL aborted its custody ({c.why}): its blocks went back to "
                                "the pool")
            elif c.state == "held" and not (partial and o.get("delta") in owed):
                problems.append(f"{who} is merged, its custody is still held at DARL"
                                + (" (the aggregator owes the commit)" if o.get("delta") in owed else ""))
            if [list(x) for x in o.get("pieces") or ()] != [x[:3] for x in c.pieces]:
                problems.append(f"{who}: the aggregator's positions {o.get('pieces')} differ from DARL's "
                                f"{[x[:3] for x in c.pieces]}")
            for _, a, b, _, _ in c.pieces:
                for p in range(a, b):
                    counts[p] = min(255, counts[p] + 1)
    twice = sorted(d for d, k in named.items() if k > 1)
    if twice:
        problems.append(f"deltas merged in more than one round: {twice[:10]}")
    merged_ids = set(named)
    stray = [C for (a, d), C in table.custody.items() if C.state == "committed" and (a != agg or d not in merged_ids)]
    for C in stray[:10]:
        problems.append(f"DARL committed custody of delta {C.delta} ({C.aggregator}, {C.cluster}, {C.blocks} blocks) "
                        "that no merged round of this aggregator holds")

    status = _position_status(table, counts, partial)
    by = collections.defaultdict(list)
    for p, s in status.items():
        by[s].append(p)
    for s in ("doubled", "missing") + (() if partial else ("open",)):
        if by[s]:
            problems.append(f"{len(by[s])} blocks {s.upper()}: positions {runs_of(by[s])}")
    if by["quarantined"]:
        notes.append(f"{len(by['quarantined'])} blocks QUARANTINED by DARL after repeated failures (missing from "
                     f"this epoch, said): positions {runs_of(by['quarantined'])}")
    for side, v in (("DARL", table.counters), ("the aggregator", fed.get("violations", {}))):
        if any(v.values()):
            problems.append(f"{side}'s violation counters: " + ", ".join(f"{k} {x}" for k, x in v.items() if x))
    problems += _tokens_check(deltas, manifest, loaded.space, notes)

    head = (f"audit of {state_dir}: {n} blocks; {len(by[MERGED])} inside exactly one merged delta, "
            f"{len(by['doubled'])} doubled, {len(by['missing'])} missing, {len(by['open'])} open, "
            f"{len(by['quarantined'])} quarantined; {len(records)} merged rounds, {len(deltas)} merged deltas; "
            f"DARL: {books.get('committed', '?')} committed, {books.get('in_custody', '?')} in custody")
    ok = not problems
    lines = [head] + [f"  note: {x}" for x in notes] + [f"  !! {x}" for x in problems]
    lines.append("PASS: every block is inside exactly one merged delta" + (" or quarantined" if by["quarantined"]
                                                                            else "")
                 + (" (or still open: --partial)" if partial and by["open"] else "") if ok else
                 f"FAIL: {len(problems)} problem(s) above")
    return Report(ok, lines, status, deltas, n, loaded.space)


def _position_status(table, counts, partial):
    held = darl_table.Intervals()
    for key in table.custody_held:
        for _, a, b, _, _ in table.custody[key].pieces:
            held.add(a, b)
    leased = darl_table.Intervals([(L.start, L.end, 0) for L in sorted(table.leases.values(), key=lambda L: L.start)])
    out = {}
    for p in range(table.num_blocks):
        k = counts[p]
        if k == 1:
            out[p] = MERGED
        elif k > 1:
            out[p] = "doubled"
        elif table.quarantined.count(p, p + 1):
            out[p] = "quarantined"
        elif table.free.count(p, p + 1) or leased.count(p, p + 1) or held.count(p, p + 1):
            out[p] = "open"
        else:
            out[p] = "missing"
    return out


def _tokens_check(deltas, manifest, space, notes):
    """Merged tokens against the corpus: every training window merged once = windows x seq_len."""
    if not manifest or not os.path.exists(manifest):
        return []
    try:
        with open(manifest) as f:
            m = json.load(f)
        windows, seq_len = m["num_windows"] - m["heldout_windows"], m["seq_len"]
    except (OSError, ValueError, KeyError) as e:
        return [f"--manifest {manifest}: cannot read num_windows, heldout_windows and seq_len ({e})"]
    if windows != space.get("num_samples"):
        return [f"--manifest {manifest} has {windows} training windows, DARL's space {space.get('num_samples')}: "
                "not this run's corpus"]
    merged = sum(int(o.get("tokens", 0)) for _, o, _ in deltas)
    if merged != windows * seq_len:
        return [f"merged deltas carry {merged:,} tokens; the corpus has {windows:,} training windows x {seq_len} = "
                f"{windows * seq_len:,} (differs by {merged - windows * seq_len:+,})"]
    notes.append(f"merged deltas carry {merged:,} tokens = {windows:,} training windows x {seq_len}")
    return []


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="\n\n".join(__doc__.split("\n\n")[1:]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--state-dir", default="runs/central",
                   help="the central state dir: darl/ and fedmom/ below it (default runs/central)")
    p.add_argument("--partial", action="store_true", help="a run still going: open blocks and owed commits pass")
    p.add_argument("--blocks", action="store_true", help="print one line per block")
    p.add_argument("--manifest", help="the corpus manifest.json, for the tokens check "
                                      "(default <state-dir>/manifest.json when it exists)")
    a = p.parse_args(argv)
    if not os.path.isdir(a.state_dir):
        raise SystemExit(f"audit.py: --state-dir {a.state_dir}: no such directory")
    report = audit(a.state_dir, a.partial, a.manifest or os.path.join(a.state_dir, "manifest.json"))
    if a.blocks and report.space:
        print("\n".join(report.block_lines()))
    print("\n".join(report.lines))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
