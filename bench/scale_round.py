"""bench/scale_round.py - a federated round at the sizes users train, through the real central
path, phase by phase, against the I/O limits of the same bytes measured in the same run.

Runs on: any CPU box (the central VM's size is projected, not needed); Python + numpy, never
torch. It starts real darl_server.py, fedmom_server.py --down-wire int4 and blobstore.py
processes over TLS (a throwaway CA, bearer tokens) on 127.0.0.1, and two fake sites: this
file's --site mode, each a process of its own doing what a site's rank 0 does each round
(fedsite.py, fedphase.py): lease a span from DARL, write its delta with --wire int4
(wire.WireWriter, with error_feedback.Residual's error feedback: owed in, the new residual out, both
F32 files), upload it through the blob store (FedMomClient.send_delta, transport blob), wait
for the round (the heartbeat's long-poll), download the update and add it
(FedMomClient.download_update, wire.apply_update: the digest the aggregator published is
checked), or take the whole theta when the update path answers no_update.

    python bench/scale_round.py --quick                      # make bench: a ~24M-param model, 3 rounds, ~1 min
    python bench/scale_round.py --flavor 0.6B [--rounds 10]  # Qwen3-0.6B's shapes, 709M params: 57 GB, ~1 h
    python bench/scale_round.py --flavor 0.6B --rounds 4 --memory-gb 3 --json 0.6B.json   # plan --rates 0.6B.json
    python bench/scale_round.py --flavor 1.7B --dir /scratch --server-arg=--threads=4 --memory-gb off

Three arms, one after the other, each on fresh central processes and a fresh state dir: the
memory arm (fedmom_server.py's default --memory-gb: the outer state in memory; today's serial
exchange), the pipelined arm (the same aggregator; each site's delta checked as it arrives,
send_delta's follow, and the update followed as it is merged, fedsite.Follow with
Follow.adopt's rule, the sites not taking turns after their send) and the budget arm
(--memory-gb, default "quarter": a quarter of the outer state, 12 B/param, or the
aggregator's fixed part plus a quarter when that is more; the rest of the outer state in file
blocks in the arm's central/outer/). --memory-gb off leaves the budget arm out.

Models (random F32 tensors; the shapes are what matters): tiny (wire_speed.py's, ~0.15M
params, for the tests), small (0.6B's first layer with a 4,096-row vocabulary, ~24M
params), 0.6B and 1.7B (torchtitan's Qwen3 shapes, the vocabulary padded to 131,328, both
embedding and output in the file: wire_speed.qwen3_shapes). M below is the model's F32
bytes (4 B/param). A real flavor is refused up front, said why, when --dir has not 20 M free
or the machine has not the memory (need(): the aggregator's outer state and fixed part in the
memory arm, 7 x the largest tensor for the sites, 1 GiB: 0.6B 14.5 GB, 1.7B 35 GB).

The sites take turns (a lock file, the baton): one site's encode, upload and acceptance, or
its publish, download and apply, runs alone, so each phase is timed without the other site
on the same cores (on their own nodes they would not share any); the aggregator's merge runs
while both wait. Each phase, per round (progress is printed as each round ends):
    encode    the site writes its delta: int4 encode + write + error feedback (owed read,
              residual written), fsync'd, as fedphase.py does; GB = the F32 values (4 B/param).
              Its row "encode: feedback" is the error feedback's part alone (GB: 2 x 4 B/param)
    upload    send_delta up to the acceptance: the delta file's sha256, its PUT to the blob
              store (TLS), the /delta_check; GB = the delta file
    accept    POST /delta_blob: the aggregator fetches the delta from the blob store, checks
              it (decoded: values, norm), spools it and takes its lease into custody at DARL
    merge     the aggregator's round record ("merge_s": the FedMom step on the outer state in
              memory, on its merge workers, and the int4 update written from it); GB = its
              bytes_read + bytes_written. With "timings" in the record (accept_s, custody_s, merge_s,
              publish_s, checkpoint_s), those are shown too and used for the central sum
    publish   the first GET /theta_update_blob of the round: the aggregator copies the
              update into the blob store (the other site finds it there)
    download  the update from the blob store (the rest of download_update); GB = the update
    apply     wire.apply_update: theta + the update -> the next theta, digest checked, fsync'd;
              GB = 4 B/param
Beside each: GB/s, and its seconds over the time the fsync'd F32 write, the read and the
memcpy of the same bytes take here (x write, x read, x memcpy: measured at the start and at
the end, averaged; the machine is noisy, the ratios are what matter; the one-core sha256 of
the model, the theta digest's serial floor, is measured beside them), and the central
processes' CPU seconds over the phase's wall time. Per round also: the aggregator's state dir
and the blob store's dir after the round, the state dir's and --outer-dir's peaks during it
(sampled every 50 ms), the central processes' CPU seconds (with the processes under them: the
aggregator's merge workers), peak RSS (VmHWM of fedmom_server, darl_server, blobstore), and
the aggregator's memory as --memory-gb counts it, measured (agg_memory, sampled every 50 ms:
the RssAnon of it and its workers plus the shared memory blocks it made; a peak shorter than
that can be missed), and the bytes its and its workers' reads and writes moved, and of them
what the disk read and was sent (/proc/<pid>/io). Once the sites are done, the aggregator is
restarted on its state dir and its memory peak until it answers is taken (restart_peak). At
the end of each arm, the summary: the median per phase; central seconds per round
(both acceptances + merge + publish) over the fsync'd F32 write of the model (target <= 1.0);
a site's encode + apply over it (target <= 0.5); the state dir's peak in M (target <= 3);
and a projection to Qwen3-8B and -32B, linear in parameters: a central phase as k x (its
central CPU seconds / 16 cores + the rest of its wall time at the measured GB/s), at least
k x what it writes at the measured fsync'd write rate; the sites' phases and the transfers
as k x their time here. The checkpoints (3 M every --checkpoint-rounds rounds, read from the
aggregator's log) are printed apart: they are written after their round is published, beside
the sites' next phase. Every site checks the digest of the theta
it holds after every round (the update's, or a whole theta against the other site's), and the
bench exits 1 if any check fails, a delta does not merge, or a round does not complete.
Then the exchange (exchanges()): per round, the memory arm against the pipelined arm, seconds
after the last delta's last byte (the latest end of the sites' uploads): accepted, the merge's
start and end and durable (the aggregator's record), each site holding theta_{r+1}, and
exchange_s (last byte -> every site holding it), over the slowest single stage (the serial
arm's, each alone), the central part (last byte -> durable, + the publish when serial) over the
floor measured in the same run (the outer state's 12 B/param written fsync'd and read, from
the I/O limits of M, + a delta and an update at the link's rate: blob_client over loopback TLS,
measured once after the memory arm's rounds), and the CPU seconds meanwhile (the pipelined
arm's sites share the cores with the aggregator: pessimistic). Both arms start from the same
init and send the same deltas: a round whose digests differ between them exits 1.
Then the arms side by side (compare): the budget arm's central round against the memory
arm's (target <= 3 x), its memory peak against --memory-gb + 4 x the largest F32 tensor, a
restart's peak against the rounds' (no 16 B/param at a start), each mode projected to 8B and
32B on a 16-core VM with a local NVMe disk (outer_state.NVME, assumed: the merge no faster
than that disk reads and writes the part of the outer state on disk), and the fixed part
with nothing in memory at 32B against the original design's ~10 GiB. --json writes every
figure, and under "rates" what `fedmom_server.py plan --rates FILE` projects from. The run's
files go under --dir (default $TMPDIR), each arm's sites and central dirs removed when the
arm ends, the rest at the end unless --keep (after a failure only logs/ and records/ are kept).
"""
import argparse
import collections
import dataclasses
import fcntl
import json
import math
import os
import re
import secrets
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)                          # run as `python bench/scale_round.py`: the siblings one level up
sys.path.insert(1, HERE)                          # wire_speed.py (the Qwen3 shapes), fedmom_disk_peak.py (dir_bytes)
sys.path.insert(2, os.path.join(ROOT, "tests"))   # tests/certs.py: the CA and certificate, as central.sh makes them

import numpy as np  # noqa: E402

import blob_client  # noqa: E402
import darl_client  # noqa: E402
import durable  # noqa: E402
import fedmom_client  # noqa: E402
import fedsite  # noqa: E402
from testbed import harness  # noqa: E402
import fedmom_merge  # noqa: E402
import fedmom_state  # noqa: E402
import httpc  # noqa: E402
import outer_state  # noqa: E402
import tensorio  # noqa: E402
import wire  # noqa: E402
from fedmom_disk_peak import dir_bytes  # noqa: E402
from wire_speed import FLAVORS as QWEN3, VOCAB, Clock, memcpy, qwen3_shapes, read_f32, write_f32  # noqa: E402

FLAVOR_CHOICES = ("tiny", "small", "0.6B", "1.7B")
REAL = ("0.6B", "1.7B")
SITES = ("alpha", "beta")
CENTRAL = {"fedmom": "fedmom_server.py", "darl": "darl_server.py", "blob": "blobstore.py"}
PHASES = ("encode", "upload", "accept", "merge", "publish", "download", "apply")
WHERE = {"encode": "site", "upload": "transfer", "accept": "central", "merge": "central", "publish": "central",
         "download": "transfer", "apply": "site"}
QWEN3_32B = (5120, 64, 64, 8, 128, 25600)   # Qwen3-32B: dim, layers, heads, kv heads, head_dim, hidden
VM_CORES = 16                     # the central VM the projection is for
PHASE_S = 600.0                   # the sites' LeaseSession phase estimate: leases of 2.5 x this (DARL caps at 3600)
SAMPLE_S = 0.05                   # the state dir and the central CPU are sampled this often
INT4 = wire.Codec("int4")         # a site's --wire int4, default block
TOKENS = 1000                     # each delta's merge weight (equal: the sites' shares are 1/2)


def say(msg=""):
    print(msg, flush=True)


# ---------------------------------------------------------------- models

def model_shapes(flavor):
    """(name, shape) in state-dict order. small: 0.6B's first layer, a 4,096-row vocabulary."""
    if flavor == "small":
        return [(n, (4096, s[1]) if n in ("tok_embeddings.weight", "output.weight") else s)
                for n, s in qwen3_shapes("0.6B", layers=1)]
    return qwen3_shapes(flavor)


def qwen3_params(dims, vocab=VOCAB):
    """Parameters of a Qwen3 flavor by qwen3_shapes' layout (embedding and output both counted)."""
    dim, layers, heads, kv, hd, hidden = dims
    per_layer = 2 * hd + 2 * dim * heads * hd + 2 * kv * hd * dim + 3 * hidden * dim + 2 * dim
    return 2 * vocab * dim + layers * per_layer + dim


def nparams(shapes):
    return sum(math.prod(s) for _, s in shapes)


class Pool:
    """Cheap random tensors: one buffer of normal float32 values (the largest tensor plus
    2^20), from which each (round, tensor) takes a window at a seeded offset, scaled. A
    window costs a multiply, not a fresh draw (numpy draws ~50 M normals/s here: 15 s per
    0.6B model per site per round, untimed but waited for)."""

    def __init__(self, shapes, seed):
        self.largest = max(math.prod(s) for _, s in shapes)
        self.buf = np.random.default_rng(seed).standard_normal(self.largest + (1 << 20), dtype=np.float32)
        self.seed = seed

    def tensor(self, key, i, shape, scale):
        n = math.prod(shape)
        off = int(np.random.default_rng([self.seed, key, i]).integers(0, self.buf.size - n + 1))
        return (self.buf[off:off + n] * np.float32(scale)).reshape(shape)


