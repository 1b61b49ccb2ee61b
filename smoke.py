"""smoke.py - infrastructure self-test: run it before spending GPU hours on a layout.

Runs on: compute nodes (one process per GPU), or this machine's CPU for tests.
    torchrun --nproc-per-node 4 smoke.py --device cpu --diloco-replicas 2 4
    sbatch jobs/lumi_smoke.sh --diloco-replicas 2          (srun ... python smoke.py)
No port of its own (the rendezvous is dist_env.init_distributed's), no state directory.

Checks, each reduced over all ranks, printed by rank 0 as a pass/fail table:
  first collective      one small all-reduce on the world, then, for each --diloco-replicas K,
                        the layout's groups made and each sub-group's first all-reduce, timed
                        under a watchdog: a rank not done after --first-collective-timeout-s
                        prints one line naming the group and the MITIGATIONS set, and exits 1
                        at once (a failure in minutes, not a stuck allocation).
  distinct devices      every rank drives its own GPU (host + device uuid, else PCI id);
                        two ranks on one GPU is the classic pinning mistake. On CPU: passes.
  all-reduce exact      a sum of rank ids, integer-valued floats: exact or broken.
  all-reduce bandwidth  --allreduce-mb of fp32, algbw = bytes / time and
                        busbw = algbw * 2(W-1)/W (the nccl-tests convention);
                        fails below --min-busbw-gbs (single-digit GB/s between GPU nodes: TCP).
  network               which transport the collectives use, read from NCCL's INFO lines (a
                        file per rank, NCCL_DEBUG_FILE) and printed under the table: Libfabric
                        over cxi on LUMI, IB on Snellius. A multi-node run on Socket (or
                        libfabric's tcp provider), or whose log says nothing, FAILS.
  hip runtime           on ROCm, after RCCL loaded its network plugin: exactly one HIP
                        runtime (libamdhip64) mapped in the process, torch's.
  attention kernel      which SDPA kernel a qwen3-0.6B-shaped grouped-query attention
                        (16 query / 8 K/V heads, head_dim 128, seq 2048, bf16; seq 128 fp32
                        on CPU) runs, forward and backward, read from the profiler, with
                        models.py's kernel plan. The math kernel FAILS on a GPU.
  diloco k=K groups     for each --diloco-replicas K: inner and outer group members
  diloco k=K outer step replica r holds the value r, theta(0) = 0, FedAvg outer step:
                        theta must be exactly (K-1)/2 everywhere, 0.5000 for K=2,
                        1.5000 for K=4. Also times the outer step on --diloco-mb.
Exit status 0 when everything passed, 1 when a check failed, 2 for a bad flag.

What to do when a row fails: RUNBOOK.md, "Validate each site before spending GPU hours".
"""
import argparse
import dataclasses
import glob
import os
import re
import socket
import sys
import tempfile
import threading
import time

import torch
import torch.distributed as dist

import diloco
import dist_env
import models
import testhooks

# what may keep the first collective of a new group from hanging on LUMI (sites/lumi.sh sets
# them; RUNBOOK.md, "Validate each site ..."): dist_env's eager NCCL init (device_id), torch's non-blocking
# communicator calls, RCCL's MSCCL algorithms. The row and its failure line say which are set.
MITIGATIONS = ("PWW_EAGER_PG_INIT", "TORCH_NCCL_USE_COMM_NONBLOCKING", "RCCL_MSCCL_ENABLE")


