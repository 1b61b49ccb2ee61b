"""fedmom_merge.py - the streaming Nesterov merge of FedMom, and the checks a delta must pass.

Runs on: the central VM, inside fedmom_server.py (numpy + tensorio.py only; never
torch). Not started on its own. Tested against torch.optim.SGD(nesterov=True) and a
ten-line naive numpy reference in tests/test_fedmom.py; bench/fedmom_merge.py
measures it against the fsync'd I/O of the same bytes.

The step (DESIGN.md): deltas d_i = theta_i - theta_global with weights p_i (token
shares, summing to 1); g = theta_global - sum_i p_i theta_i = -sum_i p_i d_i; then one
step of torch.optim.SGD(lr, momentum=mu, nesterov=True, dampening=0) with grad = g:
    buf = g (first step) or mu * buf + g;   theta -= lr * (g + mu * buf)
lr 1 / momentum 0 is exact FedAvg.

    stats = merge_files("theta-3.safetensors", "momentum-3.safetensors",
                        [("spool/a.safetensors", 0.25), ("spool/b.safetensors", 0.75)],
                        "theta-4.safetensors", "momentum-4.safetensors", lr=0.7, mu=0.9)
    check_delta_file("spool/a.safetensors", {name: shape})   # raises DeltaRejected(status, reason)

Memory: one tensor at a time, read from the input files, updated in place in
chunks of CHUNK elements (small enough to stay in cache), handed to a writer thread
that writes and fsyncs the new files while the next tensor is computed; peak memory
is a few times the largest tensor, never the model.
"""
import math
import os
import queue
import threading
import time

import numpy as np

import tensorio

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


def nesterov_chunk(theta, buf, g, tmp, lr, mu, first):
    """One chunk of torch.optim.SGD(momentum=mu, nesterov=True, dampening=0), grad = g,
    all in place: buf = g | mu*buf + g;  theta -= lr * (g + mu*buf). `g` is clobbered."""
    if first:
        np.copyto(buf, g)
    else:
        buf *= np.float32(mu)
        buf += g
    np.multiply(buf, np.float32(mu), out=tmp)
    g += tmp
    g *= np.float32(lr)
    theta -= g


def merge_tensor(theta, buf, deltas, weights, lr, mu, first, sums):
    """Merge one flat fp32 tensor in place, chunk by chunk. deltas: [(flat array, dtype)].
    sums["theta"] and sums["delta"][i] accumulate squared norms (for drift)."""
    n = theta.size
    g = np.empty(min(CHUNK, n), np.float32)
    t = np.empty_like(g)
    for lo in range(0, n, CHUNK):
        hi = min(lo + CHUNK, n)
        gc, tc, th = g[:hi - lo], t[:hi - lo], theta[lo:hi]
        sums["theta"] += float(np.dot(th, th))
        for i, ((d, dtype), p) in enumerate(zip(deltas, weights)):
            x = tc if i else gc                  # g = theta - sum p_i theta_i = -sum p_i d_i
            if dtype == "BF16":
                widen(d[lo:hi], dtype, x)
                x *= np.float32(-p)
            else:                                # widen and scale in one pass
                np.multiply(d[lo:hi], np.float32(-p), out=x, dtype=np.float32)
            sums["delta"][i] += float(np.dot(x, x)) / (p * p)
            if i:
                gc += tc
        nesterov_chunk(th, buf[lo:hi], gc, tc, lr, mu, first)


class WriteBehind:
    """Writes finished tensors on a background thread while the next one is computed.
    At most `cap` bytes wait in the queue (a tensor larger than the rest waits for an
    empty queue), so memory stays bounded by the cap plus the tensor being merged."""

    def __init__(self, cap):
        self.cap, self.inflight, self.error = cap, 0, None
        self.cond = threading.Condition()
        self.q = queue.Queue()
        self.thread = threading.Thread(target=self._run, name="merge-writer", daemon=True)
        self.thread.start()

    def _run(self):
        while True:
            item = self.q.get()
            if item is None:
                return
            writer, name, array = item
            try:
                if self.error is None:
                    writer.write(name, array)
            except BaseException as e:   # surfaced on the next put()/finish()
                self.error = e
            with self.cond:
                self.inflight -= array.nbytes
                self.cond.notify_all()

    def reserve(self, nbytes):
        """Block until `nbytes` more may be held without passing the cap."""
        with self.cond:
            while self.inflight and self.inflight + nbytes > self.cap and self.error is None:
                self.cond.wait()
        self._raise()

    def put(self, writer, name, array):
        with self.cond:
            self.inflight += array.nbytes
        self.q.put((writer, name, array))

    def finish(self):
        self.q.put(None)
        self.thread.join()
        self._raise()

    def _raise(self):
        if self.error is not None:
            raise self.error


