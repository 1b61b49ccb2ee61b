"""What the central VM keeps per round (fedmom_state.blob_plan, FedMomState's per-round
files): the disk of a real fedmom_server.py + blobstore.py stays bounded over 61 rounds of
a tiny model, through a SIGKILL mid-sweep; a site 60 rounds behind rejoins with the full
theta; deletions never hold the state lock (fault points, no sleeps)."""
import html
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import types
import unittest

import numpy as np

import fedmom_client
import fedmom_state
import fedmom_state as fs
import httpc
import outer_state
import tensorio
import testhooks
import wire
from testbed.harness import expect, listening_url

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = {"embed": (64, 256), "w": (32, 32), "b": (32,)}      # 17,440 parameters: 70 KB of theta
HANG_S = 120.0                                                # bounds a hang, never waited out


def write_tensors(path, arrays):
    with tensorio.TensorWriter(path, [(k, "F32", a.shape) for k, a in arrays.items()], fsync=False) as w:
        for k, a in arrays.items():
            w.write(k, a)


def bits(path):
    with tensorio.TensorReader(path) as r:
        return {n: r.read(n).view(np.uint32).copy() for n in r.names}


def tree_bytes(root, skip=()):
    """Bytes of every file under root (sidecars and temp files included), but `skip` names."""
    total = 0
    for base, _, files in os.walk(root):
        total += sum(os.path.getsize(os.path.join(base, f)) for f in files if f not in skip)
    return total


class PlanTest(unittest.TestCase):
    """fedmom_state.blob_plan, the rule alone."""

    def test_the_last_k_rounds_of_this_aggregator_stay_and_nothing_else_is_judged(self):
        me, other = "fedmom-aaaa", "fedmom-bbbb"
        ids = [fedmom_state.blob_name(me, k, r) for k in ("theta", "update") for r in range(0, 12)]
        ids += [fedmom_state.blob_name(other, "theta", 1), "theta-1", "update-2", "delta-lumi-x-r3-abcd",
                f"{me}.theta-x", f"{me}.momentum-3", f"{me}.theta-3.bak"]
        plan = fedmom_state.blob_plan(ids, me, 10, 3)
        self.assertEqual({b["blob"] for b in plan}, {fedmom_state.blob_name(me, k, r) for k in ("theta", "update")
                                                     for r in range(12)}, "only this aggregator's own names")
        keep = sorted((b["kind"], b["round"]) for b in plan if b["keep"])
        self.assertEqual(keep, [(k, r) for k in ("theta", "update") for r in (8, 9, 10, 11)])
        why = {(b["kind"], b["round"]): b["why"] for b in plan}
        self.assertEqual(why[("update", 10)], "the current round's update")
        self.assertIn("last 3 rounds", why[("theta", 8)])
        self.assertIn("newer than round 10", why[("theta", 11)])     # published after the sweep read the round
        self.assertIn("takes the full theta", why[("update", 7)])
        self.assertEqual([b["round"] for b in plan], sorted(b["round"] for b in plan))
        for rnd, keep in ((5, True), (4, False)):
            plan = fedmom_state.blob_plan([fedmom_state.blob_name(me, "theta", rnd)], me, 5, 1)
            self.assertEqual([b["keep"] for b in plan], [keep])

    def test_keep_rounds_below_one_is_refused_naming_the_flag(self):
        for bad in (0, -1, 1.5):
            with self.subTest(bad), self.assertRaises(SystemExit) as cm:
                fs.ServerConfig("st", keep_rounds=bad).validate()
            self.assertIn("--keep-rounds", str(cm.exception))

    def test_the_page_and_the_alarms_show_what_is_kept_and_a_failed_sweep(self):
        import fedmom_server
        import status_page
        ret = {"keep_rounds": 3, "state": [{"file": "theta-7.safetensors", "bytes": 2 << 30,
                                            "why": "theta_global of the current round"},
                                           {"file": "spool/r7_lumi_x.safetensors", "bytes": 1 << 20,
                                            "why": "lumi's delta for the open round 7"}],
               "blobs": {"keep_rounds": 3, "swept_round": 7, "error": "ConnectionRefusedError: refused", "deleted": 4,
                         "recent_deleted": [], "kept": [{"blob": "fedmom-aaaa.update-7", "kind": "update", "round": 7,
                                                         "keep": True, "bytes": 512 << 20,
                                                         "why": "the current round's update"}]}}
        st = {"round": 7, "merging": False, "members": [], "pending": [], "events": [], "excluded": [],
              "dropped": [], "pending_commits": 0, "parameters": 1000, "tensors": 2,
              "config": {"outer_lr": 0.7, "outer_momentum": 0.9}, "retention": ret}
        alarms = fedmom_server.alarm_lines(st)
        self.assertEqual(len(alarms), 1)
        self.assertIn("retention sweep of the blob store failed (ConnectionRefusedError: refused)", alarms[0])
        page = status_page.render({"status": st, "alarms": alarms, "rows": [], "now": 2e9, "saved": False,
                                   "darl": None, "darl_error": None, "blob": None, "blob_error": None,
                                   "disk": {"state_bytes": 5 << 20, "state_free_bytes": 100 << 30}})
        for text in ("theta_global of the current round", "fedmom-aaaa.update-7", "the current round's update",
                     "512.00 MiB", "--keep-rounds 3 (as of the sweep at round 7); 4 blob(s) deleted",
                     "r7_lumi_x.safetensors"):
            self.assertIn(text, html.unescape(page))
        self.assertNotIn("spool/", page, "no path on the page")
        lines = fedmom_server.retention_lines(ret)
        self.assertIn("kept in the blob store (--keep-rounds 3; as of the sweep at round 7; 4 blob(s) deleted "
                      "by this process):", lines)


