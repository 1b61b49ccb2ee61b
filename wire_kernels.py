"""wire_kernels.py - the fast path under wire.py: the int8/int4/int2 block kernels in numpy, and the
threads they and wire.py's streaming loops run on.

Runs on: both ends, wherever wire.py runs: a site encodes, the central VM decodes, merges and
publishes (fedmom_merge.py and outer_state.py call the span kernels on pieces of their own).
Python + numpy + tensorio.py only; never torch. No server, no port, no state directory,
nothing to run from the shell. wire.py's Codec calls it; tests/test_wire.py FastPathTest
checks it bit for bit against the plain numpy reference kept in wire.py
(Codec.encode/decode(reference=True)), and bench/wire_speed.py times both.

The formats are wire.py's (its module docstring is their one statement); what is here is
how their int8/int4/int2 blocks are computed fast:
  - a tensor seen as X [R, C] (as_blocks): when its last dimension is a multiple of the
    block, X is [rows x blocks, block] (one scale per row of X, the flattened order
    unchanged, no padding); else X is [rows, cols] and each chunk is zero-padded to whole
    blocks in its buffer. With it the layout arithmetic wire.py's parts use too (rows_cols,
    packed_bytes) and the grid's one rounding rule, bf16_up (a scale rounded UP to bfloat16).
  - encode_span / decode_span: rows [a, b) of X, CHUNK values at a time in reused buffers,
    the same float32 operations as the reference; encode_blocks / decode_blocks: one
    tensor, its spans on threads.
  - the threads: run_spans (spans of about TASK values on one shared pool per size and
    process; threads= default $WIRE_THREADS or every core: numpy releases the GIL), Behind
    (jobs in order on one thread behind the caller: a write, a hash) and Pipeline (wire.py's
    file-to-file loops: tensor i computed while tensor i-1's sha256 and write run behind).

    codes, sbits, sent = wire_kernels.encode_blocks(wire.Codec("int4"), x, threads=8)
    out, bad = wire_kernels.decode_blocks(codec, codes, sbits, x.shape, threads=8)  # bad: None, or why not

A kernel is handed the codec (a wire.Codec of int8 or int4: it reads fmt, block and levels);
this module never imports wire.py, which imports it.
"""
import concurrent.futures
import math
import os
import threading

import numpy as np

import tensorio

# ---------------------------------------------------------------- the layout and the scale

