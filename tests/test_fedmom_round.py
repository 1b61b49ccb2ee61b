"""fedmom_round: the aggregator's protocol core alone - no files, no sockets, no threads,
`now` and `wall` passed in. Membership, what the open round accepts, when it closes (its
phases), every custody step and the steps it refuses, what is owed to DARL and counted,
fencing, the durable part saved and put back, and a replay: the same calls twice give the
same books, replies and log lines. (tests/test_fedmom.py and tests/test_custody.py run the
same protocol through FedMomState with its files, merges and a real DARL.)"""
import itertools
import os
import subprocess
import sys
import unittest

import fedmom_round
from fedmom_round import OK, REFUSED, Answer, Custody, IllegalMove, Phase, Refused, RoundTable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
T0, WALL0 = 1000.0, 1.7e9


def stats(batch, update=None):
    """What a merge of `batch` reports (outer_state.OuterKeeper.merge), with made-up numbers."""
    n = len(batch)
    return {"weights": [1 / n] * n, "scales": [1.0] * n, "delta_norms": [0.5] * n, "theta_norm": 10.0,
            "merge_s": 0.25, "clip": {"factor": 10.0, "limit": None, "clipped": []}, "momentum_reset": None,
            "update": update, "outer_lr": 0.7, "outer_momentum": 0.9, "bytes_read": 100, "bytes_written": 200}


class Table:
    """A RoundTable driven the way FedMomState drives it, minus the files: deltas are admitted
    as if spooled, custody answers are handed in. Every reply and log line is kept."""

    def __init__(self, custody=True, members=("lumi", "snellius"), deadline_s=100.0, timeout_s=60.0, **rule):
        self.said, self.now, self.wall = [], T0, WALL0
        self.t = RoundTable(timeout_s, deadline_s, custody=custody, say=self.said.append, **rule)
        self.t.books.aggregator = "fedmom-test"
        self.t.started(self.now)
        self.n = 0
        for c in members:
            self.t.join(c, f"{c}-inc", self.now, self.wall)

    def tick(self, s):
        self.now += s
        self.wall += s

    def send(self, cluster, tokens=10, leases=None, base_round=None, metrics=None):
        meta = self.t.check_delta({"cluster": cluster, "incarnation": f"{cluster}-inc", "tokens": tokens,
                                   "base_round": self.t.round if base_round is None else base_round,
                                   "leases": [{"id": 7, "start": 0, "end": 5}] if leases is None else leases,
                                   "metrics": metrics}, self.now, self.wall)
        self.n += 1
        p = self.t.new_pending(meta, f"{self.n:04d}", f"/spool/{cluster}.safetensors", f"/spool/{cluster}.json",
                               1000, 0.5, 0.01, self.wall)
        self.t.admit(p, self.now)
        self.t.asked(p)
        return p

    def held(self, p, start=0, end=5):
        return self.t.custody_held(p, [[7, start, end]])

    def merge(self):
        """close, finish, opened: a round with nothing left out -> its record."""
        batch, late, closed_at = self.t.close(self.now)
        rec = self.t.finish(batch, stats(batch), "test", late, closed_at, self.wall)
        self.t.opened(rec, self.now)
        return rec


