"""DARL: block space, lease state machine (injected clock), write-ahead log and
snapshots, the HTTP coordinator on a loopback socket, sessions in threads, the
coordinator SIGKILLed under load, and the end-to-end audit of darl_simulate.py."""
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
import time
import traceback
import unittest
import zlib

import block_space
import darl_client
import darl_server
import darl_simulate
import durable
import httpc
import httpd
from block_space import BlockSpace
from darl_server import LogError
from darl_server import Coordinator
from darl_table import InvariantError, LeaseError, LeaseTable, TableConfig
from testbed.harness import expect, listening_url

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Clock:
    def __init__(self, t=1000.0):
        self.t = t

    def __call__(self):
        return self.t

    def advance(self, dt):
        self.t += dt


def table(m=100, clock=None, **cfg):
    cfg = {"min_ttl": 1.0, "default_ttl": 10.0, "max_ttl": 100.0, "initial_grant": 10, **cfg}
    return LeaseTable(m, TableConfig(**cfg), clock or Clock())


def tmpdir(test):
    path = tempfile.mkdtemp(prefix="darl-test-")
    test.addCleanup(shutil.rmtree, path, True)
    return path


class BlockSpaceTest(unittest.TestCase):
    def test_permutation_is_a_bijection_with_an_inverse(self):
        for m in (1, 2, 3, 7, 1000, 1025):
            space = BlockSpace(m, 1, seed=5)
            order = [space.block_at(p) for p in range(m)]
            self.assertEqual(sorted(order), list(range(m)), m)
            self.assertTrue(all(space.position_of(b) == p for p, b in enumerate(order)))
        self.assertNotEqual([BlockSpace(1000, 1, 1).block_at(p) for p in range(20)], list(range(20)))

    def test_order_is_pinned(self):
        # Sites must agree without talking: if this changes, PERMUTATION_VERSION must change too.
        self.assertEqual([BlockSpace(1000, 1, 0).block_at(p) for p in range(6)], [43, 519, 831, 640, 131, 786])
        self.assertEqual(block_space.PERMUTATION_VERSION, "feistel-splitmix64/1")

    def test_blocks_samples_and_digest(self):
        space = BlockSpace(1003, 10, seed=0)
        self.assertEqual(space.num_blocks, 101)
        self.assertEqual(space.samples_of(100), range(1000, 1003))
        self.assertEqual(space.samples_of(3), range(30, 40))
        base = space.digest()
        for other in (BlockSpace(1004, 10, 0), BlockSpace(1003, 11, 0), BlockSpace(1003, 10, 1),
                      BlockSpace(1003, 10, 0, manifest_digest="abc")):
            self.assertNotEqual(other.digest(), base)
        self.assertEqual(BlockSpace(1003, 10, 0).digest(), base)
        with self.assertRaises(IndexError):
            space.block_at(101)

    def test_million_blocks_need_no_table(self):
        space = BlockSpace(10**6, 1, seed=3)
        picks = [space.block_at(p) for p in range(0, 10**6, 9973)]
        self.assertEqual(len(set(picks)), len(picks))
        self.assertTrue(all(not hasattr(v, "__len__") or len(v) < 64 for v in vars(space).values()))

    def test_manifest(self):
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "manifest.json")
            with open(path, "w") as f:        # 58 windows, the last 8 held out: 50 to train on
                json.dump({"num_windows": 58, "heldout_windows": 8, "digest": "tok-v1", "seq_len": 8}, f)
            space = BlockSpace.from_manifest(path, 4, 0)
            self.assertEqual((space.num_samples, space.num_blocks), (50, 13))
            self.assertNotEqual(space.digest(), BlockSpace(50, 4, 0).digest())
            samples = sorted(i for p in range(space.num_blocks) for i in space.samples_of(space.block_at(p)))
            self.assertEqual(samples, list(range(50)))      # every training window once, no held-out one
            self.assertEqual(space.describe()["manifest_digest"], "tok-v1")
            for bad, why in (({"windows": 50}, "--manifest"),
                             ({"num_windows": 50, "digest": "d"}, "heldout_windows"),
                             ({"num_windows": 8, "heldout_windows": 8, "digest": "d"}, "no training windows")):
                with open(path, "w") as f:
                    json.dump(bad, f)
                with self.assertRaisesRegex(ValueError, why):
                    BlockSpace.from_manifest(path, 4, 0)


