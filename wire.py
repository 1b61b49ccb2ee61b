"""wire.py - compressed delta files: the wire formats of a site's outer-round delta and of the
update that carries theta_global from one round to the next, with their fast numpy kernels.

Runs on both ends (numpy + tensorio.py, never torch): sites encode (train.py --wire, through
fedphase.py) and the central VM decodes at acceptance (fedmom_state.py); downstream
(fedmom_server.py --down-wire) the VM encodes each round's update (fedmom_merge.Publisher) and
a site holding the previous round applies it (fedsite.py, apply_update). wire_torch.py is the
same int8/int4/int2 codec in torch. From the shell:
    python wire.py FILE            # header: wire format, parameters, one line per tensor
    python wire.py FILE --check    # also decode every tensor once (--threads N: its threads)

The formats (--wire), per tensor NAME; n values, b = --wire-block (64-256), in B/param:
    f32, bf16  plain tensors: 4 exact; 2, rounded to nearest even
    int8  NAME I8 (NAME's shape): q in [-127, 127]; NAME#scale BF16 [rows, nblocks]: one scale
          per block of b values along the last dimension (a row's last may be short): 1 + 2/b
    int4  NAME U8 [ceil(n/2)]: q + 8 (q in [-7, 7]), two per byte of the flattened tensor,
          element 2i in byte i's low nibble (an odd tensor's last high nibble 0): 0.5 + 2/b
    int2  NAME U8 [ceil(n/4)]: (q + 3) / 2 for q in {-3, -1, 1, 3} (no zero level), element
          4i + j in bits 2j of byte i (unused bits 0); scales by their own rule: 0.25 + 2/b
    topk  per chunk of --wire-topk-chunk values the --wire-topk-k largest magnitudes: NAME U8
          their codes (q + 2^(bits-1), --wire-topk-bits 8 or 4; 2: int2's grid and code),
          NAME#idx U8 their positions in the chunk (ceil(log2 chunk) bits each, increasing),
          both packed little-endian bit by bit; NAME#scale BF16 [nchunks]
A value is q x scale in float32 (one IEEE multiply: numpy and a site's torch get the same
bits). A scale is its block's largest magnitude / L (127, 7, 3; topk 2^(bits-1) - 1), rounded
UP to bfloat16: no clipping. Files keep the safetensors layout; __metadata__ says "wire":
"pww-wire/1", "wire_format", "wire_block" (topk: "wire_topk_chunk", "wire_topk_k",
"wire_topk_bits"), "wire_shapes" (JSON {NAME: decoded shape}) and "wire_parts" (the naming
above). A file without "wire" is a plain F32/F16/BF16 tensor file, read as it is.

Its parts, in reading order: bit packing; scales; Codec (encode, decode; reference=True is the
plain numpy definition the fast path matches bit for bit: tests/test_wire.py FastPathTest,
bench/wire_speed.py); the files (WireWriter; WireReader checks the layout at open and each
tensor as it decodes, WireError naming it); theta by updates (add_update, Digest, apply_update,
decode_file: a tensor at a time); then the fast path: the layout and the scale, int2's scale,
the threads (run_spans, Behind, Pipeline) and the int8/int4/int2 block kernels.

Why no clipping, and error feedback: FEDERATION_GUIDE.md, "Wire formats and error feedback".
"""
import argparse
import concurrent.futures
import dataclasses
import json
import math
import os
import struct
import sys
import threading

import numpy as np

import tensorio

WIRE = "pww-wire/1"
FORMATS = ("f32", "bf16", "int8", "int4", "int2", "topk")
LOSSLESS = ("f32",)
SCALE, INDEX = "#scale", "#idx"       # part suffixes: '#' is in no parameter name
PARTS_DOC = ("NAME: codes (int8: I8, NAME's shape; int4/int2/topk: packed U8); NAME#scale: BF16 scales "
             "(int8/int4/int2: [rows, ceil(cols/block)] along the last dim; topk: one per chunk); "
             "NAME#idx: topk positions in the chunk, packed U8")
LEVELS = {"int8": 127, "int4": 7, "int2": 3}      # the block formats: their largest |q|


class WireError(ValueError):
    """A wire file that must not be decoded; the message names the file, the tensor and why."""


# ---------------------------------------------------------------- bit packing

def pack_bits(codes, nbits):
    """Unsigned integers < 2**nbits -> U8, little-endian bit order (value i starts at bit i*nbits)."""
    codes = np.asarray(codes).reshape(-1)
    if nbits == 4:                                    # the int4 fast path: two nibbles a byte
        c = codes.astype(np.uint8)
        if c.size % 2:
            c = np.append(c, np.uint8(0))
        return c[0::2] | (c[1::2] << np.uint8(4))
    if nbits == 8:
        return codes.astype(np.uint8)
    shifts = np.arange(nbits, dtype=np.uint32)
    bits = ((codes.astype(np.uint32)[:, None] >> shifts) & np.uint32(1)).astype(np.uint8)
    return np.packbits(bits.reshape(-1), bitorder="little")


