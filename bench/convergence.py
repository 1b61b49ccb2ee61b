"""bench/convergence.py - held-out loss of plain DDP, DiLoCo in one allocation, and the same
DiLoCo across two federated sites through the central services.

Runs on: this machine's CPU (2 gloo ranks at a time), from the repository root:
    .venv/bin/python bench/convergence.py --quick     # ~1 MB of corpus, about 8 minutes here
    .venv/bin/python bench/convergence.py             # ~4.2 MB (4.1M training tokens), about 30 minutes
    .venv/bin/python bench/convergence.py --arms ddp,fed-fedavg    # a subset
It prints its estimated time first, then one line per arm as it finishes, then the table.
Work files: --out (default runs/bench-convergence/, wiped first).

The arms: the same model (--model, qwen3-tiny by default), the same initial weights
(--seed; the federated arms start FedMom from `train.py --export-init` with that
seed), the same corpus (this Python's standard library, byte tokens), one epoch of
its training windows, the same inner AdamW and LR schedule, 16 windows per step in
all (2 x --batch-size), and one held-out loss function for all (harness.heldout_loss on
the final weights: train.py's last checkpoint, or FedMom's final theta):
  (a) ddp            one site, plain DDP over 2 ranks: the global batch every step
  (b) diloco-fedavg  train.py --diloco-replicas 2 (one rank each), H = --inner-steps,
                     outer sgd lr 1.0 momentum 0 (FedAvg)
      diloco-nesterov  the same with outer Nesterov lr 0.7 momentum 0.9
  (c) fed-fedavg     two sites (torchrun 1 rank each, --federation) through darl_server,
                     fedmom_server (--outer-lr 1.0 --outer-momentum 0) and blobstore
      fed-nesterov   the same with fedmom --outer-lr 0.7 --outer-momentum 0.9
(c) is (b)'s algorithm on another carrier: equal work per site per round (one DARL
span of H x batch windows each, so equal token weights), the same H, inner optimizer
and schedule. What differs: DARL hands out the windows dynamically (--block-size 1,
blocks in a seeded permutation, each span shuffled) where (b) gives each replica a
static slice of one epoch permutation, so the two see the same windows in a
different order and grouping; and a round that only one site reaches before DARL
runs out (the last) is weighted by its tokens alone. Target: (c) within 1% of (b).
"""
import argparse
import dataclasses
import os
import shutil
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)                           # bench/ imports the repository's top-level scripts

import audit                                       # noqa: E402  (after the path line above)
import durable                                     # noqa: E402
import outer_state                           # noqa: E402
from testbed import harness                                     # noqa: E402
from outer_state import OUTER_LR, OUTER_MOMENTUM  # noqa: E402

ARMS = ("ddp", "diloco-fedavg", "diloco-nesterov", "fed-fedavg", "fed-nesterov")
OUTER = {"fedavg": ("sgd", 1.0, 0.0), "nesterov": ("nesterov", OUTER_LR, OUTER_MOMENTUM)}
LABEL = {"ddp": "(a) DDP, 2 ranks, global batch",
         "diloco-fedavg": "(b) DiLoCo k=2 in one job, FedAvg",
         "diloco-nesterov": f"(b) DiLoCo k=2 in one job, Nesterov {OUTER_LR}/{OUTER_MOMENTUM}",
         "fed-fedavg": "(c) 2 federated sites, FedAvg",
         "fed-nesterov": f"(c) 2 federated sites, Nesterov {OUTER_LR}/{OUTER_MOMENTUM}"}
TOKENS_PER_S = 25000.0          # 2 CPU ranks of qwen3-tiny here (train.py, seq 128): for the estimate only


@dataclasses.dataclass
class BenchConfig:
    out: str = "runs/bench-convergence"
    quick: bool = False
    corpus_mb: float | None = None        # default 4.2, --quick 1.0
    heldout_windows: int | None = None    # default 256, --quick 128
    seq_len: int = 128
    model: str = "qwen3-tiny"
    batch_size: int = 8
    inner_steps: int = 50
    lr: float = 3e-3
    min_lr: float = 3e-4
    seed: int = 0
    arms: str = ",".join(ARMS)
    timeout_min: float = 60.0
    known_arms = ARMS                     # what --arms may name (bench/wire_formats.py has its own)

    def validate(self):
        self.corpus_mb = self.corpus_mb or (1.0 if self.quick else 4.2)
        self.heldout_windows = self.heldout_windows or (128 if self.quick else 256)
        bad = [a for a in self.arm_list if a not in self.known_arms]
        if bad:
            raise SystemExit(f"--arms: unknown {', '.join(bad)}; use some of {', '.join(self.known_arms)}")
        if self.corpus_mb <= 0 or self.batch_size < 1 or self.inner_steps < 1:
            raise SystemExit("--corpus-mb, --batch-size and --inner-steps must be positive")
        return self

    @property
    def arm_list(self):
        return [a for a in self.arms.split(",") if a]


