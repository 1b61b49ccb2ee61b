"""fedmom_server.py + fedmom_state.py: the merge against torch's SGD and a naive numpy step, the round
protocol with an injected clock, a live server with both transports, real DARL and
blob store on 127.0.0.1, a SIGKILL mid-merge, and an import with torch absent."""
import http.client
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
import unittest

import numpy as np

import blob_client
import blobstore
import block_space
import darl_server
import durable
import fedmom_client
import fedmom_merge
import fedmom_round
import fedmom_server as fm
import fedmom_state
import fedmom_state as fs
import httpc
import httpd
import outer_state
import tensorio
import wire
from fixtures import SHAPES, FedMomFixture, read_all, write_tensors
from testbed.harness import listening_url

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def naive_fedmom(theta, buf, deltas, tokens, lr, mu):
    """The outer step in ten lines of float64 numpy: the reference the streaming merge must match."""
    p = np.asarray(tokens, np.float64) / sum(tokens)
    new_theta, new_buf = {}, {}
    for k in theta:
        g = theta[k] - sum(pi * (theta[k] + d[k]) for pi, d in zip(p, deltas))
        b = g if buf is None else mu * buf[k] + g
        new_theta[k], new_buf[k] = theta[k] - lr * (g + mu * b), b
    return new_theta, new_buf


def rel_err(a, b):
    return max(float(np.abs(a[k] - b[k]).max() / (np.abs(b[k]).max() + 1e-30)) for k in b)


class MergeMathTest(FedMomFixture):
    def test_nesterov_matches_torch_sgd_and_the_naive_reference_over_rounds(self):
        import torch
        st = self.state(outer_lr=0.7, outer_momentum=0.9)
        for c in ("lumi", "snellius"):
            st.join(c, f"{c}-inc")
        params = {k: torch.tensor(v, dtype=torch.float64) for k, v in self.theta0.items()}
        opt = torch.optim.SGD(list(params.values()), lr=0.7, momentum=0.9, nesterov=True)
        heavy = {k: torch.tensor(v, dtype=torch.float64) for k, v in self.theta0.items()}
        hopt = torch.optim.SGD(list(heavy.values()), lr=0.7, momentum=0.9, nesterov=False)
        theta, buf = dict(self.theta0), None
        for rnd in range(4):                                   # round 0 is torch's first step (buf = g)
            (pa, da), (pb, db) = self.delta("F16"), self.delta("BF16")
            tokens = [3000 + rnd, 5000]
            self.send(st, "lumi", pa, tokens[0])
            self.send(st, "snellius", pb, tokens[1])
            rec = st.tick()
            self.assertEqual((rec["round"], st.round), (rnd + 1, rnd + 1))
            theta, buf = naive_fedmom(theta, buf, [da, db], tokens, 0.7, 0.9)
            p = np.asarray(tokens, np.float64) / sum(tokens)
            for P, O in ((params, opt), (heavy, hopt)):
                for k, t in P.items():
                    g = t.detach().numpy() - (p[0] * (t.detach().numpy() + da[k]) + p[1] * (t.detach().numpy() + db[k]))
                    t.grad = torch.tensor(g)
                O.step()
            got = self.theta(st)
            self.assertLess(rel_err(got, {k: v.detach().numpy() for k, v in params.items()}), 1e-6)
            self.assertLess(rel_err(got, theta), 1e-6)
            mom = read_all(os.path.join(st.dir, st.momentum_file))
            self.assertLess(rel_err(mom, buf), 1e-5)
        # the control: heavy-ball momentum lands measurably elsewhere
        self.assertGreater(rel_err(got, {k: v.detach().numpy() for k, v in heavy.items()}), 1e-4)

    def test_lr1_momentum0_is_the_exact_token_weighted_mean(self):
        st = self.state(outer_lr=1.0, outer_momentum=0.0)
        deltas, tokens = [], [100, 300, 600]
        for i, t in enumerate(tokens):
            st.join(f"c{i}", f"c{i}-inc")
        for i, t in enumerate(tokens):
            path, d = self.delta(["F16", "BF16", "F32"][i])
            deltas.append(d)
            self.send(st, f"c{i}", path, t)
        st.tick()
        p = np.asarray(tokens, np.float64) / sum(tokens)
        mean = {k: sum(pi * (self.theta0[k] + d[k]) for pi, d in zip(p, deltas)) for k in SHAPES}
        self.assertLess(rel_err(self.theta(st), mean), 1e-6)
        self.assertIsNone(st.momentum_file)                    # FedAvg keeps no buffer

    def test_equal_tokens_weigh_one_over_k(self):
        st = self.state(outer_lr=1.0, outer_momentum=0.0)
        deltas = []
        for i in range(4):
            st.join(f"c{i}", f"c{i}-inc")
        for i in range(4):
            path, d = self.delta("F32")
            deltas.append(d)
            self.send(st, f"c{i}", path, 777)
        rec = st.tick()
        self.assertEqual({c["weight"] for c in rec["clusters"].values()}, {0.25})
        mean = {k: self.theta0[k] + sum(d[k] for d in deltas) / 4 for k in SHAPES}
        self.assertLess(rel_err(self.theta(st), mean), 1e-6)


class ThreadedMergeTest(FedMomFixture):
    """merge_files on threads: the chunks of a tensor split over a pool give the serial
    merge's bits, norms and NonFinite, for any number of threads."""
    BIG = {"big": (2100, 1024), "small": (7,)}           # 9 chunks of fedmom_merge.CHUNK: 3 thread tasks

    def files(self, spoil=None):
        rng = np.random.default_rng(7)
        p = lambda n: os.path.join(self.dir, n)
        for fn, dtype, scale in (("theta", "F32", 1), ("mom", "F32", 0.1), ("d0", "F16", 0.01), ("d1", "BF16", 0.01)):
            arrays = {k: (scale * rng.standard_normal(s)).astype(np.float32) for k, s in self.BIG.items()}
            if spoil is not None:
                spoil(fn, arrays["big"].reshape(-1))
            write_tensors(p(fn), arrays, dtype)
        return p("theta"), p("mom"), [(p("d0"), 0.25), (p("d1"), 0.75)]

    def merge(self, threads, inputs):
        theta, mom, deltas = inputs
        out_t, out_m = os.path.join(self.dir, f"t{threads}"), os.path.join(self.dir, f"m{threads}")
        stats = fedmom_merge.merge_files(theta, mom, deltas, out_t, out_m, lr=0.7, mu=0.9, fsync=False,
                                         threads=threads)
        with open(out_t, "rb") as f, open(out_m, "rb") as g:
            return stats, f.read(), g.read()

    def test_any_number_of_threads_gives_the_serial_bits_and_norms(self):
        inputs = self.files()
        serial = self.merge(1, inputs)
        for threads in (2, 3):
            with self.subTest(threads=threads):
                self.assertEqual(self.merge(threads, inputs), serial)

    def test_a_compressed_delta_merges_on_threads_with_the_serial_bits(self):
        # an int4 delta is decoded by the merge's own pool threads (DecodedDelta): the decode's
        # spans must not wait in the queue behind the merge's spans that wait for them (it hung)
        theta, mom, deltas = self.files()
        with wire.WireWriter(deltas[1][0], [(k, s) for k, s in self.BIG.items()], wire.Codec("int4"), fsync=False) as w:
            rng = np.random.default_rng(8)
            for k, s in self.BIG.items():
                w.write(k, (0.01 * rng.standard_normal(s)).astype(np.float32))
        serial = self.merge(1, (theta, mom, deltas))
        for threads in (2, 3):
            box = {}
            t = threading.Thread(target=lambda: box.update(out=self.merge(threads, (theta, mom, deltas))), daemon=True)
            t.start()
            t.join(120)                                  # a hang bound, not a timing
            with self.subTest(threads=threads):
                self.assertFalse(t.is_alive(), f"merge_files(threads={threads}) with an int4 delta hung")
                self.assertEqual(box["out"], serial)

    def test_the_first_non_finite_chunk_is_the_one_raised(self):
        def spoil(fn, big):
            at = 6 * fedmom_merge.CHUNK + 3              # chunk 6 (the second task): the momentum alone overflows
            if fn == "theta":
                big[at] = 3e38
            if fn == "mom":
                big[at] = -3.4e38
            if fn == "d0":
                big[2 * fedmom_merge.CHUNK + 1] = np.inf   # chunk 2 (the first task): a delta
        inputs = self.files(spoil)
        got = []
        for threads in (1, 3):
            with self.assertRaises(fedmom_merge.NonFinite) as cm:
                self.merge(threads, inputs)
            got.append((cm.exception.what, cm.exception.name, cm.exception.cause))
        self.assertEqual(got[0], ("theta", "big", "deltas"))       # chunk 2's, not chunk 6's "momentum"
        self.assertEqual(got[1], got[0])