class LeaseTableTest(unittest.TestCase):
    def setUp(self):
        self.clock = Clock()

    def test_expiry_returns_the_uncommitted_part(self):
        t = table(100, self.clock)
        t.register("a", "i1")
        lease = t.acquire("a", "i1", blocks=30, ttl=10)["lease"]
        t.heartbeat("a", "i1", [{"lease": lease["id"], "cursor": 20}], ttl=10)
        t.commit("a", "i1", lease["id"], end=10)
        self.clock.advance(9)
        self.assertTrue(t.heartbeat("a", "i1", [lease["id"]], ttl=10)["leases"][0]["valid"])   # extended
        self.clock.advance(9.5)
        self.assertEqual(t.verify()["leased"], 20)
        self.clock.advance(1)
        reply = t.heartbeat("a", "i1", [lease["id"]], ttl=10)["leases"][0]
        self.assertFalse(reply["valid"])
        books = t.verify()
        self.assertEqual((books["committed"], books["leased"], books["free"]), (10, 0, 90))
        self.assertEqual(t.clusters["a"].lost, 20)
        self.assertIn((10, 20, 1), list(t.free))     # started blocks carry one attempt, untouched ones none
        self.assertEqual(t.commit("a", "i1", lease["id"], end=10)["committed"], 0)   # the old part still stands

    def test_a_late_commit_stands_while_nobody_has_the_blocks_again(self):
        """The aggregator may commit a lease that expired before the merge was durable:
        if every position is still in the pool, nobody else trained them."""
        t = table(100, self.clock, max_attempts=2)
        t.register("a", "i1")
        t.register("b", "j1")
        one = t.acquire("a", "i1", blocks=10, ttl=10)["lease"]          # [0, 10)
        two = t.acquire("a", "i1", blocks=10, ttl=10)["lease"]          # [10, 20)
        t.heartbeat("a", "i1", [{"lease": one["id"], "cursor": 6}, {"lease": two["id"], "cursor": 20}])
        self.clock.advance(11)                                          # both expire, nobody re-leased yet
        self.assertFalse(t.heartbeat("a", "i1", [one["id"]])["leases"][0]["valid"])
        self.assertEqual(t.verify()["free"], 100)
        r = t.commit("a", "i1", one["id"], end=4)                       # a partial late commit
        self.assertEqual((r["committed"], r["start"]), (4, 4))
        self.assertEqual(t.commit("a", "i1", one["id"], end=4)["committed"], 0)   # still idempotent
        self.assertEqual(t.commit("a", "i1", one["id"])["committed"], 6)          # crosses the attempt tags
        books = t.verify()
        self.assertEqual((books["committed"], books["free"], t.clusters["a"].committed), (10, 90, 10))
        self.assertEqual(t.closed[one["id"]].state, "done")
        self.assertEqual(t.commit("a", "i1", one["id"])["committed"], 0)
        # someone else leased part of the other lease's run: refused, with the reason, books unchanged
        t.acquire("b", "j1", blocks=2, ttl=10)                          # the pool hands out [10, 12)
        with self.assertRaisesRegex(LeaseError, "leased or committed again") as cm:
            t.commit("a", "i1", two["id"])
        self.assertEqual(cm.exception.status, 409)
        self.assertEqual(t.verify()["committed"], 10)
        # a released lease stays refused: its holder gave the blocks back on purpose
        three = t.acquire("a", "i1", blocks=3, ttl=10)["lease"]
        t.release("a", "i1", [three["id"]])
        with self.assertRaisesRegex(LeaseError, "released"):
            t.commit("a", "i1", three["id"])
        t.verify()

    def test_a_late_commit_takes_quarantined_blocks_too(self):
        t = table(20, self.clock, max_attempts=1)
        t.register("a", "i1")
        lease = t.acquire("a", "i1", blocks=10, ttl=10)["lease"]
        t.heartbeat("a", "i1", [{"lease": lease["id"], "cursor": 5}])
        self.clock.advance(11)
        t.expire(self.clock())
        self.assertEqual(t.verify()["quarantined"], 5)                  # [0, 5) quarantined, [5, 10) free
        self.assertEqual(t.commit("a", "i1", lease["id"])["committed"], 10)
        books = t.verify()
        self.assertEqual((books["committed"], books["quarantined"], books["free"]), (10, 0, 10))

    def test_a_heartbeat_without_ttl_keeps_the_sites_ttl_and_never_shortens(self):
        t = table(100, self.clock)
        t.register("a", "i1")
        lease = t.acquire("a", "i1", ttl=50)["lease"]
        self.clock.advance(10)
        t.heartbeat("a", "i1", [lease["id"]])              # e.g. the aggregator, on the site's behalf
        self.assertEqual(t.leases[lease["id"]].expires, self.clock() + 50)
        t.heartbeat("a", "i1", [lease["id"]], ttl=5)
        self.assertEqual(t.leases[lease["id"]].expires, self.clock() + 50)

    def test_stealing_takes_the_unstarted_tail_of_the_slowest(self):
        t = table(100, self.clock, initial_grant=50)
        t.register("fast", "x")
        t.register("slow", "x")
        t.heartbeat("slow", "x", throughput=1.0)
        t.heartbeat("fast", "x", throughput=4.0)
        a = t.acquire("fast", "x", blocks=80)["lease"]     # fair share: half, 'slow' is idle and up
        self.assertEqual(a["end"], 50)
        b = t.acquire("slow", "x", blocks=80)["lease"]
        t.register("idle", "y")
        t.heartbeat("idle", "y", throughput=3.0)
        t.heartbeat("slow", "x", [{"lease": b["id"], "cursor": 60}])
        self.assertEqual(t.free.total, 0)
        stolen = t.acquire("idle", "y", blocks=100)["lease"]
        # the slow lease ends last; its unstarted 40 split 3:1 by rate -> 30 to the thief
        self.assertEqual((stolen["start"], stolen["end"]), (70, 100))
        beat = t.heartbeat("slow", "x", [b["id"]])["leases"][0]
        self.assertEqual((beat["valid"], beat["end"]), (True, 70))
        with self.assertRaisesRegex(LeaseError, "stolen"):
            t.commit("slow", "x", b["id"], end=80)
        t.commit("slow", "x", b["id"])
        self.assertEqual(t.clusters["slow"].committed, 20)
        t.verify()
        self.assertEqual(a["end"], 50)

    def test_claimed_positions_are_never_stolen(self):
        t = table(10, self.clock)
        t.register("a", "x")
        lease = t.acquire("a", "x", blocks=10)["lease"]
        t.register("b", "x")
        t.heartbeat("a", "x", [{"lease": lease["id"], "cursor": 10}])
        self.assertEqual(t.acquire("b", "x")["status"], "wait")
        t.commit("a", "x", lease["id"])
        self.assertEqual(t.acquire("b", "x")["status"], "done")

    def test_quarantine_after_max_attempts_and_never_with_zero(self):
        for max_attempts, want_q in ((2, 5), (0, 0)):
            clock = Clock()
            t = table(10, clock, max_attempts=max_attempts)
            for round_ in range(3):
                t.register("a", f"i{round_}")
                got = t.acquire("a", f"i{round_}", blocks=5, ttl=1)
                if got["status"] != "ok":
                    break
                t.heartbeat("a", f"i{round_}", [{"lease": got["lease"]["id"], "cursor": got["lease"]["end"]}], ttl=1)
                clock.advance(2)
                t.expire(clock())
            self.assertEqual(t.quarantined.total, want_q)
            t.register("b", "z")
            while (got := t.acquire("b", "z", blocks=10))["status"] == "ok":
                t.commit("b", "z", got["lease"]["id"])
            self.assertEqual(got["status"], "done")
            self.assertEqual(got["quarantined"], want_q)
            if want_q:
                self.assertIn("QUARANTINED", got["warning"])
            books = t.verify()
            self.assertEqual(books["committed"] + books["quarantined"], 10)

    def test_grant_size_follows_throughput(self):
        t = table(10000, self.clock, grant_seconds=10, initial_grant=3)
        for c in ("fast", "slow", "new"):
            t.register(c, "x")
        t.heartbeat("fast", "x", throughput=8.0)
        t.heartbeat("slow", "x", throughput=1.0)
        size = lambda c: (lambda L: L["end"] - L["start"])(t.acquire(c, "x")["lease"])
        self.assertEqual((size("fast"), size("slow"), size("new")), (80, 10, 3))
        t.heartbeat("slow", "x", throughput=2.0)       # it measured itself faster: bigger grants
        self.assertEqual(size("slow"), 20)

    def test_commit_rate_sizes_grants_without_reports(self):
        t = table(10000, self.clock, grant_seconds=10, initial_grant=4)
        t.register("a", "x")
        lease = t.acquire("a", "x")["lease"]
        self.clock.advance(2)
        t.commit("a", "x", lease["id"])
        self.assertEqual(t.clusters["a"].rate, 2.0)
        lease = t.acquire("a", "x")["lease"]
        self.assertEqual(lease["end"] - lease["start"], 20)

    def test_fair_share_and_never_a_made_up_minimum(self):
        t = table(10, self.clock, initial_grant=100)
        t.register("a", "x")
        t.register("b", "x")
        la = t.acquire("a", "x")["lease"]
        self.assertEqual(la["end"] - la["start"], 5)        # half the pool: b is up too
        lb = t.acquire("b", "x")["lease"]
        self.assertEqual(lb["end"] - lb["start"], 5)        # the rest: nobody else is idle
        t.heartbeat("a", "x", [{"lease": la["id"], "cursor": 5}])
        t.heartbeat("b", "x", [{"lease": lb["id"], "cursor": 10}])
        wait = t.acquire("a", "x")
        self.assertEqual(wait["status"], "wait")
        self.assertGreater(wait["retry_after"], 0)
        t.commit("a", "x", la["id"])
        t.commit("b", "x", lb["id"])
        self.assertEqual(t.acquire("a", "x"), {"status": "done", "committed": 10, "quarantined": 0})
        self.assertTrue(t.verify()["complete"])

    def test_commit_is_idempotent_partial_and_checked(self):
        t = table(100, self.clock)
        t.register("a", "i1")
        lease = t.acquire("a", "i1", blocks=10)["lease"]
        self.assertEqual(t.commit("a", "i1", lease["id"], end=4)["committed"], 4)
        self.assertEqual(t.commit("a", "i1", lease["id"], end=4)["committed"], 0)     # same commit twice = one
        self.assertEqual(t.commit("a", "i1", lease["id"], end=3)["committed"], 0)
        with self.assertRaisesRegex(LeaseError, "never in it"):
            t.commit("a", "i1", lease["id"], end=11)
        with self.assertRaisesRegex(LeaseError, "not held"):
            t.commit("a", "other", lease["id"])
        with self.assertRaisesRegex(LeaseError, "unknown lease"):
            t.commit("a", "i1", 99)
        self.assertEqual(t.commit("a", "i1", lease["id"])["committed"], 6)
        self.assertEqual(t.commit("a", "i1", lease["id"])["committed"], 0)           # a closed lease repeats fine
        self.assertEqual((t.committed.total, t.clusters["a"].committed), (10, 10))
        t.verify()

    def test_retried_acquire_returns_the_same_lease(self):
        t = table(100, self.clock)
        t.register("a", "x")
        one = t.acquire("a", "x", request_id="r1")["lease"]
        again = t.acquire("a", "x", request_id="r1")
        self.assertTrue(again["repeat"])
        self.assertEqual(again["lease"]["id"], one["id"])
        self.assertEqual(t.verify()["leased"], one["end"] - one["start"])
        self.assertNotEqual(t.acquire("a", "x", request_id="r2")["lease"]["id"], one["id"])

    def test_incarnation_guard(self):
        t = table(100, self.clock)
        t.register("lumi", "old")
        lease = t.acquire("lumi", "old", ttl=5)["lease"]
        with self.assertRaisesRegex(LeaseError, "--replica") as cm:
            t.register("lumi", "new")
        self.assertEqual(cm.exception.status, 409)
        self.assertEqual(cm.exception.extra, {"code": "incarnation_conflict", "retry_after_s": 5.0})
        t.register("lumi-b", "new")                        # its own stream is fine
        self.clock.advance(6)                              # the old process was SIGKILLed: leases expire
        t.register("lumi", "new")
        for call in (lambda: t.acquire("lumi", "old"), lambda: t.heartbeat("lumi", "old", [lease["id"]]),
                     lambda: t.release("lumi", "old", [])):
            with self.assertRaisesRegex(LeaseError, "stale incarnation"):
                call()
        self.assertEqual(t.acquire("lumi", "new")["status"], "ok")

    def test_release_and_leave(self):
        t = table(100, self.clock)
        t.register("a", "i1")
        lease = t.acquire("a", "i1", blocks=10)["lease"]
        t.commit("a", "i1", lease["id"], end=3)
        self.assertEqual(t.release("a", "i1", [lease["id"]])["released"], 7)
        self.assertEqual(t.verify()["free"], 97)
        self.assertEqual(list(t.free)[0][2], 0)            # a release is not a failed attempt
        t.acquire("a", "i1", blocks=5)
        with self.assertRaisesRegex(LeaseError, "--replica"):
            t.register("a", "i2")
        t.release("a", "i1", [], leave=True)
        t.register("a", "i2")                              # a clean exit frees the stream at once
        self.assertEqual(t.verify()["leased"], 0)

    def test_a_release_from_a_position_gives_back_only_the_tail(self):
        # a phase the clock ended early (train.py --diloco-phase-s) keeps [start, cut) and gives
        # the rest back; the part kept is committed as any lease's, the tail goes to someone else
        t = table(100, self.clock)
        t.register("a", "i1")
        t.register("b", "i1")
        lease = t.acquire("a", "i1", blocks=10)["lease"]
        t.heartbeat("a", "i1", [{"lease": lease["id"], "cursor": 10}])      # all of it claimed
        self.assertEqual(t.release("a", "i1", [{"lease": lease["id"], "from": 6}])["released"], 4)
        books = t.verify()
        self.assertEqual((books["leased"], books["free"]), (6, 94))
        beat = t.heartbeat("a", "i1", [lease["id"]])["leases"][0]
        self.assertEqual((beat["valid"], beat["start"], beat["claimed"], beat["end"]), (True, 0, 6, 6))
        with self.assertRaisesRegex(LeaseError, r"\[6, 10\)"):
            t.commit("a", "i1", lease["id"], end=10)      # the tail is not a's any more
        t.commit("a", "i1", lease["id"], end=6)
        self.assertEqual(t.release("a", "i1", [{"lease": lease["id"], "from": 3}])["released"], 0)   # closed
        other = t.acquire("b", "i1", blocks=100)["lease"]
        self.assertEqual(other["start"], 6)                                   # the tail went back to the pool
        t.commit("b", "i1", other["id"])
        self.assertEqual(t.verify()["committed"], other["end"])
        with self.assertRaises(LeaseError):
            t.release("a", "i1", [{"lease": lease["id"], "from": "6"}])

    def test_a_grant_comes_from_a_free_run_that_holds_it_not_from_a_released_tail(self):
        for fit in (True, False):
            t = table(100, self.clock)
            if not fit:             # a log from before the rule replays the old one: the lowest run, cut short
                t.config = TableConfig.from_dict({k: v for k, v in t.config.to_dict().items() if k != "fit_grants"})
                self.assertFalse(t.config.fit_grants)
            t.register("a", "i1")
            t.register("b", "i1")
            first = t.acquire("a", "i1", blocks=10)["lease"]
            t.acquire("b", "i1", blocks=10)                                  # [10, 20)
            t.release("a", "i1", [{"lease": first["id"], "from": 7}])       # [7, 10) back: a short run
            got = t.acquire("b", "i1", blocks=5)["lease"]
            self.assertEqual((got["start"], got["end"]), (20, 25) if fit else (7, 10))
            if fit:
                small = t.acquire("b", "i1", blocks=2)["lease"]
                self.assertEqual((small["start"], small["end"]), (7, 9))     # the tail serves a small ask
            t.verify()

    def test_a_log_written_before_fitted_grants_replays_as_decided_then(self):
        # tests/old-logs/darl-before-fit-grants.wal.jsonl: a coordinator of the code before the rule
        # (its config has no fit_grants), restarted once with --accept-config-change (a set_config
        # record, whose recorded outcome is that config): it replays, and keeps the old rule
        d = tmpdir(self)
        os.makedirs(os.path.join(d, "darl"))
        shutil.copy(os.path.join(os.path.dirname(__file__), "old-logs", "darl-before-fit-grants.wal.jsonl"),
                    os.path.join(d, "darl", "wal.jsonl"))
        loaded = darl_server.load_state(d)
        self.assertFalse(loaded.table.config.fit_grants)
        self.assertEqual(loaded.table.config.max_attempts, 0)
        self.assertEqual(loaded.table.verify()["leased"], 10)
        self.assertNotIn("fit_grants", loaded.table.config.to_dict())

    def test_verify_catches_broken_books(self):
        t = table(20, self.clock)
        t.register("a", "x")
        lease = t.acquire("a", "x", blocks=10)["lease"]
        t.commit("a", "x", lease["id"], end=5)
        t.verify()
        t.clusters["a"].committed += 1
        with self.assertRaisesRegex(InvariantError, "duplication"):
            t.verify()
        t.clusters["a"].committed -= 1
        t.leases[lease["id"]].start = 3                    # the lease now overlaps committed blocks
        with self.assertRaisesRegex(InvariantError, "disjointness"):
            t.verify()
        t.leases[lease["id"]].start = 5
        t.free.pop_front(1)
        with self.assertRaisesRegex(InvariantError, "completeness"):
            t.verify()

    def test_bad_arguments_change_nothing(self):
        t = table(100, self.clock)
        t.register("a", "x")
        t.acquire("a", "x", blocks=10)
        before = json.dumps(t.to_dict())
        bad = [lambda: t.register("a b", "x"), lambda: t.acquire("a", "x", blocks=0),
               lambda: t.acquire("a", "x", ttl=-1), lambda: t.heartbeat("a", "x", ["one"]),
               lambda: t.heartbeat("a", "x", throughput=float("nan")), lambda: t.commit("a", "x", "1"),
               lambda: t.commit("zz", "x", 1), lambda: t.release("a", "x", [42]),
               lambda: t.acquire("nobody", "x")]
        for call in bad:
            with self.assertRaises(LeaseError):
                call()
        self.assertEqual(json.dumps(t.to_dict()), before)