class MembershipTest(unittest.TestCase):
    def test_one_live_incarnation_per_cluster_until_the_old_one_is_silent(self):
        x = Table(members=("lumi",))
        with self.assertRaises(Refused) as cm:
            x.t.join("lumi", "lumi-2", x.now, x.wall)
        self.assertEqual((cm.exception.status, cm.exception.extra["code"]), (409, "incarnation_conflict"))
        self.assertEqual(cm.exception.extra["retry_after_s"], 60.0)
        x.tick(61)                                  # silent past --member-timeout-s: dropped, the new one joins
        self.assertEqual(x.t.join("lumi", "lumi-2", x.now, x.wall)["members"], ["lumi"])
        self.assertEqual([d["cluster"] for d in x.t.dropped], ["lumi"])
        self.assertEqual([e["event"] for e in x.t.roster.events], ["join", "drop", "join"])
        with self.assertRaises(Refused) as cm:
            x.t.heartbeat("lumi", "lumi-inc", x.now)
        self.assertEqual(cm.exception.extra["code"], "stale_incarnation")
        with self.assertRaises(Refused) as cm:
            x.t.heartbeat("beta", "beta-inc", x.now)
        self.assertEqual(cm.exception.extra["code"], "not_member")
        with self.assertRaises(Refused) as cm:
            x.t.join("../x", "i", x.now, x.wall)
        self.assertEqual(cm.exception.status, 400)

    def test_joins_leaves_and_drops_are_durable_changes_heartbeats_are_not(self):
        x = Table(members=())
        c0 = x.t.changes
        x.t.join("lumi", "lumi-inc", x.now, x.wall)
        self.assertEqual(x.t.changes, c0 + 1)
        x.t.join("lumi", "lumi-inc", x.now, x.wall)
        x.t.heartbeat("lumi", "lumi-inc", x.now, {"loss": 2.5, "junk": 1})
        self.assertEqual(x.t.changes, c0 + 1)
        self.assertEqual(x.t.members["lumi"].metrics, {"loss": 2.5})
        self.assertEqual(x.t.leave("lumi", "lumi-inc", x.wall), {"round": 0, "left": True})
        self.assertEqual(x.t.changes, c0 + 2)
        self.assertEqual(x.t.to_json()["members"], {})

    def test_a_failed_save_puts_the_books_back(self):
        x = Table(members=("lumi",))
        mark, before, changes = x.t.mark(), x.t.to_json(), x.t.changes
        x.t.join("snellius", "snellius-inc", x.now, x.wall)
        x.t.leave("lumi", "lumi-inc", x.wall)
        x.t.books.owe_abort("r0.x", "lumi", "lumi-inc", "why", x.wall)
        x.t.rewind(mark)
        self.assertEqual(x.t.to_json(), before)
        self.assertEqual(x.t.changes, changes)

    def test_a_reconciliation_whose_save_failed_runs_again_and_owes_the_same(self):
        x = Table()
        held = [{"delta": "r0.lost", "cluster": "gone", "incarnation": "gone-inc", "blocks": 3}]
        mark = x.t.mark()
        x.t.reconcile(held, x.wall)
        self.assertTrue(x.t.reconciled)
        x.t.rewind(mark)
        self.assertEqual((x.t.reconciled, x.t.books.aborts), (False, []))
        x.t.reconcile(held, x.wall)
        self.assertEqual([a["delta"] for a in x.t.books.aborts], ["r0.lost"])


class AcceptanceTest(unittest.TestCase):
    def test_what_the_open_round_refuses(self):
        x = Table()
        for meta, status, code in (({"base_round": 3}, 409, "stale_round"),
                                   ({"leases": []}, 400, None),        # custody needs the leases
                                   ({"tokens": -1}, 400, None)):
            with self.subTest(meta=meta), self.assertRaises(Refused) as cm:
                x.send("lumi", **{"tokens": 10, **meta})
            self.assertEqual((cm.exception.status, cm.exception.extra.get("code")), (status, code))
        self.assertEqual(x.t.pending, {})
        p = x.send("lumi")
        dup = x.t.duplicate({"cluster": "lumi", "incarnation": "lumi-inc"})
        self.assertEqual(dup, {"accepted": True, "duplicate": True, "round": 0, "custody": p.custody})
        x.held(p)
        x.send("snellius")
        x.t.custody_held(x.t.pending[("snellius", "snellius-inc")], [[8, 5, 9]])
        x.t.close(x.now)
        with self.assertRaises(Refused) as cm:                              # closed: the next round
            x.t.check_current({"cluster": "lumi", "incarnation": "lumi-inc", "base_round": 0}, x.now)
        self.assertEqual(cm.exception.extra["code"], "stale_round")

    def test_a_zero_token_delta_is_refused_and_counts_as_the_answer(self):
        x = Table(custody=False)
        x.send("lumi")
        with self.assertRaises(Refused) as cm:
            x.send("snellius", tokens=0)
        self.assertEqual((cm.exception.status, cm.exception.extra["code"]), (400, "bad_delta"))
        self.assertEqual(x.t.ready(x.now), "every live member sent its delta")
        rec = x.merge()
        self.assertEqual([(o["cluster"], o["outcome"]) for o in rec["outcomes"]],
                         [("lumi", "merged"), ("snellius", "excluded")])

    def test_a_fenced_process_takes_no_delta(self):
        x = Table()
        x.t.books.stop("a newer process of this aggregator runs")
        with self.assertRaises(Refused) as cm:
            x.send("lumi")
        self.assertEqual(cm.exception.status, 503)


