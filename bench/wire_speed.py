"""bench/wire_speed.py - how fast are wire.py's int4 encode, decode, apply and digest at a
real model's shapes, against the fsync'd F32 write of the same model in the same run?

Runs on: any CPU box (a site's rank 0, the central VM): stdlib + numpy + tensorio + wire.
    python bench/wire_speed.py [--flavor 0.6B|1.7B|8B|tiny] [--threads N] [--dir /tmp/wire-speed] [--keep]
    python bench/wire_speed.py --quick        # 0.6B's shapes with 2 of its 28 layers, no reference runs (make bench)
Needs about 4 x the model in fp32 free in --dir (0.6B: ~11 GB): the model, the int4
update, the decoded delta and the applied theta.

Shapes: torchtitan 0.2.2's qwen3 flavors, as models.py builds them (the numbers are
copied here so that the bench needs no torch): the vocabulary padded to 131,328 rows,
both tok_embeddings and output in the file (a state dict carries both names even where
torchtitan ties them): 0.6B is 311 tensors, 709,427,200 values. Tensors are random
normal float32, made one at a time from a seed: nothing holds the model.

Phases, each timed alone and printed with seconds, GB/s of fp32 values and the ratio to
the fsync'd write:
    write-f32     baseline: the model written as F32 with fsync (tensorio.TensorWriter)
    read-f32      baseline: the model read back (page cache warm) into one reused buffer
    memcpy        baseline: the model's bytes copied once in memory (np.copyto, reused buffers)
    encode        int4 encode + write (wire.WireWriter), fsync'd
    decode        the int4 file -> a plain F32 file (wire.decode_file), fsync'd
    apply         theta + the int4 update -> the next theta, digest checked (wire.apply_update), fsync'd
    digest        wire.theta_digest of the model (one sha256 over every tensor, in order)
    sha256        baseline of digest: hashlib over the same bytes already in memory
encode/decode/apply run with the reference path (the plain numpy codec of wire.py as it was,
a tensor at a time, nothing behind: `ref`), threads=1 and threads=N; the reference's
digest is the one the fast applies must reproduce, so every run also checks the bits.
The machine is what it is: on a shared 2-core box the ratios are noisy; run it twice.
"""
import argparse
import hashlib
import math
import os
import shutil
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import numpy as np  # noqa: E402

import tensorio  # noqa: E402
import wire  # noqa: E402

VOCAB = 131_328
# torchtitan 0.2.2 qwen3_args: dim, layers, heads, kv heads, head_dim, hidden (tiny: models.py's)
FLAVORS = {"tiny": (64, 2, 4, 2, 16, 192), "0.6B": (1024, 28, 16, 8, 128, 3072),
           "1.7B": (2048, 28, 16, 8, 128, 6144), "8B": (4096, 36, 32, 8, 128, 12288)}


def qwen3_shapes(flavor, layers=None):
    """(name, shape) in torchtitan's state-dict order (tiny: the byte vocabulary, 320 rows)."""
    dim, nl, heads, kv, hd, hidden = FLAVORS[flavor]
    vocab = 320 if flavor == "tiny" else VOCAB
    out = [("tok_embeddings.weight", (vocab, dim))]
    for i in range(nl if layers is None else layers):
        p = f"layers.{i}."
        out += [(p + "attention.q_norm.weight", (hd,)), (p + "attention.k_norm.weight", (hd,)),
                (p + "attention.wq.weight", (heads * hd, dim)), (p + "attention.wk.weight", (kv * hd, dim)),
                (p + "attention.wv.weight", (kv * hd, dim)), (p + "attention.wo.weight", (dim, heads * hd)),
                (p + "feed_forward.w1.weight", (hidden, dim)), (p + "feed_forward.w2.weight", (dim, hidden)),
                (p + "feed_forward.w3.weight", (hidden, dim)),
                (p + "attention_norm.weight", (dim,)), (p + "ffn_norm.weight", (dim,))]
    return out + [("norm.weight", (dim,)), ("output.weight", (vocab, dim))]