class ProtocolTest(FedMomFixture):
    def test_the_join_answer_says_the_outer_step_of_the_merge(self):
        # what a site's --overlap-fold eager repeats locally (FEDERATION_GUIDE.md section 4, "Overlap")
        got = self.state(outer_lr=0.5, outer_momentum=0.8).join("lumi", "lumi-inc")
        self.assertEqual(got["outer"], {"lr": 0.5, "momentum": 0.8, "nesterov": True})
        self.assertEqual(got["round"], 0)

    def test_stale_base_round_is_rejected_with_the_current_round(self):
        st = self.state()
        st.join("lumi", "lumi-inc")
        self.send(st, "lumi", self.delta()[0], 10)
        st.tick()
        with self.assertRaises(fedmom_round.Refused) as cm:
            self.send(st, "lumi", self.delta()[0], 10, base_round=0)
        self.assertEqual((cm.exception.status, cm.exception.extra["round"]), (409, 1))
        self.assertIn("stale", cm.exception.reason)

    def test_a_nan_delta_is_excluded_named_and_the_others_merge(self):
        st = self.state(outer_lr=1.0, outer_momentum=0.0)
        for c in ("good", "bad"):
            st.join(c, f"{c}-inc")
        gpath, g = self.delta("F32")
        arrays = {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}
        arrays["layer.w"][3, 4] = np.nan
        bpath = os.path.join(self.dir, "nan.safetensors")
        write_tensors(bpath, arrays, "F16")
        self.send(st, "good", gpath, 10, leases=[{"id": 7, "end": 20}])
        with self.assertRaises(fedmom_round.Refused) as cm:
            self.send(st, "bad", bpath, 10, leases=[{"id": 8, "end": 30}])
        self.assertEqual(cm.exception.status, 422)
        self.assertIn("layer.w", cm.exception.reason)
        self.assertEqual(sorted((o["cluster"], o["outcome"]) for o in st.status()["outcomes"]),
                         [("bad", "excluded"), ("good", "pending")])
        rec = st.tick()                                        # the excluded member does not stall the round
        self.assertEqual(sorted(rec["clusters"]), ["good"])
        self.assertEqual([(e["cluster"], "layer.w" in e["why"]) for e in rec["excluded"]], [("bad", True)])
        self.assertLess(rel_err(self.theta(st), {k: self.theta0[k] + g[k] for k in SHAPES}), 1e-6)
        self.assertIn("excluded bad", fedmom_round.format_record(rec))
        # each delta's fate, with the leases it carried: in the record, on disk, and told to each site
        fates = {o["cluster"]: (o["outcome"], o["merged_into"], o["base_round"], o["leases"]) for o in rec["outcomes"]}
        self.assertEqual(fates, {"good": ("merged", 1, 0, [{"id": 7, "end": 20}]),
                                 "bad": ("excluded", None, 0, [{"id": 8, "end": 30}])})
        self.assertIn("layer.w", [o for o in rec["outcomes"] if o["cluster"] == "bad"][0]["why"])
        self.assertEqual(durable.read_jsonl(st.rounds_path)[-1]["outcomes"], rec["outcomes"])
        for c in ("good", "bad"):
            told = st.heartbeat(c, f"{c}-inc")["deltas"]
            self.assertEqual([(o["outcome"], o["merged_into"], o["base_round"], o["leases"]) for o in told], [fates[c]])
        self.assertEqual(st.status()["outcomes"], [])

    def test_bad_input_is_refused_and_nothing_on_disk_changes(self):
        st = self.state()
        st.join("lumi", "lumi-inc")
        before = self.snapshot(st)
        wrong_names = self.delta(names=["embed", "norm"])[0]
        wrong_shape = self.delta(shapes={**SHAPES, "norm": (8,)})[0]
        wrong_dtype = os.path.join(self.dir, "f64.safetensors")
        write_tensors(wrong_dtype, {k: np.zeros(s) for k, s in SHAPES.items()}, "F64")
        garbage = os.path.join(self.dir, "garbage")
        with open(garbage, "wb") as f:
            f.write(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
        good = self.delta()[0]
        cases = [("names", lambda: self.send(st, "lumi", wrong_names, 5), 400),
                 ("shape", lambda: self.send(st, "lumi", wrong_shape, 5), 400),
                 ("F16, BF16 or F32", lambda: self.send(st, "lumi", wrong_dtype, 5), 400),
                 ("not a tensor file", lambda: self.send(st, "lumi", garbage, 5), 400),
                 ("tokens is 0", lambda: self.send(st, "lumi", good, 0), 400),
                 ("non-negative", lambda: self.send(st, "lumi", good, -3), 400),
                 ("cluster must match", lambda: self.send(st, "../etc", good, 5), 400),
                 ("not a member", lambda: self.send(st, "stranger", good, 5), 409),
                 ("stale", lambda: self.send(st, "lumi", good, 5, base_round=7), 409),
                 ("leases", lambda: self.send(st, "lumi", good, 5, leases=[{"x": 1}]), 400),
                 ("integer 'end'", lambda: self.send(st, "lumi", good, 5, leases=[{"id": 1, "end": "20"}]), 400),
                 ("integer 'end'", lambda: self.send(st, "lumi", good, 5, leases=[{"id": 1, "end": 2.5}]), 400),
                 ("metrics.loss", lambda: self.send(st, "lumi", good, 5, metrics={"loss": "high"}), 400)]
        for what, fn, status in cases:
            with self.subTest(what), self.assertRaises(fedmom_round.Refused) as cm:
                fn()
            self.assertEqual(cm.exception.status, status, cm.exception.reason)
            self.assertIn(what, cm.exception.reason)
            self.assertNotIn("\n", cm.exception.reason)
        m = fedmom_round.parse_delta_meta({"cluster": "lumi", "incarnation": "other", "base_round": 0, "tokens": 5})
        with self.assertRaises(fedmom_round.Refused) as cm:
            st.accept_delta(m, st.spool.part())
        self.assertEqual(cm.exception.extra["code"], "stale_incarnation")
        with self.assertRaises(fedmom_round.Refused) as cm:
            st.join("lumi", "second-job")
        self.assertEqual((cm.exception.status, cm.exception.extra["code"]), (409, "incarnation_conflict"))
        self.assertIn("--replica", cm.exception.reason)
        self.assertEqual(self.snapshot(st), before)
        self.assertIsNone(st.tick())                           # nothing pending: nothing merged

    def test_ids_that_join_to_the_same_text_keep_their_own_spooled_deltas(self):
        st = self.state(outer_lr=1.0, outer_momentum=0.0)
        sent = []
        for cluster, inc in (("lumi", "b-x"), ("lumi-b", "x")):    # "lumi" + "b-x" and "lumi-b" + "x"
            st.join(cluster, inc)
            path, arrays = self.delta("F32")
            m = st.check_delta_meta({"cluster": cluster, "incarnation": inc, "tokens": 10, "base_round": 0})
            part = st.spool.part()
            shutil.copyfile(path, part)
            st.accept_delta(m, part)
            sent.append(arrays)
        st.tick()
        want = {k: self.theta0[k] + 0.5 * (sent[0][k] + sent[1][k]) for k in SHAPES}
        self.assertLess(rel_err(self.theta(st), want), 1e-6)

    def test_silent_members_are_dropped_and_the_deadline_closes_a_round(self):
        st = self.state(member_timeout_s=60, round_deadline_s=100)
        for c in ("a", "b", "c"):
            st.join(c, f"{c}-inc")
        self.send(st, "a", self.delta()[0], 10)
        self.clock.t += 50
        st.heartbeat("a", "a-inc")
        st.heartbeat("b", "b-inc")
        self.assertIsNone(st.tick())                           # b and c still owe a delta
        self.clock.t += 20                                     # c silent for 70 s > 60: dropped
        self.assertIsNone(st.tick())
        self.assertEqual(sorted(st.members), ["a", "b"])
        self.clock.t += 35                                     # 105 s after a's delta: deadline
        st.heartbeat("b", "b-inc")
        rec = st.tick()
        self.assertEqual((rec["round"], sorted(rec["clusters"]), rec["late"]), (1, ["a"], ["b"]))
        self.assertEqual([d["cluster"] for d in rec["dropped"]], ["c"])
        self.assertIn("deadline", rec["reason"])
        with self.assertRaises(fedmom_round.Refused) as cm:              # c may come back: told to join again
            st.heartbeat("c", "c-inc")
        self.assertEqual(cm.exception.extra["code"], "not_member")
        st.join("c", "c-inc")
        self.assertIn("c", st.members)

    def test_no_members_and_empty_rounds_consume_nothing(self):
        st = self.state()
        for _ in range(3):
            self.clock.t += 10_000
            self.assertIsNone(st.tick())
        self.assertEqual((st.round, st.theta_file, list(st.records)), (0, "theta-0.safetensors", []))
        st.join("solo", "solo-inc")                            # one member merges alone
        self.send(st, "solo", self.delta()[0], 10)
        self.assertEqual(st.tick()["round"], 1)

    def test_restart_between_rounds_and_with_a_spooled_delta_loses_nothing(self):
        st = self.state()
        for c in ("a", "b"):
            st.join(c, f"{c}-inc")
        pa, pb = self.delta()[0], self.delta()[0]
        self.send(st, "a", pa, 10)
        self.send(st, "b", pb, 20, leases=[{"id": 4, "end": 9}])
        st.tick()
        theta1, mom1 = self.theta(st), read_all(os.path.join(st.dir, st.momentum_file))
        self.send(st, "a", self.delta()[0], 10)                # accepted, not merged yet
        del st
        st = self.state(init=None)
        self.assertEqual((st.round, sorted(st.members), [c for c, _ in st.pending]), (1, ["a", "b"], ["a"]))
        self.assertEqual(rel_err(self.theta(st), theta1), 0)
        self.assertEqual(rel_err(read_all(os.path.join(st.dir, st.momentum_file)), mom1), 0)
        self.assertEqual([r["round"] for r in st.records], [1])
        self.assertEqual([l for r in st.records for o in r["outcomes"] for l in o["leases"]], [{"id": 4, "end": 9}])
        self.assertEqual(st.pending_commits, [], "no --darl: no DARL accounting, nothing owed")
        self.send(st, "b", self.delta()[0], 20)
        self.assertEqual(st.tick()["round"], 2)
        st2 = self.state()                                     # --init of the same model: a note, no change
        self.assertEqual(st2.round, 2)
        # round 0 is the checkpoint (--checkpoint-rounds 4); rounds 1 and 2 are their deltas, kept to replay
        self.assertEqual(sorted(os.listdir(st2.dir)), ["ckpt-0", "rounds.jsonl", "spool", "state.json"])
        self.assertEqual(len([f for f in os.listdir(st2.spool.dir) if f.endswith(".safetensors")]), 4)
        self.assertEqual(st2.checkpoint(force=True), 2)       # its segments rewritten: the log and its deltas go
        self.assertEqual(sorted(os.listdir(st2.dir)), ["ckpt-0", "rounds.jsonl", "spool", "state.json"])
        for fn in outer_state.checkpoint_files(st2.dir, st2.ckpt):
            with tensorio.TensorReader(os.path.join(st2.dir, fn)) as r:
                self.assertEqual((r.metadata["round"], r.names), ("2", ["theta", "momentum"]), fn)
        self.assertEqual(os.listdir(st2.spool.dir), [])

    def test_a_torn_rounds_line_is_cut_and_its_record_put_back(self):
        """A crash mid-append of round 2's line (state.json, written first, says round 2): the
        restart cuts the fragment before it appends, so rounds 1, 2, 3 all stay readable."""
        st = self.state()
        st.join("a", "a-inc")
        for _ in range(2):
            self.send(st, "a", self.delta()[0], 10)
            st.tick()
        path = os.path.join(st.dir, "rounds.jsonl")
        with open(path, "rb") as f:
            data = f.read()
        last = data.rstrip(b"\n").rfind(b"\n") + 1
        with open(path, "wb") as f:
            f.write(data[:last + (len(data) - last) // 2])
        st = self.state(init=None)
        self.assertEqual([r["round"] for r in st.records], [1, 2])
        self.send(st, "a", self.delta()[0], 10)
        self.assertEqual(st.tick()["round"], 3)
        st = self.state(init=None)
        self.assertEqual([r["round"] for r in durable.read_jsonl(path)], [1, 2, 3])
        with open(path, "rb") as f:
            self.assertTrue(all(json.loads(line) for line in f.read().splitlines()))

    def test_another_outer_step_on_restart_is_refused_unless_accepted(self):
        st = self.state(outer_lr=0.7, outer_momentum=0.9)
        st.join("a", "a-inc")
        self.send(st, "a", self.delta()[0], 10)
        st.tick()
        before = self.snapshot(st)
        with self.assertRaises(SystemExit) as cm:
            self.state(init=None, outer_lr=0.5, outer_momentum=0.9)
        self.assertIn("--outer-lr was 0.7, this start has 0.5", str(cm.exception))
        self.assertIn("restart with --outer-lr 0.7, or add --accept-config-change", str(cm.exception))
        with self.assertRaises(SystemExit) as cm:
            self.state(init=None, outer_lr=0.7, outer_momentum=0.0)
        self.assertIn("--outer-momentum was 0.9", str(cm.exception))
        self.assertEqual(self.snapshot(st), before, "a refused start changed the state dir")
        st = self.state(init=None, outer_lr=0.5, accept_config_change=True)
        self.assertEqual(st.cfg.outer_lr, 0.5)
        self.assertEqual(self.state(init=None, outer_lr=0.5).round, 1)      # recorded: no refusal now

    def test_an_unreadable_spool_entry_is_excluded_and_named(self):
        st = self.state()
        for c in ("a", "b"):
            st.join(c, f"{c}-inc")
        p = self.send(st, "a", self.delta()[0], 10)
        meta = [fn for fn in os.listdir(st.spool.dir) if fn.endswith(".json")]
        self.assertEqual(meta, ["r0_a_a-inc.json"])
        with open(os.path.join(st.spool.dir, meta[0]), "w") as f:
            f.write('{"cluster": "a", "incarn')                 # damaged on disk
        st = self.state(init=None)
        self.assertEqual(st.pending, {})
        self.assertEqual([(e["cluster"], e["incarnation"]) for e in st.excluded], [("a", "a-inc")])
        self.assertIn("r0_a_a-inc.json cannot be read", st.excluded[0]["why"])
        self.send(st, "b", self.delta()[0], 10)
        rec = st.tick()
        self.assertEqual(rec["round"], 1)
        self.assertEqual([e["cluster"] for e in rec["excluded"]], ["a"])

    def test_a_different_init_model_is_refused(self):
        self.state()
        other = os.path.join(self.dir, "other.safetensors")
        write_tensors(other, {"x": np.zeros(3, np.float32)}, "F32")
        with self.assertRaises(SystemExit) as cm:
            self.state(init=other)
        self.assertIn("not the model", str(cm.exception))
        with self.assertRaises(SystemExit) as cm:
            fs.FedMomState(fs.ServerConfig(os.path.join(self.dir, "empty")))
        self.assertIn("--init", str(cm.exception))


class LiveServerTest(FedMomFixture):
    """Threads serving fedmom, a real blob store and a real DARL coordinator on 127.0.0.1."""
    TOKEN = "t0ken"

    def serve(self, routes, **kw):
        server = httpd.make_server(routes, token=self.TOKEN, **kw)
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        self.addCleanup(server.server_close)
        self.addCleanup(server.shutdown)
        return server.url

    def test_membership_0_1_2_1_with_both_transports_and_darl_commits(self):
        coord = darl_server.Coordinator(block_space.BlockSpace(1000, 1, 0))
        darl_url = self.serve(darl_server.make_routes(coord))
        store = blobstore.BlobStore(os.path.join(self.dir, "blobs"), 1 << 34, 1 << 32)
        blob_url = self.serve(blobstore.make_routes(store))
        cfg = fs.ServerConfig(os.path.join(self.dir, "st"), self.init, 0.7, 0.9, 600, 600, blob_url, darl_url,
                              darl_retry_s=0.1)
        st = fs.FedMomState(cfg.validate(), darl=fedmom_state.DarlLink(darl_url, self.TOKEN))
        url = self.serve(fm.make_routes(st, blob_token=self.TOKEN), public=("/health", "/"))
        stop = threading.Event()
        for fn in (fm.round_loop, fm.darl_loop):
            loop = threading.Thread(target=fn, args=(st, stop, 0.05), daemon=True)
            loop.start()
            self.addCleanup(loop.join)
        self.addCleanup(stop.set)

        def lease(cluster, inc):
            httpc.call(darl_url, "POST", "/register", {"cluster": cluster, "incarnation": inc,
                                                       "digest": coord.digest}, token=self.TOKEN)
            return httpc.call(darl_url, "POST", "/acquire", {"cluster": cluster, "incarnation": inc, "blocks": 5},
                              token=self.TOKEN)["lease"]

        a = fedmom_client.FedMomClient(url, "lumi", "inc-a", token=self.TOKEN, blob_url=blob_url)
        b = fedmom_client.FedMomClient(url, "snellius", "inc-b", token=self.TOKEN, blob_url=blob_url)
        self.assertEqual(httpc.call(url, "GET", "/status", token=self.TOKEN)["members"], [])   # 0 members
        self.assertEqual(a.join()["members"], ["lumi"])                                        # 1
        theta_path = os.path.join(self.dir, "theta-a.safetensors")
        self.assertEqual(a.download_theta(theta_path), 0)
        self.assertEqual(rel_err(read_all(theta_path), self.theta0), 0)
        reply = a.send_delta(self.delta()[0], 0, 100, [lease("lumi", "inc-a")], {"loss": 2.0, "mfu": 0.4})
        self.assertTrue(reply["accepted"])
        self.assertEqual(a.wait_round_after(0, timeout_s=60), 1)                               # merged alone
        self.assertEqual(b.join()["members"], ["lumi", "snellius"])                            # 2
        self.assertEqual(b.download_theta(os.path.join(self.dir, "theta-b.safetensors"), "blob"), 1)
        self.assertEqual(rel_err(read_all(os.path.join(self.dir, "theta-b.safetensors")), self.theta(st)), 0)
        a.send_delta(self.delta()[0], 1, 100, [lease("lumi", "inc-a")], {"loss": 2.0}, transport="inline")
        self.assertEqual(a.heartbeat()["round"], 1)                                            # waits for b
        b.send_delta(self.delta("BF16")[0], 1, 300, [lease("snellius", "inc-b")], {"loss": 4.0}, transport="blob")
        self.assertEqual(b.wait_round_after(1, timeout_s=60), 2)
        rec = st.records[-1]
        self.assertAlmostEqual(rec["loss"], (100 * 2.0 + 300 * 4.0) / 400)                     # pooled by tokens
        self.assertAlmostEqual(rec["perplexity"], np.exp(rec["loss"]))
        self.assertEqual(rec["drift_max"], max(c["drift"] for c in rec["clusters"].values()))
        with self.assertRaises(fedmom_client.StaleRound) as cm:                                           # an old base
            a.send_delta(self.delta()[0], 0, 5, [], {})
        self.assertEqual(cm.exception.current_round, 2)
        b.leave()                                                                              # 1
        a.send_delta(self.delta()[0], 2, 50, [lease("lumi", "inc-a")], {}, transport="auto")
        self.assertEqual(a.wait_round_after(2, timeout_s=60), 3)
        self.assertEqual([r["members"] for r in st.records], [["lumi"], ["lumi", "snellius"], ["lumi"]])
        deadline = time.monotonic() + 60
        while st.pending_commits and time.monotonic() < deadline:                              # DARL catches up
            time.sleep(0.05)
        self.assertEqual(st.pending_commits, [])
        self.assertEqual(coord.status()["committed"], 20)
        merged = [l["id"] for r in st.records for o in r["outcomes"] if o["outcome"] == "merged" for l in o["leases"]]
        self.assertEqual(len(merged), 4)                        # 4 leases x 5 blocks, each in one merged round
        self.assertEqual(len(set(merged)), 4)
        self.assertEqual([(o["outcome"], o["merged_into"]) for o in a.heartbeat()["deltas"]], [("merged", 3)])
        self._check_http_edges(url, st)

    def _check_http_edges(self, url, st):
        page = urllib_get(url + "/")                           # public, no token
        self.assertIn("<svg", page)
        self.assertIn("round 3", page)
        with self.assertRaises(httpc.CallError) as cm:
            httpc.call(url, "GET", "/status", token="wrong")
        self.assertEqual(cm.exception.status, 401)
        before = self.snapshot(st)
        for headers, body, want in (({}, b"x" * 10, "X-Delta-Meta"),
                                    ({"X-Delta-Meta": "{nope"}, b"x", "not JSON"),
                                    ({"X-Delta-Meta": json.dumps({"cluster": "lumi", "incarnation": "inc-a",
                                                                  "base_round": 3, "tokens": 5,
                                                                  "leases": [{"id": 1, "end": 5}]})},
                                     b"\x00" * 100, "not a tensor file")):
            conn = httpc.connect(url)
            conn.request("PUT", "/delta", body=body, headers={**headers, **httpc.auth_headers(self.TOKEN)})
            resp = conn.getresponse()
            reply = json.loads(resp.read())
            conn.close()
            self.assertEqual(resp.status, 400, reply)
            self.assertIn(want, reply["error"])
        self.assertEqual(self.snapshot(st), before)
        out = subprocess.run([sys.executable, "fedmom_server.py", "status", "--url", url],
                             cwd=ROOT, capture_output=True, text=True, timeout=60,
                             env={**os.environ, "PWW_TOKEN": self.TOKEN})
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertIn("round 3", out.stdout)
        self.assertIn("merge round 3", out.stdout)
        self.assertRegex(out.stdout, r"memory budget [0-9.]+ GB \(fixed [0-9.]+ MB\): outer state [0-9.]+ MB in memory, "
                                     r"0.0 MB on disk")


class BlobRouteTest(FedMomFixture):
    """POST /delta_blob over HTTP: every refusal is a one-line JSON error and stores nothing;
    then the same delta with the right id and checksum is accepted."""
    TOKEN = LiveServerTest.TOKEN
    serve = LiveServerTest.serve

    def setUp(self):
        super().setUp()
        self.store = blobstore.BlobStore(os.path.join(self.dir, "blobs"), 1 << 30, 1 << 28)
        self.blob_url = self.serve(blobstore.make_routes(self.store))

    def aggregator(self, name, blob_url):
        cfg = fs.ServerConfig(os.path.join(self.dir, name), self.init, blob_url=blob_url)
        st = fs.FedMomState(cfg.validate(), clock=self.clock)
        st.join("lumi", "lumi-inc")
        return st, self.serve(fm.make_routes(st, blob_token=self.TOKEN))

    def post(self, url, body):
        """(status, reply) of one POST /delta_blob."""
        try:
            return 200, httpc.call(url, "POST", "/delta_blob", body, token=self.TOKEN, timeout=120)
        except httpc.CallError as e:
            return e.status, e.reply

    def test_every_refusal_names_the_cause_and_stores_nothing(self):
        st, url = self.aggregator("st", self.blob_url)
        path = self.delta()[0]
        sha = blob_client.put_file(self.blob_url, "delta-lumi-r0", path, token=self.TOKEN)["sha256"]
        meta = {"cluster": "lumi", "incarnation": "lumi-inc", "base_round": 0, "tokens": 100}
        before = self.snapshot(st)
        # refused before the fetch: the blob stays in place; refused after it (a wrong checksum): deleted
        cases = [({**meta, "blob": "../delta-lumi-r0", "sha256": sha}, 400, "must match", True),
                 ({**meta, "blob": "absent", "sha256": sha}, 400, "no complete blob 'absent'", True),
                 ({**meta, "blob": "delta-lumi-r0"}, 400, "missing field 'sha256'", True),
                 ({**meta, "blob": "delta-lumi-r0", "sha256": sha, "tokens": 0}, 400, "tokens is 0", True),
                 ({**meta, "blob": "delta-lumi-r0", "sha256": "0" * 64}, 400, "has sha256", False)]
        for body, status, why, kept in cases:
            with self.subTest(why=why):
                got, reply = self.post(url, body)
                self.assertEqual(got, status, reply)
                self.assertIn(why, reply["error"])
                self.assertNotIn("\n", reply["error"])
                self.assertEqual(self.snapshot(st), before)
                self.assertEqual(self.store.complete("delta-lumi-r0") is not None, kept, "blob kept")
        sha = blob_client.put_file(self.blob_url, "delta-lumi-r0", path, token=self.TOKEN)["sha256"]
        # no blob store configured, and a store that is down: nothing stored either
        plain, plain_url = self.aggregator("plain", None)
        got, reply = self.post(plain_url, {**meta, "blob": "delta-lumi-r0", "sha256": sha})
        self.assertEqual(got, 400, reply)
        self.assertIn("--blob-url", reply["error"])
        import socket
        with socket.socket() as s:                      # a port nobody listens on
            s.bind(("127.0.0.1", 0))
            dead = f"http://127.0.0.1:{s.getsockname()[1]}"
        down, down_url = self.aggregator("down", dead)
        down_before = self.snapshot(down)
        t0 = time.monotonic()
        got, reply = self.post(down_url, {**meta, "blob": "delta-lumi-r0", "sha256": sha})
        self.assertEqual(got, 502, reply)
        self.assertIn("unreachable", reply["error"])
        self.assertLess(time.monotonic() - t0, 60, "a few retries, then the site is told")
        self.assertEqual(self.snapshot(down), down_before)
        self.assertEqual((down.pending, plain.pending), ({}, {}))
        # the right id and checksum: accepted, spooled, and the blob is removed from the store
        got, reply = self.post(url, {**meta, "blob": "delta-lumi-r0", "sha256": sha})
        self.assertEqual(got, 200, reply)
        self.assertTrue(reply["accepted"])
        self.assertIn(("lumi", "lumi-inc"), st.pending)
        self.assertIsNone(self.store.complete("delta-lumi-r0"))


class JsonRouteTest(FedMomFixture):
    """Every JSON route of the aggregator (its own route table's POSTs), over HTTP, fed
    bodies no client should send: each a 4xx with a one-line error, nothing on disk changes,
    and the server goes on serving."""
    TOKEN = LiveServerTest.TOKEN
    serve = LiveServerTest.serve

    def raw(self, url, path, body, headers=None):
        conn = httpc.connect(url)
        try:
            conn.putrequest("POST", path)
            hdrs = {**httpc.auth_headers(self.TOKEN), **(headers or {})}
            if "Content-Length" not in hdrs and body is not None:
                hdrs["Content-Length"] = str(len(body))
            for k, v in hdrs.items():
                conn.putheader(k, v)
            conn.endheaders(body)
            resp = conn.getresponse()
            return resp.status, json.loads(resp.read())
        finally:
            conn.close()

    def test_bad_bodies_on_every_json_route(self):
        cfg = fs.ServerConfig(os.path.join(self.dir, "st"), self.init, blob_url="http://127.0.0.1:9")
        st = fs.FedMomState(cfg.validate(), clock=self.clock)
        st.join("lumi", "lumi-inc")
        routes = fm.make_routes(st, blob_token=self.TOKEN)
        url = self.serve(routes, max_body=4096)
        posts = sorted(path for method, path in routes if method == "POST")
        self.assertEqual(posts, ["/delta_blob", "/delta_check", "/heartbeat", "/join", "/leave"])
        me = {"cluster": "lumi", "incarnation": "lumi-inc"}
        bodies = [(b"{not json", 400, "malformed JSON"), (b"[1, 2]", 400, "must be an object"),
                  (b'"text"', 400, "must be an object"), (b"\xff\xfe", 400, "malformed JSON"),
                  (b"[" * 100000 + b"]" * 100000, 413, "exceeds"), (b"{" + b" " * 5000 + b"}", 413, "exceeds"),
                  (b"", 400, "cluster|blob"), (b"{}", 400, "cluster|blob"),
                  (json.dumps({"cluster": 7, "incarnation": ["x"]}).encode(), 400, "cluster|blob"),
                  (json.dumps({"cluster": None, "incarnation": "lumi-inc"}).encode(), 400, "cluster|blob"),
                  # a well-formed id nobody joined with: 409 where membership is asked, 400 on a bad id
                  (json.dumps({"cluster": "../etc", "incarnation": "x"}).encode(), (400, 409), "cluster|member|blob")]
        per_route = {"/heartbeat": [({**me, "wait_round_after": "soon"}, "wait_round_after"),
                                    ({**me, "wait_s": [1]}, "wait_s")],
                     "/delta_check": [({**me, "base_round": -1, "tokens": 5}, "base_round"),
                                      ({**me, "base_round": 0, "tokens": True}, "tokens"),
                                      ({**me, "base_round": 0, "tokens": 5, "leases": [{"id": "7"}]}, "leases"),
                                      ({**me, "base_round": 0, "tokens": 5, "metrics": []}, "metrics")],
                     "/delta_blob": [({**me, "base_round": 0, "tokens": 5, "blob": 7, "sha256": "x"}, "blob"),
                                     ({**me, "base_round": 0, "tokens": 5, "blob": "b", "sha256": None}, "sha256")]}
        before = self.snapshot(st)
        for path in posts:
            cases = bodies + [(json.dumps(b).encode(), 400, why) for b, why in per_route.get(path, [])]
            for body, status, why in cases:
                with self.subTest(path=path, body=body[:40]):
                    got, reply = self.raw(url, path, body)
                    self.assertIn(got, status if isinstance(status, tuple) else (status,), reply)
                    self.assertRegex(reply["error"], why)
                    self.assertNotIn("\n", reply["error"])
            with self.subTest(path=path, body="no Content-Length"):
                got, reply = self.raw(url, path, None)
                self.assertEqual((got, "Content-Length" in reply["error"]), (411, True), reply)
        self.assertEqual(self.snapshot(st), before)
        self.assertEqual(st.pending, {})
        self.assertEqual(httpc.call(url, "POST", "/heartbeat", me, token=self.TOKEN)["round"], 0)   # still serving


def urllib_get(url):
    conn = httpc.connect(url)
    try:
        conn.request("GET", "/")
        resp = conn.getresponse()
        return resp.read().decode()
    finally:
        conn.close()


class CrashTest(FedMomFixture):
    def start(self, state_dir, *extra, pause="0"):
        proc = subprocess.Popen([sys.executable, "fedmom_server.py", "--state-dir", state_dir, "--port", "0",
                                 *extra], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, outer_state.MERGE_PAUSE_ENV: pause})
        self.addCleanup(lambda: proc.poll() is None and (proc.kill(), proc.wait(30)))
        self.url = listening_url(proc, timeout=120)[0]
        return proc, self.url

    def served_theta(self, url):
        """theta_global as GET /theta serves it, as a file -> its path."""
        path = os.path.join(self.dir, f"served-{secrets.token_hex(4)}.safetensors")
        fedmom_client.FedMomClient(url, "reader", "reader-inc").download_theta(path)
        return path

    def test_sigkill_during_a_merge_leaves_a_consistent_round(self):
        sd = os.path.join(self.dir, "st")
        # 600 s after each of the 4 tensors: the merge stays mid-file until the kill, however slow the machine
        proc, url = self.start(sd, "--init", self.init, pause="600")
        deltas = []
        for c, tok in (("a", 10), ("b", 30)):
            fedmom_client.FedMomClient(url, c, f"{c}-inc").join()
        for c, tok in (("a", 10), ("b", 30)):
            path, d = self.delta("F16")
            deltas.append(d)
            fedmom_client.FedMomClient(url, c, f"{c}-inc").send_delta(path, 0, tok, [], {})
        deadline = time.monotonic() + 120                      # the merge runs in memory, paused mid-model
        while not httpc.call(url, "GET", "/round")["merging"] and time.monotonic() < deadline:
            time.sleep(0.01)
        self.assertTrue(httpc.call(url, "GET", "/round")["merging"])
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        with open(os.path.join(sd, "state.json")) as f:        # the old round, intact
            self.assertEqual(json.load(f)["round"], 0)
        outer = outer_state.load_outer(sd)              # round 0's theta, as it was
        self.assertEqual(rel_err({n: a.reshape(outer.shapes[n]) for n, a in outer.theta.items()}, self.theta0), 0)
        proc, url = self.start(sd)                             # restart: the spooled deltas merge now
        client = fedmom_client.FedMomClient(url, "a", "a-inc")
        self.assertEqual(client.wait_round_after(0, timeout_s=60), 1)
        want, _ = naive_fedmom(self.theta0, None, deltas, [10, 30], 0.7, 0.9)
        theta1 = read_all(self.served_theta(url))
        self.assertLess(rel_err(theta1, want), 1e-6)
        self.assertFalse([f for f in os.listdir(sd) if ".tmp-" in f])
        self.assertEqual([r["round"] for r in durable.read_jsonl(os.path.join(sd, "rounds.jsonl"))], [1])
        proc.send_signal(signal.SIGKILL)                       # and right after a merge: still round 1,
        proc.wait(timeout=30)                                  # replayed from round 0's checkpoint, same bits
        proc, url = self.start(sd)
        self.assertEqual(httpc.call(url, "GET", "/round")["round"], 1)
        self.assertEqual(rel_err(read_all(self.served_theta(url)), theta1), 0)
        proc.kill()
        proc.wait(timeout=30)


    def test_a_second_start_on_a_live_state_dir_touches_nothing(self):
        """Port taken, or another port on the same state dir: the second process stops with
        one line, before it reads, cleans or rewrites anything of the live one's."""
        sd = os.path.join(self.dir, "st")
        proc, url = self.start(sd, "--init", self.init)
        for c in ("a", "b"):
            fedmom_client.FedMomClient(url, c, f"{c}-inc").join()
        fedmom_client.FedMomClient(url, "a", "a-inc").send_delta(self.delta()[0], 0, 10, [], {})  # spooled, b owes
        with open(os.path.join(sd, "spool", ".part-0123456789abcdef"), "wb") as f:
            f.write(b"an upload still arriving")           # what a live PUT /delta writes mid-body
        def files():
            out = {}
            for base, _, names in os.walk(sd):
                for fn in names:
                    with open(os.path.join(base, fn), "rb") as f:
                        out[os.path.relpath(os.path.join(base, fn), sd)] = f.read()
            return out
        before = files()
        port = url.rsplit(":", 1)[1]
        for port_arg, says in ((port, "address is in use"), ("0", "in use by another fedmom_server")):
            out = subprocess.run([sys.executable, "fedmom_server.py", "--state-dir", sd, "--port", port_arg],
                                 cwd=ROOT, capture_output=True, text=True, timeout=120)
            self.assertEqual(out.returncode, 1, out.stdout + out.stderr)
            self.assertIn(says, out.stderr)
            self.assertNotIn("Traceback", out.stderr)
            self.assertEqual(files(), before, f"a refused start on port {port_arg} changed the live state dir")
        self.assertEqual(httpc.call(url, "GET", "/status")["pending"], ["a"])
        proc.kill()
        proc.wait(timeout=30)


class QuorumServerTest(FedMomFixture):
    """fedmom_server.py with --phase-s and --quorum: a round whose quorum arrived merges a grace
    later without the straggler, whose delta for it is then stale; the replies say the cadence,
    the round's age and whom it waits on."""
    start = CrashTest.start

    def test_a_round_merges_without_the_straggler_once_its_quorum_arrived(self):
        # the grace is 0.001 x --phase-s = 0.06 s: the first round-loop tick after alpha's delta closes it
        proc, url = self.start(os.path.join(self.dir, "st"), "--init", self.init, "--phase-s", "60",
                               "--quorum", "0.5", "--grace-frac", "0.001")
        alpha, beta = (fedmom_client.FedMomClient(url, c, f"{c}-inc") for c in ("alpha", "beta"))
        self.assertEqual(alpha.join()["phase_s"], 60.0)
        beta.join()
        for client, tokens in ((alpha, 30), (beta, 10)):        # round 0: no history, so it waits for both
            client.send_delta(self.delta()[0], 0, tokens, [], {"ended_by": "clock", "util": 0.9})
        self.assertEqual(alpha.wait_round_after(0, timeout_s=120), 1)
        reply = beta.heartbeat()
        self.assertEqual(reply["waiting_on"], ["alpha", "beta"])
        self.assertIsInstance(reply["round_age_s"], float)
        alpha.send_delta(self.delta()[0], 1, 30, [], {})        # 30 of 30 + beta's 10 expected: 75%
        self.assertEqual(alpha.wait_round_after(1, timeout_s=120), 2)
        with self.assertRaises(fedmom_client.StaleRound) as cm:   # the client's name for 409 stale_round
            beta.send_delta(self.delta()[0], 1, 10, [], {})
        self.assertEqual(cm.exception.current_round, 2)
        first, second = httpc.call(url, "GET", "/status")["recent"]
        self.assertEqual((first["reason"], first["quorum"], first["period_s"]),
                         ("every live member sent its delta", None, None))
        self.assertEqual({k: first["clusters"]["alpha"][k] for k in ("ended_by", "util")},
                         {"ended_by": "clock", "util": 0.9})
        self.assertEqual(second["reason"], "quorum: 75% of the 40 tokens expected arrived; "
                                           "grace 0.06 s passed without ['beta']")
        self.assertEqual((second["late"], second["quorum"], list(second["clusters"])),
                         (["beta"], {"fraction": 0.5, "grace_s": 0.06, "expected_tokens": 40}, ["alpha"]))
        self.assertIsInstance(second["period_s"], float)
        self.assertIsInstance(second["clusters"]["alpha"]["waited_s"], float)
        proc.kill()
        proc.wait(timeout=30)

    def test_the_cadence_flags_are_checked_and_the_quorum_defaults_with_phase_s(self):
        cfg = lambda **kw: fs.ServerConfig(os.path.join(self.dir, "st"), **kw)
        self.assertEqual((cfg().round_quorum(), cfg(phase_s=60.0).round_quorum(),
                          cfg(phase_s=60.0, quorum=0.5).round_quorum()), (1.0, 0.25, 0.5))
        for kw, flag in (({"phase_s": 0.0}, "--phase-s"), ({"phase_s": float("inf")}, "--phase-s"),
                         ({"quorum": 0.0}, "--quorum"), ({"quorum": 1.5}, "--quorum"),
                         ({"grace_frac": 0.0}, "--grace-frac"), ({"grace_frac": float("nan")}, "--grace-frac")):
            with self.subTest(kw=kw), self.assertRaises(SystemExit) as cm:
                cfg(**kw).validate()
            self.assertTrue(str(cm.exception.code).startswith(flag), cm.exception.code)


class DownstreamTest(FedMomFixture):
    """--down-wire against a real fedmom_server process: a site holding round r gets r+1 as
    an update and holds the server's theta bit for bit, through a server SIGKILL and a new
    site process; a new, behind or altered site downloads the whole theta."""
    start = CrashTest.start

    def site(self, url, name, blob_url=None):
        """fedsite.FedSite's download half (no DARL call is made), as train.py's rank 0 uses it;
        with blob_url, theta and its updates come through the blob store (--transport blob)."""
        import fedsite
        import types
        cfg = types.SimpleNamespace(cluster=name, token_file=None, darl_url="http://127.0.0.1:9", federation=url,
                                    blob_url=blob_url, ca_file=None, transport="blob" if blob_url else "inline")
        return fedsite.FedSite(cfg, None, 0, self.said.append)

    def start_blobstore(self):
        proc = subprocess.Popen([sys.executable, "blobstore.py", "--root", os.path.join(self.dir, "blobs"),
                                 "--port", "0"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.addCleanup(lambda: proc.poll() is None and (proc.kill(), proc.wait(30)))
        return listening_url(proc, timeout=120)[0]

    def bits(self, path):
        with tensorio.TensorReader(path) as r:
            return {n: r.read(n).view(np.uint32).copy() for n in r.names}

    def assert_holds_server_theta(self, sd, path, rnd):
        with open(os.path.join(sd, "state.json")) as f:
            st = json.load(f)
        self.assertEqual(st["round"], rnd)
        want, got = self.bits(CrashTest.served_theta(self, self.url)), self.bits(path)
        self.assertEqual(sorted(want), sorted(got))
        for n in want:                      # the exact bits, not close values
            self.assertTrue(np.array_equal(want[n], got[n]), f"round {rnd}: tensor {n} differs")

    def merge_round(self, url, rnd):
        for c, tok in (("a", 10), ("b", 30)):
            fedmom_client.FedMomClient(url, c, f"{c}-inc").send_delta(self.delta("F32")[0], rnd, tok, [], {})
        self.assertEqual(fedmom_client.FedMomClient(url, "a", "a-inc").wait_round_after(rnd, timeout_s=120), rnd + 1)

    def test_a_site_holding_round_r_gets_r_plus_1_as_an_update_bit_for_bit(self):
        self.said = []
        sd = os.path.join(self.dir, "st")
        blob_url = self.start_blobstore()
        proc, url = self.start(sd, "--init", self.init, "--down-wire", "int4", "--blob-url", blob_url)
        for c in ("a", "b"):
            fedmom_client.FedMomClient(url, c, f"{c}-inc").join()
        a_path, late_path = os.path.join(self.dir, "a", "theta.safetensors"), os.path.join(self.dir, "late.safetensors")
        os.makedirs(os.path.dirname(a_path))
        a = self.site(url, "a")
        self.assertEqual(a._fetch(a_path), 0)
        self.assertEqual(a.down["via"], "full")                     # nothing held yet: the whole file
        full = a.down["bytes"]
        late = self.site(url, "late")
        self.assertEqual(late._fetch(late_path), 0)
        b_path = os.path.join(self.dir, "b.safetensors")           # a site on the blob transport
        b = self.site(url, "b", blob_url)
        self.assertEqual(b._fetch(b_path), 0)
        sizes = []
        for rnd in range(3):
            self.merge_round(url, rnd)
            for site, path in ((a, a_path), (b, b_path)):
                self.assertEqual(site._fetch(path), rnd + 1)
                self.assertEqual(site.down["via"], "update", self.said)
                self.assert_holds_server_theta(sd, path, rnd + 1)
            sizes.append(a.down["bytes"])
            self.assertEqual(b.down["bytes"], a.down["bytes"])
        blobs = {x["id"]: x["size"] for x in httpc.call(blob_url, "GET", "/blobs")["blobs"]}
        agg = httpc.call(url, "GET", "/status")["aggregator"]
        self.assertEqual([blobs.get(fedmom_state.blob_name(agg, "update", r)) for r in (1, 2, 3)], sizes)  # b's came this way
        n = sum(int(np.prod(s)) for s in SHAPES.values())
        self.assertTrue(all(b / n < 0.6 for b in sizes), f"int4 update bytes/param {[b / n for b in sizes]}")
        self.assertGreater(full / n, 3.99)
        # the server's theta is theta_r + the decoded update, not the exact merge: what it
        # rounded away is in its residual, owed to the next update
        with open(os.path.join(sd, "state.json")) as f:
            upd = json.load(f)["update"]
        self.assertEqual((upd["round"], upd["format"]), (3, "int4"))
        self.assertGreater(upd["residual_norm"], 0)
        self.assertEqual(upd["digest"], wire.theta_digest(a_path))
        rec = durable.read_jsonl(os.path.join(sd, "rounds.jsonl"))[-1]
        self.assertEqual((rec["down_wire"], rec["update_bytes"]), ("int4", sizes[-1]))
        self.assertEqual(httpc.call(url, "GET", "/status")["update"],
                         {"round": 3, "format": "int4", "update_bytes": sizes[-1], "residual_norm": upd["residual_norm"]})
        # a site three rounds behind: the whole theta, the same bits
        self.assertEqual(late._fetch(late_path), 3)
        self.assertEqual(late.down["via"], "full")
        self.assert_holds_server_theta(sd, late_path, 3)
        # the aggregator is SIGKILLed and restarted: its residual and update survive, and a new
        # site process (digest read from the file it left) still gets the update
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        proc, url = self.start(sd, "--down-wire", "int4", "--blob-url", blob_url)
        self.merge_round(url, 3)
        a2 = self.site(url, "a")
        self.assertEqual(a2._fetch(a_path), 4)
        self.assertEqual(a2.down["via"], "update", self.said)
        self.assert_holds_server_theta(sd, a_path, 4)
        # a theta that is not the server's (one value changed): refused by digest, downloaded whole
        with tensorio.TensorReader(a_path) as r:
            arrays = {k: r.read(k).copy() for k in r.names}
        arrays["norm"][0] += 1.0
        with tensorio.TensorWriter(a_path, [(k, "F32", v.shape) for k, v in arrays.items()], {"round": "4"},
                                   fsync=False) as w:
            for k, v in arrays.items():
                w.write(k, v)
        self.merge_round(url, 4)
        a3 = self.site(url, "a")
        self.assertEqual(a3._fetch(a_path), 5)
        self.assertEqual(a3.down["via"], "full")
        self.assert_holds_server_theta(sd, a_path, 5)
        with self.assertRaises(httpc.CallError) as cm:
            httpc.call(url, "GET", "/theta_update?from=4&digest=" + "0" * 64)
        self.assertEqual((cm.exception.status, cm.exception.reply.get("code")), (409, "no_update"))
        with open(os.path.join(sd, "state.json")) as f:
            ckpt = json.load(f)["checkpoint"]
        self.assertEqual(ckpt["round"], 4, "--checkpoint-rounds 4: round 4's theta, momentum and residual")
        self.assertFalse([f for f in os.listdir(sd) if f.startswith(("update-", "residual-", "merged-", "theta-"))
                          and not f.endswith(("-5.safetensors", "-4.safetensors"))], "files of older rounds are left")
        self.assertFalse(os.path.exists(os.path.join(self.dir, "a", "theta-update.safetensors")))

    def test_int2_deltas_up_and_int2_updates_down(self):
        # two sites send int2 deltas (train.py --wire int2) to a server with --down-wire int2:
        # the server merges their decoded values, and a site holding round r adds the int2
        # update of r+1 to the server's theta bit for bit, at ~0.27 B/param each way
        self.said = []
        sd = os.path.join(self.dir, "st")
        proc, url = self.start(sd, "--init", self.init, "--down-wire", "int2", "--outer-lr", "1", "--outer-momentum", "0")
        for c in ("a", "b"):
            fedmom_client.FedMomClient(url, c, f"{c}-inc").join()
        a_path = os.path.join(self.dir, "a", "theta.safetensors")
        os.makedirs(os.path.dirname(a_path))
        a = self.site(url, "a")
        self.assertEqual(a._fetch(a_path), 0)
        n = sum(int(np.prod(s)) for s in SHAPES.values())
        codec = wire.Codec("int2")
        for rnd in range(2):
            before = self.bits(a_path)
            sent = {}
            for c, tok in (("a", 10), ("b", 30)):
                path = os.path.join(self.dir, f"{c}-{rnd}.safetensors")
                with wire.WireWriter(path, list(SHAPES.items()), codec, {"base_round": str(rnd)}) as w:
                    sent[c] = {k: w.write(k, (0.01 * self.rng.standard_normal(s)).astype(np.float32))
                               for k, s in SHAPES.items()}
                self.assertLess(os.path.getsize(path) / n, 0.3)
                fedmom_client.FedMomClient(url, c, f"{c}-inc").send_delta(path, rnd, tok, [], {})
            self.assertEqual(fedmom_client.FedMomClient(url, "a", "a-inc").wait_round_after(rnd, timeout_s=120),
                             rnd + 1)
            self.assertEqual(a._fetch(a_path), rnd + 1)
            self.assertEqual(a.down["via"], "update", self.said)
            self.assert_holds_server_theta(sd, a_path, rnd + 1)
            self.assertLess(a.down["bytes"] / n, 0.3)
            # the merge (FedAvg, tokens 10 : 30) of the decoded deltas, then int2 on the way down:
            # theta moved by that merge to within the update's error (what it owes)
            with tensorio.TensorReader(a_path) as r:
                for k in SHAPES:
                    step = r.read(k).view(np.float32) - before[k].view(np.float32)
                    merged = 0.25 * sent["a"][k] + 0.75 * sent["b"][k]
                    rel = np.linalg.norm(step - merged) / np.linalg.norm(merged)
                    self.assertLess(rel, 0.75 if rnd == 0 else 1.2, k)
        rec = durable.read_jsonl(os.path.join(sd, "rounds.jsonl"))[-1]
        self.assertEqual(rec["down_wire"], "int2")
        proc.terminate()
        proc.wait(timeout=30)


class HostileDeltaTest(FedMomFixture):
    """Finite deltas that would wreck theta_global, and members that must not stall a round."""

    def huge(self, value=3e38):
        arrays = {k: np.zeros(sh, np.float32) for k, sh in SHAPES.items()}
        arrays["layer.w"][:] = value
        path = os.path.join(self.dir, f"huge-{self.rng.integers(1 << 40)}.safetensors")
        write_tensors(path, arrays, "F32")
        return path

    def test_two_huge_finite_deltas_never_publish_a_non_finite_theta(self):
        """(test_custody.HostileMergeCustodyTest: the same under --darl, the custody aborted.)"""
        st = self.state()                                     # lr 0.7, Nesterov 0.9: 3e38 * 1.33 = inf
        for c in ("a", "b"):
            st.join(c, f"{c}-inc")
        before = self.theta(st)
        self.send(st, "a", self.huge(), 10, leases=[{"id": 1, "end": 4}])
        self.send(st, "b", self.huge(), 10, leases=[{"id": 2, "end": 8}])
        self.assertIsNone(st.tick(), "nothing finite to merge: no round")
        self.assertEqual(st.round, 0)
        self.assertEqual(rel_err(self.theta(st), before), 0.0)
        whys = {e["cluster"]: e["why"] for e in st.status()["excluded"]}
        self.assertEqual(sorted(whys), ["a", "b"])
        self.assertTrue(all("not finite" in w for w in whys.values()), whys)
        self.assertEqual(sorted(os.listdir(st.spool.dir)), [], "the excluded deltas' files are gone")
        # the round goes on: a finite delta from a newcomer merges into a finite theta
        st.join("c", "c-inc")
        gpath, g = self.delta("F32")
        self.send(st, "c", gpath, 20, leases=[{"id": 3, "end": 12}])
        rec = st.tick()
        self.assertEqual(sorted(rec["clusters"]), ["c"])
        self.assertEqual(sorted((o["cluster"], o["outcome"]) for o in rec["outcomes"]),
                         [("a", "excluded"), ("b", "excluded"), ("c", "merged")])
        self.assertTrue(all(np.isfinite(t).all() for t in self.theta(st).values()))
        with tensorio.TensorReader(os.path.join(st.dir, st.momentum_file)) as r:
            self.assertTrue(all(np.isfinite(r.read(n)).all() for n in r.names))

    def test_recent_rounds_make_the_median_robust_to_a_hostile_majority(self):
        st = self.state(outer_lr=1.0, outer_momentum=0.0)
        for c in ("a", "b", "c"):
            st.join(c, f"{c}-inc")
        for _ in range(2):                                     # two ordinary rounds: the history
            for c in ("a", "b", "c"):
                self.send(st, c, self.delta("F32")[0], 10)
            self.assertIsNotNone(st.tick())
        before = self.theta(st)
        self.send(st, "a", self.huge(1e30), 10)
        self.send(st, "b", self.huge(1e30), 10)
        pc, c = self.delta("F32")
        self.send(st, "c", pc, 10)
        rec = st.tick()
        self.assertEqual(sorted(x["cluster"] for x in rec["clip"]["clipped"]), ["a", "b"])
        limit = rec["clip"]["limit"]
        moved = np.sqrt(sum(float(((self.theta(st)[k] - before[k]) ** 2).sum()) for k in SHAPES))
        self.assertLess(moved, limit, "the step is bounded by the clipped norms, not by 1e30")

    def test_a_momentum_pushed_near_the_limit_is_reset_not_a_stuck_round(self):
        st = self.state()                                     # lr 0.7, Nesterov 0.9
        st.join("a", "a-inc")
        self.send(st, "a", self.huge(2e38), 10)               # theta 2.66e38, momentum -2e38: finite
        self.assertEqual(st.tick()["momentum_reset"], None)
        gpath, g = self.delta("F32")
        self.send(st, "a", gpath, 10)                         # any delta now: theta + 0.567 x 2e38 = inf
        rec = st.tick()
        self.assertIsNotNone(rec, "the round merged")
        self.assertEqual(sorted(rec["clusters"]), ["a"], "the small delta was not excluded")
        self.assertIn("momentum buffer of round 1 is reset", rec["momentum_reset"])
        self.assertTrue(all(np.isfinite(t).all() for t in self.theta(st).values()))

    def test_a_long_poll_whose_member_leaves_meanwhile_still_answers(self):
        """Found by http_fuzz.py: the reply after the wait looked the member up again (500)."""
        st = self.state()
        st.join("a", "a-inc")
        self.clock.t += 1.0                                   # the heartbeat marks its arrival with this time
        out = {}
        t = threading.Thread(target=lambda: out.update(reply=st.heartbeat("a", "a-inc", wait_round_after=0,
                                                                          wait_s=60)))
        t.start()
        deadline = time.monotonic() + 30
        while st.members["a"].last_seen != self.clock.t:      # it holds the lock until it waits
            self.assertLess(time.monotonic(), deadline)
            time.sleep(0.01)
        st.leave("a", "a-inc")                                # runs once the heartbeat waits
        t.join(30)
        self.assertEqual((out["reply"]["members"], out["reply"]["sent"]), ([], False))

    def test_a_huge_delta_alone_is_excluded_and_the_round_stays(self):
        st = self.state()
        st.join("a", "a-inc")
        self.send(st, "a", self.huge(), 10)
        before = self.theta(st)
        self.assertIsNone(st.tick())
        self.assertEqual(st.round, 0)
        self.assertEqual(rel_err(self.theta(st), before), 0.0)
        told = st.heartbeat("a", "a-inc")["deltas"]
        self.assertEqual([o["outcome"] for o in told], ["excluded"])    # the site releases its leases
        self.assertIn("not finite", told[0]["why"])

    def test_an_outlier_is_clipped_to_k_times_the_median_and_named(self):
        st = self.state(outer_lr=1.0, outer_momentum=0.0, clip_factor=10.0)
        for c in ("a", "b", "big"):
            st.join(c, f"{c}-inc")
        pa, a = self.delta("F32", scale=0.01)
        pb, b = self.delta("F32", scale=0.012)
        pbig, big = self.delta("F32", scale=5.0)              # ~450x the others' norm
        for c, path in (("a", pa), ("b", pb), ("big", pbig)):
            self.send(st, c, path, 10)
        rec = st.tick()
        norms = {c: np.sqrt(sum(float((d[k] ** 2).sum()) for k in d)) for c, d in (("a", a), ("b", b), ("big", big))}
        limit = 10.0 * norms["b"]                              # the median of the three
        scale = limit / norms["big"]
        self.assertAlmostEqual(rec["clip"]["limit"], limit, delta=limit * 1e-5)
        self.assertEqual([(c["cluster"], round(c["scale"], 4)) for c in rec["clip"]["clipped"]],
                         [("big", round(scale, 4))])
        self.assertAlmostEqual(rec["clusters"]["big"]["clip_scale"], scale, places=5)
        self.assertEqual(rec["clusters"]["a"]["clip_scale"], 1.0)
        want = {k: self.theta0[k] + (a[k] + b[k] + scale * big[k]) / 3 for k in SHAPES}
        self.assertLess(rel_err(self.theta(st), want), 1e-5)

    def test_clipping_needs_company_and_can_be_switched_off(self):
        self.assertEqual(fedmom_merge.clip_scales([5.0], [], 10.0), ([1.0], 50.0))
        self.assertEqual(fedmom_merge.clip_scales([1.0, 1000.0], [1.0, 1.0], 10.0), ([1.0, 0.01], 10.0))
        self.assertEqual(fedmom_merge.clip_scales([1.0, 1000.0], [], 0.0), ([1.0, 1.0], None))

    def test_a_zero_token_delta_does_not_stall_the_round(self):
        st = self.state()
        for c in ("a", "b"):
            st.join(c, f"{c}-inc")
        with self.assertRaises(fedmom_round.Refused) as cm:
            self.send(st, "a", self.delta()[0], 0)
        self.assertEqual((cm.exception.status, cm.exception.extra["code"]), (400, "bad_delta"))
        self.send(st, "b", self.delta()[0], 10)
        rec = st.tick()                                        # no deadline needed: a has answered
        self.assertEqual(rec["reason"], "every live member sent its delta")
        self.assertEqual([e["cluster"] for e in rec["excluded"]], ["a"])

    def test_merge_files_stops_before_writing_a_non_finite_tensor(self):
        st = self.state()
        out_t, out_m = os.path.join(self.dir, "t.safetensors"), os.path.join(self.dir, "m.safetensors")
        with self.assertRaises(fedmom_merge.NonFinite) as cm:
            fedmom_merge.merge_files(os.path.join(st.dir, st.theta_file), None, [(self.huge(), 1.0)],
                                     out_t, out_m, lr=0.7, mu=0.9, fsync=False)
        self.assertEqual(cm.exception.name, "layer.w")
        self.assertFalse([f for f in os.listdir(self.dir) if f.startswith(("t.safetensors", "m.safetensors"))])

    def test_a_non_finite_init_model_is_refused(self):
        bad = {k: np.zeros(sh, np.float32) for k, sh in SHAPES.items()}
        bad["norm"][0] = np.inf
        path = os.path.join(self.dir, "bad-init.safetensors")
        write_tensors(path, bad, "F32")
        with self.assertRaises(SystemExit) as cm:
            self.state(init=path)
        self.assertIn("NaN or Inf", str(cm.exception))


class ImportTest(unittest.TestCase):
    def test_the_server_module_imports_with_torch_absent(self):
        """The central VM's modules (and fedsite.py, the site's torch-free half) import without torch."""
        code = ("import sys; sys.modules['torch'] = None\n"
                "import fedmom_server, fedmom_state, fedmom_client, tensorio\n"
                "import darl_server, darl_table, darl_table, block_space, darl_server, audit, blobstore, blob_client, durable, httpd, httpd, httpc, testhooks, wire, wire, fedsite\n"  # the rest of the VM; fedsite
                "assert 'torch' not in [m for m in sys.modules if sys.modules[m] is not None]\n"
                "print('ok', fedmom_server.DEFAULT_PORT)")
        out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertEqual(out.stdout.strip(), "ok 29511")


if __name__ == "__main__":
    unittest.main()
