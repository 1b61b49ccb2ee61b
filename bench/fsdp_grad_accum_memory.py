"""bench/fsdp_grad_accum_memory.py - peak memory of FSDP2 gradient accumulation, both ways.

Runs on: this machine's CPU (2 gloo ranks), or a node with 2 GPUs and `--device cuda`
(2 NCCL ranks, one GPU each). Usage:
    .venv/bin/python bench/fsdp_grad_accum_memory.py [--dim 768] [--layers 6] [--grad-accum 4]

The two ways train.py can accumulate gradients over --grad-accum micro-batches under FSDP2,
each measured in fresh processes on the same model, batch and ranks:
  baseline  --fsdp-defer-grad-sync: no reduce-scatter until the last micro-batch, so each
            rank holds the full unsharded fp32 gradient in between;
  default   reduce-scatter after every micro-batch: each rank only ever holds its shard.
Peak memory is the process's resident-set high-water mark over the training steps
(Linux VmHWM, reset after the warm-up step, with glibc told to map every tensor above
64 KiB on its own so that freed ones leave the resident set) on CPU,
torch.cuda.max_memory_allocated on a GPU; the figure printed per mode is the largest over
the ranks. The saving to expect is
the unsharded gradient less its shard, 4 bytes x params x (1 - 1/ranks).
"""
import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORLD = 2


def rss_hwm_bytes():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM:"))


def reset_rss_hwm():
    with open("/proc/self/clear_refs", "w") as f:   # "5": reset the peak RSS to the current RSS
        f.write("5")


def build(a, device):
    import models
    from torchtitan.models.qwen3 import Qwen3Model, Qwen3ModelArgs
    args = Qwen3ModelArgs(dim=a.dim, n_layers=a.layers, n_heads=a.dim // 64, n_kv_heads=a.dim // 128,
                          head_dim=64, hidden_dim=3 * a.dim, qk_norm=True, vocab_size=320,
                          max_seq_len=a.seq_len, attn_type="sdpa", attn_mask_type="causal")
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Qwen3Model(args)
    n = models.count_params(model)
    return models.parallelize(model, "fsdp", device), n


def worker(rank, tmp, a, defer, out_path):
    sys.path.insert(0, ROOT)
    import dist_env
    import train
    import train_step
    os.environ.update(GLOO_SOCKET_IFNAME="lo", LOCAL_RANK=str(rank))   # LOCAL_RANK: GPU `rank`
    torch.set_num_threads(1)
    dist.init_process_group("gloo" if a.device == "cpu" else "nccl",
                            init_method=f"file://{tmp}/store-{defer}", rank=rank, world_size=WORLD)
    d = dist_env.init_distributed(a.device)
    model, n_params = build(a, d.device)
    cfg = train.Config(parallel="fsdp", grad_accum=a.grad_accum, fsdp_defer_grad_sync=defer)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, 320, (a.batch_size, a.seq_len + 1), generator=gen).to(d.device)
               for _ in range(a.grad_accum)]

    def step():
        for i, b in enumerate(batches):
            with train_step.grad_sync(model, cfg, i == len(batches) - 1):
                loss = F.cross_entropy(model(b[:, :-1]).flatten(0, 1).float(), b[:, 1:].flatten())
            (loss / len(batches)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()                                           # warm-up: optimizer state exists now
    dist.barrier()
    if d.device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    else:
        reset_rss_hwm()
    t0 = time.perf_counter()
    for _ in range(a.steps):
        step()
    dt = (time.perf_counter() - t0) / a.steps
    peak = torch.cuda.max_memory_allocated() if d.device.type == "cuda" else rss_hwm_bytes()
    got = [None] * WORLD
    dist.all_gather_object(got, {"peak": peak, "step_s": dt, "params": n_params})
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(got, f)
    dist.destroy_process_group()


def measure(a, defer):
    # glibc keeps freed heap memory mapped, so the resident high-water mark would count
    # temporaries long dead; with a fixed mmap threshold every tensor above 64 KiB gets
    # its own mapping, returned on free, and VmHWM follows the live tensors (the workers
    # read this at start)
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.start_processes(worker, args=(tmp, a, defer, out), nprocs=WORLD, join=True, start_method="spawn")
        with open(out) as f:
            ranks = json.load(f)
    return {"peak": max(r["peak"] for r in ranks), "step_s": max(r["step_s"] for r in ranks),
            "params": ranks[0]["params"]}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--dim", type=int, default=768, help="model width (default 768: 43M parameters at 6 layers)")
    p.add_argument("--layers", type=int, default=6, help="transformer blocks (default 6)")
    p.add_argument("--grad-accum", type=int, default=4, help="micro-batches per step (default 4)")
    p.add_argument("--batch-size", type=int, default=1, help="sequences per micro-batch (default 1)")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sequence (default 64)")
    p.add_argument("--steps", type=int, default=2, help="measured optimizer steps (default 2)")
    a = p.parse_args(argv)
    base = measure(a, defer=True)
    new = measure(a, defer=False)
    n = base["params"]
    expect = 4 * n * (1 - 1 / WORLD)
    mib = 2 ** 20
    print(f"fsdp grad accumulation, {n / 1e6:.1f}M params, {WORLD} ranks, grad-accum {a.grad_accum}, "
          f"{a.device} ({'VmHWM' if a.device == 'cpu' else 'max_memory_allocated'} per rank, max over ranks)")
    print(f"  baseline --fsdp-defer-grad-sync  peak {base['peak'] / mib:8.1f} MiB   step {base['step_s']:.2f} s")
    print(f"  default  reduce-scatter each     peak {new['peak'] / mib:8.1f} MiB   step {new['step_s']:.2f} s")
    print(f"  saved {(base['peak'] - new['peak']) / mib:.1f} MiB per rank (expected ~{expect / mib:.1f} MiB: "
          f"4 B x params x (1 - 1/{WORLD})); peak ratio default/baseline {new['peak'] / base['peak']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
