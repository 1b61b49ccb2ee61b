"""bench/wire_formats.py - the wire formats side by side: bytes per parameter per round as
uploaded (the delta) and downloaded (theta, or its update with --down-wire), reconstruction
error, and the held-out loss of a short CPU federation relative to the uncompressed arm
measured in the same run.

Runs on: this machine's CPU (two 1-rank sites at a time), from the repository root:
    .venv/bin/python bench/wire_formats.py                     # 28 runs on ~1 MB of corpus, ~36 minutes here
    .venv/bin/python bench/wire_formats.py --arms f32,int4 --no-sweep --no-ddp     # 2 runs
    .venv/bin/python bench/wire_formats.py --corpus-mb 4.2     # bench/convergence.py's full size (~4x longer)
It prints its estimated time first, one line per arm as it finishes, then the table.
Work files: --out (default runs/bench-wire/, wiped first).

First the outer settings: f32 arms over --outer-lr {0.4, 0.7, 1.0} x --outer-momentum
{0, 0.5, 0.9} (same tokens, same init), printed with their merged rounds; the best is the
setting of every arm below (--no-sweep: FedAvg, lr 1 momentum 0, or --outer-lr/--outer-momentum). Then DDP on 2 ranks
(bench/convergence.py's (a); --no-ddp skips it) for the vs-DDP column. Then the arms,
each bench/convergence.py's (c): two federated sites through darl_server, fedmom_server
and blobstore, the same init, corpus, inner optimizer and schedule, one epoch, and one
held-out loss function on FedMom's final theta. Only the sites' --wire flags differ:
    f32          plain fp32 deltas: the reference arm
    bf16         plain bf16 deltas (error feedback on)
    int8, int4   per-block scales along the last dimension (--wire-block 128), error feedback on
    int4-noef    the same without error feedback
    topk         64 of every 4096 values, 4-bit values, 12-bit positions, error feedback on
    topk-noef    the same without error feedback
    topk-k512    512 of every 4096 (--wire-topk-k 512), error feedback on
    int4-both    int4 up, and theta down as int4 updates (fedmom_server.py --down-wire int4,
                 the aggregator's error feedback)
    topk-both    topk up and down (--down-wire topk)
    topk-int4    topk up, int4 down
    f32-overlap, int4-both-overlap
                 the f32 and int4-both arms with both sites on train.py --overlap: each trains its
                 next phase while its delta's round trip runs and folds theta_global in as soon as it
                 arrives (FEDERATION_GUIDE.md section 4, "Overlap")
    f32-overlap-end, int4-both-overlap-end
                 the same with --overlap-fold end: the fold waits for the end of that phase
    int2         2-bit codes, levels {-3, -1, 1, 3} x a block scale (--wire-block 128), error feedback on
    int2-both    int2 up, and theta down as int2 updates (--down-wire int2)
    sparseloco   SparseLoCo's compression up: topk, 128 of every 4096 values, 2-bit values
                 (--wire-topk-bits 2), the residual decayed by 0.95 before each selection
                 (--wire-feedback-decay 0.95); int4 down
    f32-eager, int4-both-eager
                 f32-overlap and int4-both-overlap with --overlap-fold eager: each phase after a send starts from one local
                 step of the aggregator's outer optimizer on the site's own delta, which the fold
                 on arrival replaces by theta_global (under FedAvg, --no-sweep's default, that step
                 is the site's own weights: the -overlap arm again; --outer-lr/--outer-momentum)
Figures, per arm:
    up B/param   the delta files the sites uploaded (train.py's "wire_bytes" row field, the
                 file's size), per parameter, mean over both sites' rounds
    payload      the same without the header, from site alpha's last delta: a model this small
                 (~0.1M parameters, ~25 tensors) pays ~0.05 B/param of header, a large one ~0
    down B/param what each site downloaded after each round (train.py's "down_bytes": the
                 whole theta, or its update), per parameter, mean over both sites' rounds
    rel. error   ||x - decode(encode(x))|| / ||x|| of one real delta: the f32 arm's last
                 delta of site alpha, encoded once with the arm's codec (no feedback)
    held-out     FedMom's final theta, and its ratio to the f32 arm's and to DDP's
    util, idle s each site's time in inner steps / (that + send + wait + download), and
                 send + wait + download per round (an -overlap arm: its "settle_s" instead, the
                 time the site spent on the delta's return outside inner steps: the wait for the
                 round trip, reading theta_global, the fold);
                 on plain loopback the wait for the other site and the merge;
                 with --link-mbit, each site reaches FedMom and the blob store through a
                 WAN-shaped link of its own (bench/wan_relay.py: that cap each way, plus
                 --link-latency-ms), so the transfers count too
Targets (not all reachable, see the table): int4 with error feedback <= 0.5 B/param and a
ratio <= 1.005, and the same down (int4-both); topk <= 0.1 B/param at a ratio <= 1.01;
an -overlap arm >= 95% utilisation on the shaped link at a ratio <= 1.01.
"""
import argparse
import dataclasses
import math
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)                           # bench/ imports the repository's top-level scripts