def make_model(path, shapes, seed):
    """The initial theta_global: random F32 tensors (not timed)."""
    pool = Pool(shapes, seed)
    with tensorio.TensorWriter(path, [(n, "F32", s) for n, s in shapes], fsync=False) as w:
        for i, (n, s) in enumerate(shapes):
            w.write(n, pool.tensor(0, i, s, 0.02))


def baselines(src, shapes, scratch):
    """The I/O limits of the model's F32 bytes here -> {"write", "read", "memcpy"} seconds,
    by wire_speed.py's measures: the model written as F32 with fsync (the reads of `src`
    between the writes not timed), read again into one reused buffer (page cache warm),
    copied once in memory (np.copyto between reused buffers)."""
    largest = max(math.prod(s) for _, s in shapes)
    buf, buf2 = np.ones(largest, np.float32), np.zeros(largest, np.float32)   # touched: no page faults timed
    write_s = write_f32(src, shapes, buf, scratch)
    return {"write": write_s, "read": read_f32(src, shapes, buf), "memcpy": memcpy(shapes, buf, buf2),
            "sha256": sha256_f32(src, shapes, buf)}


def sha256_f32(src, shapes, buf):
    """Seconds of the theta digest (wire.Digest: one sha256 over the model's F32 bytes, on one
    core whatever the cores), the reads not timed: the serial floor of a round's publish."""
    d, clock = wire.Digest(), Clock()
    with tensorio.TensorReader(src) as r:
        for n, s in shapes:
            a = r.read(n, out=buf).reshape(s)
            with clock:
                d.add(n, a)
    return clock.s


# ---------------------------------------------------------------- processes: CPU, RSS

TICK = os.sysconf("SC_CLK_TCK")


def _stat_cpu(pid, reaped=False):
    """utime + stime of one process (all its threads), plus its reaped children's with
    `reaped`, seconds; 0.0 once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return sum(int(x) for x in fields[11:15 if reaped else 13]) / TICK
    except (OSError, IndexError, ValueError):
        return 0.0


def procs_cpu(pids):
    """{key: CPU seconds} of each process in {key: pid} and every process under it: its own
    threads, its live descendants (fedmom_server's merge workers, outer_state.py
    --merge-worker, do a round's arithmetic), and the children it has reaped (a worker
    replaced after it died). One walk of /proc for all."""
    parents = harness.ppids()
    kids = {}
    for c, pp in parents.items():
        kids.setdefault(pp, []).append(c)

    def tree(p):
        out, todo = [], list(kids.get(p, ()))
        while todo:
            c = todo.pop()
            out.append(c)
            todo += kids.get(c, ())
        return out
    return {k: _stat_cpu(p, reaped=True) + sum(_stat_cpu(c) for c in tree(p)) for k, p in pids.items()}


def proc_status(pid, key):
    """A kB field of /proc/<pid>/status (VmHWM: peak RSS, VmRSS) in bytes, or None."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def real_pid(proc, script):
    """The pid of the python that runs `script` in a started process's tree (the leader
    itself, or the child of a wrapper that harness or a supervisor put in front of it)."""
    def cmdline(pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                return [x.decode(errors="replace") for x in f.read().split(b"\0")]
        except OSError:
            return []
    tree = harness.process_tree(proc.pid)
    runs = [p for p in tree if any(os.path.basename(x) == script for x in cmdline(p))]
    leaves = [p for p in runs if not (harness.process_tree(p) - {p}) & set(runs)]
    if not leaves:
        raise RuntimeError(f"no process runs {script} under pid {proc.pid}")
    return max(leaves)


class Meter:
    """Snapshots for timing a phase: wall time, this process's CPU and the central processes' CPU."""

    def __init__(self, central_pids):
        self.pids = list(central_pids)

    def now(self):
        t = os.times()
        return (time.time(), time.perf_counter(), t.user + t.system, sum(procs_cpu(dict(enumerate(self.pids))).values()))

    @staticmethod
    def span(a, b, nbytes, minus=None):
        """The phase from snapshot a to b (less the (a', b') of `minus`, a part timed apart)."""
        d = [b[i] - a[i] for i in range(4)]
        if minus is not None:
            d = [x - (minus[1][i] - minus[0][i]) for i, x in enumerate(d)]
        return {"s": d[1], "cpu": d[2], "central_cpu": d[3], "t0": a[0], "t1": b[0], "bytes": nbytes}


# ---------------------------------------------------------------- the fake site (--site)

class TimedClient(fedmom_client.FedMomClient):
    """fedmom_client.FedMomClient with its calls to the aggregator on the routes in `timed`
    snapshotted (Meter), so that send_delta splits into the upload and the acceptance
    (POST /delta_blob), and download_update into the publish (GET /theta_update_blob) and
    the download from the blob store. The calls themselves are FedMomClient's."""

    timed = ("/delta_blob", "/theta_update_blob", "/theta_blob")

    def __init__(self, *args, meter, **kw):
        super().__init__(*args, **kw)
        self.meter, self.calls = meter, []

    def _request(self, method, path, body=None, timeout=None, deadline=None):
        route = path.split("?")[0]
        if route not in self.timed:
            return super()._request(method, path, body, timeout, deadline)
        a = self.meter.now()
        try:
            return super()._request(method, path, body, timeout, deadline)
        finally:
            self.calls.append((route, a, self.meter.now()))

    def last(self, route, since):
        """(a, b) of the last call on `route` made after call number `since`."""
        got = [(a, b) for r, a, b in self.calls[since:] if r == route]
        if not got:
            raise RuntimeError(f"no {route} call was made")
        return got[-1]


class TimedUpload(blob_client.Upload):
    """blob_client.Upload with the end of each attempt snapshotted (Meter): the delta's last
    byte is in the blob store then. With the delta checked while it arrives (send_delta's
    follow), the acceptance runs beside the upload, so its end is the only split point. The
    site process puts it in blob_client's place (send_delta makes its Upload there)."""

    meter, ends = None, []

    def attempt(self, deadline=None):
        info = super().attempt(deadline)
        TimedUpload.ends.append(TimedUpload.meter.now())
        return info


class Residual:
    """error_feedback.Residual's files and rules (torch-free): residual.safetensors is owed now,
    residual-next.safetensors what the delta in flight leaves owed (renamed once merged).
    Every delta of this bench must merge (else it fails), so only that rule is needed."""

    def __init__(self, workdir):
        self.path = os.path.join(workdir, "residual.safetensors")
        self.next_path = os.path.join(workdir, "residual-next.safetensors")

    def merged(self):
        durable.rename(self.next_path, self.path)


def write_delta(path, shapes, base, pool, key, residual):
    """delta + owed -> the int4 delta file and the new residual, tensor by tensor, both
    fsync'd (fedphase.FedMomCarrier.write_delta with Residual) -> (seconds, of them the error
    feedback's: the owed read and added, the residual subtracted and written), the draws
    of the delta not counted."""
    enc, fb_clock = Clock(), Clock()
    owed = tensorio.TensorReader(residual.path) if os.path.exists(residual.path) else None
    try:
        with enc:
            w = wire.WireWriter(path, shapes, INT4, {"base_round": str(base)})
        with fb_clock:
            fb = tensorio.TensorWriter(residual.next_path, [(n, "F32", s) for n, s in shapes],
                                       {"base_round": str(base)})
        for i, (n, s) in enumerate(shapes):
            d = pool.tensor(key, i, s, 1e-3)
            with fb_clock:
                x = d if owed is None else d + owed.read(n).reshape(s)
            with enc:
                sent = w.write(n, x)
            with fb_clock:
                fb.write(n, x - sent)
        with enc:
            w.close()
        with fb_clock:
            fb.close()
    finally:
        if owed is not None:
            owed.close()
    return enc.s + fb_clock.s, fb_clock.s


class Baton:
    """One site at a time in a timed stretch: an flock on a file both sites open."""

    def __init__(self, path):
        self.path = path

    def __enter__(self):
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def __exit__(self, *exc):
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)


def site_main(a):
    """One fake site: join, take theta, then --rounds round trips; a line per round in --records."""
    shapes = model_shapes(a.flavor)
    token = httpc.load_token(a.token_file)
    meter = Meter(int(p) for p in a.central_pids.split(","))
    inc = secrets.token_hex(6)
    os.makedirs(a.work, exist_ok=True)
    records = open(os.path.join(a.records, f"{a.name}.jsonl"), "a", buffering=1)

    def note(**kw):
        records.write(json.dumps({"site": a.name, "t": time.time(), **kw}) + "\n")
    darl = darl_client.LeaseClient(a.darl, token=token, ca_file=a.ca_file)
    digest = darl.status()["digest"]
    darl.register(a.name, inc, digest)
    session = darl_client.LeaseSession(darl, a.name, digest, incarnation=inc, span_blocks=1, lease_blocks=1,
                                       prefetch=False, phase_s=PHASE_S, log=lambda m: say(f"darl: {m}"))
    session.start(register=False)
    fed = TimedClient(a.fedmom, a.name, inc, token=token, blob_url=a.blob, ca_file=a.ca_file, meter=meter)
    TimedUpload.meter, blob_client.Upload = meter, TimedUpload
    fed.join(deadline=httpc.Deadline(60))
    baton, pool = Baton(a.baton), Pool(shapes, [7, SITES.index(a.name)])
    theta, residual = os.path.join(a.work, "theta.safetensors"), Residual(a.work)
    with fed.keepalive(interval_s=10.0):
        deadline = time.monotonic() + 300
        while len(fed._request("GET", "/status")["members"]) < a.sites:     # no round may close without us all
            if time.monotonic() > deadline:
                raise RuntimeError("the other sites did not join within 300 s")
            time.sleep(0.2)
        with baton:
            held, first = full_theta(fed, meter, theta)
        note(event="start", round=held[0], digest=held[1], **first)
        for _ in range(a.rounds):
            held = one_round(a, fed, session, meter, baton, pool, theta, residual, held, note)
    session.close()
    fed.leave()
    note(event="end", vm_hwm=proc_status(os.getpid(), "VmHWM"))
    return 0


def full_theta(fed, meter, theta):
    """The whole theta_global through the blob store (sha256 checked), and its digest ->
    ((round, digest), {"publish_full", "download_full"} phases)."""
    n, a = len(fed.calls), meter.now()
    rnd = fed.download_theta(theta, transport="blob")
    b = meter.now()
    pub = fed.last("/theta_blob", n)
    size = os.path.getsize(theta)
    digest = wire.theta_digest(theta)
    return (rnd, digest), {"publish_full": Meter.span(*pub, size), "download_full": Meter.span(a, b, size, pub)}


