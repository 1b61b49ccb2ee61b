"""demo.py - `make demo`: two sites train ONE model through the central services, on this CPU.

What it does (about 4 minutes on 2 idle CPU cores): tokenizes this Python's own stdlib
sources (--corpus-mb) and writes the initial model; starts darl_server.py, fedmom_server.py
and blobstore.py on 127.0.0.1 with a fresh token; launches two sites as `torchrun --standalone
--nproc-per-node 2 train.py --federation ...` jobs ("alpha": FSDP2; "beta": DDP, slower with
--throttle-ms); SIGKILLs one site mid-phase and restarts it with --resume auto (it waits out
its dead incarnation's leases and membership, then resumes from its checkpoint); runs until
DARL has no block left, prints the summary and exits non-zero if any check fails.

How to read the output:
  "round N merged ..."   one line per merge: the deltas' token-weighted training loss, which
                         sites contributed, DARL's committed blocks and percent, and the ETA.
  "waiting for the first merge; ..."  every 10 s until then: each site's last log line.
  "    alpha: ..."       a site's own log: waiting out its dead incarnation, resuming, a delta
                         that was not merged.
  "live: ..."            which sites are members of the federation right now.
  the summary            merged rounds, the loss per round (table and sparkline), the held-out
                         loss of the initial and final global model, the run audit (audit.py),
                         where the logs and the saved status page are, and PASS/FAIL per check.

Run:
    make demo                          # = .venv/bin/python demo.py (after make setup)
    .venv/bin/python demo.py --help    # sizes, timings, which site is killed
    .venv/bin/python demo.py --kill-site none --corpus-mb 0.5    # a shorter run without the kill

Where: everything goes under --out (default runs/demo/), which the demo wipes first:
    data/          the tokenized corpus (manifest.json + token shards) and init.safetensors
    central/       the services' durable state: darl/, fedmom/, blobs/
    sites/<site>/  each site's train.log, metrics.jsonl, checkpoints/
    logs/          stdout+stderr of every process the demo started
    theta-<round>.safetensors  the final global model (`fedmom_server.py export` of central/fedmom)
    status.html    FedMom's status page, saved before the servers stop
    summary.txt    the summary printed at the end
Ports 29510-29512 when free, else ones the kernel picks, all on 127.0.0.1; the token is in
<out>/token. The demo stops every process it started, also on Ctrl-C or an error.

Owns the story and its checks; the processes, services, sites and held-out score are
testbed/harness.py's. What the demo shows: README.md, "What `make demo` shows".
"""
import argparse
import dataclasses
import json
import math
import os
import shutil
import signal
import sys
import time

import audit
import durable
import outer_state
from testbed import harness
import status_page
from outer_state import OUTER_LR, OUTER_MOMENTUM

SPARK = "▁▂▃▄▅▆▇█"


def rel(path):
    """A path as a new user would type it: relative to here when below here."""
    r = os.path.relpath(path)
    return path if r.startswith("..") else r


def say(msg=""):
    print(msg, flush=True)


def stamp(t0):
    s = int(time.monotonic() - t0)
    return f"[{s // 60:2d}:{s % 60:02d}]"


def _sigterm_as_interrupt(signum, frame):
    raise KeyboardInterrupt


# ---------------------------------------------------------------------------
# Summary: plain functions of records (tests/test_demo.py feeds them); the coverage audit is audit.py
# ---------------------------------------------------------------------------

def sparkline(values):
    """One character per value, on a log scale of the height above the minimum: the first
    rounds' steep fall no longer flattens every later round onto the lowest bar (on a
    linear scale a loss falling 5.5 -> 2.0, then 2.2 -> 2.0, drew the last 80 % as one
    level). spark_scale() says what the ends mean."""
    vals = [v for v in values if v is not None and math.isfinite(v)]
    if not vals:
        return ""
    lo, hi = min(vals), max(vals)
    d = (hi - lo) / 20 or 1.0
    top = math.log1p((hi - lo) / d) or 1.0
    level = lambda v: min(7, int(math.log1p((v - lo) / d) / top * 8))
    return "".join(" " if v is None or not math.isfinite(v) else SPARK[level(v)] for v in values)