def rows_cols(shape):
    """A tensor as [rows, cols] along its last dimension (a scalar is one 1-value row)."""
    cols = shape[-1] if shape else 1
    return (math.prod(shape) // cols if cols else 0), cols


def packed_bytes(count, nbits):
    """Bytes that `count` values of `nbits` bits take, packed (the last byte padded with 0)."""
    return (count * nbits + 7) // 8


def bf16_up(a):
    """float32 >= 0 -> bfloat16 bits, rounded UP (toward +inf): the stored scale is never
    smaller than the one asked for, so no value of its block leaves the grid."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    hi = (u >> np.uint32(16)).astype(np.uint16)
    hi[(u & np.uint32(0xFFFF)) != 0] += np.uint16(1)
    return hi


def as_blocks(shape, block):
    """-> (R, C, nb): X's rows and columns and the blocks per row of X."""
    rows, cols = rows_cols(shape)
    if cols and cols % block == 0:
        return rows * (cols // block), block, 1
    return rows, cols, -(-cols // block)


CODE_BITS = {"int8": 8, "int4": 4, "int2": 2}      # bits of one block code; int4/int2 are packed


def row_unit(C, fmt):
    """int4 packs two values a byte over the flattened tensor, int2 four: a span must start
    on a byte, so it takes rows in pairs (int4, odd C) or in fours (int2, C not a multiple of 4)."""
    per_byte = 8 // CODE_BITS[fmt]
    return per_byte // math.gcd(C, per_byte) if per_byte > 1 else 1


def code_start(fmt, v):
    """The index into a tensor's codes of value v (int4/int2: a byte of the packed codes;
    v on a byte boundary; int8: the value itself)."""
    return v * CODE_BITS[fmt] // 8


# ---------------------------------------------------------------- int2's scale (wire.py's docstring: the rule)

def int2_scale_bits(x2, block):
    """x as [r, C] (rows of whole blocks, the row's last block maybe short) -> bf16 scale
    bits [r, nb]: each block's largest magnitude / 3, rounded UP (NaN if the block holds one)."""
    r, C = x2.shape
    nfull, tail = divmod(C, block)
    mag = np.abs(x2)
    parts = []
    if nfull:
        parts.append(mag[:, :nfull * block].reshape(r, nfull, block).max(axis=2))
    if tail:
        parts.append(mag[:, nfull * block:].max(axis=1, keepdims=True))
    amax = np.concatenate(parts, axis=1) if len(parts) > 1 else parts[0] if parts else np.zeros((r, 0), np.float32)
    return bf16_up(amax / np.float32(3))


def int2_grid(t):
    """t = x / scale (float32) -> q, the nearest odd level in {-3, -1, 1, 3} (a tie, t even,
    goes up): 2 floor(t / 2) + 1, clipped. Every step is exact in float32."""
    q = np.floor(t * np.float32(0.5))
    q *= np.float32(2)
    q += np.float32(1)
    np.clip(q, -3, 3, out=q)
    return q


# ---------------------------------------------------------------- threads

CHUNK = 1 << 16       # values per step of the block kernels: 256 KiB of f32, in L2 while it is worked on
TASK = 1 << 20        # values per task handed to a thread (fewer, larger tasks: less Python per value)
_pools, _pools_lock = {}, threading.Lock()


def default_threads():
    """Threads for encode/decode/apply: $WIRE_THREADS, else every core (numpy releases the GIL)."""
    env = os.environ.get("WIRE_THREADS", "").strip()
    if env:
        if not env.isdigit() or int(env) < 1:
            raise ValueError(f"WIRE_THREADS={env!r}: use a whole number of threads >= 1")
        return int(env)
    return os.cpu_count() or 1


def resolve_threads(threads):
    """None -> default_threads(); else a whole number >= 1 (the error names --threads)."""
    if threads is None:
        return default_threads()
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"--threads {threads!r}: use a whole number of threads >= 1")
    return threads


def _pool(threads):
    """One shared pool per size and process, made on first use (nothing runs at import;
    a forked child has none of its parent's threads, so it makes its own)."""
    key = (os.getpid(), threads)
    with _pools_lock:
        if key not in _pools:
            _pools[key] = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="wire")
        return _pools[key]


def run_spans(fn, rows, unit, per_row, threads):
    """fn(a, b) over [0, rows) in spans of whole `unit`s of rows, about TASK values each,
    on `threads` threads (inline for one thread or one span). Spans never overlap, so each
    writes its own slice of the outputs and the result does not depend on the threads.
    Called from inside a span (the merge's chunks decode a compressed delta), it runs
    inline: its spans would wait in the queue behind the very spans waiting for them."""
    step = max(unit, -(-max(1, TASK // max(per_row, 1)) // unit) * unit)
    spans = [(a, min(a + step, rows)) for a in range(0, rows, step)]
    if threads <= 1 or len(spans) <= 1 or getattr(_in_span, "on", False):
        for a, b in spans:
            fn(a, b)
        return
    futures = [_pool(threads).submit(_span, fn, a, b) for a, b in spans]
    errors = [f.exception() for f in futures]          # every span ended before one is raised: nothing
    for e in errors:                                   # writes the caller's arrays after this returns
        if e is not None:
            raise e


_in_span = threading.local()


def _span(fn, a, b):
    _in_span.on = True
    try:
        fn(a, b)
    finally:
        _in_span.on = False


class Behind:
    """Jobs run in submission order on one thread behind the caller (a write, a hash):
    submit() returns a future; result() of a later one re-raises an earlier failure."""

    def __init__(self):
        self.ex = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="wire-behind")

    def submit(self, fn, *args):
        return self.ex.submit(fn, *args)

    def close(self):
        self.ex.shutdown(wait=True)


class Pipeline:
    """wire.py's streaming loops (decode_file, apply_update, theta_digest), one tensor after
    another with the slow serial parts behind: tensor i is computed in buffer set i % 2
    while the jobs submitted for tensor i - 1 (the sha256 of a Digest, the write of the
    output file: each on its own thread, in order) still read set (i - 1) % 2. Buffers are float32, the largest tensor's size, reused: peak
    memory is 2 x `per_set` x the largest tensor, and no page is faulted in twice."""

    def __init__(self, size, per_set, lanes):
        self.sets = [[np.empty(size, np.float32) for _ in range(per_set)] for _ in range(2)]
        self.lanes = [Behind() for _ in range(lanes)]
        self.pending, self.i = [[], []], 0

    def next(self):
        """-> (the buffers of the next tensor, a token for behind()); waits for their last jobs."""
        k = self.i % 2
        self.i += 1
        self._wait(k)
        return self.sets[k], k

    def behind(self, k, lane, fn, *args):
        self.pending[k].append(self.lanes[lane].submit(fn, *args))

    def _wait(self, k):
        jobs, self.pending[k] = self.pending[k], []
        for f in jobs:
            f.result()

    def finish(self):
        """Wait for every job (re-raising the first failure)."""
        for k in (self.i % 2, (self.i + 1) % 2):
            self._wait(k)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for lane in self.lanes:          # the jobs in flight end before a writer is aborted
            lane.close()
        return False


# ---------------------------------------------------------------- the block kernels (int8, int4)
#
# The fast path of wire.Codec's int8/int4/int2 encode and decode: the same float32 operations as
# its reference (Codec._encode_blocks_ref, and decode(reference=True)), done CHUNK values at
# a time in reused buffers, on threads, over X [R, C] as as_blocks() sees the tensor.

def encode_span(X, a, b, codec, codes, sbits, sent):
    """Rows [a, b) of X -> their codes, scales (BF16 bits, [R, nb]) and decoded values."""
    if codec.fmt == "int2":
        return encode2_span(X, a, b, codec, codes, sbits, sent)
    block, fmt, levels = codec.block, codec.fmt, codec.levels
    C, nb = X.shape[1], sbits.shape[1]
    W, unit = nb * block, row_unit(C, fmt)
    step = max(unit, CHUNK // W // unit * unit)
    buf = np.zeros((step, W), np.float32)           # q; the pad columns of a ragged row start at 0
    mag = np.zeros((step, W), np.float32)
    amax = np.empty((step, nb), np.float32)
    u8 = np.empty((step, W), np.uint8) if fmt == "int4" else None
    for r0 in range(a, b, step):
        r1 = min(r0 + step, b)
        r = r1 - r0
        q, m, am = buf[:r], mag[:r], amax[:r]
        qb = q.reshape(r, nb, block)
        if W == C:
            src = X[r0:r1].reshape(r, nb, block)
            np.abs(X[r0:r1], out=m)
        else:                                        # ragged: the row padded with zeros to whole blocks
            q[:, :C] = X[r0:r1]
            q[:, C:] = 0
            src = qb
            np.abs(q, out=m)
        # the block's largest magnitude, reduced as int32 bits: the same order for floats
        # >= 0, and numpy's integer reduction is the vectorised one (about 2x here)
        np.maximum.reduce(m.reshape(r, nb, block).view(np.int32), axis=2, out=am.view(np.int32))
        am /= np.float32(levels)
        bits = bf16_up(am)
        sbits[r0:r1] = bits
        scale = tensorio.bf16_to_f32(bits)[:, :, None]
        with np.errstate(divide="ignore", invalid="ignore"):
            np.divide(src, scale, out=qb)            # IEEE division, as the reference's x / scale
        np.rint(qb, out=qb)
        # no clip: |x| <= amax and scale >= fl(amax / L), so |x| / scale <= L (1 + 2^-17) and
        # rint gives at most L (a subnormal fl(amax / L) rounds up to a bfloat16 >= 2^-133 first)
        if not scale.all():                          # a zero block (or one below the bf16 range): codes 0
            qb[scale[:, :, 0] == 0] = 0
        if fmt == "int4":
            qb += np.float32(8)                      # codes 1..15; and -0.0 + 8 - 8 is +0.0, as in the reference
            np.copyto(u8[:r], q, casting="unsafe")
            qb -= np.float32(8)
            pack4_rows(u8[:r, :C], r0 * C, codes)
        else:
            qb += np.float32(0)                      # -0.0 -> +0.0: the reference's codes pass through int8
            np.copyto(codes[r0:r1], q[:, :C], casting="unsafe")
        if W == C:
            np.multiply(qb, scale, out=sent[r0:r1].reshape(r, nb, block))
        else:
            with np.errstate(over="ignore"):
                np.multiply(qb, scale, out=qb)
            sent[r0:r1] = q[:, :C]
    # (an overflowing product is Inf, as in the reference: the receiver's finiteness check refuses it)


def encode2_span(X, a, b, codec, codes, sbits, sent):
    """int2: rows [a, b) of X -> packed codes (from value a x C, a byte boundary: row_unit),
    scales and decoded values; the same float32 operations as wire.Codec's reference."""
    block, C, nb = codec.block, X.shape[1], sbits.shape[1]
    unit = row_unit(C, "int2")
    step = max(unit, CHUNK // max(C, 1) // unit * unit)
    for r0 in range(a, b, step):
        r1 = min(r0 + step, b)
        x = X[r0:r1]
        bits = int2_scale_bits(x, block)
        sbits[r0:r1] = bits
        per = np.repeat(tensorio.bf16_to_f32(bits), block, axis=1)[:, :C]
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):    # beyond 3s: clipped below
            t = np.divide(x, per)                    # IEEE division, as the reference's x / scale
        t[np.broadcast_to(per == 0, t.shape)] = 0    # a zero block: q = 1, and 1 x 0 = +0.0
        q = int2_grid(t)
        pack2_rows(((q + np.float32(3)) * np.float32(0.5)).astype(np.uint8), r0 * C, codes)
        with np.errstate(over="ignore", invalid="ignore"):
            np.multiply(q, per, out=sent[r0:r1])


def pack2_rows(u8, start, packed):
    """Codes (uint8 < 4) of values start.. (start a multiple of 4) into packed[start // 4 ..]:
    value 4i + j at bits 2j of byte i; the tensor's last byte's unused high bits 0."""
    flat = np.ascontiguousarray(u8).reshape(-1)
    whole = flat.size // 4 * 4
    v = flat[:whole].reshape(-1, 4)
    out = packed[start // 4:start // 4 + whole // 4]
    np.copyto(out, v[:, 0])
    for j in (1, 2, 3):
        out |= v[:, j] << np.uint8(2 * j)
    if whole < flat.size:                            # the tensor's last values
        tail = flat[whole:]
        packed[(start + whole) // 4] = sum(int(c) << (2 * j) for j, c in enumerate(tail))


def unpack2(packed, count):
    """The inverse of pack2_rows: `count` codes (uint8 < 4) from packed bytes."""
    out = np.empty((packed.size, 4), np.uint8)
    for j in range(4):
        np.right_shift(packed, np.uint8(2 * j), out=out[:, j])
    out &= np.uint8(3)
    return out.reshape(-1)[:count]


def pack4_rows(u8, start, packed):
    """Codes (uint8 < 16, [r, C]) of values start.. into packed[start // 2 ..]: each pair is
    one little-endian uint16 (lo, hi), so lo | hi << 4 is (v | v >> 4) & 0xFF."""
    flat = np.ascontiguousarray(u8).reshape(-1)
    even = flat.size // 2 * 2
    v = flat[:even].view(np.uint16)
    t = v >> np.uint16(4)
    t |= v
    np.copyto(packed[start // 2:start // 2 + even // 2], t, casting="unsafe")
    if even < flat.size:                             # the tensor's odd last value: the high nibble is 0
        packed[(start + even) // 2] = flat[-1]


def decode_span(codes, scale, a, b, C, codec, out, bad):
    """Rows [a, b) of X from codes and float32 scales [R, nb] into out [R, C]; a code
    outside the symmetric range is put in `bad` (the caller raises)."""
    block, fmt, nb = codec.block, codec.fmt, scale.shape[1]
    W, unit = nb * block, row_unit(C, fmt)
    step = max(unit, CHUNK // W // unit * unit)
    if fmt == "int2":                                # every code 0..3 is a level: nothing to refuse
        for r0 in range(a, b, step):
            r1 = min(r0 + step, b)
            cnt = (r1 - r0) * C
            q = unpack2(codes[r0 * C // 4:(r0 * C + cnt + 3) // 4], cnt).astype(np.float32)
            q *= np.float32(2)
            q -= np.float32(3)                       # q = 2 code - 3: -3, -1, 1, 3
            with np.errstate(over="ignore"):
                np.multiply(q.reshape(r1 - r0, C), np.repeat(scale[r0:r1], block, axis=1)[:, :C], out=out[r0:r1])
        return
    if fmt == "int4":
        v = np.empty(-(-step * C // 2), np.uint16)
        t = np.empty_like(v)
    qf = np.empty((step, W), np.float32)
    for r0 in range(a, b, step):
        r1 = min(r0 + step, b)
        r, cnt = r1 - r0, (r1 - r0) * C
        if fmt == "int4":
            src = codes[r0 * C // 2:(r0 * C + cnt + 1) // 2]
            vv, tt = v[:src.size], t[:src.size]
            np.copyto(vv, src)                       # byte (hi, lo) -> uint16 0x0h0l, little-endian: lo, hi
            np.bitwise_and(vv, np.uint16(0xF0), out=tt)
            tt <<= np.uint16(4)
            vv &= np.uint16(0x0F)
            vv |= tt
            q8 = vv.view(np.uint8)[:cnt]
            if cnt and q8.min() == 0:
                bad.append("int4 code 0 (= -8) is outside the symmetric range [-7, 7]")
                return
            q = qf[:r, :C]
            np.subtract(q8.reshape(r, C), np.float32(8), out=q)
        else:
            q8 = codes[r0:r1]
            if cnt and q8.min() < -127:
                bad.append("code -128 is outside the symmetric int8 range [-127, 127]")
                return
            q = q8                                   # int8 x float32 scale multiplies in float32
        with np.errstate(over="ignore"):             # an overflow is Inf: the receiver's finiteness check refuses it
            if W == C:
                np.multiply(q.reshape(r, nb, block), scale[r0:r1, :, None], out=out[r0:r1].reshape(r, nb, block))
            else:
                np.multiply(q, np.repeat(scale[r0:r1], block, axis=1)[:, :C], out=out[r0:r1])


def encode_blocks(codec, x, threads=1):
    """int8/int4/int2, the fast path: x (float32) -> (codes, scale bits [rows, nb], decoded x)."""
    block, fmt = codec.block, codec.fmt
    rows, cols = rows_cols(x.shape)
    R, C, nb = as_blocks(x.shape, block)
    X = x.reshape(R, C)
    sbits = np.empty((R, nb), np.uint16)
    sent = np.empty(x.shape, np.float32)
    codes = np.empty(x.shape, np.int8) if fmt == "int8" else np.empty(packed_bytes(x.size, CODE_BITS[fmt]), np.uint8)
    cview = codes.reshape(R, C) if fmt == "int8" else codes
    run_spans(lambda a, b: encode_span(X, a, b, codec, cview, sbits, sent.reshape(R, C)),
              R, row_unit(C, fmt), C, threads)
    return codes, sbits.reshape(rows, -(-cols // block)), sent


def decode_blocks(codec, codes, sbits, shape, threads=1, out=None):
    """int8/int4/int2, the fast path: parts as read (their scales and padding already checked,
    as wire.Codec.decode does) -> (float32 of `shape`, into `out` if given; None, or why a
    code is out of range: the caller raises)."""
    block, fmt, n = codec.block, codec.fmt, math.prod(shape)
    R, C, nb = as_blocks(shape, block)
    scale = tensorio.bf16_to_f32(sbits).reshape(R, nb)
    out = np.empty(shape, np.float32) if out is None else out.reshape(-1)[:n].reshape(shape)
    cview = codes.reshape(R, C) if fmt == "int8" else codes.reshape(-1)
    bad = []
    run_spans(lambda a, b: decode_span(cview, scale, a, b, C, codec, out.reshape(R, C), bad),
              R, row_unit(C, fmt), C, threads)
    return out, (bad[0] if bad else None)