def one_round(a, fed, session, meter, baton, pool, theta, residual, held, note):
    """Lease, encode, send, wait for the round, fetch the next theta -> (round, digest) held."""
    shapes = model_shapes(a.flavor)
    span = session.next_span(timeout=300)
    if span is None:
        raise RuntimeError("DARL has no block left for this round")
    base, ph = held[0], {}
    delta = os.path.join(a.work, f"delta-r{base}.safetensors")
    with baton:
        t0 = meter.now()
        _, fb_s = write_delta(delta, shapes, base, pool, base + 1, residual)
        ph["encode"] = {**Meter.span(t0, meter.now(), 4 * nparams(shapes)), "feedback_s": fb_s}
        session.refresh()                               # FedSite.round_trip's check: is the lease still ours?
        if span.lease not in session.held():
            raise RuntimeError(f"lease {span.lease} lost at DARL before the send")
        size, n, t0 = os.path.getsize(delta), len(fed.calls), meter.now()
        # the serial arm: today's path (the POST after the upload); the pipelined: checked as it arrives
        reply = fed.send_delta(delta, base, TOKENS, [session.commit_record(span)], {"loss": 1.0}, transport="blob",
                               follow=a.pipelined)
        t1 = meter.now()
        landed = TimedUpload.ends[-1]
        if a.pipelined:                                 # the acceptance: what is left after the last byte
            ph["upload"], ph["accept"] = Meter.span(t0, landed, size), Meter.span(landed, t1, size)
        else:
            acc = fed.last("/delta_blob", n)
            ph["upload"], ph["accept"] = Meter.span(t0, t1, size, acc), Meter.span(*acc, size)
    os.unlink(delta)
    # the pipelined arm follows the update of round base + 1 as it is merged (fedsite.Follow.start)
    fol = Followed(fed, theta, held, meter) if a.pipelined else None
    t0 = meter.now()
    while True:                                         # the round's long-poll, as FedSite.round_trip
        got = fed.heartbeat(wait_round_after=base, wait_s=30.0)
        mine = [o for o in got.get("deltas") or () if o.get("incarnation") == fed.incarnation
                and o.get("base_round") == base]
        state = mine[0]["outcome"] if mine else None
        if state == "pending" or (state is None and got["round"] <= base):
            continue
        break
    seen = meter.now()
    ph["wait"] = Meter.span(t0, seen, 0)
    session.span_done(span)
    if state != "merged":
        if fol is not None:
            fol.discard()
        raise RuntimeError(f"the delta of round {base} was not merged: {mine or got}")
    residual.merged()
    adopted = fol.adopt(got.get("update"), ph, 4 * nparams(shapes)) if fol is not None else None
    if adopted is not None:
        rnd, digest, via = adopted
    elif a.pipelined:                                   # not the durable round's: the usual way, concurrently
        rnd, digest, via, fetched = fetch(fed, meter, theta, held, 4 * nparams(shapes))
        ph.update(fetched)
    else:
        with baton:
            rnd, digest, via, fetched = fetch(fed, meter, theta, held, 4 * nparams(shapes))
        ph.update(fetched)
    now = meter.now()
    # the exchange's time line, wall clock (one machine): the last byte of this site's delta, its
    # acceptance, the round durable as the heartbeat said it, the new theta held; the site's CPU
    ph["exchange"] = {"landed": landed[0], "accepted": t1[0], "durable_seen": seen[0], "held": now[0],
                      "cpu": now[2] - landed[2]}
    note(event="round", round=rnd, base=base, merged_into=mine[0].get("merged_into"), custody=reply.get("custody"),
         via=via, digest=digest, delta_bytes=size, phases=ph)
    return rnd, digest


class Followed:
    """The pipelined arm's fetch: fedsite.Follow (the update downloaded as it is merged, each
    tensor added as its bytes are in, into theta-next.safetensors), watched on a thread for its
    first and last byte and the end of its addition; adopt() is Follow.adopt's rule."""

    def __init__(self, fed, theta, held, meter):
        self.theta, self.held, self.meter, self.marks = theta, held, meter, {}
        self.fol = fedsite.Follow(fed, theta, held, retry_s=3600.0)
        self.watch = threading.Thread(target=self._watch, name="follow-watch", daemon=True)
        self.watch.start()

    def _watch(self):
        f = self.fol.f
        try:
            f.wait_for(8)
            self.marks["first"] = self.meter.now()
            f.wait_for(f.total)
            self.marks["last"] = self.meter.now()
        except Exception:                            # the follow failed: adopt() says so
            pass
        self.fol.thread.join()
        self.marks["applied"] = self.meter.now()

    def adopt(self, want, ph, model_bytes):
        """The round is durable (want: the heartbeat's "update") -> (round, digest, "followed")
        with theta renamed in when the followed theta is that round's bit for bit, else None."""
        got = self.fol.result()
        self.watch.join()
        if got is None or want is None or got != (want["round"], want["digest"]) \
                or want["base_digest"] != self.held[1]:
            say(f"the followed update ({got}, {self.fol.box.get('err')}) is not the durable round's ({want})")
            self.discard()
            return None
        durable.rename(self.fol.cand, self.theta, True)
        durable.unlink(self.fol.upd)
        m = self.marks
        ph["download"] = Meter.span(m["first"], m["last"], self.fol.f.total)
        ph["apply"] = Meter.span(m["first"], m["applied"], model_bytes)
        return got[0], got[1], "followed"

    def discard(self):
        self.fol.discard()
        self.watch.join()


def fetch(fed, meter, theta, held, model_bytes):
    """FedSite._fetch's order: the update from the theta held (publish, download, apply: the
    digest it must give checked by wire.apply_update), else the whole theta ->
    (round, digest, "update" | "full", phases)."""
    upd = os.path.join(os.path.dirname(theta), "theta-update.safetensors")
    n, t0 = len(fed.calls), meter.now()
    got = fed.download_update(upd, *held, transport="blob")
    t1 = meter.now()
    if got is None:                                     # no_update: the parent judges why
        (rnd, digest), ph = full_theta(fed, meter, theta)
        return rnd, digest, "full", {"publish": ph["publish_full"], "download": ph["download_full"]}
    size = os.path.getsize(upd)
    pub = fed.last("/theta_update_blob", n)
    digest = wire.apply_update(theta, upd, theta, got[1], {"round": str(got[0])})
    t2 = meter.now()
    durable.unlink(upd)
    return got[0], digest, "update", {"publish": Meter.span(*pub, size), "download": Meter.span(t0, t1, size, pub),
                                      "apply": Meter.span(t1, t2, model_bytes)}


# ---------------------------------------------------------------- the bench

@dataclasses.dataclass
class Config:
    flavor: str
    rounds: int
    dir: str
    keep: bool
    server_args: list
    json: str | None
    memory_gb: str = "quarter"        # the budget arm's --memory-gb: quarter, off, or GB

    def validate(self):
        if self.rounds < 1:
            raise SystemExit(f"--rounds {self.rounds}: at least 1")
        if self.memory_gb not in ("quarter", "off"):
            try:
                ok = float(self.memory_gb) > 0
            except ValueError:
                ok = False
            if not ok:
                raise SystemExit(f"--memory-gb {self.memory_gb}: give GB (> 0), quarter or off")
        return self


def need(shapes, aggregator=None):
    """(disk bytes, memory bytes) a run needs. The disk: 20 M (M = the model's F32 bytes) at
    the arms' peak: each site's theta, the theta an update is applied into and the owed and
    next residuals, 4 M a site; the aggregator's state dir at its merge, 6.5 M; the blob
    store, 1.4 M (the run's own peak was 13.8 M before the arms); the budget arm's file
    blocks, 3 M at most; the initial model, kept for every arm, 1 M. The memory: the
    aggregator's (`aggregator`; default its outer state in memory, 12 B/param, plus its fixed
    part: outer_state.Budget), a site's encode (4.8 x the largest tensor, measured VmHWM)
    and both sites' pools (1 x each: the sites wait while the aggregator merges, and take
    turns), and 1 GiB for DARL, the blob store and this process."""
    m = 4 * nparams(shapes)
    largest = 4 * max(math.prod(s) for _, s in shapes)
    if aggregator is None:
        b = outer_state.Budget(0, dict(shapes), ("theta", "momentum", "residual"), INT4, os.cpu_count() or 1)
        aggregator = b.minimum() + b.state_bytes()
    return int(20 * m), int(aggregator + 7 * largest + (1 << 30))


def room_problems(flavor, shapes, free, avail, aggregator=None):
    """What keeps a run from fitting `free` bytes of disk and `avail` of memory: [reasons]."""
    disk_need, mem_need = need(shapes, aggregator)
    gb, why = 1e9, []
    if free < disk_need:
        why.append(f"--dir has {free / gb:.1f} GB free, --flavor {flavor} needs ~{disk_need / gb:.1f} GB (each "
                   "site's theta, next theta and two residuals; the aggregator's merge peak; the blob store; the "
                   "budget arm's file blocks): point --dir at a larger disk")
    if avail < mem_need:
        why.append(f"this machine has {avail / gb:.1f} GB of memory available, --flavor {flavor} needs "
                   f"~{mem_need / gb:.1f} GB (the aggregator's outer state in memory, 12 B/param, in the memory arm; "
                   "a site's encode holds several copies of the largest tensor): run it on a larger machine, or "
                   "only the budget arm's (--memory-gb GB)")
    return why


def check_room(cfg, shapes, root, arms):
    """Say what the run needs and has; a real flavor that cannot fit stops here (SystemExit).
    The aggregator's memory is the larger arm's: its outer state in memory (the memory arm)."""
    fixed = fixed_budget(cfg, shapes)
    agg = max(fixed.minimum() + fixed.state_bytes(),
              max((a["memory_gb"] or 0) * outer_state.GB for a in arms))
    disk_need, mem_need = need(shapes, agg)
    free, avail = shutil.disk_usage(root).free, outer_state.meminfo("MemAvailable")
    say(f"room: --dir {os.path.abspath(root)}: {free / 1e9:.1f} GB free, this run needs ~{disk_need / 1e9:.1f} GB; memory "
        f"{avail / 1e9:.1f} GB available, needs ~{mem_need / 1e9:.1f} GB (the aggregator ~{agg / 1e9:.1f} GB)")
    why = room_problems(cfg.flavor, shapes, free, avail, agg)
    if why and cfg.flavor in REAL:
        raise SystemExit("scale_round: cannot fit: " + "; ".join(why))


def agg_memory(pid):
    """(private, shared) bytes the aggregator holds now, measured: the anonymous resident
    memory (RssAnon) of it and of every process under it (its merge workers), and the
    allocated bytes of the shared memory blocks it made (fedmom_merge's files named after its
    pid in $PWW_SHM_DIR; counted once, however many workers map them). Its file blocks on
    disk are neither: page cache the kernel may drop."""
    private = sum(proc_status(p, "RssAnon") or 0 for p in harness.process_tree(pid))
    shm, d = 0, fedmom_merge.shm_dir()
    try:
        names = [fn for fn in os.listdir(d) if fn.startswith(f"{fedmom_merge.PREFIX}{pid}-")]
    except OSError:
        names = []
    for fn in names:
        try:
            shm += os.stat(os.path.join(d, fn)).st_blocks * 512
        except OSError:
            pass
    return private, shm


IO_KEYS = ("rchar", "wchar", "read_bytes", "write_bytes")


def tree_io(pid):
    """{rchar, wchar, read_bytes, write_bytes} summed over the aggregator and its workers
    (/proc/<pid>/io): the bytes their read and write calls moved, and of them what the disk
    itself read and was sent to write (page cache misses and write-back)."""
    out = dict.fromkeys(IO_KEYS, 0)
    for p in harness.process_tree(pid):
        try:
            with open(f"/proc/{p}/io") as f:
                for line in f:
                    k, v = line.split(":")
                    if k in out:
                        out[k] += int(v)
        except (OSError, ValueError):
            continue
    return out


