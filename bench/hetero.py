"""bench/hetero.py - sites of different speeds: fixed H inner steps per round against phases
measured in time (fedmom_server.py --phase-s T), and what a stalled site costs the others with
the quorum rule and without it.

Runs on: this machine's CPU (two or three 1-rank DDP sites of qwen3-tiny at a time, with the
real central services), from the repository root:
    .venv/bin/python bench/hetero.py --quick        # make bench: 1 seed, 1:2 and the stall, ~5 min
    .venv/bin/python bench/hetero.py                # 3 seeds, 1:1 1:2 1:3 1:2:3 and the stall (~3 h)
    .venv/bin/python bench/hetero.py --arms 1:3,stall --seeds 2 --phase-s 8
    .venv/bin/python bench/hetero.py --report runs/bench-hetero/results.json    # the tables again
It prints its plan and estimate, one line per run, then the tables. Work files: --out (default
runs/bench-hetero/, wiped first): each run's services' state, sites/<site>/metrics.jsonl and
logs/; results.json (rewritten after each run: one cut short keeps what it measured), table.txt.

Speeds: every site sleeps --base-ms after each inner step (train.py --throttle-ms), so the sleep,
not the two shared cores, sets the step time; a site of ratio r sleeps (r - 1) x (a step's
compute, measured here first, + --base-ms) more. The step ms printed are what the sites ran.
Per speed setting and seed, two runs on the same corpus, initial model and seed:
    fixed   every site trains H inner steps a phase (train.py --diloco-phase-s 0), the round waits
            for all; H = --inner-steps, default T / the fastest site's estimated step
    timed   fedmom_server.py --phase-s T (its default --quorum), the sites take the offer
and the stall (equal speeds, phases of T): site beta's process tree SIGSTOPped mid-phase for
--stall-phases x T after --rounds / 3 rounds, then SIGCONTed, under the default quorum (stall-q)
and --quorum 1 (stall-all). A site's --steps (its LR schedule) is its expected share of the
corpus (1/n under fixed H, by speed in time); the corpus (the standard library, byte tokens) is
sized per site count for about --rounds fixed-H rounds, and every run trains it once (DARL).
Figures: util, a site's phase rows' util (inner s / its cycle: lease, inner steps, checkpoint,
round trip), median and whole run; tok/s, its tokens / its life (first phase's start to last
phase's end: torch's import and the first held-out score outside); solo, its tokens / its inner
seconds (same run, no solo run); fed, merged tokens / (the first phase's start to the last merge)
against the sum of solo rates; held-out, timed / fixed per seed at equal tokens (both final) and
at equal wall time (fixed's theta_global downloaded at each merge, GET /theta: the last round
within the timed run's wall time); stall, the other site's wait_s in the rounds from the SIGSTOP
to the stalled site's next merge, less its median wait before, per round in phases of T.
"""
import argparse
import dataclasses
import json
import math
import os
import shutil
import signal
import statistics
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)                           # bench/ imports the repository's top-level scripts

import audit                                       # noqa: E402  (after the path line above)
import durable                                     # noqa: E402
import fedmom_client                               # noqa: E402
import outer_state                           # noqa: E402
from testbed import harness                                     # noqa: E402
from outer_state import OUTER_LR, OUTER_MOMENTUM  # noqa: E402

SETTINGS = ("1:1", "1:2", "1:3", "1:2:3")
ARMS = SETTINGS + ("stall",)
QUICK_ARMS = ("1:2", "stall")
SITES = ("alpha", "beta", "gamma")
STALLED = "beta"
# targets (the issue "every site busy")
UTIL_TARGET, FED_TARGET, EQUAL_TOKENS_TARGET, STALL_TARGET = 0.95, 0.95, 1.01, 0.25
UTIL_TARGET_AT = "1:2"
START_S = 35.0                   # a run's fixed cost here: services, torch's import in every site, the end (estimate)


@dataclasses.dataclass
class HeteroConfig:
    out: str = "runs/bench-hetero"
    quick: bool = False
    arms: str | None = None              # default ARMS; --quick QUICK_ARMS
    seeds: int | None = None             # default 3, --quick 1
    seed: int = 0
    rounds: int | None = None            # default 30, --quick 8
    phase_s: float | None = None         # default 6, --quick 4
    inner_steps: int | None = None       # H of the fixed arm; default T / the fastest step
    base_ms: int = 100
    stall_phases: float = 2.0
    stall_quorum: float | None = None    # the stall-q run's --quorum; default fedmom_server.py's with --phase-s
    grace_frac: float | None = None      # fedmom_server.py's default
    seq_len: int = 128
    heldout_windows: int | None = None   # default 128, --quick 64
    model: str = "qwen3-tiny"
    batch_size: int = 8
    block_size: int = 8
    lr: float = 3e-3
    min_lr: float = 3e-4
    outer_lr: float = OUTER_LR
    outer_momentum: float = OUTER_MOMENTUM
    timeout_min: float | None = None     # default: 4 x the run's estimate, at least 5 min

    def validate(self):
        q = self.quick
        self.arms = self.arms or ",".join(QUICK_ARMS if q else ARMS)
        self.seeds = (1 if q else 3) if self.seeds is None else self.seeds
        self.rounds = (8 if q else 30) if self.rounds is None else self.rounds
        self.phase_s = (4.0 if q else 6.0) if self.phase_s is None else self.phase_s
        self.heldout_windows = self.heldout_windows or (64 if q else 128)
        bad = [a for a in self.arm_list if a not in ARMS]
        if bad:
            raise SystemExit(f"--arms: unknown {', '.join(bad)}; use some of {','.join(ARMS)}")
        checks = [(self.seeds >= 1, "--seeds must be >= 1"), (self.rounds >= 3, "--rounds must be >= 3"),
                  (self.phase_s > 0, "--phase-s must be > 0 s"), (self.base_ms >= 0, "--base-ms must be >= 0"),
                  (self.inner_steps is None or self.inner_steps >= 1, "--inner-steps must be >= 1"),
                  (self.stall_phases > 0, "--stall-phases must be > 0"),
                  (self.stall_quorum is None or 0 < self.stall_quorum <= 1, "--stall-quorum must be in (0, 1]"),
                  (self.batch_size >= 1 and self.block_size >= 1, "--batch-size and --block-size must be >= 1")]
        for ok, msg in checks:
            if not ok:
                raise SystemExit(f"hetero.py: {msg}")
        return self

    @property
    def arm_list(self):
        return [a for a in self.arms.split(",") if a]

    @property
    def seed_list(self):
        return list(range(self.seed, self.seed + self.seeds))


