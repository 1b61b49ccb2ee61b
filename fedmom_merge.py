"""fedmom_merge.py - FedMom's merge arithmetic: the streaming Nesterov merge, the checks a delta
must pass, and the worker processes and shared blocks a round runs on.

Used on the central VM inside fedmom_server.py (by fedmom_state.py and outer_state.py); numpy
+ tensorio.py + wire.py (the compressed downstream update); never torch. Not started on its
own: its workers are `python outer_state.py --merge-worker`, started by Pool. Tested against
torch.optim.SGD(nesterov=True) and a ten-line numpy reference in tests/test_fedmom.py, the
workers against one thread in tests/test_merge_pool.py; bench/fedmom_merge.py measures it.

The step (the one statement of the rule; FEDERATION_GUIDE.md, "A round, from the site's
side" says it in words): deltas d_i = theta_i - theta_global with weights p_i (token shares,
summing to 1); g = theta_global - sum_i p_i theta_i = -sum_i p_i d_i; then one step of
torch.optim.SGD(lr, momentum=mu, nesterov=True, dampening=0) with grad = g:
    buf = g (first step) or mu * buf + g;   theta -= lr * (g + mu * buf)
lr 1 / momentum 0 is exact FedAvg.

Its parts, in reading order:
  - the merge: a delta read piece by piece (DeltaReader, decoding a compressed one), the fused
    float32 step (merge_tensor), merge_files (the file-to-file merge: CHUNK values at a time in
    cache-sized buffers on wire.py's threads, the new files written behind; peak memory 4 x the
    largest fp32 tensor, and any number of threads gives the serial bits);
  - the published update: Publisher (theta_{r+1} = theta_r + the decoded update, file to file);
  - the delta checks (the robust merge's parts): check_delta_file, delta_norm, clip_scales;
  - the round on every core: the arrays in blocks (shared memory, or FileBlock on disk past
    --memory-gb: BlockArrays), sweep_stale, and the workers: Pool and serve().

    stats = merge_files("theta-3.safetensors", "momentum-3.safetensors",
                        [("spool/a.safetensors", 0.25), ("spool/b.safetensors", 0.75)],
                        "theta-4.safetensors", "momentum-4.safetensors", lr=0.7, mu=0.9)
    norm = check_delta_file("spool/a.safetensors", {name: shape})   # raises DeltaRejected(status, reason)
    scales, limit = clip_scales([norm_a, norm_b], reference=[...], factor=10.0)
    pool = Pool(4, outer_state.worker_argv())          # the workers; pool.close() stops them
    arrays = BlockArrays(shapes, on_disk={"embed"}, disk_dir="state/outer")   # "embed" in a file

How a round uses these on the outer state (in memory or not, on workers or not) is
outer_state.py's docstring.
"""
import atexit
import errno
import fcntl
import math
import mmap
import os
import pickle
import queue
import secrets
import select
import struct
import subprocess
import sys
import threading
import time

import numpy as np

import tensorio
import wire

DELTA_DTYPES = ("F16", "BF16", "F32")
CHUNK = 1 << 18               # elements per arithmetic step: 1 MiB of f32 stays in cache


def widen(chunk, dtype, out):
    """A delta chunk (F16, raw BF16 bits or F32) into the float32 buffer `out`, no allocation."""
    if dtype == "BF16":
        bits = out.view(np.uint32)
        np.copyto(bits, chunk)
        bits <<= np.uint32(16)          # bfloat16 is the top half of a float32
    else:
        np.copyto(out, chunk)


def scaled_sum(deltas, weights, s, tmp, sq):
    """s = sum_i weights[i] * deltas[i] in float32 (= -g); sq[i] += ||deltas[i]||^2.
    deltas: [(chunk, dtype)]; F16/F32 are widened and scaled in one pass."""
    for i, ((d, dtype), p) in enumerate(zip(deltas, weights)):
        x = tmp if i else s
        if dtype == "BF16":
            widen(d, dtype, x)
            x *= np.float32(p)
        else:
            np.multiply(d, np.float32(p), out=x, dtype=np.float32)
        sq[i] += sq_norm(x) / (p * p)
        if i:
            s += tmp


def nesterov_chunk(theta, buf, s, tmp, lr, mu, first, out=None):
    """One chunk of torch.optim.SGD(momentum=mu, nesterov=True, dampening=0) with
    grad g = -s, in place: buf = g | mu*buf + g;  theta -= lr * (g + mu*buf).
    `s` and `tmp` are clobbered; buf may be None when mu == 0 (FedAvg keeps none).
    out: the new theta goes there and `theta` is left as it was (the same bits)."""
    out = theta if out is None else out
    if first:                                   # buf = g, so theta += lr*(1+mu)*s
        if buf is not None:
            np.negative(s, out=buf)
        s *= np.float32(lr * (1.0 + mu))
        np.add(theta, s, out=out)
        return
    buf *= np.float32(mu)                       # buf = mu*buf + g = mu*buf - s
    buf -= s
    np.multiply(buf, np.float32(lr * mu), out=tmp)
    s *= np.float32(lr)                         # theta += lr*s - lr*mu*buf
    s -= tmp
    np.add(theta, s, out=out)


class Inputs:
    """The merge's input files, read CHUNK elements at a time with positioned reads
    straight into cache-sized (or caller-owned) buffers: no per-tensor allocation,
    and each chunk is used while it is still in cache."""

    def __init__(self, theta_path, momentum_path, delta_paths):
        self.readers, self.fds = [], []
        try:
            for k, path in enumerate([theta_path, momentum_path, *delta_paths]):
                if path is None:
                    self.readers.append(None)
                    self.fds.append(None)
                    continue
                if k >= 2 and _is_wire(path):           # a compressed delta, decoded as it is read
                    self.readers.append(DecodedDelta(path))
                    self.fds.append(None)
                    continue
                self.readers.append(tensorio.TensorReader(path))
                self.fds.append(os.open(path, os.O_RDONLY))
        except BaseException:
            self.close()
            raise
        self.theta, self.momentum, self.deltas = self.readers[0], self.readers[1], self.readers[2:]
        self.first = self.momentum is None        # no buffer yet: the step starts it (buf = g)
        self.scratch = self.new_scratch()
        self.nread, self._lock = 0, threading.Lock()

    def new_scratch(self):
        """One CHUNK of raw bytes per delta (a thread of the merge owns its own)."""
        return [np.empty(CHUNK * 4, np.uint8) for _ in self.deltas]

    def read(self, k, name, lo, hi, out=None, scratch=None):
        """Elements [lo, hi) of tensor `name` of input k (0 theta, 1 momentum, 2+ deltas),
        into `out` or into that input's scratch (`scratch`: a thread's own, from
        new_scratch()); returns (flat array, dtype)."""
        r, fd = self.readers[k], self.fds[k]
        if isinstance(r, DecodedDelta):
            got, decoded = r.chunk(name, lo, hi)
            with self._lock:
                self.nread += decoded
            if out is not None:
                np.copyto(out, got)
                return out, "F32"
            return got, "F32"
        dtype = r.specs[name][0]
        item = tensorio.DTYPES[dtype]
        if out is None:
            out = (scratch or self.scratch)[k - 2][:(hi - lo) * item.itemsize].view(item)
        start = r.span(name)[0] + lo * item.itemsize
        view, done = memoryview(out).cast("B"), 0
        while done < len(view):
            got = os.preadv(fd, [view[done:]], start + done)
            if got == 0:
                raise tensorio.FormatError(f"{r.path}: tensor {name!r} ends early: the file shrank while merging")
            done += got
        with self._lock:
            self.nread += done
        return out, dtype

    def prefetch(self, name):
        """Decode tensor `name` of every compressed delta now, on the caller's thread (whose
        decode uses the thread pool), before the merge's chunks ask for it from the pool's
        threads (where a decode would run on one thread while the others wait for it)."""
        for r in self.deltas:
            if isinstance(r, DecodedDelta):
                _, decoded = r.chunk(name, 0, 0)
                with self._lock:
                    self.nread += decoded

    def close(self):
        for r in self.readers:
            if r is not None:
                r.close()
        for fd in self.fds:
            if fd is not None:
                os.close(fd)
        self.readers, self.fds = [], []


