"""tests/run.py itself: small probe modules written to a temp dir and run by the real
runner in a subprocess, one case each; the closing line and the exit status are checked.

Cases: fixture errors and skips (setUpClass, setUpModule, tearDownClass) counted for the
tests they stand for; subtests and cleanup errors counted once; an exception in another
thread fails its test; a leaked socket or file, or an error in a finalizer, fails the
test that caused it; the watchdog (a hung test fails and the run goes on; a test that
swallows the TestTimeout ends the run with its totals; a module's WATCHDOG_S); --fail-on-skip against an
expected-skips list; an import error and an empty run; and TESTING.md's own list.
"""
import os
import re
import subprocess
import sys
import tempfile
import textwrap
import time
import unittest

import run

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SUMMARY = re.compile(r"^(\d+) passed, (\d+) failed, (\d+) skipped$")

PROBES = {
    "probe_fixtures": """
        import unittest
        class Broken(unittest.TestCase):
            @classmethod
            def setUpClass(cls):
                raise RuntimeError("no fixture")
            def test_a(self): pass
            def test_b(self): pass
            def test_c(self): pass
        class Fine(unittest.TestCase):
            def test_ok(self): pass
        """,
    "probe_module_error": """
        import unittest
        def setUpModule():
            raise RuntimeError("no module fixture")
        class T(unittest.TestCase):
            def test_a(self): pass
            def test_b(self): pass
        """,
    "probe_module_skip": """
        import unittest
        def setUpModule():
            raise unittest.SkipTest("needs root")
        class T(unittest.TestCase):
            def test_a(self): pass
            def test_b(self): pass
        """,
    "probe_class_skip": """
        import unittest
        class T(unittest.TestCase):
            @classmethod
            def setUpClass(cls):
                raise unittest.SkipTest("no scontrol")
            def test_a(self): pass
            def test_b(self): pass
        class U(unittest.TestCase):
            def test_ok(self): pass
        """,
    "probe_teardown": """
        import unittest
        class T(unittest.TestCase):
            @classmethod
            def tearDownClass(cls):
                raise RuntimeError("cleanup broke")
            def test_a(self): pass
            def test_b(self): pass
        class U(unittest.TestCase):
            def test_ok(self): pass
        """,
    "probe_subtests": """
        import unittest
        class T(unittest.TestCase):
            def test_three_bad_subtests(self):
                for i in range(3):
                    with self.subTest(i=i):
                        self.assertEqual(i, -1)
            def test_fine_subtests(self):
                for i in range(3):
                    with self.subTest(i=i):
                        self.assertEqual(i, i)
        """,
    "probe_cleanup": """
        import unittest
        class T(unittest.TestCase):
            def test_fails_and_its_cleanup_too(self):
                self.addCleanup(lambda: 1 / 0)
                self.fail("the body")
            def test_passes_but_its_cleanup_fails(self):
                self.addCleanup(lambda: 1 / 0)
            def test_ok(self): pass
        """,
    "probe_expected": """
        import unittest
        class T(unittest.TestCase):
            @unittest.expectedFailure
            def test_known_bug(self):
                self.assertEqual(1, 2)
            @unittest.expectedFailure
            def test_fixed_bug(self):
                pass
        """,
    "probe_thread": """
        import threading, unittest
        GATE = threading.Event()
        class T(unittest.TestCase):
            def test_worker_dies(self):
                t = threading.Thread(target=lambda: 1 / 0, name="worker")
                t.start()
                t.join()
            def test_ok(self): pass
        class Outlived(unittest.TestCase):
            @classmethod
            def tearDownClass(cls):
                GATE.set()                   # the thread raises only after its test ended
                cls.thread.join()
            def test_starts_a_thread_that_raises_later(self):
                def late():
                    GATE.wait()
                    raise ValueError("after the test")
                type(self).thread = threading.Thread(target=late, name="late")
                type(self).thread.start()
        """,
    "probe_leaks": """
        import os, socket, tempfile, unittest
        class T(unittest.TestCase):
            def test_leaks_a_socket(self):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                s.bind(("127.0.0.1", 0))
                del s                        # dropped open: its finalizer warns
            def test_leaks_a_file(self):
                open(os.devnull).read(0)
            def test_leaks_a_pipe_in_a_cycle(self):
                r, w = os.pipe()
                os.close(w)
                holder = {"f": os.fdopen(r)}
                holder["self"] = holder      # freed only by the collector
            def test_ok(self):
                with socket.socket() as s, open(os.devnull) as f:
                    s.bind(("127.0.0.1", 0))
        class Broken:
            def __del__(self):
                raise ValueError("a finalizer's own error")
        class Finalizer(unittest.TestCase):
            def test_drops_an_object_whose_del_raises(self):
                Broken()
        class Kept(unittest.TestCase):
            def test_keeps_a_socket_on_the_instance(self):
                self.sock = socket.socket()  # freed when the runner drops the test, after it ended
            def test_ok_after(self): pass
        """,
    "probe_hang": """
        import threading, unittest
        class T(unittest.TestCase):
            def test_hangs(self):
                threading.Event().wait()
            def test_after(self): pass
        """,
    "probe_long": """
        import threading, time, unittest
        WATCHDOG_S = 10
        class T(unittest.TestCase):
            def test_a_longer_than_the_default(self):
                time.sleep(3)
            def test_b_hangs(self):
                threading.Event().wait()
        """,
    "probe_stubborn": """
        import time, unittest
        class T(unittest.TestCase):
            def test_a_swallows_the_timeout(self):
                while True:
                    try:
                        time.sleep(100)
                    except Exception:
                        pass
            def test_b_never_reached(self): pass
        """,
    "probe_setup_hang": """
        import threading, unittest
        class T(unittest.TestCase):
            @classmethod
            def setUpClass(cls):
                threading.Event().wait()
            def test_a(self): pass
            def test_b(self): pass
        class U(unittest.TestCase):
            def test_ok(self): pass
        """,
    "probe_skips": """
        import unittest
        class S(unittest.TestCase):
            def test_listed(self):
                self.skipTest("a GPU is visible")
            def test_unlisted(self):
                self.skipTest("curl missing")
            def test_ok(self): pass
        """,
    "probe_empty": """
        import unittest
        """,
}


class RunnerTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory(prefix="runner-probes-")
        for name, text in PROBES.items():
            with open(os.path.join(cls.tmp.name, name + ".py"), "w") as f:
                f.write(textwrap.dedent(text))

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def runner(self, *args, expect_rc=None, timeout=120):
        """tests/run.py on the probes: (counts, exit status, output, seconds)."""
        env = {**os.environ, "PYTHONPATH": self.tmp.name}
        t0 = time.monotonic()
        p = subprocess.run([sys.executable, os.path.join(HERE, "run.py"), *args], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=timeout)
        out = p.stdout + p.stderr
        lines = p.stdout.rstrip("\n").splitlines()
        m = SUMMARY.match(lines[-1]) if lines else None
        self.assertIsNotNone(m, f"the last line is not the summary:\n{out}")
        if expect_rc is not None:
            self.assertEqual(p.returncode, expect_rc, out)
        return tuple(map(int, m.groups())), p.returncode, out, time.monotonic() - t0

    def counts(self, *args, rc):
        got, _, out, _ = self.runner(*args, expect_rc=rc)
        return got, out

    def test_a_setupclass_error_fails_each_test_of_the_class(self):
        got, out = self.counts("probe_fixtures", rc=1)
        self.assertEqual(got, (1, 3, 0), out)
        self.assertIn("no fixture", out)

    def test_a_setupmodule_error_fails_each_test_of_the_module(self):
        got, out = self.counts("probe_module_error", "probe_fixtures.Fine", rc=1)
        self.assertEqual(got, (1, 2, 0), out)

    def test_a_skip_in_setupmodule_or_setupclass_skips_each_test(self):
        self.assertEqual(self.counts("probe_module_skip", rc=0)[0], (0, 0, 2))
        self.assertEqual(self.counts("probe_class_skip", rc=0)[0], (1, 0, 2))

    def test_a_teardownclass_error_fails_the_tests_it_served(self):
        self.assertEqual(self.counts("probe_teardown", rc=1)[0], (1, 2, 0))

    def test_failing_subtests_are_one_failed_test(self):
        got, out = self.counts("probe_subtests", rc=1)
        self.assertEqual(got, (1, 1, 0), out)
        self.assertEqual(out.count("AssertionError: 0 != -1"), 1, out)     # each subtest still reported
        self.assertEqual(out.count("AssertionError: 2 != -1"), 1, out)

    def test_a_failure_and_a_cleanup_error_are_one_failure(self):
        got, out = self.counts("probe_cleanup", rc=1)
        self.assertEqual(got, (1, 2, 0), out)
        self.assertIn("ZeroDivisionError", out)

    def test_expected_failure_passes_unexpected_success_fails(self):
        self.assertEqual(self.counts("probe_expected", rc=1)[0], (1, 1, 0))

    def test_an_exception_in_another_thread_fails_its_test(self):
        got, out = self.counts("probe_thread", rc=1)
        self.assertEqual(got, (1, 2, 0), out)
        self.assertRegex(out, r"probe_thread\.T\.test_worker_dies: an exception escaped thread 'worker'")
        self.assertRegex(out, r"probe_thread\.Outlived\.test_starts_a_thread_that_raises_later: "
                              r"an exception escaped thread 'late'")
        self.assertIn("ValueError: after the test", out)

    def test_a_test_that_leaks_a_socket_or_a_file_fails(self):
        got, out = self.counts("probe_leaks", rc=1)
        self.assertEqual(got, (2, 5, 0), out)
        for test, leaked in [("T.test_leaks_a_socket", "unclosed <socket.socket"),
                             ("T.test_leaks_a_file", "unclosed file"),
                             ("T.test_leaks_a_pipe_in_a_cycle", "unclosed file"),
                             ("Kept.test_keeps_a_socket_on_the_instance", "unclosed <socket.socket")]:
            m = re.search(rf"^FAIL probe_leaks\.{test}: leaked a resource .*?\n\n", out, re.M | re.S)
            self.assertIsNotNone(m, f"{test} is not failed for its leak:\n{out}")
            self.assertIn(f"ResourceWarning: {leaked}", m.group(0))
        self.assertRegex(out, r"FAIL probe_leaks\.Finalizer\.test_drops_an_object_whose_del_raises: "
                              r"a finalizer failed .*\n(.*\n)*ValueError: a finalizer's own error")
        self.assertNotRegex(out, r"FAIL probe_leaks\.\w+\.test_ok", out)

    def test_the_watchdog_fails_a_hung_test_prints_stacks_and_goes_on(self):
        got, rc, out, seconds = self.runner("probe_hang", "--timeout", "3", expect_rc=1)
        self.assertEqual(got, (1, 1, 0), out)
        self.assertIn("watchdog: probe_hang.T.test_hangs still running after its 3 s budget", out)
        self.assertRegex(out, r'File ".*probe_hang\.py", line \d+ in test_hangs')     # the stack dump
        self.assertIn("TestTimeout", out)
        self.assertLess(seconds, 60, "the hang was cut short")

    def test_a_module_watchdog_s_is_its_tests_budget(self):
        got, _, out, _ = self.runner("probe_long", "probe_hang", "--timeout", "1", expect_rc=1)
        self.assertEqual(got, (2, 2, 0), out)     # probe_long's 3 s test passes; each hang still fails
        self.assertIn("watchdog: probe_long.T.test_b_hangs still running after its 10 s budget", out)
        self.assertIn("watchdog: probe_hang.T.test_hangs still running after its 1 s budget", out)

    def test_a_hung_setupclass_fails_its_tests_and_the_run_goes_on(self):
        got, _, out, _ = self.runner("probe_setup_hang", "--timeout", "3", expect_rc=1)
        self.assertEqual(got, (1, 2, 0), out)
        self.assertIn("in setUpClass", out)

    def test_a_test_that_swallows_the_timeout_ends_the_run_with_its_totals(self):
        got, rc, out, seconds = self.runner("probe_stubborn", "probe_fixtures.Fine", "--timeout", "2",
                                            "--grace", "2", expect_rc=1)
        self.assertEqual(got, (0, 3, 0), out)          # the stubborn test and the two never reached
        self.assertIn("did not stop after the TestTimeout", out)
        self.assertIn("cut off by the watchdog: probe_stubborn.T.test_a_swallows_the_timeout", out)
        self.assertIn("did not run: probe_stubborn.T.test_b_never_reached", out)
        self.assertIn("did not run: probe_fixtures.Fine.test_ok", out)
        self.assertLess(seconds, 60)

    def test_fail_on_skip_fails_only_skips_the_list_does_not_name(self):
        listing = os.path.join(self.tmp.name, "EXPECTED.md")
        with open(listing, "w") as f:
            f.write("# Title\n\n## Expected skips\n\n- `probe_skips.S.test_listed`: where a GPU is visible\n"
                    "\n## Another section\n\n- `probe_skips.S.test_unlisted`: not in the list above\n")
        self.assertEqual(self.counts("probe_skips", "--expected-skips", listing, rc=0)[0], (1, 0, 2))
        got, out = self.counts("probe_skips", "--fail-on-skip", "--expected-skips", listing, rc=1)
        self.assertEqual(got, (1, 1, 1), out)
        self.assertIn("unexpected skip: probe_skips.S.test_unlisted (curl missing)", out)
        with open(listing, "w") as f:
            f.write("## Expected skips\n- `probe_skips.S`: the whole class\n")
        self.assertEqual(self.counts("probe_skips", "--fail-on-skip", "--expected-skips", listing, rc=0)[0],
                         (1, 0, 2))

    def test_an_import_error_fails_and_an_empty_run_exits_1(self):
        got, out = self.counts("probe_does_not_exist", rc=1)
        self.assertEqual(got, (0, 1, 0), out)
        self.assertEqual(self.counts("probe_empty", rc=1)[0], (0, 0, 0))

    def test_with_adds_a_module_to_the_same_run_and_summary(self):
        got, out = self.counts("probe_class_skip", "--with", "probe_module_skip", rc=0)
        self.assertEqual(got, (1, 0, 4), out)         # (1, 0, 2) and (0, 0, 2): one summary for both
        self.assertEqual(len([l for l in out.splitlines() if SUMMARY.match(l)]), 1, out)
        got, out = self.counts("probe_class_skip", "--with", "probe_fixtures", rc=1)
        self.assertEqual(got, (2, 3, 2), out)         # a failure in the added module fails the run

    def test_testing_md_lists_only_tests_that_exist(self):
        listed = run.expected_skips(os.path.join(ROOT, "TESTING.md"))
        self.assertTrue(listed, "TESTING.md has an \"Expected skips\" list")
        self.assertEqual(run.expected_skips(os.path.join(ROOT, "README.md")), [],
                         "the expected skips are listed once, in TESTING.md")
        ids = run.test_ids(unittest.TestLoader().discover(HERE, pattern="test_*.py", top_level_dir=HERE))
        for entry in listed:
            self.assertTrue(any(i == entry or i.startswith(entry + ".") for i in ids), entry)


if __name__ == "__main__":
    sys.exit("run with: .venv/bin/python tests/run.py test_runner")