def common_args(cfg, steps, warmup, outer=True):
    """train.py flags every arm shares: the same schedule, steps and evaluation; H for the arms
    with an outer step (train.py refuses --diloco-inner-steps on plain DDP)."""
    return ["--model", cfg.model, "--batch-size", cfg.batch_size, "--lr", cfg.lr, "--min-lr", cfg.min_lr,
            "--warmup-steps", warmup, "--steps", steps, "--seed", cfg.seed, "--log-every", 50,
            "--eval-windows", cfg.heldout_windows] + (["--diloco-inner-steps", cfg.inner_steps] if outer else [])


def final_eval(run_dir):
    """train.py's own last eval row (the same held-out windows), as a cross-check."""
    rows = [r for r in durable.read_jsonl(os.path.join(run_dir, "metrics.jsonl")) if r.get("split") == "eval"]
    return rows[-1]["loss"] if rows else None


def run_job(launcher, name, cmd, log_path, timeout_s):
    p = launcher.start(name, cmd, log_path)
    if harness.wait_for(lambda: p.poll() is not None, timeout_s, 0.5) is None:
        p.stop(10)
        raise RuntimeError(f"{name} still running after {timeout_s:.0f} s; see {log_path}")
    if p.poll() != 0:
        raise RuntimeError(f"{name} failed (exit {p.poll()}); see {log_path}:\n  " + "\n  ".join(p.tail()))


def in_allocation(cfg, arm, ctx, launcher):
    """(a) or (b): one torchrun job of 2 ranks; returns its final checkpoint."""
    run_dir = os.path.join(ctx["out"], arm)
    cmd = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--standalone", "--nproc-per-node", 2,
           "train.py", "--device", "cpu", "--data", ctx["manifest"], "--parallel", "ddp",
           "--runs-dir", ctx["out"], "--run-name", arm, *common_args(cfg, ctx["steps"], ctx["warmup"], arm != "ddp")]
    if arm != "ddp":
        opt, lr, mom = OUTER[arm.split("-")[1]]
        cmd += ["--diloco-replicas", 2, "--diloco-outer-optimizer", opt, "--diloco-outer-lr", lr,
                "--diloco-outer-momentum", mom]
    run_job(launcher, arm, [str(c) for c in cmd], os.path.join(ctx["out"], "logs", f"{arm}.log"), ctx["timeout_s"])
    with open(os.path.join(run_dir, "checkpoints", "latest")) as f:
        weights = os.path.join(run_dir, "checkpoints", f.read().strip())
    return {"weights": weights, "train_eval": final_eval(run_dir), "rounds": None}


def federated(cfg, arm, ctx, launcher, site_args=(), outer=None, fed_args=()):
    """(c): the central services and two 1-rank sites; returns FedMom's final theta.
    bench/wire_formats.py's arms: site_args, more train.py flags for both sites (--wire ...);
    outer, (lr, momentum) at the aggregator instead of the arm's; fed_args, more
    fedmom_server.py flags (--down-wire ...); ctx["link"] = (Mbit/s, latency ms): each
    site reaches FedMom and the blob store through a WAN-shaped link of its own
    (bench/wan_relay.py)."""
    _, lr, mom = OUTER[arm.split("-")[1]] if outer is None else (None, *outer)
    arm_dir = os.path.join(ctx["out"], arm)
    os.makedirs(arm_dir)
    svc = harness.start_services(launcher, arm_dir, ctx["manifest"], ctx["init"], block_size=1, seed=cfg.seed,
                              fedmom_args=["--outer-lr", lr, "--outer-momentum", mom,
                                           # a round waits for both sites (equal weights, like (b))
                                           "--round-deadline-s", 3600, "--member-timeout-s", 600, *fed_args])
    links = []
    try:
        sites = [harness.launch_site(launcher, name, shaped(svc, ctx.get("link"), links), ctx["manifest"],
                                     log_dir=os.path.join(arm_dir, "logs"), nproc=1, parallel="ddp",
                                     runs_dir=os.path.join(arm_dir, "sites"),
                                     train_args=common_args(cfg, ctx["steps"], ctx["warmup"]) + list(site_args)
                                     + list(ctx.get("site_args", ())))
                 for name in ("alpha", "beta")]
        done = harness.wait_for(lambda: all(p.poll() is not None for p in sites), ctx["timeout_s"], 0.5)
    finally:
        for link in links:
            link.close()
    for p in sites:
        if done is None or p.poll() != 0:
            raise RuntimeError(f"{arm}: site {p.name} {'timed out' if done is None else f'failed (exit {p.poll()})'}; "
                               f"see {p.log_path}:\n  " + "\n  ".join(p.tail()))
    harness.wait_for(lambda: (harness.get_json(svc.fedmom, "/status", svc.token) or {}).get("pending_commits") == 0, 60)
    for p in svc.procs.values():
        p.stop(20)
    state = os.path.join(svc.state_dir, "fedmom")
    # the final theta_global, rebuilt from the stopped aggregator's checkpoint and the rounds
    # logged since (fedmom_server.py export; state.json names no theta file of its own)
    theta = os.path.join(arm_dir, "theta-final.safetensors")
    outer_state.load_outer(state).write("theta", theta, fsync=False)
    records = durable.read_jsonl(os.path.join(state, "rounds.jsonl"))
    coverage = audit.audit(svc.state_dir, manifest=ctx["manifest"]).ok
    site_evals = [final_eval(os.path.join(arm_dir, "sites", n)) for n in ("alpha", "beta")]
    return {"weights": theta, "train_eval": site_evals[0], "rounds": records, "coverage": coverage,
            "sites": os.path.join(arm_dir, "sites")}


