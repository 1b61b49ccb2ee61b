"""tests/run.py - run the unittest suite and end with `N passed, N failed, N skipped`.

Runs on: any machine with the venv (CPU only). Usage:
    python tests/run.py                 # every tests/test_*.py
    python tests/run.py test_darl       # one module (or several)
    python tests/run.py test_darl.LeaseTableTest.test_expiry
The last line is the summary CI reads; the exit status is 1 if anything failed.
"""
import os
import sys
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


class CountingResult(unittest.TextTestResult):
    """TextTestResult that also times each test, so slow tests are visible."""

    def startTest(self, test):
        self._t0 = time.monotonic()
        super().startTest(test)

    def stopTest(self, test):
        super().stopTest(test)
        self.timings = getattr(self, "timings", [])
        self.timings.append((time.monotonic() - self._t0, test.id()))


def main(argv):
    sys.path[:0] = [ROOT, HERE]          # siblings import siblings: `import darl_server`
    os.chdir(ROOT)
    loader = unittest.TestLoader()
    names = [a for a in argv if not a.startswith("-")]
    if names:
        suite = loader.loadTestsFromNames(names)
    else:
        suite = loader.discover(HERE, pattern="test_*.py", top_level_dir=HERE)
    runner = unittest.TextTestRunner(verbosity=2, resultclass=CountingResult, stream=sys.stdout)
    t0 = time.monotonic()
    result = runner.run(suite)
    slow = sorted(getattr(result, "timings", []), reverse=True)[:8]
    if slow:
        print("slowest tests:")
        for dt, name in slow:
            print(f"  {dt:7.1f} s  {name}")
    failed = len(result.failures) + len(result.errors) + len(result.unexpectedSuccesses)
    skipped = len(result.skipped)
    passed = result.testsRun - failed - skipped
    print(f"total {time.monotonic() - t0:.0f} s")
    print(f"{passed} passed, {failed} failed, {skipped} skipped")
    return 1 if failed or result.testsRun == 0 else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
