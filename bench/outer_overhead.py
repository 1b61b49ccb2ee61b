"""bench/outer_overhead.py - what the DiLoCo outer step costs against the inner step.

Runs on: this machine's CPU (2 gloo ranks, k=2 replicas of one rank each), or any
node with `--device cuda`. Usage:
    .venv/bin/python bench/outer_overhead.py [--model qwen3-tiny] [--steps 100] [--seq-len 128] [--batch-size 8]

Measured in one run, on the same model, batch and ranks:
  baseline  inner steps alone (forward, next-token loss, backward, AdamW), no DiLoCo
  inner     the same steps with DiLoCo attached (every step pays only a counter)
  outer     the outer step: deltas, one all-reduce over the 2 replicas, Nesterov, copy-back
Overhead at H = outer / (H x inner), for H = 10, 100, 500, and measured directly
at H=10 as (wall time of H=10 training) / (baseline wall time) - 1.
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORLD, K = 2, 2


def timed_steps(step, n, outer=None):
    """Per-step seconds (inner part only when outer is given) and the outer rows."""
    inner, rows = [], []
    for _ in range(n):
        t0 = time.perf_counter()
        step()
        inner.append(time.perf_counter() - t0)
        if outer is not None:
            row = outer.after_inner_step()
            if row:
                rows.append(row)
    return inner, rows


def worker(rank, tmp, a):
    sys.path.insert(0, ROOT)                       # siblings of the repository root
    import diloco
    import dist_env
    import models
    from outer_state import OUTER_LR, OUTER_MOMENTUM
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    dist.init_process_group("gloo" if a.device == "cpu" else "nccl",
                            init_method=f"file://{tmp}/store", rank=rank, world_size=WORLD)
    d = dist_env.init_distributed(a.device)           # adopts the group, picks the device
    model = models.build_model(a.model, vocab_size=259, seq_len=a.seq_len)
    models.materialize(model, d.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(rank)
    batch = torch.randint(0, 259, (a.batch_size, a.seq_len + 1), generator=gen).to(d.device)

    def step():
        out = model(batch[:, :-1])
        loss = torch.nn.functional.cross_entropy(out.flatten(0, 1).float(), batch[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if d.device.type == "cuda":
            torch.cuda.synchronize()

    layout = diloco.ReplicaLayout.build(WORLD, rank, K)
    outer = diloco.DiLoCo(model, layout, diloco.DiLoCoConfig(inner_steps=10, outer_lr=OUTER_LR, outer_momentum=OUTER_MOMENTUM))
    timed_steps(step, 5)                                          # warm-up
    # The two arms alternate in blocks of H=10 steps, so a load change on this
    # shared machine hits both alike. Baseline steps never call DiLoCo.
    base, inner, rows, base_wall, h10_wall = [], [], [], 0.0, 0.0
    for _ in range(a.steps // 10):
        dist.barrier()
        t0 = time.perf_counter()
        base += timed_steps(step, 10)[0]
        t1 = time.perf_counter()
        i, r = timed_steps(step, 10, outer)
        h10_wall += time.perf_counter() - t1
        base_wall += t1 - t0
        inner, rows = inner + i, rows + r
    # The outer step alone: after a barrier nobody waits for a slower replica.
    alone = []
    for _ in range(5):
        step()
        outer.after_inner_step()                                  # 1 of H: no outer step yet
        dist.barrier()
        alone.append(outer.finish()["outer_ms"] / 1e3)
    res = {"base": statistics.median(base), "inner": statistics.median(inner),
           "outer": statistics.median(r["outer_ms"] for r in rows) / 1e3, "n_outer": len(rows),
           "alone": statistics.median(alone),
           "base_wall": base_wall, "h10_wall": h10_wall,
           "params": sum(p.numel() for p in model.parameters())}
    got = [None] * WORLD
    dist.all_gather_object(got, res)
    if rank == 0:
        report(a, got)
    dist.destroy_process_group()


def report(a, got):
    ms = lambda key: max(g[key] for g in got) * 1e3               # the slower rank sets the pace
    base, inner, outer, alone = ms("base"), ms("inner"), ms("outer"), ms("alone")
    print(f"{a.model}: {got[0]['params']:,} parameters, batch {a.batch_size} x {a.seq_len} tokens, "
          f"{WORLD} ranks, k={K} replicas, device {a.device}, {a.steps} timed steps per arm")
    print(f"{'':34} {'median ms':>10}  vs baseline")
    print(f"{'baseline inner step (no DiLoCo)':34} {base:10.2f}  1.000")
    print(f"{'inner step with DiLoCo attached':34} {inner:10.2f}  {inner / base:.3f}")
    print(f"{'outer step in the loop (' + str(got[0]['n_outer']) + ' steps)':34} {outer:10.2f}  {outer / base:.3f}"
          "   includes waiting for the slower replica")
    print(f"{'outer step after a barrier':34} {alone:10.2f}  {alone / base:.3f}")
    for h in (10, 100, 500):
        print(f"overhead at H={h:<4} (outer / (H x inner)) {100 * outer / (h * inner):8.2f} %"
              f"   after a barrier: {100 * alone / (h * inner):6.2f} %")
    wall = max(g["h10_wall"] for g in got) / max(g["base_wall"] for g in got) - 1
    print(f"overhead at H=10 measured on wall time      {100 * wall:8.2f} %   (interleaved arms; noisy on a shared machine)")


def main(argv=None):
    p = argparse.ArgumentParser(description="DiLoCo outer-step overhead on 2 ranks, k=2.")
    p.add_argument("--model", default="qwen3-tiny", help="models.py name (default qwen3-tiny)")
    p.add_argument("--steps", type=int, default=100, help="timed inner steps per arm, a multiple of 10 (default 100)")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (default 128)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per rank (default 8)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="default cpu (gloo)")
    a = p.parse_args(argv)
    if a.steps < 10:
        p.error(f"--steps {a.steps}: need >= 10 for one outer step at H=10")
    with tempfile.TemporaryDirectory(prefix="outer-overhead-") as tmp:
        mp.start_processes(worker, args=(tmp, a), nprocs=WORLD, join=True, start_method="spawn")


if __name__ == "__main__":
    main()
