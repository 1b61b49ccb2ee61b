"""metrics.py - what a training run reports: train.log, metrics.jsonl rows, TensorBoard, MFU, provenance.

Runs on: compute nodes (every rank; rank 0 writes), imported by train.py. Not started on
its own; no port. Writes into the run directory train.py made (runs/<run>/):
    train.log       what rank 0 printed (RunLog.log), one timestamped line each
    metrics.jsonl   one JSON row per line (RunLog.metric); which rows train.py's docstring
                    names, their keys FEDERATION_GUIDE.md, "Reading the metrics". Every row gets the job's `<unit>_total` (tokens
                    or img trained by all ranks so far, kept across --resume), this process's
                    `incarnation` and the wall `time`
    --tensorboard DIR  the same rows as scalars: <split>/<key> against the step, and
                    <split>/loss_by_<unit> against the total (tensorboard_row)

MFU = the model's training FLOPs x throughput per rank / the device's dense bf16 peak
(PEAK_BF16_FLOPS, matched on the whole device name); CPUs and unlisted GPUs report None.
provenance() is the first line of every run's log and the `provenance` entry of its
config.yaml: the code (git hash, or the sha256 of every *.py on an air-gapped copy), the
library versions and every rank's device (a collective: every rank calls it).
"""
import datetime
import hashlib
import json
import math
import os
import platform
import re
import resource
import secrets
import socket
import subprocess
import time

import torch
import torch.distributed as dist

from dist_env import ConfigError, print0

# Peak dense (no sparsity) bf16 FLOP/s per device, i.e. per rank, for MFU, from the
# vendors' datasheets. Matched against the whole device name (torch.cuda.get_device_name,
# "NVIDIA " dropped), because the form factors differ by up to 30 %: an H100 PCIe card
# peaks at 756 TFLOP/s, an SXM one at 989, and a substring match on "H100" credited every
# card with the SXM figure. An MI250X package is two GCDs, each its own rank: 383 TFLOP/s
# per package = 191.5 per GCD (MI250: 362.1 = 181.0). A name not listed gets no MFU.
PEAK_BF16_FLOPS = (
    (r"H100 PCIe", 756e12),
    (r"H100 NVL", 835e12),
    (r"H100( SXM5?)?( \d+GB)?( HBM3)?", 989e12),      # "NVIDIA H100 80GB HBM3" = SXM5
    (r"H200 NVL", 835e12),
    (r"H200( SXM)?( \d+GB)?( HBM3e)?", 989e12),       # "NVIDIA H200" = SXM
    (r"A100[- ](SXM4|PCIE)-\d+GB|A100 \d+GB PCIe|A100", 312e12),   # same peak in both forms
    (r"AMD Instinct MI250X", 191.5e12),
    (r"AMD Instinct MI250", 181.0e12),
)


def peak_flops_for(name, compute_units=None):
    """Peak bf16 FLOP/s for a device name (the table above), or None. ROCm may name both
    MI250 variants "AMD Instinct MI250X/MI250"; the compute units per GCD tell them apart
    (MI250X: 110, MI250: 104)."""
    bare = name.removeprefix("NVIDIA ").strip()
    if bare == "AMD Instinct MI250X/MI250" and compute_units:
        bare = "AMD Instinct MI250X" if compute_units >= 110 else "AMD Instinct MI250"
    return next((v for pat, v in PEAK_BF16_FLOPS if re.fullmatch(pat, bare)), None)


def peak_flops(d):
    """This rank's device peak bf16 FLOP/s, or None (CPUs and unknown GPUs: MFU not reported)."""
    if d.accel == "cpu":
        return None
    name = torch.cuda.get_device_name(d.device)
    peak = peak_flops_for(name, torch.cuda.get_device_properties(d.device).multi_processor_count)
    if peak is None:
        print0(f"MFU not reported: no bf16 peak for device {name!r} in metrics.PEAK_BF16_FLOPS")
    return peak


def peak_memory_gib(d):
    if d.accel == "cpu":
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20   # KiB on Linux
    return torch.cuda.max_memory_allocated(d.device) / 2**30


