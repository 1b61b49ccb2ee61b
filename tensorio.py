"""tensorio.py - tensor files in the safetensors layout: a streaming writer and a lazy reader.

Runs on: everywhere. The central VM uses it with the standard library and numpy
only (fedmom_server.py merges deltas tensor by tensor); sites use the torch
bridge (save_torch / load_torch / iter_torch), which imports torch lazily.
No server, no port, no state directory. Inspect a file from the shell:

    python tensorio.py FILE            # header: format, metadata, one line per tensor
    python tensorio.py FILE --check    # also read every tensor once (finds a truncated file)

The global model as a Hugging Face checkpoint directory is hf_export.py's (it needs torch
and torchtitan; this file needs numpy only).

Layout (the safetensors one, so `safetensors` and every tool that reads it opens
our files, and we open theirs):

    [8 bytes: little-endian u64 N][N bytes: JSON header, space-padded to a multiple of 8][data]

    header = {"__metadata__": {"format": "pww-tensors/1", "producer": ..., "round": ...},
              "<name>": {"dtype": "BF16", "shape": [rows, cols], "data_offsets": [begin, end]}, ...}

`data_offsets` count from the first data byte. Data is raw little-endian, one
tensor after another in header order with no gaps. Metadata values are strings.

Why a streaming writer: a 1.7B model's delta is 3.6 GiB in fp16 and a 32B one
60 GiB; the writer takes the list of (name, dtype, shape) up front, writes the
header, then takes one tensor at a time, so nothing ever holds a whole model.
The file is written under a temporary name, fsynced, and renamed into place:
a reader sees the old file or the complete new one, never half of one.

numpy has no bfloat16: BF16 tensors are kept as raw uint16 and converted to or
from float32 by bit shifts (round to nearest even when narrowing, like torch).
"""
import argparse
import json
import os
import struct
import sys
import threading

import numpy as np

import durable

FORMAT_VERSION = "1"
FORMAT = "pww-tensors/" + FORMAT_VERSION
MAX_HEADER_BYTES = 100_000_000      # the safetensors limit: a larger header is corruption, not a model
CONVERT_CHUNK = 1 << 22             # elements converted per step when a writer narrows (16 MiB of f32)

# dtype string -> little-endian numpy dtype. BF16 is stored and handed out as raw uint16.
DTYPES = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2"),
    "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"),
    "U8": np.dtype("u1"), "BOOL": np.dtype("?"),
}
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")


class FormatError(ValueError):
    """A file that is not a valid tensor file; the message names the file and the fix."""


# ---------------------------------------------------------------- bfloat16 by bit shifts

def f32_to_bf16(a):
    """float32 -> bfloat16 bits (uint16), rounding to nearest even; NaN -> 0x7FC0, Inf stays Inf.

    Same bits as torch's `tensor.to(torch.bfloat16)`: add 0x7FFF plus the lowest
    kept bit, then drop the low 16 bits. A finite value that rounds past the
    largest bfloat16 becomes Inf, as in torch.
    """
    a = np.ascontiguousarray(a, dtype=np.float32)
    u = a.view(np.uint32)
    rounded = u >> np.uint32(16)              # in place from here: one 4-byte temporary per value
    rounded &= np.uint32(1)
    rounded += np.uint32(0x7FFF)
    rounded += u
    rounded >>= np.uint32(16)
    out = rounded.astype(np.uint16)
    out[np.isnan(a)] = 0x7FC0      # the quiet NaN torch produces (the rounding add would wrap)
    return out


def bf16_to_f32(u):
    """bfloat16 bits (uint16) -> float32, exactly (bfloat16 is the top half of a float32)."""
    u = np.asarray(u)
    if u.dtype != np.uint16:
        raise TypeError(f"bf16_to_f32 takes the raw bits as uint16, got {u.dtype}")
    wide = u.astype(np.uint32)
    wide <<= np.uint32(16)
    return wide.view(np.float32)


