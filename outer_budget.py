"""outer_budget.py - the aggregator's memory held to a budget: which tensors of its outer state
live in memory and which on disk, the checks at its start, and the plan of a run.

Runs on: the central VM, imported by fedmom_outer.py (the running aggregator) and
fedmom_server.py (`plan`, and the offline `export` / `checkpoint`); standard library + numpy +
merge_pool.py + outer_state.py; never torch, no port, no state of its own. Tested in
tests/test_outer_budget.py.

    python fedmom_server.py --state-dir DIR --memory-gb 48 [--outer-dir /nvme/outer]   # a run
    python fedmom_server.py plan --params 8e9 --sites 2 --down-wire int4 [--memory-gb 48]

What the aggregator holds, all of it inside fedmom_server.py --memory-gb G (Budget.fixed):
    processes    the aggregator itself (AGG_BASE) and each merge worker (WORKER_BASE)
    a round      the update's two scratch slots in shared memory (int4: 2 x 0.53 B/param of the
                 largest tensor), and the deltas' parts read at once, at most DELTA_RESERVE
                 x the largest tensor's fp32 bytes (a round with more deltas than that holds
                 runs each tensor in waves: outer_state.apply_round's delta_bytes)
    a check      one delta checked at a time, a block format 16M values at a time (CHECK_BYTES;
                 a topk delta or --down-wire is decoded a whole tensor at a time: TOPK_TENSORS)
    the state    theta, momentum and the --down-wire residual, 4 B/param each: what is left of
                 G holds them in memory, theta first, then the momentum, then the residual,
                 tensor by tensor in file order; the others live in file blocks in --outer-dir
                 (merge_pool.FileBlock), read and written a piece at a time by the same merge
                 workers (outer_state._Tensor), so the bits are the same whatever G.
The file blocks are scratch, never a checkpoint: a start sweeps what a dead aggregator left
there, and loads the checkpoint straight into the blocks (memory or disk: no private copy
first). The default G is the machine's: 3/4 of its memory (or of its cgroup's limit), no more
than 9/10 of what is available, and with merge workers no more than shared memory can hold
(default_memory); the start says which it took, and refuses in one line naming the flag to
change when RAM, shared memory or the disk cannot hold what G asks (check_machine).
FEDERATION_GUIDE.md section 9 has the sizing and the design beyond one VM; RUNBOOK.md
section 1 the table `plan` printed.
"""
import dataclasses
import json
import math
import os

import merge_pool
import outer_state

GB = 10**9
OUTER_DIR = "outer"           # --outer-dir's default, in the state dir
AGG_BASE = 256 << 20          # the aggregator's own memory at rest: Python, numpy, TLS, HTTP threads, its books
WORKER_BASE = 64 << 20        # one merge worker: measured 19 MiB anonymous at rest, + its pieces' buffers
DELTA_RESERVE = 1.0           # the deltas' parts a round holds at once, in fp32 tensors of the largest
CHECK_BYTES = 32 << 20        # a delta's check: 16M values of a block format's parts + the threads' pieces
TOPK_TENSORS = 4              # a topk delta or --down-wire: a tensor decoded or encoded whole, ~4 fp32 copies
VOCAB = 131328                # the largest tensor when only --params is known: this vocabulary x the width
QWEN3_WIDTH = {0.6e9: 1024, 1.7e9: 2048, 4e9: 2560, 8e9: 4096, 14e9: 5120, 32e9: 5120}   # params -> hidden dim


def largest_of(params):
    """The largest tensor (values) of a Qwen3 model of about `params` parameters: the
    embedding, VOCAB x the width of the flavor nearest in size."""
    near = min(QWEN3_WIDTH, key=lambda p: abs(math.log(p / max(params, 1))))
    return VOCAB * QWEN3_WIDTH[near]