class Sampler:
    """A thread that samples, every SAMPLE_S, the bytes of the aggregator's state dir, its
    --outer-dir and the blob store's dir (walked: no file layout assumed), the central
    processes' CPU seconds and the aggregator's memory (agg_memory: private + shared); peak()
    and the CPU of a past interval come from it. `agg` (the aggregator's pid) may be replaced
    by a callable that finds a restarted one's."""

    def __init__(self, dirs, pids):
        self.dirs, self.pids = dirs, pids
        self.agg = lambda: pids["fedmom"]
        self.stop, self.lock = threading.Event(), threading.Lock()
        self.peaks = {k: 0 for k in list(dirs) + ["memory"]}
        self.at_peak = (0, 0)                     # (private, shared) at the memory peak
        self.series = []                          # (time.time(), {kind: cpu s})
        self.thread = threading.Thread(target=self._run, name="sampler", daemon=True)

    def _run(self):
        while not self.stop.is_set():
            sizes = {k: dir_bytes(d) for k, d in self.dirs.items()}
            cpu = procs_cpu(self.pids)
            pid = self.agg()
            mem = agg_memory(pid) if pid else (0, 0)
            with self.lock:
                for k, v in sizes.items():
                    self.peaks[k] = max(self.peaks[k], v)
                if sum(mem) > self.peaks["memory"]:
                    self.peaks["memory"], self.at_peak = sum(mem), mem
                self.series.append((time.time(), cpu))
            self.stop.wait(SAMPLE_S)

    def take_peaks(self):
        """The peaks since the last call (then reset), with "private" and "shared" at the memory peak."""
        with self.lock:
            out = {**self.peaks, "private": self.at_peak[0], "shared": self.at_peak[1]}
            self.peaks, self.at_peak = dict.fromkeys(self.peaks, 0), (0, 0)
        return out

    def cpu_between(self, t0, t1):
        """The central processes' CPU seconds (all three) between two wall times, interpolated."""
        with self.lock:
            s = list(self.series)

        def at(t):
            if not s:
                return 0.0
            if t <= s[0][0]:
                return sum(s[0][1].values())
            for (ta, ca), (tb, cb) in zip(s, s[1:]):
                if ta <= t <= tb:
                    f = (t - ta) / (tb - ta) if tb > ta else 1.0
                    return sum(ca.values()) + f * (sum(cb.values()) - sum(ca.values()))
            return sum(s[-1][1].values())
        return max(0.0, at(t1) - at(t0))


def start_central(L, root, cfg, init, arm_args=()):
    """The three servers over TLS on 127.0.0.1 -> (urls, Procs, token file, CA); arm_args: the
    arm's flags for fedmom_server.py (--memory-gb, --outer-dir)."""
    central, logs = os.path.join(root, "central"), os.path.join(root, "logs")
    os.makedirs(os.path.join(root, "tls"))
    import certs
    ca, cert, key = certs.make_tls(os.path.join(root, "tls"))
    token = harness.make_token(os.path.join(root, "token"))
    agg = harness.make_token(os.path.join(root, "aggregator.token"))
    common = ["--token-file", token, "--tls-cert", cert, "--tls-key", key]
    procs, urls = {}, {}
    procs["darl"], urls["darl"] = harness.start_server(
        L, "darl", ["--num-samples", len(SITES) * cfg.rounds, "--block-size", 1, "--seed", 0, "--state-dir", central,
                    "--aggregator-token-file", agg, *common], os.path.join(logs, "darl.log"), port=0, ca_file=ca)
    procs["blob"], urls["blob"] = harness.start_server(
        L, "blob", ["--root", os.path.join(central, "blobs"), *common], os.path.join(logs, "blob.log"), port=0,
        ca_file=ca)
    fed_args = ["--state-dir", os.path.join(central, "fedmom"), "--init", init, "--darl", urls["darl"],
                "--blob-url", urls["blob"], "--darl-token-file", agg, "--ca-file", ca, "--down-wire", "int4",
                *common, *cfg.server_args, *arm_args]
    procs["fedmom"], urls["fedmom"] = harness.start_server(L, "fedmom", fed_args, os.path.join(logs, "fedmom.log"),
                                                           port=0, ca_file=ca)
    procs["fedmom"].args = fed_args                   # restart_peak starts it again with the same flags
    return urls, procs, token, ca


def launch_sites(L, root, cfg, urls, token, ca, pids, pipelined=False):
    out = {}
    for name in SITES:
        cmd = [sys.executable, os.path.abspath(__file__), "--site", "--name", name, "--flavor", cfg.flavor,
               "--rounds", cfg.rounds, "--sites", len(SITES), "--darl", urls["darl"], "--fedmom", urls["fedmom"],
               "--blob", urls["blob"], "--token-file", token, "--ca-file", ca,
               "--records", os.path.join(root, "records"), "--work", os.path.join(root, "sites", name),
               "--baton", os.path.join(root, "baton"), "--central-pids", ",".join(str(p) for p in pids.values())]
        cmd += ["--pipelined"] if pipelined else []
        out[name] = L.start(f"site-{name}", cmd, os.path.join(root, "logs", f"site-{name}.log"))
    return out


def read_records(root):
    out = collections.defaultdict(dict)           # site -> {round: record}, plus "start"/"end" events
    for name in SITES:
        for e in durable.read_jsonl(os.path.join(root, "records", f"{name}.jsonl")):
            out[name][e["round"] if e["event"] == "round" else e["event"]] = e
    return out


def arms_of(cfg, shapes, root):
    """The arms of the run, one after the other on fresh central processes: "memory" (the
    aggregator's default budget: its outer state in memory, as before --memory-gb), then
    "budget" at --memory-gb (quarter: a quarter of the outer state, or the fixed part plus a
    quarter when that is more) -> [{"name", "args", "memory_gb"}]."""
    arms = [{"name": "memory", "args": [], "memory_gb": None},
            {"name": "pipelined", "args": [], "memory_gb": None, "pipelined": True}]
    if cfg.memory_gb == "off":
        return arms
    b = fixed_budget(cfg, shapes)
    if cfg.memory_gb == "quarter":
        g = b.state_bytes() / 4 if b.state_bytes() / 4 > b.minimum() else b.minimum() + b.state_bytes() / 4
    else:
        g = float(cfg.memory_gb) * outer_state.GB
    outer = os.path.join(root, "budget", "central", "outer")
    return arms + [{"name": "budget", "args": ["--memory-gb", f"{g / outer_state.GB:.6f}", "--outer-dir", outer],
                    "memory_gb": g / outer_state.GB}]


def fixed_budget(cfg, shapes, memory=0):
    """outer_state.Budget of the bench's aggregator: --down-wire int4, momentum, its merge
    workers (--merge-procs from --server-arg, else every core; none under the pool's minimum)."""
    procs = os.cpu_count() or 1
    for arg in cfg.server_args:
        if arg.startswith("--merge-procs="):
            procs = int(arg.split("=", 1)[1])
    procs = procs if procs > 1 and nparams(shapes) >= fedmom_merge.min_params() else 0
    return outer_state.Budget(int(memory), dict(shapes), ("theta", "momentum", "residual"), INT4, procs)


def run(cfg):
    shapes = model_shapes(cfg.flavor)
    P, M = nparams(shapes), 4 * nparams(shapes)
    os.makedirs(cfg.dir, exist_ok=True)
    say(f"scale_round: --flavor {cfg.flavor}: {len(shapes)} tensors, {P:,} parameters, M = {M / 1e9:.3f} GB (F32); "
        f"{cfg.rounds} round{'s' if cfg.rounds > 1 else ''}, {len(SITES)} sites (int4, error feedback), aggregator "
        "--down-wire int4" + (f" {' '.join(cfg.server_args)}" if cfg.server_args else "") + f"; {os.cpu_count()} cores")
    root = tempfile.mkdtemp(prefix="scale-round-", dir=cfg.dir)
    arms = arms_of(cfg, shapes, root)
    check_room(cfg, shapes, cfg.dir, arms)
    say(f"files in {root}; arms: " + ", ".join(a["name"] + (f" (--memory-gb {a['memory_gb']:.3f})" if a["memory_gb"]
                                                            else " (the default budget)") for a in arms))
    ok, out = False, {"config": dataclasses.asdict(cfg), "parameters": P, "model_bytes": M, "cores": os.cpu_count(),
                      "largest_params": max(math.prod(s) for _, s in shapes), "arms": {}}
    try:
        init = os.path.join(root, "init.safetensors")
        t0 = time.monotonic()
        make_model(init, shapes, 1)
        say(f"made the initial model in {time.monotonic() - t0:.1f} s; measuring the I/O limits of M ...")
        base = [baselines(init, shapes, os.path.join(root, "baseline.safetensors"))]
        say("  " + limits_line(base[0], M))
        for arm in arms:
            say(f"\n=== arm {arm['name']}: fedmom_server.py {' '.join(arm['args']) or '(its default --memory-gb)'}")
            adir = os.path.join(root, arm["name"])
            for sub in ("logs", "records", "sites"):
                os.makedirs(os.path.join(adir, sub))
            with harness.Launcher() as L:
                out["arms"][arm["name"]] = {**federate(L, cfg, adir, init, shapes, base, arm), "arm": arm}
                L.stop_all()
            if not cfg.keep:
                for sub in ("sites", "central"):              # the next arm's disk: only logs and records stay
                    shutil.rmtree(os.path.join(adir, sub), ignore_errors=True)
        base.append(baselines(init, shapes, os.path.join(root, "baseline.safetensors")))
        say("I/O limits again at the end: " + limits_line(base[1], M))
        out["baselines"] = base
        ok = True
        for arm in arms:
            say(f"\n=== summary of arm {arm['name']}")
            ok = summary(out["arms"][arm["name"]], base, shapes, P, M) and ok
        same, out["exchange"] = exchanges(out, {k: statistics.mean(b[k] for b in base) for k in ("write", "read")})
        ok = same and ok
        compare(out, [a for a in arms if not a.get("pipelined")], shapes, cfg, base)
    finally:
        if cfg.json:
            with open(cfg.json, "w") as f:
                json.dump(out, f, indent=1, default=str)
            say(f"figures written to {cfg.json}")
        cleanup(root, cfg.keep, ok)
    return 0 if ok else 1


def limits_line(b, M):
    return "  ".join(f"{k} {b[k]:.2f} s ({M / 1e9 / b[k]:.2f} GB/s)"
                     for k in ("write", "read", "memcpy", "sha256")).replace("write", "write+fsync", 1)


def cleanup(root, keep, ok):
    if keep:
        say(f"kept {root} ({dir_bytes(root) / 1e9:.1f} GB)")
        return
    if ok:
        shutil.rmtree(root, ignore_errors=True)
        return
    for arm in os.listdir(root):                   # a failure: each arm's logs and the sites' records stay
        p = os.path.join(root, arm)
        if not os.path.isdir(p):
            os.unlink(p)
            continue
        for entry in os.listdir(p):
            if entry not in ("logs", "records"):
                q = os.path.join(p, entry)
                shutil.rmtree(q, ignore_errors=True) if os.path.isdir(q) else os.unlink(q)
    say(f"FAILED: logs and records kept in {root}")


