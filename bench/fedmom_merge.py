"""bench/fedmom_merge.py - how fast is one durable FedMom merge of a Qwen3-0.6B-shaped model?

Runs on: the central VM (or any CPU box): stdlib + numpy + tensorio + fedmom_merge.
    python bench/fedmom_merge.py [--dir /tmp/fedmom-bench] [--deltas 2] [--repeats 2] [--keep]
Needs ~15 GB free in --dir (theta + momentum fp32, two fp16 deltas, the new theta and
momentum). Prints the merge's seconds, GB/s and peak RSS beside a baseline measured in
the same run: the same bytes read from and written to files with fsync and no
arithmetic (the I/O limit of a durable merge), and the ratios.

Model shapes: torchtitan 0.2.2's qwen3 "0.6B" (dim 1024, 28 layers, 16 heads, 8 kv
heads, head_dim 128, hidden 3072, q/k norms) with the vocabulary padded to 131,328
rows. torchtitan ties the output projection to the embedding for this flavor
(574,947,328 distinct parameters), but a state dict carries both names, so a delta
file holds both: 709,427,200 parameters, the count the design quotes.
Each phase runs in its own child process, so its peak RSS (VmHWM: anonymous and
file-backed pages, what `top` shows as RES at its highest) is its own.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import numpy as np  # noqa: E402

import durable  # noqa: E402
import fedmom_merge  # noqa: E402
import tensorio  # noqa: E402

VOCAB, DIM, LAYERS, HEADS, KV_HEADS, HEAD_DIM, HIDDEN = 131_328, 1024, 28, 16, 8, 128, 3072


def qwen3_shapes():
    """(name, shape) in torchtitan's state-dict order."""
    out = [("tok_embeddings.weight", (VOCAB, DIM))]
    for i in range(LAYERS):
        p = f"layers.{i}."
        out += [(p + "attention.wq.weight", (HEADS * HEAD_DIM, DIM)),
                (p + "attention.wk.weight", (KV_HEADS * HEAD_DIM, DIM)),
                (p + "attention.wv.weight", (KV_HEADS * HEAD_DIM, DIM)),
                (p + "attention.wo.weight", (DIM, HEADS * HEAD_DIM)),
                (p + "attention.q_norm.weight", (HEAD_DIM,)), (p + "attention.k_norm.weight", (HEAD_DIM,)),
                (p + "attention_norm.weight", (DIM,)),
                (p + "feed_forward.w1.weight", (HIDDEN, DIM)), (p + "feed_forward.w2.weight", (DIM, HIDDEN)),
                (p + "feed_forward.w3.weight", (HIDDEN, DIM)), (p + "ffn_norm.weight", (DIM,))]
    return out + [("norm.weight", (DIM,)), ("output.weight", (VOCAB, DIM))]


def peak_rss_bytes():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def make_files(d, ndeltas):
    rng = np.random.default_rng(0)
    shapes = qwen3_shapes()
    plan = [("theta.safetensors", "F32", 1.0), ("momentum.safetensors", "F32", 1e-3)]
    plan += [(f"delta{i}.safetensors", "F16", 1e-2) for i in range(ndeltas)]
    for fn, dtype, scale in plan:
        with tensorio.TensorWriter(os.path.join(d, fn), [(n, dtype, s) for n, s in shapes], fsync=True) as w:
            for n, s in shapes:
                a = rng.standard_normal(s, dtype=np.float32)
                a *= np.float32(scale)
                w.write(n, a)
                del a


def baseline(d, ndeltas):
    """Read every input byte, write the two outputs' bytes, fsync: no arithmetic."""
    inputs = ["theta.safetensors", "momentum.safetensors"] + [f"delta{i}.safetensors" for i in range(ndeltas)]
    out_size = os.path.getsize(os.path.join(d, "theta.safetensors"))
    buf = bytearray(64 << 20)
    view = memoryview(buf)
    t0 = time.perf_counter()
    nread = 0
    for fn in inputs:
        with open(os.path.join(d, fn), "rb", buffering=0) as f:
            while n := f.readinto(view):
                nread += n
    t_read = time.perf_counter() - t0
    nwritten = 0
    for fn in ("base-theta.out", "base-momentum.out"):
        with open(os.path.join(d, fn), "wb", buffering=0) as f:
            left = out_size
            while left:
                n = f.write(view[:min(left, len(view))])
                left -= n
                nwritten += n
            os.fsync(f.fileno())
        durable.fsync_dir(d)                 # a new name is durable once its directory is (as in the merge)
    dt = time.perf_counter() - t0
    for fn in ("base-theta.out", "base-momentum.out"):
        os.unlink(os.path.join(d, fn))
    return {"seconds": dt, "bytes_read": nread, "bytes_written": nwritten, "peak_rss": peak_rss_bytes(),
            "read_s": t_read, "write_s": dt - t_read}