class Live(unittest.TestCase):
    """An aggregator with --down-wire int4 and a blob store, as processes on 127.0.0.1."""

    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="retention-")
        self.addCleanup(shutil.rmtree, self.dir, True)
        self.faults = os.path.join(self.dir, "faults")
        os.makedirs(self.faults)
        rng = np.random.default_rng(7)
        self.init = os.path.join(self.dir, "init.safetensors")
        write_tensors(self.init, {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()})
        self.deltas = []
        for i in range(2):
            self.deltas.append(os.path.join(self.dir, f"delta-{i}.safetensors"))
            write_tensors(self.deltas[-1], {k: (0.01 * rng.standard_normal(s)).astype(np.float32)
                                            for k, s in SHAPES.items()})
        self.sd, self.blob_root = os.path.join(self.dir, "st"), os.path.join(self.dir, "blobs")
        self.said = []

    def spawn(self, *args, port=0):
        proc = subprocess.Popen([sys.executable, *args, "--port", str(port)], cwd=ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, testhooks.FAULT_DIR_ENV: self.faults})
        self.addCleanup(lambda: proc.poll() is None and (proc.kill(), proc.wait(30)))
        url, self.output = listening_url(proc, timeout=HANG_S)
        return proc, url

    def start(self, *extra, port=0):
        self.fed, self.url = self.spawn("fedmom_server.py", "--state-dir", self.sd, "--down-wire", "int4",
                                        "--blob-url", self.blob_url, *extra, port=port)
        self.fed_log = self.output

    def site(self, name, blob):
        """fedsite.FedSite's download half, as train.py's rank 0 uses it (no DARL call is made)."""
        import fedsite
        cfg = types.SimpleNamespace(cluster=name, token_file=None, darl_url="http://127.0.0.1:9",
                                    federation=self.url, blob_url=self.blob_url if blob else None, ca_file=None,
                                    transport="blob" if blob else "inline")
        return fedsite.FedSite(cfg, None, 0, self.said.append)

    def send_round(self, rnd):
        """a sends inline, b through the blob store."""
        for c, path, how in (("a", self.deltas[0], "inline"), ("b", self.deltas[1], "blob")):
            fedmom_client.FedMomClient(self.url, c, f"{c}-inc", blob_url=self.blob_url).send_delta(
                path, rnd, 10, [], {}, transport=how)

    def merge_round(self, rnd):
        """send_round; -> once round rnd + 1 is durable."""
        self.send_round(rnd)
        got = fedmom_client.FedMomClient(self.url, "a", "a-inc").wait_round_after(rnd, timeout_s=HANG_S)
        self.assertEqual(got, rnd + 1)

    def arm(self, point):
        open(os.path.join(self.faults, point), "w").close()

    def hit(self, point):
        return os.path.exists(os.path.join(self.faults, point + ".hit"))

    def blobs(self):
        return {b["id"] for b in httpc.call(self.blob_url, "GET", "/blobs")["blobs"]}

    def int4_deltas(self):
        """The deltas as a site with --wire int4 sends them (what the sizing is for)."""
        import wire
        for d in self.deltas:
            with tensorio.TensorReader(d) as r:
                arrays = {n: r.read(n) for n in r.names}
            with wire.WireWriter(d, [(n, a.shape) for n, a in arrays.items()], wire.Codec("int4"), fsync=False) as w:
                for n, a in arrays.items():
                    w.write(n, a)

    def assert_holds_server_theta(self, path):
        served = os.path.join(self.dir, "served.safetensors")
        fedmom_client.FedMomClient(self.url, "reader", "reader-inc").download_theta(served)
        want, got = bits(served), bits(path)
        self.assertEqual(sorted(want), sorted(got))
        for n in want:                      # the exact bits, not close values
            self.assertTrue(np.array_equal(want[n], got[n]), f"tensor {n} differs")


