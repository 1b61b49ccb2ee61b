"""bench/darl_rpc.py - what the DARL coordinator costs per RPC.

Runs on: any machine with Python 3 (stdlib only); CPU, loopback network.
    python bench/darl_rpc.py [--clients 64] [--seconds 5] [--cycles 300]

Prints, measured in the same run:
  1. acquire + heartbeat + commit cycles per second from --clients closed-loop
     keep-alive clients against the real coordinator (write-ahead log fsync'd
     before every reply, snapshots at the default --snapshot-every), beside the
     same three calls against a no-op handler on the same HTTP server, in
     alternating rounds (a busy moment of a shared machine falls on both): the ratio
     (target >= 0.9), errors (target 0), each side's cycle latency p50/p99/max
     (target p99 <= 3 x p50) and a histogram of them.
  2. acquire latency at M = 1,000 and M = 1,000,000 blocks, over HTTP and on
     the bare LeaseTable (target: no growth proportional to M).
Servers run as separate processes (as in production); clients are threads
here, each with its own keep-alive connection. The log goes to runs/bench/
(a real disk, not tmpfs, so the fsync is real). This is a measurement, not a test.
"""
import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)      # run as `python bench/darl_rpc.py`: the siblings live one level up

import block_space  # noqa: E402
import darl_client  # noqa: E402
import darl_server  # noqa: E402
import darl_table  # noqa: E402
import httpd  # noqa: E402


def serve_noop(port):
    """The baseline: the same stdlib server, handlers that parse the JSON body and answer."""
    lease = {"id": 1, "lease": 1, "start": 0, "claimed": 0, "end": 1, "valid": True}

    def acquire(req):
        req.json()
        return {"status": "ok", "lease": lease}

    def heartbeat(req):
        req.json()
        return {"leases": [lease], "ttl": 60}

    def commit(req):
        req.json()
        return {"lease": 1, "committed": 1}
    routes = {("POST", "/acquire"): acquire, ("POST", "/heartbeat"): heartbeat, ("POST", "/commit"): commit,
              ("POST", "/register"): lambda req: req.json() and {}, ("GET", "/health"): lambda req: {"ok": True}}
    httpd.serve_forever(httpd.make_server(routes, port=port), "noop")


def start(cmd):
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    while True:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{cmd} exited before listening")
        if " listening on " in line:
            threading.Thread(target=proc.stdout.read, daemon=True).start()
            return proc, line.split()[-1]


def darl_cmd(num_blocks, state_dir):
    return [sys.executable, "darl_server.py", "--num-samples", str(num_blocks), "--state-dir", state_dir,
            "--port", "0", "--initial-grant", "1", "--max-grant", "1"]


def closed_loop(factory, clients, seconds):
    """`clients` threads, each calling factory(i)() (one request or cycle) back to back for
    `seconds`. -> (calls/s, [latency s of each good call], errors)."""
    lat, errors, stop = [[] for _ in range(clients)], [0] * clients, time.monotonic() + seconds

    def worker(i):
        one = factory(i)
        while time.monotonic() < stop:
            t0 = time.perf_counter()
            try:
                one()
            except Exception:
                errors[i] += 1
                continue
            lat[i].append(time.perf_counter() - t0)
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(clients)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    flat = [x for xs in lat for x in xs]
    return len(flat) / (time.monotonic() - t0), flat, sum(errors)


def cycles(url, clients, seconds, digest):
    """acquire(1 block) + heartbeat(claim it) + commit from `clients` closed-loop threads,
    each on its own keep-alive connection. -> (cycles/s, [cycle latency s], errors)."""
    def factory(i):
        c, name = darl_client.LeaseClient(url), f"bench-{i}"
        c.register(name, "inc", digest)

        def one():
            lease = c.acquire(name, "inc", blocks=1)["lease"]
            c.heartbeat(name, "inc", [{"lease": lease["id"], "cursor": lease["end"]}])
            c.commit(name, "inc", lease["id"], lease["end"])
        return one
    return closed_loop(factory, clients, seconds)


