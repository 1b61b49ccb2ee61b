"""bench/scale_round.py end to end at its smallest: the real servers over TLS, two fake
int4 sites, two rounds of the tiny model in each arm (the outer state in memory, today's
serial exchange; the same, pipelined: each delta checked as it arrives and the update followed
as it is merged; then under a --memory-gb that keeps most of it on disk); it must exit 0
(every round complete, every delta merged, every theta's digest checked, the pipelined arm's
thetas the serial arm's bit for bit) and print its summary, the exchange and the arms side by
side. No figure is judged: the timings are the machine's. The sizes users train are `python
bench/scale_round.py --flavor 0.6B`."""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import outer_state  # noqa: E402
import scale_round  # noqa: E402


class ScaleRoundTest(unittest.TestCase):
    def test_two_rounds_of_the_tiny_model_complete_checked_and_summed_up(self):
        work = tempfile.mkdtemp(prefix="scale-round-test-")
        self.addCleanup(shutil.rmtree, work, True)
        figures = os.path.join(work, "figures.json")
        p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "scale_round.py"), "--quick", "--flavor",
                            "tiny", "--rounds", "2", "--dir", work, "--json", figures],
                           capture_output=True, text=True, timeout=600, cwd=ROOT)
        self.assertEqual(p.returncode, 0, p.stdout[-3000:] + p.stderr[-3000:])
        for line in ("=== arm memory", "=== arm budget", "round 1 (1/2)", "round 2 (2/2)", "central s/round",
                     "site encode + apply:", "state-dir peak:", "projection, linear in parameters", "all passed",
                     "a restart's peak", "the arms side by side", "projection per mode", "nothing in memory at 32B",
                     "=== arm pipelined", "the exchange, serial", "floor of a round's bytes",
                     "bit-exact: every round's theta the same in both arms: yes"):
            self.assertIn(line, p.stdout)
        with open(figures) as f:
            out = json.load(f)
        for arm in ("memory", "budget"):
            a = out["arms"][arm]
            self.assertEqual([r["round"] for r in a["rounds"]], [1, 2])
            self.assertEqual(a["failures"], [])
            self.assertLessEqual(set(scale_round.PHASES), set(a["summary"]["phases"]))
            self.assertGreater(a["summary"]["memory_peak"], 0)
        self.assertGreater(out["arms"]["budget"]["summary"]["outer_peak"], 0, "the budget arm kept nothing on disk")
        serial, pipe = out["arms"]["memory"], out["arms"]["pipelined"]
        self.assertEqual(pipe["failures"], [])
        for a, b in zip(serial["rounds"], pipe["rounds"], strict=True):      # bit-exact, round by round
            self.assertEqual({e["digest"] for e in a["sites"].values()}, {e["digest"] for e in b["sites"].values()})
            self.assertEqual({e["via"] for e in b["sites"].values()}, {"followed"}, "the update was not followed")
            self.assertEqual({e["via"] for e in a["sites"].values()}, {"update"})
        ex = out["exchange"]
        self.assertEqual(ex["failures"], [])
        self.assertEqual([r["digests_equal"] for r in ex["rounds"]], [True, True])
        for r in ex["rounds"]:
            for arm in ("serial", "pipelined"):
                self.assertGreater(r[arm]["exchange_s"], 0)
                self.assertEqual(set(r[arm]["held_s"]), set(scale_round.SITES))
            self.assertGreater(r["floor_s"], 0)
        self.assertLessEqual(set(outer_state.RATES), set(out["rates"]))
        plan = subprocess.run([sys.executable, "fedmom_server.py", "plan", "--params", "8e9", "--rates", figures],
                              capture_output=True, text=True, timeout=60, cwd=ROOT)
        self.assertEqual(plan.returncode, 0, plan.stderr)
        self.assertIn("bench/scale_round.py --flavor tiny", plan.stdout)
        self.assertIn("pipelined: max(merge", plan.stdout)      # the exchange from this run's rates
        self.assertEqual(sorted(os.listdir(work)), ["figures.json"])      # the run's directory removed

    def test_a_flavor_that_cannot_fit_is_refused_naming_the_flag_and_the_fix(self):
        shapes = scale_round.model_shapes("1.7B")
        disk, mem = scale_round.need(shapes)
        self.assertEqual(scale_round.room_problems("1.7B", shapes, disk, mem), [])
        short = scale_round.room_problems("1.7B", shapes, disk - 1, mem - 1)
        self.assertEqual(len(short), 2)
        self.assertIn("--dir has", short[0])
        self.assertIn("larger disk", short[0])
        self.assertIn("larger machine", short[1])

    def test_the_flavors_have_the_sizes_the_help_says(self):
        sizes = {f: scale_round.nparams(scale_round.model_shapes(f)) for f in scale_round.FLAVOR_CHOICES}
        self.assertEqual(sizes["0.6B"], 709_427_200)
        self.assertTrue(20e6 < sizes["small"] < 30e6 and 1.9e9 < sizes["1.7B"] < 2.1e9, sizes)
        for f in ("0.6B", "1.7B", "8B"):
            self.assertEqual(scale_round.qwen3_params(scale_round.QWEN3[f]),
                             scale_round.nparams(scale_round.qwen3_shapes(f)))


if __name__ == "__main__":
    unittest.main()
