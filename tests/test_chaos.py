"""tests/test_chaos.py - bench/chaos.py's judgement, on real aggregator state (no processes).

The bench itself (two torchrun sites under faults, then an unfaulted run: ~10 minutes at
its --quick size on 2 cores) is not run here; what it concludes from is:
  - its replay of the recorded merges (fedmom_merge.merge_files + publish over the deltas
    fedmom_state.KEEP_DELTAS_ENV kept) gives the aggregator's theta_global bit for bit,
    int4 downstream with error feedback and a clipped delta included, and a changed
    kept delta does not;
  - its goodput accounting: lost work keyed by lease (two deltas of one incarnation may
    share a base round), a killed incarnation's steps counted as killed, a merged delta
    whose site died before learning its outcome counted as merged;
  - its compute utilisation: every incarnation's phase rows summed per site, over the
    seconds the site was up and over the phases' cycles, and the table that puts the
    unfaulted run's row under the chaos run's.
"""
import os
import sys
import unittest

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import chaos  # noqa: E402
import durable  # noqa: E402
import fedmom_state  # noqa: E402
import fixtures  # noqa: E402
import tensorio  # noqa: E402


class ReplayTest(fixtures.FedMomFixture):
    def run_rounds(self):
        kept = os.path.join(self.dir, "kept")
        os.environ[fedmom_state.KEEP_DELTAS_ENV] = kept
        try:
            st = self.state(outer_lr=0.7, outer_momentum=0.9, down_wire="int4")
        finally:
            del os.environ[fedmom_state.KEEP_DELTAS_ENV]
        for c in ("alpha", "beta"):
            st.join(c, f"{c}-inc")
        for rnd in range(4):
            # round 3: beta's delta is 100 x the others, so the robust rule clips it
            self.send(st, "alpha", self.delta("F32")[0], 3000 + rnd)
            self.send(st, "beta", self.delta("F32", scale=1.0 if rnd == 3 else 0.01)[0], 5000)
            self.assertEqual(st.tick()["round"], rnd + 1)
        records = durable.read_jsonl(os.path.join(st.dir, "rounds.jsonl"))
        self.assertTrue(records[-1]["clip"]["clipped"], "the test needs a clipped delta")
        return st, kept, records

    def test_the_replay_of_the_recorded_merges_is_the_aggregators_theta_bit_for_bit(self):
        st, kept, records = self.run_rounds()
        codec = st.cfg.down_codec()
        final, problems, thetas, residual = chaos.replay_theta(self.init, st.dir, kept, records,
                                                     os.path.join(self.dir, "replay"), codec)
        self.assertEqual(problems, [])
        self.assertEqual(len(thetas), 4)
        ok, detail = chaos.same_bits(final, os.path.join(st.dir, st.theta_file))
        self.assertTrue(ok, detail)
        ok, detail = chaos.same_bits(residual, chaos.final_files(st.dir, self.dir)[1])
        self.assertTrue(ok, f"the aggregator's residual: {detail}")

    def test_a_changed_kept_delta_breaks_the_replay(self):
        st, kept, records = self.run_rounds()
        victim = os.path.join(kept, records[1]["outcomes"][0]["delta"] + ".safetensors")
        with tensorio.TensorReader(victim) as r:
            arrays = {n: r.read(n, as_float32=True).copy() for n in r.names}
        first = next(iter(arrays))
        arrays[first].reshape(-1)[0] += 1e-5          # below int4's step: it shows in the residual, if not in theta
        os.unlink(victim)                                   # a hard link: write a new file, not through it
        fixtures.write_tensors(victim, arrays, "F32")
        final, _, _, residual = chaos.replay_theta(self.init, st.dir, kept, records,
                                                   os.path.join(self.dir, "replay"), st.cfg.down_codec())
        same = [chaos.same_bits(final, os.path.join(st.dir, st.theta_file))[0],
                chaos.same_bits(residual, chaos.final_files(st.dir, self.dir)[1])[0]]
        self.assertFalse(all(same), "a changed delta replayed to the same theta and residual")

    def test_a_merged_delta_never_kept_is_said(self):
        st, kept, records = self.run_rounds()
        os.unlink(os.path.join(kept, records[2]["outcomes"][1]["delta"] + ".safetensors"))
        final, problems, _, _ = chaos.replay_theta(self.init, st.dir, kept, records, os.path.join(self.dir, "replay"),
                                                st.cfg.down_codec())
        self.assertIsNone(final)
        self.assertIn("round 3", problems[-1])


def train_rows(inc, steps, ms=100.0, tokens_per_step=1000):
    return [{"split": "train", "incarnation": inc, "step": s, "step_ms": ms,
             "tokens_per_s": tokens_per_step / (ms / 1e3)} for s in steps]


