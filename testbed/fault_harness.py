"""fault_harness.py - exactly-once under fault schedules: real servers, fake sites, faults, and
the oracle's verdict.

Runs on: this machine (CPU; Python + numpy, never torch), imported by bench/fault_schedule.py
(random schedules, its command line) and tests/test_fault_schedule.py (fixed ones); nothing to
run from the shell. For each schedule it starts real darl_server.py, fedmom_server.py (--darl)
and blobstore.py processes on 127.0.0.1 (their own state dirs under the work dir) and 2-3 fake
sites (fault_site.py processes: the real clients, no training, small seeded random deltas for
real leases, a record of what each sent and held), injects the schedule's faults at protocol
phases, and has fault_oracle.py judge the outcome.

    res = fault_harness.run_schedule(seed, work_dir)   # or sched=Schedule(...); res.findings [] = passed

What it owns: the schedules (make_schedule, drawn from the seed), the processes (Proc, Run),
and these faults (KINDS; POINTS names the fault points of testhooks.py each may stop at):
    darl_kill         DARL SIGKILLed at darl.append, darl.torn or darl.synced
    fedmom_kill       the aggregator SIGKILLed at one of its fault points, back after 0-2 s
    fedmom_outage     the aggregator down for 2-3 x the longest lease TTL, then back
    blob_kill         the blob store SIGKILLed mid-upload (blob.chunk)
    site_kill         a site SIGKILLed at site.trained or site.sent; requeued as a new incarnation
    site_stop         a site SIGSTOPped past its lease TTL at site.trained or site.checked (maybe
                      with a newcomer site leasing its expired blocks), then SIGCONTed
    darl_flag         DARL restarted with --max-attempts or --max-grant changed: refused naming
                      the flag, then restarted with --accept-config-change
    clock_step        the servers' wall clock stepped by +-1 h across a DARL restart
    token_rotation    new tokens, the sites' (unless each has its own) and the aggregator's, DARL first
    stale_aggregator  a stopped copy of the aggregator started beside the live one 1-3 times:
                      DARL must fence it at every start (exit 3)
  the pipelined round's (STREAMED: 0-2 a schedule, drawn last, so older seeds keep theirs):
    publish_kill      the aggregator SIGKILLed at fedmom.merge while a site follows its update;
                      newcomer: once a site built it whole and a newcomer joined, whose delta
                      the restart merges too (the sites must discard what they built)
    check_kill        the aggregator SIGKILLed at fedmom.check_stream (a blob delta checked as it lands)
    apply_kill        a site SIGKILLed at site.follow (fedsite.Follow), requeued as for site_kill
    site_revoke       (drawn after those, 1 schedule in 4; each site then has its own credential) a
                      site's revoked at site.trained or site.sent: 403, requeued with a new one
Sites may be careless, overlapped, int4 or time-budgeted (fault_site.py); aggregators may run
--down-wire int4 or --phase-s with the quorum rule. Beside the oracle: the changed-flag restart
refused naming the flag, no site crashed, nothing stalled; a failing schedule keeps its dir.
"""
import collections
import dataclasses
import http.client
import json
import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

import audit
import durable
from testbed import fault_oracle
from testbed import fault_site
import httpc
import testhooks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the checkout: testbed/ is one level down
TTL = (3.0, 4.0)                  # DARL --min-ttl / --max-ttl: every lease lives 3-4 s unless renewed
MEMBER_TIMEOUT_S, ROUND_DEADLINE_S = 10, 20   # longer than a stop, so a stopped site's round waits for it
                                              # (unless --phase-s's quorum rule closes it without the site)
PORTS = (12000, 28000)            # server ports: below the kernel's ephemeral range, so no other socket takes a
                                  # killed server's port before it comes back on it
SCHEDULE_DEADLINE_S = 300         # a schedule still running after this is a stall (a liveness failure)
KINDS = ("darl_kill", "fedmom_kill", "fedmom_outage", "blob_kill", "site_kill", "site_stop", "darl_flag",
         "clock_step", "token_rotation", "stale_aggregator")
WEIGHTS = (3, 4, 2, 1, 3, 2, 1, 1, 1, 1)
STREAMED = ("publish_kill", "check_kill", "apply_kill")   # the pipelined round's faults: drawn last
KINDS += STREAMED
REVOKE = ("site_revoke",)         # drawn after STREAMED, for the same reason
KINDS += REVOKE
FOLLOW_WAIT_S = 30                # publish_kill: the merge held this long at most for a site to follow it
EXIT_FENCED = 3                   # fedmom_server's exit status when DARL fenced it
POINTS = {"darl_kill": ("darl.append", "darl.torn", "darl.synced"),
          "fedmom_kill": ("fedmom.received", "fedmom.spooled", "fedmom.custody_held", "fedmom.merge",
                          "fedmom.round_durable", "fedmom.committed", "fedmom.epoch_durable"),
          "blob_kill": ("blob.chunk",), "site_kill": ("site.trained", "site.sent"),
          "site_stop": ("site.trained", "site.checked"),
          "publish_kill": ("fedmom.merge",), "check_kill": ("fedmom.check_stream",), "apply_kill": ("site.follow",),
          "site_revoke": ("site.trained", "site.sent")}