def federate(L, cfg, root, init, shapes, base, arm):
    """Start the servers and the sites, watch every round, restart the aggregator once the
    sites are done (restart_peak) -> the figures. arm: {"name", "args"} (fedmom_server.py flags)."""
    M = 4 * nparams(shapes)
    urls, procs, token, ca = start_central(L, root, cfg, init, arm["args"])
    pids = {k: real_pid(procs[k], CENTRAL[k]) for k in CENTRAL}
    state_dir, blob_dir = os.path.join(root, "central", "fedmom"), os.path.join(root, "central", "blobs")
    outer_dir = os.path.join(root, "central", "outer")
    say(f"central: fedmom {urls['fedmom']} (pid {pids['fedmom']}), darl {urls['darl']} (pid {pids['darl']}), "
        f"blob store {urls['blob']} (pid {pids['blob']}), TLS")
    said = [line for line in procs["fedmom"].output().splitlines() if "memory budget" in line]
    say("  " + (said[-1].split("fedmom: ", 1)[-1] if said else "(the aggregator said nothing of its memory budget)"))
    sampler = Sampler({"state": state_dir, "blobs": blob_dir, "run": root, "outer": outer_dir}, pids)
    sampler.thread.start()
    sites = launch_sites(L, root, cfg, urls, token, ca, pids, arm.get("pipelined", False))
    bound_s = max(300.0, 150.0 * M / 1e9)             # a round slower than this is a stall
    rounds, failures, t_last = [], [], time.monotonic()
    cpu_last, io_last = procs_cpu(pids), tree_io(pids["fedmom"])

    def central():
        try:
            st = httpc.call(urls["fedmom"], "GET", "/status", token=httpc.load_token(token), timeout=10, ca_file=ca)
            said = (f"the aggregator is at round {st['round']}, merging {st['merging']}, pending {st['pending']}, "
                    f"merge_error {st['merge_error']}")
        except (OSError, httpc.CallError, ValueError) as e:
            said = f"the aggregator does not answer GET /status ({e})"
        return said + "; its log ends:\n    " + "\n    ".join(procs["fedmom"].tail(6))
    try:
        recs = wait_records(sites, root, lambda r: all("start" in r[s] for s in SITES), bound_s, "the sites' start")
        first = recs[SITES[0]]["start"]
        starts = [recs[s]["start"] for s in SITES]
        say(f"sites joined; whole theta of round {first['round']} published to the blob store in "
            f"{max(s['publish_full']['s'] for s in starts):.2f} s, downloaded in "
            + ", ".join(f"{s['download_full']['s']:.2f} s" for s in starts))
        if len({s["digest"] for s in starts}) != 1:
            failures.append("the sites hold different thetas of round 0")
        sampler.take_peaks()                          # the rounds' peaks from here (the start's apart)
        for i in range(1, cfg.rounds + 1):
            r = first["round"] + i
            recs = wait_records(sites, root, lambda rr: all(r in rr[s] for s in SITES), bound_s, f"round {r}",
                                central)
            rec = wait_round_record(state_dir, r)
            peaks = sampler.take_peaks()
            cpu_now, io_now = procs_cpu(pids), tree_io(pids["fedmom"])
            row = {"round": r, "wall_s": time.monotonic() - t_last, "sites": {s: recs[s][r] for s in SITES},
                   "record": {k: rec.get(k) for k in ("merge_s", "timings", "bytes_read", "bytes_written",
                                                      "update_bytes", "wall_s", "time", "outcomes", "exchange")},
                   "state_bytes": dir_bytes(state_dir), "blob_bytes": dir_bytes(blob_dir),
                   "state_peak": peaks["state"], "blob_peak": peaks["blobs"], "run_peak": peaks["run"],
                   "outer_peak": peaks["outer"], "memory_peak": peaks["memory"],
                   "memory_private": peaks["private"], "memory_shared": peaks["shared"],
                   "io": {k: io_now[k] - io_last[k] for k in IO_KEYS},
                   "central_cpu": {k: cpu_now[k] - cpu_last[k] for k in pids},
                   "vm_hwm": {k: proc_status(p, "VmHWM") for k, p in pids.items()}}
            row["merge_central_cpu"] = sampler.cpu_between(rec["time"] - rec["merge_s"], rec["time"])
            row["exchange"] = exchange_row(row, sampler)
            failures += judge(row, recs, r)
            rounds.append(row)
            print_round(row, i, cfg.rounds, M)
            t_last, cpu_last, io_last = time.monotonic(), cpu_now, io_now
        for name, p in sites.items():
            if harness.wait_for(lambda: not p.alive(), bound_s) is None or p.poll() != 0:
                failures.append(f"site {name} exited {p.poll()}:\n    " + "\n    ".join(p.tail(20)))
        recs = read_records(root)
        vm_hwm = {k: proc_status(p, "VmHWM") for k, p in pids.items()}
        # after the rounds (its blob is no round's): our client's TLS rate to the blob store and back
        wire_rate = link_rate(root, urls, token, ca, shapes) if arm["name"] == "memory" else None
        restart = restart_peak(L, root, procs, sampler, ca, bound_s)
    finally:
        sampler.stop.set()
    return {"rounds": rounds, "failures": failures, "central_vm_hwm": vm_hwm, "restart": restart, "link": wire_rate,
            "site_vm_hwm": {s: recs[s].get("end", {}).get("vm_hwm") for s in SITES},
            "initial": {s: recs[s]["start"] for s in SITES},
            "checkpoints": checkpoints(os.path.join(root, "logs", "fedmom.log"))}


def link_rate(root, urls, token, ca, shapes):
    """Our client's loopback TLS rate (blob_client, as the sites' transfers), measured once in
    the run: a random file of an int4 delta's size put to the blob store and got back ->
    {"bytes", "up_s", "down_s", "up_bps", "down_bps"} (the up's sha256 of the file not timed)."""
    n = max(8 << 20, int(outer_state.payload_per_param(INT4) * nparams(shapes)))
    src, dst = os.path.join(root, "link.bin"), os.path.join(root, "link-back.bin")
    np.random.default_rng(3).integers(0, 256, n, dtype=np.uint8).tofile(src)
    tok, blob = httpc.load_token(token), f"link-{secrets.token_hex(4)}"
    up = blob_client.Upload(urls["blob"], blob, src, token=tok, ca_file=ca)
    t0 = time.perf_counter()
    up.attempt()
    t1 = time.perf_counter()
    blob_client.get_file(urls["blob"], blob, dst, token=tok, ca_file=ca)            # checked, renamed in: a site's
    t2 = time.perf_counter()
    up.close()
    for f in (src, dst):
        os.unlink(f)
    out = {"bytes": n, "up_s": t1 - t0, "down_s": t2 - t1, "up_bps": n / (t1 - t0), "down_bps": n / (t2 - t1)}
    say(f"link: blob_client over loopback TLS, {n / 1e6:.0f} MB up {out['up_s']:.2f} s ({out['up_bps'] / 1e9:.2f} "
        f"GB/s), down {out['down_s']:.2f} s ({out['down_bps'] / 1e9:.2f} GB/s)")
    return out


def exchange_row(row, sampler):
    """One round's exchange on one time line, seconds after the last delta's last byte (the
    latest of the sites' uploads' ends): accepted, the aggregator's merge start/end and
    durable (its record's "exchange" walls), each site holding theta_{r+1}; exchange_s = the
    last byte -> every site holding it; each stage's own seconds; the CPU seconds meanwhile."""
    ex = {s: e["phases"]["exchange"] for s, e in row["sites"].items()}
    last = max(ex, key=lambda s: ex[s]["landed"])
    t0, rx = ex[last]["landed"], row["record"].get("exchange") or {}

    def agg(k):
        return None if rx.get(f"{k}_s") is None else rx["landed_at"] + rx[f"{k}_s"] - t0
    held = max(x["held"] for x in ex.values())
    ph = {s: e["phases"] for s, e in row["sites"].items()}
    stages = {"accept": ph[last]["accept"]["s"], "merge": row["record"]["merge_s"]}
    for k in ("publish", "download", "apply"):
        got = [p[k]["s"] for p in ph.values() if k in p]
        if got:
            stages[k] = max(got)
    return {"last_byte": t0, "accepted_s": max(x["accepted"] for x in ex.values()) - t0,
            **{f"{k}_s": agg(k) for k in ("merge_start", "offered", "merged", "durable")},
            "held_s": {s: x["held"] - t0 for s, x in ex.items()}, "exchange_s": held - t0, "stages": stages,
            "central_cpu": sampler.cpu_between(t0, held), "site_cpu": {s: x["cpu"] for s, x in ex.items()},
            # the sites apart (each on its own node): the round durable, the publish, the slower site's own fetch
            "apart_s": (agg("durable") or 0.0) + stages.get("publish", 0.0)
            + max(p.get("download", {}).get("s", 0.0) + p.get("apply", {}).get("s", 0.0) for p in ph.values())}


def restart_peak(L, root, procs, sampler, ca, bound_s):
    """The aggregator stopped (SIGTERM) and started again on its state dir, with the same
    flags: its memory peak (private + shared, sampled) from the start until it answers, the
    checkpoint loaded and the logged rounds replayed -> {"s", "memory_peak", "private", "shared"}."""
    procs["fedmom"].stop()
    sampler.take_peaks()
    t0 = time.monotonic()
    proc = L.start("fedmom", [sys.executable, os.path.join(ROOT, CENTRAL["fedmom"]), *procs["fedmom"].args,
                              "--port", 0], os.path.join(root, "logs", "fedmom.log"))

    def find():
        try:
            return real_pid(proc, CENTRAL["fedmom"])
        except RuntimeError:                          # not exec'd yet
            return None
    sampler.agg = find
    url = harness.wait_listening(proc, bound_s)
    httpc.wait_healthy(url, 60, ca)
    peaks = sampler.take_peaks()
    out = {"s": time.monotonic() - t0, "memory_peak": peaks["memory"], "private": peaks["private"],
           "shared": peaks["shared"]}
    say(f"restart: the aggregator answers {out['s']:.1f} s after its start; memory peak {gib(out['memory_peak'])} "
        f"({gib(out['private'])} private, {gib(out['shared'])} shared)")
    proc.stop()
    return out


CHECKPOINT_RE = re.compile(r"checkpoint of round (\d+): ([0-9.]+) GiB in ([0-9.]+) s")


def checkpoints(log_path):
    """The aggregator's checkpoints as its log says them -> [{"round", "gib", "s"}] (every
    --checkpoint-rounds rounds it writes the outer state, fsync'd: central time the round
    records do not hold)."""
    try:
        with open(log_path) as f:
            return [{"round": int(m.group(1)), "gib": float(m.group(2)), "s": float(m.group(3))}
                    for m in CHECKPOINT_RE.finditer(f.read())]
    except OSError:
        return []


def wait_records(sites, root, cond, bound_s, what, central=lambda: ""):
    """The sites' records once cond(records) holds; RuntimeError with the logs (the sites',
    and central(): what the aggregator says) when a site exits first or bound_s passes."""
    deadline = time.monotonic() + bound_s
    while True:
        recs = read_records(root)
        if cond(recs):
            return recs
        done = all(not p.alive() for p in sites.values())
        for name, p in sites.items():
            # a site that finished (exit 0) leaves the others to finish theirs; read again: it may just have
            if not p.alive() and (p.poll() != 0 or done) and not cond(read_records(root)):
                raise RuntimeError(f"waiting for {what}: site {name} exited {p.poll()}:\n    "
                                   + "\n    ".join(p.tail(25)))
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not complete within {bound_s:.0f} s; {central()}; site logs:\n"
                               + "\n".join(f"  {n}: " + "\n    ".join(p.tail(8)) for n, p in sites.items()))
        time.sleep(0.2)


def wait_round_record(state_dir, r, bound_s=60.0):
    """Round r's record in the aggregator's rounds.jsonl (appended just after the round is durable)."""
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        for rec in durable.read_jsonl(os.path.join(state_dir, "rounds.jsonl")):
            if rec.get("round") == r:
                return rec
        time.sleep(0.1)
    raise RuntimeError(f"no record of round {r} in {state_dir}/rounds.jsonl")


def judge(row, recs, r):
    """The checks of one round: both deltas merged into it; each site holds a theta of round
    r; the update path's digest was checked by apply_update (a site that had to take the
    whole theta while holding round r-1 is a finding: its theta was not the aggregator's),
    and every site's digest is the same."""
    out = []
    merged = [o for o in row["record"]["outcomes"] or () if o.get("outcome") == "merged"]
    if len(merged) != len(SITES):
        out.append(f"round {r} merged {len(merged)} deltas, not {len(SITES)}")
    for s in SITES:
        e = recs[s][r]
        if e["via"] not in ("update", "followed"):
            out.append(f"round {r}: {s} held round {e['base']}'s theta and got no update (409 no_update): its "
                       "theta is not the one the aggregator's update applies to")
    digests = {recs[s][r]["digest"] for s in SITES}
    if len(digests) != 1:
        out.append(f"round {r}: the sites hold different thetas (digests {sorted(d[:12] for d in digests)})")
    return out


