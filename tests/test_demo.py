"""demo.py's own logic, without training: the summary and audit functions on prepared
records (and on a real DARL snapshot), the site command line, process-group kills,
the three services started and stopped for real, and --help. The end-to-end
federation runs live in tests/test_federation.py."""
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import unittest

import numpy as np

import audit
import darl_client
import demo
from testbed import harness
import httpc
import tensorio

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tmpdir(test):
    path = tempfile.mkdtemp(prefix="demo-test-")
    test.addCleanup(shutil.rmtree, path, True)
    return path


def record(rnd, loss, tokens=1000, clusters=("alpha", "beta")):
    return {"round": rnd, "loss": loss, "tokens": tokens,
            "clusters": {c: {"incarnation": f"{c}-1", "tokens": tokens // len(clusters)} for c in clusters}}


class SummaryTest(unittest.TestCase):
    def test_sparkline_spans_low_to_high(self):
        s = demo.sparkline([5.0, 4.0, 3.0, 2.0, 1.0])
        self.assertEqual(len(s), 5)
        self.assertEqual(s[0], demo.SPARK[-1])
        self.assertEqual(s[-1], demo.SPARK[0])
        self.assertEqual(demo.sparkline([]), "")
        self.assertEqual(demo.sparkline([None, 2.0])[0], " ")
        # a steep first fall, then a slow one: the later rounds keep distinct levels
        loss = [5.5, 4.0, 3.1, 2.6, 2.4, 2.3, 2.25, 2.2, 2.15, 2.12, 2.1, 2.08, 2.05, 2.03, 2.0]
        s = demo.sparkline(loss)
        self.assertEqual((s[0], s[-1]), (demo.SPARK[-1], demo.SPARK[0]))
        self.assertGreaterEqual(len(set(s[4:])), 3, s)            # a linear scale drew these as one level
        self.assertEqual(list(s), sorted(s, reverse=True))
        self.assertIn("= 2.000", demo.spark_scale(loss))
        self.assertIn("= 5.500", demo.spark_scale(loss))

    def test_coverage_line_has_percent_and_eta(self):
        darl = {"num_blocks": 100, "committed": 12, "leased": 4, "free": 84, "quarantined": 0,
                "clusters": [{"live": True, "blocks_per_s": 0.2}, {"live": False, "blocks_per_s": 5.0}]}
        self.assertEqual(demo.coverage_text(darl, now=0),
                         "DARL: 12/100 blocks committed (12 %), ETA 7 min 20 s at 0.2 blocks/s")
        self.assertIn("ETA unknown", demo.coverage_text(dict(darl, clusters=[]), now=0))
        self.assertEqual(demo.coverage_text({}), "DARL: ?")

    def test_loss_trend(self):
        falling = [record(i, 5.0 - 0.3 * i) for i in range(1, 9)]
        first, last, ok = demo.loss_trend(falling)
        self.assertTrue(ok)
        self.assertAlmostEqual(first, 5.0 - 0.3 * 2)
        self.assertLess(last, first)
        rising = [record(i, 2.0 + 0.3 * i) for i in range(1, 9)]
        self.assertFalse(demo.loss_trend(rising)[2])
        self.assertFalse(demo.loss_trend([record(1, 3.0)])[2], "one round proves nothing")
        self.assertFalse(demo.loss_trend([])[2])

    def test_round_table_lists_every_round_and_site(self):
        lines = demo.round_table([record(1, 4.5), record(2, None, clusters=("alpha",))])
        self.assertEqual(len(lines), 3)
        self.assertIn("alpha, beta", lines[1])
        self.assertIn("4.500", lines[1])
        self.assertIn(" - ", lines[2])

    def test_format_checks(self):
        lines = demo.format_checks([("a", True, ""), ("b", False, "why"), ("c", None, "n/a")])
        self.assertTrue(lines[0].strip().startswith("PASS  a"))
        self.assertIn("FAIL  b: why", lines[1])
        self.assertIn("INFO  c", lines[2])


class CommandTest(unittest.TestCase):
    def test_site_command(self):
        svc = harness.Services("http://d", "http://f", "http://b", "/s", "/s/token", {})
        cmd = harness.site_command("beta", svc, "m.json", nproc=2, parallel="ddp", runs_dir="runs/x",
                                train_args=["--model", "qwen3-tiny"], throttle_ms=40)
        self.assertTrue(cmd[0].endswith("torchrun"))
        self.assertEqual(cmd[1:4], ["--standalone", "--nproc-per-node", "2"])
        for flag, value in (("--federation", "http://f"), ("--darl-url", "http://d"), ("--blob-url", "http://b"),
                            ("--token-file", "/s/token"), ("--site", "beta"), ("--parallel", "ddp"),
                            ("--throttle-ms", "40"), ("--run-name", "beta"), ("--model", "qwen3-tiny")):
            self.assertEqual(cmd[cmd.index(flag) + 1], value, flag)
        self.assertNotIn("--resume", cmd)
        again = harness.site_command("beta", svc, "m.json", nproc=1, parallel="ddp", runs_dir="r", resume=True,
                                  replica="b")
        self.assertEqual(again[again.index("--resume") + 1], "auto")
        self.assertEqual(again[again.index("--replica") + 1], "b")
        self.assertEqual(again[again.index("--run-name") + 1], "beta-b")
        self.assertNotIn("--throttle-ms", again)

    def test_config_errors_name_the_flag(self):
        with self.assertRaisesRegex(SystemExit, "--lease-ttl-s"):
            demo.DemoConfig(lease_ttl_s=1).validate()
        with self.assertRaisesRegex(SystemExit, "--kill-site"):
            demo.DemoConfig(kill_site="gamma").validate()

    def test_help(self):
        out = subprocess.run([sys.executable, "demo.py", "--help"], cwd=ROOT, capture_output=True, text=True,
                             timeout=60)
        self.assertEqual(out.returncode, 0, out.stderr)
        for word in ("--kill-site", "--corpus-mb", "runs/demo", "status.html", "How to read the output"):
            self.assertIn(word, out.stdout)


class ProcessTest(unittest.TestCase):
    def test_sigkill_reaches_the_whole_tree(self):
        """Like torchrun: a leader whose children run in sessions of their own (torch's
        elastic agent starts each rank with start_new_session=True), plus one child in
        the leader's own group. One signal_tree(SIGKILL) leaves none of them."""
        d = tmpdir(self)
        script = ("import subprocess, sys, time\n"
                  "kids = [subprocess.Popen(['sleep', '300'], start_new_session=True) for _ in range(2)]\n"
                  "kids.append(subprocess.Popen(['sleep', '300']))\n"
                  "print('kids', *[k.pid for k in kids], flush=True)\n"
                  "time.sleep(300)\n")
        with harness.Launcher() as launcher:
            p = launcher.start("tree", [sys.executable, "-c", script], os.path.join(d, "tree.log"))
            kids = harness.wait_for(lambda: next((list(map(int, l.split()[1:])) for l in p.tail()
                                               if l.startswith("kids")), None), 60)
            self.assertEqual(len(kids), 3)
            self.assertEqual(harness.process_tree(p.pid), {p.pid, *kids})
            p.signal_tree(signal.SIGKILL)
            self.assertTrue(harness.wait_for(p.gone, 30), "part of the tree outlived SIGKILL")
            for k in kids:
                self.assertFalse(harness._alive(k), f"rank-like child {k} survived")
            self.assertEqual(p.poll(), -signal.SIGKILL)

    def test_launcher_stops_everything_on_an_exception(self):
        d = tmpdir(self)
        procs = []
        with self.assertRaises(RuntimeError):
            with harness.Launcher() as launcher:
                for i in range(2):
                    procs.append(launcher.start(f"s{i}", ["sleep", "300"], os.path.join(d, f"s{i}.log")))
                raise RuntimeError("boom")
        for p in procs:
            self.assertTrue(p.gone())
            self.assertEqual(p.poll(), -signal.SIGTERM)


class ServicesTest(unittest.TestCase):
    """The three real servers on free ports: start, a lease committed, the page saved,
    SIGTERM, and the run audit read back from DARL's snapshot and FedMom's state."""

    def test_start_audit_stop(self):
        d = tmpdir(self)
        corpus = os.path.join(d, "corpus")
        os.makedirs(corpus)
        with open(os.path.join(corpus, "a.txt"), "w") as f:
            f.write("def f(x):\n    return x + 1\n" * 400)
        import tokenize_corpus
        m = tokenize_corpus.tokenize(tokenize_corpus.TokenizeConfig(inputs=[corpus], out=os.path.join(d, "data"),
                                                                    seq_len=32, heldout_windows=8, progress=False))
        manifest = os.path.join(d, "data", "manifest.json")
        init = os.path.join(d, "init.safetensors")
        with tensorio.TensorWriter(init, [("w", "F32", (4, 3))]) as w:
            w.write("w", np.arange(12, dtype=np.float32).reshape(4, 3))
        with harness.Launcher() as launcher:
            svc = harness.start_services(launcher, d, manifest, init, block_size=4, default_ports=False)
            self.assertEqual(oct(os.stat(svc.token_file).st_mode & 0o777), "0o600")
            for url in (svc.darl, svc.fedmom, svc.blob):
                self.assertTrue(url.startswith("http://127.0.0.1:"), url)
                httpc.wait_healthy(url, 30)
            for url in (svc.darl, svc.fedmom, svc.blob):       # the token is enforced
                for token in (None, "not-" + svc.token):
                    with self.assertRaises(httpc.CallError) as cm:
                        httpc.call(url, "GET", "/status" if url != svc.blob else "/blobs", token=token)
                    self.assertEqual(cm.exception.status, 401, (url, cm.exception.reply))
            client = darl_client.LeaseClient(svc.darl, token=svc.token)
            self.addCleanup(client.close)
            st = client.status()
            num_blocks = st["num_blocks"]
            self.assertEqual(num_blocks, -(-(m["num_windows"] - 8) // 4))
            client.register("alpha", "inc1", st["digest"])
            lease = client.acquire("alpha", "inc1", blocks=2)["lease"]
            client.commit("alpha", "inc1", lease["id"], lease["end"])
            page = harness.fetch_page(svc.fedmom, os.path.join(d, "status.html"), svc.token)
            self.assertIn("<html", pathlib.Path(page).read_text().lower())
            for p in svc.procs.values():
                self.assertEqual(p.stop(20), 0, p.tail())
        report = audit.audit(os.path.join(d, "central"))      # from the snapshot DARL wrote at SIGTERM
        self.assertFalse(report.ok)
        self.assertEqual([report.status[p] for p in range(num_blocks)], ["missing"] * 2 + ["open"] * (num_blocks - 2),
                         "a site's own commit is in no merged delta; the rest was never trained")


if __name__ == "__main__":
    unittest.main()