@dataclasses.dataclass
class SmokeConfig:
    device: str = "auto"
    diloco_replicas: tuple = ()
    allreduce_mb: float | None = None     # None: 256 on GPU, 16 on CPU
    diloco_mb: float | None = None        # None: 45 on GPU (ResNet-18's fp32 size), 4 on CPU
    iters: int = 5
    min_busbw_gbs: float | None = None    # None: 10 on GPU, 0 on CPU
    first_collective_timeout_s: float = 180.0

    def __post_init__(self):
        if self.iters < 1:
            raise ValueError(f"--iters {self.iters}: must be >= 1")
        if not self.first_collective_timeout_s > 0:
            raise ValueError(f"--first-collective-timeout-s {self.first_collective_timeout_s}: must be > 0")
        for name in ("allreduce_mb", "diloco_mb"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ValueError(f"--{name.replace('_', '-')} {v}: must be > 0")

    def resolved(self, on_gpu):
        pick = lambda v, gpu, cpu: v if v is not None else (gpu if on_gpu else cpu)
        return dataclasses.replace(self, allreduce_mb=pick(self.allreduce_mb, 256, 16),
                                   diloco_mb=pick(self.diloco_mb, 45, 4),
                                   min_busbw_gbs=pick(self.min_busbw_gbs, 10.0, 0.0))


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def device_identity(d):
    """(host, device id, device name) of this rank."""
    host = socket.gethostname()
    if d.device.type != "cuda":
        return host, "cpu", "cpu"
    p = torch.cuda.get_device_properties(d.device)
    uid = str(getattr(p, "uuid", "") or "")
    pci = f"{getattr(p, 'pci_domain_id', 0):04x}:{getattr(p, 'pci_bus_id', 0):02x}:{getattr(p, 'pci_device_id', 0):02x}"
    return host, uid or pci, f"{p.name} pci {pci}"


def mitigations_set(env=os.environ):
    """'PWW_EAGER_PG_INIT=1, TORCH_NCCL_USE_COMM_NONBLOCKING unset, ...' for the row and its failure line."""
    return ", ".join(f"{v}={env[v]}" if v in env else f"{v} unset" for v in MITIGATIONS)


class Watchdog:
    """Ends this process with exit status 1 and one line on stderr when the block it guards
    is still running after timeout_s: a collective that hangs in C++ cannot be interrupted,
    so a thread waits beside it. `stage` names what the block is doing, for the line."""

    def __init__(self, timeout_s, rank):
        self.timeout_s, self.rank, self.stage = timeout_s, rank, "starting"
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="smoke-watchdog", daemon=True)

    def _watch(self):
        if not self.done.wait(self.timeout_s):
            print(f"smoke.py: FAIL first collective: {self.stage} did not finish within "
                  f"{self.timeout_s:g} s on rank {self.rank} ({socket.gethostname()}); {mitigations_set()}; "
                  f"see RUNBOOK.md section 2, 'first collective'", file=sys.stderr, flush=True)
            os._exit(1)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.done.set()
        self.thread.join()


def _first_all_reduce(d, group, what, dog):
    """ms of one small all-reduce on `group` (its first, when the group is new); exact or raises."""
    dog.stage = f"the first all-reduce on {what}"
    testhooks.fault_point(f"smoke.first_collective.rank{d.rank}")     # test hook: a rank that never arrives
    t0 = time.perf_counter()
    t = torch.ones(1, device=d.device)
    dist.all_reduce(t, group=group)
    _sync(d.device)
    ms = (time.perf_counter() - t0) * 1e3
    if t.item() != dist.get_world_size(group):
        raise RuntimeError(f"{what}: all-reduce of ones gave {t.item():g}, expected {dist.get_world_size(group)}")
    return ms


def check_first_collectives(d, replicas, timeout_s):
    """The layouts for each K (their groups made here, the first time) and the row: a first
    all-reduce on the world, then on each sub-group of each layout, all under one Watchdog.
    Why first: on LUMI's torch 2.10 + ROCm 7.0 images the first collective of a group made
    with new_group() hangs on every rank at >= 4 nodes in most attempts (one group alone
    always passed). The Watchdog turns that into one line and exit 1 (jobs/*_smoke.sh: srun
    --kill-on-bad-exit ends the other ranks); the row, when it passes, gives each group's time."""
    layouts, parts = {}, []
    with Watchdog(timeout_s, d.rank) as dog:
        parts.append(f"world {_first_all_reduce(d, None, 'the world group', dog):.1f} ms")
        for k in replicas:
            dog.stage = f"making the groups of --diloco-replicas {k} (ReplicaLayout.build)"
            t0 = time.perf_counter()
            lay = layouts[k] = diloco.ReplicaLayout.build(d.world_size, d.rank, k)
            made = (time.perf_counter() - t0) * 1e3
            times = [f"{name} {ranks} {_first_all_reduce(d, group, f'k={k} {name} group {ranks}', dog):.1f} ms"
                     for name, group, ranks in (("inner", lay.inner_group, lay.inner_ranks),
                                                ("outer", lay.outer_group, lay.outer_ranks))]
            parts.append(f"k={k}: groups made in {made:.1f} ms, " + ", ".join(times))
    return layouts, (True, "; ".join(parts) + f" (limit {timeout_s:g} s; {mitigations_set()})")