import numpy as np                                 # noqa: E402

import convergence                                 # noqa: E402  (bench/convergence.py, this directory)
import durable                                     # noqa: E402
from testbed import harness                                     # noqa: E402
import tensorio                                    # noqa: E402
import wire                                        # noqa: E402

# SparseLoCo's settings (FEDERATION_GUIDE.md section 4, "Wire formats and error feedback"):
# chunks of 4096 (their 64 x 64 tiles), k kept per chunk, 2-bit values, the residual decayed by beta
SPARSELOCO = (4096, 128, 0.95)
# arm -> (train.py flags of both sites, the codec that makes them, for the error column,
# fedmom_server.py flags)
ARMS = {"f32": ([], wire.Codec("f32"), []),
        "bf16": (["--wire", "bf16"], wire.Codec("bf16"), []),
        "int8": (["--wire", "int8"], wire.Codec("int8"), []),
        "int4": (["--wire", "int4"], wire.Codec("int4"), []),
        "int4-noef": (["--wire", "int4", "--no-error-feedback"], wire.Codec("int4"), []),
        "topk": (["--wire", "topk"], wire.Codec("topk"), []),
        "topk-noef": (["--wire", "topk", "--no-error-feedback"], wire.Codec("topk"), []),
        "topk-k512": (["--wire", "topk", "--wire-topk-k", "512"], wire.Codec("topk", topk_k=512), []),
        "int4-both": (["--wire", "int4"], wire.Codec("int4"), ["--down-wire", "int4"]),
        "topk-both": (["--wire", "topk"], wire.Codec("topk"), ["--down-wire", "topk"]),
        "topk-int4": (["--wire", "topk"], wire.Codec("topk"), ["--down-wire", "int4"]),
        "f32-overlap": (["--overlap"], wire.Codec("f32"), []),
        "int4-both-overlap": (["--wire", "int4", "--overlap"], wire.Codec("int4"), ["--down-wire", "int4"]),
        "f32-overlap-end": (["--overlap", "--overlap-fold", "end"], wire.Codec("f32"), []),
        "int4-both-overlap-end": (["--wire", "int4", "--overlap", "--overlap-fold", "end"], wire.Codec("int4"),
                                  ["--down-wire", "int4"]),
        "int2": (["--wire", "int2"], wire.Codec("int2"), []),
        "int2-both": (["--wire", "int2"], wire.Codec("int2"), ["--down-wire", "int2"]),
        "sparseloco": (["--wire", "topk", "--wire-topk-bits", "2", "--wire-topk-chunk", str(SPARSELOCO[0]),
                        "--wire-topk-k", str(SPARSELOCO[1]), "--wire-feedback-decay", str(SPARSELOCO[2])],
                       wire.Codec("topk", topk_chunk=SPARSELOCO[0], topk_k=SPARSELOCO[1], topk_bits=2),
                       ["--down-wire", "int4"]),
        "f32-eager": (["--overlap", "--overlap-fold", "eager"], wire.Codec("f32"), []),
        "int4-both-eager": (["--wire", "int4", "--overlap", "--overlap-fold", "eager"], wire.Codec("int4"),
                            ["--down-wire", "int4"])}
SWEEP_LR, SWEEP_MU = (0.4, 0.7, 1.0), (0.0, 0.5, 0.9)
TARGETS = {"int4": (0.5, 1.005), "int4-both": (0.5, 1.005), "topk": (0.1, 1.01), "topk-both": (0.1, 1.01)}
OVERLAP_TARGET = (0.95, 1.01)      # -overlap arms: utilisation at least, held-out ratio to f32 at most


