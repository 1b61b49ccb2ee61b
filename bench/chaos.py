"""bench/chaos.py - real training under random faults: exactly-once, theta replay, held-out loss, goodput.

Runs on: this machine's CPU (`make chaos`; torch, as `make demo`). Two real torchrun sites
train the demo's model (qwen3-tiny) through the three central services over TLS, while a
seeded schedule SIGKILLs and SIGSTOPs every process at random; killed sites are requeued
with --resume auto, as a batch queue would. Then the same corpus is trained once more with
no fault (the baseline), in the same invocation, and the two are compared.

    make chaos                                  # = .venv/bin/python bench/chaos.py (15 min of faults)
    .venv/bin/python bench/chaos.py --minutes 5 --seed 2
    .venv/bin/python bench/chaos.py --quick     # ~3 min of faults on a small corpus (make bench)

The processes (testbed/harness.py starts them on 127.0.0.1, https with a fresh CA, bearer token):
    alpha   torchrun 2 ranks, FSDP2, --wire int4 --overlap --overlap-fold end, inline deltas
    beta    torchrun 2 ranks, DDP, --wire int4 --overlap (fold on arrival), blob deltas,
            --throttle-ms (the slow site)
    central darl_server.py, fedmom_server.py --down-wire int4, blobstore.py
The faults, one at a time, at exponentially distributed gaps (--mean-gap-s), for --minutes
or until DARL has no block left (kinds and weights: KINDS):
    site_kill      a site's whole torchrun tree SIGKILLed at a random moment (mostly
                   mid-phase: inner steps are most of a site's time), requeued after 0-3 s
    site_kill_at   ... SIGKILLed at a fault point (testhooks.fault_point, armed in the site's
                   PWW_TEST_FAULT_DIR): site.trained (checkpointed, delta not sent),
                   site.sent (delta accepted, outcome unknown to the site), site.fold
                   (error feedback settled, theta_global not yet folded in)
    site_stop      a site SIGSTOPped for 3 s to 2 x the lease TTL (past it about half the
                   time: its lease expires, its delta must not merge), then SIGCONTed
    fedmom_kill_at the aggregator SIGKILLed at fedmom.received, .spooled, .custody_held,
                   .merge (mid-merge), .round_durable, .committed; restarted after 0-2 s
    darl_kill_at   DARL SIGKILLed at darl.append, darl.torn, darl.synced
    blob_kill_at   the blob store SIGKILLed mid-upload (blob.chunk)
    <server>_kill  a server SIGKILLed at a random moment; <server>_stop SIGSTOPped 2-20 s
A fault point not reached within 60 s is disarmed and counted as not reached.

The judgement (exit 1 on any violation; the table at the end says which):
    - audit.py on both servers' durable state: PASS (every block inside exactly one merged delta);
    - theta_global equals a replay of the recorded merges, bit for bit: from the initial
      model, fedmom_merge.merge_files and fedmom_merge.publish (the int4 update with the
      aggregator's error feedback) over the deltas the aggregator accepted (hard-linked as
      they were spooled: fedmom_state.KEEP_DELTAS_ENV), in the recorded order and shares;
    - no site exited non-zero by itself; both sites finished;
    - the held-out loss within --loss-tolerance of the unfaulted run's (the same corpus:
      every training window once in both, so the same tokens).
The goodput, from the sites' metrics rows (--log-every 1: one train row per step, its
tokens and step time) and the aggregator's round records (each merged delta's tokens and
inner_s): tokens inside merged deltas / tokens trained by all incarnations, and inner-step
seconds that ended in a merged delta / all inner-step seconds. Lost work is split by where
it went: refused stale, lease lost (a stopped site), excluded, refused, and killed (trained
by an incarnation that died before its delta was accepted). A killed incarnation's step in
progress is not in its rows (< 1 step per kill is not counted as trained).
Beside it, each site's compute utilisation, from its "phase" rows (inner_s, cycle_s of
every phase that ended): inner-step seconds over the seconds the site was up (its
torchrun trees alive, from each launch to its exit or kill; a SIGSTOPped site is up, a
killed one waiting for its requeue is not), and over the phases' cycles (lease, steps,
checkpoint, round trip); the goodput counts work lost, this the seconds a site spent not
training. A phase cut by a kill has no row: its steps are up-time not counted as inner;
a SIGSTOP that lands mid-phase is inside that phase's inner_s (a wall-clock interval, as in
the step times the goodput sums), so a stopped site can look busier than unfaulted.

Everything goes under --out (default runs/chaos/, wiped first): data/ (corpus, init),
chaos/ and baseline/ (central/ state, sites/<site>/ metrics, logs/, faults/, kept-deltas/),
summary.txt (the final table).
"""
import argparse
import collections
import dataclasses
import json
import os
import random
import shutil
import signal
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)                          # run as `python bench/chaos.py`: the siblings one level up
sys.path.insert(1, os.path.join(ROOT, "tests"))   # tests/certs.py: the CA and certificate, as central.sh makes them

import numpy as np  # noqa: E402