def unpack_bits(packed, nbits, count):
    """The inverse of pack_bits: `count` unsigned integers (uint32 or narrower)."""
    packed = np.asarray(packed, dtype=np.uint8).reshape(-1)
    if nbits == 4:
        out = np.empty(packed.size * 2, np.uint8)
        out[0::2] = packed & np.uint8(0x0F)
        out[1::2] = packed >> np.uint8(4)
        return out[:count]
    if nbits == 8:
        return packed[:count]
    bits = np.unpackbits(packed, count=count * nbits, bitorder="little").reshape(count, nbits)
    return (bits.astype(np.uint32) << np.arange(nbits, dtype=np.uint32)).sum(axis=1, dtype=np.uint32)


def padding_is_zero(packed, nbits, count):
    """The bits after the last value are 0 (a stray bit there is a damaged or forged file)."""
    used = count * nbits
    if used % 8 == 0 or packed.size == 0:
        return True
    return int(packed[-1]) >> (used % 8) == 0


# ---------------------------------------------------------------- scales (how they are made: bf16_up)

def scales_ok(bits):
    """BF16 scale bits that are finite and >= 0 (-0 is taken as 0)."""
    negative = ((bits & np.uint16(0x8000)) != 0) & (bits != np.uint16(0x8000))
    return not np.any((bits & np.uint16(0x7F80)) == np.uint16(0x7F80)) and not np.any(negative)


def _odd_grid(x, scale):
    """int2's q: the nearest odd integer to x / scale (a tie goes up) in [-3, 3]; 1 where scale is 0."""
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):     # beyond 3 x scale: clipped
        t = np.where(scale == 0, np.float32(0), x / np.where(scale == 0, np.float32(1), scale)).astype(np.float32)
    return np.clip(np.floor(t / np.float32(2)) * np.float32(2) + np.float32(1), -3, 3).astype(np.int8)


def _grid(x, scale, levels):
    """q = rint(x / scale) in [-levels, levels]; 0 where scale is 0."""
    safe = np.where(scale > 0, scale, np.float32(1))
    q = np.rint(x / safe)
    np.clip(q, -levels, levels, out=q)
    q[np.broadcast_to(scale == 0, q.shape)] = 0
    return q.astype(np.int8 if levels <= 127 else np.int16)


# ---------------------------------------------------------------- the codec