def ratios(setting):
    """'1:2:3' -> [1.0, 2.0, 3.0]; the stall runs at equal speeds."""
    return [1.0, 1.0] if setting == "stall" else [float(x) for x in setting.split(":")]


def throttles(rs, compute_ms, base_ms):
    """Each site's --throttle-ms: the base, plus (r - 1) x a base step (compute + base) for ratio r."""
    return [int(round(base_ms + (r - 1) * (compute_ms + base_ms))) for r in rs]


def schedule_steps(train_windows, batch, rs, timed):
    """Each site's --steps (the LR schedule's length): its expected share of the corpus's steps,
    1/n under fixed H (every site trains H a round), its speed's share under phases in time."""
    total = train_windows / batch
    shares = [1 / r for r in rs] if timed else [1.0] * len(rs)
    return [max(1, math.ceil(total * s / sum(shares))) for s in shares]


# ---------------------------------------------------------------------------
# The figures: pure functions of metrics.jsonl rows and round records (tests/test_hetero.py)
# ---------------------------------------------------------------------------

def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def site_figures(rows, seq_len):
    """One site's figures from its metrics.jsonl rows (the "phase" and "federation" ones), or None
    when it wrote no phase row."""
    ph = [r for r in rows if r.get("split") == "phase"]
    fed = [r for r in rows if r.get("split") == "federation"]
    if not ph or not fed:
        return None
    inner = sum(r["inner_s"] for r in ph)
    cycle = sum(r["cycle_s"] for r in ph)
    tokens = sum(r["windows"] for r in fed) * seq_len
    start, end = ph[0]["time"] - ph[0]["cycle_s"], ph[-1]["time"]
    ended = {}
    for r in ph:
        ended[r.get("ended_by")] = ended.get(r.get("ended_by"), 0) + 1
    mid = ph[1:-1]          # the first phase starts on an old round (its budget cut), the last at the corpus's end
    mid_cycle = sum(r["cycle_s"] for r in mid)
    return {"phases": len(ph), "util_med": median(r.get("util") for r in ph),
            "util_run": inner / cycle if cycle > 0 else None, "tokens": tokens,
            "util_mid": sum(r["inner_s"] for r in mid) / mid_cycle if mid_cycle > 0 else None,
            "trip_med": median(r.get("after_s") for r in ph),
            "solo_tps": tokens / sum(r["inner_s"] for r in fed), "life_s": end - start,
            "tps": tokens / (end - start) if end > start else None,
            "step_ms": 1e3 * median(r.get("step_s") for r in ph), "steps_med": median(r["steps"] for r in ph),
            "wait_med": median(r.get("wait_s") for r in ph), "ended_by": ended,
            "refused": sum(1 for r in fed if r.get("merged") is False), "start": start, "end": end}


def federation_figures(records, sites):
    """The federation's figures from its round records and its sites' figures ({name: site_figures})."""
    live = {n: s for n, s in sites.items() if s}
    if not records or not live:
        return None
    start = min(s["start"] for s in live.values())
    end = max(r["time"] for r in records)
    merged = sum(r["tokens"] for r in records)
    solo = sum(s["solo_tps"] for s in live.values())
    wall = end - start
    return {"rounds": len(records), "merged_tokens": merged, "wall_s": wall, "tps": merged / wall,
            "solo_sum": solo, "ratio": merged / wall / solo, "start": start, "end": end,
            "head_s": max(s["start"] for s in live.values()) - start,
            "tail_s": max(s["end"] for s in live.values()) - min(s["end"] for s in live.values()),
            "partial_rounds": sum(1 for r in records if len(r.get("clusters", {})) < len(sites)),
            "quorum_rounds": sum(1 for r in records if r.get("quorum")),
            "refused": sum(s["refused"] for s in live.values())}


def round_at(records, start, wall_s):
    """The last round merged within wall_s of `start` (0: none, theta is the init)."""
    done = [r["round"] for r in records if r["time"] - start <= wall_s]
    return max(done) if done else 0


def snapshot_for(snapshots, rnd):
    """(round, file) of the newest snapshot at or before round `rnd`; (0, None) when none (the init)."""
    have = [r for r in snapshots if r <= rnd]
    return (max(have), snapshots[max(have)]) if have else (0, None)


def closed_by(reason):
    """A record's reason in one word: all (every live member sent), quorum, deadline, or the reason."""
    r = reason or ""
    return ("all" if r.startswith("every live member") else "quorum" if r.startswith("quorum")
            else "deadline" if "deadline" in r else r)