class DurabilityTest(unittest.TestCase):
    def setUp(self):
        self.dir = tmpdir(self)
        self.clock = Clock()
        self.space = BlockSpace(200, 1, 0)
        self.cfg = TableConfig(min_ttl=1, default_ttl=10, initial_grant=7, grant_seconds=1)

    def coord(self, snapshot_every=1000, grace=30.0):
        return Coordinator(self.space, self.cfg, self.dir, snapshot_every, grace, clock=self.clock)

    def drive(self, c, n=12):
        c.call("register", {"cluster": "a", "incarnation": "x", "digest": self.space.digest()})
        c.call("register", {"cluster": "b", "incarnation": "y", "digest": self.space.digest()})
        for i in range(n):
            who, inc = ("a", "x") if i % 2 else ("b", "y")
            lease = c.call("acquire", {"cluster": who, "incarnation": inc})["lease"]
            self.clock.advance(0.5)
            c.call("heartbeat", {"cluster": who, "incarnation": inc, "leases": [{"lease": lease["id"], "cursor": lease["end"]}]})
            if i % 3:
                c.call("commit", {"cluster": who, "incarnation": inc, "lease": lease["id"], "end": lease["end"] - 1})
        part = c.call("acquire", {"cluster": "b", "incarnation": "y", "blocks": 6})["lease"]
        c.call("release", {"cluster": "b", "incarnation": "y", "leases": [{"lease": part["id"], "from": part["start"] + 2}]})
        late = c.call("acquire", {"cluster": "a", "incarnation": "x", "blocks": 3, "ttl": 1})["lease"]
        self.clock.advance(60)          # every lease expires; then a late commit takes `late` back from the pool
        c.call("commit", {"cluster": "a", "incarnation": "x", "lease": late["id"]})
        return c

    def books(self, c):
        d = json.loads(json.dumps(c.table.to_dict()))
        for row in d["leases"]:
            row[8] = None           # expiry: the restart extends it on purpose
        return json.dumps(d)

    def test_replay_and_snapshot_rebuild_the_same_table(self):
        for every in (1000, 5):     # log only; snapshots plus a log tail
            self.dir = tmpdir(self)
            first = self.drive(self.coord(every))
            want = self.books(first)
            first.wal.close()       # the process dies: no clean snapshot
            again = self.coord(every)
            self.assertEqual(self.books(again), want)
            again.table.verify()
            if every == 5:
                self.assertTrue(os.path.exists(os.path.join(self.dir, "darl", "snapshot.json")))

    def test_a_snapshot_killed_before_its_rename_leaves_nothing_after_the_restart(self):
        first = self.drive(self.coord(5))
        want = self.books(first)
        first.wal.close()
        torn = os.path.join(self.dir, "darl", "snapshot.json.tmp-4242")    # written, never renamed
        with open(torn, "w") as f:
            f.write('{"v": 2, "seq": 1')
        again = self.coord(5)
        self.assertEqual(self.books(again), want)
        self.assertFalse(os.path.exists(torn))
        self.assertEqual(sorted(os.listdir(os.path.join(self.dir, "darl"))), ["lock", "snapshot.json", "wal.jsonl"])
    def test_the_log_is_cut_by_a_snapshot_even_when_no_process_lives_long_enough(self):
        """Each process makes fewer than --snapshot-every changes before it is killed: the log
        since the last snapshot counts across restarts, so it does not grow without bound."""
        snap = os.path.join(self.dir, "darl", "snapshot.json")
        for life in range(4):
            c = self.coord(snapshot_every=10)
            c.call("register", {"cluster": "a", "incarnation": "x", "digest": self.space.digest()})
            for _ in range(4):
                c.call("heartbeat", {"cluster": "a", "incarnation": "x"})
            c.wal.close()                                   # killed: no snapshot at exit
        self.assertTrue(os.path.exists(snap), "20 changes over 4 lives, --snapshot-every 10: no snapshot")
        with open(snap) as f:
            snap_seq = json.load(f)["seq"]
        log = darl_server.WriteAheadLog.read(os.path.join(self.dir, "darl", "wal.jsonl"))
        last = log.records[-1]["seq"] if log.records else log.header["seq"]
        self.assertLess(last - snap_seq, 10, "the log holds more than --snapshot-every changes")

    def test_torn_tail_is_dropped_and_a_damaged_complete_line_is_refused(self):
        """Only the bytes after the last newline are a torn write; a complete line that
        fails its checksum, the last one included, may have been acknowledged."""
        first = self.drive(self.coord())
        want = self.books(first)
        first.wal.close()
        wal = os.path.join(self.dir, "darl", "wal.jsonl")
        with open(wal, "ab") as f:
            f.write(b'{"v":2,"seq":999,"op":"acq')          # the crash hit mid-write
        again = self.coord()
        self.assertEqual(self.books(again), want)
        self.assertEqual(again.status()["torn_bytes_dropped"], 26)
        again.call("heartbeat", {"cluster": "a", "incarnation": "x"})   # appends cleanly after the cut
        again.wal.close()
        self.coord().wal.close()
        with open(wal, "rb") as f:
            good = f.read()
        lines = good.split(b"\n")
        last = len(b"\n".join(lines[:-2])) + 1
        with open(wal, "wb") as f:                      # the last complete line damaged, its newline intact
            f.write(b"\n".join(lines[:-2] + [lines[-2].replace(b'"a"', b'"\x00"'), b""]))
        with self.assertRaises(LogError) as cm:
            self.coord()
        self.assertIn(f"byte {last} (line {len(lines) - 1}): checksum mismatch in a complete line", str(cm.exception))
        with open(wal, "rb") as f:
            self.assertNotEqual(f.read(), good, "the refused start changed the log")
        at = len(b"\n".join(lines[:3])) + 1
        for damaged, what in ((lines[3][:-3] + b"fff", "checksum mismatch"),
                              (b'{"v":2,"seq":3,"op":"acquire","args":{', "no checksum")):
            with open(wal, "wb") as f:
                f.write(b"\n".join(lines[:3] + [damaged] + lines[4:]))
            with self.assertRaises(LogError) as cm:
                self.coord()
            self.assertIn(f"byte {at} (line 4): {what} in a complete line", str(cm.exception))
            self.assertIn(f"truncate -s {at} {wal}", str(cm.exception))
        with open(wal, "wb") as f:
            f.write(b"\n".join(lines[:3] + [darl_server._line({"v": 3, "seq": 3})] + lines[4:]))
        with self.assertRaisesRegex(LogError, "version 3"):
            self.coord()
        with open(wal, "wb") as f:                      # an intact line of an older darl_server
            f.write(b'{"v":1,"seq":1,"t":1.0,"op":"register","args":{}}\n')
        with self.assertRaisesRegex(LogError, "older darl_server.py"):
            self.coord()

    def test_a_lost_snapshot_or_log_stops_the_start_instead_of_serving_an_old_table(self):
        """snapshot.json and wal.jsonl name each other (the log id); either one missing, or a
        log that is not the snapshot's, stops the start: none of them is a fresh start."""
        c = self.coord(snapshot_every=5)
        c.call("register", {"cluster": "a", "incarnation": "x", "digest": self.space.digest()})
        for _ in range(2):
            lease = c.call("acquire", {"cluster": "a", "incarnation": "x", "blocks": 5})["lease"]
            c.call("commit", {"cluster": "a", "incarnation": "x", "lease": lease["id"]})
        held = c.call("acquire", {"cluster": "a", "incarnation": "x", "blocks": 5})["lease"]   # change 6, after the snapshot
        c.wal.close()
        d = os.path.join(self.dir, "darl")
        snap, wal = os.path.join(d, "snapshot.json"), os.path.join(d, "wal.jsonl")
        saved = {p: pathlib.Path(p).read_bytes() for p in (snap, wal)}
        os.remove(snap)                                   # the log alone, continuing snapshot 5
        with self.assertRaisesRegex(LogError, r"snapshot.json is missing, and .* continues snapshot 5"):
            self.coord()
        with open(snap, "wb") as f:
            f.write(saved[snap])
        os.remove(wal)                                    # the snapshot alone: change 6 would vanish
        with self.assertRaisesRegex(LogError, r"wal.jsonl is missing .*\(change 5\)"):
            self.coord()
        header = json.loads(saved[wal].split(b"\n")[0].rsplit(b"\t", 1)[0])
        with open(wal, "wb") as f:                        # a log of another snapshot
            f.write(darl_server._line({**header, "log": "0" * 16}) + saved[wal].split(b"\n", 1)[1])
        with self.assertRaisesRegex(LogError, "is not the one the snapshot .* names"):
            self.coord()
        lines = saved[wal].split(b"\n")
        with open(wal, "wb") as f:                        # a change logged twice (two writers)
            f.write(b"\n".join(lines[:2] + lines[1:]))
        with self.assertRaisesRegex(LogError, "change 6, 'acquire'.* does not follow change 6"):
            self.coord()
        with open(wal, "wb") as f:
            f.write(saved[wal])
        self.assertEqual(os.listdir(d).count("snapshot.json"), 1)
        again = self.coord(snapshot_every=5)
        self.assertEqual(again.table.committed.total, 10)
        self.assertIn(held["id"], again.table.leases)
        again.wal.close()

    def test_a_crash_between_a_snapshot_and_the_log_restart_keeps_the_changes_logged_meanwhile(self):
        """A snapshot is written outside the lock, so changes go on into the old log meanwhile.
        A crash once the snapshot is in place but before the log restarts leaves the log the
        previous snapshot named, holding changes after this one: they are replayed, and the
        restart's new log (the snapshot's log id) carries them over."""
        c = self.coord()
        c.call("register", {"cluster": "a", "incarnation": "x", "digest": self.space.digest()})
        first = c.call("acquire", {"cluster": "a", "incarnation": "x", "blocks": 5})["lease"]
        with c.lock:
            snap, header, cut = c._capture()                  # the table at change 2
        later = c.call("acquire", {"cluster": "a", "incarnation": "x", "blocks": 5})["lease"]
        c.call("commit", {"cluster": "a", "incarnation": "x", "lease": first["id"]})
        snap["crc"] = darl_server._snapshot_crc(snap)
        durable.write_json(os.path.join(self.dir, "darl", "snapshot.json"), snap, separators=(",", ":"))
        want = self.books(c)
        c.wal.close()                                         # killed before the log restarts
        again = self.coord()
        self.assertEqual(self.books(again), want)
        self.assertIn(later["id"], again.table.leases)
        self.assertEqual(again.table.committed.total, 5)
        wal = os.path.join(self.dir, "darl", "wal.jsonl")
        log = darl_server.WriteAheadLog.read(wal)
        self.assertEqual((log.header["seq"], log.header["log"]), (snap["seq"], snap["log"]))
        self.assertEqual([r["seq"] for r in log.records][:2], [snap["seq"] + 1, snap["seq"] + 2])
        again.call("heartbeat", {"cluster": "a", "incarnation": "x"})
        want = self.books(again)
        again.wal.close()
        third = self.coord()
        self.assertEqual(self.books(third), want)
        third.wal.close()

    def test_one_process_per_state_dir(self):
        """A second coordinator on the same state dir (another --port, a stale unit) stops
        before reading or writing anything: two writers would each lease the same blocks."""
        c = self.coord()
        c.call("register", {"cluster": "a", "incarnation": "x", "digest": self.space.digest()})
        wal = os.path.join(self.dir, "darl", "wal.jsonl")
        before = pathlib.Path(wal).read_bytes()
        with self.assertRaisesRegex(SystemExit, f"{self.dir}/darl is in use by another darl_server \\(pid {os.getpid()}"):
            self.coord()
        out = subprocess.run([sys.executable, "darl_server.py", "--num-samples", "200", "--state-dir", self.dir,
                              "--port", "0"], cwd=ROOT, capture_output=True, text=True, timeout=120)
        self.assertEqual(out.returncode, 1, out.stderr)
        self.assertIn("is in use by another darl_server", out.stderr)
        self.assertNotIn("Traceback", out.stderr)
        self.assertEqual(pathlib.Path(wal).read_bytes(), before, "the refused start touched the log")
        c.wal.close()                                     # the first one dies: the dir is free again
        self.coord().wal.close()

    def test_a_failed_fsync_stops_the_process(self):
        """EIO from fsync leaves the change in memory and maybe not on disk: exit 75, unanswered."""
        code = ("import os, sys, block_space, darl_server, darl_server\n"
                "def eio(fd): raise OSError(5, 'Input/output error')\n"
                "darl_server._datasync = eio\n"
                "s = block_space.BlockSpace(10, 1, 0)\n"
                "c = darl_server.Coordinator(s, state_dir=sys.argv[1])\n"
                "c.call('register', {'cluster': 'a', 'incarnation': 'x', 'digest': s.digest()})\n"
                "print('answered')\n")
        self.assert_stops_unanswered(code, "answered", "cannot flush the log to disk")

    def assert_stops_unanswered(self, code, after, says):
        """`code`, run in a child process on this state dir, exits 75 before it prints `after`."""
        out = subprocess.run([sys.executable, "-c", code, self.dir], cwd=ROOT, capture_output=True, text=True,
                             timeout=120)
        self.assertEqual(out.returncode, 75, out.stdout + out.stderr)
        self.assertNotIn(after, out.stdout)
        self.assertIn(says, out.stderr)

    def test_a_failed_directory_fsync_after_the_log_restart_stops_the_process(self):
        """The restarted log is renamed into place but its directory's fsync fails (EIO):
        appending to it would acknowledge changes a power cut may take away, so exit 75."""
        code = ("import os, sys, block_space, darl_server, durable\n"
                "s = block_space.BlockSpace(10, 1, 0)\n"
                "c = darl_server.Coordinator(s, state_dir=sys.argv[1])\n"
                "c.call('register', {'cluster': 'a', 'incarnation': 'x', 'digest': s.digest()})\n"
                "calls, real = [], durable.fsync_dir\n"
                "def eio(path):\n"                       # the snapshot's rename is durable, the log's is not
                "    calls.append(path)\n"
                "    if len(calls) == 2: raise OSError(5, 'Input/output error')\n"
                "    real(path)\n"
                "durable.fsync_dir = eio\n"
                "c.snapshot()\n"
                "print('served on')\n")
        self.assert_stops_unanswered(code, "served on", "may not be durable")

    def test_every_line_is_versioned_checksummed_and_fsynced_before_the_reply(self):
        synced = []                  # the log's size at each flush to disk: what that flush made durable
        real = darl_server._datasync

        def spy(fd):
            real(fd)
            synced.append(os.fstat(fd).st_size)
        darl_server._datasync = spy
        self.addCleanup(setattr, darl_server, "_datasync", real)
        c = self.coord()
        wal = os.path.join(self.dir, "darl", "wal.jsonl")
        call, replies = c.call, []

        def checked(op, args):       # at each reply, the line it logged is already flushed
            reply = call(op, args)
            self.assertTrue(synced, f"{op} replied before any flush")
            self.assertEqual(synced[-1], os.path.getsize(wal), f"{op} replied before its line was flushed")
            replies.append(op)
            return reply
        c.call = checked
        self.drive(c, n=2)
        self.assertGreaterEqual(len(replies), 6)
        with open(wal, "rb") as f:
            lines = f.read().splitlines()
        recs = []
        for line in lines:
            payload, crc = line.rsplit(b"\t", 1)
            self.assertEqual(crc, b"%08x" % zlib.crc32(payload))
            recs.append(json.loads(payload))
        self.assertTrue(all(r["v"] == 2 for r in recs))
        self.assertEqual(recs[0]["op"], "header")
        self.assertEqual(recs[0]["config"], self.cfg.to_dict())
        self.assertEqual([r["seq"] for r in recs[1:]], list(range(1, len(recs))))
        self.assertEqual(len(recs) - 1, len(replies))
        self.assertTrue(all(len(r["out"]) == 8 for r in recs[1:]))
        self.assertEqual(c.wal.durable, c.seq)

    def test_restore_grace(self):
        c = self.coord(grace=30.0)
        c.call("register", {"cluster": "a", "incarnation": "x", "digest": self.space.digest()})
        lease = c.call("acquire", {"cluster": "a", "incarnation": "x", "ttl": 2})["lease"]
        c.wal.close()
        self.clock.advance(5)         # the coordinator was down longer than the TTL
        again = self.coord(grace=30.0)
        self.assertEqual(again.table.leases[lease["id"]].expires, self.clock() + 30)
        self.clock.advance(29)
        beat = again.call("heartbeat", {"cluster": "a", "incarnation": "x", "leases": [lease["id"]]})
        self.assertTrue(beat["leases"][0]["valid"])
        again.wal.close()
        self.clock.advance(1)
        self.assertIn(lease["id"], self.coord(grace=30.0).table.leases)   # the restore itself was logged

    def test_digest_checks(self):
        c = self.coord()
        with self.assertRaisesRegex(LeaseError, "digest mismatch"):
            c.call("register", {"cluster": "a", "incarnation": "x", "digest": BlockSpace(201, 1, 0).digest()})
        self.assertEqual(c.seq, 0)
        c.call("register", {"cluster": "a", "incarnation": "x", "digest": self.space.digest()})
        c.close()
        self.space = BlockSpace(300, 1, 0)
        with self.assertRaisesRegex(LogError, "another block space"):
            self.coord()