def quantile(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")


def histogram(rows, lo_ms=0.25, buckets=15, width=40):
    """Log-scale latency histogram, one column per series: [(label, [seconds])]."""
    edges = [lo_ms * 2 ** i for i in range(buckets)]
    counts = {label: [0] * (buckets + 1) for label, _ in rows}
    for label, xs in rows:
        for x in xs:
            ms = x * 1e3
            counts[label][next((i for i, e in enumerate(edges) if ms < e), buckets)] += 1
    out = ["  cycle latency      " + "".join(f"{label:>{width // 2 + 8}}" for label, _ in rows)]
    for i in range(buckets + 1):
        name = f"< {edges[i]:g} ms" if i < buckets else f">= {edges[-1]:g} ms"
        cells = []
        for label, xs in rows:
            n = counts[label][i]
            bar = "#" * (round(width / 2 * n / max(1, max(counts[label]))) if n else 0)
            cells.append(f"{n:>7} {bar:<{width // 2}}")
        if any(counts[label][i] for label, _ in rows):
            out.append(f"  {name:<17}" + " ".join(cells))
    return "\n".join(out)


def acquire_latency(url, n, digest):
    c = darl_client.LeaseClient(url)
    c.register("lat", "inc", digest)
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        lease = c.acquire("lat", "inc", blocks=1)["lease"]
        times.append(time.perf_counter() - t0)
        c.commit("lat", "inc", lease["id"])
    return times


def table_latency(num_blocks, n):
    """The bare state machine, fragmented the way a long run leaves it: every
    other lease expired and back in the pool, so the free list has n/2 runs."""
    clock = [0.0]
    t = darl_table.LeaseTable(num_blocks, darl_table.TableConfig(min_ttl=1, default_ttl=1), lambda: clock[0])
    t.register("x", "i")
    for i in range(n):
        lease = t.acquire("x", "i", blocks=1, ttl=1 if i % 2 else 100)["lease"]
        t.heartbeat("x", "i", [{"lease": lease["id"], "cursor": 1}], ttl=1 if i % 2 else 100)
    clock[0] = 50.0
    t.expire(clock[0])
    runs = len(t.free)
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        lease = t.acquire("x", "i", blocks=1, ttl=1000)["lease"]
        times.append(time.perf_counter() - t0)
        t.commit("x", "i", lease["id"])
    return times, runs


def disk_sync_ms(directory, n=200):
    """Median time to append one log-sized line and flush it, as the log does."""
    path = os.path.join(directory, "sync-probe")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    times = []
    try:
        for _ in range(n):
            t0 = time.perf_counter()
            os.write(fd, b"x" * 120 + b"\n")
            darl_server._datasync(fd)
            times.append(time.perf_counter() - t0)
    finally:
        os.close(fd)
        os.remove(path)
    return statistics.median(times) * 1e3


def us(xs):
    xs = sorted(xs)
    return statistics.median(xs) * 1e6, xs[int(0.9 * (len(xs) - 1))] * 1e6


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=64, help="closed-loop clients for the cycle rate (default 64)")
    p.add_argument("--seconds", type=float, default=5.0, help="seconds per cycle-rate measurement (default 5)")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds of the two sides (default 3)")
    p.add_argument("--cycles", type=int, default=300, help="acquires per latency measurement (default 300)")
    p.add_argument("--serve-noop", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.serve_noop:
        return serve_noop(0)
    os.makedirs(os.path.join(ROOT, "runs", "bench"), exist_ok=True)
    work = tempfile.mkdtemp(prefix="darl-", dir=os.path.join(ROOT, "runs", "bench"))
    procs, shm = [], None
    try:
        big = block_space.BlockSpace(10**6, 1, 0)
        noop, noop_url = start([sys.executable, os.path.abspath(__file__), "--serve-noop"])
        darl, darl_url = start(darl_cmd(10**6, os.path.join(work, "rate")))
        procs += [noop, darl]
        # the same coordinator with its log in memory (tmpfs: fdatasync returns at once): what
        # is left of the gap there is CPU (the GIL), what closes is the disk
        if os.path.isdir("/dev/shm"):
            shm = tempfile.mkdtemp(prefix="darl-", dir="/dev/shm")
            mem, mem_url = start(darl_cmd(10**6, shm))
            procs.append(mem)
        # rounds alternate the two sides, so a busy moment of the machine (shared cores, the
        # disk) falls on both; each side's latencies are pooled over its rounds
        sides = {"noop": [0.0, [], 0], "darl": [0.0, [], 0], "mem": [0.0, [], 0]}
        for _ in range(a.rounds):
            for side, url in (("noop", noop_url), ("darl", darl_url)) + ((("mem", mem_url),) if shm else ()):
                rate, lat, err = cycles(url, a.clients, a.seconds, big.digest())
                sides[side][0] += rate / a.rounds
                sides[side][1] += lat
                sides[side][2] += err
        (base, base_lat, base_err), (real, real_lat, real_err) = sides["noop"], sides["darl"]
        print(f"acquire+heartbeat+commit cycles/s, {a.clients} closed-loop keep-alive clients, {a.rounds} rounds "
              f"of {a.seconds:g} s each side, alternating (state dir {work})")
        rows = [("no-op handler, same server", base, base_lat, base_err),
                ("DARL, fsync'd write-ahead log", real, real_lat, real_err)]
        if shm:
            rows.append(("DARL, its log on tmpfs", *sides["mem"]))
        for label, rate, xs, err in rows:
            p50, p99 = quantile(xs, 0.5) * 1e3, quantile(xs, 0.99) * 1e3
            print(f"  {label:<31} {rate:9.1f} cycles/s  p50 {p50:6.1f} ms  p99 {p99:6.1f} ms "
                  f"({p99 / p50:4.1f} x p50, target <= 3)  max {max(xs) * 1e3:6.1f} ms  errors {err}")
        print(f"  ratio DARL / no-op              {real / base:9.2f}   (target >= 0.9)"
              + (f"; log on tmpfs / no-op {sides['mem'][0] / base:.2f} (the part the disk does not explain)"
                 if shm else ""))
        print(histogram([("no-op", base_lat), ("DARL", real_lat)]))
        print(f"  disk: one log append + fdatasync, median {disk_sync_ms(work):.2f} ms (measured just after)")

        print(f"acquire latency, {a.cycles} acquires (median / p90, microseconds)")
        rows = {}
        for m in (10**3, 10**6):
            proc, url = start(darl_cmd(m, os.path.join(work, f"lat{m}")))
            procs.append(proc)
            http_med, http_p90 = us(acquire_latency(url, a.cycles, block_space.BlockSpace(m, 1, 0).digest()))
            (tab_med, tab_p90), runs = (lambda r: (us(r[0]), r[1]))(table_latency(m, a.cycles))
            rows[m] = (http_med, tab_med)
            print(f"  M = {m:>9,}  HTTP+fsync {http_med:8.0f} / {http_p90:8.0f}   "
                  f"LeaseTable alone {tab_med:6.1f} / {tab_p90:6.1f}  ({runs} free runs)")
        print(f"  ratio M=1e6 / M=1e3           HTTP {rows[10**6][0] / rows[10**3][0]:5.2f}   "
              f"LeaseTable {rows[10**6][1] / rows[10**3][1]:5.2f}   (target: ~1, not 1000)")
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=30)
        shutil.rmtree(work, ignore_errors=True)
        if shm:
            shutil.rmtree(shm, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
