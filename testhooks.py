"""testhooks.py - the test hooks: named fault points and a steppable wall clock.

Runs on: everywhere (imported by the central servers, the site code and the tests).
Standard library only. No state, no port. Inert unless their variable is set:
testbed/fault_harness.py (bench/fault_schedule.py), bench/chaos.py and the tests set them; a
production start never does.

  - PWW_TEST_CLOCK_OFFSET_FILE=FILE: wall_time() is time.time() plus the number of
    seconds in FILE (re-read at every call; absent or empty = 0), so a test can step
    the wall clock of a running server by +-1 h without touching the machine's clock.
  - PWW_TEST_PHASE_CLOCK_RATE="RANK:RATE,...": phase_clock(rank) runs RATE times as fast
    as time.perf_counter() on that rank (diloco.PhaseClock's time source), so a test can
    make the ranks of one site disagree on how long a phase has lasted.
  - PWW_TEST_FAULT_DIR=DIR: fault_point(name) stops the calling thread at a named
    protocol phase while DIR/<name> exists. The file holds how many hits to let pass
    first; at the hit that stops, DIR/<name>.hit appears (holding the pid) and the
    thread waits until DIR/<name> is removed. A test SIGKILLs the process there, or
    removes the file to let it go on (the thread removes <name>.hit as it leaves, so
    the point can be armed again): a crash or a stall at an exact phase, with no sleep.
    The servers' points are named darl.*, fedmom.*, blob.*; train.py's sites have
    site.trained and site.sent (fedsite.py, rank 0: before the send, after it was
    accepted) and site.fold (diloco.py, --overlap: error feedback settled, theta_global
    not yet folded in); smoke.py has smoke.first_collective.rank<N>.
"""
import contextlib
import fcntl
import os
import threading
import time

CLOCK_OFFSET_ENV = "PWW_TEST_CLOCK_OFFSET_FILE"
FAULT_DIR_ENV = "PWW_TEST_FAULT_DIR"
_fault_lock = threading.Lock()


PHASE_CLOCK_RATE_ENV = "PWW_TEST_PHASE_CLOCK_RATE"


def phase_clock(rank):
    """The time source of a phase measured in time on `rank`: time.perf_counter, or a faster
    one where $PWW_TEST_PHASE_CLOCK_RATE names this rank."""
    rates = dict(x.split(":") for x in os.environ.get(PHASE_CLOCK_RATE_ENV, "").split(",") if ":" in x)
    rate = float(rates.get(str(rank), 1.0))
    if rate == 1.0:
        return time.perf_counter
    t0 = time.perf_counter()
    return lambda: t0 + (time.perf_counter() - t0) * rate


def wall_time():
    """time.time(), plus the test offset of $PWW_TEST_CLOCK_OFFSET_FILE when set."""
    path = os.environ.get(CLOCK_OFFSET_ENV)
    if not path:
        return time.time()
    try:
        with open(path) as f:
            text = f.read().strip()
        return time.time() + (float(text) if text else 0.0)
    except (OSError, ValueError):
        return time.time()


@contextlib.contextmanager
def _dir_locked(root):
    """An exclusive flock on the fault directory: the count and the .hit file are read and
    replaced by one process at a time (several processes may pass one point: the merge
    workers), never through each other's temporary file."""
    try:
        fd = os.open(root, os.O_RDONLY)
    except OSError:                      # no such directory: nothing is armed there
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def fault_point(name, on_stop=None):
    """A named protocol phase a test may stop this thread at ($PWW_TEST_FAULT_DIR; see the
    module docstring). `on_stop` runs just before the thread stops (e.g. write half a log
    line, for a torn write). A no-op without the variable."""
    root = os.environ.get(FAULT_DIR_ENV)
    if not root:
        return
    arm = os.path.join(root, name)
    with _fault_lock, _dir_locked(root):   # one process at a time too: a point the merge workers share
        try:
            with open(arm) as f:
                text = f.read().strip()
        except OSError:
            return
        skip = int(text) if text.isdigit() else 0
        if skip > 0:
            with open(arm + ".tmp", "w") as f:
                f.write(str(skip - 1))
            os.replace(arm + ".tmp", arm)
            return
        if on_stop is not None:
            on_stop()
        with open(arm + ".hit.tmp", "w") as f:
            f.write(str(os.getpid()))
        os.replace(arm + ".hit.tmp", arm + ".hit")
    while os.path.exists(arm):
        time.sleep(0.01)
    try:                                 # gone on: the test may arm this point again
        os.unlink(arm + ".hit")
    except FileNotFoundError:
        pass