def shapes_of(params):
    """{name: shape} standing for a model known by its size alone: its largest tensor
    (largest_of), the rest in tensors an eighth of that (a Qwen3 feed-forward matrix is a
    tenth to a third of its embedding)."""
    big = min(largest_of(params), params)
    rest, part = params - big, max(1, big // 8)
    out = {"embedding": (big,)}
    out.update({f"part{i}": (min(part, rest - i * part),) for i in range(-(-rest // part))})
    return out


@dataclasses.dataclass
class Budget:
    """G bytes for a model of `shapes`, keeping `kinds` (of outer_state.ARRAYS), with `procs`
    merge workers (0: the round runs in the aggregator) and the --down-wire codec."""
    memory: int
    shapes: dict
    kinds: tuple
    codec: object = None          # wire.Codec or None
    procs: int = 0
    topk_deltas: bool = False     # the sites send topk deltas (plan: --wire topk)

    @property
    def params(self):
        return sum(math.prod(sh) for sh in self.shapes.values())

    @property
    def largest(self):
        return max((math.prod(sh) for sh in self.shapes.values()), default=0)

    def state_bytes(self):
        return 4 * self.params * len(self.kinds)

    def delta_bytes(self):
        """The deltas' parts a round may hold at once (outer_state.apply_round's delta_bytes)."""
        return int(DELTA_RESERVE * 4 * self.largest)

    def scratch_bytes(self):
        return outer_state.scratch_bytes(self.shapes, self.codec) if self.procs else 0

    def fixed(self):
        """{what: bytes} the aggregator holds besides its outer state."""
        whole = self.topk_deltas or (self.codec is not None and self.codec.fmt not in ("int8", "int4", "int2"))
        out = {"aggregator": AGG_BASE, "merge workers": self.procs * WORKER_BASE,
               "update scratch": self.scratch_bytes(), "deltas' parts": self.delta_bytes(),
               "a delta's check": CHECK_BYTES}
        if whole:                    # a topk delta is decoded whole by each worker that merges part of it
            copies = max(self.procs, 1) if self.topk_deltas else 1
            out["whole-tensor codecs"] = TOPK_TENSORS * 4 * self.largest * copies
        return out

    def minimum(self):
        return sum(self.fixed().values())

    def placement(self):
        """{kind: set of tensor names on disk}: theta first, then momentum, then residual, each
        tensor in memory if it fits in what is left of G, else on disk."""
        left, out = self.memory - self.minimum(), {}
        for kind in self.kinds:
            out[kind] = set()
            for n, sh in self.shapes.items():
                b = 4 * math.prod(sh)
                if b <= left:
                    left -= b
                else:
                    out[kind].add(n)
        return out

    def split(self):
        """(bytes of the outer state in memory, bytes on disk)."""
        disk = sum(4 * math.prod(self.shapes[n]) for names in self.placement().values() for n in names)
        return self.state_bytes() - disk, disk


def kinds_of(outer_momentum, codec):
    """The arrays a run keeps: theta, the momentum unless --outer-momentum 0, the residual with --down-wire."""
    return ("theta",) + (("momentum",) if outer_momentum > 0 else ()) + (("residual",) if codec else ())


# ---------------------------------------------------------------- the machine

def meminfo(key):
    """A /proc/meminfo field in bytes (0 if it cannot be read)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def cgroup_limit():
    """This process's memory limit set by its cgroup (v2 memory.max or v1
    memory.limit_in_bytes), or None when there is none."""
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 1 << 60:
            return int(text)
    return None


def default_memory(budget_for, shared):
    """--memory-gb when not given -> (bytes, why): 3/4 of the machine's memory (its cgroup's
    limit if lower), at most 9/10 of what is available now; with merge workers (`shared`) no
    more than the shared memory free holds besides the fixed part. budget_for(bytes) -> Budget."""
    total = meminfo("MemTotal")
    limit = cgroup_limit()
    g, why = 3 * min(total, limit or total) // 4, f"3/4 of {'the cgroup limit' if limit and limit < total else 'RAM'}"
    avail = meminfo("MemAvailable")
    if avail and 9 * avail // 10 < g:
        g, why = 9 * avail // 10, "9/10 of the memory available"
    free = merge_pool.free_bytes()
    b = budget_for(g)
    if shared and free is not None and b.split()[0] + b.scratch_bytes() > free:
        g, why = b.minimum() + max(0, free - b.scratch_bytes()), f"what {merge_pool.shm_dir()} has free"
    return max(g, budget_for(0).minimum()), why


def check_machine(b, shared, outer_dir, given):
    """The start's checks: RAM, shared memory and --outer-dir against the budget -> None, or a
    SystemExit in one line naming the flag to change."""
    need, flag = b.minimum(), f"--memory-gb {b.memory / GB:g}"
    if b.memory < need:
        raise SystemExit(f"fedmom_server: {flag} is less than the aggregator holds with none of its outer state in "
                         f"memory ({gb(need)}: {describe_fixed(b)}): raise --memory-gb to at least "
                         f"{math.ceil(need / GB * 10) / 10:g}, or lower --merge-procs")
    avail = meminfo("MemAvailable")
    if given and avail and b.memory > avail:
        raise SystemExit(f"fedmom_server: {flag} is more than the {gb(avail)} this machine has available: lower "
                         "--memory-gb (what does not fit goes to --outer-dir, on disk)")
    mem, disk = b.split()
    free = merge_pool.free_bytes()
    if shared and free is not None and mem + b.scratch_bytes() > free:
        fit = b.minimum() + max(0, free - b.scratch_bytes())
        raise SystemExit(f"fedmom_server: {flag} puts {gb(mem)} of outer state in shared memory "
                         f"({merge_pool.shm_dir()}, {gb(free)} free; {gb(b.scratch_bytes())} of update scratch too): "
                         f"lower --memory-gb to {fit / GB:.2f}, or enlarge it (mount -o remount,size=... "
                         f"{merge_pool.shm_dir()}, or ${merge_pool.SHM_ENV})")
    if disk:
        os.makedirs(outer_dir, exist_ok=True)
        dfree = merge_pool.free_bytes(outer_dir)
        if dfree is not None and disk > dfree:
            raise SystemExit(f"fedmom_server: {flag} leaves {gb(disk)} of outer state on disk and --outer-dir "
                             f"{outer_dir} has {gb(dfree)} free: point --outer-dir at a larger disk, or raise "
                             "--memory-gb")


def gb(n):
    """Bytes as GB (10^9), or MB below one GB, for messages."""
    return f"{n / GB:.2f} GB" if n >= GB else f"{n / 1e6:.1f} MB"


def describe_fixed(b):
    return ", ".join(f"{k} {gb(v)}" for k, v in b.fixed().items() if v)


def describe(b, outer_dir):
    """One line for the start's log: the budget and where the outer state went."""
    mem, disk = b.split()
    where = {k: f"{len(b.shapes) - len(v)}/{len(b.shapes)}" for k, v in b.placement().items()}
    return (f"memory budget {gb(b.memory)}: fixed {gb(b.minimum())} ({describe_fixed(b)}); outer state "
            f"{gb(b.state_bytes())}, {gb(mem)} in memory, {gb(disk)} on disk"
            + (f" in {outer_dir}" if disk else "") + " (tensors in memory: "
            + ", ".join(f"{k} {v}" for k, v in where.items()) + ")")


def make_store(shapes, kinds, codec, procs, memory_gb, outer_dir, say):
    """At a start, once the shapes are known: the budget (memory_gb, or the machine's:
    default_memory), the checks of RAM, shared memory and outer_dir against it (a one-line
    SystemExit naming the flag), what a dead aggregator left in outer_dir swept, and the Store
    the outer state is loaded into -> (Budget, Store). say(line): the start's log."""
    budget_for = lambda g: Budget(g, shapes, kinds, codec, procs)
    if memory_gb is not None:
        memory, why = int(memory_gb * GB), "--memory-gb"
    else:
        memory, why = default_memory(budget_for, procs > 0)
    b = budget_for(memory)
    merge_pool.sweep_stale(outer_dir)
    check_machine(b, procs > 0, outer_dir, memory_gb is not None)
    say(f"{describe(b, outer_dir)}; budget from {why}")
    return b, Store(shapes, b.placement(), outer_dir, procs > 0)


# ---------------------------------------------------------------- the blocks

class Store:
    """The outer state's blocks as a Budget places them: for each of outer_state.ARRAYS one
    merge_pool.BlockArrays, made on first use (its memory or disk taken then, at once) and
    reused by every load, round and rebuild after. shared: the memory part in shared memory
    (a round on merge workers), else private. A kind the placement does not name (kept by a
    logged round only) goes to disk whole."""

    def __init__(self, shapes, placement, outer_dir, shared):
        self.shapes, self.placement, self.dir, self.shared = dict(shapes), placement, outer_dir, shared
        self.made = {}

    def arrays(self, kind):
        if kind not in self.made:
            disk = self.placement.get(kind, set(self.shapes))
            if disk:
                os.makedirs(self.dir, exist_ok=True)
            self.made[kind] = merge_pool.BlockArrays(self.shapes, on_disk=disk, disk_dir=self.dir,
                                                     shared=self.shared)
        return self.made[kind]

    def sync(self):
        for a in self.made.values():
            a.sync()

    def bytes(self):
        """(memory, disk) bytes of the blocks made so far."""
        return (sum(a.memory_bytes() for a in self.made.values()), sum(a.disk_bytes() for a in self.made.values()))

    def release(self):
        for a in self.made.values():
            a.release()
        self.made = {}


# ---------------------------------------------------------------- the plan of a run

# Rates bench/scale_round.py measured (`--flavor 0.6B --rounds 4`, both arms, 2 cores shared
# with other work; `plan --rates FILE` takes a run's --json instead): the merge's CPU seconds
# per parameter (all its workers) with the outer state in memory and on disk, one delta's
# acceptance and the publish per parameter projected to a 16-core VM (bench/scale_round.py's
# project()), the one-core sha256 of theta per byte, the checkpoint's fsync'd write rate.
RATES = {"source": "bench/scale_round.py --flavor 0.6B --rounds 4 (2 cores)", "merge_cpu_s_per_param": 1.34e-8,
         "merge_disk_cpu_s_per_param": 1.77e-8, "accept_s_per_param": 9.0e-10, "publish_s_per_param": 1.03e-9,
         "sha256_s_per_byte": 7.4e-10, "checkpoint_write_bps": 0.37e9}
NVME = {"read_bps": 3.0e9, "write_bps": 2.0e9}      # a VM's local NVMe disk, assumed (plan --disk-gbs)


def rates_from(path):
    """RATES from a bench/scale_round.py --json file (its "rates")."""
    with open(path) as f:
        got = json.load(f).get("rates")
    if not isinstance(got, dict) or not set(RATES) <= set(got):
        raise SystemExit(f"plan: {path} holds no \"rates\" (write it with bench/scale_round.py --json)")
    return got


def round_seconds(b, sites, cores, rates, disk):
    """Central seconds of one round at this budget: the acceptances, the merge (its CPU over
    the cores, or the disk's reads and writes of the part on disk, whichever is longer, and
    never under the one-core theta digest), the publish."""
    P, (in_mem, on_disk) = b.params, b.split()
    f = on_disk / max(in_mem + on_disk, 1)
    cpu = P * (rates["merge_cpu_s_per_param"] * (1 - f) + rates["merge_disk_cpu_s_per_param"] * f) / cores
    io = on_disk / disk["read_bps"] + on_disk / disk["write_bps"]
    merge = max(cpu, io, rates["sha256_s_per_byte"] * 4 * P)
    return {"accept": sites * rates["accept_s_per_param"] * P, "merge": merge, "merge_io": io,
            "publish": rates["publish_s_per_param"] * P}


def disk_needs(P, sites, codec_bytes, delta_bytes, checkpoint_rounds, keep_rounds, kinds):
    """{what: bytes} on disk: the state dir (checkpoint, the logged rounds' deltas, the open
    round's, one update, one segment more while a checkpoint is written) and the blob store
    (K + 1 updates, a delta per site in transit); RUNBOOK.md section 1 has the formula."""
    M, D, U = 4 * P, sites * delta_bytes * P, codec_bytes * P
    return {"checkpoint": len(kinds) * M + 3 * (64 << 20), "deltas logged + open": (checkpoint_rounds + 1) * D,
            "update": U, "blob store": (keep_rounds + 1) * U + D}


def payload_per_param(codec):
    """Bytes per parameter of one delta or update in a wire format (wire.Codec; None: f32)."""
    if codec is None or codec.fmt == "f32":
        return 4.0
    if codec.fmt == "bf16":
        return 2.0
    if codec.fmt == "topk":
        return codec.topk_k * (codec.topk_bits + codec.index_bits) / 8 / codec.topk_chunk + 2 / codec.topk_chunk
    return {"int8": 8, "int4": 4, "int2": 2}[codec.fmt] / 8 + 2 / codec.block


def plan(shapes, how, sites, wire_codec, down_codec, memory_gb, procs, cores, outer_momentum, checkpoint_rounds,
         keep_rounds, rates, disk):
    """What a run needs -> the lines `fedmom_server.py plan` prints: RAM at the budget, the
    disk, and the central seconds of a round in memory, at the budget and with nothing in
    memory (round_seconds, from `rates`: bench/scale_round.py's)."""
    kinds = kinds_of(outer_momentum, down_codec)
    at = lambda g: Budget(int(g), shapes, kinds, down_codec, procs, bool(wire_codec and wire_codec.fmt == "topk"))
    low = at(0).minimum()
    full = low + at(0).state_bytes()
    b = at(memory_gb * GB if memory_gb is not None else full)
    P, M = b.params, 4 * b.params
    mem, disk_b = b.split()
    fmt = lambda c: c.fmt if c else "f32"
    out = [f"plan: {P / 1e9:.3f}G parameters (M = {gb(M)} fp32), largest tensor {b.largest / 1e6:.1f}M values ({how}); "
           f"{sites} site(s) sending {fmt(wire_codec)} deltas; --down-wire {fmt(down_codec)}; {procs} merge workers "
           f"on {cores} cores; --checkpoint-rounds {checkpoint_rounds}, --keep-rounds {keep_rounds}",
           f"memory, --memory-gb {b.memory / GB:.2f}{'' if memory_gb is not None else ' (all in memory)'}: "
           f"fixed {gb(low)} ({describe_fixed(b)})",
           f"  outer state {gb(b.state_bytes())} ({', '.join(kinds)}: {4 * len(kinds)} B/param): {gb(mem)} in memory"
           + (f" (shared memory: {gb(mem + b.scratch_bytes())})" if procs else "") + f", {gb(disk_b)} on disk "
           "(--outer-dir)",
           f"  RAM: {gb(b.memory)} at this budget; all in memory {gb(full)}; nothing in memory {gb(low)}"]
    D, U = payload_per_param(wire_codec), (payload_per_param(down_codec) if down_codec else 0.0)
    needs = disk_needs(P, sites, U, D, checkpoint_rounds, keep_rounds, kinds)
    needs = {"--outer-dir (file blocks, scratch)": disk_b, "state dir: checkpoint": needs["checkpoint"],
             f"state dir: deltas of {checkpoint_rounds} logged rounds + the open one": needs["deltas logged + open"],
             "state dir: the update": needs["update"], "blob store": needs["blob store"]}
    out.append(f"disk ({sites} x {D:.3f} B/param of deltas a round, {U:.3f} B/param of update):")
    out += [f"  {k:<58} {gb(v):>11}" for k, v in needs.items() if v]
    out.append(f"  {'in all':<58} {gb(sum(needs.values())):>11}")
    out.append(f"seconds per round, central (rates: {rates['source']}; {cores} cores; disk read "
               f"{disk['read_bps'] / GB:.1f} GB/s, write {disk['write_bps'] / GB:.1f} GB/s):")
    out.append(f"  {'mode':<26} {'in memory':>10} {f'accept x{sites}':>9} {'merge':>8} {'(disk)':>8} {'publish':>8} "
               f"{'central':>8}")
    modes = [("all in memory", at(full)), (f"--memory-gb {b.memory / GB:.2f}", b), ("nothing in memory", at(low))]
    for name, m in modes:
        r = round_seconds(m, sites, cores, rates, disk)
        out.append(f"  {name:<26} {gb(m.split()[0]):>10} {r['accept']:9.1f} {r['merge']:8.1f} {r['merge_io']:8.1f} "
                   f"{r['publish']:8.1f} {r['accept'] + r['merge'] + r['publish']:8.1f}")
    ck = needs["state dir: checkpoint"] / disk["write_bps"]
    out.append(f"  the checkpoint, every {checkpoint_rounds} rounds after its round is published: {ck:.0f} s "
               f"({gb(needs['state dir: checkpoint'])} at the disk's {disk['write_bps'] / GB:.1f} GB/s; measured "
               f"{rates['checkpoint_write_bps'] / GB:.2f} GB/s where the rates were)")
    return out
