"""tests/run.py - run the unittest suite and end with `N passed, N failed, N skipped`.

Runs on: any machine with the venv (CPU only). Usage:
    python tests/run.py                   # every tests/test_*.py
    python tests/run.py test_darl         # one module (or several)
    python tests/run.py test_darl.LeaseTableTest.test_expiry_returns_the_uncommitted_part
    python tests/run.py --fail-on-skip    # a skip TESTING.md does not list fails (make test, CI)
    python tests/run.py --with slurm_jobs # every tests/test_*.py, then tests/slurm_jobs.py (make test as root)
    python tests/run.py --timeout 900     # the watchdog's budget, s (default 600)
The last line is the summary CI reads; the exit status is 1 if anything failed or
nothing ran.

What is counted (each test id exactly once: passed, failed or skipped):
  - an error in setUpClass or setUpModule fails every test of that class or module
    (they never run); a SkipTest raised there skips each of them; an error in
    tearDownClass, tearDownModule or a class/module cleanup fails the tests it served;
  - a test with several failing subtests, or a failure and then a cleanup error, is
    one failed test; an unexpected success is a failure, an expected failure a pass;
  - an exception that escapes any thread of this process while a test runs fails
    that test (threading.excepthook): much of the code under test runs in threads,
    and a worker killed by an unexpected error must not vanish;
  - a leak fails the test that leaked: ResourceWarning is an error in tests, so a
    socket, file, pipe or child process dropped unclosed raises it in its finalizer,
    and sys.unraisablehook records it (like any other exception a finalizer ignores)
    against the test running then, or between tests the one that just ended. The
    garbage collector runs before each test, so what the last one dropped in
    a reference cycle is finalized, and counted, before the next begins.
    PYTHONTRACEMALLOC=20 adds where each leaked object was allocated;
  - with --fail-on-skip, a skip whose test id (or class, or module) TESTING.md's
    "Expected skips" list does not name is a failure, with its reason printed.

The watchdog: a test, or the class and module fixtures between two tests, still
running after --timeout seconds (for a test, its module's WATCHDOG_S when larger) gets
every thread's stack printed and a TestTimeout raised in it, so it fails and the run
goes on. If it has not stopped --grace s later (--grace; it swallowed the exception, or
sits in C code), the run prints its totals with the rest counted as failed and exits 1;
faulthandler ends the process after that if even the printing thread cannot run.
"""
import argparse
import faulthandler
import gc
import os
import re
import signal
import sys
import threading
import time
import tracemalloc
import traceback
import unittest
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DEFAULT_TIMEOUT_S = 600.0
DEFAULT_GRACE_S = 30.0
FIXTURE = re.compile(r"^(setUpClass|tearDownClass|setUpModule|tearDownModule) \((.+)\)$")


class TestTimeout(Exception):
    """Raised in the main thread by the watchdog in a test or fixture that ran too long."""


def test_ids(suite):
    out = []
    for t in suite:
        out.extend(test_ids(t) if isinstance(t, unittest.TestSuite) else [t.id()])
    return out


def expected_skips(path):
    """Test ids (or class/module prefixes) in the bullet list under a heading
    "Expected skips" of a markdown file: lines like "- `test_x.Class.test_y` ..."."""
    found, inside = [], False
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("#"):
                    inside = "expected skips" in line.lower()
                elif inside:
                    m = re.match(r"\s*[-*]\s+`([\w.]+)`", line)
                    if m:
                        found.append(m.group(1))
    except FileNotFoundError:
        pass
    return found


