"""bench/site_share.py - a site's per-round share of the wire format (int4 both ways, error
feedback on) with its delta encoded and theta's update added on the device, each rank its
own FSDP2 shard (train.py --encode-on device: shard_wire.py), beside the host path (rank 0's
numpy, file to file: --encode-on host) and beside an fsync'd F32 write of the same model
measured in the same run.

Runs on: any CPU box with the venv (torch, gloo): 2 ranks of FSDP2 on the CPU, spawned here
(the "device" is CPU torch: a GPU's own figure comes from bench/gpu_check.sh).
    python bench/site_share.py                  # Qwen3-0.6B's shapes (709M values; ~25 GB of --dir traffic)
    python bench/site_share.py --quick          # 0.6B's shapes, 2 layers, 8192 vocabulary rows (make bench)
    python bench/site_share.py --flavor tiny --ranks 3 --dir /tmp/x --keep
Needs about 3 x the fp32 model of memory and 4 x in --dir (0.6B: ~9 GB and ~11 GB).

What is timed, on rank 0, for one round that carries an owed residual (the first round
leaves it, untimed):
    up    FedMomCarrier.write_delta: host = full_tensor() of each tensor + numpy encode on
          rank 0 + the delta and residual files; device = each rank encodes its rows with
          wire_torch + gather of codes and scales + rank 0 writes the delta file, each rank
          its residual file (the files fsync'd, as in a run)
    down  the update of theta_global to the model's weights: host = wire.apply_update file
          to file (digest checked) + read_theta (the fp32 theta scattered from rank 0's
          file); device = FedMomCarrier.apply_update (the update's codes and scales
          broadcast, each rank adds its rows); its check behind (wire.apply_update on rank
          0's host, off the critical path) is timed and printed apart
and the baselines on rank 0: the model written as F32 with fsync (write-f32, the ratio's
unit), without (the page cache's rate: the device path fsyncs nothing on the way), and
read back. Both paths' delta files are compared (the same bits) and the device's theta
checked against the aggregator's digest. Printed: seconds, the ratio to write-f32, the
projection to Qwen3-8B linear in the parameter count at this run's ranks and cores, and
for a site of --site-ranks GPUs, whose devices do the encode and the addition in
milliseconds, rank 0's host bytes (files) at this run's measured rates, the arithmetic
shown. Random normal tensors; the shapes are what matters.
"""
import argparse
import json
import math
import os
import shutil
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)                 # run as `python bench/site_share.py`: the siblings one level up
sys.path.insert(1, HERE)                 # wire_speed.py: the Qwen3 shapes, the F32 write

import numpy as np  # noqa: E402

import tensorio  # noqa: E402
import wire  # noqa: E402
from wire_speed import FLAVORS, VOCAB, Clock, qwen3_shapes, read_f32, write_f32  # noqa: E402


def shapes_for(a):
    shapes = qwen3_shapes(a.flavor, 2 if a.quick else None)
    if a.quick:        # the embedding and output rows cut to 8192: the layers' shapes as they are
        shapes = [(n, (8192,) + s[1:] if s[0] == VOCAB else s) for n, s in shapes]
    return shapes


def Params(torch, shapes):
    """A module holding zero parameters of these shapes (named p0, p1, ...; the carrier names them)."""
    class Params(torch.nn.Module):
        def __init__(self):
            super().__init__()
            for i, (_, s) in enumerate(shapes):
                self.register_parameter(f"p{i}", torch.nn.Parameter(torch.zeros(s)))

        def forward(self, x):
            return x
    return Params()