# the streamed check's point, while it is being added to fedmom_state.py: drawn only once it is there
with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fedmom_state.py")) as _f:
    CHECK_STREAM = 'fault_point("fedmom.check_stream")' in _f.read()
STOP = threading.Event()          # SIGTERM / Ctrl-C: every running schedule stops its processes and ends


class Interrupted(BaseException):
    """The whole run is being stopped (not a finding)."""


# ---------------------------------------------------------------- schedules

@dataclasses.dataclass
class Fault:
    kind: str
    after: int                    # inject once the sites have sent this many deltas in all
    point: str | None = None
    target: str | None = None     # a site's name (site faults)
    skip: int = 0                 # hits of the point to let pass first
    pause: float = 0.0            # seconds down before the restart
    value: object = None          # darl_flag: (flag, new value); clock_step: +-3600

    def describe(self):
        bits = [self.kind] + [f"{k}={v}" for k, v in (("point", self.point), ("target", self.target),
                                                       ("skip", self.skip), ("pause", self.pause),
                                                       ("value", self.value)) if v not in (None, 0, 0.0)]
        return f"after {self.after} sends: " + " ".join(bits)


@dataclasses.dataclass
class Schedule:
    seed: int
    sites: list                   # [(name, transport)]
    blocks: int
    span: int
    max_attempts: int
    faults: list
    careless: list = dataclasses.field(default_factory=list)   # sites that send without checking the lease
    overlapped: list = dataclasses.field(default_factory=list)  # sites that train on while a delta is in flight
    int4: list = dataclasses.field(default_factory=list)        # sites that send int4 deltas (train.py --wire int4)
    down_wire: str = "f32"        # the aggregator's --down-wire: f32 (sites download theta) or int4 (updates)
    phase_s: float | None = None  # the aggregator's --phase-s offer, with the quorum rule on (None: neither)
    quorum: float = 0.5           # its --quorum and --grace-frac (with phase_s only)
    grace_frac: float = 0.2
    timed: dict = dataclasses.field(default_factory=dict)       # time-budgeted sites: name -> s per fake step

    @property
    def credentials(self):
        """Each site its own credential (--credentials) when a fault revokes one."""
        return any(f.kind == "site_revoke" for f in self.faults)

    @property
    def checkpoint_rounds(self):
        """The aggregator's --checkpoint-rounds, 1 to 4 by seed: kills land between checkpoints
        (a restart replays the rounds since) and on them."""
        return 1 + self.seed % 4

    def describe(self):
        head = (f"seed {self.seed}: sites {self.sites}, {self.blocks} blocks, span {self.span}, "
                f"--max-attempts {self.max_attempts}" + (f", careless {self.careless}" if self.careless else "")
                + (f", overlapped {self.overlapped}" if self.overlapped else "")
                + (f", int4 {self.int4}" if self.int4 else "")
                + (f", aggregator --down-wire {self.down_wire}" if self.down_wire != "f32" else "")
                + (f", aggregator --phase-s {self.phase_s} --quorum {self.quorum} --grace-frac {self.grace_frac}"
                   if self.phase_s else "")
                + (f", time-budgeted {self.timed} (s per step)" if self.timed else "")
                + f", --checkpoint-rounds {self.checkpoint_rounds}")
        return "\n".join([head] + [f"  {i + 1}. {f.describe()}" for i, f in enumerate(self.faults)])


def make_schedule(seed):
    rng = random.Random(seed)
    n_sites = rng.choice((2, 2, 3))
    sites = [(name, rng.choice(("inline", "inline", "blob"))) for name in ("alpha", "beta", "gamma")[:n_sites]]
    careless = sorted(name for name, _ in sites if rng.random() < 0.3)
    blocks, span = rng.randint(18, 30), rng.choice((2, 3))
    transports = {t for _, t in sites}
    faults, after = [], 0
    for _ in range(rng.randint(2, 4)):
        kind = rng.choices(KINDS[:len(WEIGHTS)], WEIGHTS)[0]
        if kind == "blob_kill" and "blob" not in transports:
            kind = "fedmom_kill"
        after += rng.randint(0, 1)
        f = Fault(kind, after)
        if kind in POINTS:
            points = [x for x in POINTS[kind] if x != "fedmom.received" or "inline" in transports]
            f.point, f.skip = rng.choice(points), rng.randint(0, 2)
        if kind in ("site_kill", "site_stop"):
            f.target = rng.choice(sites)[0]
        if kind in ("fedmom_kill", "darl_kill", "blob_kill", "site_kill"):
            f.pause = round(rng.uniform(0.0, 2.0), 2)
        if kind == "fedmom_outage":
            f.pause = round(rng.uniform(2.0, 3.0) * TTL[1], 2)
        if kind == "darl_flag":
            f.value = rng.choice((("--max-attempts", rng.choice((0, 2, 4))), ("--max-grant", rng.choice((0, 1, 5)))))
        if kind == "clock_step":
            f.value = rng.choice((3600, -3600))
        if kind == "stale_aggregator":
            f.value = rng.randint(1, 3)
        if kind == "site_stop" and f.point == "site.checked" and rng.random() < 0.6:
            f.value = "newcomer"
        faults.append(f)
    attempts = rng.choice((0, 3))
    overlapped = sorted(name for name, _ in sites if rng.random() < 0.4)     # drawn after the rest: older
    int4 = sorted(name for name, _ in sites if rng.random() < 0.4)           # seeds keep their schedules
    down_wire = rng.choice(("f32", "int4"))
    phase_s, quorum, grace_frac, timed = None, 0.5, 0.2, {}
    if rng.random() < 0.5:                   # drawn last too: time-budgeted sites, rounds closed by quorum
        phase_s, quorum = rng.choice((0.3, 0.4, 0.5)), rng.choice((0.3, 0.5, 0.5))
        grace_frac = rng.choice((0.1, 0.2, 0.5))
        timed = {name: round(phase_s / rng.choice((2, 3, 4)), 3) for name, _ in sites if rng.random() < 0.8}
    faults += _streamed(rng, faults[-1].after, sites, down_wire)
    if rng.random() < 0.25:                  # last: per-site credentials, one of them revoked mid-round
        f = Fault("site_revoke", faults[-1].after + rng.randint(0, 1), skip=rng.randint(0, 1))
        f.point, f.target = rng.choice(POINTS["site_revoke"]), rng.choice(sites)[0]
        faults.append(f)
    return Schedule(seed, sites, blocks, span, attempts, faults, careless, overlapped, int4, down_wire,
                    phase_s, quorum, grace_frac, timed)