def spark_scale(values):
    vals = [v for v in values if v is not None and math.isfinite(v)]
    if not vals:
        return ""
    return f"({SPARK[0]} = {min(vals):.3f}, {SPARK[-1]} = {max(vals):.3f}; log scale above the minimum)"


def coverage_text(darl, now=None):
    """'DARL: 12/100 blocks committed (12 %), ETA 1 min 05 s' from DARL's GET /status."""
    cov = status_page.coverage(darl, time.time() if now is None else now)
    if cov is None:
        return "DARL: ?"
    eta = ("done" if cov["complete"] else "ETA unknown yet" if cov["eta_s"] is None
           else f"ETA {status_page.duration(cov['eta_s'])} at {cov['rate']:.2g} blocks/s")
    return f"DARL: {cov['committed']}/{cov['num_blocks']} blocks committed ({cov['pct']:.0f} %), {eta}"


def round_table(records):
    """Lines of a table: one row per merged round of rounds.jsonl."""
    lines = [f"  {'round':>5} {'loss':>7} {'tokens':>8}  sites"]
    for r in records:
        loss = "-" if r.get("loss") is None else f"{r['loss']:.3f}"
        sites = ", ".join(sorted(r.get("clusters", {})))
        lines.append(f"  {r['round']:>5} {loss:>7} {r.get('tokens', 0):>8}  {sites}")
    return lines