class LoggedDecisionsTest(unittest.TestCase):
    """The log replays what was decided: under the flags it recorded, each record checked
    against the outcome it recorded; damage is refused with the file and the byte offset."""

    def setUp(self):
        self.dir = tmpdir(self)
        self.clock = Clock()
        self.space = BlockSpace(20, 1, 0)

    def coord(self, accept=False, **cfg):
        cfg = TableConfig(**{"min_ttl": 1, "default_ttl": 10, "initial_grant": 5, **cfg})
        return Coordinator(self.space, cfg, self.dir, clock=self.clock,
                           **({"accept_config_change": True} if accept else {}))

    def test_a_restart_under_other_leasing_flags_never_re_decides_the_log(self):
        c = self.coord(max_attempts=1)
        c.call("register", {"cluster": "a", "incarnation": "x", "digest": self.space.digest()})
        first = c.call("acquire", {"cluster": "a", "incarnation": "x", "blocks": 5, "ttl": 2})["lease"]
        c.call("heartbeat", {"cluster": "a", "incarnation": "x", "leases": [{"lease": first["id"], "cursor": 5}]})
        self.clock.advance(5)                  # expires claimed: quarantined under --max-attempts 1
        second = c.call("acquire", {"cluster": "a", "incarnation": "x", "blocks": 5, "ttl": 60})["lease"]
        self.assertEqual((second["start"], second["end"]), (5, 10))
        c.wal.close()                          # killed: no snapshot, the log alone
        with self.assertRaises(SystemExit) as cm:                   # the guide's advice: --max-attempts 0
            self.coord(max_attempts=0)
        self.assertIn("--max-attempts was 1, this start has 0", str(cm.exception))
        self.assertIn("--accept-config-change", str(cm.exception))
        again = self.coord(accept=True, max_attempts=0)
        L = again.table.leases[second["id"]]
        self.assertEqual((L.start, L.end), (5, 10), "replay re-decided the lease the client holds")
        self.assertEqual(again.table.quarantined.total, 5)
        self.assertEqual(again.table.config.max_attempts, 0)
        again.wal.close()
        again = self.coord(max_attempts=0)                          # the change is logged: no refusal now
        self.assertEqual(again.table.config.max_attempts, 0)
        again.wal.close()
        with self.assertRaises(SystemExit):                         # and 1 is now the change
            self.coord(max_attempts=1)
        for flag, value in (("min_ttl", 2.0), ("max_ttl", 99.0), ("default_ttl", 20.0), ("grant_seconds", 9.0),
                            ("initial_grant", 3), ("max_grant", 4)):
            with self.subTest(flag), self.assertRaises(SystemExit) as cm:
                self.coord(max_attempts=0, **{flag: value})
            self.assertIn("--" + flag.replace("_", "-"), str(cm.exception))

    def test_a_damaged_record_stops_the_start_at_its_byte_offset(self):
        c = self.coord()
        c.call("register", {"cluster": "a", "incarnation": "x", "digest": self.space.digest()})
        for _ in range(3):
            c.call("acquire", {"cluster": "a", "incarnation": "x", "blocks": 5})
        c.call("heartbeat", {"cluster": "a", "incarnation": "x"})
        c.wal.close()
        wal = os.path.join(self.dir, "darl", "wal.jsonl")
        with open(wal, "rb") as f:
            data = f.read()
        at = data.index(b'"blocks":5')
        line_start = data.rindex(b"\n", 0, at) + 1
        for old, new in ((b'"blocks":5', b'"blocks":7'), (b'"op":"acquire"', b'"oq":"acquire"')):
            with self.subTest(new):
                i = data.index(old, line_start)
                with open(wal, "wb") as f:      # valid JSON, other meaning (or a key gone)
                    f.write(data[:i] + new + data[i + len(old):])
                with self.assertRaises(LogError) as cm:
                    self.coord()
                self.assertIn(f"byte {line_start}", str(cm.exception))
        with open(wal, "wb") as f:              # intact checksum, unreplayable record (a bug, not damage)
            lines = data.split(b"\n")
            lines[2] = darl_server._line({"v": 2, "seq": 2, "t": 1000.0, "op": "acquire", "args": {"nope": 1},
                                          "out": "00000000"}).rstrip(b"\n")
            f.write(b"\n".join(lines))
        with self.assertRaisesRegex(LogError, "cannot be replayed"):
            self.coord()

    def test_a_replay_that_decides_otherwise_than_recorded_stops(self):
        c = self.coord()
        c.call("register", {"cluster": "a", "incarnation": "x", "digest": self.space.digest()})
        c.call("acquire", {"cluster": "a", "incarnation": "x", "blocks": 5})
        c.call("heartbeat", {"cluster": "a", "incarnation": "x"})
        c.wal.close()
        wal = os.path.join(self.dir, "darl", "wal.jsonl")
        with open(wal, "rb") as f:
            lines = f.read().split(b"\n")
        rec = json.loads(lines[2].rsplit(b"\t", 1)[0])
        rec["out"] = "deadbeef"                 # a log written under other rules
        lines[2] = darl_server._line(rec).rstrip(b"\n")
        with open(wal, "wb") as f:
            f.write(b"\n".join(lines))
        with self.assertRaisesRegex(LogError, "replays to another outcome than the one it recorded"):
            self.coord()

    def test_a_damaged_snapshot_stops_the_start_naming_the_file(self):
        c = self.coord()
        c.call("register", {"cluster": "a", "incarnation": "x", "digest": self.space.digest()})
        c.call("acquire", {"cluster": "a", "incarnation": "x", "blocks": 5})
        c.close()                                   # a clean stop: the books are in snapshot.json
        snap_path = os.path.join(self.dir, "darl", "snapshot.json")
        with open(snap_path) as f:
            good = json.load(f)
        again = self.coord()
        self.assertEqual(again.table.leases.keys(), {1}, "the intact snapshot does not restore")
        again.wal.close()
        with open(snap_path, "w") as f:             # valid JSON, another meaning, the old checksum
            json.dump({**good, "table": {**good["table"], "leases": []}}, f)
        with self.assertRaises(LogError) as cm:
            self.coord()
        self.assertIn(snap_path, str(cm.exception))
        self.assertIn("checksum does not match", str(cm.exception))
        with open(snap_path, "w") as f:             # cut short
            f.write(json.dumps(good)[:40])
        with self.assertRaisesRegex(LogError, "unreadable snapshot"):
            self.coord()

    def test_the_config_a_snapshot_records_decides_a_restart(self):
        """A crash between writing snapshot.json and starting the log afresh leaves the old
        log, whose header names the flags it began under; a change logged after that header
        is inside the snapshot, so the snapshot's config is the one a restart compares."""
        c = self.coord(max_attempts=1)
        c.call("register", {"cluster": "a", "incarnation": "x", "digest": self.space.digest()})
        c.wal.close()
        c = self.coord(accept=True, max_attempts=0)        # logs set_config after a max_attempts=1 header
        c.call("acquire", {"cluster": "a", "incarnation": "x", "blocks": 5})
        wal = os.path.join(self.dir, "darl", "wal.jsonl")
        with open(wal, "rb") as f:
            old_log = f.read()
        self.assertTrue(c.snapshot())                        # takes the lock itself
        c.wal.close()
        with open(wal, "wb") as f:                           # the crash: the log was never restarted
            f.write(old_log)
        again = self.coord(max_attempts=0)
        self.assertEqual(again.table.config.max_attempts, 0)
        self.assertEqual(len(again.table.leases), 1)
        again.wal.close()
        with self.assertRaises(SystemExit) as cm:
            self.coord(max_attempts=1)
        self.assertIn("--max-attempts was 0, this start has 1", str(cm.exception))

    def test_custody_and_its_counters_survive_snapshots_and_replay(self):
        for every in (1000, 3):
            with self.subTest(snapshot_every=every):
                self.dir = tmpdir(self)
                c = Coordinator(self.space, TableConfig(min_ttl=1, default_ttl=10), self.dir, every,
                                clock=self.clock)
                c.call("register", {"cluster": "a", "incarnation": "x", "digest": self.space.digest()})
                L = c.call("acquire", {"cluster": "a", "incarnation": "x", "blocks": 5})["lease"]
                agg = {"aggregator": "agg", "epoch": 1}
                self.assertEqual(c.call("fence", {"aggregator": "agg", "last_epoch": 0, "claim": "c1"})["epoch"], 1)
                c.call("take_custody", {**agg, "delta": "d1", "cluster": "a", "incarnation": "x",
                                        "leases": [{"lease": L["id"]}]})
                c.call("abort_custody", {**agg, "delta": "d1", "why": "test"})
                with self.assertRaises(LeaseError):
                    c.call("commit_custody", {**agg, "delta": "d1"})      # refused, counted, logged
                want = c.status()["violations"]
                self.assertEqual(want, {"refused_commits": 1, "aborted_custody": 1, "blocks_trained_twice": 5,
                                        "refused_aborts": 0})
                c.wal.close()
                again = Coordinator(self.space, TableConfig(min_ttl=1, default_ttl=10), self.dir, every,
                                    clock=self.clock)
                self.assertEqual(again.status()["violations"], want)
                self.assertEqual(again.table.custody[("agg", "d1")].state, "aborted")
                with self.assertRaises(LeaseError) as cm:                   # the epoch is fenced after replay
                    again.call("commit_custody", {"aggregator": "agg", "epoch": 0, "delta": "d1"})
                self.assertEqual(cm.exception.extra["code"], "fenced")
                again.close()


    def test_the_fence_holder_and_round_watermark_survive_snapshots_and_replay(self):
        """The holder that confirmed an epoch and the highest committed round are rebuilt by
        a restart (from the log, or a snapshot), so a copy of the aggregator's state is fenced
        after DARL restarts too; a log line without the new fields replays as before."""
        for every in (1000, 2):
            with self.subTest(snapshot_every=every):
                self.dir = tmpdir(self)
                cfg = TableConfig(min_ttl=1, default_ttl=10)
                c = Coordinator(self.space, cfg, self.dir, every, clock=self.clock)
                c.call("register", {"cluster": "a", "incarnation": "x", "digest": self.space.digest()})
                L = c.call("acquire", {"cluster": "a", "incarnation": "x", "blocks": 5})["lease"]
                self.assertEqual(c.call("fence", {"aggregator": "agg", "last_epoch": 0, "claim": "c1"})["epoch"], 1)
                c.call("confirm_fence", {"aggregator": "agg", "epoch": 1, "claim": "c1", "holder": "hA"})
                agg = {"aggregator": "agg", "epoch": 1}
                c.call("take_custody", {**agg, "delta": "d1", "cluster": "a", "incarnation": "x",
                                        "leases": [{"lease": L["id"]}]})
                c.call("commit_custody", {**agg, "delta": "d1", "round": 1})
                c.wal.close()
                again = Coordinator(self.space, cfg, self.dir, every, clock=self.clock)
                row = again.status()["aggregators"][0]
                self.assertEqual((row["epoch"], row["holder"], row["round"]), (1, "hA", 1))
                for ask in ({"last_holder": "hB", "round": 1}, {"last_holder": "hA", "round": 0}):
                    with self.assertRaises(LeaseError) as cm:
                        again.call("fence", {"aggregator": "agg", "last_epoch": 1, "claim": "c2", **ask})
                    self.assertEqual(cm.exception.extra["code"], "fenced")
                self.assertEqual(again.call("fence", {"aggregator": "agg", "last_epoch": 1, "claim": "c3",
                                                      "last_holder": "hA", "round": 1})["epoch"], 2)
                again.close()


