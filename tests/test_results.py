"""bench/results.py, run as `make bench` runs it, on real files in a temporary directory:
it rewrites only its own bench's block of a RESULTS.md, and refuses (exit 1, the file
untouched) when the markers are missing, doubled or out of order, or stdin is empty. The
repository's bench/RESULTS.md has a block for every bench `make bench` runs."""
import os
import re
import subprocess
import sys
import tempfile
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "bench", "results.py")

PAGE = """# Results

## Phases in time

Hand-written: what the figures mean (kept).

<!-- bench:hetero -->
old hetero figures
<!-- /bench:hetero -->

After hetero's block (kept).

<!-- bench:wire_speed -->
old wire_speed figures
<!-- /bench:wire_speed -->
"""

OUTPUT = "progress 1/3\rprogress 3/3\n\x1b[1mutilisation\x1b[0m fast 0.96 slow 0.99\nheld-out -0.2%\n\n"


class ResultsTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.addCleanup(self.tmp.cleanup)
        self.path = os.path.join(self.tmp.name, "RESULTS.md")

    def write(self, text):
        with open(self.path, "w") as f:
            f.write(text)

    def read(self):
        with open(self.path) as f:
            return f.read()

    def run_results(self, *args, stdin=""):
        return subprocess.run([sys.executable, SCRIPT, *args, "--file", self.path], input=stdin,
                              capture_output=True, text=True, timeout=60)

    def test_it_rewrites_only_its_own_block(self):
        self.write(PAGE)
        r = self.run_results("hetero", "--command", "python bench/hetero.py --quick", "--date", "2026-12-06",
                             stdin=OUTPUT)
        self.assertEqual(r.returncode, 0, r.stderr)
        text = self.read()
        begin, end = text.index("<!-- bench:hetero -->"), text.index("<!-- /bench:hetero -->")
        self.assertEqual(text[:begin], PAGE[:PAGE.index("<!-- bench:hetero -->")])
        self.assertEqual(text[end:], PAGE[PAGE.index("<!-- /bench:hetero -->"):])
        inside = text[begin:end]
        self.assertIn("`python bench/hetero.py --quick`", inside)
        self.assertIn("2026-12-06", inside)
        self.assertIn("progress 3/3\nutilisation fast 0.96 slow 0.99\nheld-out -0.2%\n```", inside)
        self.assertNotIn("old hetero figures", inside)
        self.assertNotIn("progress 1/3", inside)          # a carriage return's overwritten progress
        self.assertNotIn("\x1b", inside)
        self.assertIn("old wire_speed figures", text)      # the other bench's block untouched

        again = self.run_results("hetero", "--command", "python bench/hetero.py --quick", "--date", "2026-12-07",
                                 stdin="utilisation fast 0.97\n")
        self.assertEqual(again.returncode, 0, again.stderr)
        text = self.read()
        self.assertEqual(text.count("<!-- bench:hetero -->"), 1)
        self.assertIn("2026-12-07", text)
        self.assertNotIn("2026-12-06", text)
        self.assertNotIn("0.96", text)
        self.assertIn("Hand-written: what the figures mean (kept).", text)

    def test_the_last_lines_only_when_a_bench_prints_many(self):
        self.write(PAGE)
        r = self.run_results("wire_speed", "--command", "x", "--tail", "3",
                             stdin="".join(f"line {i}\n" for i in range(10)))
        self.assertEqual(r.returncode, 0, r.stderr)
        text = self.read()
        self.assertIn("line 7\nline 8\nline 9\n```", text)
        self.assertNotIn("line 6", text)
        self.assertIn("7 earlier ones left out", text)

    def test_it_refuses_without_its_markers_and_writes_nothing(self):
        for page, why in ((PAGE.replace("<!-- /bench:hetero -->\n", ""), "no end marker"),
                          (PAGE.replace("<!-- bench:hetero -->\n", ""), "no begin marker"),
                          (PAGE + "<!-- bench:hetero -->\n<!-- /bench:hetero -->\n", "twice"),
                          (PAGE.replace("<!-- bench:hetero -->", "@@").replace("<!-- /bench:hetero -->",
                                                                                "<!-- bench:hetero -->")
                           .replace("@@", "<!-- /bench:hetero -->"), "out of order")):
            with self.subTest(why):
                self.write(page)
                r = self.run_results("hetero", "--command", "python bench/hetero.py", stdin=OUTPUT)
                self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
                self.assertIn("<!-- bench:hetero -->", r.stderr)
                self.assertIn("nothing was written", r.stderr)
                self.assertEqual(self.read(), page)
                check = self.run_results("--check", "hetero")
                self.assertEqual(check.returncode, 1, check.stderr)
        self.write(PAGE)
        self.assertEqual(self.run_results("--check", "hetero").returncode, 0)
        self.assertEqual(self.run_results("--check", "chaos").returncode, 1)

    def test_empty_output_is_refused(self):
        self.write(PAGE)
        r = self.run_results("hetero", "--command", "python bench/hetero.py", stdin="\n\n")
        self.assertEqual(r.returncode, 1)
        self.assertIn("no output", r.stderr)
        self.assertEqual(self.read(), PAGE)

    def test_results_md_has_a_block_for_every_bench_make_bench_runs(self):
        with open(os.path.join(ROOT, "Makefile")) as f:
            make = f.read()
        recipe = make[make.index("\nbench:"):]
        recipe = recipe[:recipe.index("\n\n")]
        skipped = set(re.search(r'skip="([^"]+)"', recipe).group(1).split())
        benches = sorted(os.path.splitext(n)[0] for n in os.listdir(os.path.join(ROOT, "bench"))
                         if n.endswith(".py") and f"bench/{n}" not in skipped)
        self.assertIn("hetero", benches)
        self.assertNotIn("results", benches)
        with open(os.path.join(ROOT, "bench", "RESULTS.md")) as f:
            text = f.read()
        for name in benches:
            with self.subTest(name):
                self.assertEqual(text.count(f"<!-- bench:{name} -->"), 1)
                self.assertEqual(text.count(f"<!-- /bench:{name} -->"), 1)


if __name__ == "__main__":
    sys.exit("run with: .venv/bin/python tests/run.py test_results")