class DiskBoundTest(Live):
    K, C = 3, 4                     # --keep-rounds, --checkpoint-rounds

    def expected(self, agg, rnd):
        """What the rule keeps once round rnd is durable and both sites took its update: the
        checkpoint of round c, the deltas of the rounds logged since, rnd's update."""
        c = rnd - rnd % self.C
        state = {"ckpt-0"}                  # the checkpoint's segments, rewritten in place every C rounds
        state |= {f"update-{rnd}.safetensors", "state.json", "rounds.jsonl", "spool", "lock"}
        state |= {f"spool/r{b}_{x}_{x}-inc.{ext}" for b in range(c, rnd) for x in ("a", "b")
                  for ext in ("safetensors", "json")}
        blobs = {fedmom_state.blob_name(agg, "update", s) for s in range(max(1, rnd - self.K + 1), rnd + 1)}
        blobs |= {fedmom_state.blob_name(agg, "theta", 0)} if rnd < self.K else set()   # the sites' first download
        return state, blobs

    def kept(self):
        spool = os.listdir(os.path.join(self.sd, "spool"))
        return set(os.listdir(self.sd)) | {f"spool/{f}" for f in spool}, self.blobs()

    def test_the_disk_stays_bounded_over_61_rounds_and_a_site_60_rounds_behind_rejoins(self):
        self.blob_store, self.blob_url = self.spawn("blobstore.py", "--root", self.blob_root)
        self.start("--init", self.init, "--keep-rounds", str(self.K), "--checkpoint-rounds", str(self.C))
        agg = httpc.call(self.url, "GET", "/status")["aggregator"]
        for c in ("a", "b"):
            fedmom_client.FedMomClient(self.url, c, f"{c}-inc").join()
        self.int4_deltas()
        paths = {c: os.path.join(self.dir, c, "theta.safetensors") for c in ("a", "b", "late")}
        for p in paths.values():
            os.makedirs(os.path.dirname(p))
        sites = {"a": self.site("a", blob=False), "b": self.site("b", blob=True), "late": self.site("late", True)}
        for c, s in sites.items():
            self.assertEqual(s._fetch(paths[c]), 0)
        self.assertEqual(sites["late"].down["via"], "full")     # then it goes away for 61 rounds
        model = 4 * sum(int(np.prod(s)) for s in SHAPES.values())
        bound = (self.K + 2) * model + self.C * sum(os.path.getsize(d) for d in self.deltas)
        worst = 0
        for rnd in range(61):
            if rnd == 30:                    # the sweep after round 31 held mid-delete, then SIGKILL
                self.arm("fedmom.blob_delete")
            self.merge_round(rnd)
            for c in ("a", "b"):
                self.assertEqual(sites[c]._fetch(paths[c]), rnd + 1)
                self.assertEqual(sites[c].down["via"], "update", self.said)
            if rnd == 30:
                expect(lambda: self.hit("fedmom.blob_delete"), "the sweep to reach a delete", timeout_s=HANG_S)
                self.fed.send_signal(signal.SIGKILL)
                self.fed.wait(30)
                os.unlink(os.path.join(self.faults, "fedmom.blob_delete"))
                self.assertIn(fedmom_state.blob_name(agg, "update", 31 - self.K), self.blobs(), "the kill left it")
                self.start("--checkpoint-rounds", str(self.C), port=httpc.split_url(self.url)[2])  # same URL
                # its first sweep deletes what the killed process owed
            want = self.expected(agg, rnd + 1)
            expect(lambda: self.kept() == want, f"round {rnd + 1}'s retention: {want}", timeout_s=HANG_S)
            used = tree_bytes(self.sd, skip=("rounds.jsonl", "state.json")) + tree_bytes(self.blob_root)
            self.assertLessEqual(used, bound, f"round {rnd + 1}: {used} bytes > (K + 2) models + C rounds' "
                                              f"deltas = {bound}")
            worst = max(worst, used)
        st = httpc.call(self.url, "GET", "/status")["retention"]
        self.assertEqual(st["blobs"]["swept_round"], 61)
        self.assertEqual({b["blob"] for b in st["blobs"]["kept"]}, want[1])
        self.assertTrue(all(b["why"] for b in st["blobs"]["kept"]))
        # 60 rounds behind: the update it would need is long gone; 409 no_update, the full theta
        with self.assertRaises(httpc.CallError) as cm:
            httpc.call(self.url, "GET", "/theta_update?from=0&digest=" + sites["late"].held[1])
        self.assertEqual((cm.exception.status, cm.exception.reply.get("code")), (409, "no_update"))
        self.assertEqual(sites["late"]._fetch(paths["late"]), 61)
        self.assertEqual(sites["late"].down["via"], "full")
        self.assert_holds_server_theta(paths["late"])
        self.assertIn(fedmom_state.blob_name(agg, "theta", 61), self.blobs())
        used = tree_bytes(self.sd, skip=("rounds.jsonl", "state.json")) + tree_bytes(self.blob_root)
        self.assertLessEqual(used, bound)
        print(f"\n    61 rounds, K={self.K}: model {model} B, worst {worst} B = {worst / model:.2f} models "
              f"(bound {bound / model:.2f}); after the rejoin {used / model:.2f}", file=sys.stderr)
        out = subprocess.run([sys.executable, "blobstore.py", "status", "--url", self.blob_url,
                              "--fedmom", self.url], cwd=ROOT, capture_output=True, text=True, timeout=HANG_S)
        self.assertEqual(out.returncode, 0, out.stdout + out.stderr)
        self.assertIn(f"{fedmom_state.blob_name(agg, 'update', 61)}", out.stdout)
        self.assertIn("kept: the current round's update", out.stdout)
        self.assertIn(f"keeps its theta/update blobs of the last {self.K} rounds", out.stdout)


