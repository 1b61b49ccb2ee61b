"""Custody: DARL holds an accepted delta's blocks for the aggregator until the aggregator
commits or aborts them (a two-phase commit, DARL the participant, the aggregator the
coordinator: fedmom_round.py decides, fedmom_state.py calls), with fencing epochs, durable
owed calls and loud violation counters.

What runs:
  - the table's custody calls (darl_table.CustodyTable) with an injected clock (no I/O);
  - the aggregator's state against a real DARL coordinator served on 127.0.0.1 in
    threads, injected clocks on both sides, and a "front" server that answers what a
    proxy or a rotated token would (401, 403, 404, 5xx) or never answers;
  - the faults that broke exactly-once before custody existed, each as it happens:
    an aggregator outage longer than a lease TTL, non-definitive DARL answers, a delta
    that names no lease, a site's release(leave=true) after its delta was accepted;
  - the status CLIs' exit codes and the operator's abort-custody command, as processes;
  - real darl_server.py and fedmom_server.py processes: the aggregator SIGKILLed at the
    instant its round is durable and its commits owed, restarted, and delivering them;
    two aggregators on copies of one state dir given the same epoch (the copy taken
    while the first /fence reply was held in flight), the copy's confirm refused or
    lost on the way (a dropping forwarder), and the copy fenced at every later start.
"""
import collections
import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import unittest

import numpy as np

import block_space
import darl_server
import durable
import fedmom_client
import fedmom_round
import fedmom_server as fm
import fedmom_state
import fedmom_state as fs
import httpc
import httpd
import testhooks
from darl_table import CustodyTable
from darl_table import LeaseError, TableConfig
from fixtures import SHAPES, FakeClock, FedMomFixture, serve_in_thread, write_tensors
from testbed.harness import expect

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKEN = "t0ken"
DEADLINE_S = 120            # bounds a hang only
EXIT_FENCED = 3             # fedmom_server's exit status when DARL fenced it


# ---------------------------------------------------------------- the table alone

class Clock:
    def __init__(self, t=1000.0):
        self.t = t

    def __call__(self):
        return self.t