def make(path, shapes, seed, scale):
    """A random F32 tensor file, one tensor at a time (not timed)."""
    with tensorio.TensorWriter(path, [(n, "F32", s) for n, s in shapes], fsync=False) as w:
        for i, (n, s) in enumerate(shapes):
            a = np.random.default_rng([seed, i]).standard_normal(s, dtype=np.float32)
            a *= np.float32(scale)
            w.write(n, a)


class Clock:
    """Seconds spent inside `with clock:` blocks only (the untimed reads between stay out)."""

    def __init__(self):
        self.s = 0.0

    def __enter__(self):
        self.t0 = time.perf_counter()

    def __exit__(self, *exc):
        self.s += time.perf_counter() - self.t0


def write_f32(src, shapes, buf, scratch, fsync=True):
    """Seconds to write the F32 tensors of file `src` to `scratch`, with fsync unless told
    not to (the reads of src between the writes not timed); scratch is removed after."""
    clock = Clock()
    with tensorio.TensorReader(src) as r:
        w = tensorio.TensorWriter(scratch, [(n, "F32", s) for n, s in shapes], fsync=fsync)
        for n, _ in shapes:
            a = r.read(n, out=buf)
            with clock:
                w.write(n, a)
        with clock:
            w.close()
    os.unlink(scratch)
    return clock.s


def read_f32(path, shapes, buf):
    """Seconds to read every tensor of `path` into one reused buffer."""
    t0 = time.perf_counter()
    with tensorio.TensorReader(path) as r:
        for n, _ in shapes:
            r.read(n, out=buf)
    return time.perf_counter() - t0


def memcpy(shapes, src, dst):
    t0 = time.perf_counter()
    for _, s in shapes:
        k = math.prod(s)
        np.copyto(dst[:k], src[:k])
    return time.perf_counter() - t0


def encode(d, shapes, buf, threads, reference):
    """delta -> update (int4), timed around the encode and the writes only."""
    codec, clock = wire.Codec("int4"), Clock()
    with tensorio.TensorReader(os.path.join(d, "delta")) as r:
        w = wire.WireWriter(os.path.join(d, "update"), shapes, codec, {"base_round": "0"}, threads=threads or 1)
        for n, s in shapes:
            x = r.read(n, out=buf).reshape(s)
            with clock:
                if reference:
                    w.write_parts(n, codec.encode(x, reference=True)[0])
                else:
                    w.write(n, x)
        with clock:
            w.close()
    return clock.s


def decode_reference(src, dst):
    """decode_file as it was: a tensor at a time, the plain codec, each array new, nothing behind."""
    with wire.WireReader(src, threads=1) as r:
        with tensorio.TensorWriter(dst, [(n, "F32", r.shapes[n]) for n in r.names]) as w:
            for n in r.names:
                parts = {p[len(n):]: r.r.read(p) for p, _, _ in r.codec.parts(n, r.shapes[n])}
                w.write(n, r.codec.decode(parts, r.shapes[n], reference=True))


def apply_reference(theta_path, update_path, out_path):
    """apply_update as it was -> the digest of the new theta."""
    dg = wire.Digest()
    with tensorio.TensorReader(theta_path) as prev, wire.WireReader(update_path, threads=1) as upd:
        with tensorio.TensorWriter(out_path, [(n, "F32", prev.specs[n][1]) for n in prev.names]) as w:
            for n in prev.names:
                parts = {p[len(n):]: upd.r.read(p) for p, _, _ in upd.codec.parts(n, upd.shapes[n])}
                theta = wire.add_update(prev.read(n).reshape(upd.shapes[n]),
                                        upd.codec.decode(parts, upd.shapes[n], reference=True))
                dg.add(n, theta)
                w.write(n, theta)
    return dg.hexdigest()


def timed(fn, *args):
    t0 = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - t0, out