class PhaseTest(unittest.TestCase):
    def test_a_round_closes_when_everyone_answered_or_at_the_deadline(self):
        x = Table(custody=False, deadline_s=100.0)
        self.assertEqual(x.t.phase(x.now), Phase.EMPTY)
        x.send("lumi")
        self.assertEqual(x.t.phase(x.now), Phase.COLLECTING)
        x.tick(99.9)
        self.assertIsNone(x.t.ready(x.now))
        x.tick(0.1)
        self.assertEqual(x.t.ready(x.now), "deadline of 100 s passed without ['snellius']")
        batch, late, _ = x.t.close(x.now)
        self.assertEqual(([p.cluster for p in batch], late, x.t.phase(x.now)), (["lumi"], ["snellius"], Phase.MERGING))

    def test_the_round_waits_for_custody_past_its_deadline_and_for_the_reconciliation(self):
        x = Table()
        p, q = x.send("lumi"), x.send("snellius")
        x.held(q)
        x.tick(10_000)                                      # far past the deadline
        self.assertEqual(x.t.phase(x.now), Phase.WAITING_CUSTODY)
        self.assertEqual(x.t.custody_waiting(), ["lumi"])
        with self.assertRaises(IllegalMove):
            x.t.close(x.now)
        x.held(p)
        self.assertEqual(x.t.phase(x.now), Phase.READY)
        y = Table()                                         # a start: a confirmed delta from the spool
        r = x.t.pending[("lumi", "lumi-inc")]
        y.t.restore(r, y.now)
        self.assertEqual(y.t.phase(y.now), Phase.WAITING_RECONCILE)
        self.assertEqual(y.t.reconcile([{"delta": r.delta_id}], y.wall), [])
        self.assertEqual(y.t.phase(y.now), Phase.COLLECTING)

    def test_a_failed_merge_backs_off_and_a_fenced_process_never_merges(self):
        x = Table(custody=False, members=("lumi",))
        x.send("lumi")
        x.t.close(x.now)
        x.t.merge_failed(x.now)
        self.assertEqual(x.t.phase(x.now), Phase.BACKING_OFF)
        x.tick(fedmom_round.MERGE_RETRY_S)
        self.assertEqual(x.t.phase(x.now), Phase.READY)
        x.t.books.stop("fenced")
        self.assertEqual(x.t.phase(x.now), Phase.FENCED)