def _streamed(rng, after, sites, down_wire):
    """0-2 faults of the pipelined round, drawn after everything else (older seeds keep their
    schedules): the aggregator killed mid-merge while sites follow its update, or mid-way
    through a streamed check of a blob delta; a site killed in its streamed apply."""
    kinds = [k for k, ok in (("publish_kill", down_wire == "int4"), ("apply_kill", down_wire == "int4"),
                             ("check_kill", CHECK_STREAM and any(t == "blob" for _, t in sites))) if ok]
    out = []
    for _ in range(rng.choice((0, 1, 1, 2)) if kinds else 0):
        after += rng.randint(0, 1)
        f = Fault(rng.choice(kinds), after, skip=rng.randint(0, 1), pause=round(rng.uniform(0.0, 1.0), 2))
        f.point = POINTS[f.kind][0]
        f.target = rng.choice(sites)[0] if f.kind == "apply_kill" else None
        if f.kind == "publish_kill" and rng.random() < 0.5:
            f.skip, f.value = 1, "newcomer"     # the whole update followed, then another round made durable
        out.append(f)
    return out


# ---------------------------------------------------------------- one schedule's processes

class Proc:
    """One server or site process, in its own session, with its own fault-point dir."""

    def __init__(self, run, name, cmd):
        self.run, self.name, self.cmd = run, name, cmd
        self.faults = os.path.join(run.dir, "faults", name)
        os.makedirs(self.faults, exist_ok=True)
        self.log_path = os.path.join(run.dir, "logs", f"{name}.log")
        self.p = None

    def start(self, cmd=None, wait_url=True):
        mark = os.path.getsize(self.log_path) if os.path.exists(self.log_path) else 0
        env = {**os.environ, testhooks.FAULT_DIR_ENV: self.faults, testhooks.CLOCK_OFFSET_ENV: self.run.clock_file,
               "PYTHONPATH": ROOT, "PWW_TOKEN": ""}
        with open(self.log_path, "ab") as log:
            self.p = subprocess.Popen(cmd or self.cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True)
        if not wait_url:
            return None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with open(self.log_path, errors="replace") as f:
                f.seek(mark)
                for line in f:
                    if " listening on " in line:
                        return line.split()[-1]
            if self.p.poll() is not None:
                raise RuntimeError(f"{self.name} exited {self.p.returncode} at start; see {self.log_path}")
            time.sleep(0.02)
        raise RuntimeError(f"{self.name} did not listen within 60 s; see {self.log_path}")

    def alive(self):
        return self.p is not None and self.p.poll() is None

    def signal(self, sig):
        if self.alive():
            os.kill(self.p.pid, sig)

    def kill(self):
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGKILL)
        if self.p is not None:
            self.p.wait()

    def term(self, timeout=30):
        self.signal(signal.SIGTERM)
        try:
            self.p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    def arm(self, point, skip):
        with open(os.path.join(self.faults, point), "w") as f:
            f.write(str(skip))

    def hit(self, point):
        return os.path.exists(os.path.join(self.faults, point + ".hit"))

    def release(self, point):
        """Let a process stopped at `point` go on (it removes the .hit as it leaves)."""
        durable.unlink(os.path.join(self.faults, point))

    def disarm(self, point):
        for suffix in ("", ".hit"):
            durable.unlink(os.path.join(self.faults, point + suffix))