def loss_trend(records, k=3):
    """(first, last, ok): mean training loss of the first k and the last k merged rounds;
    ok when the last are lower. With fewer than 2 rounds nothing can be said: not ok."""
    losses = [r["loss"] for r in records if r.get("loss") is not None]
    if len(losses) < 2:
        return None, None, False
    k = max(1, min(k, len(losses) // 2))
    first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
    return first, last, last < first


def format_checks(checks):
    """[(name, ok, detail)] -> lines with PASS/FAIL; ok None = not checked (INFO)."""
    out = []
    for name, ok, detail in checks:
        tag = "INFO" if ok is None else ("PASS" if ok else "FAIL")
        out.append(f"  {tag}  {name}" + (f": {detail}" if detail else ""))
    return out


# ---------------------------------------------------------------------------
# The demo
# ---------------------------------------------------------------------------

@dataclasses.dataclass
class DemoConfig:
    out: str = "runs/demo"
    corpus_mb: float = 4.0
    seq_len: int = 128
    heldout_windows: int = 64
    block_size: int = 16
    model: str = "qwen3-tiny"
    batch_size: int = 8
    inner_steps: int = 30
    phase_s: float = 3.0
    lr: float = 3e-3
    ranks: int = 2
    throttle_ms: int = 40
    kill_site: str = "alpha"
    kill_after_round: int = 3
    lease_ttl_s: float = 15.0
    member_timeout_s: float = 15.0
    round_deadline_s: float = 90.0
    outer_lr: float = OUTER_LR
    outer_momentum: float = OUTER_MOMENTUM
    timeout_min: float = 9.0
    seed: int = 0

    def validate(self):
        checks = [(self.corpus_mb > 0, "--corpus-mb must be > 0"),
                  (self.seq_len >= 8, "--seq-len must be >= 8"),
                  (self.block_size >= 1, "--block-size must be >= 1 window"),
                  (self.inner_steps >= 1, "--inner-steps must be >= 1"),
                  (self.phase_s >= 0, "--phase-s must be >= 0 (0: phases of --inner-steps steps)"),
                  (self.ranks >= 1, "--ranks must be >= 1"),
                  (self.kill_site in ("alpha", "beta", "none"), "--kill-site must be alpha, beta or none"),
                  (self.kill_after_round >= 1, "--kill-after-round must be >= 1"),
                  (self.lease_ttl_s >= 5, "--lease-ttl-s must be >= 5 s (heartbeats come every TTL/3)"),
                  (self.member_timeout_s >= 5, "--member-timeout-s must be >= 5 s"),
                  (self.round_deadline_s > 0, "--round-deadline-s must be > 0"),
                  (self.timeout_min > 0, "--timeout-min must be > 0")]
        for ok, msg in checks:
            if not ok:
                raise SystemExit(f"demo.py: {msg}")
        return self


SITES = {"alpha": "fsdp", "beta": "ddp"}
SITE_LOG_KEYS = ("waiting for the previous incarnation", "still live as the previous incarnation",
                 "resumed at step", "NOT merged")


class Demo:
    def __init__(self, cfg: DemoConfig):
        self.cfg, self.t0 = cfg, time.monotonic()
        self.out = os.path.abspath(cfg.out)
        self.logs = os.path.join(self.out, "logs")
        self.sites_dir = os.path.join(self.out, "sites")
        self.checks, self.notes = [], []
        self.sites, self.exit_codes, self.seen_round = {}, {}, 0
        self.next_start_note = time.monotonic() + 10.0
        self.killed = None          # {"site", "incarnation", "round"} once the kill happened
        self.restarted_at = None
        self.live_line = ""
        self.log_offsets = {}

    def log(self, msg):
        say(f"{stamp(self.t0)} {msg}")

    # -- stages ------------------------------------------------------------

    def header(self):
        c = self.cfg
        kill = ("no site is killed (--kill-site none)" if c.kill_site == "none" else
                f"after round {c.kill_after_round}, site {c.kill_site} is SIGKILLed mid-phase and restarted "
                f"with --resume auto")
        say("=" * 78)
        say("pww demo: two sites train ONE model through the central services, on this CPU")
        say("=" * 78)
        say(f"  corpus    this Python's standard library, first {c.corpus_mb:g} MB, byte tokens, "
            f"windows of {c.seq_len}")
        say(f"  model     {c.model}, the same initial weights for everyone (train.py --export-init)")
        say(f"  central   DARL (data leases, {c.block_size} windows per block), FedMom (Nesterov "
            f"{c.outer_lr}/{c.outer_momentum}), blob store, on 127.0.0.1")
        say(f"  sites     alpha: torchrun {c.ranks} ranks FSDP2;  beta: torchrun {c.ranks} ranks DDP, "
            f"{c.throttle_ms} ms slower per step")
        say(f"            each round: " + (f"{c.phase_s:g} s (FedMom's --phase-s, offered to both sites): each "
                                      f"trains as many inner steps as fit, then its delta goes to FedMom"
                                      if c.phase_s else f"{c.inner_steps} inner steps on leased blocks, then the "
                                      f"delta goes to FedMom"))
        say(f"  fault     {kill}")
        say(f"  ends      when DARL has no block left; then the summary and PASS/FAIL per check")
        say(f"  files     {self.out}/  (wiped first)")
        say("-" * 78)

    def prepare(self, launcher):
        c = self.cfg
        if os.path.isdir(self.out):
            shutil.rmtree(self.out)
        os.makedirs(self.logs)
        data_dir = os.path.join(self.out, "data")
        m = harness.tokenize(data_dir, c.corpus_mb * 1e6, c.seq_len, c.heldout_windows)
        self.manifest, self.m = m["path"], m
        self.train_windows = m["num_windows"] - m["heldout_windows"]
        self.num_blocks = -(-self.train_windows // c.block_size)
        self.log(f"corpus: {m['files']} files, {m['tokens_total']:,} tokens -> {self.train_windows:,} "
                 f"training + {m['heldout_windows']} held-out windows; DARL: {self.num_blocks} blocks")
        self.log(f"initial model: train.py --export-init is importing torch and building {c.model} "
                 "(10-30 s on 2 cores) ...")
        self.init = harness.export_init(launcher, os.path.join(data_dir, "init.safetensors"), self.manifest,
                                c.model, c.seed, os.path.join(self.logs, "export-init.log"))
        self.log(f"initial model: {self.init}")

    def services(self, launcher):
        c = self.cfg
        ttl = c.lease_ttl_s
        self.svc = harness.start_services(
            launcher, self.out, self.manifest, self.init, block_size=c.block_size, seed=c.seed,
            darl_args=["--min-ttl", 5, "--default-ttl", ttl, "--max-ttl", ttl, "--restore-grace", ttl],
            fedmom_args=["--outer-lr", c.outer_lr, "--outer-momentum", c.outer_momentum,
                         "--round-deadline-s", c.round_deadline_s, "--member-timeout-s", c.member_timeout_s,
                         "--darl-retry-s", 2] + (["--phase-s", c.phase_s] if c.phase_s else []))
        self.token = self.svc.token
        self.log(f"services: DARL {self.svc.darl}  FedMom {self.svc.fedmom}  blobs {self.svc.blob}")
        self.log(f"status page (while the demo runs): {self.svc.fedmom}/")

    def train_args(self):
        c = self.cfg
        # the cosine LR schedule spans this site's share of the corpus (each site trains about
        # half of it); train.py's default would span the whole corpus at one site's step
        steps = -(-self.train_windows // (len(SITES) * c.ranks * c.batch_size))
        return ["--model", c.model, "--batch-size", c.batch_size, "--lr", c.lr, "--seed", c.seed,
                "--steps", steps, "--diloco-inner-steps", c.inner_steps, "--log-every", 5,
                "--eval-windows", c.heldout_windows, "--eval-every", 5]     # held-out loss on the status page

    def launch(self, launcher, name, resume=False):
        c = self.cfg
        tag = f"{name}-restart" if resume else name
        self.sites[name] = harness.launch_site(
            launcher, name, self.svc, self.manifest, log_dir=self.logs, nproc=c.ranks, parallel=SITES[name],
            runs_dir=self.sites_dir, train_args=self.train_args(), resume=resume,
            throttle_ms=c.throttle_ms if name == "beta" else 0, log_name=tag)
        self.log(f"site {name} started: torchrun --nproc-per-node {c.ranks} train.py --parallel {SITES[name]}"
                 + (" --throttle-ms %d" % c.throttle_ms if name == "beta" else "")
                 + (" --resume auto" if resume else "") + f"  (log {rel(self.sites[name].log_path)})")

    # -- the watch loop ----------------------------------------------------

    def train_rows(self, name):
        return [r for r in durable.read_jsonl(os.path.join(self.sites_dir, name, "metrics.jsonl"))
                if r.get("split") == "train"]

    def report_rounds(self, fed, darl):
        for rec in fed.get("recent", []):
            if rec["round"] <= self.seen_round:
                continue
            self.seen_round = rec["round"]
            loss = "-" if rec.get("loss") is None else f"{rec['loss']:.3f}"
            self.log(f"round {rec['round']:>3} merged: loss {loss}  tokens {rec.get('tokens', 0):>6}  "
                     f"from {', '.join(sorted(rec.get('clusters', {}))) or '-'}  [{coverage_text(darl)}]")

    def report_start(self):
        """Until the first merge, every 10 s: what each site is doing (torch takes a while to
        import on a loaded machine, and a silent terminal looks like a hang)."""
        if self.seen_round or time.monotonic() < self.next_start_note:
            return
        self.next_start_note = time.monotonic() + 10.0
        parts = []
        for name in SITES:
            try:
                with open(os.path.join(self.sites_dir, name, "train.log"), errors="replace") as f:
                    last = (f.read().strip().splitlines() or [""])[-1].split(" ", 1)[-1]
            except OSError:
                last = "importing torch, starting its ranks"
            parts.append(f"{name}: {last[:70]}")
        self.log("waiting for the first merge; " + ";  ".join(parts))

    def report_site_lines(self):
        """Echo the lines of the sites' own logs that tell the story of the restart."""
        for name in SITES:
            path = os.path.join(self.sites_dir, name, "train.log")
            try:
                with open(path) as f:
                    f.seek(self.log_offsets.get(name, 0))
                    text = f.read()
            except OSError:
                continue
            done = text.rfind("\n") + 1            # whole lines only
            self.log_offsets[name] = self.log_offsets.get(name, 0) + len(text[:done].encode())
            for line in text[:done].splitlines():
                if any(k in line for k in SITE_LOG_KEYS):
                    self.log(f"    {name}: {line.split(' ', 1)[-1]}")

    def report_live(self, fed):
        members = {m["cluster"]: m for m in fed.get("members", [])}
        parts = []
        for name in SITES:
            p = self.sites.get(name)
            proc = "running" if p and p.alive() else ("exited" if p else "-")
            parts.append(f"{name} {'member' if name in members else 'not a member'} ({proc})")
        line = "live: " + ";  ".join(parts)
        if line != self.live_line:
            self.live_line = line
            self.log(line)

    def maybe_kill(self, launcher, fed):
        """Kill the victim once a train row shows it mid-phase (not on a phase's last step)
        on a theta_global of round >= --kill-after-round: it holds a lease, its delta unsent."""
        c = self.cfg
        if c.kill_site == "none" or self.killed is not None or fed.get("round", 0) < c.kill_after_round:
            return
        victim = c.kill_site
        phase_ends = {r["step"] for r in durable.read_jsonl(os.path.join(self.sites_dir, victim, "metrics.jsonl"))
                      if r.get("split") == "federation"}
        if not any((r.get("round") or 0) >= c.kill_after_round and r["step"] not in phase_ends
                   and (c.phase_s or r["step"] % c.inner_steps) for r in self.train_rows(victim)):
            return
        inc = next((m["incarnation"] for m in fed.get("members", []) if m["cluster"] == victim), None)
        self.sites[victim].signal_tree(signal.SIGKILL)
        harness.wait_for(self.sites[victim].gone, 30, 0.05)
        self.killed = {"site": victim, "incarnation": inc, "round": fed.get("round")}
        self.exit_codes[f"{victim} (killed)"] = self.sites[victim].poll()
        self.log(f"*** SIGKILL site {victim} (torchrun and its {c.ranks} ranks) in the middle of its inner "
                 f"phase on round {fed.get('round')}")
        self.launch(launcher, victim, resume=True)
        self.restarted_at = time.monotonic()
        self.log(f"    {victim} must now wait until DARL and FedMom give up on the dead incarnation "
                 f"(lease TTL {c.lease_ttl_s:g} s, member timeout {c.member_timeout_s:g} s)")

    def watch(self, launcher):
        deadline = self.t0 + self.cfg.timeout_min * 60
        while True:
            fed = harness.get_json(self.svc.fedmom, "/status", self.token) or {}
            darl = harness.get_json(self.svc.darl, "/status", self.token) or {}
            self.report_rounds(fed, darl)
            self.report_start()
            self.report_live(fed)
            self.report_site_lines()
            self.maybe_kill(launcher, fed)
            finished = {n: p.poll() for n, p in self.sites.items() if not p.alive()}
            failed = {n: rc for n, rc in finished.items() if rc != 0}
            if failed:
                for n, rc in failed.items():
                    self.log(f"site {n} FAILED (exit {rc}); last lines of {self.sites[n].log_path}:")
                    for line in self.sites[n].tail():
                        say(f"      {line}")
                return False
            if len(finished) == len(SITES):
                self.log("both sites finished: DARL has no block left")
                return True
            if time.monotonic() > deadline:
                self.log(f"TIMEOUT: still training after {self.cfg.timeout_min:g} min (--timeout-min)")
                return False
            time.sleep(0.5)

    # -- the end -----------------------------------------------------------

    def finish(self, launcher, trained):
        svc = self.svc
        for n, p in self.sites.items():
            self.exit_codes[n] = p.stop(10)
        harness.wait_for(lambda: (harness.get_json(svc.fedmom, "/status", self.token) or {}).get("pending_commits") == 0,
                         60, 0.5)
        fed = harness.get_json(svc.fedmom, "/status", self.token) or {}
        darl = harness.get_json(svc.darl, "/status", self.token) or {}
        with open(os.path.join(self.out, "darl_status.json"), "w") as f:
            json.dump(darl, f, indent=1)
        with open(os.path.join(self.out, "fedmom_status.json"), "w") as f:
            json.dump(fed, f, indent=1)
        try:
            self.page = rel(harness.fetch_page(svc.fedmom, os.path.join(self.out, "status.html"), self.token))
        except OSError as e:
            self.page = f"(not saved: {e})"
        for p in svc.procs.values():          # SIGTERM: DARL writes its snapshot on the way out
            p.stop(20)
        return fed, darl

    def audit(self, trained, fed, darl):
        c, out = self.cfg, []
        state_fed = os.path.join(self.svc.state_dir, "fedmom")
        records = durable.read_jsonl(os.path.join(state_fed, "rounds.jsonl"))
        checks = self.checks

        # sites
        bad = {n: rc for n, rc in self.exit_codes.items() if "killed" not in n and rc != 0}
        checks.append(("sites finished cleanly", trained and not bad,
                       ", ".join(f"{n} exit {rc}" for n, rc in self.exit_codes.items())))
        if self.cfg.kill_site != "none" and not self.killed:
            checks.append((f"site {self.cfg.kill_site} SIGKILLed mid-phase", False,
                           f"training ended before round {self.cfg.kill_after_round}: use a larger --corpus-mb "
                           f"or a smaller --kill-after-round"))
        if self.killed:
            back = [r["round"] for r in records if r["round"] > (self.killed["round"] or 0)
                    and self.killed["site"] in r.get("clusters", {})
                    and r["clusters"][self.killed["site"]].get("incarnation") != self.killed["incarnation"]]
            checks.append((f"killed site {self.killed['site']} came back", bool(back),
                           f"its new incarnation is in {len(back)} merged rounds (first: {back[0]})" if back
                           else "its new incarnation is in no merged round"))

        # rounds and loss
        checks.append(("merged rounds", len(records) > 0, f"{len(records)}"))
        out.append(f"Merged rounds: {len(records)}  (fedmom round {fed.get('round', '?')})")
        out += round_table(records)
        losses = [r.get("loss") for r in records]
        out.append(f"  training loss per round: {sparkline(losses)}  {spark_scale(losses)}")
        first, last, trend_ok = loss_trend(records)
        try:                # as `fedmom_server.py export` writes it: the checkpoint and the rounds since
            outer = outer_state.load_outer(state_fed)
            theta = outer.write("theta", os.path.join(self.out, f"theta-{outer.round}.safetensors"), fsync=False)
        except (OSError, ValueError) as e:
            theta = None
            out.append(f"the final theta_global cannot be rebuilt: {e}")
        before = harness.heldout_loss(self.init, self.manifest, c.model)
        after = harness.heldout_loss(theta, self.manifest, c.model) if theta else None
        out.append(f"Held-out loss ({self.m['heldout_windows']} windows never trained on): "
                   f"before {before:.4f}  after {after if after is None else format(after, '.4f')}  "
                   f"(final global model {rel(theta) if theta else '-'})")
        checks.append(("training loss falls round by round", trend_ok,
                       f"first rounds {first:.3f} -> last rounds {last:.3f}" if first is not None else "too few rounds"))
        checks.append(("held-out loss falls", after is not None and after < before,
                       f"{before:.4f} -> {after:.4f}" if after is not None else "no final model"))

        # coverage: the run audit (audit.py) over both servers' durable state
        out.append("Coverage audit (python audit.py --state-dir "
                   f"{rel(self.svc.state_dir)}: every block inside exactly one merged delta):")
        report = audit.audit(self.svc.state_dir, manifest=self.manifest)
        out += ["  " + l for l in report.lines]
        checks.append(("every block inside exactly one merged delta (audit.py)", report.ok, ""))
        excluded = [o for r in records for o in r.get("outcomes", ()) if o.get("outcome") == "excluded"]
        site_rows = {n: durable.read_jsonl(os.path.join(self.sites_dir, n, "metrics.jsonl")) for n in SITES}
        unmerged = [r for rows in site_rows.values() for r in rows
                    if r.get("split") == "federation" and r.get("merged") is False]
        out.append(f"Deltas not merged: {len(excluded)} excluded by FedMom, {len(unmerged)} reported unmerged by "
                   f"the sites" + (" (their blocks went back to the pool and were trained again)"
                                   if excluded or unmerged else ""))
        out += utilisation_lines(site_rows)
        lost = {c["cluster"]: c.get("lost", 0) for c in darl.get("clusters", []) if c.get("lost")}
        if lost:
            out.append("Blocks reclaimed from dead leases (trained again by a live incarnation): "
                       + ", ".join(f"{c} {n}" for c, n in sorted(lost.items())))
        return out

    def summary(self, body):
        failed = [n for n, ok, _ in self.checks if ok is False]
        wall = time.monotonic() - self.t0
        lines = ["", "=" * 78, "SUMMARY", "=" * 78, *body, "",
                 "Where things are:",
                 f"  status page (saved copy; the servers are stopped): {self.page}",
                 f"  FedMom rounds: {rel(os.path.join(self.svc.state_dir, 'fedmom', 'rounds.jsonl'))}",
                 f"  site logs: {rel(self.sites_dir)}/<site>/train.log, metrics.jsonl",
                 f"  process output: {rel(self.logs)}/",
                 "", "Checks:", *format_checks(self.checks), "",
                 f"{'FAIL: ' + ', '.join(failed) if failed else 'PASS: all checks'}  (wall time {wall / 60:.1f} min)"]
        text = "\n".join(lines)
        say(text)
        with open(os.path.join(self.out, "summary.txt"), "w") as f:
            f.write(text + "\n")
        return 1 if failed else 0


def utilisation_lines(site_rows):
    """Each site's compute utilisation (its inner steps' seconds over its wall seconds, from the
    "phase" rows of its metrics.jsonl), its phases' step counts and what ended them."""
    out = ["Compute utilisation (inner training s / wall s, per phase; a restarted site's jobs together):"]
    for name, rows in sorted(site_rows.items()):
        ph = [r for r in rows if r.get("split") == "phase" and r.get("util") is not None]
        if not ph:
            out.append(f"  {name}: no phase rows")
            continue
        utils = sorted(r["util"] for r in ph)
        whole = sum(r["inner_s"] for r in ph) / max(sum(r["cycle_s"] for r in ph), 1e-9)
        ends = {}
        for r in ph:
            ends[r.get("ended_by")] = ends.get(r.get("ended_by"), 0) + 1
        out.append(f"  {name}: median {utils[len(utils) // 2]:.2f}, whole run {whole:.2f} over {len(ph)} phases; "
                   f"steps per phase {min(r['steps'] for r in ph)}-{max(r['steps'] for r in ph)}; ended by "
                   + ", ".join(f"{k} {v}" for k, v in sorted(ends.items(), key=lambda kv: str(kv[0]))))
    return out


def run_demo(cfg: DemoConfig):
    demo = Demo(cfg.validate())
    demo.header()
    signal.signal(signal.SIGTERM, _sigterm_as_interrupt)
    with harness.Launcher() as launcher:
        try:
            demo.prepare(launcher)
            demo.services(launcher)
            for name in SITES:
                demo.launch(launcher, name)
            trained = demo.watch(launcher)
            fed, darl = demo.finish(launcher, trained)
            body = demo.audit(trained, fed, darl)
        except KeyboardInterrupt:
            say(f"\n{stamp(demo.t0)} interrupted: stopping every process the demo started")
            return 130
        except Exception as e:
            say(f"\n{stamp(demo.t0)} demo.py: {type(e).__name__}: {e}")
            say("stopping every process the demo started")
            return 1
    return demo.summary(body)


def build_parser():
    d = DemoConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog="\n\n".join(__doc__.split("\n\n")[1:]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--out", default=d.out, help=f"working directory, wiped first (default {d.out})")
    a("--corpus-mb", type=float, default=d.corpus_mb, help=f"stdlib source bytes to tokenize, MB (default {d.corpus_mb})")
    a("--seq-len", type=int, default=d.seq_len, help=f"tokens per training window (default {d.seq_len})")
    a("--heldout-windows", type=int, default=d.heldout_windows,
      help=f"windows kept out of training for the held-out loss (default {d.heldout_windows})")
    a("--block-size", type=int, default=d.block_size, help=f"windows per DARL block (default {d.block_size})")
    a("--model", default=d.model, help=f"model (default {d.model})")
    a("--batch-size", type=int, default=d.batch_size, help=f"windows per rank per step (default {d.batch_size})")
    a("--inner-steps", type=int, default=d.inner_steps, help=f"H, inner steps per round with --phase-s 0, and the "
      f"first phase's lease otherwise (default {d.inner_steps})")
    a("--phase-s", type=float, default=d.phase_s, help=f"the round's length in s that FedMom offers the sites "
      f"(fedmom_server.py --phase-s): each site trains as many steps as fit; 0 = H steps a phase "
      f"(default {d.phase_s:g})")
    a("--lr", type=float, default=d.lr, help=f"inner AdamW peak learning rate (default {d.lr})")
    a("--ranks", type=int, default=d.ranks, help=f"ranks per site (default {d.ranks})")
    a("--throttle-ms", type=int, default=d.throttle_ms, help=f"extra ms per step of site beta (default {d.throttle_ms})")
    a("--kill-site", default=d.kill_site, choices=("alpha", "beta", "none"),
      help=f"site SIGKILLed mid-phase and restarted (default {d.kill_site})")
    a("--kill-after-round", type=int, default=d.kill_after_round,
      help=f"kill during the phase after this merged round (default {d.kill_after_round})")
    a("--lease-ttl-s", type=float, default=d.lease_ttl_s,
      help=f"DARL's longest lease TTL, s: how long a killed site's leases outlive it (default {d.lease_ttl_s:g})")
    a("--member-timeout-s", type=float, default=d.member_timeout_s,
      help=f"FedMom drops a silent member after this many s (default {d.member_timeout_s:g})")
    a("--round-deadline-s", type=float, default=d.round_deadline_s,
      help=f"FedMom merges without a late site this many s after the first delta (default {d.round_deadline_s:g})")
    a("--outer-lr", type=float, default=d.outer_lr, help=f"FedMom outer learning rate (default {d.outer_lr})")
    a("--outer-momentum", type=float, default=d.outer_momentum,
      help=f"FedMom Nesterov momentum (default {d.outer_momentum})")
    a("--timeout-min", type=float, default=d.timeout_min,
      help=f"give up (FAIL) if training has not ended after this many minutes (default {d.timeout_min:g})")
    a("--seed", type=int, default=d.seed, help=f"model init and DARL permutation seed (default {d.seed})")
    return p


def main(argv=None):
    a = build_parser().parse_args(argv)
    return run_demo(DemoConfig(**vars(a)))


if __name__ == "__main__":
    sys.exit(main())
