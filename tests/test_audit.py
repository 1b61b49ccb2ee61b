"""audit.py against real durable state: a DARL coordinator (write-ahead log on disk, served
on 127.0.0.1) and an aggregator merging real deltas into a state dir, driven to the end of
the corpus with injected clocks; then each way the books can be wrong, made on disk, must
be named and FAIL, and the command line must say PASS/FAIL with exit 0/1."""
import json
import os
import subprocess
import sys
import unittest

import audit
import block_space
import darl_server
import darl_table
import durable
import fedmom_state
import fedmom_state as fs
import httpc
from fixtures import FedMomFixture, serve_in_thread

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BLOCKS = 12
TOKEN = "audit-token"


class AuditTest(FedMomFixture):
    def setUp(self):
        super().setUp()
        self.central = os.path.join(self.dir, "central")

    def run_(self, blocks_left=0, max_attempts=3, quarantine=0):
        """Two sites train BLOCKS blocks 3 at a time through DARL and the aggregator until
        `blocks_left` remain; `quarantine` blocks die with their site first."""
        space = block_space.BlockSpace(BLOCKS, 1, 0)
        self.coord = darl_server.Coordinator(space, darl_table.TableConfig(min_ttl=1.0, max_attempts=max_attempts),
                                             self.central, clock=self.clock)
        url = self.darl_url = serve_in_thread(self, darl_server.make_routes(self.coord), token=TOKEN)
        cfg = fs.ServerConfig(os.path.join(self.central, "fedmom"), init=self.init, outer_lr=1.0, outer_momentum=0.0)
        st = self.st = fs.FedMomState(cfg.validate(), clock=self.clock, darl=fedmom_state.DarlLink(url, TOKEN))
        call = lambda path, **body: httpc.call(url, "POST", path, body, token=TOKEN)
        for c in ("alpha", "beta"):
            call("/register", cluster=c, incarnation=f"{c}-inc", digest=space.digest())
            st.join(c, f"{c}-inc")
        if quarantine:
            L = call("/acquire", cluster="alpha", incarnation="alpha-inc", blocks=quarantine, ttl=1)["lease"]
            call("/heartbeat", cluster="alpha", incarnation="alpha-inc", leases=[{"lease": L["id"], "cursor": L["end"]}])
            self.clock.t += 5                        # the site died mid-phase: expired, quarantined
        while self.coord.status()["free"] > blocks_left:
            for c in sorted(st.members):
                got = call("/acquire", cluster=c, incarnation=f"{c}-inc", blocks=3, ttl=60)
                if got["status"] != "ok":          # nothing left for it: it leaves the rounds (as train.py does)
                    st.leave(c, f"{c}-inc")
                    continue
                L = got["lease"]
                n = L["end"] - L["start"]
                self.send(st, c, self.delta()[0], 10 * n, leases=[{"id": L["id"], "start": L["start"], "end": L["end"]}])
            self.assertIsNotNone(st.tick())
            self.assertTrue(st.darl_tick())
        return space

    def check(self, *, ok, says=(), partial=False, manifest=None):
        report = audit.audit(self.central, partial, manifest)
        text = "\n".join(report.lines)
        self.assertEqual(report.ok, ok, text)
        for word in says:
            self.assertIn(word, text)
        return report

    def test_a_clean_run_passes_block_by_block_and_the_command_says_so(self):
        space = self.run_()
        report = self.check(ok=True, says=["12 inside exactly one merged delta", "PASS"])
        self.assertEqual(set(report.status.values()), {"once"})
        out = subprocess.run([sys.executable, "audit.py", "--state-dir", self.central, "--blocks"], cwd=ROOT,
                             capture_output=True, text=True, timeout=60)
        self.assertEqual(out.returncode, 0, out.stdout + out.stderr)
        lines = [l for l in out.stdout.splitlines() if l.startswith("block ")]
        self.assertEqual(len(lines), BLOCKS)
        self.assertEqual(sorted(int(l.split()[1]) for l in lines), list(range(BLOCKS)))
        self.assertIn(f"block {space.block_at(0)} (position 0): once - round 1 delta r0.", lines[0])

    def test_blocks_still_open_fail_unless_the_run_is_partial(self):
        self.run_(blocks_left=6)
        self.check(ok=False, says=["6 blocks OPEN: positions [6, 12)"])
        self.check(ok=True, partial=True, says=["6 open", "still open"])

    def test_quarantined_blocks_are_said_and_the_rest_must_be_once(self):
        self.run_(max_attempts=1, quarantine=2)
        self.check(ok=True, says=["2 blocks QUARANTINED", "or quarantined", "10 inside exactly one"])

    def edit_records(self, fn):
        path = os.path.join(self.central, "fedmom", "rounds.jsonl")
        recs = durable.read_jsonl(path)
        recs = fn(recs)
        with open(path, "w") as f:
            f.write("".join(json.dumps(r) + "\n" for r in recs))
        with open(os.path.join(self.central, "fedmom", "state.json")) as f:
            st = json.load(f)
        st["round"] = recs[-1]["round"]
        with open(os.path.join(self.central, "fedmom", "state.json"), "w") as f:
            json.dump(st, f)

    def test_a_delta_merged_twice_is_doubled(self):
        self.run_()
        self.edit_records(lambda recs: recs + [{**recs[-1], "round": recs[-1]["round"] + 1}])
        self.check(ok=False, says=["doubled", "DOUBLED: positions", "merged in more than one round"])

    def test_a_merged_delta_without_custody_and_custody_without_a_merged_delta(self):
        self.run_()

        def rename(recs):
            o = [o for o in recs[0]["outcomes"] if o["outcome"] == "merged"][0]
            o["delta"] = "r0.0000000000000000"
            return recs
        self.edit_records(rename)
        self.check(ok=False, says=["DARL holds no custody of it", "that no merged round of this aggregator holds",
                                   "MISSING"])

    def test_a_merged_delta_whose_custody_the_operator_aborted(self):
        self.run_(blocks_left=3)
        L = httpc.call(self.darl_url, "POST", "/acquire", {"cluster": "alpha", "incarnation": "alpha-inc",
                                                           "blocks": 3, "ttl": 60}, token=TOKEN)["lease"]
        self.send(self.st, "alpha", self.delta()[0], 30, leases=[L])
        self.st.leave("beta", "beta-inc")
        self.assertIsNotNone(self.st.tick())                     # merged, its commit owed ...
        self.coord.call("abort_orphaned", {"aggregator": self.st.aggregator_id, "reason": "wrongly thought lost"})
        self.assertFalse(self.st.darl_tick())                    # ... and fenced: it never lands
        self.check(ok=False, says=["is merged, but DARL aborted its custody (aborted by the operator: wrongly "
                                   "thought lost)", "aborted_custody 1"])

    def test_the_aggregators_positions_must_be_darls(self):
        self.run_()
        self.check(ok=True)

        def shift(recs):
            o = [o for o in recs[0]["outcomes"] if o["outcome"] == "merged"][0]
            o["pieces"] = [[lid, a + 1, b + 1] for lid, a, b in o["pieces"]]
            return recs
        self.edit_records(shift)
        self.check(ok=False, says=["the aggregator's positions", "differ from DARL's"])

    def test_rounds_lost_counters_and_tokens_are_checked(self):
        space = self.run_()
        self.edit_records(lambda recs: recs[:1] + recs[2:])
        self.check(ok=False, says=["rounds lost or repeated"])
        self.tearDown_run()
        manifest = os.path.join(self.dir, "manifest.json")
        with open(manifest, "w") as f:
            json.dump({"num_windows": BLOCKS + 4, "heldout_windows": 4, "seq_len": 10}, f)
        self.check(ok=True, manifest=manifest, says=["120 tokens = 12 training windows x 10"])
        with open(manifest, "w") as f:
            json.dump({"num_windows": BLOCKS + 4, "heldout_windows": 4, "seq_len": 11}, f)
        self.check(ok=False, manifest=manifest, says=["differs by -12"])
        state = os.path.join(self.central, "fedmom", "state.json")
        with open(state) as f:
            st = json.load(f)
        st["violations"]["refused_commits"] = 1
        with open(state, "w") as f:
            json.dump(st, f)
        self.check(ok=False, says=["the aggregator's violation counters: refused_commits 1"])

    def tearDown_run(self):
        """Start over on a clean run in a fresh dir (the edits above are not undone)."""
        self.dir = os.path.join(self.dir, "again")
        os.makedirs(self.dir)
        self.central = os.path.join(self.dir, "central")
        self.run_()

    def test_damaged_darl_state_is_a_fail_naming_the_file_and_offset(self):
        self.run_()
        wal = os.path.join(self.central, "darl", "wal.jsonl")
        with open(wal, "rb") as f:
            lines = f.read().split(b"\n")
        lines[3] = lines[3].replace(b'"blocks":3', b'"blocks":4')
        with open(wal, "wb") as f:
            f.write(b"\n".join(lines))
        report = self.check(ok=False, says=["DARL's state cannot be read", wal, "in a complete line"])
        self.assertEqual(report.status, {})
        out = subprocess.run([sys.executable, "audit.py", "--state-dir", self.central], cwd=ROOT,
                             capture_output=True, text=True, timeout=60)
        self.assertEqual(out.returncode, 1)
        self.assertIn("FAIL", out.stdout)


if __name__ == "__main__":
    unittest.main()