class SiteCredentials:
    """Each site its own credential (a schedule with site_revoke): the file the servers read
    (--credentials) and the operator's commands on it (httpd.py site)."""

    def __init__(self, workdir):
        self.file, self.dir = os.path.join(workdir, "credentials.json"), os.path.join(workdir, "sites")

    def command(self, *args):
        out = subprocess.run([sys.executable, "httpd.py", "site", "--file", self.file, *args], cwd=ROOT,
                             capture_output=True, text=True, timeout=60)
        if out.returncode:
            raise RuntimeError(f"httpd.py site {' '.join(args)}: {out.stderr or out.stdout}")

    def token_file(self, name):
        """The site's own token file (its credential made on first use)."""
        path = os.path.join(self.dir, f"{name}.token")
        if not os.path.exists(path):
            self.command("add", name, "--out", self.dir)
        return path

    def revoke_and_renew(self, name):
        """Revoke every credential of the site, and make the one its next job starts with."""
        self.command("revoke", name)
        self.command("add", name, "--out", self.dir)


class Run:
    """The servers, the sites and the records of one schedule; apply() injects one fault."""

    def __init__(self, sched, workdir, log=None):
        self.s, self.dir, self.log = sched, workdir, log or (lambda msg: None)
        for sub in ("logs", "records", "faults", "central"):
            os.makedirs(os.path.join(workdir, sub), exist_ok=True)
        self.central, self.records = os.path.join(workdir, "central"), os.path.join(workdir, "records")
        self.clock_file = os.path.join(workdir, "clock_offset")
        open(self.clock_file, "w").close()
        self.token_file = os.path.join(workdir, "token")
        self.agg_token_file = os.path.join(workdir, "aggregator.token")    # the custody endpoints' own credential
        self._write_token()
        self.creds = SiteCredentials(workdir) if sched.credentials else None
        self.cred_args = ["--credentials", self.creds.file] if self.creds else []
        self.darl_flags = {"--max-attempts": sched.max_attempts, "--max-grant": 0}
        self.procs, self.sites, self.requeue, self.transports = {}, {}, {}, dict(sched.sites)
        self.findings, self.injected = [], collections.Counter()
        self.committed_seen, self.max_round_seen = set(), 0
        self.token_exits = 0              # site exits for a refused token (the 401 a rotation promises)
        self.t0 = time.monotonic()

    def _write_token(self):
        """A new sites' token and a new aggregator token (written, not yet read by any server)."""
        self.token, self.agg_token = secrets.token_hex(16), secrets.token_hex(16)
        for path, token in ((self.token_file, self.token), (self.agg_token_file, self.agg_token)):
            durable.write_text(path, token + "\n", fsync=False)

    # -- processes
    def darl_cmd(self, port, accept=False):
        flags = [x for k, v in self.darl_flags.items() for x in (k, str(v))]
        return [sys.executable, "darl_server.py", "--num-samples", str(self.s.blocks), "--block-size", "1",
                "--seed", str(self.s.seed % 1000), "--state-dir", self.central, "--port", str(port),
                "--token-file", self.token_file, "--aggregator-token-file", self.agg_token_file, *self.cred_args,
                "--min-ttl", str(TTL[0]), "--default-ttl", str(TTL[0]),
                "--max-ttl", str(TTL[1]), "--restore-grace", str(2 * TTL[1]), "--snapshot-every", "25", *flags] + (
            ["--accept-config-change"] if accept else [])

    def start_servers(self):
        init = os.path.join(self.dir, "init.safetensors")
        rng = np.random.default_rng(self.s.seed)
        fault_site.write_tensors(init, {k: rng.standard_normal(s).astype(np.float32)
                                        for k, s in fault_site.SHAPES.items()})
        self.init = init
        self.darl_port = pick_port()
        self.procs["darl"] = Proc(self, "darl", self.darl_cmd(self.darl_port))
        self.darl = self.procs["darl"].start()
        self.procs["blob"] = Proc(self, "blob", [sys.executable, "blobstore.py", "--root",
                                                 os.path.join(self.central, "blobs"), "--port", str(pick_port()),
                                                 "--token-file", self.token_file, *self.cred_args])
        self.blob = self.procs["blob"].start()
        fed = [sys.executable, "fedmom_server.py", "--state-dir", os.path.join(self.central, "fedmom"),
               "--init", init, "--darl", self.darl, "--blob-url", self.blob, "--token-file", self.token_file,
               *self.cred_args,
               "--darl-token-file", self.agg_token_file,
               "--outer-lr", str(fault_oracle.LR), "--outer-momentum", str(fault_oracle.MU),
               "--round-deadline-s", str(ROUND_DEADLINE_S),
               "--member-timeout-s", str(MEMBER_TIMEOUT_S), "--darl-retry-s", "0.5", "--port", str(pick_port()),
               "--down-wire", self.s.down_wire, "--checkpoint-rounds", str(self.s.checkpoint_rounds)] + (
            ["--phase-s", str(self.s.phase_s), "--quorum", str(self.s.quorum), "--grace-frac", str(self.s.grace_frac)]
            if self.s.phase_s else [])
        self.procs["fedmom"] = Proc(self, "fedmom", fed)
        self.fedmom = self.procs["fedmom"].start()

    def start_site(self, name):
        transport = self.transports.setdefault(name, "inline")
        cmd = [sys.executable, "-m", "testbed.fault_site", "--cluster", name, "--darl", self.darl,
               "--fedmom", self.fedmom, "--blob", self.blob, "--token-file",
               self.creds.token_file(name) if self.creds else self.token_file,
               "--records", self.records, "--seed", str(self.s.seed), "--span", str(self.s.span),
               "--transport", transport, "--train-s", "0.15", "--phase-s", "0.5"] + (
            ["--careless"] if name in self.s.careless else []) + (
            ["--overlap"] if name in self.s.overlapped else []) + (
            ["--wire", "int4"] if name in self.s.int4 else []) + (
            ["--step-s", str(self.s.timed[name])] if name in self.s.timed else [])
        proc = self.sites.get(name) or Proc(self, f"site-{name}", cmd)
        proc.cmd = cmd
        proc.start(wait_url=False)
        self.sites[name] = proc
        self.requeue.pop(name, None)

    def restart(self, name, cmd=None):
        """Start a server again on its own port (tried a few times: a socket another process
        closes late may hold the port for a moment)."""
        for attempt in range(5):
            try:
                url = self.procs[name].start(cmd)
                break
            except RuntimeError:
                if attempt == 4:
                    raise
                self.wait(lambda: False, 1.0)
        assert url == getattr(self, name), (url, getattr(self, name))

    # -- watching
    def sends(self):
        n = 0
        for fn in os.listdir(self.records):
            if fn.endswith(".jsonl"):
                with open(os.path.join(self.records, fn)) as f:
                    n += sum(1 for line in f if '"event": "sent"' in line)
        return n

    def trained(self, name):
        """Has (any incarnation of) site `name` trained a span yet?"""
        for fn in os.listdir(self.records):
            if fn.startswith(f"{name}-") and fn.endswith(".jsonl"):
                with open(os.path.join(self.records, fn)) as f:
                    if any('"event": "trained"' in line for line in f):
                        return True
        return False

    def supervise(self):
        """Requeue sites that stopped for a token refusal or a kill; note a site that crashed."""
        if STOP.is_set():
            raise Interrupted()
        now = time.monotonic()
        for name, proc in self.sites.items():
            if name in self.requeue:
                if now >= self.requeue[name]:
                    self.start_site(name)
                continue
            rc = proc.p.poll()
            if rc is None or rc == 0:
                continue
            if rc == fault_site.EXIT_TOKEN:
                self.token_exits += 1
                self.requeue[name] = now + 0.3
            elif rc < 0:                 # killed by us: the fault that did it set the requeue time
                self.requeue.setdefault(name, now)
            else:
                self.findings.append(f"site {name} crashed (exit {rc}); see {proc.log_path}")
                self.requeue[name] = now + 0.5
        if now - self.t0 > SCHEDULE_DEADLINE_S:
            raise Stalled(f"still running after {SCHEDULE_DEADLINE_S} s")

    def finished(self):
        return not self.requeue and all(p.p.poll() == 0 for p in self.sites.values())

    def wait(self, cond, bound_s=None):
        """Poll cond() while supervising the sites; False when the run finished first (or bound_s passed)."""
        end = None if bound_s is None else time.monotonic() + bound_s
        while not cond():
            self.supervise()
            self.observe()
            if self.finished() or (end is not None and time.monotonic() > end):
                return False
            time.sleep(0.05)
        return True

    def observe(self, every_s=1.0):
        """What DARL acknowledged as committed and the rounds the aggregator announced, now."""
        if time.monotonic() - getattr(self, "_observed", 0.0) < every_s:
            return
        self._observed = time.monotonic()
        try:
            got = httpc.call(self.darl, "GET", "/custody?state=committed", token=self.agg_token, timeout=2)
            self.committed_seen |= {c["delta"] for c in got["custody"]}
            self.max_round_seen = max(self.max_round_seen,
                                      httpc.call(self.fedmom, "GET", "/round", token=self.token, timeout=2)["round"])
        except (OSError, http.client.HTTPException, httpc.CallError, ValueError):
            pass

    # -- faults
    def apply(self, f):
        if not self.wait(lambda: self.sends() >= f.after):
            return False
        if f.kind in ("darl_kill", "fedmom_kill", "blob_kill", "check_kill"):
            return self._kill_at(self.procs["fedmom" if f.kind == "check_kill" else f.kind.split("_")[0]], f)
        if f.kind == "publish_kill":
            return self._publish_kill(f) if f.value == "newcomer" else self._kill_at(
                self.procs["fedmom"], f, held=self._followed)
        if f.kind == "apply_kill":
            return self._site_kill(f)
        if f.kind == "fedmom_outage":
            self.procs["fedmom"].kill()
            self.wait(lambda: False, f.pause)
            self.restart("fedmom")
            return True
        if f.kind == "site_kill":
            return self._site_kill(f)
        if f.kind == "site_stop":
            return _site_stop(self, f)
        if f.kind == "darl_flag":
            return self._darl_flag(f)
        if f.kind == "clock_step":
            with open(self.clock_file) as fh:
                now = float(fh.read().strip() or 0)
            with open(self.clock_file, "w") as fh:
                fh.write(str(now + f.value))
            self.procs["darl"].kill()
            self.restart("darl")
            return True
        if f.kind == "token_rotation":
            self._write_token()
            exits = self.token_exits
            self.procs["darl"].term()
            self.restart("darl")
            # the aggregator's calls (and the sites' DARL calls) get 401 meanwhile
            self.wait(lambda: self.token_exits > exits or "401" in self._fedmom_alarm(), bound_s=5.0)
            for name in ("fedmom", "blob"):
                self.procs[name].term()
                self.restart(name)
            if self.creds:                    # each site holds its own credential: none is refused
                return True
            return self.wait(lambda: self.token_exits > exits, bound_s=60)    # a site met the 401, requeued
        if f.kind == "stale_aggregator":
            return self._stale_aggregator(f)
        if f.kind == "site_revoke":
            return _site_revoke(self, f)
        raise ValueError(f.kind)

    def _kill_at(self, proc, f, held=None):
        """SIGKILL `proc` once it stops at f.point (and, with `held`, once held() too, for at
        most FOLLOW_WAIT_S: the kill comes either way, reached only if held() came true)."""
        proc.arm(f.point, f.skip)
        reached = self.wait(lambda: proc.hit(f.point) or not proc.alive())
        if reached and held is not None and proc.alive():
            reached = self.wait(held, FOLLOW_WAIT_S)
        elif not reached:
            proc.disarm(f.point)
            return False
        proc.kill()
        proc.disarm(f.point)
        self.wait(lambda: False, f.pause)
        self.restart(proc.name)
        return reached

    def _publish_kill(self, f):
        """publish_kill, value newcomer: the merge held once a site built the followed theta
        whole (theta-next), a newcomer joins (durable: the aggregator lists it), the aggregator
        is killed; its restart waits for the newcomer's delta (a live member's), trained from
        the durable round, and merges the round again with it: the round made durable is not
        the one the sites built, which they must discard (fedsite.Follow.adopt's digest comparison)."""
        fed = self.procs["fedmom"]
        fed.arm(f.point, f.skip)
        reached = self.wait(lambda: fed.hit(f.point) or not fed.alive())
        reached = reached and fed.alive() and self.wait(lambda: self._followed("theta-next.safetensors"),
                                                        FOLLOW_WAIT_S)
        if reached:
            name = f"newcomer{len(self.sites)}"
            self.start_site(name)
            reached = self.wait(lambda: name in self._members(), 60)
        fed.kill()
        fed.disarm(f.point)
        self.wait(lambda: False, f.pause)
        self.restart("fedmom")
        return bool(reached)

    def _members(self):
        try:
            got = httpc.call(self.fedmom, "GET", "/status", token=self.token, timeout=5)["members"]
        except (OSError, http.client.HTTPException, httpc.CallError, KeyError):
            return []
        return [m["cluster"] for m in got]

    def _followed(self, fn="theta-followed.safetensors"):
        """Does a live site hold bytes of an update it follows now (fedsite.Follow's file, made
        at the first reply of GET /theta_update_next; or with fn theta-next.safetensors, the
        theta it built whole; gone once adopted or discarded; a killed incarnation's is left in
        its own dir, so only each site's newest incarnation counts)?"""
        newest = {}
        for rec in os.listdir(self.records):
            if rec.endswith(".jsonl"):
                with open(os.path.join(self.records, rec)) as f:
                    first = f.readline()
                if first.endswith("\n"):
                    e = json.loads(first)
                    if e["t"] > newest.get(e["cluster"], (0.0, None))[0]:
                        newest[e["cluster"]] = (e["t"], e["incarnation"])
        return any(self.sites[name].alive() and os.path.exists(
            os.path.join(self.records, "theta", f"{name}-{inc}", fn))
            for name, (_, inc) in newest.items() if name in self.sites)

    def _site_kill(self, f):
        proc = self.sites[f.target]
        proc.arm(f.point, f.skip)
        reached = self.wait(lambda: proc.hit(f.point) or f.target in self.requeue)
        proc.disarm(f.point)
        if not reached or f.target in self.requeue:
            return False
        self.requeue[f.target] = time.monotonic() + f.pause
        proc.kill()
        return True

    def _stale_aggregator(self, f):
        live = self.procs["fedmom"]
        live.term()
        src, copy = os.path.join(self.central, "fedmom"), os.path.join(self.dir, "fedmom-stale")
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(src, copy, ignore=shutil.ignore_patterns("lock"))
        with open(os.path.join(copy, "state.json")) as fh:
            copied = json.load(fh)["epoch"]
        self.restart("fedmom")
        deadline = time.monotonic() + 60          # the live one is issued its epoch first (sites done or not)
        while self._fedmom_epoch() <= copied:
            if time.monotonic() > deadline:
                self.findings.append(f"the restarted aggregator was not issued an epoch above {copied} in 60 s")
                return True
            self.supervise()
            time.sleep(0.05)
        port = pick_port()
        cmd = [copy if x == src else x for x in live.cmd]
        cmd[cmd.index("--port") + 1] = str(port)
        stale = Proc(self, "fedmom-stale", cmd)
        try:
            for i in range(f.value):
                stale.start(wait_url=False)
                try:
                    rc = stale.p.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    rc = None
                if rc != EXIT_FENCED:
                    self.findings.append(f"a stale copy of the aggregator's state (epoch {copied}) started beside "
                                         f"the live one was not fenced at start {i + 1} (exit {rc}); see "
                                         f"{stale.log_path}")
                    return True
        finally:
            stale.kill()
            with PORT_LOCK:
                PORTS_TAKEN.discard(port)
        return True

    def _fedmom_alarm(self):
        try:
            alarm = httpc.call(self.fedmom, "GET", "/status", token=self.token, timeout=5)["darl"]["alarm"]
        except (OSError, http.client.HTTPException, httpc.CallError, KeyError):
            return ""
        return (alarm or {}).get("error", "")

    def _fedmom_epoch(self):
        try:
            return httpc.call(self.fedmom, "GET", "/status", token=self.token, timeout=5)["epoch"]
        except (OSError, http.client.HTTPException, httpc.CallError, KeyError):
            return -1

    def _darl_flag(self, f):
        flag, value = f.value
        if self.darl_flags[flag] == value:
            value = value + 1
        self.procs["darl"].term()
        self.darl_flags[flag] = value
        refused = subprocess.run(self.darl_cmd(self.darl_port), cwd=ROOT, capture_output=True, text=True,
                                 timeout=60, env={**os.environ, testhooks.CLOCK_OFFSET_ENV: self.clock_file})
        if refused.returncode == 0 or flag not in refused.stderr + refused.stdout:
            self.findings.append(f"DARL restarted with {flag} {value} changed: not refused naming the flag "
                                 f"(exit {refused.returncode}: {(refused.stderr or refused.stdout)[-300:]})")
        self.restart("darl", self.darl_cmd(self.darl_port, accept=True))
        self.procs["darl"].cmd = self.darl_cmd(self.darl_port)     # later restarts: the new flags, logged
        return True

    def wait_end(self):
        self.wait(lambda: self.finished())
        ok = self.wait(lambda: self._settled(), bound_s=60)
        if not ok:
            self.findings.append("the aggregator never settled: commits or aborts still owed, or a delta pending")

    def _settled(self):
        self.supervise()
        try:
            st = httpc.call(self.fedmom, "GET", "/status", token=self.token, timeout=5)
            darl = httpc.call(self.darl, "GET", "/status", token=self.token, timeout=5)
        except (OSError, http.client.HTTPException, httpc.CallError):
            return False
        return st["pending_commits"] == 0 and st["pending_aborts"] == 0 and not st["pending"] and darl["done"]

    def stop(self):
        for p in self.sites.values():
            p.kill()
        for name in ("fedmom", "blob", "darl"):
            if name in self.procs and self.procs[name].alive():
                self.procs[name].term()
        for proc in self.procs.values():
            port = httpc.split_url(getattr(self, proc.name, "http://x:0"))[2]
            with PORT_LOCK:
                PORTS_TAKEN.discard(port)