import audit  # noqa: E402
import certs  # noqa: E402
import durable  # noqa: E402
import fedmom_merge  # noqa: E402
import fedmom_round  # noqa: E402
import fedmom_state  # noqa: E402
import outer_state  # noqa: E402
from testbed import harness  # noqa: E402
import httpc  # noqa: E402
import tensorio  # noqa: E402
import testhooks  # noqa: E402

# kind -> weight; the points of the *_at kinds
KINDS = {"site_kill": 4, "site_kill_at": 4, "site_stop": 3, "fedmom_kill_at": 3, "fedmom_kill": 1, "fedmom_stop": 1,
         "darl_kill_at": 2, "darl_kill": 1, "darl_stop": 1, "blob_kill_at": 1, "blob_kill": 1, "blob_stop": 1}
POINTS = {"site": ("site.trained", "site.sent", "site.fold"),
          "fedmom": ("fedmom.received", "fedmom.spooled", "fedmom.custody_held", "fedmom.merge",
                     "fedmom.round_durable", "fedmom.committed"),
          "darl": ("darl.append", "darl.torn", "darl.synced"), "blob": ("blob.chunk",)}
POINT_WAIT_S = 60.0
NOISE_ROUNDS = 5                  # the held-out loss's noise: its spread over an unfaulted run's last rounds
SITES = {"alpha": dict(parallel="fsdp", transport="inline", throttle=False, extra=["--overlap-fold", "end"]),
         "beta": dict(parallel="ddp", transport="blob", throttle=True, extra=[])}
LOST_KINDS = ("stale", "lease lost", "excluded", "refused", "unknown", "killed")


def say(msg=""):
    print(msg, flush=True)


@dataclasses.dataclass
class ChaosConfig:
    out: str = "runs/chaos"
    minutes: float = 15.0
    seed: int = 0
    quick: bool = False
    corpus_mb: float = 0.0            # 0: 0.3 MB per minute of faults (the unfaulted run trains ~0.26 MB/min
                                      # on this project's busy 2-core machine: faults cover the faulted run)
    mean_gap_s: float = 10.0
    seq_len: int = 128
    heldout_windows: int = 64
    block_size: int = 16
    batch_size: int = 8
    inner_steps: int = 10
    lr: float = 3e-3
    ranks: int = 2
    throttle_ms: int = 40
    lease_ttl_s: float = 15.0
    member_timeout_s: float = 15.0
    round_deadline_s: float = 60.0
    loss_tolerance: float = 0.03
    baseline: bool = True
    timeout_min: float = 0.0          # 0: 3 x --minutes + 10

    def resolve(self):
        if self.quick:
            self.minutes = min(self.minutes, 3.0)
        if self.corpus_mb <= 0:
            self.corpus_mb = round(0.3 * self.minutes, 3)
        if self.timeout_min <= 0:
            self.timeout_min = 3 * self.minutes + 10
        for ok, msg in ((self.minutes > 0, "--minutes must be > 0"), (self.mean_gap_s > 0, "--mean-gap-s must be > 0"),
                        (self.lease_ttl_s >= 5, "--lease-ttl-s must be >= 5 (heartbeats every TTL/3)"),
                        (self.inner_steps >= 1, "--inner-steps must be >= 1"), (self.ranks >= 1, "--ranks must be >= 1")):
            if not ok:
                raise SystemExit(f"bench/chaos.py: {msg}")
        return self


# ---------------------------------------------------------------- one federation, faulted or not

