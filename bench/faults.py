"""bench/faults.py - what the three central servers survive, measured: SIGKILLs, fuzz,
load, half-open connections and full disks. `make bench-faults` runs it and rewrites
its tables in bench/RESULTS.md ("What the central VM survives") from what it printed.

Runs on: any Linux box with the venv (CPU, loopback, openssl; root for the tmpfs of
the disk-full cases, else they are skipped and said so). Every server runs as its own
process over TLS, as on the central VM.
    python bench/faults.py                       # everything, ~15-25 min on 2 busy cores
    python bench/faults.py --quick               # small counts: checks the bench itself (~3 min)
    python bench/faults.py --only kills,fuzz     # some parts: kills wal fuzz load halfopen diskfull
    python bench/faults.py --no-guide            # print, leave bench/RESULTS.md alone

Figures, each beside its baseline or target:
  kills     SIGKILLs per daemon (target >= 200 each): DARL under 8 leasing clients,
            FedMom mid-spool and mid-merge, the blob store mid-upload; acknowledged work
            lost (a commit DARL acknowledged and then forgot, an accepted delta neither
            pending nor merged after the restart, a finished blob missing or changed;
            target 0) and restart-to-healthy p50/p99 (spawn to /health 200).
  wal       DARL's log cut at every byte offset of its last 8 records (each copy read back
            as a restart does, its books compared with the table after each intact record;
            target: all exact, the torn record dropped), one byte changed at 300 places
            before its last record and at 30 in it (complete lines, maybe acknowledged; target:
            every start refused, naming file and byte), and a few of each started as the real
            darl_server.py.
  fuzz      http_fuzz.py per server (target >= 10,000 each): outcomes, 5xx (target 0),
            hangs (target 0), and the legitimate epoch afterwards.
  load      closed-loop keep-alive clients per server: req/s, p50/p99, errors.
  halfopen  2,000 connections held open (half idle, half mid-headers) against DARL:
            server threads and RSS beside the unloaded ones, and a legitimate client's
            p99 beside its unloaded p99 (target <= 2x).
  diskfull  ENOSPC on a 16 MiB tmpfs: blob upload, delta spool, merge, join, a DARL change,
            a DARL snapshot; the reply, what is left on disk, and whether the service is
            back once space returns.
"""
import argparse
import collections
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]   # run as `python bench/faults.py`; certs.py is a test helper

import numpy as np  # noqa: E402

import blob_client  # noqa: E402
import certs  # noqa: E402
import darl_client  # noqa: E402
import durable  # noqa: E402
from darl_rpc import closed_loop, quantile  # noqa: E402  (bench/ is this script's directory)
import fedmom_client  # noqa: E402
import http_fuzz  # noqa: E402
import httpc  # noqa: E402
import results  # noqa: E402  (bench/results.py: the blocks of bench/RESULTS.md)
import tensorio  # noqa: E402

TOKEN = "bench-faults-token"
GUIDE = results.RESULTS                              # the page its tables live on, in its `faults` block


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Service:
    """One server process on a fixed port (a restart comes back on the same URL), over TLS."""

    def __init__(self, work, name, args, env=None):
        self.work, self.name, self.args, self.env = work, name, [str(a) for a in args], env
        self.port, self.proc = free_port(), None
        self.url = f"https://127.0.0.1:{self.port}"
        self.log = os.path.join(work, f"{name}.log")

    def start(self):
        """Spawn and wait for /health; returns seconds from spawn to healthy."""
        t0 = time.monotonic()
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen([sys.executable, *self.args, "--port", str(self.port), "--token-file",
                                          self.work + "/token", "--tls-cert", self.work + "/server.pem",
                                          "--tls-key", self.work + "/server.key"], cwd=ROOT, stdout=out,
                                         stderr=subprocess.STDOUT, env={**os.environ, **(self.env or {})})
        while True:
            try:
                httpc.call(self.url, "GET", "/health", timeout=2, ca_file=self.ca)
                return time.monotonic() - t0
            except Exception:                       # not up yet: refused, reset, 5xx
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.name} exited {self.proc.returncode}; see {self.log}")
                if time.monotonic() - t0 > 120:
                    raise RuntimeError(f"{self.name} not healthy within 120 s; see {self.log}")
                time.sleep(0.01)

    def kill(self):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()

    @property
    def ca(self):
        return self.work + "/ca.pem"


def write_model(path, tensors=16, size=65536, value=1.0):
    specs = [(f"t{i}", "F32", (size,)) for i in range(tensors)]
    with tensorio.TensorWriter(path, specs, fsync=False) as w:
        for name, _, shape in specs:
            w.write(name, np.full(shape, value, np.float32))
    return path


# ---------------------------------------------------------------- kills