class Stalled(Exception):
    pass


PORTS_TAKEN, PORT_LOCK = set(), threading.Lock()


def _held_at(run, f):
    """The target site's Proc once it stands at f.point (armed, f.skip hits let pass); None if
    it never got there (the run ended, or the site was requeued first)."""
    proc = run.sites[f.target]
    proc.arm(f.point, f.skip)
    reached = run.wait(lambda: proc.hit(f.point) or f.target in run.requeue)
    if not reached or f.target in run.requeue:
        proc.disarm(f.point)
        return None
    return proc


def _site_stop(run, f):
    """SIGSTOP the site at f.point past its lease TTL (maybe with a newcomer leasing its blocks), then SIGCONT."""
    proc = _held_at(run, f)
    if proc is None:
        return False
    proc.signal(signal.SIGSTOP)
    proc.release(f.point)                 # it goes on at once when continued
    reached = True
    if f.value == "newcomer":             # its lease expires; then someone new leases and trains those blocks
        t0 = time.monotonic()
        run.wait(lambda: False, TTL[1] + 0.5)
        name = f"newcomer{len(run.sites)}"
        run.start_site(name)
        # continued once the newcomer trained (the stopped site then meets the refusal), and
        # before the stopped site's membership times out (its delta would only be stale)
        reached = run.wait(lambda: run.trained(name), MEMBER_TIMEOUT_S - 1.0 - (time.monotonic() - t0))
    else:
        run.wait(lambda: False, 1.5 * TTL[1] + 1.0)
    proc.signal(signal.SIGCONT)
    # it has left the point before the next fault may arm it again (else it stays stopped
    # there, taking the new arming for the old one)
    run.wait(lambda: not proc.hit(f.point) or not proc.alive() or f.target in run.requeue)
    proc.disarm(f.point)
    return reached                        # a newcomer that never trained: its headline case not reached