def _is_wire(path):
    with tensorio.TensorReader(path) as r:
        return "wire" in r.metadata


class DecodedDelta:
    """A compressed delta (wire.py) as Inputs reads it: each tensor decoded whole when its
    first chunk is asked for, and kept until the merge moves to the next tensor, so the
    spool holds the compressed file and the merge's memory grows by one decoded tensor
    (the largest: 4 B/param of it) per compressed delta. .specs as a plain F32 file's."""

    def __init__(self, path):
        self.w, self.path = wire.WireReader(path), path
        self.names = list(self.w.names)
        self.specs = {n: ("F32", tuple(self.w.shapes[n])) for n in self.names}
        self.name, self.values = None, None
        self.lock = threading.Lock()          # the merge's threads ask for chunks of one tensor at once

    def chunk(self, name, lo, hi):
        """-> (elements [lo, hi) of tensor `name`, bytes read from the file for it: once per tensor)."""
        with self.lock:
            read = 0
            if name != self.name:
                self.name, self.values = None, None       # the last tensor's memory goes first
                self.values = self.w.read(name).reshape(-1)
                self.name, read = name, self.w.nbytes(name)
            return self.values[lo:hi], read

    def close(self):
        self.w.close()


class DeltaReader:
    """One spooled delta as the round reads it: elements [lo, hi) of a tensor into the
    caller's float32 buffer. A plain file (F32/BF16/F16) by positioned reads of just those
    bytes; an int8/int4/int2 file decodes just those blocks from the parts load() read (on
    the caller's thread: the rows of the span it names, or the whole tensor), which stay
    compressed in memory, so a merge worker holds the codes of its own share of a tensor,
    not the whole tensor's; topk decodes the whole tensor at load(). Nothing here writes."""

    def __init__(self, path):
        self.path, self.nread = path, 0
        self.w = wire.WireReader(path, threads=1)
        self.codec = self.w.codec
        self.fd = os.open(path, os.O_RDONLY) if self.codec is None else None
        self.specs = {n: self.w.r.specs[n] if self.codec is None else ("F32", tuple(self.w.shapes[n]))
                      for n in self.w.names}
        self.name = self.parts = self.whole = None
        self.lo = 0                                        # the first element load() read
        self.sq = 0.0                                      # delta_sq_norm's running ||delta||^2

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    @property
    def blocks(self):
        return self.codec is not None and self.codec.fmt in wire.LEVELS

    def part_bytes(self, shape):
        """Bytes per element that load() holds in memory for a span of a tensor of `shape`: a
        block format's codes and scales (as read and as float32); 0 for a plain file (read a
        piece at a time) and for topk (decoded whole whatever the span: outer_state counts it)."""
        if not self.blocks:
            return 0.0
        _, C, nb = wire.as_blocks(shape, self.codec.block)
        return wire.CODE_BITS[self.codec.fmt] / 8 + 6 * nb / max(C, 1)

    def whole_bytes(self, shape):
        """Bytes load() holds whatever the span: a topk tensor decoded whole (0 otherwise)."""
        return 4 * math.prod(shape) if self.codec is not None and not self.blocks else 0

    def load(self, name, shape, lo=0, hi=None):
        """Make elements [lo, hi) of tensor `name` (default: all of it) the current ones: a block
        format's codes and scales of those rows are read into memory and checked as wire.py
        checks them. lo and hi on this file's block boundaries (piece_unit), or hi the end."""
        n = math.prod(shape)
        hi = n if hi is None else hi
        self.name, self.parts, self.whole, self.lo = name, None, None, lo
        if self.codec is None:
            return
        where = f"{self.path}: tensor {name!r}"
        if not self.blocks:
            self.whole, self.lo = self.w.read(name).reshape(-1), 0
            self.nread += self.w.nbytes(name)
            return
        fmt, bits = self.codec.fmt, wire.CODE_BITS[self.codec.fmt]
        R, C, nb = wire.as_blocks(shape, self.codec.block)
        a, b = lo // C, -(-hi // C)
        codes = self.w.r.read_range(name, wire.code_start(fmt, lo), wire.packed_bytes(hi, bits))
        sbits = self.w.r.read_range(name + wire.SCALE, a * nb, b * nb)
        if not wire.scales_ok(sbits):
            raise wire.WireError(f"{where}: a scale is negative, NaN or Inf")
        if bits < 8 and hi == n and not wire.padding_is_zero(codes, bits, hi - lo):
            raise wire.WireError(f"{where}: the padding bits after the last value are not 0")
        self.parts = (codes if bits < 8 else codes.reshape(b - a, C), tensorio.bf16_to_f32(sbits).reshape(b - a, nb),
                      C)
        self.nread += codes.nbytes + sbits.nbytes

    def read(self, lo, hi, out):
        """Elements [lo, hi) of the current tensor -> (array, dtype) for scaled_sum;
        lo and hi on this file's block boundaries (piece_unit), inside the span load() read."""
        if self.whole is not None:
            return self.whole[lo:hi], "F32"
        if self.parts is None:                             # a plain file: its own dtype, widened later
            dtype = self.specs[self.name][0]
            item = tensorio.DTYPES[dtype]
            buf = out.view(np.uint8)[:(hi - lo) * item.itemsize].view(item)
            start, view, done = self.w.r.span(self.name)[0] + lo * item.itemsize, memoryview(buf).cast("B"), 0
            while done < len(view):
                got = os.preadv(self.fd, [view[done:]], start + done)
                if got == 0:
                    raise tensorio.FormatError(f"{self.path}: tensor {self.name!r} ends early: the file "
                                               "shrank while merging")
                done += got
            self.nread += done                             # (threads: an approximate count)
            return buf, dtype
        codes, scale, C = self.parts
        fmt, a0 = self.codec.fmt, self.lo // C
        a, b = lo // C - a0, -(-hi // C) - a0
        bad = []
        src = codes[wire.code_start(fmt, lo) - wire.code_start(fmt, self.lo):] if fmt != "int8" \
            else codes[a:b]
        wire.decode_span(src, scale[a:b], 0, b - a, C, self.codec, out[:hi - lo].reshape(b - a, C), bad)
        if bad:
            raise wire.WireError(f"{self.path}: tensor {self.name!r}: {bad[0]}")
        return out[:hi - lo], "F32"

    def close(self):
        self.w.close()
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