def check_devices(d, world, ids):
    if d.device.type != "cuda":
        return True, f"{world} ranks on cpu (hosts: {len({h for h, _, _ in ids})}); not a GPU run"
    keys = [(h, u) for h, u, _ in ids]
    dup = sorted({k for k in keys if keys.count(k) > 1})
    if dup:
        return False, f"ranks share a device: {dup}; check the pinning variable and --gpus-per-task"
    return True, f"{world} distinct devices: " + ", ".join(f"{h}/{n}" for h, _, n in ids[:4]) + (
        " ..." if world > 4 else "")


def check_exact(d, world):
    t = torch.full((1 << 20,), float(d.rank + 1), device=d.device)
    dist.all_reduce(t)
    want = world * (world + 1) / 2
    bad = int((t != want).sum())
    return bad == 0, f"sum of 1..{world} = {want:g} on {t.numel()} elements" + (f"; {bad} wrong" if bad else "")


def check_bandwidth(d, world, cfg):
    n = int(cfg.allreduce_mb * (1 << 20)) // 4
    t = torch.ones(n, device=d.device)
    for _ in range(2):                                    # warm-up: connections, buffers
        dist.all_reduce(t)
    _sync(d.device)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(cfg.iters):
        dist.all_reduce(t)
    _sync(d.device)
    dt = (time.perf_counter() - t0) / cfg.iters
    algbw = n * 4 / dt / 1e9
    busbw = algbw * 2 * (world - 1) / world
    ok = world == 1 or busbw >= cfg.min_busbw_gbs
    return ok, (f"{cfg.allreduce_mb:g} MiB x{cfg.iters}: {dt * 1e3:.2f} ms, algbw {algbw:.2f} GB/s, "
                f"busbw {busbw:.2f} GB/s (min {cfg.min_busbw_gbs:g})"), busbw


def nccl_debug_to_file():
    """On a GPU run, before the process group exists: have NCCL/RCCL write its INFO lines of
    INIT and NET to a file this process can read back, and return that file's glob pattern.
    The caller's settings are kept where the check still works: NCCL_DEBUG stays when it is
    INFO or TRACE (anything less is raised to INFO: the check needs those lines), INIT,NET
    are added to the caller's NCCL_DEBUG_SUBSYS, and the caller's NCCL_DEBUG_FILE is used
    as it is (its %h and %p expanded to find it), else a file in a fresh temporary
    directory. The lines then go to that file, not to the job's log: the network row and
    the lines printed under the table say what they were."""
    env = os.environ
    if env.get("NCCL_DEBUG", "").upper() not in ("INFO", "TRACE"):
        env["NCCL_DEBUG"] = "INFO"
    subsys = [s for s in env.get("NCCL_DEBUG_SUBSYS", "").split(",") if s]
    if subsys and "ALL" not in (s.upper() for s in subsys):
        env["NCCL_DEBUG_SUBSYS"] = ",".join(subsys + [s for s in ("INIT", "NET") if s not in subsys])
    elif not subsys:
        env["NCCL_DEBUG_SUBSYS"] = "INIT,NET"
    if not env.get("NCCL_DEBUG_FILE"):
        env["NCCL_DEBUG_FILE"] = os.path.join(tempfile.mkdtemp(prefix="pww-smoke-nccl-"), "nccl.%h.%p.log")
    # NCCL writes %h as the host name up to its first dot: a wildcard finds it either way
    return env["NCCL_DEBUG_FILE"].replace("%h", "*").replace("%p", str(os.getpid()))


