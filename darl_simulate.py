"""darl_simulate.py - the end-to-end check of DARL: a real coordinator, one process per
simulated cluster, some killed mid-lease, some late, and an audit of exactly-once coverage.

Runs on: any machine with Python 3 (standard library only; darl_client.py, darl_server.py
and what they import beside it). It starts its own darl_server.py on a free loopback port
with a state directory under /tmp (kept, with the workers' reports, when the check
fails), and one process per cluster (this script's `worker` mode: a LeaseSession that
"trains" by sleeping and commits each span itself, as a site without an aggregator would).

    python darl_simulate.py --clusters 4 --kill 1 --late 1 [--blocks 1000]

It prints a per-cluster table and `PASS: coverage is exactly once` (exit 0), or the
duplicated and missing blocks (exit 1). Killed clusters are SIGKILLed holding a claimed
span they never commit (after two commits); late ones start --delay s after the others.
"""
import argparse
import collections
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import block_space
import darl_client
import httpc

WORKER_CALL_S = 30.0     # a worker's call may go this long without an answer (the coordinator is local)

def start_coordinator(state_dir, num_blocks, seed, extra=(), log_path=None):
    """A real darl_server.py process on a free loopback port: (Popen, url)."""
    log_path = log_path or os.path.join(state_dir, "coordinator.log")
    out = open(log_path, "ab")
    cmd = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "darl_server.py"),
           "--num-samples", str(num_blocks), "--block-size", "1", "--seed", str(seed),
           "--state-dir", state_dir, "--port", "0", *map(str, extra)]
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    out.close()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with open(log_path, "rb") as f:
            for line in f.read().decode(errors="replace").splitlines():
                if line.startswith("darl_server listening on "):
                    return proc, line.split()[-1]
        if proc.poll() is not None:
            raise RuntimeError(f"coordinator exited with {proc.returncode}; see {log_path}")
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"coordinator did not start within 60 s; see {log_path}")


def call_deadline():
    """A worker's calls to the coordinator: repeated by httpc's rule for up to WORKER_CALL_S."""
    return httpc.Deadline(WORKER_CALL_S, log=httpc.quiet)


def sim_worker(a):
    """One simulated cluster: trains `rate` blocks/s, reporting every span and commit."""
    space = block_space.BlockSpace(a.blocks, 1, a.seed)
    report = open(a.report, "a", buffering=1)

    def note(event, span=None, **kw):
        rec = {"event": event, "t": time.time(), **kw}
        if span is not None:
            rec.update(lease=span.lease, start=span.start, end=span.end)
        report.write(json.dumps(rec) + "\n")

    time.sleep(a.delay)                                   # queued behind other jobs
    client = darl_client.LeaseClient(a.url)
    session = darl_client.LeaseSession(client, a.cluster, space.digest(), span_blocks=a.span,
                                       phase_s=a.span / a.rate, log=lambda m: None)
    with session.start(deadline=call_deadline()):
        note("start", incarnation=session.incarnation)
        commits = 0
        while (span := session.next_span(timeout=120)) is not None:
            note("span", span)
            if a.hold_after is not None and commits >= a.hold_after:
                note("hold", span)                        # mid-lease: wait here for the SIGKILL
                while True:
                    time.sleep(3600)
            time.sleep(len(span) / a.rate)                # "training"
            try:
                session.commit(span, deadline=call_deadline())
            except darl_client.LeaseLost as e:
                note("lost", span, reason=str(e))
                continue
            note("commit", span, blocks=[space.block_at(p) for p in span.positions()])
            commits += 1
    note("exit")
    return 0


def read_reports(paths):
    """{cluster: [events]} from the workers' own report files."""
    out = {}
    for name, path in paths.items():
        events = []
        if os.path.exists(path):
            with open(path) as f:
                for line in f:
                    if line.endswith("\n"):
                        events.append(json.loads(line))
        out[name] = events
    return out