class Federation:
    """The three services and the two sites of one run under `root`; inject() applies one fault."""

    def __init__(self, cfg, root, data, launcher, rng=None):
        self.cfg, self.root, self.data, self.L, self.rng = cfg, root, data, launcher, rng
        self.logs, self.sites_dir = os.path.join(root, "logs"), os.path.join(root, "sites")
        self.faults, self.kept = os.path.join(root, "faults"), os.path.join(root, "kept-deltas")
        for d in (self.logs, self.sites_dir, self.faults):
            os.makedirs(d, exist_ok=True)
        self.sites, self.requeue_at, self.ours = {}, {}, set()    # ours: Procs we killed
        self.up, self.up_since = collections.Counter(), {}        # site -> s its trees were alive; since when
        self.finished, self.findings = set(), []
        self.injected, self.not_reached, self.launches = collections.Counter(), collections.Counter(), collections.Counter()
        self.at_points, self.point = collections.Counter(), None
        self.t0 = time.monotonic()

    def env(self, role):
        d = os.path.join(self.faults, role)
        os.makedirs(d, exist_ok=True)
        extra = {testhooks.FAULT_DIR_ENV: d}
        if role == "fedmom":
            extra[fedmom_state.KEEP_DELTAS_ENV] = self.kept
        return harness.child_env(**extra)

    # -- processes
    def start_services(self):
        c, root = self.cfg, self.root
        self.state = os.path.join(root, "central")
        os.makedirs(self.state, exist_ok=True)
        self.token_file = harness.make_token(os.path.join(root, "token"))
        agg = harness.make_token(os.path.join(root, "aggregator.token"))
        self.token = httpc.load_token(self.token_file)
        os.makedirs(os.path.join(root, "tls"))
        self.ca, cert, key = certs.make_tls(os.path.join(root, "tls"))
        common = ["--token-file", self.token_file, "--tls-cert", cert, "--tls-key", key]
        ttl = c.lease_ttl_s
        self.args = {
            "darl": ["--manifest", self.data["manifest"], "--block-size", c.block_size, "--seed", c.seed,
                     "--state-dir", self.state, "--aggregator-token-file", agg, "--min-ttl", 5, "--default-ttl", ttl,
                     "--max-ttl", ttl, "--restore-grace", ttl, *common],
            "blob": ["--root", os.path.join(self.state, "blobs"), *common]}
        self.procs, self.urls = {}, {}
        for kind in ("darl", "blob"):
            self._start(kind, 0)
        self.args["fedmom"] = ["--state-dir", os.path.join(self.state, "fedmom"), "--init", self.data["init"],
                               "--darl", self.urls["darl"], "--blob-url", self.urls["blob"], "--darl-token-file", agg,
                               "--outer-lr", 0.7, "--outer-momentum", 0.9, "--round-deadline-s", c.round_deadline_s,
                               "--member-timeout-s", c.member_timeout_s, "--darl-retry-s", 2, "--down-wire", "int4",
                               "--ca-file", self.ca, *common]
        self._start("fedmom", 0)
        self.services = harness.Services(self.urls["darl"], self.urls["fedmom"], self.urls["blob"], self.state,
                                         self.token_file, self.procs)

    def _start(self, kind, port):
        for attempt in range(6):           # a killed server's port may be held for a moment
            try:
                self.procs[kind], url = harness.start_server(self.L, kind, self.args[kind],
                                                             os.path.join(self.logs, f"{kind}.log"), port=port,
                                                             ca_file=self.ca, env=self.env(kind))
                break
            except (RuntimeError, TimeoutError):
                if attempt == 5:
                    raise
                time.sleep(1.0)
        self.urls.setdefault(kind, url)
        return url

    def restart(self, kind):
        self._start(kind, httpc.split_url(self.urls[kind])[2])

    def train_args(self):
        c = self.cfg
        steps = -(-self.data["train_windows"] // (len(SITES) * c.ranks * c.batch_size))
        return ["--model", "qwen3-tiny", "--batch-size", c.batch_size, "--lr", c.lr, "--seed", c.seed,
                "--steps", steps, "--diloco-inner-steps", c.inner_steps, "--log-every", 1,
                "--eval-windows", c.heldout_windows, "--eval-every", 0, "--wire", "int4", "--overlap",
                "--ca-file", self.ca, "--register-wait-s", 600]

    def launch(self, name, resume=False):
        s, c = SITES[name], self.cfg
        self.launches[name] += 1
        self.up_since[name] = time.monotonic()
        self.sites[name] = harness.launch_site(
            self.L, name, self.services, self.data["manifest"], log_dir=self.logs, nproc=c.ranks,
            parallel=s["parallel"], runs_dir=self.sites_dir, train_args=self.train_args() + s["extra"], resume=resume,
            throttle_ms=c.throttle_ms if s["throttle"] else 0, transport=s["transport"],
            log_name=f"{name}-{self.launches[name]}", env=self.env(f"site-{name}"))

    # -- watching
    def supervise(self):
        """Requeue killed sites (--resume auto) when due; a site that exited non-zero by itself is a finding."""
        now = time.monotonic()
        for name, p in list(self.sites.items()):
            if name in self.requeue_at:
                if now >= self.requeue_at[name]:
                    del self.requeue_at[name]
                    self.launch(name, resume=True)
                continue
            rc = p.poll()
            if rc is None or name in self.finished:
                continue
            self.went_down(name)
            if rc == 0:
                self.finished.add(name)
            elif p in self.ours:
                self.requeue_at[name] = now
            else:
                self.findings.append(f"site {name} exited {rc} by itself; see {p.log_path}")
                say(f"  !! site {name} exited {rc} by itself; last lines:\n      " + "\n      ".join(p.tail(8)))
                self.requeue_at[name] = now + 1.0

    def went_down(self, name):
        """Site `name`'s tree is gone (exited, or killed by us): its up-time ends now."""
        if name in self.up_since:
            self.up[name] += time.monotonic() - self.up_since.pop(name)

    def done(self):
        return self.finished == set(SITES)

    def wait(self, cond, bound_s):
        """Poll cond() while supervising; its value, or None after bound_s (or once both sites finished)."""
        end = time.monotonic() + bound_s
        while True:
            self.supervise()
            v = cond()
            if v:
                return v
            if self.done() or time.monotonic() > end:
                return None
            time.sleep(0.1)

    def status(self, kind):
        try:
            return httpc.call(self.urls[kind], "GET", "/status", token=self.token, timeout=10, ca_file=self.ca)
        except Exception:
            return None

    # -- faults
    def inject(self, kind):
        """One fault of `kind`; -> (True if it happened, what it was)."""
        rng = self.rng
        role, _, how = kind.partition("_")
        if role == "site":
            live = [n for n, p in self.sites.items() if p.alive() and n not in self.finished and n not in self.requeue_at]
            if not live:
                return False, "no live site"
            name = rng.choice(live)
            p = self.sites[name]
            if how == "stop":
                secs = round(rng.uniform(3.0, 2.0 * self.cfg.lease_ttl_s), 1)
                self._stop(p, secs)
                return True, f"{name} SIGSTOPped {secs:g} s" + (" (past the lease TTL)" if secs > self.cfg.lease_ttl_s else "")
            point = None
            if how == "kill_at":
                point = self.point = rng.choice(POINTS["site"])
                if not self._at(f"site-{name}", point, rng.randint(0, 1), lambda: not p.alive()):
                    return False, f"{name} at {point}: not reached"
            self.ours.add(p)
            p.signal_tree(signal.SIGKILL)
            harness.wait_for(p.gone, 60, 0.05)
            self.went_down(name)
            self._disarm(f"site-{name}", point)
            pause = round(rng.uniform(0.0, 3.0), 1)
            self.requeue_at[name] = time.monotonic() + pause
            return True, f"{name} SIGKILLed " + (f"at {point}" if point else "at a random moment") + f", requeued after {pause:g} s"
        p = self.procs[role]
        if how == "stop":
            secs = round(rng.uniform(2.0, 20.0), 1)
            self._stop(p, secs)
            return True, f"{role} SIGSTOPped {secs:g} s"
        point = None
        if how == "kill_at":
            point = self.point = rng.choice(POINTS[role])
            if not self._at(role, point, rng.randint(0, 2), lambda: not p.alive()):
                return False, f"{role} at {point}: not reached"
        p.kill()
        self._disarm(role, point)
        pause = round(rng.uniform(0.0, 2.0), 1)
        time.sleep(pause)
        self.restart(role)
        return True, f"{role} SIGKILLed " + (f"at {point}" if point else "at a random moment") + f", back after {pause:g} s"

    def _stop(self, p, secs):
        p.signal_tree(signal.SIGSTOP)
        try:
            self.wait(lambda: False, secs)
        finally:
            p.signal_tree(signal.SIGCONT)

    def _at(self, role, point, skip, gone):
        """Arm `point` (after `skip` passes) in role's fault dir; True once a process stopped there."""
        durable.write_text(os.path.join(self.faults, role, point), str(skip), fsync=False)
        hit = os.path.join(self.faults, role, point + ".hit")
        if self.wait(lambda: os.path.exists(hit) or gone(), POINT_WAIT_S) and os.path.exists(hit):
            return True
        self._disarm(role, point)
        return False

    def _disarm(self, role, point):
        if point:
            for suffix in ("", ".hit"):
                durable.unlink(os.path.join(self.faults, role, point + suffix))

    def run(self, minutes, timeout_min, log):
        """Start everything, inject faults for `minutes` (rng None: none), then wait for both
        sites to finish. -> wall seconds, or None at the timeout."""
        self.start_services()
        for name in SITES:
            self.launch(name)
        fault_end, deadline = self.t0 + 60 * minutes, self.t0 + 60 * timeout_min
        n = 0
        while self.rng is not None and time.monotonic() < fault_end and not self.done():
            gap = self.rng.expovariate(1.0 / self.cfg.mean_gap_s)
            self.wait(lambda: False, min(gap, max(0.0, fault_end - time.monotonic())))
            if self.done() or time.monotonic() >= fault_end:
                break
            kind = self.rng.choices(list(KINDS), list(KINDS.values()))[0]
            self.point = None
            ok, what = self.inject(kind)
            n += 1
            (self.injected if ok else self.not_reached)[kind] += 1
            if ok and self.point:
                self.at_points[self.point] += 1
            log(f"fault {n}: {kind}: {what}")
        self.fault_s = time.monotonic() - self.t0
        if self.rng is not None:
            log(f"faults stopped ({'DARL ran out of blocks' if self.done() else f'{minutes:g} min passed'}); "
                "waiting for both sites to finish")
        ok = self.wait(self.done, max(0.0, deadline - time.monotonic()))
        if not ok:
            self.findings.append(f"TIMEOUT: the sites had not finished after {timeout_min:g} min")
        return time.monotonic() - self.t0

    def finish(self):
        """Commits settled, status saved, servers stopped (SIGTERM: DARL writes its snapshot)."""
        harness.wait_for(lambda: (self.status("fedmom") or {}).get("pending_commits") == 0, 60, 0.5)
        for kind in ("fedmom", "darl"):
            with open(os.path.join(self.root, f"{kind}_status.json"), "w") as f:
                json.dump(self.status(kind), f, indent=1)
        for p in list(self.sites.values()) + [self.procs[k] for k in ("fedmom", "blob", "darl")]:
            p.stop(20)
        for name in list(self.up_since):      # still up at a timeout: counted until stopped
            self.went_down(name)


# ---------------------------------------------------------------- the judgement

def final_files(fed_dir, out_dir):
    """The stopped aggregator's theta_global and residual, rebuilt from its checkpoint and log
    (outer_state.load_outer), as files in out_dir -> (theta path, residual path or None)."""
    outer = outer_state.load_outer(fed_dir)
    theta = outer.write("theta", os.path.join(out_dir, "final-theta.safetensors"), fsync=False)
    residual = outer.residual and outer.write("residual", os.path.join(out_dir, "final-residual.safetensors"),
                                              fsync=False)
    return theta, residual


def replay_theta(init, fed_dir, kept, records, work, codec, lr=0.7, mu=0.9):
    """theta_global by the aggregator's own functions over the recorded merges: per round,
    fedmom_merge.merge_files on the merged deltas (in the record's order, token shares times
    the clip scale fedmom_merge.clip_scales gives on the recorded norms), then with --down-wire
    fedmom_merge.publish (the int4 update and the error feedback owed). -> (the final theta's
    path or None, problems, every round's theta path in round order: kept for the held-out noise,
    the residual owed after the last round or None)."""
    os.makedirs(work, exist_ok=True)
    theta = os.path.join(work, "theta-0.safetensors")       # round 0: the aggregator's own theta-0 of the init file
    outer_state.init_theta(init, theta, fsync=False)
    momentum, residual, history, problems, thetas = None, None, [], [], []
    for rec in records:
        merged = [o for o in rec.get("outcomes", ()) if o["outcome"] == "merged"]
        paths = [os.path.join(kept, f"{o.get('delta')}.safetensors") for o in merged]
        missing = [o.get("delta") for o, p in zip(merged, paths) if not os.path.exists(p)]
        if missing or not merged:
            return None, problems + [f"round {rec['round']}: merged deltas {missing or '(none)'} were never kept"], thetas, None
        by_inc = {c["incarnation"]: c for c in rec["clusters"].values()}
        norms = [by_inc[o["incarnation"]]["delta_norm"] or 0.0 for o in merged]
        recent = [n for r in history[-fedmom_round.CLIP_HISTORY_ROUNDS:] for n in r]
        scales, _ = fedmom_merge.clip_scales(norms, recent, 10.0)
        for o, s in zip(merged, scales):
            if abs(round(s, 6) - by_inc[o["incarnation"]]["clip_scale"]) > 1e-6:
                problems.append(f"round {rec['round']}: clip scale {s} recomputed, {by_inc[o['incarnation']]['clip_scale']} recorded")
        total = sum(o["tokens"] for o in merged)
        r = rec["round"]
        out_theta = os.path.join(work, f"merged-{r}.safetensors")
        out_mom = os.path.join(work, f"momentum-{r}.safetensors")
        fedmom_merge.merge_files(theta, None if rec.get("momentum_reset") else momentum,
                                 [(p, (o["tokens"] / total) * s) for p, o, s in zip(paths, merged, scales)],
                                 out_theta, out_mom, lr, mu, {"round": str(r)}, fsync=False)
        if codec is not None:
            new_theta, res = os.path.join(work, f"theta-{r}.safetensors"), os.path.join(work, f"residual-{r}.safetensors")
            fedmom_merge.publish(theta, out_theta, residual, codec, new_theta, os.path.join(work, "update.safetensors"),
                                 res, {"round": str(r)}, fsync=False)
            for old in (out_theta, residual if residual else None):
                if old:
                    os.unlink(old)
            residual, out_theta = res, new_theta
        if momentum:
            os.unlink(momentum)
        theta, momentum = out_theta, out_mom
        thetas.append(theta)
        history.append(norms)
    return theta, problems, thetas, residual


def same_bits(a, b):
    with tensorio.TensorReader(a) as ra, tensorio.TensorReader(b) as rb:
        if ra.names != rb.names:
            return False, f"names differ: {ra.names[:3]} vs {rb.names[:3]}"
        bad = [n for n in ra.names if not np.array_equal(ra.read(n).view(np.uint32), rb.read(n).view(np.uint32))]
    return not bad, f"{len(bad)} tensor(s) differ, first {bad[0]}" if bad else f"{len(ra.names)} tensors, bit for bit"


def site_rows(sites_dir):
    return {n: durable.read_jsonl(os.path.join(sites_dir, n, "metrics.jsonl")) for n in SITES}


def lost_kind(reason):
    r = (reason or "").lower()
    for k in ("stale", "lease lost", "excluded", "refused", "unknown"):
        if r.startswith(k) or (k == "unknown" and "outcome unknown" in r):
            return k
    return "refused"


def goodput(records, rows):
    """The accounting: tokens and inner-step seconds trained by every incarnation (train
    rows, one per step), those inside merged deltas (round records), and where the rest went."""
    trained = collections.defaultdict(lambda: [0.0, 0.0])          # (cluster, inc) -> [tokens, seconds]
    step_s = {}                                                     # (cluster, inc, step) -> seconds
    phases = {}                                                     # (cluster, inc, lease) -> federation row
    for name, rs in rows.items():
        for r in rs:
            if r.get("split") == "train":
                t = trained[(name, r["incarnation"])]
                t[0] += r["tokens_per_s"] * r["step_ms"] / 1e3
                t[1] += r["step_ms"] / 1e3
                step_s[(name, r["incarnation"], r["step"])] = r["step_ms"] / 1e3
            elif r.get("split") == "federation":
                phases[(name, r["incarnation"], r["lease"])] = r

    def phase_s(key, r):     # the phase's steps as its train rows timed them (inner_s also holds the rows' writes)
        return sum(step_s.get((key[0], key[1], s), 0.0) for s in range(r["step"] - r["steps"] + 1, r["step"] + 1))
    merged = {}
    for rec in records:
        by_inc = {c["incarnation"]: c for c in rec["clusters"].values()}
        for o in rec.get("outcomes", ()):
            if o["outcome"] == "merged":
                key = (o["cluster"], o["incarnation"], o["leases"][0]["id"])
                r = phases.get(key)      # None: its site died before the outcome (the record's inner_s then)
                merged[key] = (o["tokens"], phase_s(key, r) if r else by_inc.get(o["incarnation"], {}).get("inner_s") or 0.0)
    lost = {k: [0.0, 0.0] for k in LOST_KINDS}
    told = sorted(f"{k[0]} {k[1]} lease {k[2]}" for k, r in phases.items() if r.get("merged") and k not in merged)
    for key, r in phases.items():
        if key not in merged and not r.get("merged"):
            k = lost_kind(r.get("reason"))
            lost[k][0] += r["tokens"]
            lost[k][1] += phase_s(key, r)
    tok = sum(t for t, _ in trained.values())
    sec = sum(s for _, s in trained.values())
    m_tok = sum(t for t, _ in merged.values())
    m_sec = sum(s for _, s in merged.values())
    named = [sum(v[i] for k, v in lost.items() if k != "killed") for i in (0, 1)]
    lost["killed"] = [max(0.0, tok - m_tok - named[0]), max(0.0, sec - m_sec - named[1])]
    return {"trained_tokens": tok, "trained_s": sec, "merged_tokens": m_tok, "merged_s": m_sec,
            "token_goodput": m_tok / tok if tok else None, "compute_goodput": m_sec / sec if sec else None,
            "incarnations": len(trained), "lost": lost, "merged_deltas": len(merged), "told_merged_missing": told}


def utilisation(rows, up):
    """Each site's compute utilisation from its "phase" rows (one per phase that ended, every
    incarnation's) and `up` (site -> seconds its trees were alive): {site: {"phases", "inner_s",
    "cycle_s", "up_s", "of_up" (inner_s / up_s), "of_cycles" (inner_s / cycle_s), "median"
    (the median phase's inner_s / cycle_s)}}; a ratio is None where its divisor is 0."""
    out = {}
    for name, rs in rows.items():
        phases = [r for r in rs if r.get("split") == "phase" and r.get("cycle_s")]
        inner, cycles = sum(r["inner_s"] for r in phases), sum(r["cycle_s"] for r in phases)
        each = sorted(r["inner_s"] / r["cycle_s"] for r in phases)
        out[name] = {"phases": len(phases), "inner_s": inner, "cycle_s": cycles, "up_s": up.get(name, 0.0),
                     "of_up": inner / up[name] if up.get(name) else None,
                     "of_cycles": inner / cycles if cycles else None,
                     "median": (each[len(each) // 2] + each[(len(each) - 1) // 2]) / 2 if each else None}
    return out


def judge(fed, data, cfg, wall):
    """-> (checks [(name, ok, detail)], figures dict) of one finished run."""
    fed_dir = os.path.join(fed.state, "fedmom")
    records = durable.read_jsonl(os.path.join(fed_dir, "rounds.jsonl"))
    checks = [("sites finished", fed.done() and not any("TIMEOUT" in f for f in fed.findings),
               ", ".join(sorted(fed.finished)) or "none")]
    crashed = [f for f in fed.findings if "by itself" in f]
    checks.append(("no site exited non-zero by itself", not crashed, "; ".join(crashed)))
    report = audit.audit(fed.state, manifest=data["manifest"])
    checks.append(("audit.py: every block inside exactly one merged delta", report.ok,
                   "; ".join(l.strip() for l in report.lines if l.startswith(("FAIL", "  !!")))[:300]))
    final, final_residual = final_files(fed_dir, fed.root)
    codec = fedmom_state.ServerConfig(state_dir=fed_dir, down_wire="int4").down_codec()
    replayed, problems, thetas, residual = replay_theta(data["init"], fed_dir, fed.kept, records,
                                                        os.path.join(fed.root, "replay"), codec)
    ok, detail = same_bits(replayed, final) if replayed else (False, "; ".join(problems))
    if ok and residual:              # and the error feedback the aggregator owes its next update
        ok, d = same_bits(residual, final_residual)
        detail += f"; its residual: {d}"
    checks.append((f"theta_global = replay of the {len(records)} recorded merges", ok and not problems,
                   detail + ("; " + "; ".join(problems[:3]) if problems else "")))
    rows = site_rows(fed.sites_dir)
    figures = goodput(records, rows)
    figures["util"] = utilisation(rows, fed.up)
    told = figures["told_merged_missing"]
    checks.append(("every delta a site was told merged is in the round records", not told, "; ".join(told[:3])))
    figures.update(rounds=len(records), wall_s=wall, final=final,
                   heldout=harness.heldout_loss(final, data["manifest"], "qwen3-tiny"),
                   # the round-to-round spread of the held-out loss over the last rounds: the noise
                   last_heldout=[harness.heldout_loss(t, data["manifest"], "qwen3-tiny") for t in thetas[-NOISE_ROUNDS:]])
    return checks, figures


# ---------------------------------------------------------------- the bench

def prepare(cfg, launcher, log):
    d = os.path.join(os.path.abspath(cfg.out), "data")
    m = harness.tokenize(d, cfg.corpus_mb * 1e6, cfg.seq_len, cfg.heldout_windows)
    log(f"corpus: {m['tokens_total']:,} tokens, {m['num_windows'] - m['heldout_windows']} training windows "
        f"({-(-(m['num_windows'] - m['heldout_windows']) // cfg.block_size)} DARL blocks)")
    init = harness.export_init(launcher, os.path.join(d, "init.safetensors"), m["path"], "qwen3-tiny", cfg.seed,
                               os.path.join(d, "export-init.log"))
    return {"manifest": m["path"], "init": init, "train_windows": m["num_windows"] - m["heldout_windows"],
            "seq_len": cfg.seq_len}


def one_run(cfg, data, label, rng, log):
    root = os.path.join(os.path.abspath(cfg.out), label)
    with harness.Launcher() as L:
        fed = Federation(cfg, root, data, L, rng)
        try:
            wall = fed.run(cfg.minutes if rng else 0, cfg.timeout_min, log)
        finally:
            fed.finish()
    checks, figures = judge(fed, data, cfg, wall)
    return fed, checks, figures


def table(cfg, chaos, base, init_loss):
    fed, checks, f = chaos
    lines = ["", "=" * 78, f"CHAOS  seed {cfg.seed}, {cfg.minutes:g} min of faults, corpus {cfg.corpus_mb:g} MB, "
             f"wall {f['wall_s'] / 60:.1f} min ({fed.fault_s / 60:.1f} under faults), {f['rounds']} rounds merged", "=" * 78]
    kinds = sorted(set(fed.injected) | set(fed.not_reached), key=list(KINDS).index)
    lines.append("faults injected by kind (reached / armed):")
    lines += [f"  {k:<16} {fed.injected[k]:>3} / {fed.injected[k] + fed.not_reached[k]}" for k in kinds]
    if fed.at_points:
        lines.append("  at fault points: " + ", ".join(f"{p} {n}" for p, n in sorted(fed.at_points.items())))
    lines.append(f"  {'total':<16} {sum(fed.injected.values()):>3} / "
                 f"{sum(fed.injected.values()) + sum(fed.not_reached.values())};  site launches "
                 + ", ".join(f"{n} {k}" for n, k in sorted(fed.launches.items())) + f";  {f['incarnations']} incarnations trained")
    lines.append("goodput:")
    lines.append(f"  tokens inside merged deltas / trained by all incarnations  {f['merged_tokens']:>12,.0f} / "
                 f"{f['trained_tokens']:>12,.0f} = {f['token_goodput']:.1%}")
    lines.append(f"  inner-step s ending in a merged delta / all inner-step s   {f['merged_s']:>12.1f} / "
                 f"{f['trained_s']:>12.1f} = {f['compute_goodput']:.1%}")
    lines.append("  where the lost work went (tokens, inner-step s):")
    for k in LOST_KINDS:
        t, s = f["lost"][k]
        if t or s:
            label = {"killed": "killed (mid-phase / before acceptance)", "stale": "refused stale",
                     "lease lost": "lease lost before the send (stopped)", "unknown": "outcome unknown, not merged"}.get(k, k)
            lines.append(f"    {label:<40} {t:>10,.0f}  {s:>8.1f} s")
    if base:
        _, bchecks, b = base
        ratio = f["heldout"] / b["heldout"]
        noise = max(b["last_heldout"]) - min(b["last_heldout"]) if b["last_heldout"] else 0.0
        allowed = max(cfg.loss_tolerance * b["heldout"], noise)
        lines.append(f"held-out loss ({cfg.heldout_windows} windows): initial {init_loss:.4f}; unfaulted {b['heldout']:.4f} "
                     f"({b['rounds']} rounds, {b['wall_s'] / 60:.1f} min; its last {len(b['last_heldout'])} rounds "
                     f"{min(b['last_heldout'], default=0):.4f}..{max(b['last_heldout'], default=0):.4f}, noise {noise:.4f}); "
                     f"chaos {f['heldout']:.4f} (last rounds {min(f['last_heldout'], default=0):.4f}.."
                     f"{max(f['last_heldout'], default=0):.4f}); ratio chaos/unfaulted {ratio:.4f}")
        lines.append(f"unfaulted run's goodput: {b['token_goodput']:.1%} tokens, {b['compute_goodput']:.1%} compute")
        checks = checks + [(f"held-out loss within the noise of the unfaulted run (max({cfg.loss_tolerance:.0%}, its "
                            f"last-{NOISE_ROUNDS}-round spread) above it)",
                            f["heldout"] <= b["heldout"] + allowed,
                            f"{f['heldout']:.4f} <= {b['heldout']:.4f} + {allowed:.4f}")]
        checks += [(f"unfaulted run: {n}", ok, d) for n, ok, d in bchecks]
    else:
        lines.append(f"held-out loss: initial {init_loss:.4f}, chaos {f['heldout']:.4f} (no unfaulted run: --no-baseline)")
    lines += util_lines(f["util"], base[2]["util"] if base else None)
    lines.append("anchor: Decoupled DiLoCo reports 88% goodput under heavy failures (DDP 27%)")
    lines.append("checks:")
    lines += [f"  {'PASS' if ok else 'FAIL'}  {n}" + (f": {d}" if d else "") for n, ok, d in checks]
    failed = [n for n, ok, _ in checks if not ok]
    lines.append(f"{'FAIL: ' + '; '.join(failed) if failed else 'PASS: all checks'}")
    return lines, bool(failed)


def util_lines(chaos, unfaulted=None):
    """The utilisation table: per site, the chaos run's row and the unfaulted run's under it."""
    def pct(x):
        return "-" if x is None else f"{x:.1%}"
    lines = ["compute utilisation (phase rows: inner-step s over the s the site was up, and over its phases' cycles):",
             f"  {'site':<6} {'run':<10} {'phases':>6} {'inner s':>9} {'up s':>9} {'inner/up':>9} {'cycles s':>9} "
             f"{'inner/cycles':>12} {'median phase':>12}"]
    for name in sorted(chaos):
        for label, runs in (("chaos", chaos), ("unfaulted", unfaulted)):
            u = (runs or {}).get(name)
            if u is not None:
                lines.append(f"  {name:<6} {label:<10} {u['phases']:>6} {u['inner_s']:>9.1f} {u['up_s']:>9.1f} "
                             f"{pct(u['of_up']):>9} {u['cycle_s']:>9.1f} {pct(u['of_cycles']):>12} "
                             f"{pct(u['median']):>12}")
    return lines


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="\n\n".join(__doc__.split("\n\n")[1:]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    d = ChaosConfig()
    a = p.add_argument
    a("--out", default=d.out, help=f"working directory, wiped first (default {d.out})")
    a("--minutes", type=float, default=d.minutes, help=f"minutes of faults (default {d.minutes:g}; fewer if DARL runs out)")
    a("--seed", type=int, default=d.seed, help="the fault schedule's seed (and the model's, DARL's order)")
    a("--quick", action="store_true", help="at most 3 minutes of faults on a corpus sized for them (make bench)")
    a("--corpus-mb", type=float, default=d.corpus_mb, help="corpus size, MB (default 0.3 x --minutes)")
    a("--mean-gap-s", type=float, default=d.mean_gap_s, help=f"mean seconds between faults (default {d.mean_gap_s:g})")
    a("--inner-steps", type=int, default=d.inner_steps, help=f"H, inner steps per phase (default {d.inner_steps})")
    a("--ranks", type=int, default=d.ranks, help=f"ranks per site (default {d.ranks})")
    a("--lease-ttl-s", type=float, default=d.lease_ttl_s, help=f"DARL's lease TTL, s (default {d.lease_ttl_s:g})")
    a("--loss-tolerance", type=float, default=d.loss_tolerance,
      help=f"held-out loss allowed above the unfaulted run's, relative (default {d.loss_tolerance:g})")
    a("--no-baseline", dest="baseline", action="store_false", help="skip the unfaulted run (no held-out comparison)")
    a("--timeout-min", type=float, default=d.timeout_min, help="give up (FAIL) after this many minutes per run "
      "(default 3 x --minutes + 10)")
    cfg = ChaosConfig(**vars(p.parse_args(argv))).resolve()
    t0 = time.monotonic()

    def log(msg):
        s = int(time.monotonic() - t0)
        say(f"[{s // 60:3d}:{s % 60:02d}] {msg}")

    def on_term(signum, frame):
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, on_term)
    out = os.path.abspath(cfg.out)
    if os.path.isdir(out):
        shutil.rmtree(out)
    os.makedirs(out)
    try:
        with harness.Launcher() as L:
            data = prepare(cfg, L, log)
        log(f"chaos run: two sites, faults for {cfg.minutes:g} min (mean gap {cfg.mean_gap_s:g} s), seed {cfg.seed}")
        chaos = one_run(cfg, data, "chaos", random.Random(cfg.seed), log)
        log(f"chaos run ended: {chaos[2]['rounds']} rounds; goodput {chaos[2]['token_goodput']:.1%} tokens")
        base = None
        if cfg.baseline:
            log("unfaulted run: the same corpus, seed and sites, no fault")
            base = one_run(cfg, data, "baseline", None, log)
            log(f"unfaulted run ended: {base[2]['rounds']} rounds in {base[2]['wall_s'] / 60:.1f} min")
        init_loss = harness.heldout_loss(data["init"], data["manifest"], "qwen3-tiny")
    except KeyboardInterrupt:
        say("interrupted: every process this bench started was stopped")
        return 130
    lines, failed = table(cfg, chaos, base, init_loss)
    say("\n".join(lines))
    with open(os.path.join(out, "summary.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