class QuorumTest(unittest.TestCase):
    """--quorum, --grace-frac, --phase-s: a round closes a grace after the deltas that arrived
    hold Q of the tokens it expects, never earlier, and not at all without the history to expect from."""

    def table(self, members=("alpha", "beta"), **rule):
        return Table(custody=False, members=members, **{"quorum": 0.5, "grace_frac": 0.2, "phase_s": 10.0, **rule})

    def full_round(self, x, tokens, length_s=1.0):
        """Every member sends (tokens: cluster -> tokens), `length_s` after the round opened -> its record."""
        x.tick(length_s)
        for c, n in tokens.items():
            x.send(c, tokens=n)
        return x.merge()

    def test_quorum_reached_closes_the_round_once_the_grace_passed(self):
        x = self.table()
        self.full_round(x, {"alpha": 8192, "beta": 4096})
        self.assertEqual(x.t.history.grace_s(x.t.q.grace_frac, x.t.q.phase_s), 2.0)                      # 0.2 x --phase-s: fewer than 3 records
        x.tick(1)
        x.send("alpha", tokens=8192)                              # 8192 of 8192 + 4096 expected: 67%
        self.assertEqual(x.t.quorum_at, x.now)
        x.tick(1.999)
        self.assertEqual((x.t.phase(x.now), x.t.ready(x.now)), (Phase.COLLECTING, None))
        x.tick(0.001)
        self.assertEqual(x.t.ready(x.now), "quorum: 67% of the 12,288 tokens expected arrived; "
                                           "grace 2 s passed without ['beta']")
        rec = x.merge()
        self.assertEqual((rec["late"], rec["quorum"]),
                         (["beta"], {"fraction": 0.5, "grace_s": 2.0, "expected_tokens": 12288}))
        self.assertEqual((rec["clusters"]["alpha"]["arrived_s"], rec["clusters"]["alpha"]["waited_s"]), (1.0, 2.0))
        self.assertEqual(rec["period_s"], 3.0)                    # close to close
        self.assertIsNone(x.t.quorum_at, "a new round counts its quorum anew")
        with self.assertRaises(Refused) as cm:                    # beta's delta for the merged round
            x.send("beta", tokens=4096, base_round=1)
        self.assertEqual(cm.exception.extra["code"], "stale_round")

    def test_below_the_quorum_the_round_waits_for_the_deadline(self):
        x = self.table(quorum=0.7)
        self.full_round(x, {"alpha": 8192, "beta": 4096})
        x.send("alpha", tokens=8192)                              # 67% < 70%
        x.tick(99.9)
        self.assertIsNone(x.t.quorum_at)
        self.assertEqual(x.t.phase(x.now), Phase.COLLECTING)
        x.tick(0.1)
        self.assertIn("deadline of 100 s passed", x.t.ready(x.now))

    def test_quorum_1_never_closes_early(self):
        x = self.table(quorum=1.0)
        self.full_round(x, {"alpha": 8192, "beta": 4096})
        x.send("alpha", tokens=100_000)                           # far more than expected: still waits
        x.tick(99.9)
        self.assertEqual((x.t.phase(x.now), x.t.quorum_view()), (Phase.COLLECTING, None))
        x.tick(0.1)
        self.assertEqual(x.merge()["quorum"], None)

    def test_no_history_no_early_close(self):
        x = self.table()
        x.send("alpha", tokens=8192)
        x.tick(99.9)
        self.assertEqual((x.t.history.expected_tokens(x.t.members), x.t.quorum_view(), x.t.phase(x.now)), (None, None, Phase.COLLECTING))
        y = self.table(phase_s=None)                              # history but no grace known yet
        for _ in range(2):
            self.full_round(y, {"alpha": 8192, "beta": 4096})
        y.send("alpha", tokens=8192)
        y.tick(99.9)
        self.assertEqual((y.t.history.grace_s(y.t.q.grace_frac, y.t.q.phase_s), y.t.phase(y.now)), (None, Phase.COLLECTING))

    def test_a_member_that_left_does_not_count(self):
        x = self.table(members=("alpha", "beta", "gamma"))
        self.full_round(x, {"alpha": 4096, "beta": 4096, "gamma": 8192})
        x.send("alpha", tokens=4096)                              # 4096 of 16384: 25%
        x.tick(5)
        self.assertEqual((x.t.phase(x.now), x.t.quorum_at), (Phase.COLLECTING, None))
        x.t.leave("gamma", "gamma-inc", x.wall)                   # 4096 of 8192: 50%
        self.assertEqual(x.t.phase(x.now), Phase.COLLECTING)
        self.assertEqual(x.t.quorum_at, x.now)
        x.tick(2)
        self.assertEqual(x.t.ready(x.now), "quorum: 50% of the 8,192 tokens expected arrived; "
                                           "grace 2 s passed without ['beta']")

    def test_a_quorum_lost_is_counted_anew(self):
        x = self.table()
        self.full_round(x, {"alpha": 8192, "beta": 4096})
        x.send("alpha", tokens=8192)
        x.tick(1)
        x.t.join("gamma", "gamma-inc", x.now, x.wall)             # expected 6144 more: 8192 of 18432
        self.assertEqual((x.t.phase(x.now), x.t.quorum_at), (Phase.COLLECTING, None))
        x.t.leave("gamma", "gamma-inc", x.wall)
        x.tick(1)
        self.assertEqual((x.t.phase(x.now), x.t.quorum_at), (Phase.COLLECTING, x.now))
        x.tick(2)
        self.assertEqual(x.t.phase(x.now), Phase.READY)

    def test_expected_tokens_come_from_the_last_merged_delta_and_a_newcomer_gets_the_mean(self):
        x = self.table()
        self.full_round(x, {"alpha": 8192, "beta": 4096})
        self.full_round(x, {"alpha": 1000, "beta": 4096})
        x.t.join("gamma", "gamma-inc", x.now, x.wall)
        self.assertEqual(x.t.history.expected_tokens(x.t.members), {"alpha": 1000, "beta": 4096, "gamma": 2548.0})
        x.send("beta", tokens=4096)
        view = x.t.quorum_view()
        self.assertEqual((view["expected_tokens"], view["arrived_tokens"]), (4096 + 1000 + 2548, 4096))

    def test_the_grace_is_a_fraction_of_the_median_round_once_three_merged(self):
        x = self.table(grace_frac=0.5)
        for length in (10.0, 30.0, 20.0):
            self.assertEqual(x.t.history.grace_s(x.t.q.grace_frac, x.t.q.phase_s), 5.0)                  # 0.5 x --phase-s until 3 records
            self.full_round(x, {"alpha": 8192, "beta": 4096}, length_s=length)
        self.assertEqual(x.t.history.grace_s(x.t.q.grace_frac, x.t.q.phase_s), 0.5 * 20.25)              # wall_s 20 + merge_s 0.25
        self.full_round(x, {"alpha": 8192, "beta": 4096}, length_s=40.0)
        self.assertEqual(x.t.history.grace_s(x.t.q.grace_frac, x.t.q.phase_s), 0.5 * 25.25)              # the median of four: (20.25 + 30.25) / 2

    def test_a_reopened_round_counts_its_quorum_anew(self):
        x = self.table()
        self.full_round(x, {"alpha": 8192, "beta": 4096})
        p = x.send("alpha", tokens=8192)
        x.tick(2)
        x.t.close(x.now)
        x.t.drop_at_merge(p, "not finite", x.wall)                # nothing left to merge
        x.t.reopen()
        self.assertIsNone(x.t.quorum_at)

    def test_replies_say_how_old_the_round_is_and_whom_it_waits_on(self):
        x = self.table()
        self.assertEqual(x.t.join("alpha", "alpha-inc", x.now, x.wall)["phase_s"], 10.0)
        self.assertIsNone(Table(members=("a",)).t.join("a", "a-inc", T0, WALL0)["phase_s"])
        x.tick(1.5)
        x.send("alpha")
        reply = x.t.reply("alpha", x.now)
        self.assertEqual((reply["round_age_s"], reply["waiting_on"], reply["sent"]), (1.5, ["beta"], True))
        x.send("beta")
        x.t.close(x.now)
        self.assertEqual(x.t.reply("beta", x.now)["waiting_on"], [])
        st = fedmom_round.round_status(x.t, x.now)
        self.assertEqual((st["phase_s"], st["quorum"]), (10.0, None))        # no history yet

    def test_a_restored_delta_arrived_at_the_start(self):
        x = self.table()
        p = x.send("alpha")
        x.tick(5)
        y = self.table()
        y.t.restore(p, y.now)
        y.t.started(y.now)
        y.send("beta")
        y.tick(1)
        rec = y.merge()
        self.assertEqual((rec["clusters"]["alpha"]["arrived_s"], rec["clusters"]["alpha"]["waited_s"]), (0.0, 1.0))
        self.assertIsNone(rec["period_s"], "the first round of a process")

    def test_phase_metrics_are_kept_and_ended_by_names_what_it_may_be(self):
        x = self.table()
        metrics = {"steps": 120, "step_s": 0.5, "budget_s": 60, "cycle_s": 75.5, "util": 0.8, "wait_s": 15.5,
                   "ended_by": "clock"}
        kept = {**{k: float(v) for k, v in metrics.items() if k != "ended_by"}, "ended_by": "clock"}
        for bad, says in (({"ended_by": "tired"}, "metrics.ended_by must be one of clock, lease, data, steps"),
                          ({"ended_by": 3}, "metrics.ended_by must be one of"),
                          ({"util": "high"}, "metrics.util must be a finite number"),
                          ({"inner_s": 10 ** 400}, "metrics.inner_s must be a finite number")):
            with self.subTest(bad=bad), self.assertRaises(Refused) as cm:
                x.send("alpha", metrics=bad)
            self.assertEqual(cm.exception.status, 400)
            self.assertIn(says, cm.exception.reason)
        m = x.t.heartbeat("alpha", "alpha-inc", x.now, {**metrics, "ended_by": "tired", "junk": 1, "util": True,
                                                        "wait_s": 10 ** 400})
        self.assertEqual(m.metrics, {k: v for k, v in kept.items() if k not in ("ended_by", "util", "wait_s")})
        x.t.heartbeat("alpha", "alpha-inc", x.now, metrics)
        self.assertEqual(x.t.members["alpha"].metrics, kept)
        self.assertEqual(x.send("alpha", metrics=metrics).metrics, kept)
        x.send("beta")
        self.assertEqual({k: v for k, v in x.merge()["clusters"]["alpha"].items() if k in kept}, kept)