class RunLog:
    """Rank 0 prints and appends to train.log and metrics.jsonl (and TensorBoard scalars
    with --tensorboard); other ranks stay quiet. Every metrics row carries the cumulative
    `<unit>_total` (tokens or img trained by the whole job so far, kept across a resume)
    and this process's `incarnation`, so loss-vs-tokens needs no arithmetic and rows from
    before and after a resume can be told apart."""

    def __init__(self, run_dir, is_main, tensorboard=None):
        self.is_main = is_main
        self.log_f = open(os.path.join(run_dir, "train.log"), "a") if is_main else None
        self.metrics_f = open(os.path.join(run_dir, "metrics.jsonl"), "a") if is_main else None
        self.total_key, self.total, self.incarnation = "tokens_total", 0, secrets.token_hex(6)
        writer = tensorboard_writer(tensorboard) if tensorboard else None    # every rank: all fail alike
        self.tb = writer(tensorboard) if writer and is_main else None

    def log(self, msg):
        if self.is_main:
            line = f"{time.strftime('%H:%M:%S')} {msg}"
            print(line, flush=True)
            self.log_f.write(line + "\n")
            self.log_f.flush()

    def metric(self, row):
        if self.is_main:
            row = {**row, self.total_key: self.total, "incarnation": self.incarnation, "time": round(time.time(), 3)}
            self.metrics_f.write(json.dumps(row) + "\n")
            self.metrics_f.flush()
            if self.tb is not None:
                tensorboard_row(self.tb, row, self.total_key)

    def close(self):
        for f in (self.log_f, self.metrics_f, self.tb):
            if f:
                f.close()


def tensorboard_writer(path):
    """torch's SummaryWriter class, or a one-line error naming the package to install."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        raise ConfigError(f"--tensorboard {path}: torch.utils.tensorboard needs the tensorboard package "
                          f"({e}): pip install tensorboard, or drop --tensorboard") from None
    return SummaryWriter


def tensorboard_row(tb, row, total_key):
    """Every number of a metrics row as <split>/<key> against the step; the loss against
    tokens too (<split>/loss_by_<unit>), since TensorBoard plots one x axis per scalar."""
    split, step = row.get("split", "train"), row.get("step") or 0
    for k, v in row.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in ("step", "time") \
                and math.isfinite(v):
            tb.add_scalar(f"{split}/{k}", v, step)
    if isinstance(row.get("loss"), float):
        tb.add_scalar(f"{split}/loss_by_{total_key.removesuffix('_total')}", row["loss"], row[total_key])
    tb.flush()


def fmt_row(row):
    return " ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                    for k, v in row.items() if v is not None and k != "split")


def provenance(d, root=None):
    """What produced this run: code version, library versions, devices, world size."""
    root = root or os.path.dirname(os.path.abspath(__file__))
    prov = {"python": platform.python_version(), "torch": str(torch.__version__),
            "hip": torch.version.hip, "cuda": torch.version.cuda,
            "host": socket.gethostname(), "world_size": d.world_size, "accel": d.accel,
            "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
            "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}
    try:
        from importlib.metadata import version
        prov["torchtitan"] = version("torchtitan")
    except Exception:                            # not installed: the CIFAR path does not need it
        prov["torchtitan"] = None
    prov["devices"] = device_names(d)
    try:
        git = lambda *a: subprocess.run(["git", "-C", root, *a], capture_output=True, text=True,
                                        timeout=10, check=True).stdout.strip()
        prov["git"] = git("rev-parse", "HEAD")
        prov["git_dirty"] = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        # an air-gapped copy without .git: identify the code by its bytes
        prov["sha256"] = {f: hashlib.sha256(open(os.path.join(root, f), "rb").read()).hexdigest()
                          for f in sorted(os.listdir(root)) if f.endswith(".py")}
    return prov


def device_names(d):
    """Every rank's device name, gathered (collective)."""
    if d.accel == "cpu":
        name = platform.processor() or platform.machine()
        try:
            with open("/proc/cpuinfo") as f:
                name = next(l.split(":", 1)[1].strip() for l in f if l.startswith("model name"))
        except (OSError, StopIteration):
            pass
    else:
        name = torch.cuda.get_device_name(d.device)
    names = [None] * d.world_size
    dist.all_gather_object(names, f"{socket.gethostname()}:{name}")
    return names
