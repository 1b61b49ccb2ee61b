"""dist_env.py - the process's place in the job: device, backend, rank and world, the
rendezvous, and the default process group, chosen once from the environment.

Runs on: compute nodes and any CPU (imported by train.py, smoke.py and the benches; not
started on its own). Opens no port itself: init_distributed joins the rendezvous at
MASTER_ADDR:MASTER_PORT, which torchrun sets, or which it derives under srun.

    d = dist_env.init_distributed("auto")     # -> Dist(rank, local_rank, world_size, device, backend, accel)

Device dispatch:
    ROCm  torch.version.hip and a GPU visible  -> backend nccl (= RCCL), pinning ROCR_VISIBLE_DEVICES
    CUDA  torch.cuda.is_available()            -> backend nccl, pinning CUDA_VISIBLE_DEVICES
    CPU   otherwise, or --device cpu           -> backend gloo
Rank/world: RANK/LOCAL_RANK/WORLD_SIZE (torchrun), else SLURM_PROCID/SLURM_LOCALID/
SLURM_NTASKS (srun), else one process (world 1). Under srun MASTER_ADDR is the job's
first node (expand_nodelist) and MASTER_PORT is derived from SLURM_JOB_ID unless set.
A process group always exists afterwards, even for one process (an in-process store,
no port), so DDP, FSDP2 and diloco.py's collectives run unchanged at world size 1.
On NCCL it is bound to the rank's GPU (device_id: eager communicator setup) unless
PWW_EAGER_PG_INIT=0 (sites/lumi.sh; RUNBOOK.md section 2, "first collective").
"""
import dataclasses
import datetime
import os
import re
import subprocess

import torch
import torch.distributed as dist


class ConfigError(ValueError):
    """A flag, file or environment the run cannot use: train.py prints it as one line (exit 2)."""


class DeviceError(ConfigError, RuntimeError):
    """--device names a device this process cannot use (one line, exit 2)."""


PINNING_VAR = {"rocm": "ROCR_VISIBLE_DEVICES", "cuda": "CUDA_VISIBLE_DEVICES", "cpu": None}

# MASTER_PORT under srun: a base plus the job id modulo a span, so two jobs that share
# a node (routine on Snellius, possible on LUMI small-g) rendezvous on different
# ports. A constant port makes the second job die in TCPStore with "address already in
# use", which reads like a network fault. The span stays below 29500 (our central
# services sit at 29510-29512) and below Linux's ephemeral range (32768+).
MASTER_PORT_BASE, MASTER_PORT_SPAN = 20000, 9000


@dataclasses.dataclass
class Dist:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    backend: str          # "nccl" (RCCL on ROCm) or "gloo"
    accel: str            # "rocm", "cuda" or "cpu"

    @property
    def is_main(self):
        return self.rank == 0


def print0(*args, **kwargs):
    """print() on global rank 0 only (every rank when no process group exists yet)."""
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return
    print(*args, **kwargs, flush=True)


def detect_accel(device="auto"):
    """'rocm' | 'cuda' | 'cpu' for --device auto|cpu|cuda|rocm; refuses a device that is absent."""
    gpu = torch.cuda.is_available()
    hip = torch.version.hip is not None
    if device == "cpu" or (device == "auto" and not gpu):
        return "cpu"
    if device == "auto":
        return "rocm" if hip else "cuda"
    if device not in ("cuda", "rocm"):
        raise ValueError(f"--device {device!r} is not one of auto, cpu, cuda, rocm")
    if not gpu:
        raise DeviceError(f"--device {device}: no GPU is visible to this process "
                           f"(check {PINNING_VAR[device]}); use --device cpu to run on the CPU")
    if (device == "rocm") != hip:
        built = "ROCm (HIP)" if hip else "CUDA"
        raise DeviceError(f"--device {device}: this torch is a {built} build; "
                           f"use --device {'rocm' if hip else 'cuda'} or --device auto")
    return device


def expand_nodelist(nodelist):
    """Slurm hostlist -> hostnames: 'nid[005000-005002,005010],gcn7' -> ['nid005000', ...].

    Uses `scontrol show hostnames` when present (it knows every syntax), else parses
    the common forms here: comma lists and one bracket group per name, with zero padding.
    """
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                             text=True, timeout=30, check=True).stdout.split()
        if out:
            return out
    except (OSError, subprocess.SubprocessError):
        pass
    hosts = []
    for prefix, ranges, suffix in re.findall(r"([^,\[]+)(?:\[([^\]]*)\])?([^,\[]*)", nodelist):
        if not ranges:
            hosts.append(prefix + suffix)
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            width = len(lo)
            for i in range(int(lo), int(hi or lo) + 1):
                hosts.append(f"{prefix}{i:0{width}d}{suffix}")
    return hosts