def kills_darl(work, n):
    svc = Service(work, "darl-kill", ["darl_server.py", "--num-samples", 10 ** 6, "--state-dir",
                                      os.path.join(work, "darl-kill"), "--min-ttl", 1, "--restore-grace", 1,
                                      "--snapshot-every", 500])
    restarts, acked, lost, rng = [], [], 0, random.Random(0)
    digest = None
    try:
        for k in range(n + 1):
            restarts.append(svc.start())
            digest = digest or httpc.call(svc.url, "GET", "/health", ca_file=svc.ca)["digest"]
            checker = darl_client.LeaseClient(svc.url, TOKEN, ca_file=svc.ca)
            for cluster, inc, lease, end in acked:    # every acknowledged commit is still committed
                reply = checker.commit(cluster, inc, lease, end, deadline=httpc.Deadline(10, log=httpc.quiet))
                lost += not reply.get("repeat")
            acked = []
            if k == n:
                break
            stop = threading.Event()

            def load(i):
                c = darl_client.LeaseClient(svc.url, TOKEN, ca_file=svc.ca)
                cluster, inc = f"k{k}-c{i}", "inc"
                try:
                    c.register(cluster, inc, digest)
                    while not stop.is_set():
                        lease = c.acquire(cluster, inc, blocks=rng.randint(1, 4), ttl=30)["lease"]
                        c.commit(cluster, inc, lease["id"], lease["end"])
                        acked.append((cluster, inc, lease["id"], lease["end"]))
                except Exception:
                    pass                              # the kill: in-flight calls fail, unacknowledged
            threads = [threading.Thread(target=load, args=(i,)) for i in range(8)]
            for t in threads:
                t.start()
            time.sleep(rng.uniform(0.05, 0.3))
            svc.kill()
            stop.set()
            for t in threads:
                t.join()
    finally:
        svc.stop()
    return {"daemon": "DARL (8 leasing clients)", "kills": n, "lost": lost, "restart": restarts}


def kills_fedmom(work, n):
    init = write_model(os.path.join(work, "fm-init.safetensors"))
    svc = Service(work, "fedmom-kill", ["fedmom_server.py", "--state-dir", os.path.join(work, "fedmom-kill"),
                                        "--init", init, "--member-timeout-s", 3600, "--round-deadline-s", 3600],
                  env={"PWW_FEDMOM_MERGE_PAUSE_S": "0.01"})
    delta = write_model(os.path.join(work, "fm-delta.safetensors"), value=1e-3)
    restarts, acked, lost, rng = [], set(), 0, random.Random(1)
    where = {"mid-spool": 0, "mid-merge": 0}
    try:
        for k in range(n + 1):
            restarts.append(svc.start())
            st = httpc.call(svc.url, "GET", "/status", token=TOKEN, ca_file=svc.ca)
            seen = {(o["cluster"], o["incarnation"], o["base_round"]) for o in st["outcomes"]
                    if o["outcome"] == "pending"} | {(o["cluster"], o["incarnation"], o["base_round"])
                                                     for r in st["recent"] for o in r["outcomes"]
                                                     if o["outcome"] == "merged"}
            # every accepted delta is still pending or merged ("recent" holds the last 200 rounds)
            lost += sum(1 for a in acked if a not in seen and a[2] >= st["round"] - 150)
            if k == n:
                break
            clients = [fedmom_client.FedMomClient(svc.url, c, f"{c}-1", token=TOKEN, ca_file=svc.ca)
                       for c in ("a", "b")]
            for c in clients:
                c.join()
            rnd = st["round"]
            todo = [c for c in clients if (c.cluster, c.incarnation, rnd) not in seen]
            mode = rng.choice(["mid-spool", "mid-merge"])
            where[mode] += 1

            def send(c):
                try:
                    if c.send_delta(delta, rnd, 10, [], {}, transport="inline").get("accepted"):
                        acked.add((c.cluster, c.incarnation, rnd))
                except Exception:
                    pass                             # the kill: an upload cut short is not accepted
            if mode == "mid-merge":                  # both sent, the merge runs (10 ms per tensor); kill in it
                for c in todo:
                    send(c)
                time.sleep(rng.uniform(0.0, 0.2))
                svc.kill()
            else:                                    # kill while a delta streams in
                t = threading.Thread(target=send, args=(todo[-1],)) if todo else None
                if t:
                    t.start()
                time.sleep(rng.uniform(0.0, 0.05))
                svc.kill()
                if t:
                    t.join()
    finally:
        svc.stop()
    return {"daemon": f"FedMom ({where['mid-spool']} mid-spool, {where['mid-merge']} mid-merge)", "kills": n,
            "lost": lost, "restart": restarts}


def kills_blob(work, n):
    svc = Service(work, "blob-kill", ["blobstore.py", "--root", os.path.join(work, "blob-kill")])
    src = os.path.join(work, "blob-src")
    with open(src, "wb") as f:
        f.write(os.urandom(24 << 20))
    sha = blob_client.sha256_file(src)
    restarts, done, lost, rng = [], [], 0, random.Random(2)
    try:
        svc.start()
        for k in range(n):
            blob, result = f"b{k}", {}

            def upload():
                try:
                    result["out"] = blob_client.put_file(svc.url, blob, src, token=TOKEN, ca_file=svc.ca,
                                                         sha256=sha, progress=False,
                                                         deadline=httpc.Deadline(120, log=httpc.quiet))
                except Exception as e:
                    result["err"] = e
            t = threading.Thread(target=upload)
            t.start()
            time.sleep(rng.uniform(0.01, 0.15))
            svc.kill()                               # mid-upload (or just after it)
            restarts.append(svc.start())
            t.join()                                 # the client resumes against the restarted store
            if "out" in result:
                done.append(blob)
            for b in done:                           # every finished blob, whole and with its checksum
                info = blob_client.head(svc.url, b, TOKEN, ca_file=svc.ca)
                lost += not (info and info["complete"] and info["sha256"] == sha)
            if len(done) > 3:                        # bound the disk: drop the oldest (checked n times)
                httpc.call(svc.url, "DELETE", f"/blobs/{done.pop(0)}", token=TOKEN, ca_file=svc.ca)
    finally:
        svc.stop()
    return {"daemon": "blob store (mid-upload; the upload resumes)", "kills": n, "lost": lost, "restart": restarts}