class CountingResult(unittest.TextTestResult):
    """TextTestResult keeping one outcome per test id, with timings and thread errors."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.ids, self.outcome, self.reasons = [], {}, {}
        self.timings, self.current, self.last = [], None, None
        self.thread_errors, self.lock = [], threading.Lock()
        self.watchdog = None
        self._t0 = self._gap0 = time.monotonic()

    # ---- bookkeeping by id
    def _stands_for(self, test):
        """The test ids an outcome is about: a fixture error holder stands for its class or module."""
        if isinstance(test, unittest.TestCase):
            return [test.id()]
        m = FIXTURE.match(test.id())
        if m is None:
            return [test.id()]
        prefix = m.group(2) + "."
        return [i for i in self.ids if i.startswith(prefix)] or [test.id()]

    def _mark(self, test, outcome, why=None):
        for i in self._stands_for(test):
            if self.outcome.get(i) == "failed":
                continue                   # a failure stands, whatever else is reported for the id
            self.outcome[i] = outcome
            if why is not None:
                self.reasons[i] = why

    def startTest(self, test):
        gc.collect()                         # finalize what the last test (or the fixtures since) left in cycles
        self._drain_thread_errors()
        now = time.monotonic()
        if now - self._gap0 > 1.0:          # class/module fixtures ran since the last test
            self.timings.append((now - self._gap0, f"(fixtures before) {test.id()}"))
        self._t0, self.current = now, test.id()
        if self.watchdog:
            # a module that legitimately needs longer (real batch jobs) names its own budget
            own = getattr(sys.modules.get(type(test).__module__), "WATCHDOG_S", None)
            self.watchdog.arm(test.id(), max(own or 0, self.watchdog.default))
        super().startTest(test)

    def stopTest(self, test):
        super().stopTest(test)
        self.timings.append((time.monotonic() - self._t0, test.id()))
        self._drain_thread_errors()
        self.current, self.last, self._gap0 = None, test.id(), time.monotonic()
        if self.watchdog:
            self.watchdog.arm(f"the fixtures after {test.id()}")

    def addSuccess(self, test):
        super().addSuccess(test)
        self._mark(test, "passed")

    def addExpectedFailure(self, test, err):
        super().addExpectedFailure(test, err)
        self._mark(test, "passed")

    def addSkip(self, test, reason):
        super().addSkip(test, reason)
        self._mark(test, "skipped", reason)

    def addFailure(self, test, err):
        super().addFailure(test, err)
        self._mark(test, "failed")

    def addError(self, test, err):
        super().addError(test, err)
        self._mark(test, "failed")

    def addUnexpectedSuccess(self, test):
        super().addUnexpectedSuccess(test)
        self._mark(test, "failed")

    def addSubTest(self, test, subtest, err):
        super().addSubTest(test, subtest, err)
        if err is not None:
            self._mark(test, "failed")

    # ---- exceptions in other threads, and in finalizers
    def thread_exception(self, args):
        """threading.excepthook: record the exception against the test running now
        (or, between tests, the one that just ended: its threads outlived it)."""
        if args.exc_type is SystemExit:
            return
        text = "".join(traceback.format_exception(args.exc_type, args.exc_value, args.exc_traceback))
        name = args.thread.name if args.thread is not None else "?"
        self._record(f"an exception escaped thread {name!r}", text)

    def unraisable(self, args):
        """sys.unraisablehook: an exception a finalizer could not raise (the ResourceWarning
        of a socket, file or child process dropped unclosed; an error in a __del__),
        recorded like a thread's. The object is not kept: that would resurrect it."""
        if args.exc_traceback is None:       # raised in C (a socket's or file's finalizer)
            text = "".join(traceback.format_exception_only(args.exc_type, args.exc_value))
        else:
            text = "".join(traceback.format_exception(args.exc_type, args.exc_value, args.exc_traceback))
        where = args.err_msg or "Exception ignored in"
        if args.object is not None:
            try:
                where = f"{where}: {args.object!r}"
            except Exception:                # a half-finalized object's repr may fail
                pass
            born = tracemalloc.get_object_traceback(args.object)
            if born is not None:
                text += "allocated at (most recent call last):\n" + "\n".join(born.format()) + "\n"
        kind = "leaked a resource" if issubclass(args.exc_type, ResourceWarning) else "a finalizer failed"
        self._record(f"{kind} ({where})", text)

    def _record(self, what, text):
        with self.lock:
            self.thread_errors.append((self.current or self.last, what, text))

    def _drain_thread_errors(self):
        with self.lock:
            errors, self.thread_errors = self.thread_errors, []
        for test_id, what, text in errors:
            if test_id is None:
                test_id = "(before the first test)"
                self.ids.append(test_id)
            self.outcome[test_id] = "failed"
            self.stream.writeln(f"FAIL {test_id}: {what}:\n{text}")
            self.errors.append((_Named(test_id), f"{what}:\n{text}"))

    # ---- the totals
    def totals(self, fail_on_skip=False, expected=()):
        self._drain_thread_errors()
        passed = failed = skipped = 0
        for i in self.ids:
            o = self.outcome.get(i)
            if o == "skipped" and fail_on_skip and not any(i == e or i.startswith(e + ".") for e in expected):
                self.stream.writeln(f"unexpected skip: {i} ({self.reasons.get(i)}); "
                                    "TESTING.md's \"Expected skips\" does not list it")
                o = "failed"
            if o is None:
                self.stream.writeln(f"{'cut off by the watchdog' if i == self.current else 'did not run'}: {i}")
                o = "failed"
            passed += o == "passed"
            failed += o == "failed"
            skipped += o == "skipped"
        return passed, failed, skipped


class _Named:
    """Stands for a test id in result.errors (printErrors calls getDescription on it)."""

    def __init__(self, test_id):
        self.test_id = test_id

    def id(self):
        return self.test_id

    def shortDescription(self):
        return None

    def __str__(self):
        return self.test_id