def master_port_for_job(job_id):
    return MASTER_PORT_BASE + int(job_id) % MASTER_PORT_SPAN


def _rank_env(env):
    """(rank, local_rank, world_size) from torchrun's or srun's variables; (0, 0, 1) alone."""
    if "RANK" in env and "WORLD_SIZE" in env:
        return int(env["RANK"]), int(env.get("LOCAL_RANK", 0)), int(env["WORLD_SIZE"])
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        return int(env["SLURM_PROCID"]), int(env.get("SLURM_LOCALID", 0)), int(env["SLURM_NTASKS"])
    return 0, 0, 1


def _rendezvous_env(env, world_size):
    """Fill MASTER_ADDR/MASTER_PORT for srun launches (torchrun sets both itself)."""
    if world_size > 1 and "MASTER_ADDR" not in env:
        nodes = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        if not nodes:
            raise RuntimeError("MASTER_ADDR is unset and there is no SLURM_JOB_NODELIST: "
                               "launch with torchrun or srun, or export MASTER_ADDR")
        env["MASTER_ADDR"] = expand_nodelist(nodes)[0]
    if world_size > 1 and "MASTER_PORT" not in env:
        if "SLURM_JOB_ID" not in env:
            raise RuntimeError("MASTER_PORT is unset and there is no SLURM_JOB_ID to derive it "
                               "from: export MASTER_PORT or launch with torchrun")
        env["MASTER_PORT"] = str(master_port_for_job(env["SLURM_JOB_ID"]))


def _pick_gpu(accel, local_rank):
    """Index of this rank's GPU: LOCAL_RANK, or 0 when the site pinned one GPU per task."""
    count = torch.cuda.device_count()
    if count == 1:
        return 0                         # the site's pinning variable left exactly one GPU
    if local_rank >= count:
        raise RuntimeError(f"local rank {local_rank} but only {count} GPUs are visible; "
                           f"check {PINNING_VAR[accel]} and --ntasks-per-node")
    return local_rank


def eager_pg_init(env=os.environ):
    """$PWW_EAGER_PG_INIT: 1 (default) binds the NCCL process group to this rank's GPU at
    init_process_group (device_id: eager communicator setup), 0 does not."""
    value = env.get("PWW_EAGER_PG_INIT", "1")
    if value not in ("0", "1"):
        raise ConfigError(f"PWW_EAGER_PG_INIT={value!r}: use 1 (eager NCCL init with device_id, "
                          f"the default) or 0 (lazy, at the first collective)")
    return value == "1"


def init_distributed(device="auto", timeout_s=1800):
    """Choose device and backend, join (or create) the default process group; returns Dist.

    A process group always exists afterwards, even for one process, so DDP, FSDP2
    and the collectives in diloco.py run unchanged at world size 1. If the caller
    already initialised one (a test harness), it is adopted as is.
    """
    accel = detect_accel(device)
    eager = eager_pg_init()               # checked on every device: a typo fails on CPU too
    backend = "gloo" if accel == "cpu" else "nccl"
    rank, local_rank, world_size = _rank_env(os.environ)
    if dist.is_initialized():
        rank, world_size = dist.get_rank(), dist.get_world_size()
        backend = dist.get_backend()
    if accel == "cpu":
        dev = torch.device("cpu")
    else:
        dev = torch.device("cuda", _pick_gpu(accel, local_rank))
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        # device_id binds NCCL to this rank's GPU at once (no guessing in the first barrier),
        # and makes the communicators eagerly, the world's here and each new group's in
        # new_group(). PWW_EAGER_PG_INIT=0 leaves both to the first collective instead: one
        # of the candidates against LUMI's first-collective hang (sites/lumi.sh, smoke.py).
        kw = dict(timeout=datetime.timedelta(seconds=timeout_s),
                  device_id=dev if backend == "nccl" and eager else None)
        if world_size == 1 and "MASTER_ADDR" not in os.environ:
            # alone: an in-process store, no port to pick or collide on
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **kw)
        else:
            _rendezvous_env(os.environ, world_size)
            dist.init_process_group(backend, init_method="env://", rank=rank,
                                    world_size=world_size, **kw)
    return Dist(rank=rank, local_rank=local_rank, world_size=world_size, device=dev,
                backend=backend, accel=accel)