def stall_figures(rows, records, other, victim, t_stop, t_cont, phase_s):
    """What the stall of `victim` from t_stop to t_cont (wall clock) cost site `other` (its
    metrics.jsonl rows). The window: the rounds from the first one merged after the SIGSTOP to the
    first one after the SIGCONT that has `victim` in it (or the last). The other site's phase rows
    of those rounds (a phase row's round is the one its round trip brought back): their wait_s less
    its median wait_s before the window (its first phase left out), summed; the same from the
    records' waited_s of `other`."""
    ph = [r for r in rows if r.get("split") == "phase"]
    after = [r for r in records if r["time"] > t_stop]
    if not after:
        return None
    first = after[0]["round"]
    back = next((r for r in after if r["time"] > t_cont and victim in r.get("clusters", {})), None)
    last = back["round"] if back is not None else after[-1]["round"]
    window = [r for r in ph if first <= r["round"] <= last]
    base = median(r["wait_s"] for r in ph[1:] if r["round"] < first) or 0.0
    lost = sum(r["wait_s"] - base for r in window)
    recs = [r for r in after if r["round"] <= last]
    waited = lambda r: r.get("clusters", {}).get(other, {}).get("waited_s")     # noqa: E731
    rbase = median(waited(r) for r in records[1:] if r["round"] < first) or 0.0
    rlost = sum(waited(r) - rbase for r in recs if waited(r) is not None)
    n = len(window)
    # the quorum rule's view of the first round: the other's delta against it plus the stalled
    # site's last merged one (what the round expects of it): the round closes without it only
    # when that share reaches --quorum
    last_victim = next((r["clusters"][victim]["tokens"] for r in reversed(records)
                        if r["round"] < first and victim in r.get("clusters", {})), None)
    mine = after[0].get("clusters", {}).get(other, {}).get("tokens")
    share = mine / (mine + last_victim) if mine and last_victim else None
    q = next((r["quorum"]["fraction"] for r in recs if r.get("quorum")), None)    # None: the rule did not apply
    return {"stalled_s": t_cont - t_stop, "back_s": None if back is None else back["time"] - t_cont,
            "share": share, "quorum": q,
            "rounds": n, "base_wait_s": base, "lost_s": lost, "per_round": lost / n / phase_s if n else None,
            "rec_lost_s": rlost, "rec_per_round": rlost / len(recs) / phase_s if recs else None,
            "without_victim": sum(1 for r in recs if victim not in r.get("clusters", {})),
            "closed_by": [closed_by(r.get("reason")) for r in recs]}


def spread(xs):
    """(mean, min, max) of the numbers given (None left out), or None."""
    xs = [x for x in xs if x is not None]
    return (statistics.fmean(xs), min(xs), max(xs)) if xs else None


def pct(x):
    return "-" if x is None else f"{100 * (x - 1):+.2f}%"


def num(v, spec):
    return "-" if v is None else format(v, spec)


def verdict(ok):
    return "-" if ok is None else ("met" if ok else "NOT met")


# ---------------------------------------------------------------------------
# The runs
# ---------------------------------------------------------------------------

def calibrate(manifest, model, batch, seq_len, steps=30):
    """The compute of one inner step of `model` here, ms (median of `steps`, one thread as the
    sites run: forward, backward, clip, AdamW), without train.py's bookkeeping around it."""
    import torch
    import torch.nn.functional as F
    import data
    import models
    torch.set_num_threads(1)
    w = data.TokenWindows(manifest)
    net = models.materialize(models.build_model(model, w.vocab_size, seq_len), torch.device("cpu"))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    t = torch.from_numpy(w.batch(list(range(batch))))
    times = []
    for i in range(steps + 5):
        t0 = time.perf_counter()
        logits = net(t[:, :-1])
        F.cross_entropy(logits.flatten(0, 1).float(), t[:, 1:].flatten()).backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        if i >= 5:
            times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


class Snapshots:
    """theta_global of every round as it merges: polls FedMom's GET /round and downloads GET /theta
    (a few hundred KB here) into `where`/round-N.safetensors when the round moved; `files`:
    {round: path}. A running aggregator's own files are not to be read (its checkpoint rewrites them)."""

    def __init__(self, svc, where, interval_s=0.25):
        self.svc, self.where, self.interval_s = svc, where, interval_s
        self.client = fedmom_client.FedMomClient(svc.fedmom, "bench-snapshots", "0", token=svc.token)
        self.files, self.stopping = {}, threading.Event()
        os.makedirs(where, exist_ok=True)
        self.thread = threading.Thread(target=self._run, name="snapshots", daemon=True)

    def _run(self):
        last = 0
        while not self.stopping.wait(self.interval_s):
            st = harness.get_json(self.svc.fedmom, "/round", self.svc.token)
            if not st or st.get("round", 0) <= last:
                continue
            tmp = os.path.join(self.where, "download.safetensors")
            try:
                got = self.client.download_theta(tmp)
            except Exception:            # the aggregator busy or stopping: the next poll tries again
                continue
            path = os.path.join(self.where, f"round-{got}.safetensors")
            os.replace(tmp, path)
            self.files[got], last = path, got

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stopping.set()
        self.thread.join(30)
        return False