def shaped(svc, link, links):
    """svc as one site sees it through a WAN-shaped link: its FedMom and blob store URLs
    point at relays of their own (appended to `links`); svc itself without a link."""
    if not link:
        return svc
    import urllib.parse
    import wan_relay
    urls = {}
    for key in ("fedmom", "blob"):
        u = urllib.parse.urlsplit(getattr(svc, key))
        relay = wan_relay.Link((u.hostname, u.port), *link).start()
        links.append(relay)
        urls[key] = f"{u.scheme}://127.0.0.1:{relay.port}"
    return dataclasses.replace(svc, **urls)


def fmt_ratio(x, base):
    return "-" if x is None or base is None else f"{x / base:.4f} ({100 * (x / base - 1):+.2f}%)"


def report(cfg, ctx, results):
    a = results.get("ddp", {}).get("heldout")
    lines = ["", f"Held-out loss after one epoch ({ctx['train_windows']:,} training windows x {cfg.seq_len} tokens "
             f"= {ctx['train_windows'] * cfg.seq_len / 1e6:.2f}M tokens, {ctx['heldout']} held-out windows), "
             f"{cfg.model}, H = {cfg.inner_steps}, {ctx['steps']} steps of 2 x {cfg.batch_size} windows:", "",
             f"  {'arm':<44} {'held-out':>9} {'vs (a)':>18} {'(c) vs (b)':>18} {'train.py eval':>13} {'min':>5}"]
    for arm in cfg.arm_list:
        r = results.get(arm)
        if r is None:
            lines.append(f"  {LABEL[arm]:<44} {'failed':>9}")
            continue
        match = results.get(arm.replace("fed-", "diloco-"), {}).get("heldout") if arm.startswith("fed-") else None
        te = "-" if r.get("train_eval") is None else f"{r['train_eval']:.4f}"
        lines.append(f"  {LABEL[arm]:<44} {r['heldout']:>9.4f} {fmt_ratio(r['heldout'], a):>18} "
                     f"{fmt_ratio(r['heldout'], match) if match else '':>18} {te:>13} {r['wall_s'] / 60:>5.1f}")
    lines.append("")
    for arm in cfg.arm_list:
        r = results.get(arm) or {}
        if r.get("rounds") is not None:
            recs = r["rounds"]
            both = sum(1 for x in recs if len(x.get("clusters", {})) == 2)
            lines.append(f"  {arm}: {len(recs)} merged rounds, {both} with both sites; coverage exactly once: "
                         f"{'yes' if r.get('coverage') else 'NO'}")
    for arm in ("fed-fedavg", "fed-nesterov"):
        b, c = results.get(arm.replace("fed-", "diloco-"), {}).get("heldout"), results.get(arm, {}).get("heldout")
        if b and c:
            gap = 100 * (c / b - 1)
            lines.append(f"  target (c) within 1% of (b), {arm}: {gap:+.2f}% -> {'met' if abs(gap) <= 1 else 'NOT met'}")
    lines += ["  (c)'s windows come from DARL's dynamic leases, (b)'s from static per-replica slices of one",
              "  permutation: the same windows, another order and grouping. Calibration quoted for a 0.8M-param",
              "  byte Qwen3 over 4.1M tokens: (b) at H=50 4.5% (FedAvg) and 8.8% (Nesterov) above (a)."]
    return "\n".join(lines)