class PeakTest(Live):
    def files(self):
        out = {f: os.path.getsize(os.path.join(self.sd, f)) for f in os.listdir(self.sd)
               if f not in ("spool", "ckpt-0")}
        for d in ("spool", "ckpt-0"):
            out.update({f"{d}/{f}": os.path.getsize(os.path.join(self.sd, d, f))
                        for f in os.listdir(os.path.join(self.sd, d))})
        return out

    def hold(self, point, skip):
        with open(os.path.join(self.faults, point), "w") as f:
            f.write(str(skip))

    def test_a_round_writes_only_its_update_and_a_checkpoint_holds_one_checkpoint_and_a_segment(self):
        """--checkpoint-rounds 2, int4 deltas. Held at round 3's durable point: the state dir is
        round 2's checkpoint (theta, momentum, residual in segments), round 3's update and the
        deltas logged since - the merge wrote no model-sized file. Held after the second segment
        of round 4's checkpoint: the segments are rewritten in place (two of round 4, the rest of
        round 2; never two checkpoints side by side, which was 6 models), the update and the two
        logged rounds' int4 deltas as they came."""
        self.blob_store, self.blob_url = self.spawn("blobstore.py", "--root", self.blob_root)
        self.start("--init", self.init, "--checkpoint-rounds", "2")
        for c in ("a", "b"):
            fedmom_client.FedMomClient(self.url, c, f"{c}-inc").join()
        self.int4_deltas()
        for rnd in (0, 1):
            self.merge_round(rnd)
        self.hold("fedmom.round_durable", 0)
        self.send_round(2)
        expect(lambda: self.hit("fedmom.round_durable"), "round 3 to be durable", timeout_s=HANG_S)
        files = self.files()
        os.unlink(os.path.join(self.faults, "fedmom.round_durable"))
        logged = {f"spool/r2_{x}_{x}-inc.{e}" for x in ("a", "b") for e in ("safetensors", "json")}
        segments = {f"ckpt-0/{i:05d}-0000.safetensors" for i in range(len(SHAPES))}
        self.assertEqual(set(files), segments | {"update-2.safetensors", "update-3.safetensors", "state.json",
                                                 "rounds.jsonl", "lock"} | logged)
        self.assertEqual(self.segment_rounds(), [2] * len(SHAPES))
        model = 4 * sum(int(np.prod(s)) for s in SHAPES.values())
        largest = 4 * max(int(np.prod(s)) for s in SHAPES.values())
        deltas = sum(os.path.getsize(d) for d in self.deltas)
        self.assertEqual(sorted(v for f, v in files.items() if f.endswith(".safetensors") and "spool/" in f),
                         sorted(os.path.getsize(d) for d in self.deltas), "the spool holds the int4 files as sent")
        expect(lambda: self.kept_after(3), "round 3's leftovers to go", timeout_s=HANG_S)
        self.hold("fedmom.checkpoint", 1)             # round 4's first two segments written
        self.merge_round(3)
        expect(lambda: self.hit("fedmom.checkpoint"), "round 4's checkpoint", timeout_s=HANG_S)
        peak = self.files()
        self.assertEqual(self.segment_rounds(), [4, 4] + [2] * (len(SHAPES) - 2))
        os.unlink(os.path.join(self.faults, "fedmom.checkpoint"))
        logged |= {f"spool/r3_{x}_{x}-inc.{e}" for x in ("a", "b") for e in ("safetensors", "json")}
        self.assertEqual(set(peak), segments | {"update-4.safetensors", "state.json", "rounds.jsonl", "lock"}
                         | logged)
        small = files["state.json"] + files["rounds.jsonl"] + 4096 * (len(SHAPES) + 1)   # headers
        self.assertLessEqual(sum(files.values()), 3 * model + files["update-3.safetensors"] +
                             files["update-2.safetensors"] + deltas + small)
        self.assertLessEqual(sum(peak.values()), 3 * model + peak["update-4.safetensors"] + 2 * deltas + small)
        expect(lambda: set(self.files()) == segments | {"update-4.safetensors", "state.json", "rounds.jsonl", "lock"},
               "the logged deltas to go", timeout_s=HANG_S)
        self.assertEqual(self.segment_rounds(), [4] * len(SHAPES))
        print(f"\n    a round: {(sum(files.values()) - small) / model:.2f} models (one checkpoint, updates, "
              f"{deltas / model:.2f} of int4 deltas a round); during a checkpoint: "
              f"{(sum(peak.values()) - small) / model:.2f} models, and one segment's file being written "
              f"({3 * largest / model:.2f} here at most)", file=sys.stderr)

    def segment_rounds(self):
        out = []
        for f in sorted(os.listdir(os.path.join(self.sd, "ckpt-0"))):
            with tensorio.TensorReader(os.path.join(self.sd, "ckpt-0", f)) as r:
                out.append(int(r.metadata["round"]))
        return out

    def kept_after(self, rnd):
        return not any(f.startswith(f"update-{rnd - 1}") for f in os.listdir(self.sd))