@dataclasses.dataclass
class WireBenchConfig(convergence.BenchConfig):
    """bench/convergence.py's config (its --quick size by default) with these arms."""
    out: str = "runs/bench-wire"
    quick: bool = True
    arms: str = ",".join(ARMS)
    sweep: bool = True
    ddp: bool = True
    link_mbit: float = 0.0
    link_latency_ms: float = 50.0
    outer_lr: float = 1.0
    outer_momentum: float = 0.0
    timeout_min: float = 30.0
    known_arms = tuple(ARMS)

    def validate(self):
        if self.sweep and (self.outer_lr, self.outer_momentum) != (1.0, 0.0):
            raise SystemExit("--outer-lr/--outer-momentum set the outer step of --no-sweep; the sweep picks "
                             "its own: add --no-sweep, or drop them")
        return super().validate()

    @property
    def arm_list(self):
        """The arms asked for, the reference f32 first whether asked for or not."""
        return ["f32"] + [a for a in self.arms.split(",") if a and a != "f32"]


def site_rows(sites_dir):
    return [r for n in ("alpha", "beta") for r in durable.read_jsonl(os.path.join(sites_dir, n, "metrics.jsonl"))
            if r.get("split") == "federation"]


def idle_s(row):
    """A phase's time outside inner steps for its delta: the round trip, or under --overlap
    (which runs the round trip during the next phase) what that next phase's end waited for it."""
    if row.get("overlap"):
        return row.get("settle_s") or 0.0
    return (row.get("send_s") or 0) + (row.get("wait_s") or 0) + (row.get("down_s") or 0)


def rel_error(delta_path, codec):
    """||x - decode(encode(x))|| / ||x|| over every tensor of a real delta file."""
    err = tot = 0.0
    with tensorio.TensorReader(delta_path) as r:
        for n in r.names:
            x = r.read(n, as_float32=True).astype(np.float32)
            _, got = codec.encode(x)
            d = (x - got).astype(np.float64).reshape(-1)
            err += float(d @ d)
            tot += float(x.astype(np.float64).reshape(-1) @ x.astype(np.float64).reshape(-1))
    return math.sqrt(err / tot) if tot else 0.0


def run_arm(cfg, arm, ctx, launcher, outer):
    args, codec, fed_args = ARMS[arm]
    r = convergence.federated(cfg, "fed-fedavg", dict(ctx, out=os.path.join(ctx["out"], arm)), launcher, args,
                              outer=outer, fed_args=fed_args)
    rows = site_rows(r["sites"])
    sizes = [x["wire_bytes"] for x in rows if x.get("wire_bytes")]
    r["up"] = sum(sizes) / len(sizes) / ctx["params"] if sizes else None
    inner = sum(x["inner_s"] for x in rows)
    idle = sum(idle_s(x) for x in rows)
    r["util"] = inner / (inner + idle) if inner + idle else None     # time in inner steps / phase + round trip
    r["idle"] = idle / len(rows) if rows else None                    # per site and round, s
    down = [x["down_bytes"] for x in rows if x.get("down_bytes")]
    r["down"] = sum(down) / len(down) / ctx["params"] if down else float("nan")
    r["delta"] = os.path.join(r["sites"], "alpha", "federation", "delta.safetensors")
    with wire.WireReader(r["delta"]) as w:          # the tensors' bytes alone, without the header
        r["payload"] = sum(w.nbytes(n) for n in w.names) / ctx["params"]
    r["codec"] = codec
    return r


def sweep(cfg, ctx, launcher):
    """f32 arms over outer lr x momentum (same tokens, same init): the best is the reference."""
    out, best = {}, None
    for lr in SWEEP_LR:
        for mu in SWEEP_MU:
            name = f"sweep-{lr:g}-{mu:g}"
            r = convergence.timed_arm(name, lambda: convergence.federated(
                cfg, "fed-fedavg", dict(ctx, out=os.path.join(ctx["out"], name)), launcher, outer=(lr, mu)), cfg, ctx)
            if r is None:
                continue
            out[(lr, mu)] = (r["heldout"], len(r["rounds"]))
            if best is None or r["heldout"] < out[best][0]:
                best = (lr, mu)
    return out, best