class GoodputTest(unittest.TestCase):
    def test_lost_work_goes_where_it_went(self):
        # alpha: incarnation a1 trains phases of 2 steps on leases 1, 2, 3 (1 merged; 2 lease lost, then 3
        # on the SAME base round, merged), then 1 step of a phase and is killed; a2 sends lease 5, dies
        # before its outcome, and the aggregator merges it anyway; beta: lease 4 refused stale.
        fed = lambda inc, lease, base, step, reason=None: {
            "split": "federation", "incarnation": inc, "lease": lease, "base_round": base, "step": step,
            "steps": 2, "tokens": 2000, "inner_s": 0.25, "merged": reason is None, "reason": reason}
        rows = {"alpha": train_rows("a1", range(1, 8)) + [
                    fed("a1", 1, 0, 2), fed("a1", 2, 1, 4, "lease lost at DARL before the send: ..."),
                    fed("a1", 3, 1, 6)] + train_rows("a2", (7, 8)),
                "beta": train_rows("b1", (1, 2)) + [fed("b1", 4, 0, 2, "stale: round 0 is closed")]}
        out = lambda inc, lease, base: {"cluster": "beta" if inc == "b1" else "alpha", "incarnation": inc,
                                        "base_round": base, "tokens": 2000, "outcome": "merged",
                                        "leases": [{"id": lease}]}
        records = [{"round": 1, "clusters": {"alpha": {"incarnation": "a1", "inner_s": 0.25}},
                    "outcomes": [out("a1", 1, 0)]},
                   {"round": 2, "clusters": {"alpha": {"incarnation": "a1", "inner_s": 0.25}},
                    "outcomes": [out("a1", 3, 1)]},
                   {"round": 3, "clusters": {"alpha": {"incarnation": "a2", "inner_s": 0.2}},
                    "outcomes": [out("a2", 5, 2)]}]
        g = chaos.goodput(records, rows)
        self.assertEqual(g["merged_deltas"], 3)
        self.assertAlmostEqual(g["trained_tokens"], 11000)
        self.assertAlmostEqual(g["merged_tokens"], 6000)
        self.assertAlmostEqual(g["merged_s"], 0.2 + 0.2 + 0.2)       # steps' own times; a2's from its record
        self.assertAlmostEqual(g["trained_s"], 1.1)
        lost = {k: [round(x, 6) for x in v] for k, v in g["lost"].items()}
        self.assertEqual(lost["lease lost"], [2000, 0.2])
        self.assertEqual(lost["stale"], [2000, 0.2])
        self.assertEqual(lost["killed"], [1000, 0.1])              # a1's step 7
        self.assertAlmostEqual(g["token_goodput"], 6000 / 11000)
        self.assertTrue(np.isclose(sum(v[0] for v in g["lost"].values()) + g["merged_tokens"], g["trained_tokens"]))
        self.assertEqual(g["told_merged_missing"], [])
        records[1]["outcomes"] = []                      # a merge a site was told of, not in the records
        self.assertEqual(chaos.goodput(records, rows)["told_merged_missing"], ["alpha a1 lease 3"])


class UtilisationTest(unittest.TestCase):
    def test_inner_seconds_over_up_seconds_and_over_cycles_per_site(self):
        phase = lambda inc, inner, cycle: {"split": "phase", "incarnation": inc, "inner_s": inner, "cycle_s": cycle}
        rows = {"alpha": train_rows("a1", (1, 2)) + [phase("a1", 3.0, 4.0), phase("a1", 2.0, 5.0),
                                                      phase("a2", 1.0, 2.0)],
                "beta": train_rows("b1", (1,))}            # killed before a phase ended: no phase row
        u = chaos.utilisation(rows, {"alpha": 20.0, "beta": 6.0})
        self.assertEqual(u["alpha"]["phases"], 3)
        self.assertAlmostEqual(u["alpha"]["of_up"], 6.0 / 20.0)
        self.assertAlmostEqual(u["alpha"]["of_cycles"], 6.0 / 11.0)
        self.assertAlmostEqual(u["alpha"]["median"], 0.5)              # of 0.75, 0.4 and 0.5
        self.assertEqual((u["beta"]["phases"], u["beta"]["of_up"], u["beta"]["of_cycles"], u["beta"]["median"]),
                         (0, 0.0, None, None))
        lines = chaos.util_lines(u, chaos.utilisation(rows, {"alpha": 8.0}))
        alpha = [line.split() for line in lines if line.split()[:1] == ["alpha"]]
        self.assertEqual([r[1] for r in alpha], ["chaos", "unfaulted"])
        self.assertEqual([r[5] for r in alpha], ["30.0%", "75.0%"])     # inner/up: 6 s of 20 s, of 8 s
        self.assertEqual(alpha[0][7], "54.5%")                          # inner/cycles: 6 s of 11 s
        beta = [line.split() for line in lines if line.split()[:1] == ["beta"]]
        self.assertEqual(beta[1][5], "-")                               # the unfaulted run never saw it up


if __name__ == "__main__":
    unittest.main()