class CustodyTableTest(unittest.TestCase):
    def setUp(self):
        self.clock = Clock()
        self.t = CustodyTable(40, TableConfig(min_ttl=1.0, default_ttl=10.0, initial_grant=5), self.clock)
        for c in ("a", "b"):
            self.t.register(c, f"{c}-inc")
        self.assertEqual(self.t.fence("agg", 0, "first")["epoch"], 1)

    def lease(self, c, n=5, ttl=10):
        return self.t.acquire(c, f"{c}-inc", blocks=n, ttl=ttl)["lease"]

    def take(self, delta, c, *leases, epoch=1, agg="agg"):
        return self.t.take_custody(agg, epoch, delta, c, f"{c}-inc",
                                   [{"lease": L["id"], "start": L["start"], "end": L["end"]} for L in leases])

    def test_custody_outlives_ttl_steal_release_and_a_new_incarnation(self):
        a = self.lease("a")
        held = self.take("d1", "a", a)
        self.assertEqual((held["state"], held["pieces"], held["blocks"]), ("held", [[a["id"], 0, 5]], 5))
        self.clock.t += 1000                                  # far past the TTL
        self.t.release("a", "a-inc", leave=True)               # the site leaves, releasing everything
        self.t.register("a", "a-new")                          # a requeue takes the stream over
        got = []
        while (r := self.t.acquire("b", "b-inc", blocks=40))["status"] == "ok":
            got.append(r["lease"])
        self.assertEqual(sorted(p for L in got for p in range(L["start"], L["end"])), list(range(5, 40)),
                         "custody positions were handed out again")
        self.assertEqual(r["status"], "wait", "an abort could still return blocks")
        self.assertEqual(self.t.verify()["in_custody"], 5)
        self.assertEqual(self.t.commit_custody("agg", 1, "d1")["state"], "committed")
        self.assertEqual(self.t.commit_custody("agg", 1, "d1")["repeat"], True)
        books = self.t.verify()
        self.assertEqual((books["committed"], books["in_custody"]), (5, 0))
        self.assertEqual(self.t.clusters["a"].committed, 5)
        beat = self.t.heartbeat("a", "a-new", leases=[a["id"]])["leases"][0]
        self.assertEqual(beat["reason"], "not held by this incarnation")

    def test_all_or_nothing_and_a_repeat_gets_the_same_answer(self):
        a1, a2, b = self.lease("a"), self.lease("a"), self.lease("b")
        before = json.dumps(self.t.to_dict())
        with self.assertRaises(LeaseError) as cm:
            self.t.take_custody("agg", 1, "d1", "a", "a-inc", [{"lease": a1["id"]}, {"lease": b["id"]}])
        self.assertEqual((cm.exception.status, cm.exception.extra["code"], cm.exception.extra["leases"]),
                         (409, "lease_lost", [b["id"]]))
        self.assertEqual(json.dumps(self.t.to_dict()), before, "a refused custody changed the books")
        first = self.take("d1", "a", a1, a2)
        self.assertEqual(self.take("d1", "a", a1, a2), {**first, "repeat": True})
        for bad, word in (([{"lease": a1["id"], "end": 99}], "never in it"),
                          ([{"lease": 999}], "unknown lease"), ([{"lease": a1["id"]}], "nothing of it")):
            with self.subTest(word), self.assertRaises(LeaseError) as cm:
                self.t.take_custody("agg", 1, "d2", "a", "a-inc", bad)
            self.assertIn(word, cm.exception.reason)
        with self.assertRaises(LeaseError) as cm:
            self.t.take_custody("agg", 1, "d3", "a", "a-inc", [{"lease": b["id"], "start": 0}])
        self.assertEqual(cm.exception.status, 409)

    def test_a_delta_must_start_where_its_lease_is_uncommitted(self):
        a = self.lease("a", n=10)
        before = json.dumps(self.t.to_dict())
        with self.assertRaises(LeaseError) as cm:
            self.t.take_custody("agg", 1, "d1", "a", "a-inc", [{"lease": a["id"], "start": 2, "end": a["end"]}])
        self.assertEqual(cm.exception.extra["code"], "lease_lost")
        self.assertIn("[0, 2) comes first and is in no custody yet", cm.exception.reason)
        self.assertEqual(json.dumps(self.t.to_dict()), before, "a refused custody changed the books")
        self.assertEqual(self.take("d1", "a", {**a, "end": a["start"] + 4})["pieces"], [[a["id"], 0, 4]])
        with self.assertRaises(LeaseError) as cm:              # a second delta of that lease from its start again
            self.take("d2", "a", a)
        self.assertIn("[0, 4) is committed or in custody already", cm.exception.reason)
        self.assertEqual(self.take("d2", "a", {**a, "start": 4})["pieces"], [[a["id"], 4, 10]])
        self.t.verify()

    def test_two_expired_leases_over_the_same_positions_are_not_taken_twice(self):
        first = self.lease("b", ttl=2)
        self.clock.t += 5                                       # expired: its positions back in the pool
        second = self.lease("b", ttl=2)                         # the same positions, leased again
        self.assertEqual((second["start"], second["end"]), (first["start"], first["end"]))
        self.clock.t += 5                                       # expired too: nobody holds them now
        self.t.expire(self.clock.t)
        before = json.dumps(self.t.to_dict())
        with self.assertRaises(LeaseError) as cm:
            self.take("d1", "b", first, second)
        self.assertEqual(cm.exception.extra["code"], "lease_lost")
        self.assertIn("the named leases cover the same positions", cm.exception.reason)
        self.assertEqual(json.dumps(self.t.to_dict()), before, "a refused custody changed the books")
        self.assertEqual(self.take("d1", "b", second)["blocks"], 5)
        self.t.verify()

    def test_an_expired_lease_goes_into_custody_only_while_nobody_has_its_blocks(self):
        a = self.lease("a", ttl=2)
        self.clock.t += 5                                       # expired, blocks back in the pool
        self.assertEqual(self.take("late", "a", a)["pieces"], [[a["id"], 0, 5]])
        self.t.verify()
        a2 = self.lease("a", ttl=2)
        self.clock.t += 5
        self.lease("b", n=40)                                   # b leases them again
        with self.assertRaises(LeaseError) as cm:
            self.take("too-late", "a", a2)
        self.assertIn("leased, committed or taken into custody again", cm.exception.reason)

    def test_an_abort_returns_the_blocks_and_a_later_commit_is_refused_and_counted(self):
        a = self.lease("a")
        self.take("d1", "a", a)
        out = self.t.abort_custody("agg", 1, "d1", "the spooled delta was lost")
        self.assertEqual((out["state"], out["returned"]), ("aborted", 5))
        self.assertEqual(self.lease("b", n=5)["start"], 0, "aborted blocks go back to the pool")
        with self.assertRaises(LeaseError) as cm:
            self.t.commit_custody("agg", 1, "d1")
        self.assertEqual((cm.exception.extra["code"], cm.exception.counted), ("custody_aborted", True))
        with self.assertRaises(LeaseError) as cm:
            self.t.commit_custody("agg", 1, "never")
        self.assertEqual(cm.exception.extra["code"], "unknown_custody")
        self.assertEqual(self.t.counters, {"refused_commits": 2, "aborted_custody": 1, "blocks_trained_twice": 5,
                                           "refused_aborts": 0})
        # an abort that overtakes its own custody request leaves a tombstone: the late request fails
        a2 = self.lease("a")
        self.assertEqual(self.t.abort_custody("agg", 1, "d9")["returned"], 0)
        with self.assertRaises(LeaseError) as cm:
            self.take("d9", "a", a2)
        self.assertEqual(cm.exception.extra["code"], "custody_aborted")
        self.take("d10", "a", a2)
        self.t.commit_custody("agg", 1, "d10")
        with self.assertRaises(LeaseError) as cm:              # a committed custody cannot be aborted
            self.t.abort_custody("agg", 1, "d10")
        self.assertEqual((cm.exception.extra["code"], cm.exception.counted), ("custody_committed", True))
        self.assertEqual(self.t.counters["refused_aborts"], 1, "committed blocks no round holds went uncounted")
        self.t.verify()

    def test_two_copies_of_one_claim_never_both_hold_the_epoch(self):
        """A copy of the state taken while its fence was in flight repeats the same claim and
        is given the same epoch: the first to confirm holds it, the other is fenced, in
        either order; once confirmed, the claim is never answered again."""
        for first, second in (("A", "B"), ("B", "A")):
            t = CustodyTable(100, TableConfig(min_ttl=1, default_ttl=10))
            self.assertEqual(t.fence("agg", 0, "c1")["epoch"], 1)        # A asks; its answer arrives or not
            self.assertEqual(t.fence("agg", 0, "c1")["epoch"], 1)        # the copy B repeats the ask
            self.assertEqual(t.confirm_fence("agg", 1, "c1", first)["epoch"], 1)
            self.assertEqual(t.confirm_fence("agg", 1, "c1", first)["epoch"], 1, "a repeat of the holder")
            with self.assertRaises(LeaseError) as cm:
                t.confirm_fence("agg", 1, "c1", second)
            self.assertEqual(cm.exception.extra["code"], "fenced")
            with self.assertRaises(LeaseError) as cm:                    # a third copy, later
                t.fence("agg", 0, "c1")
            self.assertEqual(cm.exception.extra["code"], "fenced")
            self.assertEqual(t.fence("agg", 1, "c2")["epoch"], 2)        # the holder's next start goes on

    def fenced(self, t, *args, **kw):
        with self.assertRaises(LeaseError) as cm:
            t.fence(*args, **kw)
        self.assertEqual(cm.exception.extra["code"], "fenced")
        return cm.exception.reason

    def test_a_copy_whose_confirm_was_refused_or_lost_never_takes_the_epoch_over(self):
        """Both copies of a state hold claim c1 (the copy was taken while A's fence was in
        flight) and are given epoch 1; each writes epoch 1 and its own holder before its
        confirm. A confirms; B's confirm is refused (then B is restarted) or lost (then B
        asks again). B's state names epoch 1 with holder hB: fenced at every later ask,
        whatever its claim. Before, any state naming epoch 1 was issued epoch 2, and B
        served the aggregator's identity from its older state, fencing A."""
        for variant in ("refused, then restarted", "lost, asked again"):
            with self.subTest(variant):
                t = CustodyTable(100, TableConfig(min_ttl=1, default_ttl=10))
                self.assertEqual(t.fence("agg", 0, "c1", round=0)["epoch"], 1)      # A
                self.assertEqual(t.fence("agg", 0, "c1", round=0)["epoch"], 1)      # the copy B
                t.confirm_fence("agg", 1, "c1", "hA")
                if variant.startswith("refused"):
                    with self.assertRaises(LeaseError):
                        t.confirm_fence("agg", 1, "c1", "hB")
                for claim in ("c2", "c3", "c4"):                                     # every start of B
                    why = self.fenced(t, "agg", 1, claim, last_holder="hB", round=0)
                    self.assertIn("held by process hA", why)
                self.assertEqual((t.aggregators["agg"]["epoch"], t.aggregators["agg"]["holder"]), (1, "hA"))
                self.assertEqual(t.fence("agg", 1, "c5", last_holder="hA", round=0)["epoch"], 2, "A's restart")

    def test_the_legitimate_restarts_of_the_newest_state_get_the_next_epoch(self):
        """Never locked out: a restart after the confirm (the state names the holder), after
        a lost confirm (epoch never confirmed), after a lost fence reply (the same claim),
        a copy restarted before the other confirmed (it never acted), and a state written
        before holders (no last_holder: the holder is not compared)."""
        t = CustodyTable(100, TableConfig(min_ttl=1, default_ttl=10))
        self.assertEqual(t.fence("agg", 0, "c1", round=0)["epoch"], 1)
        self.assertEqual(t.fence("agg", 0, "c1", round=0)["epoch"], 1, "the reply was lost: the same ask")
        # the state names (1, h1); h1's confirm never reached DARL: it asks again
        self.assertEqual(t.fence("agg", 1, "c2", last_holder="h1", round=0)["epoch"], 2)
        t.confirm_fence("agg", 2, "c2", "h2")
        self.assertEqual(t.fence("agg", 2, "c3", last_holder="h2", round=0)["epoch"], 3, "a restart")
        t.confirm_fence("agg", 3, "c3", "h3")
        self.assertEqual(t.fence("agg", 3, "c4")["epoch"], 4, "an old state (no holder, no round)")
        # two copies given epoch 4; B restarts before anyone confirmed: B goes on, A never acted
        self.assertEqual(t.fence("agg", 3, "c4", last_holder="h3")["epoch"], 4)
        self.assertEqual(t.fence("agg", 4, "c5", last_holder="hB", round=0)["epoch"], 5)
        with self.assertRaises(LeaseError) as cm:
            t.confirm_fence("agg", 4, "c4", "hA")
        self.assertEqual(cm.exception.extra["code"], "fenced")
        self.fenced(t, "agg", 4, "c6", last_holder="hA", round=0)

    def test_a_copy_missing_merges_whose_blocks_darl_committed_is_fenced(self):
        """A copy taken after A's holder was durable names A's epoch and holder: the holder
        rule alone lets it in. A then merged round 1 and DARL committed its custody: the
        copy (round 0) lacks it and is fenced, naming both rounds; A's own restart (round
        1), and one whose round 2 is durable with its commits not yet sent, go on."""
        a = self.lease("a")
        self.t.confirm_fence("agg", 1, "first", "hA")
        self.take("d1", "a", a)
        self.t.commit_custody("agg", 1, "d1", round=1)
        self.assertEqual(self.t.status()["aggregators"][0]["round"], 1)
        why = self.fenced(self.t, "agg", 1, "copy", last_holder="hA", round=0)
        self.assertIn("round 0", why)
        self.assertIn("round 1", why)
        self.assertEqual(self.t.aggregators["agg"]["epoch"], 1, "a refused fence issued an epoch")
        self.assertEqual(self.t.fence("agg", 1, "restart", last_holder="hA", round=2)["epoch"], 2)
        self.t.commit_custody("agg", 2, "d1", round=1)           # a repeat never lowers it
        self.assertEqual(self.t.aggregators["agg"]["round"], 1)
        with self.assertRaises(LeaseError) as cm:
            self.t.commit_custody("agg", 2, "d1", round=-1)
        self.assertEqual(cm.exception.status, 400)
        self.t.verify()

    def test_older_epochs_are_fenced_and_an_operator_retires_an_orphan(self):
        a, a2 = self.lease("a"), self.lease("a")
        self.take("d1", "a", a)
        again = self.t.fence("agg", 1, "second")                 # the restarted aggregator
        self.assertEqual((again["epoch"], again["held"]), (2, 1))
        for call in (lambda: self.t.commit_custody("agg", 1, "d1"), lambda: self.take("d2", "a", a2, epoch=1),
                     lambda: self.t.abort_custody("agg", 1, "d1"), lambda: self.t.fence("agg", 1, "x"),
                     lambda: self.take("d2", "a", a2, epoch=3), lambda: self.t.fence("agg", 0, "first")):
            with self.assertRaises(LeaseError) as cm:
                call()
            self.assertEqual(cm.exception.extra["code"], "fenced")
        out = self.t.abort_orphaned("agg", "state dir lost with its disk")
        self.assertEqual((out["returned"], [c["delta"] for c in out["aborted"]]), (5, ["d1"]))
        with self.assertRaises(LeaseError) as cm:
            self.t.commit_custody("agg", 99, "d1")
        self.assertIn("retired", cm.exception.reason)
        with self.assertRaises(LeaseError):
            self.t.abort_orphaned("nobody", "x")
        self.assertEqual(self.t.counters["aborted_custody"], 1)
        self.t.verify()