def merge(d, ndeltas):
    deltas = [(os.path.join(d, f"delta{i}.safetensors"), w) for i, w in
              enumerate(np.full(ndeltas, 1.0 / ndeltas))]
    t0 = time.perf_counter()
    st = fedmom_merge.merge_files(os.path.join(d, "theta.safetensors"), os.path.join(d, "momentum.safetensors"),
                                  deltas, os.path.join(d, "theta-new.safetensors"),
                                  os.path.join(d, "momentum-new.safetensors"), 0.7, 0.9, {"round": "1"})
    dt = time.perf_counter() - t0
    for fn in ("theta-new.safetensors", "momentum-new.safetensors"):
        os.unlink(os.path.join(d, fn))
    return {"seconds": dt, "bytes_read": st["bytes_read"], "bytes_written": st["bytes_written"],
            "peak_rss": peak_rss_bytes()}


def child(phase, d, ndeltas):
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", phase, "--dir", d,
                          "--deltas", str(ndeltas)], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(a):
    if a.child:
        fn = {"make": lambda: make_files(a.dir, a.deltas) or {}, "baseline": lambda: baseline(a.dir, a.deltas),
              "merge": lambda: merge(a.dir, a.deltas)}[a.child]
        print(json.dumps(fn()))
        return
    shapes = qwen3_shapes()
    nparams = sum(int(np.prod(s)) for _, s in shapes)
    largest = max(int(np.prod(s)) for _, s in shapes) * 4
    os.makedirs(a.dir, exist_ok=True)
    print(f"model: Qwen3-0.6B shapes, vocab {VOCAB:,}: {len(shapes)} tensors, {nparams:,} parameters; "
          f"largest tensor {largest / 2**20:.0f} MiB in fp32; {a.deltas} fp16 deltas; files in {a.dir}")
    t0 = time.perf_counter()
    child("make", a.dir, a.deltas)
    print(f"made the input files in {time.perf_counter() - t0:.0f} s")
    # interleaved, twice: the disk is shared, so one run of each could land in different weather
    runs = [(name, child(name, a.dir, a.deltas)) for _ in range(a.repeats) for name in ("baseline", "merge")]
    print(f"{'phase':<10} {'seconds':>8} {'GB read':>8} {'GB written':>10} {'GB/s':>6} {'peak RSS MiB':>12}  detail")
    for name, r in runs:
        gb = (r["bytes_read"] + r["bytes_written"]) / 1e9
        detail = f"read {r['read_s']:.1f} s + write/fsync {r['write_s']:.1f} s" if "read_s" in r else ""
        print(f"{name:<10} {r['seconds']:8.1f} {r['bytes_read'] / 1e9:8.2f} {r['bytes_written'] / 1e9:10.2f} "
              f"{gb / r['seconds']:6.2f} {r['peak_rss'] / 2**20:12.0f}  {detail}")
    # conservative: the fastest baseline against the slowest merge
    base = min((r for n, r in runs if n == "baseline"), key=lambda r: r["seconds"])
    m = max((r for n, r in runs if n == "merge"), key=lambda r: r["seconds"])
    ratio = base["seconds"] / m["seconds"]
    budget = 4 * largest + (200 << 20)
    print(f"merge throughput / baseline (fastest baseline vs slowest merge): {ratio:.2f} (target >= 0.60: {'met' if ratio >= 0.6 else 'NOT met'})")
    print(f"merge peak RSS {m['peak_rss'] / 2**20:.0f} MiB vs 4 x largest fp32 tensor + 200 MiB = "
          f"{budget / 2**20:.0f} MiB: {m['peak_rss'] / budget:.2f} of the budget "
          f"({'met' if m['peak_rss'] <= budget else 'NOT met'}); the dense model alone is "
          f"{nparams * 4 / 2**20:.0f} MiB in fp32")
    if not a.keep:
        shutil.rmtree(a.dir, ignore_errors=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default="/tmp/fedmom-bench", help="scratch dir for ~15 GB of files (default /tmp/fedmom-bench)")
    p.add_argument("--deltas", type=int, default=2, help="fp16 deltas merged (default 2)")
    p.add_argument("--repeats", type=int, default=2, help="baseline/merge pairs, interleaved (default 2)")
    p.add_argument("--keep", action="store_true", help="keep the files afterwards (default: remove them)")
    p.add_argument("--child", choices=("make", "baseline", "merge"), help=argparse.SUPPRESS)
    main(p.parse_args())