class Bench:
    """The runs in order, each recorded (and results.json rewritten) as it finishes."""

    def __init__(self, cfg, out, launcher):
        self.cfg, self.out, self.launcher = cfg, out, launcher
        self.runs, self.corpora, self.inits, self.plan = [], {}, {}, []
        self.t0, self.est_done = time.monotonic(), 0.0
        self.compute_ms = None

    @property
    def base_step_ms(self):
        return self.compute_ms + self.cfg.base_ms

    @property
    def h(self):
        """H of the fixed arm: --inner-steps, else the fastest site's estimated steps in T."""
        return self.cfg.inner_steps or max(1, round(1e3 * self.cfg.phase_s / self.base_step_ms))

    def corpus(self, n):
        """The corpus of the n-site runs (tokenized once): about --rounds fixed-H rounds of n x H steps."""
        if n not in self.corpora:
            cfg = self.cfg
            windows = cfg.rounds * n * self.h * cfg.batch_size
            mb = (windows + cfg.heldout_windows) * cfg.seq_len / 1e6      # ~120 bytes make a window of 128 here
            m = harness.tokenize(os.path.join(self.out, f"data-{n}sites"), mb * 1e6, cfg.seq_len, cfg.heldout_windows)
            self.corpora[n] = {"manifest": m["path"], "train_windows": m["num_windows"] - m["heldout_windows"],
                               "heldout": m["heldout_windows"], "mb": mb}
        return self.corpora[n]

    def init(self, n, seed):
        key = (n, seed)
        if key not in self.inits:
            path = os.path.join(self.out, "inits", f"{n}sites-seed{seed}.safetensors")
            os.makedirs(os.path.dirname(path), exist_ok=True)
            self.inits[key] = harness.export_init(self.launcher, path, self.corpus(n)["manifest"], self.cfg.model,
                                                  seed, os.path.join(self.out, "logs", f"init-{n}-{seed}.log"))
        return self.inits[key]

    def estimate(self, setting, arm):
        """Seconds one run should take here: START_S + its rounds x their length."""
        cfg, rs = self.cfg, ratios(setting)
        n, t = len(rs), cfg.phase_s
        steps = self.corpus_steps(n)
        if arm == "fixed":
            return START_S + steps / (n * self.h) * max(rs) * self.h * self.base_step_ms / 1e3
        per_round = sum(self.h / r for r in rs)
        return START_S + steps / per_round * t * 1.05 + (cfg.stall_phases * t if arm.startswith("stall") else 0)

    def corpus_steps(self, n):
        return self.cfg.rounds * n * self.h * 1.07        # before the corpus exists: as sized, ~7% more

    def federated(self, setting, arm, seed):
        """One run: services, the sites of `setting`, (the stall), until DARL is done -> its record."""
        cfg = self.cfg
        rs = ratios(setting)
        n = len(rs)
        corpus, init = self.corpus(n), self.init(n, seed)
        timed = arm != "fixed"
        where = os.path.join(self.out, setting.replace(":", "-"), f"seed{seed}", arm)
        os.makedirs(where)
        thr = throttles(rs, self.compute_ms, cfg.base_ms)
        steps = schedule_steps(corpus["train_windows"], cfg.batch_size, rs, timed)
        slowest_phase = max(rs) * self.h * self.base_step_ms / 1e3
        fed_args = ["--outer-lr", cfg.outer_lr, "--outer-momentum", cfg.outer_momentum,
                    "--round-deadline-s", max(600, 10 * slowest_phase), "--member-timeout-s", 600,
                    "--darl-retry-s", 2]
        if timed:
            fed_args += ["--phase-s", cfg.phase_s]
        if arm == "stall-all":
            fed_args += ["--quorum", 1]
        if arm == "stall-q" and cfg.stall_quorum is not None:
            fed_args += ["--quorum", cfg.stall_quorum]
        if cfg.grace_frac is not None and timed:
            fed_args += ["--grace-frac", cfg.grace_frac]
        row = {"setting": setting, "arm": arm, "seed": seed, "ratios": rs, "throttle_ms": thr, "steps": steps,
               "h": self.h, "phase_s": cfg.phase_s if timed else None, "dir": where, "error": None}
        t0 = time.monotonic()
        try:
            timeout_s = 60 * cfg.timeout_min if cfg.timeout_min else max(300.0, 4 * self.estimate(setting, arm))
            row.update(self.run_sites(where, corpus, init, seed, rs, thr, steps, timed, fed_args, arm, timeout_s))
            if row["fed"] is None or None in row["sites"].values():
                raise RuntimeError("no round merged, or a site wrote no phase row: see " + where)
            row["heldout"] = harness.heldout_loss(row["theta"], corpus["manifest"], cfg.model)
        except RuntimeError as e:
            row["error"] = str(e)
        row["run_s"] = time.monotonic() - t0
        return self.record(row)

    def run_sites(self, where, corpus, init, seed, rs, thr, steps, timed, fed_args, arm, timeout_s):
        cfg, L = self.cfg, self.launcher
        svc = harness.start_services(L, where, corpus["manifest"], init, block_size=cfg.block_size, seed=seed,
                                     fedmom_args=fed_args, default_ports=False)
        names = SITES[:len(rs)]
        stall, sites = None, {}
        try:
            with Snapshots(svc, os.path.join(where, "snapshots")) as snaps:
                for name, throttle, st in zip(names, thr, steps):
                    args = ["--model", cfg.model, "--batch-size", cfg.batch_size, "--lr", cfg.lr,
                            "--min-lr", cfg.min_lr, "--steps", st, "--seed", seed, "--log-every", 50,
                            "--eval-windows", corpus["heldout"], "--diloco-inner-steps", self.h]
                    if not timed:
                        args += ["--diloco-phase-s", 0]
                    sites[name] = harness.launch_site(L, name, svc, corpus["manifest"], nproc=1, parallel="ddp",
                                                      log_dir=os.path.join(where, "logs"),
                                                      runs_dir=os.path.join(where, "sites"),
                                                      train_args=args, throttle_ms=throttle)
                deadline = time.monotonic() + timeout_s
                if arm.startswith("stall"):
                    stall = self.stall(svc, sites[STALLED], list(sites.values()), deadline)
                left = max(1.0, deadline - time.monotonic())
                done = harness.wait_for(lambda: all(p.poll() is not None for p in sites.values()), left, 0.5)
            for p in sites.values():
                if done is None or p.poll() != 0:
                    why = "timed out" if done is None else f"failed (exit {p.poll()})"
                    raise RuntimeError(f"site {p.name} {why}; see {p.log_path}:\n  " + "\n  ".join(p.tail()))
            harness.wait_for(lambda: (harness.get_json(svc.fedmom, "/status", svc.token) or {})
                             .get("pending_commits") == 0, 60)
        finally:                         # a site that failed or hung stops with its run, then the services
            for p in [*sites.values(), *svc.procs.values()]:
                p.stop(20)
        state = os.path.join(svc.state_dir, "fedmom")
        theta = os.path.join(where, "theta-final.safetensors")
        outer_state.load_outer(state).write("theta", theta, fsync=False)
        records = durable.read_jsonl(os.path.join(state, "rounds.jsonl"))
        rows = {n: durable.read_jsonl(os.path.join(where, "sites", n, "metrics.jsonl")) for n in names}
        sites_fig = {n: site_figures(r, cfg.seq_len) for n, r in rows.items()}
        out = {"theta": theta, "snapshots": snaps.files, "sites": sites_fig,
               "fed": federation_figures(records, sites_fig), "record_times": {r["round"]: r["time"] for r in records},
               "coverage": audit.audit(svc.state_dir, manifest=corpus["manifest"]).ok}
        if stall:
            others = [n for n in names if n != STALLED]
            out["stall"] = {o: stall_figures(rows[o], records, o, STALLED, stall["t_stop"], stall["t_cont"],
                                             cfg.phase_s) for o in others}
            out["stall_times"] = stall
        return out

    def stall(self, svc, victim, sites, deadline):
        """SIGSTOP the victim's whole process tree half a phase after round --rounds/3 merged, for
        --stall-phases x T, then SIGCONT -> {"t_stop", "t_cont", "round"} (wall clock)."""
        cfg = self.cfg
        at = max(3, cfg.rounds // 3)

        def reached():
            if any(p.poll() is not None for p in sites):
                raise RuntimeError(f"a site exited before round {at}: see {victim.log_path}")
            return (harness.get_json(svc.fedmom, "/round", svc.token) or {}).get("round", 0) >= at
        if harness.wait_for(reached, max(1.0, deadline - time.monotonic()), 0.2) is None:
            raise RuntimeError(f"round {at} not reached within the run's timeout (--timeout-min)")
        time.sleep(cfg.phase_s / 2)
        t_stop = time.time()
        victim.signal_tree(signal.SIGSTOP)
        time.sleep(cfg.stall_phases * cfg.phase_s)
        victim.signal_tree(signal.SIGCONT)
        return {"t_stop": t_stop, "t_cont": time.time(), "round": at}

    def record(self, row):
        self.runs.append(row)
        self.est_done += self.plan.pop(0) if self.plan else 0.0
        spent = time.monotonic() - self.t0
        left = sum(self.plan) * (spent / self.est_done if self.est_done else 1.0)
        f = row.get("fed")
        what = (f"FAILED: {row['error']}" if row["error"] else
                f"held-out {row['heldout']:.4f}, {f['rounds']} rounds, {f['wall_s']:.0f} s, "
                f"fed {f['tps']:.0f} tok/s = {f['ratio']:.2f} x solo; util "
                + " ".join(f"{n} {num(s and s['util_run'], '.2f')}" for n, s in row["sites"].items()))
        print(f"  {row['setting']:<6} {row['arm']:<9} seed {row['seed']}: {what}  "
              f"({row['run_s'] / 60:.1f} min; {spent / 60:.1f} min so far, about {left / 60:.0f} min left)", flush=True)
        self.save()
        return row

    def save(self, text=None):
        out = {"config": dataclasses.asdict(self.cfg), "compute_ms": self.compute_ms, "h": self.h,
               "corpora": self.corpora, "runs": self.runs}
        if text:
            out["table"] = text
        durable.write_json(os.path.join(self.out, "results.json"), out, fsync=False, indent=1)


def wall_pairs(bench, setting, seed):
    """fixed's theta_global at the timed run's wall time (the same seed and speeds), scored."""
    got = {r["arm"]: r for r in bench.runs if r["setting"] == setting and r["seed"] == seed and not r["error"]}
    fixed, timed = got.get("fixed"), got.get("timed")
    if not fixed or not timed:
        return
    times = [{"round": int(k), "time": v} for k, v in fixed["record_times"].items()]
    want = round_at(times, fixed["fed"]["start"], timed["fed"]["wall_s"])
    final = max(int(k) for k in fixed["record_times"])
    if want >= final:
        rnd, path = final, fixed["theta"]
    else:
        rnd, path = snapshot_for({int(k): v for k, v in fixed["snapshots"].items()}, want)
        path = path or bench.init(len(ratios(setting)), seed)
    fixed["at_wall"] = {"wall_s": timed["fed"]["wall_s"], "round": rnd, "wanted_round": want, "final_round": final,
                        "heldout": harness.heldout_loss(path, bench.corpus(len(ratios(setting)))["manifest"],
                                                        bench.cfg.model)}
    bench.save()


def _sigterm_as_interrupt(signum, frame):
    raise KeyboardInterrupt


def header(cfg, bench, runs):
    """The plan: the step, T and H, each setting's sleeps, the estimate, the corpora."""
    fixed_h = "" if cfg.inner_steps else ": T / the fastest step"
    print(f"hetero: {cfg.model}, 1-rank DDP sites on this CPU; one inner step computes in {bench.compute_ms:.0f} ms "
          f"(measured here, one thread) + {cfg.base_ms} ms of sleep at the fastest site; phases of T = "
          f"{cfg.phase_s:g} s (timed), H = {bench.h} steps (fixed{fixed_h}); about {cfg.rounds} fixed-H rounds "
          f"per run; seeds {cfg.seed_list}", flush=True)
    for a in cfg.arm_list:
        rs = ratios(a)
        sleeps = throttles(rs, bench.compute_ms, cfg.base_ms)
        print(f"  {a:<6} sites " + ", ".join(f"{n} {r:g}x ({t} ms sleep)" for n, r, t in zip(SITES, rs, sleeps)),
              flush=True)
    print(f"estimated {sum(bench.plan) / 60:.0f} min on 2 CPU cores for {runs} runs", flush=True)
    for n in sorted({len(ratios(a)) for a in cfg.arm_list}):
        c = bench.corpus(n)
        print(f"  corpus of the {n}-site runs: {c['mb']:.2f} MB, {c['train_windows']:,} training windows "
              f"(~{c['train_windows'] / (n * bench.h * cfg.batch_size):.0f} fixed-H rounds), "
              f"{c['heldout']} held-out", flush=True)


def run(cfg: HeteroConfig):
    cfg.validate()
    signal.signal(signal.SIGTERM, _sigterm_as_interrupt)     # the Launcher stops every process on the way out
    out = os.path.abspath(cfg.out)
    if os.path.isdir(out):
        shutil.rmtree(out)
    os.makedirs(os.path.join(out, "logs"))
    with harness.Launcher() as launcher:
        bench = Bench(cfg, out, launcher)
        probe = harness.tokenize(os.path.join(out, "data-probe"), 0.2e6, cfg.seq_len, 16)
        bench.compute_ms = calibrate(probe["path"], cfg.model, cfg.batch_size, cfg.seq_len)
        order = [(a, arm, seed) for seed in cfg.seed_list for a in cfg.arm_list
                 for arm in (("stall-q", "stall-all") if a == "stall" else ("timed", "fixed"))]
        bench.plan = [bench.estimate(a, arm) for a, arm, _ in order]
        header(cfg, bench, len(order))
        for setting, arm, seed in order:
            bench.federated(setting, arm, seed)
            if arm == "fixed":
                wall_pairs(bench, setting, seed)
        text = report(cfg, bench)
        print(text)
        with open(os.path.join(out, "table.txt"), "w") as f:
            f.write(text + "\n")
        bench.save(text)
    return 1 if any(r["error"] for r in bench.runs) else 0


# ---------------------------------------------------------------------------
# The tables
# ---------------------------------------------------------------------------

def runs_of(bench, setting, arm):
    return [r for r in bench.runs if r["setting"] == setting and r["arm"] == arm and not r["error"]]


def settings_of(cfg):
    return [a for a in cfg.arm_list if a != "stall"]


def site_mean(runs, name, key):
    """(mean, min, max) over the runs (seeds) of one site's figure, or None."""
    return spread(r["sites"][name][key] for r in runs if r["sites"].get(name))


def m0(s):
    return s and s[0]


def mean_min(s, spec=".3f"):
    """'mean/min' of a spread (one seed: the value twice)."""
    return "-" if s is None else f"{s[0]:{spec}}/{s[1]:{spec}}"


def site_lines(cfg, bench):
    lines = ["", "Per site (mean over seeds; util as mean/min over seeds; tok/s: its tokens over its life; solo: its "
                 "tokens / its inner s, the same run;", "  mid: util without its first and last phase; trip s: median "
                 "phase end to next phase, the checkpoint and the round trip):", "",
             f"  {'speeds':<6} {'site':<6} {'x':>3} | {'fixed H':<7} {'step ms':>7} {'util med':>11} {'util run':>11} "
             f"{'tok/s':>6} {'solo':>6} | {'timed':<5} {'step ms':>7} {'steps':>5} {'util med':>11} {'util run':>11} "
             f"{'mid':>5} {'trip s':>6} {'tok/s':>6} {'solo':>6} {'vs fixed':>8} | target"]
    for setting in settings_of(cfg):
        fx, tm = runs_of(bench, setting, "fixed"), runs_of(bench, setting, "timed")
        for i, name in enumerate(SITES[:len(ratios(setting))]):
            f = {k: site_mean(fx, name, k) for k in ("step_ms", "util_med", "util_run", "tps", "solo_tps")}
            t = {k: site_mean(tm, name, k) for k in ("step_ms", "steps_med", "util_med", "util_run", "util_mid",
                                                     "trip_med", "tps", "solo_tps")}
            tgt = ""
            if setting == UTIL_TARGET_AT and t["util_run"]:
                tgt = f"util >= {UTIL_TARGET}: {verdict(min(t['util_run'][1], t['util_med'][1]) >= UTIL_TARGET)}"
            gain = m0(t["tps"]) / m0(f["tps"]) if m0(t["tps"]) and m0(f["tps"]) else None
            lines.append(f"  {setting if i == 0 else '':<6} {name:<6} {ratios(setting)[i]:>3g} | {bench.h:>7} "
                         f"{num(m0(f['step_ms']), '.0f'):>7} {mean_min(f['util_med']):>11} "
                         f"{mean_min(f['util_run']):>11} "
                         f"{num(m0(f['tps']), '.0f'):>6} {num(m0(f['solo_tps']), '.0f'):>6} | {'':<5} "
                         f"{num(m0(t['step_ms']), '.0f'):>7} {num(m0(t['steps_med']), '.0f'):>5} "
                         f"{mean_min(t['util_med']):>11} {mean_min(t['util_run']):>11} "
                         f"{num(m0(t['util_mid']), '.3f'):>5} {num(m0(t['trip_med']), '.2f'):>6} "
                         f"{num(m0(t['tps']), '.0f'):>6} {num(m0(t['solo_tps']), '.0f'):>6} {num(gain, '.2f'):>8} "
                         f"| {tgt}")
    return lines


FED_KEYS = ("rounds", "partial_rounds", "refused", "wall_s", "head_s", "tail_s", "tps", "solo_sum")


def fed_lines(cfg, bench):
    lines = ["", "The federation (mean over seeds; x solo: merged tok/s over the sum of its sites' solo rates, as "
                 "mean/min over seeds):", "",
             f"  {'speeds':<6} {'arm':<6} {'rounds':>6} {'partial':>7} {'refused':>7} {'wall s':>7} {'head s':>6} "
             f"{'tail s':>6} {'tok/s':>6} {'solo sum':>8} {'x solo':>11} {'vs fixed':>8} | "
             f"target x solo >= {FED_TARGET}"]
    for setting in settings_of(cfg):
        base = spread(r["fed"]["tps"] for r in runs_of(bench, setting, "fixed"))
        for arm in ("fixed", "timed"):
            runs = runs_of(bench, setting, arm)
            if not runs:
                lines.append(f"  {setting:<6} {arm:<6} {'failed':>6}")
                continue
            f = {k: statistics.fmean(r["fed"][k] for r in runs) for k in FED_KEYS}
            ratio = spread(r["fed"]["ratio"] for r in runs)
            lines.append(f"  {setting:<6} {arm:<6} {f['rounds']:>6.0f} {f['partial_rounds']:>7.1f} "
                         f"{f['refused']:>7.1f} {f['wall_s']:>7.0f} {f['head_s']:>6.1f} {f['tail_s']:>6.1f} "
                         f"{f['tps']:>6.0f} {f['solo_sum']:>8.0f} {mean_min(ratio):>11} "
                         f"{num(base and f['tps'] / base[0], '.2f'):>8} | "
                         + (verdict(ratio[1] >= FED_TARGET) if arm == "timed" else "(baseline)"))
    return lines


def heldout_lines(cfg, bench):
    lines = ["", "Held-out loss, timed over fixed H, paired by seed (mean, min, max over seeds). Equal tokens: both "
                 "final (the whole corpus);", "  equal wall time: fixed's theta_global of the last round it merged "
                 "within the timed run's wall time (round r of its n):", "",
             f"  {'speeds':<6} {'seeds':>5} {'fixed':>7} {'timed':>7} | {'equal tokens':>12} {'min':>8} {'max':>8} | "
             f"{'fixed@wall':>10} {'round':>9} | {'equal wall':>10} {'min':>8} {'max':>8} | targets"]
    for setting in settings_of(cfg):
        fx = {r["seed"]: r for r in runs_of(bench, setting, "fixed")}
        tm = {r["seed"]: r for r in runs_of(bench, setting, "timed")}
        seeds = sorted(set(fx) & set(tm))
        if not seeds:
            lines.append(f"  {setting:<6} {'-':>5}")
            continue
        walled = [s for s in seeds if fx[s].get("at_wall")]
        eq = spread(tm[s]["heldout"] / fx[s]["heldout"] for s in seeds)
        aw = spread(tm[s]["heldout"] / fx[s]["at_wall"]["heldout"] for s in walled)
        atw = spread(fx[s]["at_wall"]["heldout"] for s in walled)
        rounds = ",".join(f"{fx[s]['at_wall']['round']} of {fx[s]['at_wall']['final_round']}" for s in walled)
        tg = (f"equal tokens <= {pct(EQUAL_TOKENS_TARGET)}: {verdict(eq[2] <= EQUAL_TOKENS_TARGET)}"
              f"; equal wall < 0: {verdict(aw and aw[2] < 1)}")
        lines.append(f"  {setting:<6} {len(seeds):>5} {statistics.fmean(fx[s]['heldout'] for s in seeds):>7.4f} "
                     f"{statistics.fmean(tm[s]['heldout'] for s in seeds):>7.4f} | "
                     f"{pct(eq[0]):>12} {pct(eq[1]):>8} {pct(eq[2]):>8} | {num(m0(atw), '.4f'):>10} "
                     f"{rounds:>9} | {pct(m0(aw)):>10} {pct(aw and aw[1]):>8} {pct(aw and aw[2]):>8} | {tg}")
    return lines


def stall_lines(cfg, bench):
    lines = ["", f"A stalled site (equal speeds, phases of T = {cfg.phase_s:g} s): {STALLED}'s process tree SIGSTOPped "
                 f"mid-phase for {cfg.stall_phases:g} x T; what it cost the other site, per seed. Rounds: from the",
             f"  first merged after the SIGSTOP to the first with {STALLED} in it again; Q: the quorum the records "
             f"name (-: the rule did not apply); share: the other's delta in the first", f"  of those rounds over it "
             f"+ {STALLED}'s last merged one (the round closes without {STALLED} once that share reaches Q); lost s: "
             "the other site's wait_s in those rounds", "  less its median wait_s before; records: the same from "
             "the records' waited_s:", "",
             f"  {'rule':<14} {'seed':>4} {'stop s':>6} {'Q':>4} {'share':>5} {'rounds':>6} {'no ' + STALLED:>7}  "
             f"{'closed by':<18} {'base wait':>9} {'lost s':>7} {'/round':>6} {'phases':>6} | {'records':>7} "
             f"{'phases':>6} | {STALLED} refused | target <= {STALL_TARGET} phase a round"]
    for arm, label in (("stall-q", "quorum" if cfg.stall_quorum is None else f"--quorum {cfg.stall_quorum:g}"),
                       ("stall-all", "--quorum 1")):
        runs = runs_of(bench, "stall", arm)
        if not runs:
            lines.append(f"  {label:<14} failed")
        for r in runs:
            for s in r["stall"].values():
                if s is None:
                    lines.append(f"  {label:<14} {r['seed']:>4} no round merged after the SIGSTOP")
                    continue
                refused = r["sites"][STALLED]["refused"] if r["sites"].get(STALLED) else "-"
                tgt = (verdict(s["per_round"] is not None and s["per_round"] <= STALL_TARGET) if arm == "stall-q"
                       else "(baseline)")
                lines.append(f"  {label:<14} {r['seed']:>4} {s['stalled_s']:>6.1f} {num(s.get('quorum'), '.2f'):>4} "
                             f"{num(s['share'], '.3f'):>5} {s['rounds']:>6} {s['without_victim']:>7}  "
                             f"{','.join(s['closed_by']):<18} {s['base_wait_s']:>9.2f} {s['lost_s']:>7.2f} "
                             f"{num(s['rounds'] and s['lost_s'] / s['rounds'], '.2f'):>6} "
                             f"{num(s['per_round'], '.3f'):>6} | {s['rec_lost_s']:>7.2f} "
                             f"{num(s['rec_per_round'], '.3f'):>6} | {refused:>12} | {tgt}")
    pairs = {r["seed"]: r["heldout"] for r in runs_of(bench, "stall", "stall-all")}
    twins = [(r["seed"], r["heldout"] / pairs[r["seed"]]) for r in runs_of(bench, "stall", "stall-q")
             if r["seed"] in pairs]
    if twins:
        lines += ["", "  Run-to-run spread of the held-out loss: stall-q over stall-all of the same seed, "
                  + ", ".join(f"seed {s} {pct(x)}" for s, x in twins) + " (the same speeds, T, stall and seed: they",
                  "  differ in the quorum rule, which changes only the rounds it closed without the stalled site, and "
                  "in the sites' timing)."]
    return lines


def report(cfg, bench):
    lines = ["", f"hetero: {cfg.model}, H = {bench.h} (fixed), T = {cfg.phase_s:g} s (timed), a step: "
                 f"{bench.compute_ms:.0f} ms of compute (measured here) + {cfg.base_ms} ms of sleep at the fastest "
                 f"site; seeds {cfg.seed_list}"
                 + (" (--quick: 1 seed, 1:2 and the stall only, fewer rounds)" if cfg.quick else "")]
    if settings_of(cfg):
        lines += site_lines(cfg, bench) + fed_lines(cfg, bench) + heldout_lines(cfg, bench)
    if "stall" in cfg.arm_list:
        lines += stall_lines(cfg, bench)
    cov = [f"{r['setting']} {r['arm']} seed {r['seed']}" for r in bench.runs if not r["error"] and not r["coverage"]]
    failed = [f"{r['setting']} {r['arm']} seed {r['seed']}" for r in bench.runs if r["error"]]
    lines += ["", "  coverage (audit.py: every block in exactly one merged delta): "
              + ("every run" if not cov else "NOT in " + ", ".join(cov)),
              *([f"  FAILED runs: {', '.join(failed)} (results.json has the errors)"] if failed else []),
              "  util: inner s / cycle s (lease, inner steps with their sleep, checkpoint, round trip); step ms: the",
              "  phase rows' step_s (their ratio is the speed gap the sites really ran); partial: rounds merged",
              "  without every site; refused: deltas not merged (stale), their blocks trained again; head s: the",
              "  spread of the sites' first phases (torch's import), tail s: of their last phases (the corpus's end);",
              "  this machine's other load moves step ms between runs, so compare tok/s across arms with care:",
              "  x solo and util are measured within one run."]
    return "\n".join(lines)


def print_report(path):
    """The tables of a results.json, runs nothing."""
    with open(path) as f:
        saved = json.load(f)
    cfg = HeteroConfig(**saved["config"])
    bench = Bench(cfg, cfg.out, None)
    bench.runs, bench.compute_ms = saved["runs"], saved["compute_ms"]
    print(report(cfg, bench))
    return 0


def main(argv=None):
    d = HeteroConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog="\n\n".join(__doc__.split("\n\n")[1:]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--quick", action="store_true", help="make bench's setting: 1 seed, 1:2 and the stall, 8 rounds, T 4 s")
    a("--out", default=d.out, help=f"work directory, wiped first (default {d.out})")
    a("--arms", help=f"comma-separated, of {','.join(ARMS)} (default all; --quick {','.join(QUICK_ARMS)})")
    a("--seeds", type=int, help="seeds --seed, --seed + 1, ... (default 3, --quick 1)")
    a("--seed", type=int, default=d.seed, help=f"the first seed (default {d.seed})")
    a("--rounds", type=int, help="the corpus's size: about this many fixed-H rounds per run (default 30, --quick 8)")
    a("--phase-s", type=float, help="T, the phase FedMom offers (fedmom_server.py --phase-s), s (default 6, --quick 4)")
    a("--inner-steps", type=int, help="H of the fixed arm (default: T / the fastest site's estimated step)")
    a("--base-ms", type=int, default=d.base_ms, help=f"every site's sleep per inner step, ms (default {d.base_ms})")
    a("--stall-phases", type=float, default=d.stall_phases,
      help=f"the stall's length, in phases of T (default {d.stall_phases:g})")
    a("--stall-quorum", type=float, help="the stall-q run's fedmom_server.py --quorum (default: its own default "
                                         "with --phase-s; the table prints the Q the records name)")
    a("--grace-frac", type=float, help="fedmom_server.py --grace-frac of the timed runs (default: its own, 0.2)")
    a("--heldout-windows", type=int, help="held-out windows scored (default 128, --quick 64)")
    a("--seq-len", type=int, default=d.seq_len, help=f"tokens per window (default {d.seq_len})")
    a("--model", default=d.model, help=f"model (default {d.model})")
    a("--batch-size", type=int, default=d.batch_size, help=f"windows per site per step (default {d.batch_size})")
    a("--block-size", type=int, default=d.block_size, help=f"windows per DARL block (default {d.block_size})")
    a("--lr", type=float, default=d.lr, help=f"inner AdamW peak LR (default {d.lr})")
    a("--min-lr", type=float, default=d.min_lr, help=f"LR at the end of the cosine (default {d.min_lr})")
    a("--outer-lr", type=float, default=d.outer_lr, help=f"FedMom outer lr (default {d.outer_lr})")
    a("--outer-momentum", type=float, default=d.outer_momentum,
      help=f"FedMom Nesterov momentum (default {d.outer_momentum})")
    a("--timeout-min", type=float, help="per run, minutes (default: 4 x its estimate, at least 5)")
    a("--report", metavar="JSON",
      help="print the tables of a results.json (of a finished bench or one cut short) and exit; runs nothing")
    args = vars(p.parse_args(argv))
    saved = args.pop("report")
    return print_report(saved) if saved else run(HeteroConfig(**args))


if __name__ == "__main__":
    sys.exit(main())