def audit(num_blocks, reports):
    """Coverage from what the clients said they committed: (rows, duplicates, missing)."""
    seen = collections.Counter()
    rows = []
    for name, events in reports.items():
        committed = [b for e in events if e["event"] == "commit" for b in e["blocks"]]
        seen.update(committed)
        spans = {(e["lease"], e["start"], e["end"]) for e in events if e["event"] == "span"}
        done = {(e["lease"], e["start"], e["end"]) for e in events if e["event"] == "commit"}
        lost = sum(end - start for _, start, end in spans - done)
        t = [e["t"] for e in events if e["event"] in ("span", "commit")]
        bps = len(committed) / (max(t) - min(t)) if len(t) > 1 and max(t) > min(t) else 0.0
        rows.append({"cluster": name, "committed": len(committed), "lost": lost, "blocks_per_s": bps,
                     "exited": any(e["event"] == "exit" for e in events)})
    duplicates = sorted(b for b, n in seen.items() if n > 1)
    missing = sorted(set(range(num_blocks)) - set(seen))
    return rows, duplicates, missing


@dataclasses.dataclass
class SimConfig:
    clusters: int
    kill: int
    late: int
    blocks: int
    span: int
    fastest: float
    spread: float
    delay: float
    seed: int
    timeout: float

    def validate(self):
        if self.clusters < 1:
            raise ValueError("--clusters must be >= 1")
        if self.kill < 0 or self.late < 0 or self.kill + self.late >= self.clusters + (self.kill == 0):
            raise ValueError(f"--kill {self.kill} and --late {self.late} must leave at least one cluster "
                             f"that is neither killed nor late, of --clusters {self.clusters}")
        if self.blocks < 1 or self.span < 1 or self.fastest <= 0 or self.spread < 1:
            raise ValueError("--blocks, --span and --fastest must be positive, --spread >= 1")
        return self

    def rates(self):
        n = self.clusters
        return [self.fastest / self.spread ** (i / (n - 1)) if n > 1 else self.fastest for i in range(n)]


def simulate(cfg):
    """Coordinator + one process per cluster; kill some, delay some; audit; 0 = PASS."""
    rates = cfg.rates()
    names = [f"sim-{i}" for i in range(cfg.clusters)]
    killed = names[1:1 + cfg.kill] if cfg.clusters > 1 else names[:cfg.kill]
    late = [n for n in names if n not in killed and n != names[0]][:cfg.late]
    work = tempfile.mkdtemp(prefix="darl-sim-")
    coord, url = start_coordinator(work, cfg.blocks, cfg.seed,
                                   ["--min-ttl", 2, "--default-ttl", 4, "--grant-seconds", 1,
                                    "--initial-grant", 2 * cfg.span, "--max-attempts", 0])
    reports = {n: os.path.join(work, f"{n}.jsonl") for n in names}
    procs = {}
    t0 = time.monotonic()
    try:
        for n, rate in zip(names, rates):
            cmd = [sys.executable, os.path.abspath(__file__), "worker", "--url", url, "--cluster", n,
                   "--rate", str(rate), "--blocks", str(cfg.blocks), "--seed", str(cfg.seed),
                   "--span", str(cfg.span), "--report", reports[n], "--delay", str(cfg.delay if n in late else 0)]
            if n in killed:       # after 2 commits it takes its next span and waits there for the kill
                cmd += ["--hold-after", "2"]
            procs[n] = subprocess.Popen(cmd)
        pending_kill = set(killed)
        while any(p.poll() is None for p in procs.values()):
            if time.monotonic() - t0 > cfg.timeout:
                raise TimeoutError(f"simulation did not finish within {cfg.timeout:.0f} s (--timeout)")
            for n in list(pending_kill):      # SIGKILL mid-lease: holding a claimed span it never commits
                ev = read_reports({n: reports[n]})[n]
                if ev and ev[-1]["event"] == "hold":
                    procs[n].send_signal(signal.SIGKILL)
                    pending_kill.discard(n)
            time.sleep(0.01)
        killed = [n for n in killed if procs[n].returncode == -signal.SIGKILL]
        books = darl_client.LeaseClient(url).status()
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
        coord.send_signal(signal.SIGTERM)
        coord.wait(timeout=30)
    elapsed = time.monotonic() - t0
    rows, duplicates, missing = audit(cfg.blocks, read_reports(reports))
    rc = print_audit(cfg, rows, rates, killed, late, books, duplicates, missing, elapsed)
    if len(killed) != cfg.kill:
        print(f"FAIL: --kill {cfg.kill} asked for {cfg.kill} cluster(s) SIGKILLed mid-lease, {len(killed)} were "
              "(a cluster ran out of blocks before its third span: use more --blocks)")
        rc = 1
    if rc == 0:
        shutil.rmtree(work, ignore_errors=True)
    else:
        print(f"reports and the coordinator's log and state are kept in {work}")
    return rc