class TableClockTest(unittest.TestCase):
    """Leases live on DARL's own clock: a wall-clock step of an hour, either way, neither
    expires nor extends them in a running process, and a restart never goes back in time."""

    def setUp(self):
        self.dir = tmpdir(self)
        self.wall, self.mono = Clock(1_000_000.0), Clock(50.0)
        self.space = BlockSpace(20, 1, 0)

    def coord(self, grace=30.0):
        return Coordinator(self.space, TableConfig(min_ttl=1, default_ttl=10), self.dir, restore_grace=grace,
                           wall=self.wall, monotonic=self.mono)

    def test_a_wall_clock_step_of_an_hour_either_way(self):
        c = self.coord()
        c.call("register", {"cluster": "a", "incarnation": "x", "digest": self.space.digest()})
        L = c.call("acquire", {"cluster": "a", "incarnation": "x", "blocks": 5, "ttl": 10})["lease"]
        beat = lambda: c.call("heartbeat", {"cluster": "a", "incarnation": "x", "leases": [L["id"]]})["leases"][0]
        self.wall.advance(3600)                 # NTP, an operator, a VM resumed: one hour forward
        self.mono.advance(5)
        self.assertTrue(beat()["valid"], "a forward step expired the lease")
        self.wall.advance(-7200)                # and two back
        self.mono.advance(11)                   # the TTL after the last heartbeat
        self.assertFalse(beat()["valid"], "a backward step extended the lease")

    def test_restarts_across_a_step_keep_leases_by_restore_grace_and_never_go_back(self):
        c = self.coord()
        c.call("register", {"cluster": "a", "incarnation": "x", "digest": self.space.digest()})
        L = c.call("acquire", {"cluster": "a", "incarnation": "x", "blocks": 5, "ttl": 10})["lease"]
        t_last = c.clock()
        c.wal.close()
        self.wall.advance(3600)                 # DARL was down while the wall clock jumped an hour
        again = self.coord(grace=30.0)
        self.assertAlmostEqual(again.table.leases[L["id"]].expires, again.clock() + 30.0)
        again.wal.close()
        self.wall.advance(-7200)                # down again, and the wall clock now an hour behind
        third = self.coord(grace=30.0)
        self.assertGreaterEqual(third.clock(), t_last + 3600, "DARL's clock went back across a restart")
        self.assertIn(L["id"], third.table.leases)