def network_summary(text):
    """What NCCL/RCCL's INFO lines say about the transport: {"network", "plugin",
    "libfabric", "provider"} (None where no line said)."""
    def last(pattern):
        found = re.findall(pattern, text, flags=re.MULTILINE)
        return found[-1].strip() if found else None
    return {"network": last(r"Using network (.+)$"),
            "plugin": last(r"NET/OFI Initializing (.+)$"),
            "libfabric": last(r"NET/OFI Using Libfabric version (\S+)"),
            "provider": last(r"NET/OFI Selected [Pp]rovider is ([^,\s]+)")}


NET_LINE = re.compile(r"Using network |NET/OFI (Initializing|Using Libfabric|Selected [Pp]rovider)|"
                      r"NET/Plugin|NET/IB : Using|NET/Socket : Using")


def read_text(path):
    with open(path, errors="replace") as f:
        return f.read()


def check_network(d, hosts, log_glob):
    """(ok, detail, lines) for the transport: NCCL's own lines about it, from this rank's
    log file. A multi-node GPU run fails on TCP, and fails when no line says what it used
    (the file missing or unreadable, or NCCL_DEBUG_SUBSYS without INIT/NET): a blind pass
    is how a TCP fallback went unnoticed."""
    if d.device.type != "cuda":
        return True, "gloo (TCP); not a GPU run", []
    files = sorted(glob.glob(log_glob))
    text = "".join(read_text(f) for f in files)
    lines = [line.strip() for line in text.splitlines() if NET_LINE.search(line)]
    n = network_summary(text)
    if n["network"] is None:
        detail = (f"no 'Using network' line in {log_glob}" if files else
                  f"no NCCL log at {log_glob} (NCCL_DEBUG_FILE's directory must be writable)")
        if hosts > 1:
            return False, detail + f": cannot tell which transport {hosts} nodes use; see RUNBOOK.md section 2", lines
        return True, detail + "; one node: the network carries nothing", lines
    detail = f"{n['network']}" + (f" via {n['plugin']}" if n["plugin"] else "") + (
        f", libfabric {n['libfabric']}" if n["libfabric"] else "") + (
        f", provider {n['provider']}" if n["provider"] else "") + f"; {hosts} node(s)"
    tcp = n["network"] == "Socket" or (n["provider"] or "").split(";")[0] in ("tcp", "sockets")
    if hosts > 1 and tcp:
        return False, detail + ": the collectives run over TCP; see RUNBOOK.md section 2", lines
    return True, detail, lines


def hip_runtimes(maps):
    """The distinct HIP runtime files (libamdhip64.so*) in a /proc/<pid>/maps text."""
    found = set()
    for line in maps.splitlines():
        fields = line.split(None, 5)
        if len(fields) == 6 and os.path.basename(fields[5].strip()).startswith("libamdhip64.so"):
            found.add(fields[5].strip())
    return sorted(found)


def check_hip_runtime(d, maps_path="/proc/self/maps"):
    """(ok, detail): one HIP runtime in this process after RCCL loaded its network plugin.
    torch's ROCm wheel brings its own libamdhip64; the image's plugin was linked against
    /opt/rocm's. The same soname makes the loader reuse torch's; two mapped files mean two
    runtimes, whose device pointers the other does not know (registration for RDMA fails
    or worse)."""
    if d.accel != "rocm":
        return True, "not a ROCm run"
    with open(maps_path) as f:
        found = hip_runtimes(f.read())
    if len(found) > 1:
        return False, (f"{len(found)} HIP runtimes in one process: {', '.join(found)}; the RCCL plugin "
                       f"must use torch's (containers/lumi-titan.def, 'Two HIP runtimes')")
    return True, f"one: {found[0]}" if found else "none mapped"