def _site_revoke(run, f):
    """Revoke the site's credential while it stands at f.point (its lease held, or its delta
    in), give it a new one as an operator would, and let it go on: it meets the 403, exits,
    and is requeued with the new credential. Its leases and deltas follow custody's rules."""
    proc = _held_at(run, f)
    if proc is None:
        return False
    exits = run.token_exits
    run.creds.revoke_and_renew(f.target)          # and the credential its next job starts with
    run.wait(lambda: False, 1.5)          # every server has read the file (httpd.RELOAD_S)
    proc.release(f.point)
    return run.wait(lambda: run.token_exits > exits, bound_s=60)


def pick_port():
    """A free loopback port in PORTS that no running schedule of this process holds."""
    import socket
    with PORT_LOCK:
        for _ in range(1000):
            port = random.randrange(*PORTS)
            if port in PORTS_TAKEN:
                continue
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
            PORTS_TAKEN.add(port)
            return port
    raise RuntimeError(f"no free port in {PORTS}")


# ---------------------------------------------------------------- running schedules

@dataclasses.dataclass
class Result:
    seed: int
    findings: list
    injected: collections.Counter
    armed: collections.Counter
    rounds: int = 0
    quarantined: int = 0
    seconds: float = 0.0
    workdir: str = ""
    seen: collections.Counter = dataclasses.field(default_factory=collections.Counter)   # site events by kind;
    # also trimmed (spans a clock ended early), trimmed_merged (of those, merged), quorum_closed (rounds)
    kinds: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # sites by kind