def print_audit(cfg, rows, rates, killed, late, books, duplicates, missing, elapsed):
    leased = {c["cluster"]: c["leased"] for c in books.get("clusters", [])}
    print(f"{'cluster':<8} {'committed':>9} {'leased':>7} {'lost':>5} {'blk/s':>8}   "
          f"({cfg.blocks:,} blocks, one epoch, {elapsed:.1f} s)")
    for r, rate in zip(rows, rates):
        tag = (["<- SIGKILLed mid-lease"] if r["cluster"] in killed else []) + \
              ([f"<- started {cfg.delay:g} s late"] if r["cluster"] in late else [])
        print(f"{r['cluster']:<8} {r['committed']:>9} {leased.get(r['cluster'], 0):>7} {r['lost']:>5} "
              f"{r['blocks_per_s']:>8.3f}   trains at {rate:.1f} blk/s {' '.join(tag)}")
    covered = cfg.blocks - len(missing)
    print(f"blocks covered {covered:,} of {cfg.blocks:,}  duplicates {len(duplicates)}  missing {len(missing)}"
          f"  (coordinator's own books: {books.get('committed')} committed, {books.get('seq')} logged changes)")
    if duplicates or missing or books.get("committed") != cfg.blocks:
        print(f"FAIL: duplicated blocks {duplicates[:50]}; missing blocks {missing[:50]}"
              + ("" if books.get("committed") == cfg.blocks else
                 f"; the coordinator counts {books.get('committed')} committed"))
        return 1
    print("PASS: coverage is exactly once")
    return 0


def _parser(doc):
    return argparse.ArgumentParser(description=doc.split("\n\n")[0], epilog="\n\n".join(doc.split("\n\n")[1:]),
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def worker_main(argv):
    w = _parser("darl_simulate.py worker - one simulated cluster (started by darl_simulate.py itself).")
    w.add_argument("--url", required=True, help="the coordinator's URL")
    w.add_argument("--cluster", required=True)
    w.add_argument("--rate", type=float, required=True, help="blocks/s")
    w.add_argument("--blocks", type=int, required=True)
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--span", type=int, default=4)
    w.add_argument("--delay", type=float, default=0.0, help="s before starting")
    w.add_argument("--report", required=True, help="JSON-lines file of spans and commits")
    w.add_argument("--hold-after", type=int, help="after this many commits, take the next span and wait "
                   "(for the simulation's SIGKILL) instead of training it")
    return sim_worker(w.parse_args(argv))


def main(argv):
    if argv[:1] == ["worker"]:
        return worker_main(argv[1:])
    p = _parser(__doc__)
    p.add_argument("--clusters", type=int, default=4, help="simulated clusters (default 4)")
    p.add_argument("--kill", type=int, default=1, help="clusters SIGKILLed mid-lease (default 1)")
    p.add_argument("--late", type=int, default=1, help="clusters that start --delay s late (default 1)")
    p.add_argument("--blocks", type=int, default=1000, help="blocks in the space (default 1000)")
    p.add_argument("--span", type=int, default=4, help="blocks per claimed span (default 4)")
    p.add_argument("--fastest", type=float, default=60.0, help="fastest cluster's rate, blocks/s (default 60)")
    p.add_argument("--spread", type=float, default=8.0, help="fastest/slowest rate ratio (default 8)")
    p.add_argument("--delay", type=float, default=2.0, help="late clusters' start delay, s (default 2)")
    p.add_argument("--seed", type=int, default=0, help="block-space seed (default 0)")
    p.add_argument("--timeout", type=float, default=120.0, help="give up after this many s (default 120)")
    a = p.parse_args(argv)
    try:
        cfg = SimConfig(a.clusters, a.kill, a.late, a.blocks, a.span, a.fastest, a.spread, a.delay, a.seed,
                        a.timeout).validate()
    except ValueError as e:
        raise SystemExit(f"darl_simulate.py: {e}")
    return simulate(cfg)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