def rank_main(rank, world, a, out):
    import torch
    import torch.distributed as dist
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(a.dir, 'store')}", rank=rank,
                            world_size=world)
    try:
        got = share(rank, world, a, torch, dist)
        if rank == 0:
            with open(out, "w") as f:
                json.dump(got, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def share(rank, world, a, torch, dist):
    from torch.distributed.fsdp import fully_shard

    import fedphase
    shapes = shapes_for(a)
    model = Params(torch, shapes)
    fully_shard(model)
    params = list(model.parameters())
    names = [n for n, _ in shapes]
    local = [torch.from_numpy(np.random.default_rng([rank, i]).standard_normal(tuple(p.to_local().shape),
                                                                               dtype=np.float32)) * 1e-3
             for i, p in enumerate(params)]
    times, quiet = {}, (lambda m: None)

    def timed(key, fn):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        times[key] = time.perf_counter() - t0

    carriers = {}
    for where in ("host", "device"):
        c = fedphase.FedMomCarrier(None, os.path.join(a.dir, where), "int4", fresh=True, log=quiet, encode_on=where)
        c.round = 0
        c.write_delta(names, params, local)                  # round 0 leaves a residual owed (not timed)
        if c.residual is not None:
            c.residual.settle(0, 1, "")
        c.round = 1
        timed(f"up {where}", lambda: c.write_delta(names, params, [x * -0.5 for x in local]))
        carriers[where] = c
    same = None
    if rank == 0:
        with open(carriers["host"].delta_path, "rb") as f, open(carriers["device"].delta_path, "rb") as g:
            same = f.read() == g.read()
    # theta (rank 0's fp32 file) and an int4 update of it, as the aggregator publishes them
    theta_path, upd = os.path.join(a.dir, "theta.safetensors"), os.path.join(a.dir, "update.safetensors")
    want = None
    if rank == 0:
        t0 = time.perf_counter()
        want = make_theta_and_update(theta_path, upd, shapes)
        print(f"   (theta and its update written in {time.perf_counter() - t0:.0f} s, not timed)", flush=True)
    dist.barrier()
    theta_local = [torch.empty_like(x) for x in local]
    host = carriers["host"]
    host.theta_path = theta_path
    host.read_theta(names, params, theta_local)               # every rank: theta_r, as it holds it
    nxt = os.path.join(a.dir, "theta-next.safetensors")
    box = {}

    def host_down():
        if rank == 0:
            box["digest"] = wire.apply_update(theta_path, upd, nxt, want)
        host.theta_path = nxt
        host.read_theta(names, params, [torch.empty_like(x) for x in local])
    timed("down host", host_down)
    dev = [x.clone() for x in theta_local]
    timed("down device", lambda: carriers["device"].apply_update(names, params, dev, upd))
    if rank == 0:
        t0 = time.perf_counter()
        wire.apply_update(theta_path, upd, nxt, want)        # the check behind, off the critical path
        times["check behind"] = time.perf_counter() - t0
    agree = device_digest(names, params, dev, torch, rank) == want
    if rank == 0:                  # the baselines, on rank 0: the model's F32 bytes written and read
        buf = np.empty(max(math.prod(s) for _, s in shapes), np.float32)
        buf[...] = 1
        times["write-f32"] = write_f32(theta_path, shapes, buf, os.path.join(a.dir, "base-write"))
        # what a file costs rank 0 when nothing waits for the disk (the delta, the residual's next file)
        times["write-f32 no fsync"] = write_f32(theta_path, shapes, buf, os.path.join(a.dir, "base-write"),
                                                fsync=False)
        times["read-f32"] = read_f32(theta_path, shapes, buf)
    return {"times": times, "same_delta": same, "device_theta_is_the_aggregators": agree,
            "wire_bytes": host.wire_bytes, "world": world, "threads": torch.get_num_threads()}


def make_theta_and_update(theta_path, upd, shapes):
    """theta (random normal) and an int4 update of a small random step -> the digest of theta + update."""
    want = wire.Digest()
    with tensorio.TensorWriter(theta_path, [(n, "F32", s) for n, s in shapes], {"round": "1"}) as tw, \
            wire.WireWriter(upd, shapes, wire.Codec("int4"), {"round": "2"}) as uw:
        for i, (n, s) in enumerate(shapes):
            theta = np.random.default_rng([7, i]).standard_normal(s, dtype=np.float32)
            tw.write(n, theta)
            sent = uw.write(n, np.random.default_rng([8, i]).standard_normal(s, dtype=np.float32) * np.float32(1e-3))
            want.add(n, wire.add_update(theta, sent))
    return want.hexdigest()


def device_digest(names, params, theta, torch, rank):
    """wire.Digest of the model as the ranks hold it (each tensor gathered, one at a time)."""
    from torch.distributed.tensor import DTensor
    d = wire.Digest()
    for n, p, t in zip(names, params, theta):
        full = DTensor.from_local(t, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()).full_tensor()
        if rank == 0:
            d.add(n, full.numpy())
    return d.hexdigest() if rank == 0 else None


def report(a, got, nvals):
    t = got["times"]
    base = t["write-f32"]
    n8 = sum(math.prod(s) for _, s in qwen3_shapes("8B"))
    print(f"{'phase':<26} {'seconds':>8} {'/ write-f32':>11}   ({got['world']} ranks of FSDP2 on CPU torch, "
          f"{got['threads']} threads each; {4 * nvals / 1e9:.2f} GB of fp32 values)")
    for k in ("write-f32", "write-f32 no fsync", "read-f32", "up host", "down host", "up device", "down device",
              "check behind"):
        print(f"{k:<26} {t[k]:8.2f} {t[k] / base:11.2f}")
    for where in ("host", "device"):
        s = t[f"up {where}"] + t[f"down {where}"]
        print(f"site share [{where}]: up + down = {s:.2f} s = {s / base:.2f} x write-f32 (target <= 0.50: "
              f"{'met' if s <= 0.5 * base else 'NOT met'}); linear at 8B ({s:.2f} s x {n8 / 1e9:.2f}G / "
              f"{nvals / 1e9:.3f}G values, at this run's ranks and cores): {s * n8 / nvals:.1f} s")
    # A site of W GPUs: the encode, the gathers and the additions are the devices' and the
    # interconnect's (a few ms per GB); what stays on rank 0's host is files: the int4 delta
    # written (0.52 B/param) and the update read (0.52), its residual shard read and written
    # (4/W each way); none fsync'd on the way, none but the update new to the page cache.
    w = a.site_ranks
    wr, rd = (0.52 + 4.0 / w) / 4.0 * t["write-f32 no fsync"], (0.52 + 4.0 / w) / 4.0 * t["read-f32"]
    print(f"a site of {w} GPUs (--site-ranks), the devices' work taken as ~0: rank 0's host writes "
          f"(0.52 + 4/{w}) B/param and reads as much: ({0.52 + 4.0 / w:.2f} / 4) x ({t['write-f32 no fsync']:.2f} + "
          f"{t['read-f32']:.2f}) s = {wr + rd:.2f} s = {(wr + rd) / base:.2f} x write-f32 (target <= 0.50: "
          f"{'met' if wr + rd <= 0.5 * base else 'NOT met'}); at 8B: {(wr + rd) * n8 / nvals:.1f} s (target <= 10 s: "
          f"{'met' if (wr + rd) * n8 / nvals <= 10 else 'NOT met'})")
    print(f"the device path's delta == the host path's, bit for bit: {got['same_delta']}; the theta it updated on the "
          f"devices has the aggregator's digest: {got['device_theta_is_the_aggregators']}; check behind "
          f"{t['check behind']:.2f} s (off the critical path)")
    if not (got["same_delta"] and got["device_theta_is_the_aggregators"]):
        sys.exit("site_share: the device path's bits differ from the host path's")


def main(a):
    import torch.multiprocessing as mp
    shapes = shapes_for(a)
    nvals = sum(math.prod(s) for _, s in shapes)
    shutil.rmtree(a.dir, ignore_errors=True)
    os.makedirs(a.dir)
    print(f"model: Qwen3-{a.flavor} shapes{' (2 layers, 8192 vocabulary rows: --quick)' if a.quick else ''}: "
          f"{len(shapes)} tensors, {nvals:,} values, {4 * nvals / 1e9:.2f} GB in fp32; {a.ranks} ranks; files in "
          f"{a.dir}", flush=True)
    out = os.path.join(a.dir, "result.json")
    try:
        mp.start_processes(rank_main, args=(a.ranks, a, out), nprocs=a.ranks, start_method="spawn")
        with open(out) as f:
            got = json.load(f)
        report(a, got, nvals)
    finally:
        if not a.keep:
            shutil.rmtree(a.dir, ignore_errors=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--flavor", choices=tuple(FLAVORS), default="0.6B", help="Qwen3 shapes (default 0.6B)")
    p.add_argument("--quick", action="store_true",
                   help="the flavor's shapes with 2 layers and 8192 vocabulary rows (make bench; < 1 min)")
    p.add_argument("--ranks", type=int, default=2, help="ranks of FSDP2 spawned here (default 2)")
    p.add_argument("--site-ranks", type=int, default=8,
                   help="ranks of a real site, for the host-bytes floor of the device path (default 8: one node)")
    p.add_argument("--dir", default="/tmp/site-share", help="scratch dir, ~4 x the fp32 model (default /tmp/site-share)")
    p.add_argument("--keep", action="store_true", help="keep the files afterwards (default: remove them)")
    args = p.parse_args()
    if args.ranks < 1 or args.site_ranks < 1:
        p.error("--ranks and --site-ranks must be >= 1")
    main(args)