class CustodyTest(unittest.TestCase):
    def test_every_step_of_the_table_and_nothing_else(self):
        states = [v for k, v in vars(Custody).items() if k.isupper()]
        self.assertEqual(len(states), 8)
        for a, b in itertools.product(states, states):
            with self.subTest(f"{a} -> {b}"):
                if b in fedmom_round.CUSTODY_MOVES.get(a, ()):
                    self.assertEqual(fedmom_round.move(a, b), b)
                else:
                    with self.assertRaises(IllegalMove) as cm:
                        fedmom_round.move(a, b)
                    self.assertIn(f"{a} -> {b} is not a step of the protocol", str(cm.exception))

    def test_unconfirmed_to_confirmed_to_commit_owed_to_committed(self):
        x = Table(members=("lumi",))
        p = x.send("lumi")
        self.assertEqual(p.custody, Custody.UNCONFIRMED)
        self.assertTrue(x.held(p, 0, 5))
        self.assertEqual((p.custody, p.pieces), (Custody.CONFIRMED, [[7, 0, 5]]))
        rec = x.merge()
        self.assertEqual(p.custody, Custody.COMMIT_OWED)
        owed = x.t.books.commits
        self.assertEqual([(c["delta"], c["round"], c["blocks"]) for c in owed], [(p.delta_id, 1, 5)])
        self.assertEqual(rec["outcomes"][0]["pieces"], [[7, 0, 5]])
        x.t.books.settle("commit", owed[0], Answer(OK, {"state": "committed"}))
        self.assertEqual((x.t.books.commits, x.t.books.violations["refused_commits"]), ([], 0))

    def test_a_refused_commit_is_counted(self):
        x = Table(members=("lumi",))
        x.held(x.send("lumi"))
        x.merge()
        c = x.t.books.commits[0]
        x.t.books.settle("commit", c, Answer(REFUSED, {"code": "custody_aborted", "error": "aborted", "blocks": 5}))
        self.assertEqual({k: v for k, v in x.t.books.violations.items() if v},
                         {"refused_commits": 1, "blocks_trained_twice": 5})
        self.assertIn("DARL REFUSED the commit", x.said[-1])

    def test_unconfirmed_to_refused_at_upload_and_later(self):
        x = Table()
        p, q = x.send("lumi"), x.send("snellius")
        self.assertTrue(x.t.custody_refused(p, "lease lost", at_upload=True, wall=x.wall))
        self.assertEqual((p.custody, x.t.excluded), (Custody.REFUSED, []))      # the upload's 409 says it
        self.assertTrue(x.t.custody_refused(q, "lease lost", at_upload=False, wall=x.wall))
        self.assertEqual([e["cluster"] for e in x.t.excluded], ["snellius"])
        self.assertEqual((x.t.pending, x.t.books.aborts, x.t.first_delta_at), ({}, [], None))
        self.assertFalse(x.t.custody_refused(q, "again", at_upload=False, wall=x.wall), "gone already")
        with self.assertRaises(IllegalMove):                        # refused is final
            fedmom_round.move(q.custody, Custody.CONFIRMED)

    def test_excluded_deltas_owe_an_abort_whatever_their_custody_and_aborts_are_counted(self):
        x = Table(members=("lumi", "snellius", "c"))
        p, q, r = x.send("lumi"), x.send("snellius"), x.send("c")
        x.held(q)
        x.held(r, 5, 9)
        x.t.exclude_spooled(p, "its spooled file is damaged", x.wall)       # unconfirmed -> abort_owed
        batch, late, closed_at = x.t.close(x.now)
        x.t.drop_at_merge(q, "not finite", x.wall)                          # confirmed -> abort_owed
        self.assertEqual((p.custody, q.custody), (Custody.ABORT_OWED, Custody.ABORT_OWED))
        self.assertEqual([a["delta"] for a in x.t.books.aborts], [p.delta_id, q.delta_id])
        rec = x.t.finish([r], stats([r]), "test", late, closed_at, x.wall)
        x.t.opened(rec, x.now)
        self.assertEqual(sorted((o["cluster"], o["outcome"]) for o in rec["outcomes"]),
                         [("c", "merged"), ("lumi", "excluded"), ("snellius", "excluded")])
        books = x.t.books
        books.settle("abort", books.aborts[0], Answer(OK, {"state": "aborted", "returned": 5}))
        books.settle("abort", books.aborts[0], Answer(REFUSED, {"code": "custody_committed", "error": "committed"}))
        self.assertEqual((books.aborts, books.violations["aborted_custody"], books.violations["refused_aborts"]),
                         ([], 1, 1))

    def test_a_round_with_an_unconfirmed_delta_is_never_finished(self):
        """The round rule, as a refusal of its own: even a caller that skips ready() cannot merge
        a delta whose custody DARL never confirmed; nothing changes."""
        x = Table(members=("lumi",))
        p = x.send("lumi")
        before, changes = x.t.to_json(), x.t.changes
        with self.assertRaises(IllegalMove) as cm:
            x.t.finish([p], stats([p]), "test", [], x.now, x.wall)
        self.assertIn("unconfirmed -> commit_owed", str(cm.exception))
        self.assertEqual((x.t.to_json(), x.t.changes, p.custody), (before, changes, Custody.UNCONFIRMED))
        x.held(p)
        with self.assertRaises(IllegalMove):                # confirmed twice: no such step
            x.held(p)

    def test_reconcile_excludes_what_darl_no_longer_holds_and_aborts_what_we_no_longer_name(self):
        x = Table()
        p, q = x.send("lumi"), x.send("snellius")
        x.held(p)
        x.held(q, 5, 9)
        y = Table()                                         # a start with both restored
        for d in (p, q):
            y.t.restore(d, y.now)
        held = [{"delta": p.delta_id, "cluster": "lumi", "incarnation": "lumi-inc", "blocks": 5},
                {"delta": "r0.lost", "cluster": "gone", "incarnation": "gone-inc", "blocks": 3}]
        gone = y.t.reconcile(held, y.wall)
        self.assertEqual([d.cluster for d in gone], ["snellius"])
        self.assertEqual((q.custody, list(y.t.pending)), (Custody.REFUSED, [("lumi", "lumi-inc")]))
        self.assertIn("no longer holds", y.t.excluded[0]["why"])
        self.assertEqual([a["delta"] for a in y.t.books.aborts], ["r0.lost"])
        self.assertTrue(y.t.reconciled)

    def test_positions_merged_twice_are_counted_from_our_own_records(self):
        x = Table(members=("lumi",))
        x.held(x.send("lumi"), 0, 5)
        x.merge()
        x.held(x.send("lumi"), 3, 8)                        # DARL forgot: positions 3, 4 again
        x.merge()
        self.assertEqual(x.t.books.violations["blocks_trained_twice"], 2)
        self.assertIn("trained twice", x.said[-1])
        y = Table(members=("lumi",))                        # a start reads the records back
        lost = y.t.restore_records(list(x.t.history.records))
        self.assertIsNone(lost)
        self.assertEqual(y.t.history.trained_twice({"outcomes": [{"outcome": "merged", "pieces": [[1, 7, 9]]}]}), 1)