def gib(n):
    return "?" if n is None else f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def print_round(row, i, n, M):
    rec = row["record"]
    pubs = {s: e["phases"]["publish"]["s"] for s, e in row["sites"].items() if "publish" in e["phases"]}
    by = max(pubs, key=pubs.get) if pubs else None
    say(f"round {row['round']} ({i}/{n}): {row['wall_s']:.1f} s; merge {rec['merge_s']:.2f} s"
        + (f", timings {rec['timings']}" if rec.get("timings") else " (the record has no timings)")
        + (f"; publish {pubs[by]:.2f} s ({by}'s call)" if by else "")
        + f"; state dir {row['state_bytes'] / M:.2f} M after, peak {row['state_peak'] / M:.2f} M; blob store "
        f"{row['blob_bytes'] / M:.2f} M (peak {row['blob_peak'] / M:.2f} M)")
    say("    central CPU s " + ", ".join(f"{k} {v:.1f}" for k, v in row["central_cpu"].items())
        + "; VmHWM " + ", ".join(f"{k} {gib(v)}" for k, v in row["vm_hwm"].items()))
    io = row["io"]
    say(f"    aggregator + workers: memory peak {gib(row['memory_peak'])} ({gib(row['memory_private'])} private, "
        f"{gib(row['memory_shared'])} shared); read {io['rchar'] / 1e9:.2f} GB, wrote {io['wchar'] / 1e9:.2f} GB "
        f"(of it the disk read {io['read_bytes'] / 1e9:.2f} GB, was sent {io['write_bytes'] / 1e9:.2f} GB); "
        f"--outer-dir peak {row['outer_peak'] / M:.2f} M")
    for s, e in row["sites"].items():
        ph = e["phases"]
        bits = [f"{k} {ph[k]['s']:.2f} s" + (f" ({ph[k]['bytes'] / 1e9 / ph[k]['s']:.2f} GB/s)"
                                              if ph[k]["bytes"] and ph[k]["s"] > 0 else "")
                for k in ("encode", "upload", "accept", "download", "apply") if k in ph]
        bits[0] += f" (error feedback {ph['encode']['feedback_s']:.2f} s)"
        say(f"    {s:<5} " + ", ".join(bits) + f"; wait {ph['wait']['s']:.2f} s; theta via {e['via']}, digest "
            f"{e['digest'][:12]} ok")


# ---------------------------------------------------------------- the summary

def phase_rows(rounds):
    """{phase: [{"s", "bytes", "central_cpu"}, ...]} over the rounds: the sites' phases per
    site and round; publish per round (the slower site's call: the one that made the copy);
    merge per round from the record."""
    out = collections.defaultdict(list)
    for row in rounds:
        for s, e in row["sites"].items():
            for k in ("encode", "upload", "accept", "download", "apply"):
                if k in e["phases"]:
                    out[k].append(e["phases"][k])
            enc = e["phases"]["encode"]
            out["encode: feedback"].append({"s": enc["feedback_s"], "bytes": 2 * enc["bytes"], "central_cpu": None})
        pubs = [e["phases"]["publish"] for e in row["sites"].values() if "publish" in e["phases"]]
        if pubs:
            out["publish"].append(max(pubs, key=lambda p: p["s"]))
        rec = row["record"]
        out["merge"].append({"s": rec["merge_s"], "bytes": (rec.get("bytes_read") or 0) + (rec.get("bytes_written") or 0),
                             "written": rec.get("bytes_written") or 0, "central_cpu": row["merge_central_cpu"]})
        for k, v in (rec.get("timings") or {}).items():
            if isinstance(v, (int, float)):
                out[f"agg:{k}"].append({"s": v, "bytes": 0, "central_cpu": None})
    return out


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def central_per_round(row):
    """Central seconds of one round: with the record's timings, their sum (plus the site-measured
    publish when they have no publish_s); else both acceptances + merge_s + the publish."""
    pub = max((e["phases"]["publish"]["s"] for e in row["sites"].values() if "publish" in e["phases"]), default=0.0)
    t = row["record"].get("timings") or {}
    if t:
        return sum(v for v in t.values() if isinstance(v, (int, float))) + (0.0 if "publish_s" in t else pub)
    return sum(e["phases"]["accept"]["s"] for e in row["sites"].values()) + row["record"]["merge_s"] + pub


def summary(out, base, shapes, P, M):
    """The closing table and judgement of one arm -> True when every check passed."""
    rounds = out["rounds"]
    lim = {k: statistics.mean(b[k] for b in base) for k in ("write", "read", "memcpy", "sha256")}   # s for M bytes
    rows = phase_rows(rounds)
    say("")
    say(f"summary: {len(rounds)} rounds, {P:,} parameters, M = {M / 1e9:.3f} GB; I/O limits of M (mean of start "
        f"and end): write+fsync {lim['write']:.2f} s, read {lim['read']:.2f} s, memcpy {lim['memcpy']:.2f} s, "
        f"sha256 (the theta digest, one core) {lim['sha256']:.2f} s")
    say(f"{'phase':<18} {'where':<9} {'median s':>9} {'GB':>7} {'GB/s':>7} {'x write':>8} {'x read':>7} "
        f"{'x memcpy':>8} {'central CPU/wall':>17}")
    table = {}
    for k in ["encode", "encode: feedback"] + list(PHASES[1:]) + sorted(k for k in rows if k.startswith("agg:")):
        if k not in rows:
            continue
        s, nb = med(p["s"] for p in rows[k]), med(p["bytes"] for p in rows[k])
        cpu = med(p.get("central_cpu") for p in rows[k])
        # what the central VM writes in the phase, fsync'd: the merge's files, the spooled delta, the
        # blob store's copy of the update (the projection's floor)
        written = med(p.get("written", p["bytes"]) for p in rows[k]) if WHERE.get(k) == "central" else None
        table[k] = {"s": s, "bytes": nb, "central_cpu": cpu, "written": written}

        def cell(x, width, fmt):
            return f"{x:{width}{fmt}}" if x is not None else f"{'-':>{width}}"
        same = {key: s / (lim[key] * nb / M) if nb and s else None for key in ("write", "read", "memcpy")}
        say(f"{k:<18} {WHERE.get(k.split(':')[0], 'central'):<9} {s:9.3f} {cell(nb / 1e9 if nb else None, 7, '.3f')} "
            f"{cell(nb / 1e9 / s if nb and s else None, 7, '.2f')} {cell(same['write'], 8, '.2f')} "
            f"{cell(same['read'], 7, '.2f')} {cell(same['memcpy'], 8, '.2f')} "
            f"{cell(cpu / s if cpu is not None and s else None, 17, '.2f')}")
    central = med(central_per_round(r) for r in rounds)
    ckpts = [c for c in out.get("checkpoints", []) if c["round"] > 0]
    ckpt_s = med(c["s"] for c in ckpts) or 0.0
    every = fedmom_state.CHECKPOINT_ROUNDS             # the aggregator runs with the default
    site = med(e["phases"]["encode"]["s"] + e["phases"]["apply"]["s"] for r in rounds for e in r["sites"].values()
               if "apply" in e["phases"])
    peak = max(r["state_peak"] for r in rounds) / M
    timed = any(r["record"].get("timings") for r in rounds)
    say(f"central s/round ({'the record timings' if timed else 'both acceptances + merge + publish'}): "
        f"{central:.2f} s = {central / lim['write']:.2f} x the fsync'd F32 write of M (target <= 1.0: "
        f"{'met' if central <= lim['write'] else 'NOT met'})")
    if ckpts:
        say(f"checkpoints (every {every} rounds, not in the round records): {len(ckpts)}, median {ckpt_s:.2f} s for "
            f"{med(c['gib'] for c in ckpts):.2f} GiB = {ckpt_s / lim['write']:.2f} x the write of M, written after "
            f"their round is published, beside the sites' next phase; as if in the rounds, central s/round "
            f"{central + ckpt_s / every:.2f} = {(central + ckpt_s / every) / lim['write']:.2f} x the write")
    say(f"site encode + apply: {site:.2f} s = {site / lim['write']:.2f} x the write (target <= 0.5: "
        f"{'met' if site <= 0.5 * lim['write'] else 'NOT met'})")
    say(f"state-dir peak: {peak:.2f} M (target <= 3: {'met' if peak <= 3 else 'NOT met'}); after the last round "
        f"{rounds[-1]['state_bytes'] / M:.2f} M; blob store peak {max(r['blob_peak'] for r in rounds) / M:.2f} M; "
        f"the whole run (sites, central) peak {max(r['run_peak'] for r in rounds) / M:.2f} M")
    say("peak RSS (VmHWM): " + ", ".join(f"{k} {gib(v)}" for k, v in out["central_vm_hwm"].items())
        + "; sites " + ", ".join(f"{k} {gib(v)}" for k, v in out["site_vm_hwm"].items()))
    mem = max(rounds, key=lambda r: r["memory_peak"])
    io = {k: med(r["io"][k] for r in rounds) for k in IO_KEYS}
    say(f"aggregator + merge workers, sampled every {SAMPLE_S * 1000:.0f} ms: memory peak over the rounds "
        f"{gib(mem['memory_peak'])} ({gib(mem['memory_private'])} private, {gib(mem['memory_shared'])} shared); "
        f"a restart's peak {gib(out['restart']['memory_peak'])} ({out['restart']['s']:.1f} s to its first answer); "
        f"per round (median) read {io['rchar'] / 1e9:.2f} GB and wrote {io['wchar'] / 1e9:.2f} GB, the disk "
        f"{io['read_bytes'] / 1e9:.2f} GB and {io['write_bytes'] / 1e9:.2f} GB of it; --outer-dir peak "
        f"{max(r['outer_peak'] for r in rounds) / M:.2f} M")
    out["summary"] = {"memory_peak": mem["memory_peak"], "memory_private": mem["memory_private"],
                      "memory_shared": mem["memory_shared"], "io_per_round": io,
                      "merge_s": med(r["record"]["merge_s"] for r in rounds),
                      "merge_central_cpu": med(r["merge_central_cpu"] for r in rounds),
                      "outer_peak": max(r["outer_peak"] for r in rounds)}
    out["summary"].update({"limits": lim, "phases": table, "central_s_per_round": central, "site_encode_apply_s": site,
                      "checkpoint_s": ckpt_s, "central_s_per_round_with_checkpoints": central + ckpt_s / every,
                      "state_peak_models": peak, "central_over_write": central / lim["write"],
                      "site_over_write": site / lim["write"]})
    out["projection"] = project(table, lim, P, central, site, ckpt_s / every)
    for f in out["failures"]:
        say(f"!! {f}")
    say(f"checks: {len(rounds)} rounds complete, every delta merged, every theta's digest checked: "
        + ("all passed" if not out["failures"] else f"{len(out['failures'])} FAILED"))
    return not out["failures"]


