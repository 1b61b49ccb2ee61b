"""bench/wan_tricks.py - the WAN tricks (compressed deltas and theta_global, overlap) measured
long enough to tell them apart: every arm over several seeds at 40+ outer rounds, its held-out
loss as a ratio to the f32 arm of the SAME seed, and DiLoCo's gap to DDP at two model sizes.

Runs on: this machine's CPU (two 1-rank sites, or one 2-rank DDP job, at a time), from the
repository root:
    .venv/bin/python bench/wan_tricks.py --json wan.json     # the full measurement (~75 min on 2 cores)
    .venv/bin/python bench/wan_tricks.py --quick              # what make bench runs: 2 seeds, 2 arms, ~5 min
    .venv/bin/python bench/wan_tricks.py --arms f32,int4-both --seeds 2 --no-sweep --gap-model none
    .venv/bin/python bench/wan_tricks.py --report wan.json    # the tables again from a --json file
It prints its estimated time first, one line per run as it finishes, then the tables; --json
FILE holds every figure, rewritten after each run (an interrupted bench keeps what it measured,
and --report FILE prints its tables).
Work files: --out (default runs/bench-wan-tricks/, wiped first).

Why seeds: between seeds the f32 arm's own held-out loss moves ~3% (bench/wire_formats.py's
quick setting, 10 rounds), so one run per arm cannot tell a 1% cost. A seed (--seed, then
--seed + 1, ...) is every process's --seed: the initial model (train.py --export-init),
DARL's block permutation (darl_server.py --seed) and the shuffle of each leased span
(train.py --seed). Which site gets which lease still follows the sites' timing, so one seed
run twice differs too: the arm f32-twin (the f32 arm again) measures by how much. The
paired ratio divides out what a seed does to every arm alike.

The steps, in order:
  1. the corpus: --corpus-mb of this Python's standard library (byte tokens), one epoch of
     its training windows, 2 x --batch-size windows per step; H = the epoch's steps //
     --rounds (or --inner-steps), so every federated arm merges at least --rounds rounds
  2. the outer settings (--no-sweep: --outer-lr and --outer-momentum for every arm): each
     arm over --sweep-lr x --sweep-momentum on a seed of its own (--sweep-seed; a pick made
     on a measured seed would flatter that seed) and a --sweep-frac share of the corpus at
     the same H (fewer rounds: cheaper); its best is that arm's setting from then on
  3. the gap at a second size (--gap-model; none: skip): DDP and the f32 arm of that model on
     the same corpus, H and first --gap-seeds seeds, with the f32 arm's outer setting (before
     the seeds below: a bench cut short loses a seed of some arms, not the second size)
  4. per seed: DDP (one job of 2 ranks, the global batch every step: bench/convergence.py's
     (a), the same tokens) and every arm: bench/wire_formats.py's ARMS, two federated
     sites through darl_server, fedmom_server and the blob store, the same init, corpus,
     inner AdamW and schedule; only the sites' --wire / --overlap flags and FedMom's
     --down-wire and outer setting differ. DiLoCo's gap at this size is its f32 arm over DDP
An arm whose sites run --overlap reaches FedMom and the blob store through a WAN-shaped link
per site (--link-mbit, --link-latency-ms: bench/wan_relay.py), so its utilisation says what
overlap hides; the others run on plain loopback, where the loss is the same and a round
costs less (--link-all: every arm on the link).
Where an overlapped site folds theta_global in decides what overlap costs (the fold column and
the "Overlap alone" table): at H = 12 this model's phase is ~0.3 s, shorter than any WAN round
trip's fixed latencies (polls, the wait for the other site, the merge), so every fold lands a
whole phase late; a real site's phase is minutes. --step-ms N makes every inner step last at
least N ms on every arm (train.py --throttle-ms; a sleep: the loss does not move) so that the
round trip is the share of a phase it would be at a real site: e.g. --step-ms 100 with the
default 5 Mbit/s link, where an fp32 exchange takes about one phase (1.5 s).
Figures, per arm: its outer setting; up and down B/param per site and round (the files as
sent, headers included: bench/wire_formats.py's columns); util = time in inner steps /
(that + the round trip outside them), both sites, and idle s per site and round; merged
rounds; held-out / the same seed's f32 held-out and / the same seed's DDP held-out, each as
mean, min, max and std over the seeds. The per-seed held-out losses follow.
"""
import argparse
import dataclasses
import math
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)                           # bench/ imports the repository's top-level scripts

import convergence                                 # noqa: E402  (bench/convergence.py, this directory)
import durable                                     # noqa: E402
from testbed import harness                                     # noqa: E402
import tensorio                                    # noqa: E402
import wire_formats                                # noqa: E402  (bench/wire_formats.py: ARMS, run_arm)