class FenceTest(unittest.TestCase):
    def test_the_claim_and_the_issued_epoch_are_durable_changes_and_another_space_stops(self):
        b = Table().t.books
        c0 = b.changes
        self.assertEqual(b.fence_request("claim-1"), (0, "claim-1", None))
        self.assertEqual(b.fence_request("claim-2"), (0, "claim-1", None), "the claim in flight is repeated")
        self.assertEqual(b.changes, c0 + 1)
        self.assertTrue(b.fence_issued(1, "space-a", "proc-1", "darl"))
        self.assertEqual((b.epoch, b.holder, b.fence_claim, b.darl_digest), (1, "proc-1", None, "space-a"))
        self.assertEqual(b.shown_epoch(custody=True), 0, "not confirmed yet: the epoch the state had")
        b.fence_confirmed(held=2)
        self.assertEqual(b.shown_epoch(custody=True), 1)
        b.not_fenced(Answer(REFUSED, {"code": "not_fenced"}))
        self.assertFalse(b.epoch_held)
        self.assertFalse(b.fence_issued(2, "space-b", "proc-1", "http://darl"))
        self.assertIn("leases block space space-b", b.fenced)
        self.assertEqual(b.epoch, 1)

    def test_silence_raises_the_alarm_and_an_answer_lowers_it(self):
        b = Table().t.books
        b.silent("commit", "HTTP 503", WALL0)
        b.silent("commit", "HTTP 503", WALL0 + 1)
        self.assertEqual((b.alarm["calls"], b.alarm["since"]), (2, WALL0))
        b.heard()
        self.assertIsNone(b.alarm)