class LiveServer:
    """A Coordinator behind the real HTTP server on 127.0.0.1, in this process."""

    def __init__(self, num_blocks, state_dir=None, token=None, clock=time.time, **cfg):
        self.space = BlockSpace(num_blocks, 1, 0)
        cfg = {"min_ttl": 1.0, "default_ttl": 10.0, "grant_seconds": 0.5, "initial_grant": 8, **cfg}
        self.coord = Coordinator(self.space, TableConfig(**cfg), state_dir, clock=clock)
        self.server = httpd.make_server(darl_server.make_routes(self.coord), token=token, max_body=4096)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = self.server.url

    def close(self):
        self.server.shutdown()
        self.server.server_close()


class HTTPTest(unittest.TestCase):
    def setUp(self):
        self.live = LiveServer(100, tmpdir(self), token="tok")
        self.addCleanup(self.live.close)
        self.client = darl_client.LeaseClient(self.live.url, token="tok")
        self.addCleanup(self.client.close)

    def raw(self, path, body, token="tok"):
        conn = httpc.connect(self.live.url)
        try:
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            conn.request("POST", path, body=data, headers=httpc.auth_headers(token))
            resp = conn.getresponse()
            return resp.status, json.loads(resp.read())
        finally:
            conn.close()

    def test_every_bad_input_is_a_4xx_that_changes_nothing(self):
        d = self.live.space.digest()
        self.client.register("a", "x", d)
        lease = self.client.acquire("a", "x", blocks=5)["lease"]
        before, seq = json.dumps(self.live.coord.table.to_dict()), self.live.coord.seq
        ident = {"cluster": "a", "incarnation": "x"}
        cases = [("/register", b"{not json", 400), ("/register", b"[1, 2]", 400),
                 ("/register", {"cluster": "a", "incarnation": "y", "digest": "wrong"}, 409),
                 ("/acquire", {"cluster": "ghost", "incarnation": "x"}, 404),
                 ("/acquire", {**ident, "blocks": "many"}, 400),
                 ("/acquire", {"cluster": "a"}, 400),
                 ("/heartbeat", {**ident, "leases": "all"}, 400),
                 ("/commit", {**ident, "lease": 12345}, 404),
                 ("/commit", {**ident, "lease": lease["id"], "end": 50}, 409),   # blocks not held
                 ("/commit", {"cluster": "a", "incarnation": "other", "lease": lease["id"]}, 409),
                 ("/acquire", {"cluster": "a", "incarnation": "other"}, 409),    # wrong incarnation
                 ("/release", {**ident, "leases": [777]}, 404),
                 ("/acquire", {**ident, "pad": "x" * 5000}, 413),
                 ("/nowhere", {}, 404)]
        for path, body, status in cases:
            got, reply = self.raw(path, body)
            self.assertEqual(got, status, (path, body if len(str(body)) < 100 else "big", reply))
            self.assertIsInstance(reply["error"], str)
            self.assertNotIn("\n", reply["error"])
        self.assertEqual(self.raw("/acquire", {**ident}, token="bad")[0], 401)
        self.assertEqual(json.dumps(self.live.coord.table.to_dict()), before)
        self.assertEqual(self.live.coord.seq, seq)
        self.assertEqual(self.client.commit("a", "x", lease["id"])["committed"], 5)   # still serving
        self.assertEqual(httpc.call(self.live.url, "GET", "/health")["service"], "darl")

    def test_status_shows_clusters_and_quarantine_loudly(self):
        d = self.live.space.digest()
        self.client.register("a", "x", d)
        lease = self.client.acquire("a", "x", blocks=4)["lease"]
        self.client.commit("a", "x", lease["id"])
        st = self.client.status()
        self.assertEqual((st["committed"], st["clusters"][0]["committed"]), (4, 4))
        st["quarantined"], st["quarantined_runs"] = 3, [[10, 13]]
        text = darl_server.format_status(st)
        self.assertIn("4/100 blocks committed", text)
        self.assertIn("3 BLOCKS QUARANTINED", text)
        out = subprocess.run([sys.executable, "darl_server.py", "status", "--url", self.live.url],
                             cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PWW_TOKEN": "tok"})
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertIn("a ", out.stdout)

    def test_register_and_status_describe_the_space_a_site_can_rebuild(self):
        clock = Clock()
        self.live = LiveServer(100, tmpdir(self), token="tok", clock=clock)
        self.addCleanup(self.live.close)
        self.client = darl_client.LeaseClient(self.live.url, token="tok")
        self.addCleanup(self.client.close)
        d = self.live.space.digest()
        for reply in (self.client.register("a", "x", d), self.client.status()):
            self.assertEqual(reply["digest"], d)
            sp = reply["space"]
            self.assertEqual((sp["num_samples"], sp["block_size"], sp["seed"], sp["algorithm"]),
                             (100, 1, 0, block_space.PERMUTATION_VERSION))
            self.assertIn("manifest_digest", sp)
            rebuilt = BlockSpace(sp["num_samples"], sp["block_size"], sp["seed"], sp["manifest_digest"])
            self.assertEqual(rebuilt.digest(), d)
        status, reply = self.raw("/register", {"cluster": "b", "incarnation": "y", "digest": "wrong"})
        self.assertEqual((status, reply["digest"], reply["space"]["num_blocks"]), (409, d, 100))
        self.client.acquire("a", "x", ttl=50)
        clock.advance(12)
        status, reply = self.raw("/register", {"cluster": "a", "incarnation": "x2", "digest": d})
        self.assertEqual((status, reply["code"]), (409, "incarnation_conflict"), reply)
        self.assertEqual(reply["retry_after_s"], 38.0, reply)            # until the old lease expires

    def test_session_ttl_follows_phase_time_and_rtt(self):
        s = darl_client.LeaseSession(self.client, "a", self.live.space.digest(), phase_s=2.0)
        self.client.rtt_s = 0.1
        self.assertAlmostEqual(s.ttl_s, 2.5 * 2.0 + 10 * 0.1)
        s.end_phase(8.0, blocks=16)          # slowed down: asks for a longer lease at once
        self.assertAlmostEqual(s.ttl_s, 2.5 * 8.0 + 1.0)
        self.assertEqual(s.throughput, 2.0)
        s.end_phase(1.0)
        self.assertAlmostEqual(s.phase_s, 4.5)

    def test_sessions_heartbeat_reply_shrinks_the_span_they_hand_out(self):
        d = self.live.space.digest()
        mk = lambda c, **kw: darl_client.LeaseSession(self.client, c, d, span_blocks=2, log=lambda m: None, **kw)
        got_a, got_b = [], []

        def drain(session, got):
            while (span := session.next_span(timeout=60)) is not None:
                got.append(span)
                session.commit(span)
        with mk("a", lease_blocks=100) as a:
            first = a.next_span(timeout=30)
            expect(lambda: a._ready, "a's prefetch", timeout_s=60, interval_s=0.02)
            with mk("b") as b:            # registers after a took the whole pool: it must steal
                stolen = b.next_span(timeout=30)
                got_b.append(stolen)
                b.commit(stolen)
                threads = [threading.Thread(target=drain, args=(b, got_b))]
                threads.append(threading.Thread(target=drain, args=(a, got_a)))
                a.commit(first)
                got_a.append(first)
                for t in threads:
                    t.start()
                for t in threads:
                    t.join(timeout=60)
        pos_a = [p for s in got_a for p in s.positions()]
        pos_b = [p for s in got_b for p in s.positions()]
        self.assertGreaterEqual(stolen.start, 4)          # a's tail, past what a had claimed
        self.assertEqual(sorted(pos_a + pos_b), list(range(100)))
        self.assertTrue(self.client.status()["complete"])


class ConcurrencyTest(unittest.TestCase):
    def run_sessions(self, url, digest, space, n, per_block_s, reports, commit_s=None, before_commit=None):
        """n sessions in threads; each reports ("commit", blocks) or ("lost", span), and
        ("error", traceback) if anything else ends it. commit_s: each commit is repeated
        (httpc's rule) for that long without an answer (None: one attempt)."""
        def deadline():
            return None if commit_s is None else httpc.Deadline(commit_s, max_wait_s=1.0, log=httpc.quiet)

        def worker(i):
            try:
                with darl_client.LeaseClient(url) as client, \
                        darl_client.LeaseSession(client, f"c{i}", digest, span_blocks=2, phase_s=1.0,
                                                 log=lambda m: None) as s:
                    while (span := s.next_span(timeout=300)) is not None:
                        time.sleep(per_block_s * len(span) * (i + 1))
                        if before_commit is not None:
                            before_commit()
                        try:
                            s.commit(span, deadline=deadline())
                        except darl_client.LeaseLost:
                            reports[i].append(("lost", span))
                            continue
                        reports[i].append(("commit", [space.block_at(p) for p in span.positions()]))
            except BaseException:
                reports[i].append(("error", traceback.format_exc()))
                raise
        threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(n)]
        for t in threads:
            t.start()
        return threads

    def audit(self, reports, m):
        self.assertEqual([e for r in reports for kind, e in r if kind == "error"], [])
        seen = collections.Counter(b for r in reports for kind, blocks in r if kind == "commit" for b in blocks)
        dup = [b for b, k in seen.items() if k > 1]
        self.assertEqual(dup, [])
        self.assertEqual(sorted(seen), list(range(m)))

    def test_four_threads_400_blocks_no_duplicates(self):
        live = LiveServer(400, tmpdir(self))
        self.addCleanup(live.close)
        reports = [[] for _ in range(4)]
        for t in self.run_sessions(live.url, live.space.digest(), live.space, 4, 0.001, reports):
            t.join(timeout=120)
            self.assertFalse(t.is_alive())
        self.audit(reports, 400)
        with darl_client.LeaseClient(live.url) as client:
            st = client.status()
        self.assertTrue(st["complete"])
        self.assertEqual(sum(c["committed"] for c in st["clusters"]), 400)

    def test_coordinator_sigkilled_under_load_restarts_exactly_once(self):
        state = tmpdir(self)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        m = 400
        args = ["--min-ttl", "2", "--default-ttl", "5", "--grant-seconds", "0.3", "--initial-grant", "6",
                "--snapshot-every", "60", "--restore-grace", "30", "--port", str(port)]

        def start():
            proc = subprocess.Popen([sys.executable, "darl_server.py", "--num-samples", str(m), "--seed", "0",
                                     "--state-dir", state, *args], cwd=ROOT, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True)
            self.addCleanup(lambda: proc.poll() is None and (proc.kill(), proc.wait(30)))
            return proc, listening_url(proc, timeout=120)[0]

        proc, url = start()
        space = BlockSpace(m, 1, 0)
        reports = [[] for _ in range(4)]
        crashed = threading.Event()
        committed = lambda: sum(len(b) for r in reports for kind, b in r if kind == "commit")

        def hold_at_half():          # nobody commits past half the epoch before the crash
            if committed() >= m // 2:
                self.assertTrue(crashed.wait(timeout=300), "the coordinator was never killed")
        # a commit's deadline (200 s without an answer) beyond any restart of the coordinator below
        threads = self.run_sessions(url, space.digest(), space, 4, 0.004, reports, commit_s=200,
                                    before_commit=hold_at_half)
        expect(lambda: committed() >= 100, "100 commits before the crash", timeout_s=60, interval_s=0.02)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        at_crash = committed()
        crashed.set()
        self.assertLess(at_crash, m)                     # mid-epoch: at most half plus the spans in flight
        proc, url2 = start()
        self.assertEqual(url2, url)
        for t in threads:
            t.join(timeout=300)
            self.assertFalse(t.is_alive())
        self.audit(reports, m)
        with darl_client.LeaseClient(url) as client:
            st = client.status()
        self.assertTrue(st["complete"])
        self.assertIsNone(st["invariant_error"])
        proc.send_signal(signal.SIGTERM)                  # clean stop: flush, snapshot, exit 0
        self.assertEqual(proc.wait(timeout=30), 0)
        self.assertTrue(os.path.exists(os.path.join(state, "darl", "snapshot.json")))