# The arms in the order the table shows them; those that wire_formats.ARMS lacks are left out.
ORDER = ("f32", "int4-both", "int2", "int2-both", "sparseloco", "topk", "f32-overlap", "int4-both-overlap",
         "f32-eager", "int4-both-eager")
DEFAULT_ARMS = tuple(a for a in ORDER if a in wire_formats.ARMS)
QUICK_ARMS = ("f32", "int4-both")
TWIN = "f32-twin"                  # the f32 arm again on the same seed: what a rerun alone moves
GAP_MODEL = "qwen3-mini"
# For the estimate only, measured on this machine (2 shared cores, qwen3-tiny): a federated
# run's fixed cost (the servers, two torchrun sites, evals, the held-out score), each
# round's, and the CPU's FLOP/s on a larger model (2 ranks, fp32).
OVERHEAD_S, ROUND_S, CPU_FLOPS = 20.0, 0.3, 60e9


@dataclasses.dataclass
class TricksConfig(convergence.BenchConfig):
    out: str = "runs/bench-wan-tricks"
    json: str | None = None
    arms: str | None = None              # default DEFAULT_ARMS; --quick QUICK_ARMS
    seeds: int | None = None             # default 3, --quick 2
    rounds: int | None = None            # default 40 (--quick 8) unless --inner-steps
    inner_steps: int | None = None
    ddp: bool = True
    sweep: bool | None = None            # default on; --quick off
    sweep_lr: str = "0.7,1.0"
    sweep_momentum: str = "0,0.9"
    sweep_seed: int = 100
    sweep_frac: float = 0.5
    outer_lr: float = 1.0
    outer_momentum: float = 0.0
    link_mbit: float = 5.0
    link_latency_ms: float = 50.0
    link_all: bool = False
    step_ms: int = 0
    gap_model: str | None = None         # default GAP_MODEL; --quick none
    gap_seeds: int = 1
    timeout_min: float = 30.0
    known_arms = tuple(wire_formats.ARMS) + (TWIN,)

    def validate(self):
        q = self.quick
        self.corpus_mb = self.corpus_mb or (0.25 if q else 1.0)
        self.heldout_windows = self.heldout_windows or (64 if q else 256)
        self.arms = self.arms or ",".join(QUICK_ARMS if q else DEFAULT_ARMS)
        self.sweep = (not q) if self.sweep is None else self.sweep
        self.gap_model = self.gap_model or ("none" if q else GAP_MODEL)
        self.seeds = (2 if q else 3) if self.seeds is None else self.seeds
        if self.rounds is not None and self.inner_steps is not None:
            raise SystemExit("--rounds and --inner-steps both given: give one (H = the epoch's steps // --rounds)")
        if self.inner_steps is None:
            self.rounds = (8 if q else 40) if self.rounds is None else self.rounds
        bad = [a for a in self.arm_list if a not in self.known_arms]
        if bad:
            raise SystemExit(f"--arms: unknown {', '.join(bad)}; use some of {', '.join(self.known_arms)} "
                             f"(bench/wire_formats.py's ARMS, and {TWIN})")
        if self.gap_model != "none":
            import models                  # (torch) only when a second size runs
            if not models.is_llm(self.gap_model):
                raise SystemExit(f"--gap-model {self.gap_model}: use a Qwen3 flavor "
                                 f"({', '.join(models.QWEN3_FLAVORS)}) or none")
        if self.seeds < 1 or (self.rounds or 1) < 1 or (self.inner_steps or 1) < 1:
            raise SystemExit("--seeds, --rounds and --inner-steps must be at least 1")
        if not 0 <= self.gap_seeds <= self.seeds:
            raise SystemExit(f"--gap-seeds {self.gap_seeds}: the first N of the {self.seeds} seeds (--seeds), "
                             f"so 0 to {self.seeds}")
        if not 0 < self.sweep_frac <= 1:
            raise SystemExit(f"--sweep-frac {self.sweep_frac}: a share of the corpus, in (0, 1]")
        if self.step_ms < 0:
            raise SystemExit(f"--step-ms {self.step_ms}: a duration, >= 0")
        if self.corpus_mb <= 0 or self.batch_size < 1:
            raise SystemExit("--corpus-mb and --batch-size must be positive")
        return self

    @property
    def arm_list(self):
        """The arms asked for, the reference f32 first whether asked for or not."""
        return ["f32"] + [a for a in (self.arms or "").split(",") if a and a != "f32"]

    @property
    def seed_list(self):
        return list(range(self.seed, self.seed + self.seeds))

    @property
    def grid(self):
        return [(float(lr), float(mu)) for lr in self.sweep_lr.split(",") for mu in self.sweep_momentum.split(",")]