class Watchdog:
    """One budget at a time (a test, or the fixtures between tests). SIGALRM when it runs
    out: stacks printed, TestTimeout raised in the main thread, `grace_s` more for the
    cleanups (then raised again). A thread ends the run `grace_s` after that."""

    def __init__(self, budget_s, grace_s, on_stuck):
        self.default = self.budget = budget_s
        self.grace, self.on_stuck, self.what, self.hard = grace_s, on_stuck, None, None
        signal.signal(signal.SIGALRM, self._alarm)
        threading.Thread(target=self._guard, name="watchdog", daemon=True).start()

    def arm(self, what, budget_s=None):
        self.what, self.budget = what, budget_s or self.default
        self.hard = time.monotonic() + self.budget + 2 * self.grace
        signal.setitimer(signal.ITIMER_REAL, self.budget)
        faulthandler.dump_traceback_later(self.budget + 3 * self.grace, exit=True)

    def disarm(self):
        self.hard = None
        signal.setitimer(signal.ITIMER_REAL, 0)
        faulthandler.cancel_dump_traceback_later()

    def _alarm(self, signum, frame):
        sys.stdout.flush()
        sys.stderr.write(f"\nwatchdog: {self.what} still running after its {self.budget:.0f} s budget; "
                         "the stack of every thread:\n")
        faulthandler.dump_traceback(all_threads=True)
        sys.stderr.flush()
        signal.setitimer(signal.ITIMER_REAL, self.grace)
        raise TestTimeout(f"{self.what} ran past the watchdog's {self.budget:.0f} s (tests/run.py --timeout)")

    def _guard(self):
        while True:
            time.sleep(0.5)
            hard = self.hard
            if hard is not None and time.monotonic() > hard:
                sys.stderr.write(f"\nwatchdog: {self.what} did not stop after the TestTimeout; "
                                 "ending the run\n")
                faulthandler.dump_traceback(all_threads=True)
                self.on_stuck()
                os._exit(1)


def summary(result, t0, args, expected):
    slow = sorted(result.timings, reverse=True)[:8]
    if slow:
        print("slowest tests:")
        for dt, name in slow:
            print(f"  {dt:7.1f} s  {name}")
    passed, failed, skipped = result.totals(args.fail_on_skip, expected)
    print(f"total {time.monotonic() - t0:.0f} s")
    print(f"{passed} passed, {failed} failed, {skipped} skipped", flush=True)
    return passed, failed, skipped


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    p.add_argument("names", nargs="*", help="modules, classes or test ids (default: every tests/test_*.py)")
    p.add_argument("--with", dest="also", action="append", default=[], metavar="NAME",
                   help="after those, also this module (class, test id) outside the test_*.py pattern, "
                        "in the same run and summary; repeatable")
    p.add_argument("--fail-on-skip", action="store_true",
                   help="count a skip as a failure unless TESTING.md's \"Expected skips\" lists it")
    p.add_argument("--expected-skips", default=os.path.join(ROOT, "TESTING.md"),
                   help="markdown file with the \"Expected skips\" list (default TESTING.md)")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                   help=f"watchdog budget per test and per fixture stretch, s (default {DEFAULT_TIMEOUT_S:g})")
    p.add_argument("--grace", type=float, default=DEFAULT_GRACE_S,
                   help="after a TestTimeout, how long a test may take to stop before the run ends, s "
                        f"(default {DEFAULT_GRACE_S:g})")
    args = p.parse_args(argv)
    expected = expected_skips(args.expected_skips)
    sys.path[:0] = [ROOT, HERE]          # siblings import siblings: `import darl_server`
    os.chdir(ROOT)
    loader = unittest.TestLoader()
    if args.names:
        suite = loader.loadTestsFromNames(args.names)
    else:
        suite = loader.discover(HERE, pattern="test_*.py", top_level_dir=HERE)
    if args.also:
        suite.addTests(loader.loadTestsFromNames(args.also))
    runner = unittest.TextTestRunner(verbosity=2, resultclass=CountingResult, stream=sys.stdout)
    result = runner._makeResult()
    result.ids = list(dict.fromkeys(test_ids(suite)))
    t0 = time.monotonic()
    result.watchdog = Watchdog(args.timeout, args.grace, lambda: summary(result, t0, args, expected))
    threading.excepthook = result.thread_exception
    sys.unraisablehook = result.unraisable
    result.watchdog.arm("the first fixtures")
    unittest.registerResult(result)
    result.startTestRun()
    try:
        with warnings.catch_warnings():
            if not sys.warnoptions:          # as unittest's runner: show deprecations once each
                warnings.simplefilter("default")
            warnings.simplefilter("error", ResourceWarning)      # a leak fails its test (see unraisable)
            suite(result)
            gc.collect()                     # what the last module's fixtures left in cycles
    finally:
        result.stopTestRun()
        result.watchdog.disarm()
    result.printErrors()
    # the summary stays the last line: a pipe or socket a module global still holds would
    # otherwise print its ResourceWarning after it, when the interpreter collects it at exit
    warnings.simplefilter("ignore", ResourceWarning)
    passed, failed, skipped = summary(result, t0, args, expected)
    sys.unraisablehook = sys.__unraisablehook__
    return 1 if failed or passed + skipped == 0 else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