def merge_files(theta_path, momentum_path, deltas, out_theta, out_momentum, lr, mu,
                metadata=None, fsync=True, pause_s=0.0):
    """One durable FedMom step from files. deltas: [(path, weight)], weights summing to 1.
    momentum_path None = first step (buf = g); out_momentum None = do not keep a buffer
    (momentum 0). Returns {"theta_norm", "delta_norms", "bytes_read", "bytes_written"}."""
    readers, writers = [], []
    try:
        tr = tensorio.TensorReader(theta_path)
        readers.append(tr)
        mr = tensorio.TensorReader(momentum_path) if momentum_path else None
        readers += [mr] if mr else []
        drs = [tensorio.TensorReader(p) for p, _ in deltas]
        readers += drs
        specs = [(name, "F32", tr.specs[name][1]) for name in tr.names]
        meta = {k: str(v) for k, v in (metadata or {}).items()}
        tw = tensorio.TensorWriter(out_theta, specs, meta, fsync=fsync)
        writers.append(tw)
        mw = tensorio.TensorWriter(out_momentum, specs, meta, fsync=fsync) if out_momentum else None
        writers += [mw] if mw else []
        largest = max((tr.nbytes(n) for n in tr.names), default=0)
        wb = WriteBehind(cap=2 * largest)
        sums = {"theta": 0.0, "delta": [0.0] * len(deltas)}
        nread = 0
        try:
            for name in tr.names:
                wb.reserve(2 * tr.nbytes(name))
                theta = tr.read(name).reshape(-1)
                buf = mr.read(name).reshape(-1) if mr else np.empty_like(theta)
                ds = [(r.read(name).reshape(-1), r.specs[name][0]) for r in drs]
                nread += theta.nbytes + (buf.nbytes if mr else 0) + sum(d.nbytes for d, _ in ds)
                merge_tensor(theta, buf, ds, [w for _, w in deltas], lr, mu, mr is None, sums)
                del ds
                wb.put(tw, name, theta)
                if mw:
                    wb.put(mw, name, buf)
                if pause_s:
                    time.sleep(pause_s)
        finally:
            wb.finish()
        for w in writers:
            w.close()
        nwritten = sum(os.path.getsize(w.path) for w in writers)
        return {"theta_norm": math.sqrt(sums["theta"]), "delta_norms": [math.sqrt(s) for s in sums["delta"]],
                "bytes_read": nread, "bytes_written": nwritten}
    except BaseException:
        for w in writers:
            w.abort()
        raise
    finally:
        for r in readers:
            r.close()


# ---------------------------------------------------------------- delta checks

class DeltaRejected(Exception):
    """A delta that must not be merged; `status` is the HTTP code, the message says why."""

    def __init__(self, status, reason):
        super().__init__(reason)
        self.status, self.reason = status, reason


def check_delta_file(path, specs):
    """Header checks, then a tensor-by-tensor finiteness scan; raises DeltaRejected.
    specs: {name: shape} of theta_global. Nothing is read twice into memory."""
    try:
        r = tensorio.TensorReader(path)
    except tensorio.FormatError as e:
        raise DeltaRejected(400, f"not a tensor file: {str(e).replace(path, 'the delta')}")
    with r:
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
        for name in r.names:
            if not _all_finite(r.read(name).reshape(-1), r.specs[name][0]):
                raise DeltaRejected(422, f"tensor {name!r} holds NaN or Inf")


def _all_finite(a, dtype):
    for lo in range(0, a.size, 1 << 22):
        c = a[lo:lo + (1 << 22)]
        if dtype == "BF16":      # exponent bits all ones = Inf or NaN
            if np.any((c & np.uint16(0x7F80)) == np.uint16(0x7F80)):
                return False
        elif not np.isfinite(c).all():
            return False
    return True