def check_attention(d):
    """(ok, detail): the SDPA kernel a qwen3-0.6B-shaped GQA call runs here."""
    gpu = d.device.type == "cuda"
    heads, kv, hd, seq = 16, 8, 128, (2048 if gpu else 128)
    dtype = torch.bfloat16 if gpu else torch.float32
    kernel, expand = models.attention_plan(d.device, dtype, heads, kv, hd, seq)
    attn = models.GQAAttention()
    attn.expand_kv = expand

    def qkv(h):
        return torch.randn(1, seq, h, hd, device=d.device, dtype=dtype, requires_grad=True).transpose(1, 2)
    q, k, v = qkv(heads), qkv(kv), qkv(kv)

    def step():
        attn(q, k, v, scale=hd ** -0.5, enable_gqa=True).float().sum().backward()
        _sync(d.device)
    ran = models.sdpa_kernels_ran(step)
    plan = models.describe_plan(kernel, expand, heads, kv)
    ok = bool(ran) and not (gpu and "math" in ran)
    return ok, (f"{'+'.join(ran) or 'none'} ran; plan {plan}; GQA {heads}/{kv} heads, head_dim {hd}, "
                f"seq {seq}, {str(dtype).removeprefix('torch.')}")


class Prepared(torch.nn.Module):
    def __init__(self, numel, value, device):
        super().__init__()
        self.w = torch.nn.Parameter(torch.full((numel,), float(value), device=device))


def check_diloco(d, world, k, cfg, lay):
    """Group membership and the exact FedAvg outer step for k replicas (lay: the layout
    check_first_collectives built)."""
    inner = dist.get_process_group_ranks(lay.inner_group)
    outer = dist.get_process_group_ranks(lay.outer_group)
    groups_ok = inner == lay.inner_ranks and outer == lay.outer_ranks
    groups = (groups_ok, f"replica {lay.replica}: inner {inner}, outer {outer}")
    numel = int(cfg.diloco_mb * (1 << 20)) // 4
    model = Prepared(numel, 0.0 if lay.replica == 0 else 7.0, d.device)  # theta(0) must come from replica 0
    outer_loop = diloco.DiLoCo(model, lay, diloco.DiLoCoConfig.fedavg(inner_steps=1))
    start_ok = bool((model.w == 0).all())
    with torch.no_grad():
        model.w.fill_(float(lay.replica))              # "training": replica r drifted to r
    row = outer_loop.after_inner_step()
    want = (k - 1) / 2
    got = model.w.detach()
    exact = start_ok and bool((got == want).all())
    detail = (f"exactly {got[0].item():.4f} (expected {want:.4f}) on {cfg.diloco_mb:g} MiB, "
              f"outer step {row['outer_ms']:.1f} ms" if exact else
              f"theta(0) aligned: {start_ok}; got min {got.min().item():.6f} max {got.max().item():.6f}, "
              f"expected {want:.4f}")
    return groups, (exact, detail)


def run(cfg: SmokeConfig):
    log_glob = nccl_debug_to_file() if dist_env.detect_accel(cfg.device) != "cpu" else None
    try:
        d = dist_env.init_distributed(cfg.device)
    except dist_env.ConfigError as e:           # a --device or PWW_* value this process cannot use
        print(f"smoke.py: {e}", file=sys.stderr, flush=True)
        return 2
    world = d.world_size
    for k in cfg.diloco_replicas:
        try:
            diloco.ReplicaLayout.check(world, k)
        except ValueError as e:
            dist_env.print0(f"smoke.py: {e}")
            return 2
    cfg = cfg.resolved(d.device.type == "cuda")
    dist_env.print0(f"smoke: {world} ranks, backend {d.backend}, accel {d.accel}, torch {torch.__version__}; "
                    f"{mitigations_set()}")
    layouts, first = check_first_collectives(d, cfg.diloco_replicas, cfg.first_collective_timeout_s)
    ids = [None] * world
    dist.all_gather_object(ids, device_identity(d))
    hosts = len({h for h, _, _ in ids})
    net_ok, net_detail, net_lines = check_network(d, hosts, log_glob)
    rows = [("first collective",) + first,
            ("distinct devices",) + check_devices(d, world, ids),
            ("all-reduce exact",) + check_exact(d, world),
            ("all-reduce bandwidth",) + check_bandwidth(d, world, cfg)[:2],
            ("network", net_ok, net_detail),
            ("hip runtime",) + check_hip_runtime(d),
            ("attention kernel",) + check_attention(d)]
    for k in cfg.diloco_replicas:
        groups, step = check_diloco(d, world, k, cfg, layouts[k])
        rows += [(f"diloco k={k} groups",) + groups, (f"diloco k={k} outer step",) + step]
    return report(d, world, rows, notes=[f"NCCL, rank 0 ({log_glob}):"] + [f"  {l}" for l in net_lines[:12]]
                  if net_lines else [])


