"""bench/tensorio_stream.py - write and read a Qwen3-1.7B-shaped bf16 file tensor by tensor.

Runs on: any machine with the venv. Not a test.

    .venv/bin/python bench/tensorio_stream.py                 # 1.95e9 parameters, 3.9 GB on disk
    .venv/bin/python bench/tensorio_stream.py --layers 4      # a quick, smaller run

The shape is torchtitan's Qwen3-1.7B (dim 2048, 28 layers, 16 heads / 8 kv heads of 128,
ffn 6144, untied output) with the 131,328-row vocabulary: 1,947,329,536 parameters;
the largest tensors are the embedding and the output projection, 538 MB each in bf16.

Measured in the same run, from a cold page cache (posix_fadvise DONTNEED after fsync):
  write   TensorWriter, one tensor at a time, fsync + rename at close
          (raw bf16 bits, and again from float32 arrays rounded by the writer)
  read    TensorReader.read() of every tensor in file order, into fresh arrays and
          (out=) into one reused buffer
  copy    baseline: a plain copy of the finished file (4 MiB reads and writes + fsync)
  scan    baseline: a plain sequential read of the file (4 MiB readinto)
Ratios: write / copy and read / scan. Peak RSS per phase (VmHWM, reset between
phases through /proc/self/clear_refs); target < 2 x largest tensor + 100 MiB.
The caller's data for the write phase is one pool the size of the largest tensor,
handed out as views, so it is counted in the peak (it is the "1 x largest").
"""
import argparse
import os
import shutil
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tensorio  # noqa: E402

CHUNK = 4 << 20


def qwen3_specs(layers=28, dim=2048, heads=16, kv_heads=8, head_dim=128, ffn=6144, vocab=131_328):
    specs = [("tok_embeddings.weight", (vocab, dim))]
    for i in range(layers):
        p = f"layers.{i}."
        specs += [(p + "attention.wq.weight", (heads * head_dim, dim)),
                  (p + "attention.wk.weight", (kv_heads * head_dim, dim)),
                  (p + "attention.wv.weight", (kv_heads * head_dim, dim)),
                  (p + "attention.wo.weight", (dim, heads * head_dim)),
                  (p + "attention.q_norm.weight", (head_dim,)), (p + "attention.k_norm.weight", (head_dim,)),
                  (p + "feed_forward.w1.weight", (ffn, dim)), (p + "feed_forward.w2.weight", (dim, ffn)),
                  (p + "feed_forward.w3.weight", (ffn, dim)),
                  (p + "attention_norm.weight", (dim,)), (p + "ffn_norm.weight", (dim,))]
    specs += [("norm.weight", (dim,)), ("output.weight", (vocab, dim))]
    return [(n, "BF16", s) for n, s in specs]


def reset_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_mib():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def evict(path):
    """Drop the file's (clean) pages from the page cache, so the next read comes from disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def write_file(path, specs, pool):
    """Time TensorWriter over views of `pool` (uint16 bits or float32 values)."""
    reset_peak()
    t0 = time.perf_counter()
    with tensorio.TensorWriter(path, specs, {"round": "0", "producer": "bench"}) as w:
        for name, _, shape in specs:
            n = int(np.prod(shape))
            w.write(name, pool[:n].reshape(shape))
    return time.perf_counter() - t0, peak_mib()


def read_file(path, reuse=False):
    """Time TensorReader.read() of every tensor: into fresh arrays, or into one reused buffer."""
    evict(path)
    reset_peak()
    t0 = time.perf_counter()
    total = 0
    with tensorio.TensorReader(path) as r:
        buf = np.empty(max(r.nbytes(n) for n in r.names) // 2, np.uint16) if reuse else None
        for name in r.names:
            total += r.read(name, out=buf).nbytes
    return time.perf_counter() - t0, peak_mib(), total


def plain_copy(src, dst):
    evict(src)
    buf = memoryview(bytearray(CHUNK))
    t0 = time.perf_counter()
    with open(src, "rb", buffering=0) as f, open(dst, "wb", buffering=0) as g:
        while True:
            n = f.readinto(buf)
            if not n:
                break
            g.write(buf[:n])
        os.fsync(g.fileno())
    dt = time.perf_counter() - t0
    os.unlink(dst)
    return dt


def plain_scan(path):
    evict(path)
    buf = memoryview(bytearray(CHUNK))
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass
    return time.perf_counter() - t0


def main(a):
    specs = qwen3_specs(layers=a.layers)
    largest = max(int(np.prod(s)) for _, _, s in specs)
    params = sum(int(np.prod(s)) for _, _, s in specs)
    tmp = tempfile.mkdtemp(prefix="tensorbench-", dir=a.dir)
    try:
        path = os.path.join(tmp, "model.safetensors")
        pool = np.random.default_rng(0).integers(0, 0x7F80, size=largest, dtype=np.uint16)
        w_s, w_peak = write_file(path, specs, pool)
        del pool
        size = os.path.getsize(path)
        r_s, r_peak, data_bytes = read_file(path)
        rr_s, rr_peak, _ = read_file(path, reuse=True)
        copy_s = plain_copy(path, os.path.join(tmp, "copy"))
        scan_s = plain_scan(path)
        pool32 = tensorio.bf16_to_f32(np.random.default_rng(1).integers(0, 0x7F80, size=largest, dtype=np.uint16))
        w32_s, w32_peak = write_file(path, specs, pool32)
        del pool32
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    gbs = lambda s: size / s / 1e9
    budget = 2 * largest * 2 / 2**20 + 100
    print(f"{params:,} parameters, {len(specs)} tensors, file {size / 1e9:.2f} GB, "
          f"largest tensor {largest * 2 / 2**20:.0f} MiB; RSS budget {budget:.0f} MiB")
    print(f"{'phase':<28} {'GB/s':>6} {'baseline':>9} {'ratio':>6} {'peak RSS MiB':>13}")
    print(f"{'write bf16 bits':<28} {gbs(w_s):>6.2f} {gbs(copy_s):>9.2f} {copy_s / w_s:>6.2f} {w_peak:>13.0f}   (baseline: copy)")
    print(f"{'write from float32':<28} {gbs(w32_s):>6.2f} {gbs(copy_s):>9.2f} {copy_s / w32_s:>6.2f} {w32_peak:>13.0f}   (baseline: copy)")
    print(f"{'read every tensor':<28} {gbs(r_s):>6.2f} {gbs(scan_s):>9.2f} {scan_s / r_s:>6.2f} {r_peak:>13.0f}   (baseline: scan)")
    print(f"{'read, out= one buffer':<28} {gbs(rr_s):>6.2f} {gbs(scan_s):>9.2f} {scan_s / rr_s:>6.2f} {rr_peak:>13.0f}   (baseline: scan)")
    assert data_bytes == params * 2


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=28, help="transformer layers (default 28, Qwen3-1.7B)")
    p.add_argument("--dir", default=None, help="where the temporary file goes (default: $TMPDIR or /tmp)")
    main(p.parse_args())
