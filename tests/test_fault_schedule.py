"""The fast subset of bench/fault_schedule.py, on testbed/fault_harness.py: eight fixed schedules that between
them inject every kind of fault (real darl_server.py, fedmom_server.py and blobstore.py
processes, fake torch-free sites on the real clients) and run every kind of site (f32,
int4 with error feedback, overlapped, time-budgeted; an aggregator with --down-wire int4
whose sites fetch theta by its updates, inline and through the blob store, and one with
--phase-s and the quorum rule), each judged by the oracle; the pipelined round among them
(the aggregator killed mid-merge while the sites follow its update, and mid-way through a
streamed check; a site killed mid-apply; a round the sites built whole from a killed merge
that the restart merged otherwise: discarded, never trained from); and the oracle itself
shown to catch a tampered run, of either aggregator. The full run (>= 500 random schedules) is
`python bench/fault_schedule.py`.

Deterministic: the schedules are fixed, and what the oracle requires holds for every
interleaving the processes may take; a fault waits for its protocol phase (a fault point
or a count of deltas sent), never for a time. The only clocks are the lease TTLs the
outages and stops must outlast, and a deadline that bounds a hang. Each schedule puts
its long pauses (an outage, a stopped site) last and triggers early, so the other
sites cannot finish the corpus before every fault was injected, however slow the
machine. Where a time-budgeted site trims a span and where a round closes by quorum
do follow clocks, so the time-budgeted schedule asks only that both happen: its sites'
seeded slow phases end on their clocks however fast the machine is (a slower one trims
more), and a site stopped after its lease check, past the first round (which every
member's tokens must reach), leaves the others' rounds only the quorum to close by.
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

import numpy as np

import durable
from testbed import fault_harness as fsch
from testbed import fault_oracle
import outer_state
import tensorio
import wire
from testbed.fault_harness import Fault, Schedule

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

INLINE, BLOB = "inline", "blob"
SCHEDULES = {
    "a torn log line, a kill between a durable round and its commits, an overlapped site killed after its send "
    "(training its next span); an int4 site and --down-wire int4":
        Schedule(101, [("alpha", INLINE), ("beta", INLINE)], 26, 2, 3,
                 [Fault("darl_kill", 0, point="darl.torn", skip=2, pause=0.5),
                  Fault("fedmom_kill", 1, point="fedmom.round_durable", pause=1.0),
                  Fault("site_kill", 3, point="site.sent", target="beta", pause=0.5)], ["alpha"], ["beta"],
                 int4=["alpha"], down_wire="int4"),
    "the blob store killed mid-upload, an aggregator outage past the TTL, a site stopped after its lease check "
    "while a newcomer trains its blocks":
        Schedule(102, [("alpha", BLOB), ("beta", INLINE)], 24, 2, 0,
                 [Fault("blob_kill", 1, point="blob.chunk", pause=0.5),
                  Fault("fedmom_outage", 1, pause=2.5 * fsch.TTL[1]),
                  Fault("site_stop", 2, point="site.checked", target="beta", value="newcomer")]),
    "DARL restarted under a changed flag, a clock step of +1 h, a token rotation, a kill before custody is spooled":
        Schedule(103, [("alpha", INLINE), ("beta", INLINE), ("gamma", BLOB)], 28, 2, 3,
                 [Fault("darl_flag", 1, value=("--max-attempts", 0)),
                  Fault("clock_step", 1, value=3600),
                  Fault("fedmom_kill", 2, point="fedmom.custody_held", pause=0.3),
                  Fault("token_rotation", 2)], ["gamma"]),
    "DARL killed after its fsync, a kill mid-merge, a clock step of -1 h, a site stopped past its TTL, a stale "
    "copy of the aggregator started twice; an int4 blob site and --down-wire int4":
        Schedule(104, [("alpha", INLINE), ("beta", BLOB)], 24, 3, 0,
                 [Fault("darl_kill", 0, point="darl.synced", skip=1, pause=0.3),
                  Fault("fedmom_kill", 1, point="fedmom.merge", pause=0.3),
                  Fault("clock_step", 1, value=-3600),
                  Fault("site_stop", 2, point="site.trained", target="alpha"),
                  Fault("stale_aggregator", 2, value=2)], int4=["beta"], down_wire="int4"),
    "time-budgeted sites under --phase-s and the quorum rule: spans trimmed where a clock ran out, DARL killed "
    "while it logs, a site stopped after its lease check while rounds close by quorum without it":
        Schedule(107, [("alpha", INLINE), ("beta", BLOB), ("gamma", INLINE)], 30, 2, 0,
                 [Fault("darl_kill", 1, point="darl.append", skip=1, pause=0.3),
                  Fault("site_stop", 3, point="site.checked", target="gamma")], overlapped=["beta"],
                 phase_s=0.4, quorum=0.5, grace_frac=0.2, timed={"alpha": 0.1, "beta": 0.13, "gamma": 0.08}),
    "the pipelined round: the aggregator killed mid-merge while the sites follow its update (mid-update, and "
    "with the whole update written but the round not durable), a site killed in its streamed apply; "
    "--down-wire int4":
        Schedule(108, [("alpha", INLINE), ("beta", BLOB)], 24, 2, 0,
                 [Fault("publish_kill", 0, point="fedmom.merge", pause=0.5),
                  Fault("apply_kill", 1, point="site.follow", target="alpha", pause=0.3),
                  Fault("publish_kill", 2, point="fedmom.merge", skip=1, pause=0.3)], int4=["alpha"],
                 down_wire="int4"),
    "the aggregator killed mid-way through the streamed check of a blob delta, twice; a site killed in its "
    "streamed apply; --down-wire int4":
        Schedule(109, [("alpha", BLOB), ("beta", BLOB)], 24, 2, 0,
                 [Fault("check_kill", 0, point="fedmom.check_stream", pause=0.3),
                  Fault("apply_kill", 1, point="site.follow", target="beta", skip=1, pause=0.3),
                  Fault("check_kill", 2, point="fedmom.check_stream", skip=1, pause=0.3)], down_wire="int4"),
    "the aggregator killed with the round's whole update written and followed, a newcomer's delta merged into "
    "that round at the restart: the round made durable is not the one the sites built, and they discard it; "
    "--down-wire int4":
        Schedule(110, [("alpha", INLINE), ("beta", INLINE)], 24, 2, 0,
                 [Fault("publish_kill", 1, point="fedmom.merge", skip=1, pause=0.3, value="newcomer")],
                 int4=["beta"], down_wire="int4"),
    "each site its own credential; alpha's revoked while its delta is in (the round not merged yet), "
    "beta's while it trains on a lease; each meets the 403 and is requeued with a new credential":
        Schedule(111, [("alpha", INLINE), ("beta", BLOB)], 24, 2, 0,
                 [Fault("site_revoke", 1, point="site.sent", target="alpha"),
                  Fault("site_revoke", 3, point="site.trained", target="beta")]),
}


class FaultScheduleTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.work = tempfile.mkdtemp(prefix="fault-schedule-")

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.work, ignore_errors=True)

    def run_one(self, name):
        sched = SCHEDULES[name]
        res = fsch.run_schedule(sched.seed, self.work, sched=sched)
        self.assertEqual(res.findings, [], fsch.describe_failure(res, sched))
        self.assertEqual(res.injected, res.armed, f"a fault was never reached, so it was not tested:\n"
                                                  f"{sched.describe()}\ninjected {dict(res.injected)}")
        self.assertGreater(res.rounds, 0)
        return res

    def assert_down_wire(self, res):
        """int4 deltas were sent, and sites took theta by the aggregator's int4 updates (followed
        as they were merged, adopted once durable)."""
        self.assertGreaterEqual(res.seen["sent_int4"], 1, "no int4 delta was sent")
        self.assertGreaterEqual(res.seen["theta_via_followed"], 1, "no site took theta by a followed update")

    def test_torn_write_durable_round_and_site_kill(self):
        res = self.run_one(list(SCHEDULES)[0])
        # beta is overlapped: some of its spans were leased and trained while a delta was in flight
        self.assertGreaterEqual(res.seen["trained_in_flight"], 1, "beta never trained on while a delta was in flight")
        self.assert_down_wire(res)

    def test_blob_kill_outage_and_site_stop(self):
        res = self.run_one(list(SCHEDULES)[1])
        self.assertGreaterEqual(res.seen["refused"], 1, "the newcomer's blocks never met the stopped site's "
                                                        "delta: the custody refusal at upload was not reached")

    def test_flag_change_clock_step_token_rotation(self):
        self.run_one(list(SCHEDULES)[2])

    def test_synced_kill_merge_kill_clock_back_stale_aggregator_and_stop(self):
        self.assert_down_wire(self.run_one(list(SCHEDULES)[3]))

    def test_trims_and_quorum_closes_under_faults(self):
        res = self.run_one(list(SCHEDULES)[4])
        self.assertEqual(res.kinds["timed"], 3)
        self.assertGreaterEqual(res.seen["trimmed_merged"], 1, "no span a site's clock trimmed was merged")
        self.assertGreaterEqual(res.seen["quorum_closed"], 1, "no round closed by quorum")
        # gamma's delta, for a round the others closed by quorum while it was stopped
        self.assertGreaterEqual(res.seen["stale"], 1, "no late delta was refused stale")

    def test_merge_killed_while_sites_follow_and_a_site_killed_mid_apply(self):
        """Every theta a site trained from is the durable round's (the oracle); some came
        followed, adopted once their round was durable."""
        res = self.run_one(list(SCHEDULES)[5])
        self.assertGreaterEqual(res.seen["theta_via_followed"], 1, "no site adopted a followed theta")

    def test_streamed_check_killed_and_a_site_killed_mid_apply(self):
        res = self.run_one(list(SCHEDULES)[6])
        self.assertGreaterEqual(res.seen["theta_via_followed"], 1, "no site adopted a followed theta")

    def test_a_followed_round_that_never_became_durable_is_discarded(self):
        """The sites built round r+1's theta from the killed merge; the restart merged another
        round r+1 (with a newcomer's delta too): each discards what it built (the oracle: no span trained
        from a theta other than the durable round's; fedsite.Follow.adopt without its digest
        comparison fails here)."""
        res = self.run_one(list(SCHEDULES)[7])
        self.assertGreaterEqual(res.seen["follow_discarded"], 1, "no site discarded a followed theta")
        # ... and took the durable round by its update instead (GET /theta_update: the theta it holds)
        self.assertGreaterEqual(res.seen["theta_via_update"], 1, "no site fetched theta by an update")

    def test_credentials_revoked_mid_round_lose_and_double_nothing(self):
        """Custody holds across a revocation: alpha's accepted delta is merged (or its blocks go back),
        beta's lease expires as a dead site's; coverage exactly once and the audit (the oracle)."""
        self.run_one(list(SCHEDULES)[8])       # reached: each revoked site met the 403 and exited (run_one)

    def test_every_fault_kind_is_in_the_fast_subset(self):
        kinds = {f.kind for s in SCHEDULES.values() for f in s.faults}
        self.assertEqual(kinds, set(fsch.KINDS))


def flip_low_bit(a):
    """The lowest mantissa bit of element 0 of float32 array `a` flipped, in place."""
    a.reshape(-1).view(np.uint32)[0] ^= np.uint32(1)


class OracleTest(unittest.TestCase):
    """The oracle fails a run whose books were tampered with after a clean finish."""
    SCHED = Schedule(105, [("alpha", INLINE), ("beta", INLINE)], 12, 2, 0, [])

    @classmethod
    def setUpClass(cls):
        cls.work = tempfile.mkdtemp(prefix="fault-oracle-")
        cls.sched = cls.SCHED
        cls.res = fsch.run_schedule(cls.sched.seed, cls.work, keep=True, sched=cls.sched)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.work, ignore_errors=True)

    def tampered(self):
        d = tempfile.mkdtemp(prefix="tampered-", dir=self.work)
        shutil.rmtree(d)
        shutil.copytree(self.res.workdir, d)
        run = fsch.Run.__new__(fsch.Run)
        run.s, run.dir, run.findings = self.sched, d, []
        run.central, run.records = os.path.join(d, "central"), os.path.join(d, "records")
        run.init, run.committed_seen, run.max_round_seen = os.path.join(d, "init.safetensors"), set(), 0
        return run

    def test_the_clean_run_passes(self):
        self.assertEqual(self.res.findings, [])
        self.assertEqual(fault_oracle.oracle(self.tampered()), [])

    def test_a_round_applied_twice_is_caught(self):
        run = self.tampered()
        path = os.path.join(run.central, "fedmom", "rounds.jsonl")
        with open(path) as f:
            lines = f.readlines()
        last = json.loads(lines[-1])
        with open(path, "a") as f:
            f.write(json.dumps({**last, "round": last["round"] + 1}) + "\n")
        found = "\n".join(fault_oracle.oracle(run))
        self.assertIn("DOUBLED", found)
        self.assertIn("rounds lost or repeated", found)

    def tamper(self, run, what, tensor, change):
        """The stopped aggregator's last round made its checkpoint (`fedmom_server.py
        checkpoint`: nothing replayed on top), then change(array) applied in place to `what`
        ("theta", "momentum", "residual") of `tensor` in its segment, and the checkpoint's
        theta digest dropped from state.json: books made to agree with the change, so that
        only the oracle's replay can find it."""
        fed = os.path.join(run.central, "fedmom")
        out = subprocess.run([sys.executable, "fedmom_server.py", "checkpoint", "--state-dir", fed], cwd=ROOT,
                             capture_output=True, text=True, timeout=300)
        self.assertEqual(out.returncode, 0, out.stdout + out.stderr)
        with open(os.path.join(fed, "state.json")) as f:
            st = json.load(f)
        self.assertEqual(st["log"], [])
        for fn in outer_state.checkpoint_files(fed, st["checkpoint"]):
            path = os.path.join(fed, fn)
            with tensorio.TensorReader(path) as r:
                if r.metadata["tensor"] != tensor:
                    continue
                arrays, meta = {k: np.array(r.read(k), np.float32) for k in r.names}, dict(r.metadata)
            change(arrays[what])
            with tensorio.TensorWriter(path, [(k, "F32", a.shape) for k, a in arrays.items()], meta,
                                            fsync=False) as w:
                for k, a in arrays.items():
                    w.write(k, a)
            st["checkpoint"]["digest"] = None
            with open(os.path.join(fed, "state.json"), "w") as f:
                json.dump(st, f)
            return
        self.fail(f"no segment of {tensor!r} in {fed}")

    def test_a_wrong_theta_is_caught(self):
        run = self.tampered()
        self.tamper(run, "theta", "w", lambda a: a.__iadd__(np.float32(0.001)))
        found = "\n".join(fault_oracle.oracle(run))
        self.assertIn("theta differs from the float32 replay", found)
        if self.SCHED.down_wire == "f32":
            self.assertIn("theta_global differs from the float64 replay", found)

    def test_one_bit_of_theta_or_momentum_is_caught(self):
        """The float32 replay is bit for bit: one ulp of one element (far inside the float64
        replay's tolerance) is a finding."""
        for what in ("theta", "momentum"):
            with self.subTest(what):
                run = self.tampered()
                self.tamper(run, what, "b", flip_low_bit)
                found = "\n".join(fault_oracle.oracle(run))
                self.assertIn(f"{what} differs from the float32 replay", found)
                self.assertIn("tensors ['b']", found)
                self.assertNotIn("float64 replay", found)

    def test_a_theta_a_site_fetched_is_checked(self):
        run = self.tampered()
        fn = next(fn for fn in sorted(os.listdir(run.records)) if fn.endswith(".jsonl"))
        path = os.path.join(run.records, fn)
        recs = durable.read_jsonl(path)
        self.assertTrue(any(r["event"] == "theta" for r in recs), "the site noted no theta it fetched")
        with open(path, "w") as f:
            for r in recs:
                f.write(json.dumps({**r, "digest": "0" * 64} if r["event"] == "theta" else r) + "\n")
        self.assertIn("fetched a theta_global of round", "\n".join(fault_oracle.oracle(run)))

    def test_a_span_trained_from_a_theta_not_durable_is_caught(self):
        """A site that trained from bits other than the durable round's (as one that adopted a
        followed theta of a merge that never became durable would): its record says so."""
        run = self.tampered()
        fn = next(fn for fn in sorted(os.listdir(run.records)) if fn.endswith(".jsonl"))
        path = os.path.join(run.records, fn)
        recs = durable.read_jsonl(path)
        i = next(i for i, r in enumerate(recs) if r["event"] == "trained")
        recs[i] = {**recs[i], "held_digest": "0" * 64}
        with open(path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in recs)
        self.assertIn("it trained on a round that is not durable", "\n".join(fault_oracle.oracle(run)))

    def test_a_merged_delta_no_site_sent_is_caught(self):
        run = self.tampered()
        for fn in os.listdir(run.records):
            if fn.startswith("beta-") and fn.endswith(".jsonl"):
                os.unlink(os.path.join(run.records, fn))
        found = "\n".join(fault_oracle.oracle(run))
        self.assertIn("merged a delta no site sent", found)

    def test_a_site_record_that_disagrees_with_darl_is_caught(self):
        """The sites' own records are a second witness: beta's first delta said to have trained
        alpha's first positions gives positions in two merged deltas, positions in none, and a
        custody DARL holds other than the positions trained."""
        run = self.tampered()
        trained = {}
        for fn in sorted(os.listdir(run.records)):
            if fn.endswith(".jsonl"):
                for rec in durable.read_jsonl(os.path.join(run.records, fn)):
                    if rec["event"] == "trained":
                        trained.setdefault(rec["cluster"], (fn, rec))
        (fn, beta), (_, alpha) = trained["beta"], trained["alpha"]
        path = os.path.join(run.records, fn)
        with open(path) as f:
            lines = f.readlines()
        with open(path, "w") as f:
            for line in lines:
                rec = json.loads(line)
                if rec == beta:
                    rec = {**rec, "start": alpha["start"], "end": alpha["end"]}
                f.write(json.dumps(rec) + "\n")
        found = "\n".join(fault_oracle.oracle(run))
        self.assertIn("DARL's custody holds", found)
        self.assertIn("are inside more than one merged delta", found)
        self.assertIn("are inside no merged delta", found)

    def test_a_delta_merged_after_its_round_closed_is_caught(self):
        """A late delta (its round closed, by quorum or otherwise) must be refused stale: one
        merged into the round after the next, the site's record and the round's made to agree."""
        run = self.tampered()
        path = os.path.join(run.central, "fedmom", "rounds.jsonl")
        recs = durable.read_jsonl(path)
        o = next(o for o in recs[1]["outcomes"] if o["outcome"] == "merged")
        key = (o["incarnation"], o["base_round"], o["leases"][0]["id"])
        o["base_round"] -= 1
        with open(path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in recs)
        for fn in os.listdir(run.records):
            if fn.endswith(".jsonl"):
                events = durable.read_jsonl(os.path.join(run.records, fn))
                with open(os.path.join(run.records, fn), "w") as f:
                    for e in events:
                        if (e.get("incarnation"), e.get("base_round"), e.get("lease")) == key:
                            e = {**e, "base_round": e["base_round"] - 1}
                        f.write(json.dumps(e) + "\n")
        found = "\n".join(fault_oracle.oracle(run))
        self.assertIn(f"round {recs[1]['round']} merged {o['cluster']}'s delta trained from round "
                      f"{o['base_round']}", found)

    def test_an_acknowledged_commit_lost_is_caught(self):
        run = self.tampered()
        run.committed_seen = {"r0.not-a-delta-we-merged"}
        self.assertIn("no longer a merged delta's", "\n".join(fault_oracle.oracle(run)))


class DownWireOracleTest(OracleTest):
    """The same tampering, and more, caught in a run of an int4 site (beta, through the blob
    store) and an f32 one with the aggregator's --down-wire int4: theta_{r+1} = theta_r +
    decode(encode(step + residual)), replayed bit for bit from the deltas the sites wrote."""
    SCHED = Schedule(106, [("alpha", INLINE), ("beta", BLOB)], 12, 2, 0, [], int4=["beta"], down_wire="int4")

    def test_the_clean_run_passes(self):
        super().test_the_clean_run_passes()
        self.assertGreaterEqual(self.res.seen["sent_int4"], 1)
        self.assertGreaterEqual(self.res.seen["theta_via_followed"], 1)

    def test_one_bit_of_the_residual_is_caught(self):
        run = self.tampered()
        self.tamper(run, "residual", "w", flip_low_bit)
        self.assertIn("residual differs from the float32 replay", "\n".join(fault_oracle.oracle(run)))

    def test_an_int4_delta_other_than_the_one_merged_is_caught(self):
        """beta's first merged delta file, one int4 code changed by one step: the replay
        decodes a delta the aggregator never merged, and theta no longer matches."""
        run = self.tampered()
        trained = [r for fn in sorted(os.listdir(run.records)) if fn.startswith("beta-") and fn.endswith(".jsonl")
                   for r in durable.read_jsonl(os.path.join(run.records, fn)) if r["event"] == "trained"]
        self.assertEqual(trained[0]["wire"], "int4")
        path = os.path.join(run.records, trained[0]["file"])
        with tensorio.TensorReader(path) as r:
            specs = [(k, r.specs[k][0], r.specs[k][1]) for k in r.names]
            parts, meta = {k: np.array(r.read(k)) for k in r.names}, dict(r.metadata)
        code = parts["w"].reshape(-1)[:1]
        low = code & np.uint8(0x0F)
        code[:] = (code & np.uint8(0xF0)) | np.where(low < 15, low + 1, low - 1).astype(np.uint8)
        with tensorio.TensorWriter(path, specs, meta, fsync=False) as w:
            for k, _, _ in specs:
                w.write(k, parts[k])
        wire.WireReader(path).read("w")            # still a valid int4 file
        found = "\n".join(fault_oracle.oracle(run))
        self.assertIn("differs from the float32 replay", found)


if __name__ == "__main__":
    unittest.main()