def project(table, lim, P, central, site, ckpt_per_round=0.0):
    """Qwen3-8B and -32B, linear in parameters (k = their parameters / ours). A central phase:
    k x (its central CPU seconds / VM_CORES + the rest of its wall time), i.e. its per-core
    work spread over a 16-core VM and what was not on a CPU (disk, network: bytes) at the
    speed measured, but never less than k x the bytes it writes at the fsync'd write rate
    measured here (CPU seconds include the kernel's copies of those writes, which 16 cores
    do not divide), and the merge never less than k x the theta digest's one-core sha256
    measured here (it runs behind the merge but is one stream); the sites' phases and the
    transfers: k x their time here."""
    targets = {"8B": sum(math.prod(s) for _, s in qwen3_shapes("8B")), "32B": qwen3_params(QWEN3_32B)}
    ks = {n: p / P for n, p in targets.items()}
    write_bps = 4 * P / lim["write"]
    say("")
    say(f"projection, linear in parameters: 8B = {targets['8B'] / 1e9:.2f}G params (k = {ks['8B']:.1f}), 32B = "
        f"{targets['32B'] / 1e9:.2f}G (k = {ks['32B']:.1f}). A central phase = k x max(CPU s / {VM_CORES} cores + "
        f"(wall - CPU) s, the bytes it writes / the fsync'd write's {write_bps / 1e9:.2f} GB/s; the merge: also "
        f"k x the one-core sha256 of M, {lim['sha256']:.2f} s); a site phase or a "
        "transfer = k x its time here (a site's node and the WAN are not this machine)")
    say(f"{'phase':<10} {'here s':>8} {'CPU s':>7} {'writes GB':>9} {'bound by':<10} "
        + " ".join(f"{n + ' s':>9}" for n in ks))
    out = {}
    per_round = {n: 0.0 for n in ks}
    for k in PHASES:
        if k not in table:
            continue
        s, cpu, written = table[k]["s"], table[k]["central_cpu"] or 0.0, table[k]["written"]
        if WHERE[k] == "central":
            per_core, rest, floor = cpu / VM_CORES, max(0.0, s - cpu), (written or 0) / write_bps
            bound = "write" if floor > per_core + rest else "CPU" if per_core >= rest else "bytes"
            if k == "merge" and lim["sha256"] > max(per_core + rest, floor):
                floor, bound = lim["sha256"], "sha256"     # the theta digest: serial, whatever the cores
            proj = {n: kk * max(per_core + rest, floor) for n, kk in ks.items()}
            for n in ks:
                per_round[n] += proj[n] * (len(SITES) if k == "accept" else 1)
        else:
            bound, proj = ("site CPU" if WHERE[k] == "site" else "bytes"), {n: kk * s for n, kk in ks.items()}
        out[k] = {"bound": bound, **proj}
        say(f"{k:<10} {s:8.2f} " + (f"{cpu:7.2f} {(written or 0) / 1e9:9.3f}" if WHERE[k] == "central"
                                    else f"{'-':>7} {'-':>9}") + f" {bound:<10} "
            + " ".join(f"{proj[n]:9.1f}" for n in ks))
    if ckpt_per_round:
        say(f"{'checkpoint':<10} {ckpt_per_round:8.2f} {'-':>7} {'-':>9} {'write':<10} "
            + " ".join(f"{kk * ckpt_per_round:9.1f}" for kk in ks.values()) + "   (per round: every "
            f"{fedmom_state.CHECKPOINT_ROUNDS} rounds, 3 M fsync'd: k x its time here)")
    c, rare = fedmom_state.CHECKPOINT_ROUNDS, 4 * fedmom_state.CHECKPOINT_ROUNDS
    for n, kk in ks.items():
        w = kk * lim["write"]
        say(f"{n}: central s/round {per_round[n]:.1f} on the round's path (2 x accept + merge + publish) vs the F32 "
            f"write {w:.1f} s (k x {lim['write']:.2f}, bytes-bound): {per_round[n] / w:.2f} x; site encode + apply "
            f"{kk * site:.1f} s = {site / lim['write']:.2f} x (linear: the same ratio); this machine, all linear: "
            f"central {kk * central:.1f} s")
        out[n] = {"k": kk, "central_s_per_round": per_round[n], "write_s": w, "site_encode_apply_s": kk * site}
        if ckpt_per_round:
            one = kk * ckpt_per_round * c
            say(f"{n}: the checkpoint, {one:.0f} s every {c} rounds, is written after its round is published, "
                f"beside the sites' next phase (it delays a round only if that phase is shorter); as disk time "
                f"{one / c:.1f} s a round, {one / rare:.1f} with --checkpoint-rounds {rare} (a restart then "
                f"replays up to {rare} rounds: ~{rare * out['merge'][n] / 60 if 'merge' in out else 0:.1f} min)")
            out[n].update(checkpoint_s=one, checkpoint_s_per_round=one / c)
    return out


# ---------------------------------------------------------------- the exchange: serial against pipelined

def exchanges(out, lim):
    """Per round, the memory arm (today's serial path, each stage alone) against the pipelined
    arm (the delta checked as it arrives, the update followed as it is merged, the sites
    concurrent): the time line after the last delta's last byte, exchange_s, its ratio to
    the slowest single stage (the serial arm's, each alone) and the central part (last byte
    -> durable, + the publish when serial) against the floor of the same run (one fsync'd
    write and one read of the outer state's 12 B/param, and a delta and an update at the
    link's measured rates). Both arms start from the same init and send the same deltas:
    every round's theta digest must be the same in both (else a failure: exit 1).
    -> (ok, {"rounds", "floor", "median"})."""
    ser, pipe = out["arms"]["memory"], out["arms"]["pipelined"]
    link = ser["link"]
    M = out["model_bytes"]
    failures, rows = [], []
    for a, b in zip(ser["rounds"], pipe["rounds"]):
        da, db = ({e["digest"] for e in r["sites"].values()} for r in (a, b))
        if da != db:
            failures.append(f"round {a['round']}: the serial arm's sites hold {sorted(d[:12] for d in da)}, the "
                            f"pipelined arm's {sorted(d[:12] for d in db)}: not bit-exact")
        delta = max(e["delta_bytes"] for e in a["sites"].values())
        upd = a["record"]["update_bytes"] or 0
        state_s = 3 * (lim["write"] + lim["read"])               # 12 B/param = 3 M: written fsync'd, read
        floor = state_s + delta / link["up_bps"] + upd / link["down_bps"]
        slow = max(a["exchange"]["stages"], key=a["exchange"]["stages"].get)
        rows.append({"round": a["round"], "serial": a["exchange"], "pipelined": b["exchange"], "floor_s": floor,
                     "floor": {"state_s": state_s, "delta_bytes": delta, "update_bytes": upd},
                     "slowest": slow, "slowest_s": a["exchange"]["stages"][slow],
                     "digests_equal": da == db, "digest": sorted(db)[0]})
    if len(ser["rounds"]) != len(pipe["rounds"]):
        failures.append(f"the serial arm completed {len(ser['rounds'])} rounds, the pipelined {len(pipe['rounds'])}")
    say("\n=== the exchange, serial (the memory arm: each stage alone, the sites take turns) against pipelined "
        "(checked as it arrives, the update followed as it is merged, the sites at once)")
    say(f"floor of a round's bytes here: the outer state's 12 B/param = 3 M written fsync'd + read, 3 x "
        f"({lim['write']:.2f} + {lim['read']:.2f}) s, + a delta at the link's {link['up_bps'] / 1e9:.2f} GB/s up "
        f"+ the update at {link['down_bps'] / 1e9:.2f} GB/s down (blob_client over loopback TLS)")
    say("seconds after the last delta's last byte; 'alone' = the slowest single stage (the serial arm's, each alone)")
    say(f"{'round':>5} {'arm':<9} {'accepted':>8} {'merge':>13} {'durable':>7} {'sites hold':>15} {'exchange':>8} "
        f"{'/alone':>6} {'central':>7} {'/floor':>6} {'CPU c+s':>9}")
    for r in rows:
        for arm in ("serial", "pipelined"):
            x = r[arm]
            fmt = lambda v: "-" if v is None else f"{v:.2f}"
            central = (x["durable_s"] or 0.0) + (x["stages"].get("publish", 0.0) if arm == "serial" else 0.0)
            x["central_s"] = central
            say(f"{r['round']:>5} {arm:<9} {x['accepted_s']:8.2f} {fmt(x['merge_start_s']):>6}-{fmt(x['merged_s']):<6} "
                f"{fmt(x['durable_s']):>7} {'/'.join(f'{v:.2f}' for v in x['held_s'].values()):>15} "
                f"{x['exchange_s']:8.2f} {x['exchange_s'] / r['slowest_s']:6.2f} {central:7.2f} "
                f"{central / r['floor_s']:6.2f} {x['central_cpu']:4.1f}+{sum(x['site_cpu'].values()):<4.1f}")
        st = r["serial"]["stages"]
        say(f"{'':>5} stages alone: " + ", ".join(f"{k} {v:.2f}" for k, v in st.items())
            + f" (slowest: {r['slowest']}); serial with the sites apart (durable + publish + the slower site's "
            f"download + apply) {r['serial']['apart_s']:.2f} s; floor {r['floor_s']:.2f} s; pipelined spans: "
            + ", ".join(f"{k} {v:.2f}" for k, v in r["pipelined"]["stages"].items()))
    md = lambda f: med(f(r) for r in rows)
    m = {"serial_s": md(lambda r: r["serial"]["exchange_s"]), "serial_apart_s": md(lambda r: r["serial"]["apart_s"]),
         "pipelined_s": md(lambda r: r["pipelined"]["exchange_s"]), "slowest_s": md(lambda r: r["slowest_s"]),
         "floor_s": md(lambda r: r["floor_s"]), "central_serial_s": md(lambda r: r["serial"]["central_s"]),
         "central_pipelined_s": md(lambda r: r["pipelined"]["central_s"]),
         "cpu_pipelined": md(lambda r: r["pipelined"]["central_cpu"] + sum(r["pipelined"]["site_cpu"].values())),
         # what the pipeline adds to its overlapped middle: before the merge starts (the last delta's
         # acceptance) and after the round is durable (the last tensors added, theta renamed in)
         "tail_s": md(lambda r: (r["pipelined"]["merge_start_s"] or 0.0) + r["pipelined"]["exchange_s"]
                      - (r["pipelined"]["durable_s"] or r["pipelined"]["exchange_s"]))}
    if rows:
        ratio, cr = m["pipelined_s"] / m["slowest_s"], m["central_pipelined_s"] / m["floor_s"]
        say(f"median: exchange serial {m['serial_s']:.2f} s ({m['serial_s'] / m['slowest_s']:.2f} x alone; sites "
            f"apart {m['serial_apart_s']:.2f} s), pipelined {m['pipelined_s']:.2f} s = {ratio:.2f} x the slowest "
            f"stage alone {m['slowest_s']:.2f} s (target <= 1.3: {'met' if ratio <= 1.3 else 'NOT met'}); central "
            f"part pipelined {m['central_pipelined_s']:.2f} s = {cr:.2f} x the floor {m['floor_s']:.2f} s (target "
            f"<= 2: {'met' if cr <= 2 else 'NOT met'}), serial {m['central_serial_s']:.2f} s")
        own = m["slowest_s"] + m["tail_s"]
        say(f"the pipelined arm's sites share this machine's {out['cores']} cores with the aggregator (CPU s in the "
            f"exchange, central + sites: {m['cpu_pipelined']:.1f}, median; its merge's wall stretches with them): "
            f"on their own nodes, the slowest stage alone + the tail (before the merge + after durable, "
            f"{m['tail_s']:.2f} s) = {own:.2f} s = {own / m['slowest_s']:.2f} x")
    for f in failures:
        say(f"!! {f}")
    say("bit-exact: every round's theta the same in both arms: " + ("yes" if not failures else "NO"))
    return not failures, {"rounds": rows, "median": m, "link": link, "failures": failures}


# ---------------------------------------------------------------- the arms side by side

NVME = outer_state.NVME          # the disk of the projected VM (assumed: a local NVMe; plan --disk-gbs)