def main(a):
    shapes = qwen3_shapes(a.flavor, 2 if a.quick else None)
    nvals = sum(math.prod(s) for _, s in shapes)
    largest = max(math.prod(s) for _, s in shapes)
    nbytes = 4 * nvals
    threads = wire.resolve_threads(a.threads)
    d = a.dir
    os.makedirs(d, exist_ok=True)
    print(f"model: Qwen3-{a.flavor} shapes{' (2 layers: --quick)' if a.quick else ''}: {len(shapes)} tensors, "
          f"{nvals:,} values, {nbytes / 1e9:.2f} GB in fp32, largest tensor {largest * 4 / 2**20:.0f} MiB; "
          f"threads N = {threads} (os.cpu_count() {os.cpu_count()}); files in {d}")
    t0 = time.perf_counter()
    make(os.path.join(d, "theta"), shapes, 1, 1.0)
    make(os.path.join(d, "delta"), shapes, 2, 1e-3)
    print(f"made theta and a delta in {time.perf_counter() - t0:.0f} s")
    buf, buf2 = np.empty(largest, np.float32), np.empty(largest, np.float32)
    buf[...] = 1
    buf2[...] = 0                                    # both touched: no page faults in what is timed
    rows = [("write-f32", write_f32(os.path.join(d, "delta"), shapes, buf, os.path.join(d, "base-write"))),
            ("read-f32", read_f32(os.path.join(d, "theta"), shapes, buf)),
            ("memcpy", memcpy(shapes, buf, buf2))]
    runs = ([("ref", None)] if not a.quick else []) + [("1", 1), ("N", threads)]
    want = None
    for label, th in runs:
        rows.append((f"encode [{label}]", encode(d, shapes, buf, th, th is None)))
        upd, dst = os.path.join(d, "update"), os.path.join(d, "decoded")
        if th is None:
            s, _ = timed(decode_reference, upd, dst)
        else:
            s, _ = timed(wire.decode_file, upd, dst, True, None, th)
        rows.append((f"decode [{label}]", s))
        out = os.path.join(d, "theta-next")
        if th is None:
            s, want = timed(apply_reference, os.path.join(d, "theta"), upd, out)
        else:
            if want is None:                          # --quick: the digest to match, from the reference, untimed
                want = apply_reference(os.path.join(d, "theta"), upd, out)
            s, got = timed(wire.apply_update, os.path.join(d, "theta"), upd, out, want, None, True, th)
            assert got == want
        rows.append((f"apply [{label}]", s))
    for label, th in (("1", 1), ("N", threads)):
        rows.append((f"digest [{label}]", timed(wire.theta_digest, os.path.join(d, "theta"), th)[0]))
    h, t0 = hashlib.sha256(), time.perf_counter()
    for _, s in shapes:
        h.update(buf[:math.prod(s)].data)
    rows.append(("sha256", time.perf_counter() - t0))
    base = rows[0][1]
    print(f"{'phase':<14} {'seconds':>8} {'GB/s':>7} {'/ write-f32':>11}   (GB of fp32 values: {nbytes / 1e9:.2f})")
    for name, s in rows:
        print(f"{name:<14} {s:8.2f} {nbytes / 1e9 / s:7.2f} {s / base:11.2f}")
    r = dict(rows)
    for label in [lab for lab, _ in runs]:
        site = r[f"encode [{label}]"] + r[f"apply [{label}]"]
        print(f"site encode + apply [{label}]: {site:.2f} s = {site / base:.2f} x write-f32 (target <= 0.50: "
              f"{'met' if site <= 0.5 * base else 'NOT met'}); linear at 8B "
              f"({sum(math.prod(s) for _, s in qwen3_shapes('8B')) / 1e9:.1f}G values): "
              f"{site * sum(math.prod(s) for _, s in qwen3_shapes('8B')) / nvals:.1f} s")
    if not a.keep:
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--flavor", choices=tuple(FLAVORS), default="0.6B", help="Qwen3 shapes (default 0.6B)")
    p.add_argument("--quick", action="store_true",
                   help="the flavor's shapes with 2 layers only, no reference runs (make bench)")
    p.add_argument("--threads", type=int, default=None,
                   help="threads of the N runs (default: $WIRE_THREADS, else every core)")
    p.add_argument("--dir", default="/tmp/wire-speed", help="scratch dir, ~4 x the fp32 model (default /tmp/wire-speed)")
    p.add_argument("--keep", action="store_true", help="keep the files afterwards (default: remove them)")
    args = p.parse_args()
    try:
        wire.resolve_threads(args.threads)
    except ValueError as e:
        p.error(str(e))
    main(args)
