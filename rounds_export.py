"""rounds_export.py - the aggregator's rounds.jsonl as a CSV table (and TensorBoard scalars).

Runs on: the central VM (CSV: Python standard library + numpy, like the aggregator) or any
machine with a copy of rounds.jsonl (--tensorboard also needs torch and the tensorboard
package, as on a site). Reads the file only; safe while the aggregator appends to it
(a torn last line is skipped).

    python rounds_export.py runs/central/fedmom/rounds.jsonl --csv rounds.csv
    python rounds_export.py runs/central/fedmom/rounds.jsonl --tensorboard runs/tb/rounds
    tensorboard --logdir runs/tb

CSV: one row per merged round, in order: round, time (Unix s), time_utc, tokens (merged in
that round), tokens_total (merged so far: the x axis of loss against tokens), loss
(token-weighted over the round's deltas, nats), perplexity, drift_mean, drift_max,
tokens_per_s (all sites), wall_s, merge_s, reason, members, excluded (how many deltas),
then per site <site>_<figure> for tokens, loss, tokens_per_s, mfu, peak_mem_gib, inner_s,
heldout_loss, heldout_round and incarnation (empty where that site sent nothing).
TensorBoard: rounds/<figure> against the round, rounds/loss_by_tokens against
tokens_total, and sites/<site>/<figure> against the round.
"""
import argparse
import csv
import math
import sys
import time

from durable import read_jsonl

ROUND_COLUMNS = ("round", "time", "time_utc", "tokens", "tokens_total", "loss", "perplexity", "drift_mean",
                 "drift_max", "tokens_per_s", "wall_s", "merge_s", "reason", "members", "excluded")
SITE_FIGURES = ("tokens", "loss", "tokens_per_s", "mfu", "peak_mem_gib", "inner_s", "heldout_loss",
                "heldout_round", "incarnation")


def table(records):
    """(sites, column names, rows as dicts): one row per round, cumulative tokens, per-site columns."""
    sites = sorted({key.split("@")[0] for r in records for key in (r.get("clusters") or {})})
    columns = list(ROUND_COLUMNS) + [f"{s}_{f}" for s in sites for f in SITE_FIGURES]
    rows, total = [], 0
    for r in records:
        total += r.get("tokens") or 0
        row = {k: r.get(k) for k in ROUND_COLUMNS}
        row.update(tokens_total=total, members=" ".join(r.get("members") or ()),
                   excluded=len(r.get("excluded") or ()),
                   time_utc=time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(r["time"])) if r.get("time") else None)
        for key, c in (r.get("clusters") or {}).items():
            s = key.split("@")[0]
            for f in SITE_FIGURES:
                if c.get(f) is not None:
                    row[f"{s}_{f}"] = c[f]
        rows.append(row)
    return sites, columns, rows


def write_csv(path, columns, rows):
    out = sys.stdout if path == "-" else open(path, "w", newline="")
    try:
        w = csv.DictWriter(out, columns, restval="", extrasaction="ignore")
        w.writeheader()
        for row in rows:
            w.writerow({k: "" if v is None else v for k, v in row.items()})
    finally:
        if out is not sys.stdout:
            out.close()


def write_tensorboard(path, rows, sites):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        raise SystemExit(f"--tensorboard {path}: needs torch and the tensorboard package ({e}): "
                         "pip install tensorboard, or write --csv instead") from None
    tb = SummaryWriter(path)
    number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    for row in rows:
        step = row["round"]
        for k in ROUND_COLUMNS:
            if k not in ("round", "time") and number(row.get(k)):
                tb.add_scalar(f"rounds/{k}", row[k], step)
        if number(row.get("loss")):
            tb.add_scalar("rounds/loss_by_tokens", row["loss"], row["tokens_total"])
        for site in sites:
            for f in SITE_FIGURES:
                if number(row.get(f"{site}_{f}")):
                    tb.add_scalar(f"sites/{site}/{f}", row[f"{site}_{f}"], step)
    tb.close()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("rounds", help="the aggregator's rounds.jsonl (<fedmom --state-dir>/rounds.jsonl)")
    p.add_argument("--csv", metavar="FILE", help="write the table here ('-' = stdout)")
    p.add_argument("--tensorboard", metavar="DIR", help="write TensorBoard scalars here")
    a = p.parse_args(argv)
    if not (a.csv or a.tensorboard):
        p.error("nothing to write: pass --csv FILE and/or --tensorboard DIR")
    records = read_jsonl(a.rounds)
    if not records:
        raise SystemExit(f"{a.rounds}: no round records (no such file, or no merge yet); it is "
                         "<fedmom_server.py --state-dir>/rounds.jsonl")
    sites, columns, rows = table(records)
    if a.csv:
        write_csv(a.csv, columns, rows)
    if a.tensorboard:
        write_tensorboard(a.tensorboard, rows, sites)
    if a.csv != "-":
        print(f"{len(rows)} rounds ({rows[0]['round']}..{rows[-1]['round']}), {rows[-1]['tokens_total']:,} tokens"
              + (f" -> {a.csv}" if a.csv else "") + (f" -> {a.tensorboard}" if a.tensorboard else ""))


if __name__ == "__main__":
    main()