def compare(out, arms, shapes, cfg, base):
    """The arms side by side against the targets (the budget arm's central round <= 3 x the
    memory arm's; its memory peak <= --memory-gb + 4 x the largest F32 tensor; a restart's
    peak <= the rounds' peak), each mode projected to 8B and 32B, and the rates
    `fedmom_server.py plan --rates FILE` reads (out["rates"])."""
    P, M = out["parameters"], out["model_bytes"]
    largest = 4 * max(math.prod(s) for _, s in shapes)
    lim = {k: statistics.mean(b[k] for b in base) for k in ("write", "read", "memcpy", "sha256")}
    say("\n=== the arms side by side (aggregator + merge workers; memory sampled, private + shared)")
    say(f"{'arm':<8} {'--memory-gb':>11} {'in memory':>10} {'on disk':>9} {'central s':>9} {'merge s':>8} "
        f"{'merge CPU':>9} {'peak':>10} {'restart':>10} {'disk I/O GB/round':>18}")
    rows = {}
    for arm in arms:
        a = out["arms"][arm["name"]]
        sm = a["summary"]
        b = fixed_budget(cfg, shapes, arm["memory_gb"] * outer_state.GB if arm["memory_gb"] else 0)
        mem, disk = b.split() if arm["memory_gb"] else (b.state_bytes(), 0)
        rows[arm["name"]] = {"budget": arm["memory_gb"], "in_memory": mem, "on_disk": disk, **sm,
                             "restart_peak": a["restart"]["memory_peak"], "fixed": b.minimum()}
        io = sm["io_per_round"]
        say(f"{arm['name']:<8} {arm['memory_gb'] or 0:11.3f} {gib(mem):>10} {gib(disk):>9} "
            f"{sm['central_s_per_round']:9.2f} {sm['merge_s']:8.2f} {sm['merge_central_cpu'] or 0:9.1f} "
            f"{gib(sm['memory_peak']):>10} {gib(a['restart']['memory_peak']):>10} "
            f"{io['read_bytes'] / 1e9:8.2f}r {io['write_bytes'] / 1e9:7.2f}w")
    judged = []
    for name, r in rows.items():
        ok = r["restart_peak"] <= r["memory_peak"]
        judged.append(f"{name}: a restart's peak {gib(r['restart_peak'])} <= the rounds' {gib(r['memory_peak'])} "
                      f"(no 16 B/param at a start): {'met' if ok else 'NOT met'}")
    if "budget" in rows:
        m, b = rows["memory"], rows["budget"]
        ratio = b["central_s_per_round"] / m["central_s_per_round"]
        judged.append(f"the budget arm's central round {b['central_s_per_round']:.2f} s = {ratio:.2f} x the memory "
                      f"arm's {m['central_s_per_round']:.2f} s (target <= 3: {'met' if ratio <= 3 else 'NOT met'}); "
                      f"merge {b['merge_s']:.2f} s vs {m['merge_s']:.2f} s")
        cap = b["budget"] * outer_state.GB + 4 * largest
        judged.append(f"the budget arm's peak {gib(b['memory_peak'])} vs --memory-gb {b['budget']:.3f} GB + 4 x the "
                      f"largest F32 tensor ({largest / 1e9:.2f} GB) = {cap / 1e9:.2f} GB: "
                      f"{'met' if b['memory_peak'] <= cap else 'NOT met'}; without its outer state in memory "
                      f"({b['in_memory'] / 1e9:.2f} GB) the measured rest is "
                      f"{(b['memory_peak'] - b['in_memory']) / 1e9:.2f} GB, the budget's fixed part {b['fixed'] / 1e9:.2f} GB")
    for line in judged:
        say(line)
    out["compare"] = rows
    out["rates"] = rates(out, rows, lim, P, M)
    project_modes(rows, out["rates"], P, M, lim)


def rates(out, rows, lim, P, M):
    """The rates `plan` projects from (outer_state.RATES' keys): the merge's CPU seconds per
    parameter in memory and on disk, the acceptance and publish projected to VM_CORES cores
    per parameter, the one-core sha256 per byte, the checkpoint's write rate."""
    mem = out["arms"]["memory"]
    k8 = mem["projection"]["8B"]["k"]
    cpu_mem = (rows["memory"]["merge_central_cpu"] or 0) / P
    cpu_disk = cpu_mem
    if "budget" in rows and rows["budget"]["on_disk"]:
        b = rows["budget"]
        f_disk = b["on_disk"] / (b["on_disk"] + b["in_memory"])
        cpu_disk = max(cpu_mem, ((b["merge_central_cpu"] or 0) / P - cpu_mem * (1 - f_disk)) / f_disk)
    ck = [c for c in mem.get("checkpoints", []) if c["round"] > 0]
    ck_bps = med(c["gib"] * 2**30 / c["s"] for c in ck) if ck else outer_state.RATES["checkpoint_write_bps"]
    got = {"source": f"bench/scale_round.py --flavor {out['config']['flavor']} ({out['cores']} cores)",
           "merge_cpu_s_per_param": cpu_mem, "merge_disk_cpu_s_per_param": cpu_disk,
           "accept_s_per_param": mem["projection"]["accept"]["8B"] / (k8 * P),
           "publish_s_per_param": mem["projection"]["publish"]["8B"] / (k8 * P),
           "sha256_s_per_byte": lim["sha256"] / M, "checkpoint_write_bps": ck_bps}
    ex = out.get("exchange")
    if ex and ex["rounds"]:
        # the exchange (plan's serial and pipelined figures): the link's rate down, a site's apply per
        # parameter (alone), and what the pipeline adds to its slowest stage per value of the largest tensor
        # (its last tensor is merged, sent and added after the others: the tail scales with it)
        got.update(link_bps=ex["link"]["down_bps"], apply_s_per_param=mem["summary"]["phases"]["apply"]["s"] / P,
                   tail_s_per_largest=ex["median"]["tail_s"] / out["largest_params"])
    return got


def project_modes(rows, r, P, M, lim):
    """Each arm's mode at 8B and 32B on a VM_CORES-core VM with an NVMe disk: a round's
    central seconds = 2 x accept + merge + publish at the rates measured, the merge no less
    than the disk's reads and writes of the part on disk (the arm's fraction of the outer
    state: read and written once a round) nor the one-core sha256; and the memory with
    nothing in memory at 32B (outer_state.Budget's fixed part) against the original design's
    ~10 GiB."""
    targets = {"8B": sum(math.prod(s) for _, s in qwen3_shapes("8B")), "32B": qwen3_params(QWEN3_32B)}
    say(f"\nprojection per mode ({VM_CORES} cores, NVMe read {NVME['read_bps'] / 1e9:.1f} GB/s, write "
        f"{NVME['write_bps'] / 1e9:.1f} GB/s; rates: merge CPU {r['merge_cpu_s_per_param'] * 1e9:.1f} ns/param in "
        f"memory, {r['merge_disk_cpu_s_per_param'] * 1e9:.1f} on disk; accept {r['accept_s_per_param'] * 1e9:.2f}, "
        f"publish {r['publish_s_per_param'] * 1e9:.2f} ns/param on {VM_CORES} cores; sha256 "
        f"{r['sha256_s_per_byte'] * 1e9:.2f} s/GB)")
    for name, row in rows.items():
        f_disk = row["on_disk"] / (row["on_disk"] + row["in_memory"])
        for n, Pn in targets.items():
            disk = 12 * Pn * f_disk
            cpu = Pn * (r["merge_cpu_s_per_param"] * (1 - f_disk) + r["merge_disk_cpu_s_per_param"] * f_disk) / VM_CORES
            io = disk / NVME["read_bps"] + disk / NVME["write_bps"]
            sha = r["sha256_s_per_byte"] * 4 * Pn
            merge = max(cpu, io, sha)
            acc, pub = r["accept_s_per_param"] * Pn, r["publish_s_per_param"] * Pn
            say(f"  {name} ({1 - f_disk:.0%} of the outer state in memory) at {n}: merge max(CPU {cpu:.1f} s, disk "
                f"{disk / 1e9:.0f} GB read + written {io:.1f} s, sha256 {sha:.1f} s) = {merge:.1f} s; central "
                f"2 x {acc:.1f} + {merge:.1f} + {pub:.1f} = {2 * acc + merge + pub:.1f} s a round")
    b32 = outer_state.Budget(0, outer_state.shapes_of(qwen3_params(QWEN3_32B)), ("theta", "momentum", "residual"),
                              INT4, VM_CORES)
    say(f"  nothing in memory at 32B: the budget's fixed part {b32.minimum() / 2**30:.2f} GiB "
        f"({outer_state.describe_fixed(b32)}), against the original design's ~10 GiB merge peak: "
        f"{'met' if b32.minimum() <= 10 * 2**30 else 'NOT met'}")


# ---------------------------------------------------------------- command line

def site_parser():
    p = argparse.ArgumentParser(prog="scale_round.py --site", description="one fake site (started by the bench)")
    for flag in ("--name", "--flavor", "--darl", "--fedmom", "--blob", "--token-file", "--ca-file", "--records",
                 "--work", "--baton", "--central-pids"):
        p.add_argument(flag, required=True)
    p.add_argument("--rounds", type=int, required=True)
    p.add_argument("--sites", type=int, required=True)
    p.add_argument("--pipelined", action="store_true", help="check while it arrives, follow the update as it is "
                                                            "merged, no turns for the download and apply")
    return p


def main(argv):
    if argv[:1] == ["--site"]:
        return site_main(site_parser().parse_args(argv[1:]))
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="\n\n".join(__doc__.split("\n\n")[1:]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flavor", choices=FLAVOR_CHOICES, default=None,
                   help="the model: tiny (~0.15M params), small (~24M), 0.6B (~709M), 1.7B (~2.0G) "
                        "(default 0.6B; small with --quick)")
    p.add_argument("--rounds", type=int, default=None,
                   help="federated rounds, each one delta per site (default 10 for 0.6B and 1.7B, 3 otherwise)")
    p.add_argument("--quick", action="store_true", help="the setting make bench runs: --flavor small --rounds 3 "
                                                        "(< 2 min); --flavor and --rounds still override it")
    p.add_argument("--dir", default=tempfile.gettempdir(),
                   help="where the run's directory goes (default $TMPDIR); 0.6B needs 45 GB free, 1.7B 125 GB")
    p.add_argument("--keep", action="store_true", help="keep the run's directory (default: removed at the end)")
    p.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                   help="one more argument for fedmom_server.py, repeatable; write it with '=': "
                        "--server-arg=--threads=2")
    p.add_argument("--json", metavar="PATH", help="write every figure (per round, per site, summary, projection) here")
    p.add_argument("--memory-gb", default="quarter",
                   help="the budget arm's fedmom_server.py --memory-gb, run after the memory arm (the default "
                        "budget: the outer state in memory) on fresh central processes: GB, 'quarter' (a quarter of "
                        "the outer state, or the fixed part plus a quarter when that is more) or 'off' (the memory arm "
                        "alone); default quarter")
    a = p.parse_args(argv)
    flavor = a.flavor or ("small" if a.quick else "0.6B")
    rounds = a.rounds if a.rounds is not None else (10 if flavor in REAL else 3)
    cfg = Config(flavor, rounds, a.dir, a.keep, a.server_arg, a.json, a.memory_gb).validate()

    def on_term(signum, frame):
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, on_term)
    try:
        return run(cfg)
    except RuntimeError as e:
        say(f"scale_round FAILED: {e}")
        return 1
    except KeyboardInterrupt:
        say("scale_round: interrupted (every process it started is stopped)")
        return 130


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