# ---------------------------------------------------------------- the aggregator against a real DARL

def front(test, status):
    """A server that answers every call with `status`: a proxy, a gateway, an old route table."""
    def answer(req):
        raise httpd.HTTPError(status, f"front says {status}")
    return serve_in_thread(test, {("GET", "/*"): answer, ("POST", "/*"): answer}, token=TOKEN)


def silent(test):
    """A port that accepts connections and never answers: a hung peer (a timeout)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(16)
    test.addCleanup(s.close)
    return f"http://127.0.0.1:{s.getsockname()[1]}"


class AggregatorFixture(FedMomFixture):
    def darl(self, blocks=100, clock=None):
        coord = darl_server.Coordinator(block_space.BlockSpace(blocks, 1, 0), TableConfig(min_ttl=10.0),
                                        clock=clock or self.clock)
        return coord, serve_in_thread(self, darl_server.make_routes(coord), token=TOKEN)

    def lease(self, url, coord, cluster, ttl=60, n=5):
        inc = f"{cluster}-inc"
        httpc.call(url, "POST", "/register", {"cluster": cluster, "incarnation": inc, "digest": coord.digest},
                   token=TOKEN)
        return httpc.call(url, "POST", "/acquire", {"cluster": cluster, "incarnation": inc, "blocks": n, "ttl": ttl},
                          token=TOKEN)["lease"]

    def agg(self, link, name="st", init=True):
        cfg = fs.ServerConfig(os.path.join(self.dir, name), init=self.init if init else None)
        return fs.FedMomState(cfg.validate(), clock=self.clock, darl=link)

    def merged(self, st):
        return [o for r in durable.read_jsonl(st.rounds_path) for o in r["outcomes"] if o["outcome"] == "merged"]

    def assert_each_position_in_one_merged_delta(self, st, coord, leases):
        """From the acquire replies (what each lease covered) and the round records."""
        span = {L["id"]: range(L["start"], L["end"]) for L in leases}
        seen = collections.Counter(p for o in self.merged(st) for l in o["leases"] for p in span[l["id"]])
        self.assertEqual(sorted(p for p, n in seen.items() if n > 1), [], "positions inside two merged deltas")
        self.assertEqual(coord.status()["committed"], len(seen), "committed != merged positions")
        self.assertEqual(st.pending_commits, [])


class AggregatorOutageTest(AggregatorFixture):
    def test_an_aggregator_outage_longer_than_a_ttl_merges_no_block_twice(self):
        """lumi's delta is accepted; the round waits for snellius; lumi dies and the aggregator
        is SIGKILLed, so nobody keeps lumi's lease alive; it outlives its TTL. Before custody,
        DARL gave the same blocks to snellius and the restarted aggregator merged both."""
        coord, url = self.darl()
        st = self.agg(fedmom_state.DarlLink(url, TOKEN))
        st.join("lumi", "lumi-inc")
        st.join("snellius", "snellius-inc")
        a = self.lease(url, coord, "lumi", ttl=10)
        self.assertTrue(self.send(st, "lumi", self.delta()[0], 100, leases=[a])["accepted"])
        del st                                                  # SIGKILL: no process, no heartbeat
        self.clock.t += 30                                      # 3 TTLs
        b = self.lease(url, coord, "snellius", ttl=600)
        st = self.agg(fedmom_state.DarlLink(url, TOKEN), init=False)      # the restart
        self.assertTrue(self.send(st, "snellius", self.delta()[0], 100, leases=[b])["accepted"])
        self.assertIsNone(st.tick(), "merged lumi's restored delta before DARL said it still holds its custody")
        st.darl_tick()                                          # the server's DARL loop: fence, reconcile
        rec = st.tick()
        self.assertIsNotNone(rec)
        for _ in range(3):
            st.darl_tick()
        self.assertEqual(sorted(o["cluster"] for o in rec["outcomes"] if o["outcome"] == "merged"),
                         ["lumi", "snellius"])
        self.assert_each_position_in_one_merged_delta(st, coord, [a, b])
        self.assertIsNone(coord.status()["invariant_error"])


class NonDefinitiveAnswerTest(AggregatorFixture):
    def test_no_definitive_answer_from_darl_decides_nothing(self):
        """DARL behind a rotated token (401), a proxy (403, 404, 5xx) or hung (a timeout): the
        delta is neither merged unchecked nor its commit dropped; both wait for DARL's word."""
        bad = {"401": None, "403": front(self, 403), "404": front(self, 404), "500": front(self, 500),
               "503": front(self, 503), "timeout": silent(self)}
        for i, (case, url) in enumerate(bad.items()):
            with self.subTest(case):
                coord, good = self.darl()
                url = url or good
                link = fedmom_state.DarlLink(url, "rotated" if case == "401" else TOKEN, timeout=0.5)
                st = self.agg(link, name=f"st-{case}")
                cluster = f"c{i}"
                st.join(cluster, f"{cluster}-inc")
                lease = self.lease(good, coord, cluster)
                self.assertTrue(self.send(st, cluster, self.delta()[0], 10, leases=[lease])["accepted"])
                for _ in range(2):                              # DARL says nothing definitive
                    st.tick()
                    st.darl_tick()
                if st.round:
                    self.assertTrue(st.pending_commits, "merged unchecked, then its commit dropped without DARL's word")
                else:                                           # custody unconfirmed: the round waits
                    self.assertEqual(st.status()["darl"]["custody_waiting"], [cluster])
                self.assertIsNotNone(st.status()["darl"]["alarm"], "no alarm while DARL is silent")
                link.url, link.token = good, TOKEN              # DARL's word: custody, merge ...
                st.darl_tick()
                self.assertIsNotNone(st.tick())
                link.url, link.token = url, ("rotated" if case == "401" else TOKEN)
                self.assertFalse(st.darl_tick())                # ... and a commit DARL does not answer
                self.assertEqual(len(st.pending_commits), 1, "a commit without DARL's word was dropped")
                self.assertEqual(st.violations, {k: 0 for k in fedmom_round.VIOLATIONS})
                link.url, link.token = good, TOKEN
                self.assertTrue(st.darl_tick())
                self.assertIsNone(st.status()["darl"]["alarm"])
                self.assert_each_position_in_one_merged_delta(st, coord, [lease])


