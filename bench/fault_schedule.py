"""bench/fault_schedule.py - exactly-once under random fault schedules: real servers, fake sites, an oracle.

Runs on: any machine (CPU; Python + numpy, never torch). Each seed draws a schedule of
2-4 faults (and 0-2 of the pipelined round's) and runs it with testbed/fault_harness.py (which says what a
schedule starts and which faults there are; testbed/fault_oracle.py says what the oracle checks,
testbed/fault_site.py what a fake site does; tests/test_fault_schedule.py runs fixed schedules of it): real darl_server.py, fedmom_server.py and blobstore.py
processes on 127.0.0.1, fake torch-free sites on the real clients, and the oracle's
judgement of the outcome.

    python bench/fault_schedule.py                       # the full run: 500 schedules
    python bench/fault_schedule.py --schedules 40 --first-seed 1000 --jobs 2
    python bench/fault_schedule.py --replay 1234         # one seed: its schedule, its dir kept

A failing seed prints its schedule and the oracle's findings; its directory is kept.
The closing lines: faults injected by kind, the site kinds run (f32, int4, overlapped),
the schedules with --down-wire int4 (theta by update, whole, or followed while merged), those with --phase-s and the quorum rule (their
time-budgeted sites, the spans their clocks trimmed, the rounds closed by quorum), what
the sites saw, and the summary: schedules, faults injected, violations.
"""
import argparse
import collections
import concurrent.futures
import os
import signal
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)      # run as `python bench/fault_schedule.py`: the siblings live one level up

from testbed import fault_harness as fh  # noqa: E402


def summary(results, seconds):
    """The closing lines: schedules, faults injected by kind (of those scheduled), what the
    sites saw, violations."""
    injected, armed, seen, kinds = (collections.Counter() for _ in range(4))
    for r in results:
        injected.update(r.injected)
        armed.update(r.armed)
        seen.update(r.seen)
        kinds.update(r.kinds)
    bad = [r for r in results if r.findings]
    faults = ", ".join(f"{k} {injected[k]}/{armed[k]}" for k in fh.KINDS if armed[k])
    sites = ", ".join(f"{k} {seen[k]}" for k in ("incarnations",) + fh.SITE_EVENTS + ("trained_in_flight",))
    return "\n".join([
        f"faults injected by kind (reached/scheduled): {faults}",
        f"site kinds: f32 {kinds['f32']}, int4 {kinds['int4']}, overlapped {kinds['overlapped']} (sites); aggregator "
        f"--down-wire int4 in {kinds['down_wire_int4']} of {len(results)} schedules; {seen['sent_int4']} int4 deltas "
        f"sent; theta fetched via update {seen['theta_via_update']}, in full {seen['theta_via_full']}, followed "
        f"while merged and adopted {seen['theta_via_followed']} ({seen['follow_discarded']} follows discarded: not "
        "the durable round's, or cut)",
        f"phases measured in time: aggregator --phase-s with the quorum rule in {kinds['phase_s']} of {len(results)} "
        f"schedules, {kinds['timed']} time-budgeted sites; {seen['trimmed']} spans trimmed by a site's clock "
        f"({seen['trimmed_merged']} of them merged), {seen['quorum_closed']} rounds closed by quorum, "
        f"{seen['stale']} late deltas refused stale",
        f"sites: {sites} (deltas); {sum(r.rounds for r in results)} rounds merged, "
        f"{sum(r.quarantined for r in results)} blocks quarantined (said)",
        f"fault schedules: {len(results)} run, {sum(injected.values())} faults injected, violations: {len(bad)}"
        + (f" (seeds {[r.seed for r in bad]})" if bad else "") + f"; {seconds / 60:.1f} min"])


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="\n\n".join(__doc__.split("\n\n")[1:]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--schedules", type=int, default=500, help="how many schedules (default 500)")
    p.add_argument("--first-seed", type=int, default=1, help="seeds first-seed .. first-seed + schedules - 1")
    p.add_argument("--jobs", type=int, default=1, help="schedules run at once (default 1)")
    p.add_argument("--replay", type=int, help="run this one seed, print its schedule, keep its directory")
    p.add_argument("--work", default=os.path.join(ROOT, "runs", "fault_schedule"),
                   help="where each schedule's state, logs and records go (default runs/fault_schedule)")
    a = p.parse_args(argv)
    os.makedirs(a.work, exist_ok=True)
    seeds = [a.replay] if a.replay is not None else list(range(a.first_seed, a.first_seed + a.schedules))
    t0, results, lock = time.monotonic(), [], threading.Lock()

    def one(seed):
        if fh.STOP.is_set():
            return None
        try:
            res = fh.run_schedule(seed, a.work, keep=a.replay is not None)
        except fh.Interrupted:
            return None
        with lock:
            results.append(res)
            tag = "ok" if not res.findings else "VIOLATION"
            print(f"[{len(results)}/{len(seeds)}] seed {seed}: {tag}  ({', '.join(sorted(res.injected.elements()))}; "
                  f"{res.rounds} rounds, {res.seconds:.1f} s)", flush=True)
            if res.findings:
                print(fh.describe_failure(res), flush=True)
        return res
    if a.replay is not None:
        print(fh.make_schedule(a.replay).describe(), flush=True)

    def on_term(signum, frame):
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, on_term)
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, a.jobs))
    try:
        list(pool.map(one, seeds))
    except KeyboardInterrupt:        # each running schedule stops its own processes, then the summary so far
        fh.STOP.set()
        print("interrupted: stopping the running schedules", flush=True)
    finally:
        pool.shutdown(wait=True)
    print(summary(sorted(results, key=lambda r: r.seed), time.monotonic() - t0))
    return 130 if fh.STOP.is_set() else 1 if any(r.findings for r in results) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