class BusyTest(Live):
    def test_a_theta_download_during_a_merge_is_told_to_retry_and_never_holds_a_worker(self):
        """Round 2's merge held after its first tensor (the arrays busy, no copy of round 1's
        theta on disk): GET /theta and /theta_blob answer 503 busy at once instead of waiting
        for the merge (each waiting download held an HTTP worker: enough of them and heartbeats
        and /status waited too), /status and a heartbeat answer; once the merge is released the
        download is round 2's theta."""
        self.blob_store, self.blob_url = self.spawn("blobstore.py", "--root", self.blob_root)
        self.start("--init", self.init, "--checkpoint-rounds", "8")
        for c in ("a", "b"):
            fedmom_client.FedMomClient(self.url, c, f"{c}-inc").join()
        self.merge_round(0)
        self.arm("fedmom.merge")
        self.send_round(1)
        expect(lambda: self.hit("fedmom.merge"), "round 2's merge to reach its first tensor", timeout_s=HANG_S)
        self.assertFalse(os.path.exists(os.path.join(self.sd, "theta-1.safetensors")))
        for route in ("/theta", "/theta_blob"):
            with self.assertRaises(httpc.CallError) as got:
                httpc.call(self.url, "GET", route, timeout=HANG_S)
            self.assertEqual((got.exception.status, got.exception.reply.get("code")), (503, "busy"), route)
            self.assertEqual(got.exception.reply.get("retry_after_s"), outer_state.BUSY_RETRY_S)
        self.assertEqual(httpc.call(self.url, "GET", "/status", timeout=HANG_S)["round"], 1)
        fedmom_client.FedMomClient(self.url, "a", "a-inc").heartbeat()
        os.unlink(os.path.join(self.faults, "fedmom.merge"))
        self.assertEqual(fedmom_client.FedMomClient(self.url, "a", "a-inc").wait_round_after(1, timeout_s=HANG_S), 2)
        served = os.path.join(self.dir, "served.safetensors")
        self.assertEqual(fedmom_client.FedMomClient(self.url, "r", "r-inc").download_theta(served), 2)
        with open(os.path.join(self.sd, "state.json")) as f:
            published = json.load(f)["update"]
        self.assertEqual((published["round"], wire.theta_digest(served)), (2, published["digest"]))