# ---------------------------------------------------------------------------
# The bookkeeping: paired ratios (pure functions; tests/test_wan_tricks.py)
# ---------------------------------------------------------------------------

def paired(runs, arm, ref, kind="main", model=None):
    """{seed: held-out of `arm` / held-out of `ref` of the SAME seed}, over the runs of `kind`
    (and `model`) where both finished."""
    by = {(r["arm"], r["seed"]): r["heldout"] for r in runs
          if r["kind"] == kind and (model is None or r["model"] == model) and r.get("heldout") is not None}
    return {s: h / by[(ref, s)] for (a, s), h in sorted(by.items()) if a == arm and (ref, s) in by}


def spread(xs):
    """{n, mean, min, max, std (sample; 0 for one value)} of a list of numbers, or None."""
    xs = list(xs)
    if not xs:
        return None
    return {"n": len(xs), "mean": statistics.fmean(xs), "min": min(xs), "max": max(xs),
            "std": statistics.stdev(xs) if len(xs) > 1 else 0.0}


def arm_summary(runs, arm, kind="main", model=None):
    """One arm's figures over its seeds: ratios to f32 and to DDP (same seed), bytes, utilisation."""
    mine = [r for r in runs if r["kind"] == kind and r["arm"] == arm and r.get("heldout") is not None
            and (model is None or r["model"] == model)]
    def mean(k):
        vals = [r.get(k) for r in mine]
        return statistics.fmean(vals) if vals and None not in vals else None
    return {"seeds": [r["seed"] for r in mine], "heldout": {r["seed"]: r["heldout"] for r in mine},
            "vs_f32": spread(paired(runs, arm, "f32", kind, model).values()),
            "vs_ddp": spread(paired(runs, arm, "ddp", kind, model).values()),
            **{k: mean(k) for k in ("up", "down", "phase_s", "util", "idle", "fold", "rounds", "wall_s")}}


def num(v, spec):
    return "-" if v is None else format(v, spec)


def fmt_outer(outer):
    return "{:g}/{:g}".format(*outer)


def tokens(cfg, data):
    """Tokens one epoch of `data` trains (both sites, or DDP's 2 ranks, together)."""
    return data["steps"] * 2 * cfg.batch_size * cfg.seq_len