SITE_EVENTS = ("sent", "merged", "excluded", "refused", "stale", "lost", "unknown")


def run_schedule(seed, work_root, keep=False, sched=None):
    """Run one schedule (make_schedule(seed), or `sched`) under work_root; a Result."""
    sched = sched or make_schedule(seed)
    workdir = tempfile.mkdtemp(prefix=f"seed{seed}-", dir=work_root)
    run = Run(sched, workdir)
    injected, armed = collections.Counter(), collections.Counter()
    t0 = time.monotonic()
    try:
        run.start_servers()
        for name, _ in sched.sites:
            run.start_site(name)
        for f in sched.faults:
            armed[f.kind] += 1
            if run.apply(f):
                injected[f.kind] += 1
        run.wait_end()
    except Stalled as e:
        run.findings.append(f"STALLED: {e}")
    except Exception as e:          # the harness itself failed: a finding, with the schedule to replay it
        run.findings.append(f"harness error: {type(e).__name__}: {e}")
    finally:
        run.stop()                  # also on Interrupted, which then goes on up
    findings = run.findings if any(f.startswith("harness error") for f in run.findings) else fault_oracle.oracle(run)
    recs = durable.read_jsonl(os.path.join(run.central, "fedmom", "rounds.jsonl"))
    report_q = 0
    if not findings:
        report_q = sum(1 for s in audit.audit(run.central).status.values() if s == "quarantined")
    events = fault_oracle.read_site_records(run.records)
    seen = collections.Counter(e["event"] for e in events if e["event"] in SITE_EVENTS)
    seen["incarnations"] = sum(1 for e in events if e["event"] == "start")
    seen["trained_in_flight"] = sum(1 for e in events if e["event"] == "trained" and e.get("while_in_flight"))
    sent = {(e["incarnation"], e["base_round"], e["lease"]) for e in events if e["event"] == "sent"}
    seen["sent_int4"] = sum(1 for e in events if e["event"] == "trained" and e.get("wire") == "int4"
                            and (e["incarnation"], e["base_round"], e["lease"]) in sent)
    for e in events:
        if e["event"] == "theta":
            seen[f"theta_via_{e['via']}"] += 1
            seen["follow_discarded"] += "follow_discarded" in e
    trimmed = {(e["incarnation"], e["base_round"], e["lease"]) for e in events
               if e["event"] == "trained" and e.get("trimmed")}
    seen["trimmed"] = len(trimmed)
    seen["trimmed_merged"] = sum(1 for e in events if e["event"] == "merged"
                                 and (e["incarnation"], e["base_round"], e["lease"]) in trimmed)
    seen["quorum_closed"] = sum(1 for r in recs if str(r.get("reason", "")).startswith("quorum"))
    names = [n for n, _ in sched.sites]
    kinds = collections.Counter(f32=sum(n not in sched.int4 for n in names), int4=sum(n in sched.int4 for n in names),
                                overlapped=sum(n in sched.overlapped for n in names),
                                down_wire_int4=int(sched.down_wire == "int4"),
                                timed=sum(n in sched.timed for n in names), phase_s=int(bool(sched.phase_s)))
    res = Result(seed, findings, injected, armed, len(recs), report_q, time.monotonic() - t0, workdir, seen, kinds)
    if not findings and not keep:
        shutil.rmtree(workdir, ignore_errors=True)
    return res


def describe_failure(res, sched=None):
    return "\n".join([f"VIOLATION in seed {res.seed} (kept: {res.workdir}); replay with "
                      f"`python bench/fault_schedule.py --replay {res.seed}`:",
                      (sched or make_schedule(res.seed)).describe()] + [f"  !! {x}" for x in res.findings])


if __name__ == "__main__":
    sys.exit("fault_harness.py is imported, not run: the fault schedules run from bench/fault_schedule.py")