class RestoredStateTest(Live):
    def test_a_blob_of_this_round_with_other_bytes_is_replaced_not_served(self):
        """A state dir restored from an older copy meets the blobs its lost future published
        under the same names: the theta a site downloads is still this state's."""
        import blob_client
        self.blob_store, self.blob_url = self.spawn("blobstore.py", "--root", self.blob_root)
        self.start("--init", self.init)
        agg = httpc.call(self.url, "GET", "/status")["aggregator"]
        stale = os.path.join(self.dir, "stale.bin")
        with open(stale, "wb") as f:
            f.write(b"not this round's theta")
        blob_client.put_file(self.blob_url, fedmom_state.blob_name(agg, "theta", 0), stale)
        fedmom_client.FedMomClient(self.url, "b", "b-inc").join()
        path = os.path.join(self.dir, "b.safetensors")
        self.assertEqual(self.site("b", blob=True)._fetch(path), 0)
        self.assert_holds_server_theta(path)
        self.assertIn("holds other bytes than round 0's file", self.fed_log.text())


class LockTest(Live):
    def test_deletions_held_at_their_fault_points_leave_status_and_heartbeats_answered(self):
        """The old round's files and its blob, held mid-deletion: the state lock is free."""
        self.blob_store, self.blob_url = self.spawn("blobstore.py", "--root", self.blob_root)
        self.start("--init", self.init, "--keep-rounds", "1", "--checkpoint-rounds", "1")
        agg = httpc.call(self.url, "GET", "/status")["aggregator"]
        for c in ("a", "b"):
            fedmom_client.FedMomClient(self.url, c, f"{c}-inc").join()
        path = os.path.join(self.dir, "b.safetensors")
        self.assertEqual(self.site("b", blob=True)._fetch(path), 0)          # publishes the theta-0 blob
        self.arm("fedmom.unlink")
        self.arm("fedmom.blob_delete")
        self.merge_round(0)
        expect(lambda: self.hit("fedmom.unlink") and self.hit("fedmom.blob_delete"),
               "both deletions to be held", timeout_s=HANG_S)
        # while both are held: the state answers (each call would wait on a held lock)
        st = httpc.call(self.url, "GET", "/status", timeout=HANG_S)
        self.assertEqual(st["round"], 1)
        reply = fedmom_client.FedMomClient(self.url, "a", "a-inc").heartbeat()
        self.assertEqual(reply["round"], 1)
        self.assertIn("theta-0.safetensors", os.listdir(self.sd), "the deletion is held, not done")
        self.assertIn(fedmom_state.blob_name(agg, "theta", 0), self.blobs())
        os.unlink(os.path.join(self.faults, "fedmom.unlink"))
        os.unlink(os.path.join(self.faults, "fedmom.blob_delete"))
        expect(lambda: "theta-0.safetensors" not in os.listdir(self.sd) and not os.listdir(
            os.path.join(self.sd, "spool")) and fedmom_state.blob_name(agg, "theta", 0) not in self.blobs(),
            "the held deletions to finish", timeout_s=HANG_S)
        kept = httpc.call(self.url, "GET", "/status")["retention"]
        self.assertEqual(sorted(f["file"] for f in kept["state"]), ["ckpt-0/", "update-1.safetensors"])
        out = subprocess.run([sys.executable, "fedmom_server.py", "status", "--url", self.url], cwd=ROOT,
                             capture_output=True, text=True, timeout=HANG_S)
        self.assertEqual(out.returncode, 0, out.stdout + out.stderr)
        self.assertIn("checkpoint of round 1: theta_global", out.stdout)
        self.assertIn("kept in the blob store (--keep-rounds 1", out.stdout)


if __name__ == "__main__":
    unittest.main()
