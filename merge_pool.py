"""merge_pool.py - the aggregator's round on every core: worker processes over blocks they share.

Runs on: the central VM, imported by outer_state.py and fedmom_outer.py; standard library +
numpy; never torch. The workers are `python outer_state.py --merge-worker` (outer_state.py's
piece code, this module's serve() loop), one process per fedmom_server.py --merge-procs,
started by Pool. No port, no state of its own. Its blocks are files named
pww-fedmom-<aggregator pid>-<random>-<n>: shared memory blocks in $PWW_SHM_DIR (default
/dev/shm, mapped), and file blocks in fedmom_server.py --outer-dir (on disk, for the part of
the outer state --memory-gb leaves out of memory: outer_budget.py). Each is held under a
shared flock by the process that made it for as long as it lives (so whose a block is never
rests on a pid, which another pid namespace does not see and a restart may get again);
removed when the aggregator lets go of it, and after a crash by the next start's sweep,
which removes only the blocks no live process holds (sweep_stale).

Why processes: a round is numpy work on cache-sized pieces (outer_state.apply_round), some 40
numpy calls of ~10-60 us per 64K values. Threads share one interpreter lock between those
calls, and measured here two threads ran a round no faster than one (12.9 vs 16.0 ns per
parameter at 64K pieces; 14.5 vs 12.9 at 256K, where the pieces leave the cache): the
cores sat idle. Processes each have their own.

How: the outer state's arrays (theta, momentum, residual) live in blocks (BlockArrays, a
dict of float32 views into one shared memory mapping, and of FileTensors for the tensors
kept on disk), so a worker writes its pieces where the aggregator reads them. A file block
is never mapped: its pieces are read and written with pread/pwrite, so a disk error is a
DiskError that fails the round (a mapped page would kill the process with SIGBUS), and the
aggregator fdatasyncs the file blocks before a round is published (a write-back error too).
Per tensor, the aggregator cuts the pieces into one contiguous run per worker and sends each
a Task: the step (delta paths, weights, lr, mu, codec), where the tensor's arrays are, where
its update's codes and scales go (a scratch block), and the pieces with their flags. The
worker opens the delta files itself (fedmom_merge.DeltaReader: the parts of its own run of
the tensor, not the whole tensor's), runs outer_state's piece code and
answers each piece's norms and whether it stayed finite. Every value is computed by the
same float32 operations in the same process-independent order, so the bits are those of
one thread (tests/test_merge_pool.py). A worker that dies fails the round (the aggregator
rebuilds the state, as after any failed merge) and is started again, and so does one that
answers nothing for TASK_TIMEOUT_S ($PWW_MERGE_TASK_TIMEOUT_S; stopped, or hung on a disk);
a worker whose aggregator dies exits at once, mid-task too (it would hold the dead
aggregator's shared memory that its restart needs).

    pool = Pool(4, [sys.executable, "outer_state.py", "--merge-worker"])
    state.share()                                   # theta, momentum, residual into shared memory
    outer_state.apply_round(state, step, out_update, pool=pool)
    pool.close()
    arrays = BlockArrays(shapes, on_disk={"embed"}, disk_dir="state/outer")   # "embed" in a file
"""
import atexit
import errno
import fcntl
import math
import mmap
import os
import pickle
import secrets
import select
import struct
import subprocess
import sys
import threading
import time

import numpy as np

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
            print(f"merge_pool: merge worker {w.pid} has not exited 30 s after SIGKILL; left behind",
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
    keeps its shared memory mapped: the restart's check (outer_budget.check_machine)
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