class SiteMistakesTest(AggregatorFixture):
    def test_a_delta_naming_no_lease_is_refused_under_darl(self):
        coord, url = self.darl()
        st = self.agg(fedmom_state.DarlLink(url, TOKEN))
        st.join("lumi", "lumi-inc")
        before = self.snapshot(st)
        with self.assertRaises(fedmom_round.Refused) as cm:
            self.send(st, "lumi", self.delta()[0], 100, leases=[])
        self.assertEqual(cm.exception.status, 400)
        self.assertIn("--darl", cm.exception.reason)
        self.assertEqual(self.snapshot(st), before)
        self.assertIsNone(st.tick())

    def test_a_release_with_leave_after_acceptance_gives_back_nothing_the_aggregator_holds(self):
        coord, url = self.darl()
        st = self.agg(fedmom_state.DarlLink(url, TOKEN))
        st.join("lumi", "lumi-inc")
        st.join("snellius", "snellius-inc")
        a = self.lease(url, coord, "lumi")
        self.assertTrue(self.send(st, "lumi", self.delta()[0], 100, leases=[a])["accepted"])
        httpc.call(url, "POST", "/release", {"cluster": "lumi", "incarnation": "lumi-inc", "leave": True},
                   token=TOKEN)                                 # the site finishes (or its job is cancelled)
        b = self.lease(url, coord, "snellius")
        self.assertTrue(self.send(st, "snellius", self.delta()[0], 100, leases=[b])["accepted"])
        self.assertIsNotNone(st.tick())
        st.darl_tick()
        self.assert_each_position_in_one_merged_delta(st, coord, [a, b])


class RoundRuleTest(AggregatorFixture):
    def test_the_round_waits_for_custody_and_a_late_refusal_excludes_the_delta_by_name(self):
        darl_clock = FakeClock()                 # the aggregator's clock runs on alone below
        coord, good = self.darl(clock=darl_clock)
        link = fedmom_state.DarlLink(front(self, 503), TOKEN)
        st = self.agg(link)
        for c in ("lumi", "snellius"):
            st.join(c, f"{c}-inc")
        a = self.lease(good, coord, "lumi", ttl=10)
        b = self.lease(good, coord, "snellius", ttl=600)
        self.send(st, "lumi", self.delta()[0], 100, leases=[a])       # DARL gives no answer
        darl_clock.t += 11                                             # lumi's lease expires ...
        other = self.lease(good, coord, "other", ttl=600)              # ... and its blocks go to "other"
        self.assertEqual(other["start"], a["start"])
        link.url = good
        self.send(st, "snellius", self.delta()[0], 100, leases=[b])   # confirmed at once
        self.assertEqual(st.status()["darl"]["custody_waiting"], ["lumi"])
        self.clock.t += 10 * st.cfg.round_deadline_s                   # far past the deadline: still waits
        link.url = front(self, 503)
        st.darl_tick()
        self.assertIsNone(st.tick(), "a round merged a delta whose custody DARL never confirmed")
        link.url = good
        self.assertTrue(st.darl_tick())                                # DARL: lumi's blocks are not its own
        self.assertEqual([(o["cluster"], o["outcome"]) for o in st.status()["outcomes"]],
                         [("snellius", "pending"), ("lumi", "excluded")])
        rec = st.tick()
        self.assertEqual([o["cluster"] for o in rec["outcomes"] if o["outcome"] == "merged"], ["snellius"])
        excluded = [o for o in rec["outcomes"] if o["outcome"] == "excluded"]
        self.assertEqual([o["cluster"] for o in excluded], ["lumi"])
        self.assertIn("cannot take this delta's leases into custody", excluded[0]["why"])
        told = st.join("lumi", "lumi-inc")["deltas"]           # dropped meanwhile (silent): back, and told
        self.assertEqual([o["outcome"] for o in told], ["excluded"])
        st.darl_tick()
        self.assert_each_position_in_one_merged_delta(st, coord, [a, b])


class HostileMergeCustodyTest(AggregatorFixture):
    def test_a_delta_excluded_at_the_merge_has_its_custody_aborted(self):
        """Two finite deltas of 3e38 would make theta_global inf: the merge excludes them. Their
        blocks sit in DARL custody; an exclusion must abort it (back to the pool, to be trained
        again), never leave it held for good or commit it."""
        coord, url = self.darl()
        st = self.agg(fedmom_state.DarlLink(url, TOKEN))
        for c in ("a", "b", "c"):
            st.join(c, f"{c}-inc")
        leases = {c: self.lease(url, coord, c) for c in ("a", "b", "c")}
        huge = {k: np.full(s, 3e38, np.float32) for k, s in SHAPES.items()}
        for c in ("a", "b"):
            path = os.path.join(self.dir, f"huge-{c}.safetensors")
            write_tensors(path, huge, "F32")
            self.assertEqual(self.send(st, c, path, 10, leases=[leases[c]])["custody"], "confirmed")
        # c's few tokens leave the huge ones ~95 % of the weight: 2.9e38 x lr 0.7 x (1 + 0.9) = inf
        self.assertEqual(self.send(st, "c", self.delta("F32")[0], 1, leases=[leases["c"]])["custody"], "confirmed")
        rec = st.tick()
        self.assertEqual(sorted((o["cluster"], o["outcome"]) for o in rec["outcomes"]),
                         [("a", "excluded"), ("b", "excluded"), ("c", "merged")])
        self.assertEqual(sorted(a["cluster"] for a in st.pending_aborts), ["a", "b"])
        self.assertTrue(st.darl_tick())
        self.assertEqual((st.pending_aborts, st.pending_commits), ([], []))
        books = coord.status()
        self.assertEqual(books["committed"], leases["c"]["end"] - leases["c"]["start"])
        self.assertEqual(books["violations"]["aborted_custody"], 2, "the aborts are counted, loudly")
        self.assert_each_position_in_one_merged_delta(st, coord, list(leases.values()))