# ---------------------------------------------------------------- DARL's log, damaged

def wal_damage(work, last=8, flips=300, starts=3):
    """DARL's log cut at every byte offset of its last `last` records, and single bytes
    changed at `flips` random places before its last record. Each damaged copy is read
    back by load_state (what a restart runs) and its books compared with the table as it
    stood after each intact record; `starts` cases of each kind also start the real
    darl_server.py on the copy (exit status and first line of its refusal)."""
    import block_space
    import darl_server
    import darl_table
    space = block_space.BlockSpace(10 ** 5, 1, 0)
    src = os.path.join(work, "wal-src")
    coord = darl_server.Coordinator(space, darl_table.TableConfig(min_ttl=1), src, snapshot_every=10 ** 9)
    books, rng = {coord.seq: coord.table.to_dict()}, random.Random(3)
    coord.call("register", {"cluster": "a", "incarnation": "i", "digest": space.digest()})
    books[coord.seq] = coord.table.to_dict()
    agg = {"aggregator": "agg", "epoch": coord.call("fence", {"aggregator": "agg", "last_epoch": 0,
                                                              "claim": "bench"})["epoch"]}
    books[coord.seq] = coord.table.to_dict()
    for k in range(40):                        # leases, claims, commits and custody: every kind of record
        lease = coord.call("acquire", {"cluster": "a", "incarnation": "i", "blocks": rng.randint(1, 5)})["lease"]
        books[coord.seq] = coord.table.to_dict()
        coord.call("heartbeat", {"cluster": "a", "incarnation": "i", "leases": [{"lease": lease["id"],
                                                                                "cursor": lease["end"]}]})
        books[coord.seq] = coord.table.to_dict()
        if k % 3:
            coord.call("commit", {"cluster": "a", "incarnation": "i", "lease": lease["id"]})
        else:
            coord.call("take_custody", {**agg, "delta": f"d{k}", "cluster": "a", "incarnation": "i",
                                        "leases": [{"lease": lease["id"]}]})
            books[coord.seq] = coord.table.to_dict()
            coord.call("commit_custody", {**agg, "delta": f"d{k}"})
        books[coord.seq] = coord.table.to_dict()
    coord.wal.close()                          # the process dies here: no snapshot, the log is everything
    wal = os.path.join(src, "darl", "wal.jsonl")
    with open(wal, "rb") as f:
        data = f.read()
    ends = [i + 1 for i, b in enumerate(data) if b == 0x0A]          # where each line ends
    copy_dir = os.path.join(work, "wal-copy")
    os.makedirs(os.path.join(copy_dir, "darl"), exist_ok=True)
    copy = os.path.join(copy_dir, "darl", "wal.jsonl")

    def read_back(damaged):
        with open(copy, "wb") as f:
            f.write(damaged)
        try:
            got = darl_server.load_state(copy_dir)
        except darl_server.LogError as e:
            return "refused", str(e)
        if got is None:
            return "empty", ""
        return ("exact" if got.table.to_dict() == books.get(got.seq) else "WRONG"), got.seq

    def start(damaged):
        """The real server on the copy: "serves" once it listens (then stopped), or its exit
        status and the last line it printed."""
        with open(copy, "wb") as f:
            f.write(damaged)
        proc = subprocess.Popen([sys.executable, "darl_server.py", "--num-samples", str(10 ** 5), "--min-ttl",
                                 "1", "--state-dir", copy_dir, "--port", "0"], cwd=ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        lines = []
        for line in proc.stdout:               # ends when the process exits
            lines.append(line.strip())
            if " listening on " in line:
                proc.terminate()
        rc = proc.wait(60)
        served = any(" listening on " in l for l in lines)
        return "serves" if served else f"exit {rc}: {(lines or [''])[-1][:150]}"

    cut = {"offsets": 0, "exact": 0, "lost_acked": 0, "refused": 0, "wrong": 0}
    first = ends[-last - 1]
    for off in range(first, len(data)):       # every byte offset inside the last records
        kind, seq = read_back(data[:off])
        cut["offsets"] += 1
        whole = sum(1 for e in ends if e <= off) - 1                   # intact records (the header is line 1)
        if kind == "exact" and seq == whole:
            cut["exact"] += 1
        elif kind == "exact":
            cut["lost_acked"] += 1
        elif kind == "refused":
            cut["refused"] += 1
        else:
            cut["wrong"] += 1
    flip = {"flips": 0, "refused": 0, "accepted": 0, "wrong": 0, "last_line": 0, "last_line_refused": 0}
    for _ in range(flips):
        at = rng.randrange(0, ends[-2] - 1)    # any byte of the header or a record but the last, not a newline
        if data[at] == 0x0A:
            continue
        bad = bytearray(data)
        bad[at] = (bad[at] + rng.randrange(1, 256)) % 256
        kind, _ = read_back(bytes(bad))
        flip["flips"] += 1
        flip["refused" if kind == "refused" else "wrong" if kind == "WRONG" else "accepted"] += 1
    for _ in range(flips // 10):               # a byte of the LAST record changed, its newline kept: a
        at = rng.randrange(ends[-2], ends[-1] - 1)     # complete line, maybe acknowledged, so refused too
        bad = bytearray(data)
        bad[at] = (bad[at] + rng.randrange(1, 256)) % 256
        kind, seq = read_back(bytes(bad))
        flip["last_line"] += 1
        flip["last_line_refused"] += kind == "refused"
    samples = {"cut mid-record": [start(data[:rng.randrange(ends[-2], ends[-1] - 1)]) for _ in range(starts)],
               "byte changed mid-log": []}
    for _ in range(starts):
        at = rng.randrange(ends[0], ends[-2] - 1)
        bad = bytearray(data)
        bad[at] = (bad[at] + 1) % 256 if bad[at] not in (0x09, 0x0A) else bad[at]
        samples["byte changed mid-log"].append(start(bytes(bad)))
    return {"records": len(ends) - 1, "bytes": len(data), "last": last, "cut": cut, "flip": flip,
            "samples": samples}


# ---------------------------------------------------------------- load, half-open, fuzz, disk

def load(work, seconds):
    rows = []
    darl = Service(work, "darl-load", ["darl_server.py", "--num-samples", 10 ** 7, "--state-dir",
                                       os.path.join(work, "darl-load")])
    init = write_model(os.path.join(work, "load-init.safetensors"), tensors=4, size=1024)
    fed = Service(work, "fedmom-load", ["fedmom_server.py", "--state-dir", os.path.join(work, "fedmom-load"),
                                        "--init", init])
    blob = Service(work, "blob-load", ["blobstore.py", "--root", os.path.join(work, "blob-load")])
    try:
        for s in (darl, fed, blob):
            s.start()
        digest = httpc.call(darl.url, "GET", "/health", ca_file=darl.ca)["digest"]

        def darl_cycle(i):
            c = darl_client.LeaseClient(darl.url, TOKEN, ca_file=darl.ca)
            c.register(f"load{i}", "inc", digest)

            def one():
                lease = c.acquire(f"load{i}", "inc", blocks=1)["lease"]
                c.commit(f"load{i}", "inc", lease["id"], lease["end"])
            return one
        src = os.path.join(work, "load-blob")
        with open(src, "wb") as f:
            f.write(os.urandom(1 << 20))
        blob_client.put_file(blob.url, "load", src, token=TOKEN, ca_file=blob.ca)

        def keep_alive(svc, method, path, body=None):
            def factory(i):
                conn = httpc.connect(svc.url, 30, svc.ca)
                return lambda: httpc.call(svc.url, method, path, body, token=TOKEN, conn=conn)
            return factory

        def blob_get(i):
            conn = httpc.connect(blob.url, 30, blob.ca)

            def one():
                conn.request("GET", "/blobs/load", headers=httpc.auth_headers(TOKEN))
                r = conn.getresponse()
                if len(r.read()) != 1 << 20:
                    raise IOError("short read")
            return one
        for name, factory, clients, unit in (
                ("DARL acquire+commit (2 fsync'd writes)", darl_cycle, 64, "cycles"),
                ("DARL GET /status", keep_alive(darl, "GET", "/status"), 64, "req"),
                ("FedMom POST /join (an existing member)", keep_alive(fed, "POST", "/join",
                                                                       {"cluster": "l", "incarnation": "l-1"}), 64, "req"),
                ("blob store GET 1 MiB", blob_get, 16, "req")):
            rate, lat, errors = closed_loop(factory, clients, seconds)
            rows.append({"what": name, "clients": clients, "rate": rate, "unit": unit, "p50_ms": quantile(lat, 0.5) * 1e3,
                         "p99_ms": quantile(lat, 0.99) * 1e3, "errors": errors})
    finally:
        for s in (darl, fed, blob):
            s.stop()
    return rows


def proc_stats(pid):
    with open(f"/proc/{pid}/status") as f:
        st = dict(line.split(":", 1) for line in f)
    return int(st["Threads"]), int(st["VmRSS"].split()[0]) / 1024


def halfopen(work, held=2000, samples=300, rounds=3):
    """Rounds of: a legitimate client's latencies unloaded, then with `held` connections
    held open (pooled over the rounds, so a noisy moment of the disk or of a neighbour
    does not decide the ratio). Two requests: GET /status (the HTTP path alone) and
    acquire+commit (two fsync'd log writes)."""
    svc = Service(work, "darl-halfopen", ["darl_server.py", "--num-samples", 10 ** 6, "--state-dir",
                                          os.path.join(work, "darl-halfopen"), "--header-timeout-s", 600])
    svc.start()
    out = {"base": {"status": [], "cycle": []}, "loaded": {"status": [], "cycle": []}}
    try:
        digest = httpc.call(svc.url, "GET", "/health", ca_file=svc.ca)["digest"]
        c = darl_client.LeaseClient(svc.url, TOKEN, ca_file=svc.ca)
        c.register("legit", "inc", digest)

        def measure(into):
            for _ in range(samples):
                t0 = time.perf_counter()
                c.status()
                t1 = time.perf_counter()
                lease = c.acquire("legit", "inc", blocks=1)["lease"]
                c.commit("legit", "inc", lease["id"], lease["end"])
                into["status"].append(t1 - t0)
                into["cycle"].append(time.perf_counter() - t1)
        for _ in range(rounds):
            measure(out["base"])
            if "rss0" not in out:                     # before the first round held anything
                out["threads0"], out["rss0"] = proc_stats(svc.proc.pid)
            # the connections are held by another process, so its sockets and TLS objects
            # do not slow this client down (measured: they did, through its garbage collector)
            holder = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--hold", str(svc.port), str(held),
                                       svc.ca], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            holder.stdout.readline()
            deadline = time.monotonic() + 60
            while c.status()["http"]["open"] < held and time.monotonic() < deadline:
                time.sleep(0.1)
            out["held"] = c.status()["http"]["open"] - 1
            out["threads1"], out["rss1"] = proc_stats(svc.proc.pid)
            measure(out["loaded"])
            holder.stdin.close()
            holder.wait(60)
            while c.status()["http"]["open"] > 1 and time.monotonic() < deadline + 60:
                time.sleep(0.1)
    finally:
        svc.stop()
    b, l_ = out["base"], out["loaded"]
    return {"held": out["held"], "threads": (out["threads0"], out["threads1"]), "rss_mib": (out["rss0"], out["rss1"]),
            "rounds": rounds, "samples": samples * rounds,
            **{f"{k}_{q}_ms": (quantile(b[k], v) * 1e3, quantile(l_[k], v) * 1e3)
               for k in ("status", "cycle") for q, v in (("p50", 0.5), ("p99", 0.99))}}


def hold(port, n, ca_file):
    """(--hold) Open n connections to 127.0.0.1:port, every other one a TLS session stopped
    mid-headers; print one line, keep them until stdin closes."""
    tls, socks = httpc.client_tls(ca_file), []
    for i in range(n):
        s = socket.create_connection(("127.0.0.1", port))
        if i % 2:
            s = tls.wrap_socket(s, server_hostname="127.0.0.1")
            s.sendall(b"POST /acquire HTTP/1.1\r\nContent-Length: 100\r\n")
        socks.append(s)
    print("holding", flush=True)
    sys.stdin.read()
    return 0


def fuzz(work, count):
    rows = []
    init = write_model(os.path.join(work, "fz-init.safetensors"), tensors=3, size=256)
    common = ["--header-timeout-s", 1]
    services = {"darl": Service(work, "darl-fuzz", ["darl_server.py", "--num-samples", 500, "--state-dir",
                                                    os.path.join(work, "darl-fuzz"), "--min-ttl", 1, "--max-ttl", 2,
                                                    "--default-ttl", 2, *common]),
                "fedmom": Service(work, "fedmom-fuzz", ["fedmom_server.py", "--state-dir",
                                                        os.path.join(work, "fedmom-fuzz"), "--init", init,
                                                        "--member-timeout-s", 3, "--round-deadline-s", 5, *common]),
                "blob": Service(work, "blob-fuzz", ["blobstore.py", "--root", os.path.join(work, "blob-fuzz"), *common])}
    for name, svc in services.items():
        svc.start()
        try:
            out = http_fuzz.run(name, svc.url, TOKEN, svc.ca, count=count, seed=0, workers=8, timeout=20,
                                slow_wait_s=20, workdir=work)
            out["alive"] = svc.proc.poll() is None
            with open(svc.log, errors="replace") as f:
                out["tracebacks"] = f.read().count("Traceback")
            rows.append(out)
            print(http_fuzz.format_report(out), flush=True)
        finally:
            svc.stop()
    return rows


def diskfull(work):
    """The cases of tests/test_exposure.py DiskFullTest, run against the real processes."""
    disk = os.path.join(work, "tmpfs")
    os.makedirs(disk)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", disk], capture_output=True, text=True)
    if r.returncode:
        return {"skipped": f"cannot mount a tmpfs ({r.stderr.strip()}): run as root"}
    rows = []
    try:
        def filler(leave):
            st = os.statvfs(disk)
            path = os.path.join(disk, "filler")
            with open(path, "wb") as f:
                f.write(b"\0" * max(0, st.f_bavail * st.f_frsize - leave))
            return path

        def files(d):
            return sum(len(fs) for _, _, fs in os.walk(d))
        blob = Service(work, "blob-full", ["blobstore.py", "--root", os.path.join(disk, "blobs")])
        blob.start()
        src = os.path.join(work, "full-src")
        with open(src, "wb") as f:
            f.write(os.urandom(6 << 20))
        fill = filler(3 << 20)
        try:
            blob_client.put_file(blob.url, "x", src, token=TOKEN, ca_file=blob.ca)
            reply = "accepted (!)"
        except httpc.CallError as e:
            reply = f"{e.status} {e.reply.get('code')}"
        left = files(os.path.join(disk, "blobs"))
        os.unlink(fill)
        back = blob_client.put_file(blob.url, "x", src, token=TOKEN, ca_file=blob.ca)["size"] == 6 << 20
        rows.append(("blob upload (6 MiB, 3 MiB free)", reply, f"{left} files", back))
        blob.stop()

        init = write_model(os.path.join(work, "full-init.safetensors"), tensors=4, size=32768)
        delta = write_model(os.path.join(work, "full-delta.safetensors"), tensors=4, size=32768, value=1e-3)
        fed = Service(work, "fedmom-full", ["fedmom_server.py", "--state-dir", os.path.join(disk, "fm"), "--init", init])
        fed.start()
        a, b = (fedmom_client.FedMomClient(fed.url, c, f"{c}-1", token=TOKEN, ca_file=fed.ca) for c in "ab")
        a.join(), b.join()
        before = files(os.path.join(disk, "fm"))
        fill = filler(256 << 10)
        try:
            a.send_delta(delta, 0, 10, [], {}, transport="inline")
            reply = "accepted (!)"
        except httpc.CallError as e:
            reply = f"{e.status} {e.reply.get('code')}"
        left = files(os.path.join(disk, "fm")) - before
        os.unlink(fill)
        back = a.send_delta(delta, 0, 10, [], {}, transport="inline").get("accepted")
        rows.append(("delta spool (512 KiB delta, 256 KiB free)", reply, f"{left} new files", bool(back)))
        fill = filler(0)
        try:
            fedmom_client.FedMomClient(fed.url, "c", "c-1", token=TOKEN, ca_file=fed.ca).join()
            reply = "joined (!)"
        except httpc.CallError as e:
            reply = f"{e.status} {e.reply.get('code')}"
        members = [m["cluster"] for m in httpc.call(fed.url, "GET", "/status", token=TOKEN, ca_file=fed.ca)["members"]]
        os.unlink(fill)
        rows.append(("join (disk full)", reply, f"members {members}", True))
        c = fedmom_client.FedMomClient(fed.url, "c", "c-1", token=TOKEN, ca_file=fed.ca)
        c.join()                                    # the round now waits for c
        b.send_delta(delta, 0, 10, [], {}, transport="inline")
        fill = filler(256 << 10)
        c.leave()                                   # nobody left to wait for: the merge starts, cannot write
        deadline = time.monotonic() + 30
        while not httpc.call(fed.url, "GET", "/status", token=TOKEN, ca_file=fed.ca)["merge_error"]:
            if time.monotonic() > deadline:
                break
            time.sleep(0.1)
        st = httpc.call(fed.url, "GET", "/status", token=TOKEN, ca_file=fed.ca)
        tmp_left = [f for f in os.listdir(os.path.join(disk, "fm")) if ".tmp-" in f]
        os.unlink(fill)
        deadline = time.monotonic() + 60                            # retried 30 s later
        while httpc.call(fed.url, "GET", "/round", token=TOKEN, ca_file=fed.ca)["round"] < 1:
            if time.monotonic() > deadline:
                break
            time.sleep(0.2)
        back = httpc.call(fed.url, "GET", "/round", token=TOKEN, ca_file=fed.ca)["round"] == 1
        rows.append(("merge (256 KiB free for 1 MiB of theta + momentum)",
                     f"round {st['round']}, merge_error: {'disk full' if 'No space' in (st['merge_error'] or '') else st['merge_error']}",
                     f"{len(tmp_left)} temp files", back))
        fed.stop()
        rows += darl_full(work, disk, filler)
    finally:
        subprocess.run(["umount", "-l", disk])
    return {"rows": rows}


def darl_full(work, disk, filler):
    """DARL's log and snapshot on the full tmpfs: a change refused under the margin, and a
    snapshot that does not fit while changes still do."""
    state = os.path.join(disk, "darl")
    svc = Service(work, "darl-full", ["darl_server.py", "--num-samples", 10 ** 6, "--state-dir", state,
                                      "--snapshot-every", 200])
    svc.start()
    rows = []
    try:
        c = darl_client.LeaseClient(svc.url, TOKEN, ca_file=svc.ca)
        c.register("a", "i", httpc.call(svc.url, "GET", "/health", ca_file=svc.ca)["digest"])

        def cycle():
            lease = c.acquire("a", "i", blocks=1)["lease"]
            c.commit("a", "i", lease["id"], lease["end"])
        wal, snap = os.path.join(state, "darl", "wal.jsonl"), os.path.join(state, "darl", "snapshot.json")
        while not os.path.exists(snap) or os.path.getsize(snap) < 160 << 10:     # closed leases: a big snapshot
            cycle()
        seq0, size0 = c.status()["seq"], os.path.getsize(wal)
        fill = filler(16 << 10)                       # under the 64 KiB margin
        try:
            cycle()
            reply = "accepted (!)"
        except httpc.CallError as e:
            reply = f"{e.status} {e.reply.get('code')}"
        st = c.status()
        kept = "nothing" if (st["seq"], os.path.getsize(wal)) == (seq0, size0) else f"change {st['seq']} (!)"
        os.unlink(fill)
        cycle()
        rows.append(("DARL change (16 KiB free, under its 64 KiB margin)", reply, f"{kept}; reads served", True))
        # the log grows to the snapshot's size, then a snapshot is due and does not fit
        # (room for the log to reach the snapshot's size, then 96 KiB: above the margin, below the snapshot)
        fill = filler(max(0, os.path.getsize(snap) - os.path.getsize(wal)) + (96 << 10))
        answers, error = collections.Counter(), None
        for _ in range(20000):
            try:
                cycle()
                answers["200"] += 1
            except httpc.CallError as e:
                answers[str(e.status)] += 1
                break
            error = c.status()["snapshot_error"]
            if error:
                break
        tmp_left = [f for f in os.listdir(os.path.join(state, "darl")) if durable.is_tmp(f)]
        os.unlink(fill)
        for _ in range(400):                          # the retry comes --snapshot-every changes later
            cycle()
            if not c.status()["snapshot_error"]:
                break
        back = not c.status()["snapshot_error"]
        rows.append(("DARL snapshot (does not fit; changes still do)",
                     f"{answers['200']} changes answered 200, {sum(answers.values()) - answers['200']} refused; "
                     f"snapshot_error: {'disk full' if error and 'No space' in error else error}",
                     f"{len(tmp_left)} temp files", back))
    finally:
        svc.stop()
    return rows


# ---------------------------------------------------------------- report

def markdown(res):
    out = ["", f"Measured by `make bench-faults` ({time.strftime('%Y-%m-%d')}, "
           f"{os.cpu_count()} cores, loopback, TLS); every figure below is regenerated by it.", ""]
    if "kills" in res:
        out += ["| SIGKILL of | kills survived | acknowledged work lost | restart to healthy p50 / p99 |", "|---|---|---|---|"]
        for r in res["kills"]:
            out.append(f"| {r['daemon']} | {r['kills']} | {r['lost']} | {quantile(r['restart'], 0.5) * 1e3:.0f} / "
                       f"{quantile(r['restart'], 0.99) * 1e3:.0f} ms |")
        out.append("")
    if "wal" in res:
        w = res["wal"]
        cut, flip = w["cut"], w["flip"]
        out += [f"| DARL's log ({w['records']} records, {w['bytes']:,} bytes), damaged | cases | read back exactly "
                "| refused, naming file and byte | anything else | a real start |", "|---|---|---|---|---|---|",
                f"| cut at every byte offset of its last {w['last']} records (a crash mid-write) | {cut['offsets']:,} "
                f"| {cut['exact']:,} (the torn record dropped) | {cut['refused']} | {cut['lost_acked'] + cut['wrong']} "
                f"| {', '.join(sorted(set(w['samples']['cut mid-record'])))} |",
                f"| one byte changed before its last record (damage) | {flip['flips']} | - | {flip['refused']} "
                f"| {flip['accepted'] + flip['wrong']} | {', '.join(sorted({x.split(':')[0] for x in w['samples']['byte changed mid-log']}))} |",
                f"| one byte changed in its last record (a complete line, maybe acknowledged) | {flip['last_line']} "
                f"| - | {flip['last_line_refused']} | {flip['last_line'] - flip['last_line_refused']} | |", ""]
    if "fuzz" in res:
        out += ["| fuzzed server | requests | 2xx / 4xx / closed or reset | 5xx | hung | crashed | epoch after |",
                "|---|---|---|---|---|---|---|"]
        for r in res["fuzz"]:
            tot = {}
            for o in r["by_kind"].values():
                for k, v in o.items():
                    tot[k] = tot.get(k, 0) + v
            out.append(f"| {r['server']} | {r['requests']:,} | {tot.get('2xx', 0):,} / {tot.get('4xx', 0):,} / "
                       f"{tot.get('closed', 0) + tot.get('reset', 0):,} | {tot.get('5xx', 0)} | {tot.get('timeout', 0)} | "
                       f"{'no' if r['alive'] and not r['tracebacks'] else 'YES'} | "
                       f"{'ok' if not r['epoch_problems'] else 'FAILED'} |")
        out.append("")
    if "load" in res:
        out += ["| load (closed loop, keep-alive, TLS) | clients | rate | p50 / p99 | errors |", "|---|---|---|---|---|"]
        for r in res["load"]:
            out.append(f"| {r['what']} | {r['clients']} | {r['rate']:,.0f} {r['unit']}/s | {r['p50_ms']:.1f} / "
                       f"{r['p99_ms']:.1f} ms | {r['errors']} |")
        out.append("")
    if "halfopen" in res:
        h = res["halfopen"]
        out += [f"| DARL holding open connections ({h['rounds']} rounds, {h['samples']} samples each side) | unloaded "
                "| with them held | target |", "|---|---|---|---|",
                f"| connections held (half idle, half mid-headers under TLS) | 0 | {h['held']:,} | 2,000 |",
                f"| server threads | {h['threads'][0]} | {h['threads'][1]} | bounded (--workers + 3) |",
                f"| server RSS | {h['rss_mib'][0]:.0f} MiB | {h['rss_mib'][1]:.0f} MiB | bounded |"]
        for k, what in (("status", "GET /status"), ("cycle", "acquire+commit (2 fsync'd writes)")):
            b99, l99 = h[f"{k}_p99_ms"]
            out += [f"| legitimate {what} p50 | {h[f'{k}_p50_ms'][0]:.1f} ms | {h[f'{k}_p50_ms'][1]:.1f} ms | |",
                    f"| legitimate {what} p99 | {b99:.1f} ms | {l99:.1f} ms ({l99 / b99:.2f}x) | <= 2x |"]
        out.append("")
    if "diskfull" in res:
        d = res["diskfull"]
        if "skipped" in d:
            out += [f"Disk full: skipped ({d['skipped']}).", ""]
        else:
            out += ["| full disk (16 MiB tmpfs) | reply | left behind | back once space returns |", "|---|---|---|---|"]
            out += [f"| {a} | {b} | {c} | {'yes' if ok else 'NO'} |" for a, b, c, ok in d["rows"]]
            out.append("")
    return "\n".join(out)


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kills", type=int, default=200, help="SIGKILLs per daemon (default 200)")
    p.add_argument("--fuzz", type=int, default=10000, help="fuzz requests per server (default 10000)")
    p.add_argument("--load-s", type=float, default=5.0, help="seconds per load measurement (default 5)")
    p.add_argument("--quick", action="store_true", help="10 kills, 500 fuzz requests, 2 s loads")
    p.add_argument("--only", default="kills,wal,fuzz,load,halfopen,diskfull", help="comma-separated parts")
    p.add_argument("--no-guide", action="store_true", help="do not rewrite the tables in bench/RESULTS.md")
    p.add_argument("--hold", nargs=3, metavar=("PORT", "N", "CA"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.hold:
        return hold(int(a.hold[0]), int(a.hold[1]), a.hold[2])
    if a.quick:
        a.kills, a.fuzz, a.load_s = 10, 500, 2.0
    parts = set(a.only.split(","))
    work = tempfile.mkdtemp(prefix="faults-", dir=os.path.join(ROOT, "runs") if os.path.isdir(os.path.join(ROOT, "runs")) else None)
    certs.make_tls(work)
    with open(os.path.join(work, "token"), "w") as f:
        f.write(TOKEN + "\n")
    res = {}
    try:
        if "kills" in parts:
            res["kills"] = []
            for fn in (kills_darl, kills_fedmom, kills_blob):
                t0 = time.monotonic()
                r = fn(work, a.kills)
                res["kills"].append(r)
                print(f"kills: {r['daemon']}: {r['kills']} SIGKILLs survived, acknowledged work lost {r['lost']} "
                      f"(target 0), restart to healthy p50 {quantile(r['restart'], 0.5) * 1e3:.0f} ms p99 "
                      f"{quantile(r['restart'], 0.99) * 1e3:.0f} ms ({time.monotonic() - t0:.0f} s)", flush=True)
        if "wal" in parts:
            w = res["wal"] = wal_damage(work, flips=30 if a.quick else 300)
            print(f"wal: {w['records']} records; cut at {w['cut']['offsets']} offsets of the last {w['last']}: "
                  f"{w['cut']['exact']} read back exactly (target all), {w['cut']['lost_acked']} lost a whole record, "
                  f"{w['cut']['refused']} refused, {w['cut']['wrong']} wrong; {w['flip']['flips']} bytes changed "
                  f"before the last record: {w['flip']['refused']} refused (target all), {w['flip']['accepted']} "
                  f"accepted, {w['flip']['wrong']} wrong; last record damaged: {w['flip']['last_line_refused']} of "
                  f"{w['flip']['last_line']} refused (target all); real starts: {w['samples']}", flush=True)
        if "fuzz" in parts:
            res["fuzz"] = fuzz(work, a.fuzz)
        if "load" in parts:
            res["load"] = load(work, a.load_s)
            for r in res["load"]:
                print(f"load: {r['what']}: {r['clients']} clients, {r['rate']:,.0f} {r['unit']}/s, p50 "
                      f"{r['p50_ms']:.1f} ms p99 {r['p99_ms']:.1f} ms, errors {r['errors']}", flush=True)
        if "halfopen" in parts:
            h = res["halfopen"] = halfopen(work)
            print(f"half-open: {h['held']} connections held; server threads {h['threads'][0]} -> {h['threads'][1]}, "
                  f"RSS {h['rss_mib'][0]:.0f} -> {h['rss_mib'][1]:.0f} MiB; legitimate p99: GET /status "
                  f"{h['status_p99_ms'][0]:.1f} -> {h['status_p99_ms'][1]:.1f} ms "
                  f"({h['status_p99_ms'][1] / h['status_p99_ms'][0]:.2f}x), acquire+commit "
                  f"{h['cycle_p99_ms'][0]:.1f} -> {h['cycle_p99_ms'][1]:.1f} ms "
                  f"({h['cycle_p99_ms'][1] / h['cycle_p99_ms'][0]:.2f}x; target <= 2x)", flush=True)
        if "diskfull" in parts:
            res["diskfull"] = diskfull(work)
            for row in res["diskfull"].get("rows", []):
                print(f"disk full: {row[0]}: {row[1]}; left {row[2]}; back: {row[3]}", flush=True)
            if "skipped" in res["diskfull"]:
                print(f"disk full: SKIPPED: {res['diskfull']['skipped']}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    table = markdown(res)
    print(table)
    if not a.no_guide and not a.quick and parts == {"kills", "wal", "fuzz", "load", "halfopen", "diskfull"}:
        results.replace_block(GUIDE, "faults", "\n" + table + "\n")
        print(f"rewrote the table in {os.path.relpath(GUIDE, ROOT)}")
    w = res.get("wal")
    bad = (any(r["lost"] for r in res.get("kills", [])) or any(not r["ok"] for r in res.get("fuzz", []))
           or (w is not None and (w["cut"]["exact"] != w["cut"]["offsets"] or w["flip"]["refused"] != w["flip"]["flips"])))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