def rounds_of(cfg, data):
    """Outer rounds of one epoch of `data` at H = cfg.inner_steps (the last one may be short)."""
    return -(-data["steps"] // cfg.inner_steps)


def pct(x):
    return "-" if x is None else f"{100 * (x - 1):+.2f}%"


def fmt_spread(s):
    """mean, min, max and std of a ratio, in percent."""
    if s is None:
        return f"{'-':>8} {'':>8} {'':>8} {'':>6}"
    return f"{pct(s['mean']):>8} {pct(s['min']):>8} {pct(s['max']):>8} {100 * s['std']:>6.2f}"


# ---------------------------------------------------------------------------
# The runs
# ---------------------------------------------------------------------------

def model_speed(model, vocab, seq_len):
    """(parameters, estimated tokens/s of 2 CPU ranks) of a Qwen3 flavor: tiny is bound by
    overheads (convergence.TOKENS_PER_S), larger ones by CPU_FLOPS."""
    import models
    meta = models.build_model(model, vocab, seq_len)
    n = models.count_params(meta)
    return n, min(convergence.TOKENS_PER_S, CPU_FLOPS / models.llm_flops_per_token(meta.model_args, n))


def phase_s(r):
    """A federated run's inner steps per phase, s (mean over both sites' phases); None for DDP."""
    rows = wire_formats.site_rows(r["sites"]) if r.get("sites") else []
    return statistics.fmean(x["inner_s"] for x in rows) if rows else None


def fold_at(r, h):
    """An --overlap run's mean share of the next phase trained before theta_global came and was
    folded in (0.1: after a tenth of it; 1.0: at its end, the whole phase a round late), over
    both sites' deltas but the last ones (no next phase); None without --overlap."""
    rows = wire_formats.site_rows(r["sites"]) if r.get("sites") else []
    late = [(x["fold_step"] - x["step"]) / h for x in rows if x.get("fold_step") and x["fold_step"] > x["step"]]
    return statistics.fmean(late) if late else None


def corpus(cfg, out, name, mb):
    """One tokenized share of the stdlib corpus -> the ctx fields its runs read."""
    m = harness.tokenize(os.path.join(out, name), mb * 1e6, cfg.seq_len, cfg.heldout_windows)
    train = m["num_windows"] - m["heldout_windows"]
    steps = train // (2 * cfg.batch_size)
    return {"manifest": m["path"], "train_windows": train, "steps": steps, "warmup": steps // 20,
            "heldout": m["heldout_windows"], "vocab": m["vocab_size"], "mb": mb}


class Bench:
    """The runs of one bench in order, each recorded (and --json rewritten) as it finishes."""

    def __init__(self, cfg, out, launcher, main, sweep_data):
        self.cfg, self.out, self.launcher, self.main, self.sweep_data = cfg, out, launcher, main, sweep_data
        self.runs, self.inits, self.params, self.best, self.plan = [], {}, {}, {}, []
        self.t0, self.est_done = time.monotonic(), 0.0

    def init(self, model, seed):
        """The initial global model of (model, seed): train.py --export-init, once."""
        key = (model, seed)
        if key not in self.inits:
            path = os.path.join(self.out, "inits", f"{model}-seed{seed}.safetensors")
            os.makedirs(os.path.dirname(path), exist_ok=True)
            self.inits[key] = harness.export_init(self.launcher, path, self.main["manifest"], model, seed,
                                                  os.path.join(self.out, "logs", f"init-{model}-{seed}.log"))
            with tensorio.TensorReader(path) as r:
                self.params[model] = sum(math.prod(r.specs[n][1]) for n in r.names)
        return self.inits[key]

    def on_link(self, arm):
        flags = wire_formats.ARMS["f32" if arm == TWIN else arm][0]
        return self.cfg.link_mbit > 0 and (self.cfg.link_all or "--overlap" in flags)

    def federated(self, kind, arm, seed, outer, model=None, data=None):
        cfg = dataclasses.replace(self.cfg, seed=seed, model=model or self.cfg.model)
        data = data or self.main
        where = os.path.join(self.out, kind, f"{cfg.model}-seed{seed}",
                             *([f"outer-{outer[0]:g}-{outer[1]:g}"] if kind == "sweep" else []),
                             *(["twin"] if arm == TWIN else []))
        link = (cfg.link_mbit, cfg.link_latency_ms) if self.on_link(arm) else None
        ctx = dict(data, out=where, init=self.init(cfg.model, seed), params=self.params[cfg.model],
                   timeout_s=cfg.timeout_min * 60, link=link,
                   site_args=["--throttle-ms", str(cfg.step_ms)] if cfg.step_ms else [])
        label = f"{kind} {cfg.model} {arm} seed {seed}" + (f" outer {fmt_outer(outer)}" if kind == "sweep" else "")
        r = convergence.timed_arm(label, lambda: wire_formats.run_arm(cfg, "f32" if arm == TWIN else arm, ctx,
                                                                      self.launcher, outer), cfg, ctx)
        return self.record(r, kind=kind, arm=arm, seed=seed, model=cfg.model, outer=list(outer),
                           link=list(link) if link else None)

    def ddp(self, kind, seed, model=None):
        cfg = dataclasses.replace(self.cfg, seed=seed, model=model or self.cfg.model)
        ctx = dict(self.main, out=os.path.join(self.out, kind, f"{cfg.model}-seed{seed}"),
                   timeout_s=cfg.timeout_min * 60)
        self.init(cfg.model, seed)                   # the parameter count
        r = convergence.timed_arm(f"{kind} {cfg.model} ddp seed {seed}",
                                  lambda: convergence.in_allocation(cfg, "ddp", ctx, self.launcher), cfg, ctx)
        return self.record(r, kind=kind, arm="ddp", seed=seed, model=cfg.model, outer=None, link=None)

    def record(self, r, **key):
        row = dict(key, heldout=None)
        if r is not None:
            row.update(heldout=r["heldout"], wall_s=round(r["wall_s"], 1), train_eval=r.get("train_eval"),
                       rounds=len(r["rounds"]) if r.get("rounds") is not None else None,
                       coverage=r.get("coverage"),
                       phase_s=phase_s(r), fold=fold_at(r, self.cfg.inner_steps),
                       **{k: r.get(k) for k in ("up", "down", "payload", "util", "idle")})
        self.runs.append(row)
        self.est_done += self.plan.pop(0) if self.plan else 0.0
        spent = time.monotonic() - self.t0
        left = sum(self.plan) * (spent / self.est_done if self.est_done else 1.0)
        print(f"      ({len(self.runs)} runs, {spent / 60:.1f} min so far; about {left / 60:.0f} min left)", flush=True)
        self.save()
        return row

    def save(self, text=None):
        if self.cfg.json:
            durable.write_json(self.cfg.json, summary(self.cfg, self, text), fsync=False, indent=1)


def sweep(bench):
    """Each arm over the grid on --sweep-seed and the sweep's share of the corpus: its best setting."""
    cfg = bench.cfg
    for arm in (a for a in cfg.arm_list if a != TWIN):
        got = {}
        for outer in cfg.grid:
            r = bench.federated("sweep", arm, cfg.sweep_seed, outer, data=bench.sweep_data)
            if r["heldout"] is not None and math.isfinite(r["heldout"]):     # a diverged setting: nan
                got[tuple(outer)] = r["heldout"]
        bench.best[arm] = min(got, key=got.get) if got else (cfg.outer_lr, cfg.outer_momentum)
    bench.best[TWIN] = bench.best["f32"]


def plan(cfg, main, sweep_data, speeds):
    """[estimated seconds of each run, in the order they run] and its breakdown as text."""
    def fed(data, model):
        return (OVERHEAD_S + ROUND_S * rounds_of(cfg, data) + tokens(cfg, data) / speeds[model][1]
                + data["steps"] * cfg.step_ms / 1e3)

    def ddp(model):
        return OVERHEAD_S / 2 + tokens(cfg, main) / speeds[model][1]

    arms = [a for a in cfg.arm_list if a != TWIN]
    out, lines = [], []
    if cfg.sweep:
        out += [fed(sweep_data, cfg.model)] * len(arms) * len(cfg.grid)
        lines.append(f"sweep {len(arms)} arms x {len(cfg.grid)} settings, ~{out[-1]:.0f} s each")
    if cfg.gap_model != "none" and cfg.ddp and cfg.gap_seeds:
        g = [ddp(cfg.gap_model), fed(main, cfg.gap_model)] * cfg.gap_seeds
        out += g
        lines.append(f"{cfg.gap_model}: {cfg.gap_seeds} seeds x (DDP + f32), ~{g[0]:.0f} + {g[1]:.0f} s")
    per_seed = ([ddp(cfg.model)] if cfg.ddp else []) + [fed(main, cfg.model)] * len(cfg.arm_list)
    out += per_seed * cfg.seeds
    lines.append(f"{cfg.seeds} seeds x ({'DDP + ' if cfg.ddp else ''}{len(cfg.arm_list)} arms), "
                 f"~{fed(main, cfg.model):.0f} s each")
    return out, "; ".join(lines)


def run(cfg: TricksConfig):
    cfg.validate()
    out = os.path.abspath(cfg.out)
    if os.path.isdir(out):
        import shutil
        shutil.rmtree(out)
    os.makedirs(os.path.join(out, "logs"))
    main = corpus(cfg, out, "data", cfg.corpus_mb)
    if cfg.inner_steps is None:
        cfg.inner_steps = main["steps"] // cfg.rounds
        if cfg.inner_steps < 1:
            raise SystemExit(f"--rounds {cfg.rounds}: {cfg.corpus_mb:g} MB of corpus gives {main['steps']} steps; "
                             f"raise --corpus-mb or lower --rounds")
    sweep_data = (corpus(cfg, out, "sweep-data", cfg.corpus_mb * cfg.sweep_frac)
                  if cfg.sweep and cfg.sweep_frac < 1 else main)
    models_used = [cfg.model] + ([cfg.gap_model] if cfg.gap_model != "none" and cfg.gap_seeds else [])
    speeds = {m: model_speed(m, main["vocab"], cfg.seq_len) for m in models_used}
    est, breakdown = plan(cfg, main, sweep_data, speeds)
    print(f"wan_tricks: {cfg.corpus_mb:g} MB of corpus, {main['train_windows']:,} training windows, {main['steps']} "
          f"steps of 2 x {cfg.batch_size} x {cfg.seq_len} tokens ({tokens(cfg, main) / 1e6:.2f}M tokens); "
          f"H = {cfg.inner_steps}: {rounds_of(cfg, main)} rounds; seeds {cfg.seed_list}", flush=True)
    print(f"estimated {sum(est) / 60:.0f} min on 2 CPU cores for {len(est)} runs: {breakdown}", flush=True)
    with harness.Launcher() as launcher:
        bench = Bench(cfg, out, launcher, main, sweep_data)
        bench.plan = est
        bench.init(cfg.model, cfg.seed)
        n = bench.params[cfg.model]
        if cfg.link_mbit > 0:
            print(f"WAN-shaped link per site ({'every arm' if cfg.link_all else 'the --overlap arms'}): "
                  f"{cfg.link_mbit:g} Mbit/s each way, {cfg.link_latency_ms:g} ms; an fp32 delta or theta of "
                  f"{cfg.model} ({4 * n / 1e6:.2f} MB) takes {4 * n * 8 / (cfg.link_mbit * 1e6):.2f} s", flush=True)
        if cfg.step_ms:
            print(f"every inner step lasts at least {cfg.step_ms} ms (train.py --throttle-ms): a phase of H = "
                  f"{cfg.inner_steps} steps at least {cfg.inner_steps * cfg.step_ms / 1e3:.2f} s", flush=True)
        if cfg.sweep:
            sweep(bench)
        else:
            bench.best = {a: (cfg.outer_lr, cfg.outer_momentum) for a in cfg.arm_list}
        if cfg.gap_model != "none" and cfg.ddp:
            for seed in cfg.seed_list[:cfg.gap_seeds]:
                bench.ddp("gap", seed, cfg.gap_model)
                bench.federated("gap", "f32", seed, bench.best["f32"], model=cfg.gap_model)
        for seed in cfg.seed_list:
            if cfg.ddp:
                bench.ddp("main", seed)
            for arm in cfg.arm_list:
                bench.federated("main", arm, seed, bench.best[arm])
    text = report(cfg, bench)
    convergence.write_table(out, text)
    bench.save(text)
    failed = [r for r in bench.runs if r["heldout"] is None]
    return 1 if failed else 0


# ---------------------------------------------------------------------------
# The tables and the JSON
# ---------------------------------------------------------------------------

def summary(cfg, bench, text=None):
    arms = (["ddp"] if cfg.ddp else []) + cfg.arm_list
    out = {"config": dataclasses.asdict(cfg), "corpus": bench.main, "sweep_corpus": bench.sweep_data,
           "params": bench.params,
           "best_outer": {a: list(v) for a, v in bench.best.items()}, "runs": bench.runs,
           "arms": {a: arm_summary(bench.runs, a) for a in arms}, "gap": gap_summary(cfg, bench)}
    if text:
        out["table"] = text
    return out


def gap_summary(cfg, bench):
    """DiLoCo (the f32 arm) over DDP, same seed, per model size."""
    sizes = [("main", cfg.model)] + ([("gap", cfg.gap_model)] if cfg.gap_model != "none" else [])
    return {model: {"params": bench.params.get(model),
                    "ratio": spread(paired(bench.runs, "f32", "ddp", kind, model).values()),
                    "ddp": arm_summary(bench.runs, "ddp", kind, model)["heldout"],
                    "f32": arm_summary(bench.runs, "f32", kind, model)["heldout"]}
            for kind, model in sizes}


def sweep_lines(cfg, bench):
    data, head = bench.sweep_data, "arm \\ lr/momentum"
    lines = ["", f"Outer settings per arm (seed {cfg.sweep_seed}, {data['mb']:g} MB of corpus: "
                 f"{rounds_of(cfg, data)} rounds of H = {cfg.inner_steps}); held-out loss (merged rounds), "
                 f"* = the arm's setting below:", "",
             f"  {head:<20}" + "".join(f"{f'{lr:g}/{mu:g}':>16}" for lr, mu in cfg.grid)]
    for arm in (a for a in cfg.arm_list if a != TWIN):
        cells = []
        for outer in cfg.grid:
            r = next((x for x in bench.runs
                      if x["kind"] == "sweep" and x["arm"] == arm and tuple(x["outer"]) == outer), None)
            mark = "*" if tuple(bench.best.get(arm, ())) == outer else " "
            ok = r is not None and r["heldout"] is not None
            cells.append(f"{r['heldout']:.4f} ({r['rounds']:>2}){mark}" if ok else "failed")
        lines.append(f"  {arm:<20}" + "".join(f"{c:>16}" for c in cells))
    return lines


def report(cfg, bench):
    main = bench.main
    link = f"{cfg.link_mbit:g} Mbit/s, {cfg.link_latency_ms:g} ms"
    lines = sweep_lines(cfg, bench) if cfg.sweep else []
    lines += ["", f"WAN tricks over {cfg.seeds} seeds {cfg.seed_list}: 2 federated sites, {cfg.model} "
                  f"({bench.params.get(cfg.model, 0):,} parameters), H = {cfg.inner_steps}, one epoch of "
                  f"{main['train_windows']:,} windows x {cfg.seq_len} tokens; link: WAN-shaped ({link} per site) or "
                  f"lo(opback); ratios to the f32 arm and to DDP of the SAME seed, in % (mean, min, max, std):", "",
              f"  {'arm':<18} {'outer':>7} {'link':>4} {'up B/p':>7} {'down B/p':>8} {'phase s':>7} {'util':>5} "
              f"{'idle s':>6} {'fold':>4} {'rounds':>6}  {'vs f32':>8} {'min':>8} {'max':>8} {'std':>6}  {'vs DDP':>8} {'min':>8} "
              f"{'max':>8} {'std':>6} {'min/run':>7}"]
    for arm in (["ddp"] if cfg.ddp else []) + cfg.arm_list:
        s = arm_summary(bench.runs, arm)
        if not s["seeds"]:
            lines.append(f"  {arm:<18} {'failed':>7}")
            continue
        outer = "-" if arm == "ddp" else fmt_outer(bench.best[arm])
        lk = "-" if arm == "ddp" else ("WAN" if bench.on_link(arm) else "lo")
        vs_f32, vs_ddp = (s["vs_f32"] if arm != "f32" else None), (s["vs_ddp"] if arm != "ddp" else None)
        lines.append(f"  {arm:<18} {outer:>7} {lk:>4} {num(s['up'], '.3f'):>7} {num(s['down'], '.3f'):>8} "
                     f"{num(s['phase_s'], '.2f'):>7} {num(s['util'], '.2f'):>5} {num(s['idle'], '.2f'):>6} "
                     f"{num(s.get('fold'), '.2f'):>4} "
                     f"{num(s['rounds'], '.0f'):>6}  "
                     f"{fmt_spread(vs_f32)}  {fmt_spread(vs_ddp)} {num(s['wall_s'] and s['wall_s'] / 60, '.1f'):>7}")
    lines += ["", "  held-out loss per seed:" + "".join(f"{f'seed {s}':>10}" for s in cfg.seed_list)]
    for arm in (["ddp"] if cfg.ddp else []) + cfg.arm_list:
        h = arm_summary(bench.runs, arm)["heldout"]
        lines.append(f"  {arm:<23}" + "".join(f"{h[s]:>10.4f}" if s in h else f"{'-':>10}" for s in cfg.seed_list))
    lines += overlap_lines(cfg, bench)
    lines += gap_lines(cfg, bench)
    lines += ["", "  up/down: the files as sent per site and round (headers included); phase s: a phase's inner steps;",
              "  util: time in inner steps / (that + send + wait + download; under --overlap the settle time",
              "  instead), both sites; idle s: that remainder per site and round; fold (--overlap): the share",
              "  of the next phase trained before theta_global came and was folded in (1.00: the whole phase",
              "  a round late). f32-twin, where run: the f32 arm again on the same seed (what a rerun alone",
              "  moves: the leases' split between the sites follows their timing)."]
    return "\n".join(lines)


def unlapped(arm):
    """The arm an --overlap arm is the overlapped twin of (same formats, no overlap), or None."""
    for tail in ("-overlap-end", "-overlap", "-eager"):
        if arm.endswith(tail):
            return arm[:-len(tail)]
    return None


def overlap_lines(cfg, bench):
    """Each --overlap arm against its own non-overlapped arm of the same seed (where both ran):
    what overlap alone costs, beside where its folds landed."""
    pairs = [(a, unlapped(a)) for a in cfg.arm_list if unlapped(a) in cfg.arm_list]
    if not pairs:
        return []
    lines = ["", "Overlap alone: each --overlap arm against the same formats not overlapped, same seed:", "",
             f"  {'arm':<20} {'against':<12} {'util':>5} {'fold':>4}  {'cost':>8} {'min':>8} {'max':>8} {'std':>6}"]
    for arm, base in pairs:
        s = arm_summary(bench.runs, arm)
        lines.append(f"  {arm:<20} {base:<12} {num(s['util'], '.2f'):>5} {num(s.get('fold'), '.2f'):>4}  "
                     f"{fmt_spread(spread(paired(bench.runs, arm, base).values()))}")
    return lines


def gap_lines(cfg, bench):
    if not cfg.ddp:
        return []
    main, n_tok = bench.main, tokens(cfg, bench.main)
    lines = ["", f"DiLoCo (2 sites, f32 deltas, the f32 arm's outer setting {fmt_outer(bench.best['f32'])}) against "
                 f"DDP at equal tokens ({n_tok / 1e6:.2f}M, H = {cfg.inner_steps}, {rounds_of(cfg, main)} rounds), "
                 "same seed:", "",
             f"  {'model':<12} {'parameters':>11} {'tokens/param':>12} {'seeds':>5} {'DDP':>8} {'DiLoCo':>8}  "
             f"{'gap':>8} {'min':>8} {'max':>8} {'std':>6}"]
    for model, g in gap_summary(cfg, bench).items():
        n = g["params"] or 0
        ddp, fed = (statistics.fmean(g[k].values()) if g[k] else float("nan") for k in ("ddp", "f32"))
        lines.append(f"  {model:<12} {n:>11,} {n_tok / n if n else 0:>12.1f} {len(g['ddp']):>5} {ddp:>8.4f} "
                     f"{fed:>8.4f}  {fmt_spread(g['ratio'])}")
    return lines


def print_report(path):
    """The tables of a --json file (of a finished bench, or of one cut short)."""
    import json
    with open(path) as f:
        saved = json.load(f)
    cfg = TricksConfig(**saved["config"])
    bench = Bench(cfg, cfg.out, None, saved["corpus"], saved["sweep_corpus"])
    bench.runs, bench.params = saved["runs"], saved["params"]
    bench.best = {a: tuple(v) for a, v in saved["best_outer"].items()}
    bench.best.setdefault("f32", (cfg.outer_lr, cfg.outer_momentum))
    print(report(cfg, bench))
    return 0


def main(argv=None):
    d = TricksConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog="\n\n".join(__doc__.split("\n\n")[1:]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="make bench's setting: 0.25 MB, 8 rounds, 2 seeds, f32 and int4-both, no sweep, no gap model")
    p.add_argument("--out", default=d.out, help=f"work directory, wiped first (default {d.out})")
    p.add_argument("--json", help="write every figure here, rewritten after each run (default: none)")
    p.add_argument("--corpus-mb", type=float, help="stdlib source bytes to tokenize, MB (default 1.0; --quick 0.25)")
    p.add_argument("--heldout-windows", type=int, help="held-out windows scored (default 256; --quick 64)")
    convergence.add_run_flags(p, d)     # --seq-len --model --batch-size --inner-steps --lr --min-lr --seed
    #                                     --timeout-min
    p.add_argument("--rounds", type=int, help="outer rounds at least: H = the epoch's steps // this "
                                              "(default 40, --quick 8; or give --inner-steps)")
    p.add_argument("--seeds", type=int, help="seeds --seed, --seed + 1, ... (default 3, --quick 2)")
    p.add_argument("--arms", help=f"comma-separated, of {', '.join(TricksConfig.known_arms)} "
                                  f"(default {','.join(DEFAULT_ARMS)}; --quick {','.join(QUICK_ARMS)})")
    p.add_argument("--no-ddp", dest="ddp", action="store_false", help="skip DDP (the vs-DDP columns and the gap)")
    p.add_argument("--sweep", action=argparse.BooleanOptionalAction,
                   help="the outer setting per arm from a sweep (default on; --quick off)")
    p.add_argument("--sweep-lr", default=d.sweep_lr, help=f"outer lrs swept, comma-separated (default {d.sweep_lr})")
    p.add_argument("--sweep-momentum", default=d.sweep_momentum,
                   help=f"outer momenta swept, comma-separated (default {d.sweep_momentum})")
    p.add_argument("--sweep-seed", type=int, default=d.sweep_seed, help=f"the sweep's seed (default {d.sweep_seed})")
    p.add_argument("--sweep-frac", type=float, default=d.sweep_frac,
                   help=f"the sweep's share of the corpus, same H (default {d.sweep_frac:g})")
    p.add_argument("--outer-lr", type=float, default=d.outer_lr, help=f"without the sweep (default {d.outer_lr:g})")
    p.add_argument("--outer-momentum", type=float, default=d.outer_momentum,
                   help=f"without the sweep (default {d.outer_momentum:g}: FedAvg)")
    p.add_argument("--link-mbit", type=float, default=d.link_mbit,
                   help=f"the --overlap arms' WAN-shaped link per site, Mbit/s each way (default {d.link_mbit:g}; "
                        "0: loopback)")
    p.add_argument("--link-latency-ms", type=float, default=d.link_latency_ms,
                   help=f"its added one-way latency, ms (default {d.link_latency_ms:g})")
    p.add_argument("--link-all", action="store_true", help="every federated arm on the link, not only --overlap's")
    p.add_argument("--step-ms", type=int, default=d.step_ms,
                   help="every site's inner step lasts at least this long (train.py --throttle-ms; default 0): "
                        "a phase as long, next to the round trip's fixed latencies, as a real site's (the loss "
                        "does not move; where an --overlap arm's fold lands does: the fold column)")
    p.add_argument("--gap-model", help=f"the second model size for the DiLoCo-vs-DDP gap (default {GAP_MODEL}; "
                                       "--quick none; none: skip)")
    p.add_argument("--gap-seeds", type=int, default=d.gap_seeds, help=f"its seeds, the first N (default {d.gap_seeds})")
    p.add_argument("--report", metavar="JSON", help="print the tables of a --json file and exit (runs nothing)")
    a = vars(p.parse_args(argv))
    report_of = a.pop("report")
    return print_report(report_of) if report_of else run(TricksConfig(**a))


if __name__ == "__main__":
    sys.exit(main())