def report(d, world, rows, notes=()):
    """Gather every rank's rows; a check passes only if it passed on every rank. Rank 0
    prints its notes (NCCL's transport lines) under the table."""
    every = [None] * world
    dist.all_gather_object(every, rows)
    failed = 0
    if d.rank == 0:
        print(f"{'check':<26} {'result':<6} detail (rank 0; failing ranks listed)")
    for i, (name, _, detail) in enumerate(rows):
        bad = [r for r in range(world) if not every[r][i][1]]
        failed += bool(bad)
        if d.rank == 0:
            extra = "".join(f"\n{'':<34}rank {r}: {every[r][i][2]}" for r in bad[:8])
            print(f"{name:<26} {'FAIL' if bad else 'PASS':<6} {detail}{extra}", flush=True)
    for line in notes:
        dist_env.print0(line)
    dist_env.print0("SMOKE TEST FAILED" if failed else "SMOKE TEST PASSED")
    dist.barrier()
    dist.destroy_process_group()
    return 1 if failed else 0


def main(argv=None):
    p = argparse.ArgumentParser(description="Infrastructure self-test: devices, all-reduce, DiLoCo groups.")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda", "rocm"),
                   help="accelerator (default auto: ROCm or CUDA when visible, else CPU with gloo)")
    p.add_argument("--diloco-replicas", type=int, nargs="*", default=[],
                   help="also check the DiLoCo layout and outer step for each K given, e.g. 2 4 "
                        "(each must divide the rank count; default: none)")
    p.add_argument("--allreduce-mb", type=float, default=None,
                   help="size of the bandwidth all-reduce in MiB (default 256 on GPU, 16 on CPU)")
    p.add_argument("--diloco-mb", type=float, default=None,
                   help="size of the prepared DiLoCo tensor in MiB (default 45 on GPU, about "
                        "ResNet-18 in fp32; 4 on CPU)")
    p.add_argument("--iters", type=int, default=5, help="timed all-reduce iterations (default 5)")
    p.add_argument("--min-busbw-gbs", type=float, default=None,
                   help="fail below this bus bandwidth in GB/s (default 10 on GPU, 0 on CPU)")
    p.add_argument("--first-collective-timeout-s", type=float, default=SmokeConfig.first_collective_timeout_s,
                   help="a rank whose first all-reduces (world, then each --diloco-replicas "
                        "layout's groups, made first) are not done after this many seconds "
                        f"exits 1 naming the group (default {SmokeConfig.first_collective_timeout_s:g})")
    a = p.parse_args(argv)
    try:
        cfg = SmokeConfig(device=a.device, diloco_replicas=tuple(a.diloco_replicas),
                          allreduce_mb=a.allreduce_mb, diloco_mb=a.diloco_mb, iters=a.iters,
                          min_busbw_gbs=a.min_busbw_gbs, first_collective_timeout_s=a.first_collective_timeout_s)
    except ValueError as e:
        p.error(str(e))
    return run(cfg)


if __name__ == "__main__":
    sys.exit(main())
