"""bench/hetero.py's bookkeeping: the sleeps that make the speed gaps, each site's LR schedule,
and the figures made from metrics.jsonl rows and round records (utilisation, tokens/s against
the solo rates, the fixed run's theta at the timed run's wall time, what a stall cost the other
site). The runs themselves are real federations, run by `make bench`; these are synthetic rows."""
import os
import sys
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import hetero  # noqa: E402


def phase(rnd, t, inner, cycle, wait=0.05, steps=10):
    return {"split": "phase", "round": rnd, "time": t, "inner_s": inner, "cycle_s": cycle, "util": inner / cycle,
            "wait_s": wait, "after_s": cycle - inner, "steps": steps, "step_s": inner / steps, "ended_by": "clock"}


def fed(windows, inner, merged=True):
    return {"split": "federation", "windows": windows, "inner_s": inner, "merged": merged}


def record(rnd, t, clusters, reason="every live member sent its delta", tokens=1000, waited=None, toks=None):
    return {"round": rnd, "time": t, "reason": reason, "tokens": tokens, "quorum": None,
            "clusters": {c: {"waited_s": (waited or {}).get(c, 0.05),
                             "tokens": (toks or {}).get(c, tokens // len(clusters))} for c in clusters}}


class SpeedsTest(unittest.TestCase):
    def test_a_site_of_ratio_r_sleeps_r_minus_1_whole_base_steps_more(self):
        # base step = 20 ms compute + 100 ms sleep: 2x sleeps 120 ms more, 3x 240 ms more
        self.assertEqual(hetero.throttles([1, 2, 3], 20.0, 100), [100, 220, 340])
        self.assertEqual(hetero.ratios("1:2:3"), [1.0, 2.0, 3.0])
        self.assertEqual(hetero.ratios("stall"), [1.0, 1.0])

    def test_each_site_schedule_spans_its_share_of_the_corpus(self):
        # 1200 windows of 8 = 150 steps: fixed H splits them evenly, phases in time by speed
        self.assertEqual(hetero.schedule_steps(1200, 8, [1.0, 2.0], timed=False), [75, 75])
        self.assertEqual(hetero.schedule_steps(1200, 8, [1.0, 2.0], timed=True), [100, 50])
        self.assertEqual(hetero.schedule_steps(1000, 8, [1.0, 2.0, 3.0], timed=True), [69, 35, 23])   # rounded up


class SiteFiguresTest(unittest.TestCase):
    ROWS = [phase(1, 110.0, 3.0, 4.0), fed(24, 3.0), phase(2, 114.0, 3.8, 4.0), fed(30, 3.8),
            phase(3, 118.0, 3.2, 4.0), fed(26, 3.2, merged=False), {"split": "train", "time": 111.0}]

    def test_utilisation_is_the_median_phase_and_the_whole_run(self):
        f = hetero.site_figures(self.ROWS, seq_len=100)
        self.assertAlmostEqual(f["util_med"], 0.8)
        self.assertAlmostEqual(f["util_run"], 10.0 / 12.0)
        self.assertAlmostEqual(f["util_mid"], 3.8 / 4.0)         # without the first and the last phase
        self.assertAlmostEqual(f["trip_med"], 0.8)
        self.assertEqual(f["phases"], 3)

    def test_tokens_per_s_over_the_sites_life_and_alone(self):
        f = hetero.site_figures(self.ROWS, seq_len=100)
        self.assertEqual(f["tokens"], 8000)                      # every phase trained, the refused one too
        self.assertEqual((f["start"], f["end"]), (106.0, 118.0))  # the first phase's start: its row less its cycle
        self.assertAlmostEqual(f["tps"], 8000 / 12.0)
        self.assertAlmostEqual(f["solo_tps"], 8000 / 10.0)       # its inner seconds only
        self.assertEqual(f["refused"], 1)

    def test_a_site_without_phases_has_no_figures(self):
        self.assertIsNone(hetero.site_figures([{"split": "train"}], 100))


class FederationFiguresTest(unittest.TestCase):
    def test_merged_tokens_per_wall_second_against_the_sum_of_solo_rates(self):
        sites = {"alpha": {"start": 100.0, "end": 130.0, "solo_tps": 800.0, "refused": 0},
                 "beta": {"start": 101.0, "end": 128.0, "solo_tps": 400.0, "refused": 1}}
        recs = [record(1, 110.0, ["alpha", "beta"], tokens=9000), record(2, 120.0, ["alpha"], tokens=9000),
                record(3, 130.0, ["alpha", "beta"], tokens=6000)]
        f = hetero.federation_figures(recs, sites)
        self.assertEqual(f["wall_s"], 30.0)
        self.assertAlmostEqual(f["tps"], 800.0)
        self.assertAlmostEqual(f["ratio"], 800.0 / 1200.0)
        self.assertEqual((f["partial_rounds"], f["refused"]), (1, 1))
        self.assertEqual((f["head_s"], f["tail_s"]), (1.0, 2.0))


class EqualWallTimeTest(unittest.TestCase):
    RECS = [record(r, 100.0 + 10 * r, ["alpha", "beta"]) for r in range(1, 6)]

    def test_the_last_round_merged_within_the_other_runs_wall_time(self):
        self.assertEqual(hetero.round_at(self.RECS, 100.0, 35.0), 3)
        self.assertEqual(hetero.round_at(self.RECS, 100.0, 30.0), 3)
        self.assertEqual(hetero.round_at(self.RECS, 100.0, 5.0), 0)

    def test_a_round_missed_by_the_snapshots_takes_the_one_before(self):
        snaps = {1: "r1", 2: "r2", 4: "r4"}
        self.assertEqual(hetero.snapshot_for(snaps, 3), (2, "r2"))
        self.assertEqual(hetero.snapshot_for(snaps, 4), (4, "r4"))
        self.assertEqual(hetero.snapshot_for(snaps, 0), (0, None))


class StallTest(unittest.TestCase):
    def rows(self, waits):
        # alpha's phase rows: round r's row is written a little after round r's record
        return [phase(r, 100.0 + 4 * r + 0.2, 3.8, 4.0, wait=w) for r, w in enumerate(waits, start=1)]

    def test_the_other_sites_extra_wait_from_the_stop_until_the_stalled_site_is_merged_again(self):
        # beta stopped at 111 (round 3 open), resumed at 119; rounds 3 and 4 closed on the quorum
        # without it, round 5 has it again; alpha waited 1.0 s in rounds 3-4, 0.3 s in round 5
        recs = [record(1, 104.0, ["alpha", "beta"]), record(2, 108.0, ["alpha", "beta"], toks={"beta": 500}),
                record(3, 112.0, ["alpha"], reason="quorum: 50% ...", waited={"alpha": 1.0}, toks={"alpha": 520}),
                record(4, 116.0, ["alpha"], reason="quorum: 50% ...", waited={"alpha": 1.0}),
                record(5, 120.0, ["alpha", "beta"]), record(6, 124.0, ["alpha", "beta"])]
        s = hetero.stall_figures(self.rows([0.5, 0.1, 1.1, 1.1, 0.4, 0.1]), recs, "alpha", "beta", 111.0, 119.0, 4.0)
        self.assertEqual(s["rounds"], 3)                 # rounds 3, 4, 5: round 5's row came after its record
        self.assertAlmostEqual(s["base_wait_s"], 0.1)    # the first phase (0.5, the start) left out
        self.assertAlmostEqual(s["lost_s"], 1.0 + 1.0 + 0.3)
        self.assertAlmostEqual(s["per_round"], 2.3 / 3 / 4.0)
        self.assertEqual(s["without_victim"], 2)
        self.assertEqual(s["closed_by"], ["quorum", "quorum", "all"])
        self.assertAlmostEqual(s["rec_lost_s"], 0.95 + 0.95 + 0.0)
        self.assertAlmostEqual(s["share"], 520 / (520 + 500))    # alpha's delta against beta's last merged one

    def test_without_the_quorum_one_round_holds_the_whole_stall(self):
        recs = [record(1, 104.0, ["alpha", "beta"]), record(2, 108.0, ["alpha", "beta"], toks={"beta": 520}),
                record(3, 121.0, ["alpha", "beta"], waited={"alpha": 9.0}, toks={"alpha": 480}),
                record(4, 125.0, ["alpha", "beta"])]
        s = hetero.stall_figures(self.rows([0.1, 0.1, 9.1, 0.1]), recs, "alpha", "beta", 111.0, 119.0, 4.0)
        self.assertEqual((s["rounds"], s["without_victim"]), (1, 0))
        self.assertAlmostEqual(s["lost_s"], 9.0)
        self.assertAlmostEqual(s["per_round"], 9.0 / 4.0)
        self.assertAlmostEqual(s["share"], 480 / 1000)           # under 0.5: no quorum would have cut it either


if __name__ == "__main__":
    unittest.main()