# ---------------------------------------------------------------- writer

def _check_spec(name, dtype, shape):
    if not isinstance(name, str) or not name or name == "__metadata__":
        raise ValueError(f"bad tensor name {name!r}: a non-empty string other than '__metadata__'")
    if dtype not in DTYPES:
        raise ValueError(f"tensor {name!r}: unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    shape = tuple(shape)
    if not all(isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise ValueError(f"tensor {name!r}: shape {shape!r} must be non-negative integers")
    return name, dtype, tuple(int(d) for d in shape)


def _numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def _header_bytes(specs, metadata):
    """The JSON header, padded with spaces to a multiple of 8 (as safetensors pads)."""
    header, offset = {"__metadata__": metadata}, 0
    for name, dtype, shape in specs:
        size = _numel(shape) * DTYPES[dtype].itemsize
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    return raw + b" " * (-len(raw) % 8)


class TensorWriter:
    """Write a tensor file one tensor at a time, in the order of `specs`.

        with TensorWriter(path, [("w", "BF16", (4, 8)), ("b", "F32", (8,))], {"round": "3"}) as w:
            w.write("w", w_float32)     # BF16 takes float32 (rounded) or raw uint16 bits
            w.write("b", b)

    Float dtypes accept any float array (cast as numpy casts; BF16 rounds to nearest
    even); integer and bool dtypes want exactly their own dtype. A tensor must have
    the declared shape (or be a flat array of the same size). The data goes to
    `path.tmp-<pid>`; close() fsyncs and renames it to `path`; abort(), or leaving
    the `with` block by an exception, removes it.

    file_format: the metadata "format" entry; "pt" makes a file Hugging Face
    transformers loads (4.x refuses a model.safetensors whose format is anything else).
    """

    def __init__(self, path, specs, metadata=None, fsync=True, file_format=FORMAT):
        self.path, self.fsync = os.fspath(path), fsync
        self.specs = [_check_spec(*s) for s in specs]
        names = [s[0] for s in self.specs]
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"duplicate tensor names in specs: {dup}")
        meta = {} if metadata is None else dict(metadata)
        bad = [k for k, v in meta.items() if not isinstance(k, str) or not isinstance(v, str)]
        if bad:
            raise ValueError(f"metadata values must be strings (safetensors rule); convert {bad}")
        meta["format"] = file_format
        meta.setdefault("producer", "tensorio")
        header = _header_bytes(self.specs, meta)
        self.size = 8 + len(header) + sum(_numel(sh) * DTYPES[dt].itemsize for _, dt, sh in self.specs)
        self.tmp = durable.tmp_name(self.path)
        self._f = open(self.tmp, "wb")
        self.written = 0
        try:
            self._f.write(struct.pack("<Q", len(header)) + header)
        except BaseException:
            self.abort()
            raise

    def _next(self, name):
        """(dtype, shape) of the tensor to write next, which must be `name`."""
        if self._f is None:
            raise ValueError(f"{self.path}: writer is already closed")
        if self.written >= len(self.specs):
            raise ValueError(f"{self.path}: all {len(self.specs)} tensors are written; {name!r} is one too many")
        want, dtype, shape = self.specs[self.written]
        if name != want:
            raise ValueError(f"{self.path}: tensors go in header order: expected {want!r} next, got {name!r}")
        return dtype, shape

    def write(self, name, array):
        dtype, shape = self._next(name)
        a = np.asarray(array)
        if a.shape != shape and not (a.ndim == 1 and a.size == _numel(shape)):
            raise ValueError(f"{self.path}: tensor {name!r} has shape {a.shape}, the header says {shape}")
        flat = np.ascontiguousarray(a).reshape(-1)
        self._write_data(name, dtype, flat)
        self.written += 1

    def write_chunks(self, name, chunks):
        """write() of the next tensor given as consecutive flat pieces (a tensor read from disk
        a bounded piece at a time, never whole in memory); they must add up to its size."""
        dtype, shape = self._next(name)
        done = 0
        for c in chunks:
            flat = np.ascontiguousarray(c).reshape(-1)
            self._write_data(name, dtype, flat)
            done += flat.size
        if done != _numel(shape):
            self.abort()
            raise ValueError(f"{self.path}: tensor {name!r} got {done} values, the header says {shape}")
        self.written += 1

    def _write_data(self, name, dtype, flat):
        target = DTYPES[dtype]
        if dtype == "BF16" and flat.dtype == np.uint16:
            convert = None                                   # already raw bfloat16 bits
        elif dtype == "BF16" and flat.dtype.kind == "f":
            convert = f32_to_bf16
        elif dtype in FLOAT_DTYPES and flat.dtype.kind == "f":
            convert = None if flat.dtype == target else (lambda x: x.astype(target))
        elif flat.dtype.newbyteorder("<") == target or flat.dtype == target:
            convert = None if flat.dtype == target else (lambda x: x.astype(target))
        else:
            raise ValueError(f"{self.path}: tensor {name!r} is {flat.dtype}, the header says {dtype}; "
                             f"cast it first (only float arrays are converted for you)")
        if convert is None:
            self._f.write(memoryview(flat).cast("B"))
            return
        for i in range(0, flat.size, CONVERT_CHUNK):       # narrow in slices: no second full copy
            self._f.write(memoryview(np.ascontiguousarray(convert(flat[i:i + CONVERT_CHUNK]))).cast("B"))

    def flushed(self):
        """The bytes written so far, flushed to the file (readable by another reader of `tmp`
        while the file is still being written: a tensor file followed as it grows)."""
        self._f.flush()
        return self._f.tell()

    def close(self):
        if self._f is None:
            return
        if self.written != len(self.specs):
            missing = [s[0] for s in self.specs[self.written:]]
            self.abort()
            raise ValueError(f"{self.path}: closed after {self.written} of {len(self.specs)} tensors; "
                             f"missing {missing[:5]}{' ...' if len(missing) > 5 else ''}; nothing was written")
        f, self._f = self._f, None
        try:
            f.flush()
            if self.fsync:
                os.fsync(f.fileno())
        finally:
            f.close()
        durable.rename(self.tmp, self.path, self.fsync)

    def abort(self):
        f, self._f = self._f, None
        if f is not None:
            f.close()
        durable.unlink(self.tmp)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()
        else:
            self.abort()
        return False


class Growing:
    """A tensor file while its TensorWriter writes it, readable as it grows: the
    aggregator's update of a round is read by the sites while later tensors are still being
    merged. The header fixes every offset, so `total` is known before the first tensor.
    The writer's side calls advance(writer.flushed()) after each tensor, fail(why) if it
    stops, and close() when the file is no longer offered; each reader iterates follow(),
    which yields the bytes in order as they are flushed and raises OSError when the writer
    failed or the file was withdrawn before its bytes came (the reply is then cut short: a
    reader never gets a byte the writer did not write)."""

    def __init__(self, writer, tag=None):
        self.total, self.tag = writer.size, dict(tag or {})
        self._fd = os.open(writer.tmp, os.O_RDONLY)    # stays readable after the rename, or an abort
        self.cond = threading.Condition()
        self.done, self.failed, self.closed = writer.flushed(), None, False

    def advance(self, nbytes):
        with self.cond:
            self.done = nbytes
            self.cond.notify_all()

    def fail(self, why):
        with self.cond:
            self.failed = why
            self.cond.notify_all()

    def close(self):
        with self.cond:
            if not self.closed:
                self.closed = True
                os.close(self._fd)
            self.cond.notify_all()

    def follow(self, start=0, chunk=1 << 20):
        """The bytes from `start` to the end, each piece as soon as it is written (a reused
        buffer: send or copy it before asking for the next)."""
        with self.cond:
            if self.closed or self.failed:
                raise OSError(f"the file is no longer offered: {self.failed or 'withdrawn'}")
            fd = os.dup(self._fd)
        view, at = memoryview(bytearray(chunk)), start
        try:
            while at < self.total:
                with self.cond:
                    while self.done <= at and self.failed is None and not self.closed:
                        self.cond.wait()
                    if self.failed is not None or self.done <= at:
                        raise OSError(f"the file stopped at byte {self.done} of {self.total}: "
                                      f"{self.failed or 'withdrawn'}")
                    end = self.done
                n = os.preadv(fd, [view[:min(chunk, end - at)]], at)
                if n <= 0:
                    raise OSError(f"the file ends at byte {at}, before the {self.done} written")
                yield view[:n]
                at += n
        finally:
            os.close(fd)


# ---------------------------------------------------------------- reader

class TensorReader:
    """Open a tensor file: the header is parsed and checked once, tensors are read on demand.

    read(name) does one positioned read of that tensor's bytes straight into a new
    numpy array, so reading one tensor never touches the others' pages.
    """

    def __init__(self, path):
        self.path = os.fspath(path)
        self._fd = os.open(self.path, os.O_RDONLY)
        try:
            self._parse()
        except BaseException:
            os.close(self._fd)
            self._fd = None
            raise

    def _fail(self, what, fix="the file is damaged or not a tensor file: re-create or re-download it"):
        raise FormatError(f"{self.path}: {what}; {fix}")

    def _parse(self):
        size = os.fstat(self._fd).st_size
        if size < 8:
            self._fail(f"only {size} bytes, shorter than the 8-byte header length")
        (n,) = struct.unpack("<Q", os.pread(self._fd, 8, 0))
        if n > MAX_HEADER_BYTES:
            self._fail(f"header length {n} is absurd (limit {MAX_HEADER_BYTES})")
        if 8 + n > size:
            self._fail(f"header length {n} runs past the end of the {size}-byte file (truncated?)")
        raw = os.pread(self._fd, n, 8)
        try:
            header = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as e:
            self._fail(f"header is not valid JSON ({e})")
        if not isinstance(header, dict):
            self._fail("header is not a JSON object")
        self.data_start, self.file_size = 8 + n, size
        self.metadata = self._parse_metadata(header.pop("__metadata__", None) or {})
        entries = sorted((self._parse_entry(k, v) for k, v in header.items()), key=lambda e: (e[3], e[4]))
        self._check_offsets(entries, size - self.data_start)
        self.names = [e[0] for e in entries]                       # file (data) order
        self.specs = {e[0]: (e[1], e[2]) for e in entries}
        self._spans = {e[0]: (e[3], e[4]) for e in entries}

    def _parse_metadata(self, meta):
        if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
            self._fail("__metadata__ must map strings to strings")
        fmt = meta.get("format", "")
        if fmt.startswith("pww-tensors/") and fmt != FORMAT:
            self._fail(f"format {fmt!r}, this tensorio reads {FORMAT!r}",
                       "convert it with the tensorio.py that wrote it, or update this one")
        return meta

    def _parse_entry(self, name, spec):
        if not isinstance(spec, dict):
            self._fail(f"entry {name!r} is not an object")
        dtype, shape, offs = spec.get("dtype"), spec.get("shape"), spec.get("data_offsets")
        if dtype not in DTYPES:
            self._fail(f"tensor {name!r} has unknown dtype {dtype!r}",
                       f"tensorio reads {', '.join(DTYPES)}")
        ok_ints = lambda xs: isinstance(xs, list) and all(type(x) is int and x >= 0 for x in xs)
        if not ok_ints(shape):
            self._fail(f"tensor {name!r} has a bad shape {shape!r}")
        if not ok_ints(offs) or len(offs) != 2 or offs[0] > offs[1]:
            self._fail(f"tensor {name!r} has bad data_offsets {offs!r}")
        want = _numel(shape) * DTYPES[dtype].itemsize
        if offs[1] - offs[0] != want:
            self._fail(f"tensor {name!r}: data_offsets {offs} hold {offs[1] - offs[0]} bytes, "
                       f"but {dtype}{shape} needs {want}")
        return name, dtype, tuple(shape), offs[0], offs[1]

    def _check_offsets(self, entries, data_bytes):
        end = 0
        for name, _, _, begin, stop in entries:
            if begin < end:
                self._fail(f"tensor {name!r} at bytes {begin}..{stop} overlaps the tensor before it")
            end = stop
        if end > data_bytes:
            self._fail(f"truncated: the header needs {end} data bytes, the file holds {data_bytes}")

    def nbytes(self, name):
        begin, end = self._span(name)
        return end - begin

    def span(self, name):
        """(start, end) byte positions of the tensor's data in the file."""
        begin, end = self._span(name)
        return self.data_start + begin, self.data_start + end

    def _span(self, name):
        try:
            return self._spans[name]
        except KeyError:
            raise KeyError(f"{self.path} has no tensor {name!r}") from None

    def read(self, name, as_float32=False, out=None):
        """The tensor as a new numpy array (BF16: raw uint16, or float32 if as_float32).

        out: a C-contiguous array of the file's dtype (uint16 for BF16) with at least as
        many elements, reused across calls; the tensor is read into its front and a view
        of that part is returned. A fresh array costs a page fault per 4 KiB on first
        touch (0.8 s per GiB measured on a loaded 2-core VM), a reused one does not."""
        if self._fd is None:
            raise ValueError(f"{self.path}: reader is closed")
        begin, end = self._span(name)
        dtype, shape = self.specs[name]
        if out is None:
            out = np.empty(shape, dtype=DTYPES[dtype])
        else:
            n = _numel(shape)
            if out.dtype != DTYPES[dtype] or out.size < n or not out.flags.c_contiguous:
                raise ValueError(f"out= for {name!r} must be a C-contiguous {DTYPES[dtype]} array of at least "
                                 f"{n} elements, got {out.dtype} with {out.size}")
            out = out.reshape(-1)[:n].reshape(shape)
        buf, pos, done = memoryview(out.reshape(-1)).cast("B"), self.data_start + begin, 0
        while done < end - begin:                          # preadv may return short (2 GiB per call)
            got = os.preadv(self._fd, [buf[done:]], pos + done)
            if got == 0:
                self._fail(f"tensor {name!r} ends early: the file shrank while being read")
            done += got
        if as_float32 and dtype == "BF16":
            return bf16_to_f32(out)
        return out

    def read_range(self, name, lo, hi, out=None):
        """Elements [lo, hi) of the flattened tensor, in the file's dtype (raw uint16 for BF16),
        into `out` (a C-contiguous array of that dtype, at least hi - lo long; its front is
        returned) or a new array: a part of a tensor, never the whole of it in memory."""
        if self._fd is None:
            raise ValueError(f"{self.path}: reader is closed")
        begin, _ = self._span(name)
        dtype, shape = self.specs[name]
        if not 0 <= lo <= hi <= _numel(shape):
            raise ValueError(f"{self.path}: elements [{lo}, {hi}) of {name!r}, which has {_numel(shape)}")
        item = DTYPES[dtype]
        out = np.empty(hi - lo, item) if out is None else out.reshape(-1)[:hi - lo]
        if out.dtype != item or not out.flags.c_contiguous:
            raise ValueError(f"out= for {name!r} must be a C-contiguous {item} array")
        buf, pos, done = memoryview(out).cast("B"), self.data_start + begin + lo * item.itemsize, 0
        while done < len(buf):
            got = os.preadv(self._fd, [buf[done:]], pos + done)
            if got == 0:
                self._fail(f"tensor {name!r} ends early: the file shrank while being read")
            done += got
        return out

    def items(self, as_float32=False):
        """(name, array) for every tensor, in file order, one at a time."""
        for name in self.names:
            yield name, self.read(name, as_float32)

    def close(self):
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __del__(self):
        if getattr(self, "_fd", None) is not None:
            self.close()


# ---------------------------------------------------------------- torch bridge (sites only)

def _torch_dtypes():
    import torch
    return {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
            torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
            torch.uint8: "U8", torch.bool: "BOOL"}


def _tensor_to_numpy(t, dtype_name):
    """One tensor to a CPU numpy array in the file's dtype (BF16 as raw uint16 bits)."""
    import torch
    by_name = {v: k for k, v in _torch_dtypes().items()}
    t = t.detach()
    if t.dtype != by_name[dtype_name]:
        t = t.to(by_name[dtype_name])
    t = t.to("cpu").contiguous()
    if dtype_name == "BF16":
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def _file_dtype(t, dtype):
    names = _torch_dtypes()
    if t.dtype not in names:
        raise ValueError(f"tensor dtype {t.dtype} has no file dtype; cast it to one of {list(names)}")
    return dtype if (dtype and t.is_floating_point()) else names[t.dtype]


def save_torch(tensors, path, metadata=None, dtype=None, specs=None):
    """Write a state dict (or (name, tensor) pairs) to `path`, tensor by tensor.

    dtype: store every floating tensor as this ("F32", "F16", "BF16"); integers keep theirs.
    The header needs every shape up front. A mapping gives them for free; a generator
    of pairs is listed first (holding its tensors) unless `specs` [(name, dtype, shape)]
    is given, in which case the generator is consumed one tensor at a time.
    """
    if dtype is not None and dtype not in FLOAT_DTYPES:
        raise ValueError(f"dtype={dtype!r}: use one of {FLOAT_DTYPES} (integers are never converted)")
    pairs = tensors.items() if hasattr(tensors, "items") else tensors
    if specs is None:
        pairs = list(pairs)
        specs = [(n, _file_dtype(t, dtype), tuple(t.shape)) for n, t in pairs]
    with TensorWriter(path, specs, metadata) as w:
        for name, t in pairs:
            if w.written >= len(w.specs):
                raise ValueError(f"{path}: more tensors than the {len(w.specs)} in specs ({name!r})")
            w.write(name, _tensor_to_numpy(t, w.specs[w.written][1]))


def _numpy_to_torch(a, dtype_name, device):
    import torch
    if dtype_name == "BF16":
        t = torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    else:
        t = torch.from_numpy(a)
    return t if str(device) == "cpu" else t.to(device)


def iter_torch(path, device="cpu", names=None):
    """(name, torch.Tensor) in file order, one tensor read at a time."""
    with TensorReader(path) as r:
        for name in r.names if names is None else names:
            yield name, _numpy_to_torch(r.read(name), r.specs[name][0], device)


def load_torch(path, device="cpu", names=None):
    """A state dict {name: tensor} (all tensors, or just `names`) on `device`."""
    return dict(iter_torch(path, device, names))


# ---------------------------------------------------------------- inspection CLI

def describe(path, check=False):
    with TensorReader(path) as r:
        print(f"{path}: {len(r.names)} tensors, {r.file_size - r.data_start} data bytes")
        for k, v in sorted(r.metadata.items()):
            print(f"  meta {k} = {v}")
        for name in r.names:
            dtype, shape = r.specs[name]
            print(f"  {name}  {dtype}{list(shape)}  {r.nbytes(name)} bytes")
            if check:
                r.read(name)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="python hf_export.py --help: the model as a Hugging Face "
                                       "checkpoint directory (needs torch + torchtitan)")
    p.add_argument("file", help="tensor file (.safetensors layout)")
    p.add_argument("--check", action="store_true", help="also read every tensor once (default: header only)")
    a = p.parse_args()
    try:
        describe(a.file, a.check)
    except (FormatError, OSError) as e:
        sys.exit(str(e))