STEP = 1 << 16     # elements per fused step: its dozen float32 buffers stay in a core's L2 cache
CHECK_SPAN = 1 << 24   # elements of a block-format delta checked at a time: its parts in memory (int4:
                       # 8.5 MB), never a whole tensor's (0.6B's embedding: 71 MB; 32B's: 356 MB)


def piece_unit(shape, codecs):
    """Elements per indivisible piece of a tensor: a piece starts and ends on a block boundary
    of every block codec in `codecs` (wire.as_blocks: a block of the flattened tensor when
    the last dimension is a multiple of it, else a whole row) and, for int4/int2, on a byte."""
    cols = shape[-1] if shape else 1
    unit = 1
    for c in codecs:
        if c is None or c.fmt not in wire.LEVELS:
            continue
        k = c.block if cols and cols % c.block == 0 else max(cols, 1)
        k = math.lcm(k, 8 // wire.CODE_BITS[c.fmt])     # int4: 2 values a byte, int2: 4
        unit = math.lcm(unit, k)
    return unit


class NonFinite(ArithmeticError):
    """The merged theta or momentum would hold NaN/Inf: nothing was written. `cause`:
    "momentum" when the old momentum alone overflows that chunk (no delta could be merged
    on top of it: reset the buffer), else "deltas" (leave the largest contribution out)."""

    def __init__(self, what, name, cause="deltas"):
        super().__init__(f"the merged {what} of tensor {name!r} is not finite")
        self.what, self.name, self.cause = what, name, cause


def _momentum_alone_overflows(theta, buf, lr, mu):
    """theta - lr*mu^2*buf and mu*buf: the step with every delta zero. theta/buf are
    scratch copies of the old chunk (clobbered)."""
    buf *= np.float32(mu)
    if not np.isfinite(buf).all():
        return True
    buf *= np.float32(lr * mu)
    theta -= buf
    return not np.isfinite(theta).all()


def sq_norm(x):
    """||x||^2 of a float32 chunk: the fast f32 dot, again in float64 if that overflowed."""
    v = float(np.dot(x, x))
    if not math.isfinite(v):
        x64 = x.astype(np.float64)
        v = float(np.dot(x64, x64))
    return v


def merge_tensor(inputs, name, theta, buf, weights, lr, mu, sums, work, threads=1):
    """Merge one tensor, chunk by chunk: read theta (and momentum) into the caller's flat
    fp32 `theta`/`buf`, the deltas into scratch, update in place, and check the result
    while it is in cache (NonFinite). `work` = two CHUNK fp32 scratch arrays.
    sums["theta"], sums["delta"][i] accumulate squared norms.
    threads > 1: runs of chunks on wire.py's thread pool, each with its own scratch; the
    per-chunk norms are added in chunk order afterwards and the first non-finite chunk
    is the one raised, so the result (bits, norms, error) does not depend on threads."""
    chunks = [(lo, min(lo + CHUNK, theta.size)) for lo in range(0, theta.size, CHUNK)]
    if threads <= 1 or len(chunks) <= 1:
        results = _merge_chunks(inputs, name, theta, buf, weights, lr, mu, chunks, work, None, stop=True)
    else:
        results = [None] * len(chunks)

        def run(a, b):
            mine = [np.empty(CHUNK, np.float32) for _ in range(2)]
            results[a:b] = _merge_chunks(inputs, name, theta, buf, weights, lr, mu, chunks[a:b], mine,
                                         inputs.new_scratch())
        wire.run_spans(run, len(chunks), 1, CHUNK, threads)
    for tsq, dsq, bad in results:
        sums["theta"] += tsq
        for i, v in enumerate(dsq):
            sums["delta"][i] += v
        if bad:
            raise NonFinite(bad[0], name, bad[1])


def _merge_chunks(inputs, name, theta, buf, weights, lr, mu, chunks, work, scratch, stop=False):
    """-> [(||theta chunk||^2, [||delta_i chunk||^2], None or (what, cause))] per chunk;
    stop: end at the first non-finite chunk (the serial merge)."""
    first = inputs.first
    out = []
    for lo, hi in chunks:
        th, _ = inputs.read(0, name, lo, hi, out=theta[lo:hi])
        b = None if buf is None else buf[lo:hi]
        if not first:
            inputs.read(1, name, lo, hi, out=b)
        tsq, dsq = sq_norm(th), [0.0] * len(weights)
        s, tmp = work[0][:hi - lo], work[1][:hi - lo]
        ds = [inputs.read(k, name, lo, hi, scratch=scratch) for k in range(2, 2 + len(weights))]
        bad = None
        with np.errstate(over="ignore", invalid="ignore"):      # overflow is checked just below
            scaled_sum(ds, weights, s, tmp, dsq)
            nesterov_chunk(th, b, s, tmp, lr, mu, first)
            what = "theta" if not np.isfinite(th).all() else \
                "momentum" if b is not None and not np.isfinite(b).all() else None
            if what:
                cause = "deltas"
                if not first:
                    th0, _ = inputs.read(0, name, lo, hi, out=s)
                    b0, _ = inputs.read(1, name, lo, hi, out=tmp)
                    cause = "momentum" if _momentum_alone_overflows(th0, b0, lr, mu) else "deltas"
                bad = (what, cause)
        out.append((tsq, dsq, bad))
        if bad and stop:
            break
    return out


class WriteBehind:
    """Writes finished tensors on a background thread while the next one is merged.

    The merge owns `slots` pairs of (theta, momentum) buffers, each the size of the
    largest tensor; take() hands out a free one (waiting for the writer to finish
    with it), put() queues it for writing. Memory is therefore fixed at
    slots x 2 x the largest tensor, allocated (and page-faulted) once: a fresh array
    per tensor cost 8.5 GB of page faults and unmaps per Qwen3-0.6B merge, about as
    much system time as writing the outputs."""

    def __init__(self, largest, with_momentum, slots=2):
        self.error = None
        self.free, self.q = queue.Queue(), queue.Queue()
        for _ in range(slots):
            self.free.put((np.empty(largest, np.float32), np.empty(largest, np.float32) if with_momentum else None))
        self.thread = threading.Thread(target=self._run, name="merge-writer", daemon=True)
        self.thread.start()

    def _run(self):
        while (item := self.q.get()) is not None:
            slot, jobs = item
            try:
                if self.error is None:
                    for writer, name, array in jobs:
                        writer.write(name, array)
            except BaseException as e:   # surfaced on the next take()/finish()
                self.error = e
            self.free.put(slot)

    def take(self):
        slot = self.free.get()
        self._raise()
        return slot

    def put(self, slot, jobs):
        self.q.put((slot, jobs))

    def finish(self):
        self.q.put(None)
        self.thread.join()
        self._raise()

    def _raise(self):
        if self.error is not None:
            raise self.error


def _check_inputs(inputs):
    """The header facts the merge relies on: theta and momentum are F32 with theta's
    names; every delta holds each tensor with theta's element count (check_delta_file
    has checked more, at acceptance)."""
    tr = inputs.theta
    for r in [tr] + ([inputs.momentum] if inputs.momentum else []) + inputs.deltas:
        for name in tr.names:
            dtype, shape = r.specs.get(name, (None, None))
            want = ("F32",) if r is tr or r is inputs.momentum else DELTA_DTYPES
            if dtype not in want or math.prod(shape) != math.prod(tr.specs[name][1]):
                raise ValueError(f"{r.path}: tensor {name!r} is {dtype} {shape}; the merge needs "
                                 f"{' or '.join(want)} with shape {tr.specs[name][1]}")


def merge_files(theta_path, momentum_path, deltas, out_theta, out_momentum, lr, mu,
                metadata=None, fsync=True, pause_s=0.0, after_tensor=None, threads=None):
    """One durable FedMom step from files. deltas: [(path, weight)], weights summing to 1.
    momentum_path None = first step (buf = g); out_momentum None = do not keep a buffer
    (momentum 0). out_theta: a path, or a callable (specs, metadata) -> a writer such as
    Publisher, which gets each merged tensor instead of a file (its .result is returned as
    "published"). after_tensor(name): called after each merged tensor (the aggregator's
    fault point). threads: the chunks of a tensor on threads (None: wire.default_threads(),
    $WIRE_THREADS or every core; the same bits and norms for any number).
    Returns {"theta_norm", "delta_norms", "bytes_read", "bytes_written", "published"}."""
    threads = wire.resolve_threads(threads)
    writers, inputs = [], None
    try:
        inputs = Inputs(theta_path, momentum_path, [p for p, _ in deltas])
        tr, weights = inputs.theta, [w for _, w in deltas]
        specs = [(name, "F32", tr.specs[name][1]) for name in tr.names]
        meta = {k: str(v) for k, v in (metadata or {}).items()}
        tw = (out_theta(specs, meta) if callable(out_theta)           # a sink: Publisher
              else tensorio.TensorWriter(out_theta, specs, meta, fsync=fsync))
        writers.append(tw)
        mw = tensorio.TensorWriter(out_momentum, specs, meta, fsync=fsync) if out_momentum else None
        writers += [mw] if mw else []
        _check_inputs(inputs)
        keep_buf = mw is not None or inputs.momentum is not None
        largest = max((tr.nbytes(n) // 4 for n in tr.names), default=0)
        wb = WriteBehind(largest, keep_buf)
        work = [np.empty(min(CHUNK, max(largest, 1)), np.float32) for _ in range(2)]
        sums = {"theta": 0.0, "delta": [0.0] * len(deltas)}
        try:
            for name in tr.names:
                th_all, buf_all = wb.take()
                n = tr.nbytes(name) // 4
                theta, buf = th_all[:n], (buf_all[:n] if keep_buf else None)
                inputs.prefetch(name)
                merge_tensor(inputs, name, theta, buf, weights, lr, mu, sums, work, threads)
                wb.put((th_all, buf_all), [(tw, name, theta)] + ([(mw, name, buf)] if mw else []))
                if pause_s:
                    time.sleep(pause_s)
                if after_tensor is not None:
                    after_tensor(name)
        finally:
            wb.finish()
        for w in writers:
            w.close()
        nwritten = sum(w.bytes_written() if hasattr(w, "bytes_written") else os.path.getsize(w.path)
                       for w in writers)
        return {"theta_norm": math.sqrt(sums["theta"]), "delta_norms": [math.sqrt(s) for s in sums["delta"]],
                "bytes_read": inputs.nread, "bytes_written": nwritten, "published": getattr(tw, "result", None)}
    except BaseException:
        for w in writers:
            w.abort()
        raise
    finally:
        if inputs is not None:
            inputs.close()


# ---------------------------------------------------------------- the published update

class Publisher:
    """Compressed downstream (fedmom_server.py --down-wire): what sites download instead of
    the merged theta, and the theta_global it defines, with the aggregator's error feedback.
    A sink for merge_files' merged theta (out_theta=lambda specs, meta: Publisher(...)): it
    takes each merged tensor in prev's order, so the merged theta is never a file of its own
    (that file was one model of the state dir's peak). Per tensor, in float32:
        x        = (merged - prev) + residual      the step, plus what earlier rounds rounded away
        sent     = decode(encode(x))               the update file (codec's format) holds encode(x)
        theta    = wire.add_update(prev, sent)     THE theta_global of the new round
        residual = x - sent                        owed to the next round's update
    A site holding prev computes theta from the update with the same addition, bit for bit.
    residual_path None: nothing owed yet. Peak memory: a few times the largest tensor.
    write() raises NonFinite if the published theta would not be finite; after close(),
    .result = {"base_digest", "digest", "update_bytes", "residual_norm"} (wire.Digest of prev
    and of the new theta)."""

    def __init__(self, prev_path, residual_path, codec, out_theta, out_update, out_residual,
                 metadata=None, fsync=True):
        self.wire, self.writers, self.readers, self.result = wire, [], [], None
        try:
            self.prev = tensorio.TensorReader(prev_path)
            self.readers.append(self.prev)
            self.owed = tensorio.TensorReader(residual_path) if residual_path else None
            self.readers += [self.owed] if self.owed else []
            self.shapes = {n: self.prev.specs[n][1] for n in self.prev.names}
            shapes = list(self.shapes.items())
            meta = {k: str(v) for k, v in (metadata or {}).items()}
            self.tw = tensorio.TensorWriter(out_theta, [(n, "F32", sh) for n, sh in shapes], meta, fsync=fsync)
            self.writers.append(self.tw)
            self.uw = wire.WireWriter(out_update, shapes, codec, meta, fsync=fsync)
            self.writers.append(self.uw)
            self.rw = tensorio.TensorWriter(out_residual, [(n, "F32", sh) for n, sh in shapes], meta, fsync=fsync)
            self.writers.append(self.rw)
        except BaseException:
            self.abort()
            raise
        self.path, self.out_update = out_theta, out_update
        self.d_prev, self.d_new, self.sq = wire.Digest(), wire.Digest(), 0.0

    def write(self, n, merged):
        sh = self.shapes[n]
        p = np.asarray(self.prev.read(n, as_float32=True), np.float32).reshape(sh)
        x = np.asarray(merged, np.float32).reshape(sh) - p
        if self.owed is not None:
            x += np.asarray(self.owed.read(n, as_float32=True), np.float32).reshape(sh)
        sent = self.uw.write(n, x)
        theta = self.wire.add_update(p, sent)
        if not np.isfinite(theta).all():
            raise NonFinite("theta", n, "deltas")
        x -= sent
        self.sq += sq_norm(x.reshape(-1))
        self.d_prev.add(n, p), self.d_new.add(n, theta)
        self.tw.write(n, theta)
        self.rw.write(n, x)

    def close(self):
        for w in self.writers:
            w.close()
        self._close_readers()
        self.result = {"base_digest": self.d_prev.hexdigest(), "digest": self.d_new.hexdigest(),
                       "update_bytes": os.path.getsize(self.out_update), "residual_norm": math.sqrt(self.sq)}

    def bytes_written(self):
        return sum(os.path.getsize(w.path) for w in self.writers)

    def abort(self):
        for w in self.writers:
            w.abort()
        self._close_readers()

    def _close_readers(self):
        for r in self.readers:
            r.close()
        self.readers = []


def publish(prev_path, merged_path, residual_path, codec, out_theta, out_update, out_residual,
            metadata=None, fsync=True):
    """Publisher from a merged theta file (the rule is Publisher's docstring) -> its .result."""
    pub = Publisher(prev_path, residual_path, codec, out_theta, out_update, out_residual, metadata, fsync)
    try:
        with tensorio.TensorReader(merged_path) as merged:
            for n in pub.shapes:
                pub.write(n, merged.read(n, as_float32=True))
        pub.close()
        return pub.result
    except BaseException:
        pub.abort()
        raise


# ---------------------------------------------------------------- delta checks
# Every finite delta is still a weapon; the robust merge's parts:
#   - at acceptance check_delta_file refuses NaN/Inf and returns the L2 norm, summed in float64
#     (an f32 sum of squares of a 3e38 delta is inf);
#   - clip_scales: a delta whose norm exceeds `factor` x the median of the round's norms and of
#     the last rounds' merged deltas is scaled down to that limit (the caller names it in the
#     round record); one site with no history is its own median, so clipping needs company;
#   - merge_tensor checks every merged chunk: a non-finite value raises NonFinite before anything
#     is written, and the caller merges again without the largest contribution, or with the
#     momentum reset when the old momentum alone overflows (otherwise a round stuck for good).

class DeltaRejected(Exception):
    """A delta that must not be merged; `status` is the HTTP code, the message says why."""

    def __init__(self, status, reason):
        super().__init__(reason)
        self.status, self.reason = status, reason


def check_delta_file(path, specs, threads=None):
    """Header checks, then a tensor-by-tensor finiteness scan; raises DeltaRejected.
    specs: {name: shape} of theta_global. Returns the delta's L2 norm (float64).
    A compressed delta (wire.py) is checked as the values it decodes to: its layout, names
    and shapes before any decoding (a forged wire_shapes could ask for any amount of
    memory), then each tensor decoded piece by piece in memory, scanned and dropped;
    nothing is written, so the spool keeps the compressed file (an int4 delta costs its
    ~0.52 B/param on disk, not 4). The checks are DeltaCheck's, as a followed upload's."""
    with DeltaCheck(path, specs, threads) as c:
        c.open()
        for name in c.names:
            c.check(name)
        return c.norm()


class DeltaCheck:
    """check_delta_file in steps, for a file whose bytes land in any order (a followed upload,
    fedmom_state.Follower): header_bytes(first 8 bytes) says how many bytes open() needs;
    open() runs the header checks and sets .spans {tensor: [(start, end)] of the file's bytes
    it is made of}; check(name) scans one tensor once its spans landed (delta_sq_norm, one
    CHECK_SPAN at a time); norm() once all were checked. The squares are summed in .names
    order whatever order the tensors were checked in: the norm is the same, bit for bit."""

    def __init__(self, path, specs, threads=None):
        self.path, self.specs, self.threads = path, specs, threads
        self.d, self.names, self.spans, self.sq = None, [], {}, {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    @staticmethod
    def header_bytes(first8):
        """The bytes of the file open() reads (safetensors: 8 + the header length it starts with)."""
        return 8 + int.from_bytes(first8[:8], "little")

    def _where(self, e):
        return str(e).replace(self.path, "the delta")

    def open(self):
        try:
            r = tensorio.TensorReader(self.path)
        except tensorio.FormatError as e:
            raise DeltaRejected(400, f"not a tensor file: {self._where(e)}")
        with r:
            is_wire = "wire" in r.metadata
            if not is_wire:
                _check_plain_header(r, self.specs)
        try:
            self.d = DeltaReader(self.path)
            if is_wire:
                wire.check_shapes(self.d.w, self.specs)
        except wire.WireError as e:
            raise DeltaRejected(400, f"bad compressed delta: {self._where(e)}")
        w = self.d.w
        self.names = list(w.names)
        parts = {n: [n] for n in self.names} if w.codec is None else \
            {n: [p for p, _, _ in w.codec.parts(n, w.shapes[n])] for n in self.names}
        self.spans = {n: [tuple(w.r.span(p)) for p in ps] for n, ps in parts.items()}

    def check(self, name):
        """Scan tensor `name` (its spans on disk): DeltaRejected 422 for NaN/Inf, 400 for a bad
        compressed tensor. Each tensor is checked once."""
        if name in self.sq:
            return self.sq[name]
        try:
            sq = delta_sq_norm(self.d, name, self.threads)
        except wire.WireError as e:
            raise DeltaRejected(400, f"bad compressed delta: {self._where(e)}")
        if sq is None:
            raise DeltaRejected(422, f"tensor {name!r} holds NaN or Inf")
        self.sq[name] = sq
        return sq

    def norm(self):
        return math.sqrt(sum(self.sq[n] for n in self.names))

    def cost(self, name):
        """Bytes check(name) holds: a block format's parts of one span, a topk tensor decoded
        whole, and each thread's piece buffer (STEP float32)."""
        shape = tuple(self.d.w.shapes[name])
        n = math.prod(shape)
        return int(self.d.part_bytes(shape) * min(n, CHECK_SPAN) + self.d.whole_bytes(shape)
                   + 4 * STEP * wire.resolve_threads(self.threads))

    def close(self):
        if self.d is not None:
            self.d.close()
            self.d = None


def _check_plain_header(r, specs):
    missing, extra = sorted(set(specs) - set(r.names)), sorted(set(r.names) - set(specs))
    if missing or extra:
        raise DeltaRejected(400, f"delta names differ from theta_global: missing {missing[:5]}, "
                                 f"unexpected {extra[:5]}")
    for name in r.names:
        dtype, shape = r.specs[name]
        if dtype not in DELTA_DTYPES:
            raise DeltaRejected(400, f"tensor {name!r} is {dtype}; deltas must be F16, BF16 or F32")
        if shape != specs[name]:
            raise DeltaRejected(400, f"tensor {name!r} has shape {list(shape)}, "
                                     f"theta_global has {list(specs[name])}")


def delta_sq_norm(d, name, threads=None):
    """||tensor name||^2 of an open DeltaReader (float32 dots of its pieces, summed in float64
    in piece order: the same for any number of threads), also added to d.sq; None if a value
    is NaN or Inf (an int8/int4 block decodes to Inf when its scale times its code overflows).
    Each piece is decoded into a buffer that stays in cache: nothing the size of a tensor is
    made (a fresh array costs a page fault per 4 KiB, more than the decode itself)."""
    shape = tuple(d.w.shapes[name])
    n = math.prod(shape)
    unit = piece_unit(shape, [d.codec] if d.blocks else [])
    step = max(unit, STEP // unit * unit)
    span = max(step, CHECK_SPAN // step * step) if d.blocks else max(n, 1)
    results = []
    for s0 in range(0, n, span):                       # a block format's parts read a span at a time
        s1 = min(s0 + span, n)
        d.load(name, shape, s0, s1)
        pieces = [(lo, min(lo + step, s1)) for lo in range(s0, s1, step)]
        got = [None] * len(pieces)

        def run(a, b, pieces=pieces, got=got):
            buf = np.empty(step, np.float32)
            for i in range(a, b):
                x, dtype = d.read(*pieces[i], buf)
                got[i] = _finite_sq_norm(x, dtype)
        wire.run_spans(run, len(pieces), 1, step, wire.resolve_threads(threads))
        if any(r is None for r in got):
            return None
        results += got
    if n == 0:
        d.load(name, shape)
    total = sum(results)
    d.sq += total
    return total


def delta_norm(path, threads=None):
    """The L2 norm of a delta file already checked (a spooled delta restored at start):
    check_delta_file's number for the same file."""
    with DeltaReader(path) as d:
        for name in d.w.names:
            delta_sq_norm(d, name, threads)
        return math.sqrt(d.sq)


def _finite_sq_norm(a, dtype):
    """||a||^2 in float64, or None if `a` holds NaN/Inf. a: F16/F32 values or raw BF16 bits."""
    total, wide = 0.0, np.empty(min(a.size, 1 << 22), np.float32)
    for lo in range(0, a.size, 1 << 22):
        c = a[lo:lo + (1 << 22)]
        if dtype == "BF16":      # exponent bits all ones = Inf or NaN
            if np.any((c & np.uint16(0x7F80)) == np.uint16(0x7F80)):
                return None
        elif not np.isfinite(c).all():
            return None
        if dtype == "F32":
            x = c
        else:
            x = wide[:c.size]
            widen(c, dtype, x)
        total += sq_norm(x)
    return total


def clip_scales(norms, reference=(), factor=10.0):
    """The robust rule: each delta is scaled to at most `factor` x the median norm of
    `norms` (this round's deltas) together with `reference` (norms merged in recent
    rounds). -> ([scale per delta, 1.0 = untouched], limit or None). factor 0 = off."""
    pool = sorted([n for n in norms if n > 0] + [n for n in reference if n and n > 0])
    if not factor or not pool:
        return [1.0] * len(norms), None
    mid = len(pool) // 2
    median = pool[mid] if len(pool) % 2 else 0.5 * (pool[mid - 1] + pool[mid])
    limit = factor * median
    return [min(1.0, limit / n) if n > 0 else 1.0 for n in norms], limit


# ==== the round on every core: worker processes over shared blocks ================================
# Processes, not threads: a round is some 40 numpy calls of 10-60 us per 64K-value piece, and
# threads share one interpreter lock between them (measured: two threads no faster than one).
# Blocks are files pww-fedmom-<pid>-<random>-<n>: shared memory in $PWW_SHM_DIR (default /dev/shm,
# mapped) and file blocks in --outer-dir. The process that made one holds a shared flock on it
# while it lives (whose a block is never rests on a pid); it is removed when the aggregator lets
# go, or after a crash by the next start's sweep_stale (only blocks no live process holds). A file
# block is never mapped (pread/pwrite: a disk error is a DiskError that fails the round, not a
# SIGBUS) and is fdatasync'd before a round is published. Per tensor each worker gets a Task (the
# step, where the arrays are, where the update's codes go, one contiguous run of pieces), reads
# its part of each delta itself and answers each piece's norms and finiteness: the bits of one
# thread. A worker that dies or is silent TASK_TIMEOUT_S fails the round (the aggregator rebuilds)
# and is started again; a worker whose aggregator dies exits at once.

SHM_DIR = "/dev/shm"
SHM_ENV = "PWW_SHM_DIR"          # where the blocks live (a tmpfs: they are the arrays' memory)
POOL_MIN_PARAMS = 4 << 20        # a smaller model's round runs in the aggregator alone: the pipes cost more
MIN_ENV = "PWW_TEST_POOL_MIN_PARAMS"    # tests: the workers for a tiny model too
PARENT_ENV = "PWW_MERGE_PARENT"  # the aggregator's pid, for its workers (they exit when it is gone)
PARENT_POLL_S = 0.2
TASK_TIMEOUT_S = 600.0           # a worker silent this long on one task (stopped, hung on a disk) fails the round
TIMEOUT_ENV = "PWW_MERGE_TASK_TIMEOUT_S"   # (a task is one tensor's share: ~1 s at 32B on 16 workers)


def task_timeout_s():
    env = os.environ.get(TIMEOUT_ENV, "").strip()
    return float(env) if env else TASK_TIMEOUT_S


def min_params():
    env = os.environ.get(MIN_ENV, "").strip()
    return int(env) if env else POOL_MIN_PARAMS
PREFIX = "pww-fedmom-"
_counter = iter(range(1 << 62))
_counter_lock = threading.Lock()
_owned = set()                   # the block paths this process made and has not removed yet (atexit removes them)
_TOKEN = secrets.token_hex(4)    # in the names: a pid alone is not unique across pid namespaces and restarts


def shm_dir():
    return os.environ.get(SHM_ENV) or SHM_DIR


class Block:
    """One shared memory block: a file in shm_dir() mapped MAP_SHARED. The creator owns the
    name, holds a shared flock on it while it lives (sweep_stale leaves a held block) and
    removes the file in release(); others attach by name."""

    def __init__(self, nbytes=None, name=None):
        self.owner, self.fd = name is None, None
        if self.owner:
            name, fd = _allocate(shm_dir(), nbytes, _no_room)
            self.fd = fd                                 # kept open: the flock is this process's claim
        else:
            fd = os.open(os.path.join(shm_dir(), name), os.O_RDWR)
        try:
            self.size = os.fstat(fd).st_size
            self.map = mmap.mmap(fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            if not self.owner:
                os.close(fd)
        self.name = name

    def view(self, offset, count, dtype=np.float32):
        """`count` items of `dtype` at byte `offset`."""
        return np.frombuffer(self.map, dtype=dtype, count=count, offset=offset)

    def release(self):
        """The creator removes the name (the memory goes with the last mapping)."""
        if self.owner:
            _remove(os.path.join(shm_dir(), self.name))
            self.owner = False
            os.close(self.fd)
            self.fd = None


class FileBlock:
    """One block of the outer state on disk: a file in `dir` (fedmom_server.py --outer-dir),
    made, flock'd and swept like a Block, its blocks taken at once (posix_fallocate: a full
    disk refuses here, never mid-round). Never mapped: its tensors (FileTensor) are read and
    written with pread/pwrite, so a disk error is an OSError (EIO) that fails the round where
    a mapped page would SIGBUS the process. Its key, in a worker's Task, is its path (a shared
    memory Block's is its bare name)."""

    def __init__(self, nbytes=None, path=None, dir=None):
        self.owner = path is None
        if self.owner:
            name, self.fd = _allocate(dir, nbytes, lambda free, n: _no_disk(dir, free, n))
            path = os.path.join(dir, name)
        else:
            self.fd = os.open(path, os.O_RDWR)
        self.name = self.path = path
        self.size = os.fstat(self.fd).st_size

    def view(self, offset, count, dtype=np.float32):
        if np.dtype(dtype) != np.float32:
            raise ValueError(f"{self.path}: a file block holds float32 arrays only")
        return FileTensor(self, offset, count)

    def sync(self):
        """fdatasync: a write-back error of anything written to it so far raises here (DiskError)."""
        _disk(lambda: os.fdatasync(self.fd), self)

    def release(self):
        if self.fd is None:
            return
        if self.owner:
            _remove(self.path)
            self.owner = False
        try:
            os.close(self.fd)
        except OSError:                                  # a failed disk's last write-back error
            pass
        self.fd = None


class DiskError(OSError):
    """An I/O error of a file block (EIO, a disk gone): the round fails and the state is
    rebuilt; nothing durable is wrong (a state dir file that cannot be read is another OSError)."""


def _disk(fn, block):
    """fn() with an OSError of the file block raised as DiskError, naming the file."""
    try:
        return fn()
    except DiskError:
        raise
    except OSError as e:
        raise DiskError(e.errno, f"{block.path}: {e.strerror or e} (a file block of the outer state, "
                                 "--outer-dir)") from None


class FileTensor:
    """`count` float32 values at byte `offset` of a FileBlock, read and written by ranges of
    elements; `whole()` reads all of it (the caller's memory: a tensor, never the model)."""
    dtype = np.dtype(np.float32)

    def __init__(self, block, offset, count):
        self.block, self.offset, self.size = block, offset, count
        self.nbytes, self.shape = 4 * count, (count,)

    def read(self, lo, hi, out=None):
        """Elements [lo, hi) -> out[:hi - lo] (a new array without out)."""
        out = np.empty(hi - lo, np.float32) if out is None else out[:hi - lo]
        view, pos, done = memoryview(out).cast("B"), self.offset + 4 * lo, 0
        while done < len(view):
            got = _disk(lambda: os.preadv(self.block.fd, [view[done:]], pos + done), self.block)
            if got == 0:
                raise DiskError(errno.EIO, f"{self.block.path}: ends early (truncated under the aggregator?)")
            done += got
        return out

    def write(self, lo, hi, a):
        """Elements [lo, hi) <- a (float32, hi - lo of them)."""
        view, pos, done = memoryview(np.ascontiguousarray(a, np.float32)).cast("B"), self.offset + 4 * lo, 0
        if len(view) != 4 * (hi - lo):
            raise ValueError(f"{self.block.path}: {len(view) // 4} values for elements [{lo}, {hi})")
        while done < len(view):
            done += _disk(lambda: os.pwritev(self.block.fd, [view[done:]], pos + done), self.block)

    def whole(self):
        return self.read(0, self.size)


def piece(a, lo, hi, buf):
    """Elements [lo, hi) of a flat float32 array (a view: nothing copied) or of a FileTensor
    (read into buf). put() writes a piece back where it came from."""
    return a[lo:hi] if isinstance(a, np.ndarray) else a.read(lo, hi, buf)


def put(a, lo, hi, x):
    """The piece x of elements [lo, hi) back into a FileTensor (an array's piece is a view of it already)."""
    if not isinstance(a, np.ndarray):
        a.write(lo, hi, x)


def whole(a):
    """A flat float32 array, or a FileTensor read whole (one tensor in the caller's memory)."""
    return a if isinstance(a, np.ndarray) else a.whole()


CHUNK_BYTES = 16 << 20           # a FileTensor copied to or from a file this much at a time


def zero(a, lo=0, hi=None):
    """Elements [lo, hi) of an array or FileTensor set to 0."""
    hi = a.size if hi is None else hi
    if isinstance(a, np.ndarray):
        a[lo:hi].fill(0)
        return
    z = np.zeros(min(max(hi - lo, 1), CHUNK_BYTES // 4), np.float32)
    for s in range(lo, hi, z.size):
        a.write(s, min(s + z.size, hi), z[:min(z.size, hi - s)])


def chunks(a, lo=0, hi=None, buf=None):
    """Elements [lo, hi) of an array or FileTensor as flat float32 pieces of CHUNK_BYTES at
    most (views of an array; reads of a FileTensor into one reused buffer: each piece is
    overwritten by the next)."""
    hi = a.size if hi is None else hi
    if isinstance(a, np.ndarray):
        yield a[lo:hi]
        return
    step = CHUNK_BYTES // 4
    buf = np.empty(min(step, max(hi - lo, 1)), np.float32) if buf is None else buf
    for s in range(lo, hi, len(buf)):
        yield a.read(s, min(s + len(buf), hi), buf)


def _allocate(d, nbytes, no_room):
    """A new block file of nbytes in d, its blocks taken now, flock'd -> (name, fd). A tmpfs
    that fills later would SIGBUS whoever writes there first; a disk, fail a write mid-round."""
    free = _free_bytes(d)
    if free is not None and nbytes > free:
        raise no_room(free, nbytes)
    name, fd = _create(d)
    try:
        os.ftruncate(fd, max(nbytes, 1))
        os.posix_fallocate(fd, 0, max(nbytes, 1))
    except BaseException as e:
        os.close(fd)
        _remove(os.path.join(d, name))
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            raise no_room(_free_bytes(d) or 0, nbytes) from None
        raise
    return name, fd


def _no_room(free, nbytes):
    return MemoryError(f"{shm_dir()} has {size(free)} free, the outer state's shared arrays need "
                       f"{size(nbytes)} more: enlarge it (mount -o remount,size=... {shm_dir()}), point "
                       f"${SHM_ENV} at a larger tmpfs, or lower --memory-gb (the rest of the outer state "
                       "on disk, in --outer-dir)")


def _no_disk(d, free, nbytes):
    return OSError(errno.ENOSPC, f"{d} has {size(free)} free, the outer state's file blocks need {size(nbytes)} "
                                 "more: point --outer-dir at a larger disk, or raise --memory-gb")


def _create(d):
    """A new block file in d, flock'd (shared) by this process -> (name, fd). A sweep may
    take a file between its creation and the flock (it is not held yet): then another."""
    while True:
        with _counter_lock:
            n = next(_counter)
        name = f"{PREFIX}{os.getpid()}-{_TOKEN}-{n}"
        path = os.path.join(d, name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            continue
        _owned.add(path)
        fcntl.flock(fd, fcntl.LOCK_SH)
        try:
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                return name, fd
        except FileNotFoundError:
            pass
        _owned.discard(path)                             # swept before the flock: not ours any more
        os.close(fd)


def _remove(path):
    _owned.discard(path)
    try:
        os.unlink(path)
    except OSError:                                      # gone, or its disk failed: the next sweep's
        pass


@atexit.register
def _remove_all():
    """At exit, whatever this process still names (a SIGKILL leaves them to sweep_stale)."""
    for path in list(_owned):
        _remove(path)


def size(n):
    """Bytes as GiB, or MiB below one GiB, for messages."""
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def free_bytes(d=None):
    """Bytes free in d (default shm_dir()), or None if it cannot be read."""
    return _free_bytes(d or shm_dir())


def _free_bytes(d):
    try:
        st = os.statvfs(d)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def sweep_stale(d=None):
    """Remove the blocks in d (default shm_dir()) no live process holds (a SIGKILLed
    aggregator's flocks went with it), whatever pid namespace made them -> count."""
    n, d = 0, d or shm_dir()
    try:
        names = os.listdir(d)
    except OSError:
        return 0
    for fn in names:
        if not fn.startswith(PREFIX):
            continue
        path = os.path.join(d, fn)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)          # held: its maker is alive
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                os.unlink(path)
                n += 1
        except OSError:
            pass
        finally:
            os.close(fd)
    return n


class BlockArrays(dict):
    """{name: flat float32 array} of `shapes`, in the order of `shapes`: the tensors in memory
    in one shared memory Block (private numpy arrays with shared=False: a round in one
    process), those in `on_disk` as FileTensors of one FileBlock in `disk_dir`. .where(n) says
    where tensor n is, for a worker: (block key, byte offset, count)."""

    def __init__(self, shapes, zero=False, on_disk=(), disk_dir=None, shared=True):
        counts = {n: math.prod(sh) for n, sh in shapes.items()}
        mem = [n for n in counts if n not in on_disk]
        disk = [n for n in counts if n in on_disk]
        self.block = Block(4 * sum(counts[n] for n in mem)) if shared and mem else None
        self.file = FileBlock(4 * sum(counts[n] for n in disk), dir=disk_dir) if disk else None
        self.offsets = {}
        super().__init__()
        for where, names in ((self.block, mem), (self.file, disk)):
            off = 0
            for n in names:
                self.offsets[n] = off
                self[n] = where.view(off, counts[n]) if where is not None else np.empty(counts[n], np.float32)
                off += 4 * counts[n]
        for n in shapes:                                  # in the order of shapes
            self[n] = self.pop(n)
        if zero:
            self.zero()

    def zero(self):
        for a in self.values():
            zero(a)

    def where(self, n):
        a = self[n]
        if isinstance(a, FileTensor):
            return self.file.path, self.offsets[n], a.size
        if self.block is None:
            raise ValueError(f"tensor {n!r} is in private memory (shared=False): a round on workers needs "
                             "shared arrays")
        return self.block.name, self.offsets[n], a.size

    def memory_bytes(self):
        return sum(a.nbytes for a in self.values() if isinstance(a, np.ndarray))

    def disk_bytes(self):
        return sum(a.nbytes for a in self.values() if isinstance(a, FileTensor))

    def sync(self):
        if self.file is not None:
            self.file.sync()

    def release(self):
        """Let go of the blocks now (the arrays must not be used after)."""
        for b in (self.block, self.file):
            if b is not None:
                b.release()

    def __del__(self):
        if getattr(self, "block", None) is not None or getattr(self, "file", None) is not None:
            self.release()


def share(arrays, shapes):
    """A dict of private arrays (or None) as BlockArrays in shared memory, copied tensor by
    tensor and each private array dropped as soon as it is copied: the peak is the arrays plus
    one tensor. Arrays already in blocks stay as they are."""
    if arrays is None or isinstance(arrays, BlockArrays):
        return arrays
    out = BlockArrays(shapes)
    for n in list(arrays):
        np.copyto(out[n], arrays.pop(n))
    return out


# ---------------------------------------------------------------- the workers

def _send(f, obj):
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    f.write(struct.pack("<Q", len(data)))
    f.write(data)
    f.flush()


def _recv(f):
    head = f.read(8)
    if len(head) < 8:
        raise EOFError("the other end closed")
    (n,) = struct.unpack("<Q", head)
    data = f.read(n)
    if len(data) < n:
        raise EOFError("the other end closed mid-message")
    return pickle.loads(data)


class WorkerDied(RuntimeError):
    """A merge worker exited or answered nothing: the round fails, the state is rebuilt."""


class Pool:
    """`procs` worker processes (the command `argv`, which calls serve()), started at once. run(tasks)
    sends task i to worker i and returns their answers in order; a worker's exception comes
    back and is raised here. Not thread-safe: one round at a time (the aggregator's mem_lock)."""

    def __init__(self, procs, argv):
        if procs < 1:
            raise ValueError(f"--merge-procs {procs}: use 1 or more")
        self.procs, self.argv, self.workers = procs, list(argv), []
        sweep_stale()
        for _ in range(procs):
            self.workers.append(self._start())

    def _start(self):
        env = {**os.environ, "WIRE_THREADS": "1", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
               PARENT_ENV: str(os.getpid())}
        return subprocess.Popen(self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
                                cwd=os.path.dirname(os.path.abspath(__file__)))

    def run(self, tasks):
        if len(tasks) > self.procs:
            raise ValueError(f"{len(tasks)} tasks for {self.procs} workers")
        for i, w in enumerate(self.workers[:len(tasks)]):
            if w.poll() is not None:                     # died since the last round: a new one
                self.workers[i] = w = self._start()
        sent = []
        try:
            for w, t in zip(self.workers, tasks):
                _send(w.stdin, t)
                sent.append(w)
            answers, deadline = [], time.monotonic() + task_timeout_s()
            for w in sent:
                if not select.select([w.stdout], [], [], max(0.0, deadline - time.monotonic()))[0]:
                    raise TimeoutError(f"worker {w.pid} answered nothing in {task_timeout_s():g} s (stopped or "
                                       f"hung; ${TIMEOUT_ENV})")
                answers.append(_recv(w.stdout))
        except (EOFError, BrokenPipeError, OSError) as e:     # TimeoutError too
            for w in self.workers:                       # whatever a worker was doing is abandoned
                self._stop(w)
            self.workers = [self._start() for _ in range(self.procs)]
            raise WorkerDied(f"a merge worker died mid-round ({type(e).__name__}: {e}); the workers were "
                             "started again") from None
        for a in answers:
            if a[0] == "error":
                raise a[1]
        return [a[1] for a in answers]

    @staticmethod
    def _stop(w):
        try:
            w.kill()
            w.wait(30)
        except OSError:
            pass
        except subprocess.TimeoutExpired:         # stuck in the kernel (a hung disk): never a reason to raise here
            print(f"fedmom_merge: merge worker {w.pid} has not exited 30 s after SIGKILL; left behind",
                  file=sys.stderr, flush=True)
        for f in (w.stdin, w.stdout):
            try:
                f.close()
            except OSError:
                pass

    def close(self):
        for w in self.workers:
            try:
                w.stdin.close()                          # EOF: every worker exits, all at once
            except OSError:
                pass
        deadline = time.monotonic() + 30
        for w in self.workers:
            try:
                w.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            self._stop(w)
        self.workers = []


def _exit_with_parent():
    """A thread of the worker's: it exits as soon as its aggregator is gone, mid-task too
    (between tasks the pipe's EOF says so as well), so that no worker of a killed aggregator
    keeps its shared memory mapped: the restart's check (outer_state.check_machine)
    needs that memory free."""
    parent = int(os.environ.get(PARENT_ENV) or os.getppid())

    def watch():
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        os._exit(1)
    threading.Thread(target=watch, name="merge-worker-parent", daemon=True).start()


def serve(session):
    """A worker's loop: answer Tasks from stdin with session.run(task, blocks) until EOF (the
    aggregator closed the pipe, or died). Each task names the shared blocks it uses; they are
    mapped on first use and dropped when a task no longer names them."""
    _exit_with_parent()
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr                             # nothing but answers on the pipe
    blocks = {}
    while True:
        try:
            task = _recv(inp)
        except EOFError:
            return
        try:
            names = task.blocks()
            for name in names:
                if name not in blocks:                  # a file block's key is its path
                    blocks[name] = FileBlock(path=name) if os.path.isabs(name) else Block(name=name)
            for name in [b for b in blocks if b not in names]:
                if isinstance(blocks[name], FileBlock):
                    blocks[name].release()
                del blocks[name]                        # unmapped once no view of it is left
            _send(out, ("ok", session.run(task, blocks)))
        except Exception as e:                          # sent back whole: the aggregator raises it
            try:
                pickle.dumps(e)
            except Exception:
                e = RuntimeError(f"{type(e).__name__}: {e}")
            _send(out, ("error", e))