class FencingAndRepairTest(AggregatorFixture):
    def test_a_newer_epoch_fences_the_older_process(self):
        coord, url = self.darl()
        old = self.agg(fedmom_state.DarlLink(url, TOKEN))
        self.assertTrue(old.darl_tick())
        new = self.agg(fedmom_state.DarlLink(url, TOKEN), init=False)    # a second process on the same state
        self.assertTrue(new.darl_tick())
        self.assertEqual((new.aggregator_id, new.epoch), (old.aggregator_id, old.epoch + 1))
        old.join("lumi", "lumi-inc")
        a = self.lease(url, coord, "lumi")
        with self.assertRaises(fedmom_round.Refused) as cm:
            self.send(old, "lumi", self.delta()[0], 100, leases=[a])
        self.assertEqual(cm.exception.status, 503)
        self.assertIn("a newer process of this aggregator runs", old.status()["darl"]["fenced"])
        self.assertEqual(coord.status()["in_custody"], 0)
        with self.assertRaises(fedmom_round.Refused):
            self.send(old, "lumi", self.delta()[0], 100, leases=[a])

    def test_a_copy_taken_before_the_first_fence_is_fenced_once_the_live_one_holds_its_epoch(self):
        """The state is copied after its fence claim is durable and before DARL's epoch is
        (a standby's copy of a state that never ran): both hold the same claim. The live one
        starts, is issued epoch 1 and confirms it; the copy, started beside it, is fenced."""
        coord, url = self.darl()
        a = self.agg(fedmom_state.DarlLink(url, TOKEN), name="A")
        shutil.copytree(os.path.join(self.dir, "A"), os.path.join(self.dir, "B"), ignore=shutil.ignore_patterns("lock"))
        self.assertTrue(a.darl_tick())
        self.assertEqual((a.epoch, a.status()["epoch"]), (1, 1))
        for _ in range(2):
            b = self.agg(fedmom_state.DarlLink(url, TOKEN), name="B", init=False)
            self.assertFalse(b.darl_tick())
            self.assertIsNotNone(b.fenced)
        a.join("lumi", "lumi-inc")                                  # A still acts
        self.assertTrue(self.send(a, "lumi", self.delta()[0], 100, leases=[self.lease(url, coord, "lumi")])["accepted"])
        self.assertIsNone(a.fenced)

    def test_a_stale_copy_of_the_state_never_gets_an_epoch_however_often_it_restarts(self):
        """Failover: the state is copied to a standby B, which restarts (DARL issues 2, 3, 4);
        the stale copy A, restarted by a supervisor, is fenced every time and never fences
        B. Before, A climbed one epoch per restart, served beside B at an equal epoch, then
        fenced the live B."""
        coord, url = self.darl()
        a = self.agg(fedmom_state.DarlLink(url, TOKEN), name="A")
        self.assertTrue(a.darl_tick())
        self.assertEqual(a.epoch, 1)
        del a
        shutil.copytree(os.path.join(self.dir, "A"), os.path.join(self.dir, "B"))
        for want in (2, 3, 4):
            b = self.agg(fedmom_state.DarlLink(url, TOKEN), name="B", init=False)
            self.assertTrue(b.darl_tick())
            self.assertEqual(b.epoch, want)
        for _ in range(3):
            a = self.agg(fedmom_state.DarlLink(url, TOKEN), name="A", init=False)
            self.assertFalse(a.darl_tick())
            self.assertIn("this one is stale", a.status()["darl"]["fenced"])
            self.assertEqual(a.epoch, 1, "a refused fence moved the stale copy's epoch")
        self.assertEqual(coord.status()["aggregators"][0]["epoch"], 4)
        b.join("lumi", "lumi-inc")                                  # B still acts
        self.assertTrue(self.send(b, "lumi", self.delta()[0], 100, leases=[self.lease(url, coord, "lumi")])["accepted"])
        self.assertIsNone(b.fenced)
        with open(os.path.join(self.dir, "B", "state.json")) as f:   # B restarts; DARL's answer is lost
            st = json.load(f)
        b = self.agg(fedmom_state.DarlLink(url, TOKEN), name="B", init=False)
        claim = json.loads(pathlib.Path(os.path.join(self.dir, "B", "state.json")).read_text())["fence_claim"]
        lost = httpc.call(url, "POST", "/fence", {"aggregator": b.aggregator_id, "last_epoch": st["epoch"],
                                                  "claim": claim}, token=TOKEN)
        self.assertEqual(lost["epoch"], 5)
        b = self.agg(fedmom_state.DarlLink(url, TOKEN), name="B", init=False)  # the restart repeats the same ask
        self.assertTrue(b.darl_tick())
        self.assertEqual(b.epoch, 5)

    def test_a_copy_never_merges_a_delta_whose_custody_the_live_process_aborted_since(self):
        """The state is copied after the live process A holds its epoch, with two deltas in
        DARL's custody; A then aborts one (an exclusion: its blocks go back to the pool) and
        dies. The copy names A as the holder at A's round, so it is issued the next epoch, but
        it must learn from DARL that the aborted delta is no longer held and never merge it:
        before, it merged both, and DARL refused the second commit (counted refused_commits)
        while those blocks were free to be trained again."""
        coord, url = self.darl()
        a = self.agg(fedmom_state.DarlLink(url, TOKEN), name="A")
        self.assertTrue(a.darl_tick())
        leases = {}
        for c in ("lumi", "snellius"):
            a.join(c, f"{c}-inc")
            leases[c] = self.lease(url, coord, c)
            self.assertEqual(self.send(a, c, self.delta()[0], 100, leases=[leases[c]])["custody"], "confirmed")
        shutil.copytree(os.path.join(self.dir, "A"), os.path.join(self.dir, "B"), ignore=shutil.ignore_patterns("lock"))
        gone = a.pending[("snellius", "snellius-inc")].delta_id
        httpc.call(url, "POST", "/custody/abort", {"aggregator": a.aggregator_id, "epoch": a.epoch, "delta": gone,
                                                   "why": "excluded by the live process"}, token=TOKEN)
        del a
        b = self.agg(fedmom_state.DarlLink(url, TOKEN), name="B", init=False)
        self.assertTrue(b.darl_tick())
        self.assertEqual(b.epoch, 2)
        self.assertEqual([(e["cluster"], "no longer holds" in e["why"]) for e in b.status()["excluded"]],
                         [("snellius", True)])
        rec = b.tick()
        self.assertEqual([(o["cluster"], o["outcome"]) for o in rec["outcomes"] if o["outcome"] == "merged"],
                         [("lumi", "merged")])
        self.assertTrue(b.darl_tick())
        books = coord.status()
        self.assertEqual(books["violations"]["refused_commits"], 0)
        self.assertEqual(books["committed"], leases["lumi"]["end"] - leases["lumi"]["start"])
        self.assert_each_position_in_one_merged_delta(b, coord, [leases["lumi"]])

    def test_a_state_that_used_custody_refuses_a_start_without_darl_or_with_another_darl(self):
        """Without --darl the owed commits would never be sent and new deltas would merge with
        no custody (their leases expire and are leased again); another DARL holds none of it."""
        coord, url = self.darl()
        st = self.agg(fedmom_state.DarlLink(url, TOKEN))
        st.join("lumi", "lumi-inc")
        a = self.lease(url, coord, "lumi")
        self.assertTrue(self.send(st, "lumi", self.delta()[0], 100, leases=[a])["accepted"])
        self.assertEqual(st.tick()["round"], 1)                  # merged: a commit owed, DARL not told yet
        self.assertEqual(len(st.pending_commits), 1)
        for owed in (1, 0):                                         # with nothing owed too, once custody was used
            with self.assertRaises(SystemExit) as cm:
                self.agg(None, init=False)
            self.assertIn("restart with --darl URL", str(cm.exception))
            st = self.agg(fedmom_state.DarlLink(url, TOKEN), init=False)
            self.assertEqual(len(st.pending_commits), owed)
            self.assertTrue(st.darl_tick())
        _, other = self.darl(blocks=50)                               # a DARL of another block space
        st = self.agg(fedmom_state.DarlLink(other, TOKEN), init=False)
        self.assertFalse(st.darl_tick())
        self.assertIn("leases block space", st.status()["darl"]["fenced"])
        plain = fs.FedMomState(fs.ServerConfig(os.path.join(self.dir, "plain"), init=self.init).validate(),
                               clock=self.clock)
        del plain
        fs.FedMomState(fs.ServerConfig(os.path.join(self.dir, "plain")).validate(), clock=self.clock)  # never used

    def test_lost_spool_entries_are_aborted_loudly_and_the_status_clis_exit_1(self):
        coord, url = self.darl()
        st = self.agg(fedmom_state.DarlLink(url, TOKEN))
        for c in ("lumi", "snellius"):
            st.join(c, f"{c}-inc")
        a, b = self.lease(url, coord, "lumi"), self.lease(url, coord, "snellius")
        self.send(st, "lumi", self.delta()[0], 100, leases=[a])
        self.send(st, "snellius", self.delta()[0], 100, leases=[b])
        self.assertEqual(coord.status()["in_custody"], 10)
        spool = st.spool.dir
        del st
        mine = [f for f in os.listdir(spool) if "_lumi_" in f]
        os.unlink(os.path.join(spool, [f for f in mine if f.endswith(".json")][0]))    # gone with a disk
        theirs = [f for f in os.listdir(spool) if "_snellius_" in f and f.endswith(".safetensors")][0]
        with open(os.path.join(spool, theirs), "r+b") as f:                           # cut short
            f.truncate(100)
        st = self.agg(fedmom_state.DarlLink(url, TOKEN), init=False)
        self.assertEqual(st.pending, {})
        self.assertEqual([e["cluster"] for e in st.excluded], ["snellius"])
        self.assertTrue(st.darl_tick())
        books = coord.status()
        self.assertEqual((books["in_custody"], books["free"]), (0, 100))
        self.assertEqual(books["violations"]["aborted_custody"], 2)
        self.assertEqual(st.violations["aborted_custody"], 2)
        furl = serve_in_thread(self, fm.make_routes(st), token=TOKEN, public=("/health", "/"))
        env = {**os.environ, "PWW_TOKEN": TOKEN}
        for script, url_ in (("fedmom_server.py", furl), ("darl_server.py", url)):
            out = subprocess.run([sys.executable, script, "status", "--url", url_], cwd=ROOT, env=env,
                                 capture_output=True, text=True, timeout=60)
            self.assertEqual(out.returncode, 1, out.stdout + out.stderr)
            self.assertIn("EXACTLY-ONCE VIOLATED", out.stdout)
            self.assertIn("aborted_custody 2", out.stdout)
        self.assertIn("EXACTLY-ONCE VIOLATED", urllib_page(furl))

    def test_an_abort_darl_refuses_as_committed_is_counted(self):
        """An abort owed for a delta whose custody DARL already committed: those blocks are
        committed but inside no merged delta; both sides count it and the status CLI exits 1."""
        coord, url = self.darl()
        st = self.agg(fedmom_state.DarlLink(url, TOKEN))
        st.join("lumi", "lumi-inc")
        self.send(st, "lumi", self.delta()[0], 100, leases=[self.lease(url, coord, "lumi")])
        st.tick()
        self.assertTrue(st.darl_tick())                          # merged and committed
        delta = self.merged(st)[0]["delta"]
        with st.lock:
            st.pending_aborts.append({"delta": delta, "cluster": "lumi", "incarnation": "lumi-inc",
                                      "why": "a spool entry lost after all", "since": 0.0})
        self.assertTrue(st.darl_tick())                          # DARL's word is definitive: not owed any more
        self.assertEqual(st.pending_aborts, [])
        self.assertEqual(st.violations["refused_aborts"], 1)
        self.assertEqual(coord.status()["violations"]["refused_aborts"], 1)
        out = subprocess.run([sys.executable, "darl_server.py", "status", "--url", url], cwd=ROOT,
                             env={**os.environ, "PWW_TOKEN": TOKEN}, capture_output=True, text=True, timeout=60)
        self.assertEqual(out.returncode, 1, out.stdout + out.stderr)
        self.assertIn("refused_aborts 1", out.stdout)

    def test_blocks_merged_twice_are_counted_from_the_aggregators_own_records(self):
        """DARL's state dir is lost and DARL starts afresh: it leases positions again that a
        merged round already holds, and takes their custody without objection (it has no
        record of them). The aggregator's own records count them, whatever DARL says."""
        coord, url = self.darl()
        st = self.agg(fedmom_state.DarlLink(url, TOKEN))
        st.join("lumi", "lumi-inc")
        first = self.lease(url, coord, "lumi")
        self.send(st, "lumi", self.delta()[0], 100, leases=[first])
        self.assertIsNotNone(st.tick())
        self.assertTrue(st.darl_tick())
        self.assertEqual(st.violations["blocks_trained_twice"], 0)
        fresh, fresh_url = self.darl()                              # the same space, no memory of round 1
        st = self.agg(fedmom_state.DarlLink(fresh_url, TOKEN), init=False)
        st.join("lumi", "lumi-inc")
        again = self.lease(fresh_url, fresh, "lumi")
        self.assertEqual((again["start"], again["end"]), (first["start"], first["end"]))
        self.assertEqual(self.send(st, "lumi", self.delta()[0], 100, leases=[again])["custody"], "confirmed")
        self.assertIsNotNone(st.tick())
        self.assertTrue(st.darl_tick())
        self.assertEqual(fresh.status()["violations"]["blocks_trained_twice"], 0, "DARL cannot know")
        self.assertEqual(st.violations["blocks_trained_twice"], 5)
        furl = serve_in_thread(self, fm.make_routes(st), token=TOKEN, public=("/health", "/"))
        out = subprocess.run([sys.executable, "fedmom_server.py", "status", "--url", furl], cwd=ROOT,
                             env={**os.environ, "PWW_TOKEN": TOKEN}, capture_output=True, text=True, timeout=60)
        self.assertEqual(out.returncode, 1, out.stdout + out.stderr)
        self.assertIn("blocks_trained_twice 5", out.stdout)

    def test_the_operator_returns_an_orphans_custody_and_the_orphan_is_fenced(self):
        coord, url = self.darl()
        st = self.agg(fedmom_state.DarlLink(url, TOKEN))
        st.join("lumi", "lumi-inc")
        a = self.lease(url, coord, "lumi")
        self.send(st, "lumi", self.delta()[0], 100, leases=[a])
        env = {**os.environ, "PWW_TOKEN": TOKEN}
        cmd = [sys.executable, "darl_server.py", "abort-custody", "--url", url, "--aggregator", st.aggregator_id,
               "--reason", "its state dir was lost"]
        def dry_run(blocks):
            dry = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
            self.assertEqual(dry.returncode, 2, dry.stdout + dry.stderr)
            self.assertIn(f"{blocks} blocks", dry.stdout)
            return dry.stdout.split("--yes --expect ")[1].split()[0]
        listing = dry_run(5)
        self.assertEqual(coord.status()["in_custody"], 5)
        no = subprocess.run(cmd + ["--yes"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
        self.assertIn("--yes needs --expect", no.stderr)
        st.join("snellius", "snellius-inc")                 # the held set changes after the listing
        self.send(st, "snellius", self.delta()[0], 100, leases=[self.lease(url, coord, "snellius")])
        stale = subprocess.run(cmd + ["--yes", "--expect", listing], cwd=ROOT, env=env, capture_output=True,
                               text=True, timeout=60)
        self.assertNotEqual(stale.returncode, 0)
        self.assertIn("holds other custody now", stale.stderr)
        self.assertEqual(coord.status()["in_custody"], 10, "a refused abort changed the books")
        with self.assertRaises(LeaseError) as cm:             # DARL itself checks the set, atomically
            coord.call("abort_orphaned", {"aggregator": st.aggregator_id, "reason": "x", "expect": ["other"]})
        self.assertEqual(cm.exception.extra["code"], "custody_changed")
        done = subprocess.run(cmd + ["--yes", "--expect", dry_run(10)], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=60)
        self.assertEqual(done.returncode, 0, done.stdout + done.stderr)
        self.assertIn("!!! ABORTED 2 custody record(s)", done.stdout)
        books = coord.status()
        self.assertEqual((books["in_custody"], books["free"], books["violations"]["aborted_custody"]), (0, 100, 2))
        self.assertIsNotNone(st.tick())                  # the orphan was alive after all: it merges ...
        self.assertFalse(st.darl_tick())                 # ... and DARL fences its commit
        self.assertIn("retired", st.fenced)
        self.assertEqual(coord.status()["committed"], 0)


class BlobTransportTest(AggregatorFixture):
    def test_a_second_delta_of_one_round_after_a_refused_one_goes_through_the_blob_store(self):
        """A blob delta refused after its upload (here: its lease was re-leased, so custody
        is refused) must neither leave its blob behind nor block the site's next delta of the
        same round: blob names used to be per (cluster, incarnation, round), so the next one
        met "blob ... already exists with another checksum" phase after phase."""
        import blobstore
        darl_clock = FakeClock()
        coord, url = self.darl(clock=darl_clock)
        store = blobstore.BlobStore(os.path.join(self.dir, "blobs"), 1 << 30, 1 << 28)
        blob_url = serve_in_thread(self, blobstore.make_routes(store), token=TOKEN)
        cfg = fs.ServerConfig(os.path.join(self.dir, "st"), init=self.init, blob_url=blob_url)
        st = fs.FedMomState(cfg.validate(), clock=self.clock, darl=fedmom_state.DarlLink(url, TOKEN))
        furl = serve_in_thread(self, fm.make_routes(st, blob_token=TOKEN), token=TOKEN)
        site = fedmom_client.FedMomClient(furl, "lumi", "lumi-inc", token=TOKEN, blob_url=blob_url)
        site.join()
        a = self.lease(url, coord, "lumi", ttl=10)
        darl_clock.t += 11                                      # expired, and someone else trains it
        self.lease(url, coord, "other")
        with self.assertRaises(httpc.CallError) as cm:
            site.send_delta(self.delta()[0], 0, 100, [a], {}, transport="blob")
        self.assertEqual(cm.exception.reply.get("code"), "lease_lost")
        b = self.lease(url, coord, "lumi", ttl=600)
        reply = site.send_delta(self.delta()[0], 0, 100, [b], {}, transport="blob")
        self.assertEqual((reply["accepted"], reply["custody"]), (True, "confirmed"))
        self.assertEqual(store.listing()["blobs"], [], "the aggregator left blobs behind")
        # a retried send whose reply was lost: a duplicate, although its blob is gone
        meta = {"cluster": "lumi", "incarnation": "lumi-inc", "base_round": 0, "tokens": 100,
                "leases": [b], "blob": "delta-gone", "sha256": "0" * 64}
        self.assertTrue(httpc.call(furl, "POST", "/delta_blob", meta, token=TOKEN)["duplicate"])


class GoneFlagTest(unittest.TestCase):
    def test_the_old_heartbeat_flag_is_refused_with_the_reason(self):
        out = subprocess.run([sys.executable, "fedmom_server.py", "--state-dir", "/nonexistent",
                              "--darl-heartbeat-s", "30"], cwd=ROOT, capture_output=True, text=True, timeout=60)
        self.assertNotEqual(out.returncode, 0)
        self.assertIn("--darl-heartbeat-s is gone", out.stderr)
        self.assertIn("custody", out.stderr)


def urllib_page(url):
    conn = httpc.connect(url)
    try:
        conn.request("GET", "/")
        return conn.getresponse().read().decode()
    finally:
        conn.close()


# ---------------------------------------------------------------- real processes

class ProcessFixture(unittest.TestCase):
    """Real darl_server.py and fedmom_server.py processes on loopback, each started with a
    fault dir (testhooks.fault_point): self.faults unless start() is given another."""

    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="custody-procs-")
        self.addCleanup(shutil.rmtree, self.dir, True)
        self.faults = os.path.join(self.dir, "faults")
        os.makedirs(self.faults)
        self.procs = []
        self.addCleanup(self.stop_all)

    def stop_all(self):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()

    def start(self, script, *args, faults=None):
        path = os.path.join(self.dir, f"{script}.log")
        mark = os.path.getsize(path) if os.path.exists(path) else 0
        with open(path, "ab") as log:
            proc = subprocess.Popen([sys.executable, script, "--port", "0", *map(str, args)], cwd=ROOT,
                                    env={**os.environ, testhooks.FAULT_DIR_ENV: faults or self.faults}, stdout=log,
                                    stderr=subprocess.STDOUT)
        self.procs.append(proc)

        def url():
            if proc.poll() is not None:
                raise AssertionError(f"{script} exited {proc.returncode}")
            with open(path, errors="replace") as f:
                f.seek(mark)
                lines = [line for line in f if " listening on " in line]
            return lines and lines[-1].split()[-1]
        return proc, expect(url, f"{script} to listen", timeout_s=DEADLINE_S, interval_s=0.02)


class RestartWithCommitsOwedTest(ProcessFixture):
    """An aggregator SIGKILLed the instant its round is durable, its DARL commits owed and
    none sent, is restarted and delivers them to a live DARL until DARL has every block."""

    def test_an_aggregator_restarted_with_commits_owed_delivers_them(self):
        import numpy as np
        import tensorio
        init = os.path.join(self.dir, "init.safetensors")
        with tensorio.TensorWriter(init, [("w", "F32", (8,))]) as w:
            w.write("w", np.zeros(8, np.float32))
        darl, durl = self.start("darl_server.py", "--num-samples", 10, "--state-dir", self.dir)
        fed_args = ["--state-dir", os.path.join(self.dir, "fedmom"), "--darl", durl, "--darl-retry-s", 0.2]
        fed, furl = self.start("fedmom_server.py", *fed_args, "--init", init)
        arm = os.path.join(self.faults, "fedmom.round_durable")
        open(arm, "w").close()
        client = darl_server_client(durl)
        self.addCleanup(client.close)
        deltas = os.path.join(self.dir, "d.safetensors")
        with tensorio.TensorWriter(deltas, [("w", "F32", (8,))]) as w:
            w.write("w", np.full(8, 0.5, np.float32))
        for cluster, n in (("lumi", 4), ("snellius", 6)):
            client.register(cluster, f"{cluster}-inc", client.status()["digest"])
            fedmom_client.FedMomClient(furl, cluster, f"{cluster}-inc").join()
        leases = {c: client.acquire(c, f"{c}-inc", blocks=n)["lease"] for c, n in (("lumi", 4), ("snellius", 6))}
        for cluster, lease in leases.items():
            fedmom_client.FedMomClient(furl, cluster, f"{cluster}-inc").send_delta(
                deltas, 0, 10 * len(range(lease["start"], lease["end"])),
                [{"id": lease["id"], "start": lease["start"], "end": lease["end"]}], {})
        expect(lambda: os.path.exists(arm + ".hit"), "the round to become durable",
               timeout_s=DEADLINE_S, interval_s=0.02)
        fed.send_signal(signal.SIGKILL)
        fed.wait()
        with open(os.path.join(self.dir, "fedmom", "state.json")) as f:
            st = json.load(f)
        self.assertEqual((st["round"], len(st["pending_commits"])), (1, 2))
        books = client.status()
        self.assertEqual((books["committed"], books["in_custody"]), (0, 10), "commits were sent before the kill")
        os.unlink(arm)
        fed, furl = self.start("fedmom_server.py", *fed_args)
        # DARL commits before the aggregator drops the entry from its books: wait for both
        expect(lambda: client.status()["committed"] == 10 and httpc.call(furl, "GET", "/status")["pending_commits"]
               == 0, "DARL to receive the owed commits and the aggregator to record it",
               timeout_s=DEADLINE_S, interval_s=0.02)
        books = client.status()
        self.assertEqual((books["in_custody"], books["custody"]["committed"], books["done"]), (0, 2, True))
        self.assertEqual(books["violations"], {k: 0 for k in fedmom_round.VIOLATIONS})
        self.assertEqual(client.acquire("lumi", "lumi-inc")["status"], "done")
        out = subprocess.run([sys.executable, "audit.py", "--state-dir", self.dir], cwd=ROOT,
                             capture_output=True, text=True, timeout=60)
        self.assertEqual(out.returncode, 0, out.stdout + out.stderr)
        self.assertIn("PASS", out.stdout)


class DroppingProxy:
    """A forwarding HTTP hop to DARL (a gateway) that drops the first POST /fence/confirm
    on the way: it closes the connection without passing it on, so DARL never sees it and
    the aggregator gets no answer. Everything else it forwards as it came."""

    def __init__(self, test, target):
        import http.client
        import http.server
        import urllib.parse
        host, port = urllib.parse.urlsplit(target).netloc.split(":")
        self.dropped = threading.Event()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def forward(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.command == "POST" and self.path == "/fence/confirm" and not proxy.dropped.is_set():
                    proxy.dropped.set()
                    self.close_connection = True
                    return
                conn = http.client.HTTPConnection(host, int(port), timeout=DEADLINE_S)
                try:
                    conn.request(self.command, self.path, body or None,
                                 {k: v for k, v in self.headers.items() if k.lower() != "host"})
                    r = conn.getresponse()
                    out = r.read()
                    self.send_response(r.status)
                    self.send_header("Content-Type", r.getheader("Content-Type") or "application/json")
                    self.send_header("Content-Length", str(len(out)))
                    self.end_headers()
                    self.wfile.write(out)
                finally:
                    conn.close()
            do_GET = do_POST = forward

        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        test.addCleanup(server.server_close)
        test.addCleanup(server.shutdown)
        self.url = f"http://127.0.0.1:{server.server_address[1]}"


class CopyTakenWhileFencingTest(ProcessFixture):
    """One DARL, two fedmom_server processes on copies of one state dir, the copy taken
    while the first one's /fence reply is held in flight (darl.synced): both are issued
    epoch 1; B is held after writing its epoch (fedmom.epoch_durable) until A confirmed.
    Then B's confirm is refused (exit 3) and a supervisor restarts B, or B's confirm is
    lost on the way and B asks again. Before, B's state still named epoch 1 and was issued
    epoch 2: B served the aggregator's identity from round 0 and A was fenced at its next
    custody call, its merged round's committed blocks missing from B's state."""

    def run_variant(self, lost):
        import numpy as np
        import tensorio
        fault = {name: os.path.join(self.dir, f"faults-{name}") for name in ("darl", "a", "b")}
        for d in fault.values():
            os.makedirs(d)
        init = os.path.join(self.dir, "init.safetensors")
        with tensorio.TensorWriter(init, [("w", "F32", (8,))]) as w:
            w.write("w", np.zeros(8, np.float32))
        held = os.path.join(fault["darl"], "darl.synced")
        open(held, "w").close()                            # every DARL reply is held once durable
        darl, durl = self.start("darl_server.py", "--num-samples", 10, "--state-dir", self.dir, faults=fault["darl"])
        client = darl_server_client(durl)
        self.addCleanup(client.close)
        a_dir, b_dir = os.path.join(self.dir, "fedmom"), os.path.join(self.dir, "fedmom-b")
        fed, furl = self.start("fedmom_server.py", "--state-dir", a_dir, "--darl", durl, "--darl-retry-s", 0.2,
                               "--init", init, faults=fault["a"])
        expect(lambda: os.path.exists(held + ".hit"), "A's /fence to be held in flight",
               timeout_s=DEADLINE_S, interval_s=0.02)
        shutil.copytree(a_dir, b_dir, ignore=shutil.ignore_patterns("lock"))    # A's claim, no epoch
        os.unlink(held + ".hit")
        proxy = DroppingProxy(self, durl) if lost else None
        b_args = ["--state-dir", b_dir, "--darl", proxy.url if lost else durl, "--darl-retry-s", 0.2]
        open(os.path.join(fault["b"], "fedmom.epoch_durable"), "w").close()
        b, _ = self.start("fedmom_server.py", *b_args, faults=fault["b"])
        expect(lambda: os.path.exists(held + ".hit"), "B's /fence (the same claim) to be held too",
               timeout_s=DEADLINE_S, interval_s=0.02)
        os.unlink(held)                                    # both replies go: epoch 1 to each
        expect(lambda: os.path.exists(os.path.join(fault["b"], "fedmom.epoch_durable.hit")),
               "B to write epoch 1 and its holder", timeout_s=DEADLINE_S, interval_s=0.02)
        expect(lambda: "at epoch 1" in self.log_of("fedmom_server.py"), "A to confirm epoch 1",
               timeout_s=DEADLINE_S, interval_s=0.02)             # B is held before its confirm
        b_state, a_state = read_json(b_dir, "state.json"), read_json(a_dir, "state.json")
        self.assertEqual((a_state["epoch"], b_state["epoch"]), (1, 1), "both copies were issued epoch 1")
        os.unlink(os.path.join(fault["b"], "fedmom.epoch_durable"))    # B confirms (refused, or lost)
        self.assert_fenced(b, b_dir)
        if lost:
            self.assertTrue(proxy.dropped.is_set(), "B's confirm was not dropped on the way")
        self.assertEqual(client.status()["aggregators"][0]["epoch"], 1, "B was issued an epoch")

        deltas = os.path.join(self.dir, "d.safetensors")
        with tensorio.TensorWriter(deltas, [("w", "F32", (8,))]) as w:
            w.write("w", np.full(8, 0.5, np.float32))
        client.register("lumi", "lumi-inc", client.status()["digest"])
        site = fedmom_client.FedMomClient(furl, "lumi", "lumi-inc")
        site.join()

        def round_of_5(base):
            L = client.acquire("lumi", "lumi-inc", blocks=5)["lease"]
            site.send_delta(deltas, base, 50, [{"id": L["id"], "start": L["start"], "end": L["end"]}], {})
            expect(lambda: client.status()["committed"] == 5 * (base + 1)
                   and httpc.call(furl, "GET", "/status")["pending_commits"] == 0,
                   f"A to merge round {base + 1} and DARL to commit it", timeout_s=DEADLINE_S, interval_s=0.02)

        round_of_5(0)                                      # A merged round 1, DARL committed 5 blocks
        for _ in range(2):                                 # a supervisor restarts B: fenced every time
            with open(os.path.join(self.dir, "b.log"), "ab") as log:
                again = subprocess.Popen([sys.executable, "fedmom_server.py", "--port", "0", *map(str, b_args)],
                                         cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
            self.procs.append(again)
            self.assert_fenced(again, b_dir)
        round_of_5(1)                                      # A goes on serving and merging
        self.assertIsNone(fed.poll(), "A stopped")
        books = client.status()
        self.assertEqual((books["aggregators"][0]["epoch"], books["done"]), (1, True))
        self.assertNotEqual(a_state.get("holder"), b_state.get("holder"), "each wrote its own holder")
        self.assertEqual((books["aggregators"][0].get("holder"), books["aggregators"][0].get("round")),
                         (a_state.get("holder"), 2))
        self.assertIn("FENCED by DARL", self.log_of("fedmom_server.py"))
        self.assertIn("is held by process", self.log_of("b"))
        out = subprocess.run([sys.executable, "audit.py", "--state-dir", self.dir], cwd=ROOT,
                             capture_output=True, text=True, timeout=60)
        self.assertEqual(out.returncode, 0, out.stdout + out.stderr)
        self.assertIn("PASS", out.stdout)

    def assert_fenced(self, proc, state_dir):
        """The process exits 3 (fenced) with its state still at epoch 1; not issued a newer one."""
        expect(lambda: proc.poll() is not None or read_json(state_dir, "state.json")["epoch"] != 1,
               "B to exit or be issued another epoch", timeout_s=DEADLINE_S, interval_s=0.02)
        self.assertEqual(read_json(state_dir, "state.json")["epoch"], 1, "B was issued an epoch after A's")
        self.assertEqual(proc.wait(timeout=DEADLINE_S), EXIT_FENCED, "B was not fenced")

    def log_of(self, name):
        with open(os.path.join(self.dir, f"{name}.log"), errors="replace") as f:
            return f.read()

    def test_a_copy_whose_confirm_is_refused_is_fenced_at_every_restart(self):
        self.run_variant(lost=False)

    def test_a_copy_whose_confirm_is_lost_is_fenced_when_it_asks_again(self):
        self.run_variant(lost=True)


def read_json(*path):
    with open(os.path.join(*path)) as f:
        return json.load(f)


def darl_server_client(url):
    import darl_client
    return darl_client.LeaseClient(url)


if __name__ == "__main__":
    unittest.main()