@dataclasses.dataclass(frozen=True)
class Codec:
    """One wire format and its parameters; encode/decode one tensor, say its parts."""
    fmt: str = "f32"
    block: int = 128          # int8/int4/int2: values per scale along the last dimension
    topk_chunk: int = 4096    # topk: values per chunk of the flattened tensor
    topk_k: int = 64          # topk: values kept per chunk
    topk_bits: int = 4        # topk: bits per kept value

    def validate(self):
        if self.fmt not in FORMATS:
            raise ValueError(f"--wire {self.fmt!r}: use one of {', '.join(FORMATS)}")
        if not 64 <= self.block <= 256:
            raise ValueError(f"--wire-block {self.block}: use 64 to 256 values per scale (128 is the default)")
        if not 2 <= self.topk_chunk <= 1 << 16:
            raise ValueError(f"--wire-topk-chunk {self.topk_chunk}: use 2 to 65536 values per chunk")
        if not 1 <= self.topk_k <= self.topk_chunk:
            raise ValueError(f"--wire-topk-k {self.topk_k}: use 1 to --wire-topk-chunk ({self.topk_chunk})")
        if self.topk_bits not in (2, 4, 8):
            raise ValueError(f"--wire-topk-bits {self.topk_bits}: use 2, 4 or 8")
        return self

    @property
    def levels(self):
        """int8/int4/int2: the largest code magnitude L, 127, 7 or 3 (LEVELS)."""
        return LEVELS[self.fmt]

    @property
    def index_bits(self):
        return max(1, (self.topk_chunk - 1).bit_length())

    def metadata(self):
        meta = {"wire": WIRE, "wire_format": self.fmt, "wire_parts": PARTS_DOC}
        if self.fmt in LEVELS:
            meta["wire_block"] = str(self.block)
        if self.fmt == "topk":
            meta.update(wire_topk_chunk=str(self.topk_chunk), wire_topk_k=str(self.topk_k),
                        wire_topk_bits=str(self.topk_bits))
        return meta

    @classmethod
    def from_metadata(cls, meta, path):
        fmt = meta.get("wire_format")
        if meta.get("wire") != WIRE or fmt not in FORMATS[2:]:
            raise WireError(f"{path}: wire {meta.get('wire')!r} format {fmt!r}; this wire.py reads "
                            f"{WIRE!r} with {', '.join(FORMATS[2:])}: update it, or resend")
        try:
            kw = {k: int(meta[f"wire_{k}"]) for k in ("block",) if fmt in LEVELS}
            if fmt == "topk":
                kw.update({k: int(meta[f"wire_{k}"]) for k in ("topk_chunk", "topk_k", "topk_bits")})
            return cls(fmt, **kw).validate()
        except (KeyError, ValueError) as e:
            raise WireError(f"{path}: bad wire parameters in the metadata ({e})") from None

    # -- layout
    def chunks(self, n):
        """topk: (number of chunks, values kept in all chunks)."""
        c, k = self.topk_chunk, self.topk_k
        nch = -(-n // c)
        last = n - (nch - 1) * c if nch else 0
        return nch, (nch - 1) * k + min(k, last) if nch else 0

    def parts(self, name, shape):
        """[(part name, dtype, shape)] of one tensor in the file, codes first."""
        shape, n = tuple(shape), math.prod(shape)
        rows, cols = rows_cols(shape)
        nb = -(-cols // self.block)
        if self.fmt == "f32":
            return [(name, "F32", shape)]
        if self.fmt == "bf16":
            return [(name, "BF16", shape)]
        if self.fmt == "int8":
            return [(name, "I8", shape), (name + SCALE, "BF16", (rows, nb))]
        if self.fmt in ("int4", "int2"):
            return [(name, "U8", (packed_bytes(n, CODE_BITS[self.fmt]),)),
                    (name + SCALE, "BF16", (rows, nb))]
        nch, m = self.chunks(n)
        return [(name, "U8", (packed_bytes(m, self.topk_bits),)),
                (name + INDEX, "U8", (packed_bytes(m, self.index_bits),)),
                (name + SCALE, "BF16", (nch,))]

    # -- one tensor
    def encode(self, x, threads=None, reference=False):
        """float32 array -> ({part name suffix: array}, what the receiver will decode, float32).
        threads: for int8/int4/int2 (None: $WIRE_THREADS, else every core); reference: the plain numpy
        version of the block formats, kept as the definition the fast path is tested against."""
        x = np.require(x, np.float32, "C")        # (ascontiguousarray makes a scalar 1-d)
        if self.fmt == "f32":
            return {"": x}, x
        if self.fmt == "bf16":
            bits = tensorio.f32_to_bf16(x)
            return {"": bits}, tensorio.bf16_to_f32(bits).reshape(x.shape)
        if self.fmt == "topk":
            return self._encode_topk(x)
        if reference:
            return self._encode_blocks_ref(x)
        codes, sbits, sent = encode_blocks(self, x, resolve_threads(threads))
        return {"": codes, SCALE: sbits}, sent

    def _blocked(self, x):
        """x as [rows, nblocks, block] (the short last block of a row zero-padded)."""
        rows, cols = rows_cols(x.shape)
        nb = -(-cols // self.block)
        x2 = x.reshape(rows, cols)
        if cols != nb * self.block:
            x2 = np.concatenate([x2, np.zeros((rows, nb * self.block - cols), np.float32)], axis=1)
        return x2.reshape(rows, nb, self.block), cols

    def _encode_blocks_ref(self, x):
        if self.fmt == "int2":
            return self._encode_int2_ref(x)
        levels = LEVELS[self.fmt]
        xb, cols = self._blocked(x)
        sbits = bf16_up(np.abs(xb).max(axis=2, initial=0.0) / np.float32(levels))
        scale = tensorio.bf16_to_f32(sbits)
        q = _grid(xb, scale[:, :, None], levels)
        q = q.reshape(q.shape[0], q.shape[1] * self.block)[:, :cols].reshape(x.shape)
        codes = q if self.fmt == "int8" else pack_bits((q.reshape(-1) + 8).astype(np.uint8), 4)
        return {"": codes, SCALE: sbits}, self._dequant_blocks(q, scale, x.shape)

    def _encode_int2_ref(self, x):
        """int2, plainly: each block's scale absmax / 3 (its own values), q the nearest odd level."""
        rows, cols = rows_cols(x.shape)
        x2 = x.reshape(rows, cols)
        nb = -(-cols // self.block)
        stat = np.zeros((rows, nb), np.float32)
        for j in range(nb):
            stat[:, j] = np.abs(x2[:, j * self.block:(j + 1) * self.block]).max(axis=1) / np.float32(3)
        sbits = bf16_up(stat)
        scale = tensorio.bf16_to_f32(sbits)
        q = _odd_grid(x2, np.repeat(scale, self.block, axis=1)[:, :cols])
        codes = pack_bits(((q.reshape(-1) + 3) // 2).astype(np.uint8), 2)
        return {"": codes, SCALE: sbits}, self._dequant_blocks(q.reshape(x.shape), scale, x.shape)

    def _dequant_blocks(self, q, scale, shape):
        rows, cols = rows_cols(shape)
        per = np.repeat(scale, self.block, axis=1)[:, :cols]
        with np.errstate(over="ignore"):     # an overflow is Inf: the receiver's finiteness check refuses it
            return (q.reshape(rows, cols).astype(np.float32) * per).reshape(shape)

    def _encode_topk(self, x):
        flat, c, k = x.reshape(-1), self.topk_chunk, self.topk_k
        n = flat.size
        nch, m = self.chunks(n)
        idx, vals, sbits = [], [], np.zeros(nch, np.uint16)
        full = n // c
        if full:
            X = flat[:full * c].reshape(full, c)
            sel = np.sort(np.argpartition(-np.abs(X), k - 1, axis=1)[:, :k], axis=1) if k < c else \
                np.broadcast_to(np.arange(c), (full, c))
            idx.append(sel.reshape(-1))
            vals.append(np.take_along_axis(X, sel, axis=1))
        if nch > full:                                   # the short last chunk
            tail = flat[full * c:]
            kk = min(k, tail.size)
            sel = np.sort(np.argpartition(-np.abs(tail), kk - 1)[:kk]) if kk < tail.size else np.arange(tail.size)
            idx.append(sel)
            vals.append(tail[sel])
        levels = 3 if self.topk_bits == 2 else (1 << (self.topk_bits - 1)) - 1
        pos = np.concatenate(idx) if idx else np.zeros(0, np.int64)
        v = np.concatenate([a.reshape(-1) for a in vals]) if vals else np.zeros(0, np.float32)
        owner = self._owners(n, m)
        amax = np.zeros(nch, np.float32)
        np.maximum.at(amax, owner, np.abs(v))
        sbits = bf16_up(amax / np.float32(levels))
        scale = tensorio.bf16_to_f32(sbits)
        if self.topk_bits == 2:                          # int2's grid: the nearest odd level, code (q + 3) / 2
            q = _odd_grid(v, scale[owner])
            codes = pack_bits(((q + 3) // 2).astype(np.uint32), 2)
        else:
            q = _grid(v, scale[owner], levels)
            codes = pack_bits((q.astype(np.int16) + (levels + 1)).astype(np.uint32), self.topk_bits)
        out = np.zeros(n, np.float32)
        out[owner * c + pos] = q.astype(np.float32) * scale[owner]
        return {"": codes, INDEX: pack_bits(pos, self.index_bits), SCALE: sbits}, out.reshape(x.shape)

    def _owners(self, n, m):
        """topk: the chunk of each of the m kept values."""
        nch, _ = self.chunks(n)
        k = self.topk_k
        owner = np.repeat(np.arange(max(nch - 1, 0)), k)
        return np.concatenate([owner, np.full(m - owner.size, nch - 1)]).astype(np.int64)

    def decode(self, parts, shape, where="tensor", threads=None, out=None, reference=False):
        """{suffix: array} as read from the file -> float32 of `shape`; WireError if hostile.
        int8/int4/int2: on `threads` threads, into `out` (a float32 buffer of at least the
        tensor's size, reused: no page faults) if given; reference: the plain version."""
        shape, n = tuple(shape), math.prod(shape)
        if self.fmt == "topk":
            return self._decode_topk(parts, shape, n, where)
        codes, sbits = parts[""], parts[SCALE]
        if not scales_ok(sbits):
            raise WireError(f"{where}: a scale is negative, NaN or Inf")
        if self.fmt in ("int4", "int2") and not padding_is_zero(codes, CODE_BITS[self.fmt], n):
            raise WireError(f"{where}: the padding bits after the last value are not 0")
        if not reference:
            threads = resolve_threads(threads)
            out, bad = decode_blocks(self, codes, sbits, shape, threads, out)
            if bad:
                raise WireError(f"{where}: {bad}")
            return out
        scale = tensorio.bf16_to_f32(sbits)
        if self.fmt == "int2":
            q = (unpack_bits(codes, 2, n).astype(np.int8) * np.int8(2) - np.int8(3)).reshape(shape)
        elif self.fmt == "int8":
            q = codes.reshape(shape)
            if n and q.min() < -127:
                raise WireError(f"{where}: code -128 is outside the symmetric int8 range [-127, 127]")
        else:
            q = unpack_bits(codes, 4, n)
            if n and q.min() == 0:
                raise WireError(f"{where}: int4 code 0 (= -8) is outside the symmetric range [-7, 7]")
            q = (q.astype(np.int8) - np.int8(8)).reshape(shape)
        return self._dequant_blocks(q, scale, shape)

    def _decode_topk(self, parts, shape, n, where):
        nch, m = self.chunks(n)
        c, vb, ib = self.topk_chunk, self.topk_bits, self.index_bits
        sbits = parts[SCALE]
        if not scales_ok(sbits):
            raise WireError(f"{where}: a scale is negative, NaN or Inf")
        for part, bits in (("", vb), (INDEX, ib)):
            if not padding_is_zero(parts[part], bits, m):
                raise WireError(f"{where}{part}: the padding bits after the last value are not 0")
        levels = (1 << (vb - 1)) - 1
        codes = unpack_bits(parts[""], vb, m).astype(np.int32)
        if vb == 2:                                      # the int2 grid: q = 2 code - 3, every code a level
            codes = codes * 2 - 3 + (levels + 1)
        elif m and codes.min() == 0:
            raise WireError(f"{where}: top-k code 0 is outside the symmetric range")
        pos = unpack_bits(parts[INDEX], ib, m).astype(np.int64)
        owner = self._owners(n, m)
        gpos = owner * c + pos
        chunk_end = np.minimum((owner + 1) * c, n)
        if m and (np.any(gpos >= chunk_end) or np.any((np.diff(gpos) <= 0) & (np.diff(owner) == 0))):
            raise WireError(f"{where}{INDEX}: a position is outside its chunk or not increasing "
                            f"(each chunk's positions must be distinct and sorted)")
        out = np.zeros(n, np.float32)
        with np.errstate(over="ignore"):
            out[gpos] = (codes - (levels + 1)).astype(np.float32) * tensorio.bf16_to_f32(sbits)[owner]
        return out.reshape(shape)


# ---------------------------------------------------------------- files

class WireWriter:
    """Write a delta in one wire format, one tensor at a time, in the order of `specs`.

        with WireWriter(path, [("w", (4, 8)), ("b", (8,))], Codec("int4"), {"base_round": "3"}) as w:
            sent = w.write("w", w_float32)      # -> float32: exactly what the receiver decodes

    f32 and bf16 write plain tensor files (no "wire" metadata); the others write the
    parts named in the module docstring. Atomic like tensorio.TensorWriter (which it uses).
    threads: for the int8/int4/int2 encode (None: $WIRE_THREADS, else every core)."""

    def __init__(self, path, specs, codec, metadata=None, fsync=True, threads=None):
        self.codec = codec.validate()
        self.threads = resolve_threads(threads)
        self.shapes = {n: tuple(int(d) for d in s) for n, s in specs}
        meta = dict(metadata or {})
        if codec.fmt not in ("f32", "bf16"):
            meta.update(codec.metadata(), wire_shapes=json.dumps({n: list(s) for n, s in self.shapes.items()},
                                                               separators=(",", ":")))
        layout = [p for n, s in self.shapes.items() for p in codec.parts(n, s)]
        self.w = tensorio.TensorWriter(path, layout, meta, fsync=fsync)
        self.path = self.w.path

    def write(self, name, x):
        x = np.asarray(x, dtype=np.float32).reshape(self.shapes.get(name, np.shape(x)))
        parts, sent = self.codec.encode(x, self.threads)
        for part, _, _ in self.codec.parts(name, x.shape):
            self.w.write(part, parts[part[len(name):]])
        return sent

    def write_parts(self, name, parts):
        """Write one tensor encoded elsewhere (wire_torch.encode at a site, on the device):
        parts {suffix: numpy array} as Codec.encode returns them; the writer checks each
        part's dtype and size against the layout."""
        for part, _, _ in self.codec.parts(name, self.shapes[name]):
            self.w.write(part, parts[part[len(name):]])

    def close(self):
        self.w.close()

    def abort(self):
        self.w.abort()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return self.w.__exit__(*exc)        # close, or abort on an exception


class WireReader:
    """Open a delta file, wire or plain; read(name) decodes one tensor to float32.

    The layout is checked when the file is opened; the values when each tensor is read.
    .names: the decoded tensors (file order), .shapes: {name: shape}, .codec: None for a
    plain file, .path. threads: for the int8/int4/int2 decode (None: $WIRE_THREADS, else every core)."""

    def __init__(self, path, threads=None):
        self.threads = resolve_threads(threads)
        try:
            self.r = tensorio.TensorReader(path)
        except tensorio.FormatError as e:
            raise WireError(str(e)) from None
        self.path = self.r.path
        try:
            self._parse()
        except BaseException:
            self.r.close()
            raise

    def _parse(self):
        meta = self.r.metadata
        if "wire" not in meta:
            self.codec = None
            self.shapes = {n: self.r.specs[n][1] for n in self.r.names}
            self.names = list(self.r.names)
            return
        self.codec = Codec.from_metadata(meta, self.path)
        try:
            shapes = json.loads(meta.get("wire_shapes", ""))
            ok = isinstance(shapes, dict) and all(
                isinstance(s, list) and all(type(d) is int and d >= 0 for d in s) for s in shapes.values())
        except ValueError:
            ok = False
        if not ok:
            raise WireError(f"{self.path}: metadata wire_shapes is not a JSON object of shapes")
        self.shapes = {n: tuple(s) for n, s in shapes.items()}
        want = {p: (d, s) for n, sh in self.shapes.items() for p, d, s in self.codec.parts(n, sh)}
        have = {n: self.r.specs[n] for n in self.r.names}
        missing, extra = sorted(set(want) - set(have)), sorted(set(have) - set(want))
        if missing or extra:
            raise WireError(f"{self.path}: the {self.codec.fmt} layout needs parts {missing[:5]} it lacks "
                            f"and does not allow {extra[:5]}")
        for p, (d, s) in want.items():
            if have[p] != (d, s):
                raise WireError(f"{self.path}: part {p!r} is {have[p][0]}{list(have[p][1])}, the "
                                f"{self.codec.fmt} layout of its tensor needs {d}{list(s)} (wrong size)")
        self.names = [n for n in self.r.names if n in self.shapes]

    def read(self, name, out=None):
        """The tensor as float32; out: a float32 buffer of at least its size to decode into
        (reused across tensors: no fresh pages to fault in), a view of its front returned."""
        if name not in self.shapes:
            raise KeyError(f"{self.path} has no tensor {name!r}")
        if self.codec is None:
            dtype = self.r.specs[name][0]
            if dtype not in tensorio.FLOAT_DTYPES:
                raise WireError(f"{self.path}: tensor {name!r} is {dtype}; a delta holds float tensors")
            return read_f32(self.r, name, out)
        parts = {p[len(name):]: self.r.read(p) for p, _, _ in self.codec.parts(name, self.shapes[name])}
        return self.codec.decode(parts, self.shapes[name], where=f"{self.path}: tensor {name!r}",
                                 threads=self.threads, out=out)

    def ends(self):
        """{name: the file position just past the last byte of all its parts}."""
        parts = lambda n: [n] if self.codec is None else [p for p, _, _ in self.codec.parts(n, self.shapes[n])]
        return {n: max(self.r.span(p)[1] for p in parts(n)) for n in self.names}

    def nbytes(self, name):
        """Bytes of this tensor in the file (all its parts)."""
        if self.codec is None:
            return self.r.nbytes(name)
        return sum(self.r.nbytes(p) for p, _, _ in self.codec.parts(name, self.shapes[name]))

    def close(self):
        self.r.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


# ---------------------------------------------------------------- theta by updates

def add_update(prev, sent):
    """theta_{r+1} = theta_r + the decoded update, elementwise in float32: the one addition
    the aggregator publishes and every site repeats, so both hold the same bits."""
    return np.add(np.asarray(prev, np.float32), np.asarray(sent, np.float32), dtype=np.float32)


class Digest:
    """sha256 over a model's tensors in order: each name, its shape and its float32 bytes
    (little-endian). Names the exact bits of a theta whatever its file's header says."""

    def __init__(self):
        import hashlib
        self.h = hashlib.sha256()

    def add(self, name, a):
        a = np.ascontiguousarray(a, dtype="<f4")
        self.add_chunks(name, a.shape, [a])

    def add_chunks(self, name, shape, chunks):
        """add() of a tensor of `shape` given as consecutive flat pieces (a tensor on disk,
        read a bounded piece at a time): the same digest."""
        self.h.update(json.dumps([name, list(shape)]).encode() + b"\0")
        for c in chunks:
            self.h.update(np.ascontiguousarray(c, dtype="<f4").reshape(-1).view(np.uint8).data)

    def hexdigest(self):
        return self.h.hexdigest()


def read_f32(reader, name, out=None):
    """A tensor of a tensorio.TensorReader as float32 of its shape; an F32 tensor is read
    straight into `out` (a reused float32 buffer) when one is given."""
    dtype, shape = reader.specs[name]
    if out is not None and dtype == "F32":
        return reader.read(name, out=out)
    a = np.asarray(reader.read(name, as_float32=True), dtype=np.float32).reshape(shape)
    if out is None:
        return a
    view = out.reshape(-1)[:a.size].reshape(shape)
    np.copyto(view, a)
    return view


def _largest(specs):
    return max([math.prod(s) for s in specs] + [1])


def add_into(theta, sent, threads=1):
    """theta += sent in float32, in place (add_update's bits), in spans on threads."""
    t, s = theta.reshape(-1), sent.reshape(-1)
    run_spans(lambda a, b: np.add(t[a:b], s[a:b], out=t[a:b]), t.size, 1, 1, threads)
    return theta


def theta_digest(path, threads=None):
    """The Digest of a tensor file's values (read one tensor at a time, as float32; the
    sha256 of one tensor runs behind the read of the next)."""
    d = Digest()
    with tensorio.TensorReader(path) as r, \
            Pipeline(_largest(s for _, s in r.specs.values()), 1, 1) as pipe:
        for n in r.names:
            (buf,), k = pipe.next()
            pipe.behind(k, 0, d.add, n, read_f32(r, n, buf))
        pipe.finish()
    return d.hexdigest()


def apply_update(theta_path, update_path, out_path, want_digest, metadata=None, fsync=True, threads=None,
                 ready=None):
    """theta_path (round r) + the update file (wire or plain) -> out_path (round r+1, F32),
    one tensor at a time with add_update; out_path may be theta_path (replaced atomically).
    The result must have the Digest `want_digest` the aggregator published with it: else
    WireError, and out_path is left as it was. Returns the digest.
    threads: the decode and the addition (None: $WIRE_THREADS, else every core); the digest's sha256
    and the write of each tensor run behind the next tensor (Pipeline).
    ready(offset): an update file still arriving (its full size already allocated): blocks
    until its first `offset` bytes are in, so each tensor is added as soon as its bytes are
    (fedmom_client.FollowedUpdate). want_digest None: no check, the caller compares."""
    threads = resolve_threads(threads)
    if ready is not None:
        ready(8)
        with open(update_path, "rb") as f:
            ready(8 + struct.unpack("<Q", f.read(8))[0])
    with tensorio.TensorReader(theta_path) as prev, WireReader(update_path, threads) as upd:
        check_shapes(upd, {n: prev.specs[n][1] for n in prev.names})
        ends = upd.ends() if ready is not None else {}
        d = Digest()
        with tensorio.TensorWriter(out_path, [(n, "F32", prev.specs[n][1]) for n in prev.names],
                                   metadata, fsync=fsync) as w, \
                Pipeline(_largest(s for _, s in prev.specs.values()), 1, 2) as pipe:
            sbuf = np.empty(pipe.sets[0][0].size, np.float32)    # the decoded update: not needed behind
            for n in prev.names:
                (tbuf,), k = pipe.next()
                if ready is not None:
                    ready(ends[n])
                theta = add_into(read_f32(prev, n, tbuf), upd.read(n, out=sbuf), threads)
                pipe.behind(k, 0, d.add, n, theta)
                pipe.behind(k, 1, w.write, n, theta)
            pipe.finish()
            if want_digest is not None and d.hexdigest() != want_digest:
                raise WireError(f"{theta_path} + {update_path} gives theta digest {d.hexdigest()[:16]}..., the "
                                f"aggregator published {str(want_digest)[:16]}...: not the theta it built")
    return d.hexdigest()


def is_wire(path):
    """True if `path` is a tensor file whose metadata declares a wire format."""
    with tensorio.TensorReader(path) as r:
        return "wire" in r.metadata


def decode_file(src, dst, fsync=True, specs=None, threads=None):
    """A wire file -> a plain F32 tensor file with the same names, shapes and metadata
    (less the wire entries), one tensor at a time. specs {name: shape}: the tensors the
    file must hold, checked before anything is decoded (a forged wire_shapes could
    otherwise ask for any amount of memory). Raises WireError; nothing is left at `dst`
    then. Returns the codec of `src` (None: it was plain, and is copied as F32).
    threads: the decode (None: $WIRE_THREADS, else every core); each write runs behind the next decode."""
    with WireReader(src, threads) as r:
        if specs is not None:
            check_shapes(r, specs)
        meta = {k: v for k, v in r.r.metadata.items() if not k.startswith("wire") and k != "format"}
        meta["wire_decoded_from"] = r.codec.fmt if r.codec else "plain"
        specs = [(n, "F32", r.shapes[n]) for n in r.names]
        with tensorio.TensorWriter(dst, specs, meta, fsync=fsync) as w, \
                Pipeline(_largest(s for _, _, s in specs), 1, 1) as pipe:
            for n in r.names:
                (buf,), k = pipe.next()
                pipe.behind(k, 0, w.write, n, r.read(n, out=buf))
            pipe.finish()
        return r.codec


def check_shapes(reader, specs):
    """The decoded tensors are exactly `specs` {name: shape}, else WireError."""
    want = {n: tuple(s) for n, s in specs.items()}
    missing, extra = sorted(set(want) - set(reader.shapes)), sorted(set(reader.shapes) - set(want))
    if missing or extra:
        raise WireError(f"{reader.path}: names differ from theta_global: missing {missing[:5]}, "
                        f"unexpected {extra[:5]}")
    for n, s in reader.shapes.items():
        if s != want[n]:
            raise WireError(f"{reader.path}: tensor {n!r} has shape {list(s)}, theta_global has {list(want[n])}")


def describe(path, check=False, threads=None):
    with WireReader(path, threads) as r:
        fmt = r.codec.fmt if r.codec else "plain"
        total = sum(math.prod(s) for s in r.shapes.values())
        size = r.r.file_size
        print(f"{path}: wire format {fmt}, {len(r.names)} tensors, {total} values, {size} bytes "
              f"({size / max(total, 1):.4f} B/value)")
        if r.codec:
            print("  " + json.dumps(dataclasses.asdict(r.codec)))
        for n in r.names:
            print(f"  {n}  {list(r.shapes[n])}  {r.nbytes(n)} bytes")
            if check:
                r.read(n)


# ==== the fast path: the int8/int4/int2 block kernels and their threads ===========================
# The Codec above calls these; they compute its blocks with the same float32 operations as the
# reference (Codec.encode/decode(reference=True)), bit for bit. A tensor is seen as X [R, C]
# (as_blocks): when its last dimension is a multiple of the block, X is [rows x blocks, block]
# (one scale per row of X, the flattened order unchanged, no padding); else X is [rows, cols]
# and each chunk is zero-padded to whole blocks in its buffer. encode_span / decode_span work
# on rows [a, b) of X, CHUNK values at a time in reused buffers; encode_blocks / decode_blocks
# run one tensor's spans on threads. fedmom_merge.py and outer_state.py call the span kernels
# on pieces of their own. A kernel is handed the Codec and reads its fmt, block and levels.

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


# ---------------------------------------------------------------- int2's scale
# s = the block's largest magnitude / 3 (rounded up to bfloat16), so 3s is its largest value;
# q = the nearest odd integer to x / s (2 floor(x / 2s) + 1, a tie going up; clipped to
# [-3, 3]): a value is off by at most s. No zero level: it would spend a code on the values
# nearest 0. Measured over the last deltas of both sites of bench/wire_formats.py's f32 arm
# (qwen3-tiny, 238K values, kurtosis 7.2), ||x - sent|| / ||x|| is 0.414 (int4 0.086, int8
# 0.005). A clipped scale has less error (the best of 45 rules tried, the magnitude at 7/8 of
# the block's sorted values x 9/32: 0.284) but cost more loss: int2 up and down +4.2% held-out
# loss over f32 with it, +1.0% and +1.5% (two runs) with absmax / 3 (10 rounds; two runs of
# one arm differ by ~0.3-0.5%). What a clipped scale saves is the small values' error; what it
# defers is the largest values. topk with 2-bit values uses the same grid over its kept values.

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
# run_spans: spans of about TASK values on one shared pool per size and process (threads=,
# default $WIRE_THREADS or every core: numpy releases the GIL); Behind: jobs in order on one
# thread behind the caller (a write, a hash); Pipeline: the file-to-file loops (decode_file,
# apply_update, theta_digest), tensor i computed while tensor i-1's sha256 and write run behind.
# The Digest stays one sha256 over the tensors in order: serial, so it overlaps the rest.

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
    """The file-to-file loops above (decode_file, apply_update, theta_digest), one tensor after
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
# The fast path of Codec's int8/int4/int2 encode and decode: the same float32 operations as
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
    scales and decoded values; the same float32 operations as Codec's reference."""
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
    as Codec.decode does) -> (float32 of `shape`, into `out` if given; None, or why a
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


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("file", help="delta file (safetensors layout, wire or plain)")
    p.add_argument("--check", action="store_true", help="also decode every tensor once (default: header only)")
    p.add_argument("--threads", type=int, default=None,
                   help="threads of the int8/int4/int2 decode (default: $WIRE_THREADS, else every core)")
    a = p.parse_args()
    try:
        describe(a.file, a.check, a.threads)
    except (ValueError, OSError) as e:          # WireError, or a bad --threads
        sys.exit(str(e))