def prepare(cfg, name, runs, overhead_s=20):
    """The work directory (wiped), the corpus and the context every arm reads; prints the
    estimate. Shared with bench/wire_formats.py. -> (out, manifest dict, ctx)."""
    out = os.path.abspath(cfg.out)
    if os.path.isdir(out):
        shutil.rmtree(out)
    os.makedirs(os.path.join(out, "logs"))
    m = harness.tokenize(os.path.join(out, "data"), cfg.corpus_mb * 1e6, cfg.seq_len, cfg.heldout_windows)
    train_windows = m["num_windows"] - m["heldout_windows"]
    steps = train_windows // (2 * cfg.batch_size)
    est = runs * (steps * 2 * cfg.batch_size * cfg.seq_len / TOKENS_PER_S + overhead_s)
    print(f"{name}: {runs} arms x {steps} steps ({train_windows:,} windows, "
          f"{train_windows * cfg.seq_len / 1e6:.2f}M tokens each); estimated {est / 60:.0f} min on 2 CPU cores",
          flush=True)
    ctx = {"out": out, "manifest": m["path"], "train_windows": train_windows, "steps": steps,
           "warmup": steps // 20, "heldout": m["heldout_windows"], "timeout_s": cfg.timeout_min * 60}
    return out, m, ctx


def run(cfg: BenchConfig):
    cfg.validate()
    out, m, ctx = prepare(cfg, "convergence", len(cfg.arm_list))
    results = {}
    with harness.Launcher() as launcher:
        if any(a.startswith("fed-") for a in cfg.arm_list):
            ctx["init"] = harness.export_init(launcher, os.path.join(out, "data", "init.safetensors"), m["path"],
                                           cfg.model, cfg.seed, os.path.join(out, "logs", "export-init.log"))
            print(f"initial model: held-out loss {harness.heldout_loss(ctx['init'], m['path'], cfg.model):.4f}",
                  flush=True)
        for arm in cfg.arm_list:
            fn = federated if arm.startswith("fed-") else in_allocation
            r = timed_arm(arm, lambda: fn(cfg, arm, ctx, launcher), cfg, ctx)
            if r is not None:
                results[arm] = r
    write_table(out, report(cfg, ctx, results))
    return 0 if len(results) == len(cfg.arm_list) else 1


def timed_arm(name, fn, cfg, ctx):
    """Run one arm (fn() -> its result dict with "weights"): adds wall_s and the held-out
    loss, prints its line; None, printed as FAILED, if it raised RuntimeError."""
    t0 = time.monotonic()
    try:
        r = fn()
    except RuntimeError as e:
        print(f"  {name}: FAILED: {e}", flush=True)
        return None
    r["wall_s"] = time.monotonic() - t0
    r["heldout"] = harness.heldout_loss(r["weights"], ctx["manifest"], cfg.model)
    print(f"  {name:<16} held-out {r['heldout']:.4f}  ({r['wall_s'] / 60:.1f} min)", flush=True)
    return r


def write_table(out, text):
    print(text)
    with open(os.path.join(out, "table.txt"), "w") as f:
        f.write(text + "\n")


def main(argv=None):
    d = BenchConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog="\n\n".join(__doc__.split("\n\n")[1:]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="~1 MB of corpus, 128 held-out windows (default: 4.2 MB, 256)")
    p.add_argument("--out", default=d.out, help=f"work directory, wiped first (default {d.out})")
    p.add_argument("--corpus-mb", type=float, help="stdlib source bytes to tokenize, MB (default 4.2; --quick 1.0)")
    p.add_argument("--heldout-windows", type=int, help="held-out windows scored (default 256; --quick 128)")
    add_run_flags(p, d)
    p.add_argument("--arms", default=d.arms, help=f"comma-separated subset of {','.join(ARMS)} (default all)")
    return run(BenchConfig(**vars(p.parse_args(argv))))


def add_run_flags(p, d):
    """The flags of one training run, shared with bench/wire_formats.py (d: the config's defaults)."""
    p.add_argument("--seq-len", type=int, default=d.seq_len, help=f"tokens per window (default {d.seq_len})")
    p.add_argument("--model", default=d.model, help=f"model (default {d.model})")
    p.add_argument("--batch-size", type=int, default=d.batch_size,
                   help=f"windows per rank (= per replica, per site) per step (default {d.batch_size})")
    p.add_argument("--inner-steps", type=int, default=d.inner_steps,
                   help=f"H (default {d.inner_steps or 'the epoch steps // --rounds'})")
    p.add_argument("--lr", type=float, default=d.lr, help=f"inner AdamW peak LR (default {d.lr})")
    p.add_argument("--min-lr", type=float, default=d.min_lr, help=f"LR at the end of the cosine (default {d.min_lr})")
    p.add_argument("--seed", type=int, default=d.seed, help=f"model init and DARL seed (default {d.seed})")
    p.add_argument("--timeout-min", type=float, default=d.timeout_min, help=f"per arm, minutes (default {d.timeout_min:g})")


if __name__ == "__main__":
    sys.exit(main())