class ReplayTest(unittest.TestCase):
    def script(self):
        """A run of rounds through every kind of call -> (the books, what each call returned, the log)."""
        x, out = Table(members=("lumi", "snellius", "c")), []
        for rnd in range(3):
            p, q = x.send("lumi", tokens=10 + rnd), x.send("snellius", tokens=30)
            out.append(x.held(p, 5 * rnd, 5 * rnd + 5))
            out.append(x.t.custody_refused(q, "lease lost", at_upload=rnd == 0, wall=x.wall) if rnd < 2
                       else x.held(q, 100, 104))
            x.tick(30)
            x.t.heartbeat("lumi", "lumi-inc", x.now)
            x.t.heartbeat("snellius", "snellius-inc", x.now)
            out.append((x.t.phase(x.now), x.t.ready(x.now)))
            x.tick(71)                                      # c silent: dropped; the deadline passed
            x.t.heartbeat("lumi", "lumi-inc", x.now)
            x.t.heartbeat("snellius", "snellius-inc", x.now)
            x.t.drop_silent(x.now, x.wall)
            out.append(x.t.reply("lumi", x.now))
            out.append(x.merge())
            for c in list(x.t.books.commits):
                x.t.books.settle("commit", c, Answer(OK, {"state": "committed"}))
            x.t.join("c", "c-inc", x.now, x.wall)
        x.t.books.owe_abort("r9.x", "c", "c-inc", "lost", x.wall)
        out.append(fedmom_round.round_status(x.t, x.now))
        return x.t.to_json(), out, x.said

    def test_the_same_calls_give_the_same_books_decisions_and_log(self):
        first, second = self.script(), self.script()
        self.assertEqual(first, second)
        books, out, said = first
        self.assertEqual(books["round"], 3)
        self.assertEqual([r["round"] for r in out if isinstance(r, dict) and "v" in r], [1, 2, 3])
        self.assertTrue(any("dropped c" in line for line in said))

    def test_the_books_read_back_are_the_books_written(self):
        books, _, _ = self.script()
        again = RoundTable(60.0, 100.0, custody=True)
        again.load(books, T0)
        self.assertEqual(again.to_json(), books)


class PurityTest(unittest.TestCase):
    def test_the_core_imports_no_io(self):
        """No files, sockets, threads or numpy come with the core (a subprocess: a clean import)."""
        code = ("import sys; import fedmom_round, fedmom_round\n"
                "print(sorted(m for m in ('threading', 'socket', 'numpy', 'httpd', 'durable', 'tensorio', 'torch',"
                " 'fedmom_state', 'http.client') if m in sys.modules))")
        out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
        self.assertEqual((out.returncode, out.stdout.strip()), (0, "[]"), out.stderr)

    def test_a_record_line_is_one_line(self):
        x = Table(custody=False)
        x.send("lumi")
        x.send("snellius")
        line = fedmom_round.format_record(x.merge())
        self.assertTrue(line.startswith("fedmom: merge round 1:"))
        self.assertNotIn("\n", line)


if __name__ == "__main__":
    unittest.main()