def sweep_table(table, best):
    lines = ["", "Outer settings, f32 deltas (held-out loss, merged rounds); the best is the reference below:", "",
             "  lr \\ momentum " + "".join(f"{mu:>16g}" for mu in SWEEP_MU)]
    for lr in SWEEP_LR:
        cells = [f"{table[(lr, mu)][0]:.4f} ({table[(lr, mu)][1]:>2}){'*' if (lr, mu) == best else ' '}"
                 if (lr, mu) in table else "failed" for mu in SWEEP_MU]
        lines.append(f"  {lr:<14g} " + "".join(f"{c:>16}" for c in cells))
    return lines


def report(cfg, ctx, results):
    ref = results.get("f32", {}).get("heldout")
    delta = results.get("f32", {}).get("delta")
    lr, mu = ctx["outer"]
    w = max(len(a) for a in cfg.arm_list + ["arm", "f32"])        # the arm column's width
    lines = ctx.get("sweep_lines", []) + [
        "", f"Wire formats, 2 federated sites, outer lr {lr:g} momentum {mu:g}, {cfg.model} ({ctx['params']:,} "
            f"parameters), H = {cfg.inner_steps}, one epoch of {ctx['train_windows']:,} windows x {cfg.seq_len} tokens"
            + (f"; DDP held-out {ctx['ddp']:.4f}" if ctx.get("ddp") else "")
            + (f"; each site on a {ctx['link'][0]:g} Mbit/s, {ctx['link'][1]:g} ms link" if ctx.get("link") else "")
            + ":", "",
        f"  {'arm':<{w}} {'up B/param':>10} {'payload':>8} {'down B/param':>12} {'rel. error':>10} {'rounds':>6} "
        f"{'held-out':>9} {'vs f32':>17} {'vs DDP':>17} {'util':>5} {'idle s':>6} {'min':>5}"]
    for arm in cfg.arm_list:
        r = results.get(arm)
        if r is None:
            lines.append(f"  {arm:<{w}} {'failed':>10}")
            continue
        err = rel_error(delta, r["codec"]) if delta and os.path.exists(delta) else None
        r["rel_error"] = err
        lines.append(f"  {arm:<{w}} {r['up']:>10.4f} {r['payload']:>8.4f} {r['down']:>12.4f} {'-' if err is None else f'{err:.4f}':>10} "
                     f"{len(r['rounds']):>6} {r['heldout']:>9.4f} {convergence.fmt_ratio(r['heldout'], ref):>17} "
                     f"{convergence.fmt_ratio(r['heldout'], ctx.get('ddp')):>17} {r['util']:>5.2f} {r['idle']:>6.1f} "
                     f"{r['wall_s'] / 60:>5.1f}")
    lines.append("")
    twin = ctx.get("sweep_best")
    if twin and ref:        # the same arm twice: what the ratios above can resolve
        lines.append(f"  noise: the f32 arm and its twin in the sweep (same flags, DARL's lease order differs): "
                     f"{ref:.4f} vs {twin:.4f}, {100 * abs(ref / twin - 1):.2f}% apart")
    for arm, (most, ratio) in TARGETS.items():
        r = results.get(arm)
        if r is None or ref is None:
            continue
        got = r["heldout"] / ref
        both = arm.endswith("-both")
        ok = r["up"] <= most and got <= ratio and (not both or r["down"] <= most)
        lines.append(f"  target {arm}: <= {most} B/param up{' and down' if both else ''} at a ratio <= {ratio}: "
                     f"{r['up']:.4f} up, {r['down']:.4f} down B/param, {got:.4f} -> {'met' if ok else 'NOT met'}")
    for arm in (a for a in cfg.arm_list if "-overlap" in a or a.endswith("-eager")):
        r, (least, ratio) = results.get(arm), OVERLAP_TARGET
        if r is None or ref is None:
            continue
        got = r["heldout"] / ref
        ok = r["util"] >= least and got <= ratio and ctx.get("link")
        lines.append(f"  target {arm}: utilisation >= {least} on the shaped link at a ratio <= {ratio}: "
                     f"{r['util']:.3f}, {got:.4f}" + ("" if ctx.get("link") else " (no --link-mbit)")
                     + f" -> {'met' if ok else 'NOT met'}")
    lines += ["  up: the delta files as uploaded (safetensors header included); payload: the same without the",
              "  header (what a large model pays: the header grows with the tensor count, not their size);",
              "  down: what each site downloaded per round: theta_global in fp32, or (-both arms) the update from",
              "  the theta it held. int4's floor is 0.5 B/param plus 2/128 for the bf16 block scales. util: time in",
              "  inner steps / (that + send + wait + download), both sites; idle s: those three per site and round",
              "  (-overlap: the wait for the round trip, theta_global's read and the fold instead):",
              "  the transfers, the wait for the other site and the merge" + (" (on the shaped link)." if ctx.get("link")
                                                                          else ", on plain loopback (no --link-mbit).")]
    return "\n".join(lines)