class SimulateTest(unittest.TestCase):
    def test_simulate_kills_a_cluster_mid_lease_and_prints_pass(self):
        out = subprocess.run([sys.executable, "darl_simulate.py", "--clusters", "3", "--kill", "1",
                              "--late", "1", "--blocks", "150", "--fastest", "80", "--delay", "0.5"],
                             cwd=ROOT, capture_output=True, text=True, timeout=300)
        self.assertEqual(out.returncode, 0, out.stdout + out.stderr)
        self.assertIn("PASS: coverage is exactly once", out.stdout)
        rows = {line.split()[0]: line.split() for line in out.stdout.splitlines() if line.startswith("sim-")}
        self.assertEqual(sorted(rows), ["sim-0", "sim-1", "sim-2"], out.stdout)
        self.assertIn("SIGKILLed", rows["sim-1"])            # printed only for a worker that died by SIGKILL
        self.assertEqual([n for n, r in rows.items() if "SIGKILLed" in r], ["sim-1"])
        self.assertGreater(int(rows["sim-1"][3]), 0, "the killed cluster lost the span it held")
        self.assertGreaterEqual(int(rows["sim-1"][1]), 2 * 4, "it committed two spans before the kill")

    def test_help_is_the_docstring(self):
        out = subprocess.run([sys.executable, "darl_simulate.py", "--help"], cwd=ROOT, capture_output=True,
                             text=True, timeout=60)
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertIn("--clusters", out.stdout)
        self.assertIn("PASS: coverage is exactly once", out.stdout)

    def test_audit_reports_duplicates_and_missing(self):
        reports = {"x": [{"event": "commit", "t": 1.0, "lease": 1, "start": 0, "end": 2, "blocks": [0, 1]}],
                   "y": [{"event": "span", "t": 1.0, "lease": 2, "start": 2, "end": 4},
                         {"event": "commit", "t": 2.0, "lease": 2, "start": 2, "end": 4, "blocks": [1, 3]}]}
        rows, dup, missing = darl_simulate.audit(5, reports)
        self.assertEqual((dup, missing), ([1], [2, 4]))
        self.assertEqual([r["committed"] for r in rows], [2, 2])


if __name__ == "__main__":
    unittest.main()