def run(cfg: WireBenchConfig):
    cfg.validate()
    out, m, ctx = convergence.prepare(cfg, "wire", len(cfg.arm_list) + 9 * cfg.sweep + cfg.ddp, overhead_s=40)
    results = {}
    with harness.Launcher() as launcher:
        ctx["init"] = harness.export_init(launcher, os.path.join(out, "data", "init.safetensors"), m["path"],
                                          cfg.model, cfg.seed, os.path.join(out, "logs", "export-init.log"))
        with tensorio.TensorReader(ctx["init"]) as r:
            ctx["params"] = sum(math.prod(r.specs[n][1]) for n in r.names)
        ctx["outer"] = (cfg.outer_lr, cfg.outer_momentum)
        if cfg.link_mbit > 0:
            ctx["link"] = (cfg.link_mbit, cfg.link_latency_ms)
            print(f"WAN-shaped link per site: {cfg.link_mbit:g} Mbit/s each way, {cfg.link_latency_ms:g} ms; an "
                  f"fp32 delta or theta ({4 * ctx['params'] / 1e6:.2f} MB) takes "
                  f"{4 * ctx['params'] * 8 / (cfg.link_mbit * 1e6):.1f} s", flush=True)
        if cfg.sweep:
            table, best = sweep(cfg, ctx, launcher)
            ctx["outer"] = best or ctx["outer"]
            ctx["sweep_lines"] = sweep_table(table, best)
            ctx["sweep_best"] = table[best][0] if best else None
        if cfg.ddp:
            r = convergence.timed_arm("ddp", lambda: convergence.in_allocation(cfg, "ddp", ctx, launcher), cfg, ctx)
            ctx["ddp"] = r and r["heldout"]
        for arm in cfg.arm_list:
            r = convergence.timed_arm(arm, lambda: run_arm(cfg, arm, ctx, launcher, ctx["outer"]), cfg, ctx)
            if r is not None:
                results[arm] = r
    convergence.write_table(out, report(cfg, ctx, results))
    return 0 if len(results) == len(cfg.arm_list) else 1


def main(argv=None):
    d = WireBenchConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog="\n\n".join(__doc__.split("\n\n")[1:]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=d.out, help=f"work directory, wiped first (default {d.out})")
    p.add_argument("--corpus-mb", type=float, help="stdlib source bytes to tokenize, MB (default 1.0)")
    p.add_argument("--heldout-windows", type=int, help="held-out windows scored (default 128)")
    convergence.add_run_flags(p, d)
    p.add_argument("--arms", default=d.arms, help=f"comma-separated subset of {','.join(ARMS)} (default all)")
    p.add_argument("--no-sweep", dest="sweep", action="store_false",
                   help="skip the outer lr x momentum sweep (9 f32 arms) and use --outer-lr/--outer-momentum "
                        "(default FedAvg: lr 1, momentum 0)")
    p.add_argument("--outer-lr", type=float, default=d.outer_lr,
                   help=f"with --no-sweep: the aggregator's outer lr (default {d.outer_lr:g}: FedAvg)")
    p.add_argument("--outer-momentum", type=float, default=d.outer_momentum,
                   help=f"with --no-sweep: its Nesterov momentum (default {d.outer_momentum:g}: FedAvg)")
    p.add_argument("--no-ddp", dest="ddp", action="store_false", help="skip the DDP arm (the vs-DDP column)")
    p.add_argument("--link-mbit", type=float, default=d.link_mbit,
                   help="a WAN-shaped link per site, Mbit/s each way (default 0: plain loopback); "
                        "~2 makes qwen3-tiny's fp32 exchange about one inner phase of the quick size")
    p.add_argument("--link-latency-ms", type=float, default=d.link_latency_ms,
                   help=f"the link's added one-way latency, ms (default {d.link_latency_ms:g})")
    return run(WireBenchConfig(**vars(p.parse_args(argv))))


if __name__ == "__main__":
    sys.exit(main())
