"""status_page.py: ticks, decimation, coverage and alarms as pure functions; the page
served live by a real aggregator (a process) with a real DARL and blob store (processes)
and merged rounds behind it; and that page in a real browser (Debian's headless Chromium,
driven through chromedriver's WebDriver HTTP protocol with urllib) at two widths, with
no console error, plots with axes, and screenshots saved under runs/test-status-page/."""
import base64
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import unittest
import ssl
import urllib.request

import numpy as np

import certs
import fedmom_client
import httpc
import status_page as sp
import tensorio
from testbed.harness import Output, listening_url

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHOTS = os.path.join(ROOT, "runs", "test-status-page")
CHROMEDRIVER, CHROMIUM, W3M = "/usr/bin/chromedriver", "/usr/bin/chromium", "/usr/bin/w3m"
SHAPES = {"w": (16, 8), "b": (8,)}


def text_outside_svg(page):
    """What a text browser shows: the page without its SVG, tags and entities."""
    import html
    bare = re.sub(r"<svg.*?</svg>", " ", page, flags=re.S)
    bare = re.sub(r"<(style|title)>.*?</\1>", " ", bare, flags=re.S)
    return html.unescape(re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", bare)))


def record(rnd, t, tokens, loss, sites, excluded=()):
    return {"v": 2, "round": rnd, "time": t, "tokens": tokens, "loss": loss, "drift_mean": 0.01, "drift_max": 0.02,
            "wall_s": 10.0, "reason": "all members sent", "clusters": sites, "excluded": list(excluded),
            "dropped": [], "late": []}


def waiting_rows(first=1, cum=0):
    """12 rounds of sites with time-budgeted phases (the record fields of quorum rounds): alpha
    sends early and waits for beta in rounds 1-8, alone at the quorum's grace in 9-10 (beta
    left out), and last in 11-12 (then beta waits: 2 of its 10 rounds, a fifth, not more).
    alpha's periods: 18 + 2 (round 1: wall + merge, no period_s), 20 x 7, 18 x 2, 20 x 2.
    Round numbers from `first`, tokens counted on from `cum`."""
    rows = []
    for r in range(1, 13):
        alpha = {"incarnation": "a", "tokens": 1000, "loss": 3.0, "tokens_per_s": 70.0, "inner_s": 14.0, "util": 0.7,
                 "steps": 110.0, "step_s": 0.12, "ended_by": "clock", "cycle_s": 20.0, "wait_s": 6.0}
        beta = {"incarnation": "b", "tokens": 500, "loss": 3.1, "tokens_per_s": 30.0, "inner_s": 16.0}  # no util
        if r <= 8:
            sites, reason, wall = {"alpha": alpha, "beta": beta}, "every live member sent its delta", 18.0
            alpha.update(arrived_s=5.0, waited_s=13.0)
            beta.update(arrived_s=17.0, waited_s=1.0)
        elif r <= 10:
            sites, wall = {"alpha": alpha}, 16.0
            reason = "quorum: 67% of the 1,500 tokens expected arrived; grace 4 s passed without ['beta']"
            alpha.update(arrived_s=10.0, waited_s=6.0)
        else:
            sites, reason, wall = {"alpha": alpha, "beta": beta}, "every live member sent its delta", 18.0
            alpha.update(arrived_s=17.0, waited_s=1.0)
            beta.update(arrived_s=3.0, waited_s=15.0)
        if r == 12:
            alpha.update(util=0.65, steps=120.0, step_s=0.117, ended_by="lease")
        rec = dict(record(first - 1 + r, 1.9e9 + 20 * r, sum(s["tokens"] for s in sites.values()), 3.0, sites), v=3,
                   reason=reason, wall_s=wall, merge_s=2.0, period_s=None if r == 1 else wall + 2.0,
                   late=[] if "beta" in sites else ["beta"])
        rows.append(sp.compact(rec, cum))
        cum = rows[-1]["cum_tokens"]
    return rows


def status(rnd, members=(), events=()):
    return {"round": rnd, "merging": False, "members": list(members), "pending": [], "events": list(events),
            "excluded": [], "dropped": [], "pending_commits": 0, "parameters": 1000, "tensors": 2,
            "config": {"outer_lr": 0.7, "outer_momentum": 0.9}}


DARL = {"num_blocks": 1000, "committed": 400, "leased": 100, "free": 490, "quarantined": 10, "done": False,
        "complete": False, "invariant_error": None,
        "clusters": [{"cluster": "lumi", "live": True, "committed": 300, "lost": 0, "leased": 50, "blocks_per_s": 2.0},
                     {"cluster": "snellius", "live": True, "committed": 100, "lost": 2, "leased": 50,
                      "blocks_per_s": 0.5},
                     {"cluster": "old", "live": False, "committed": 0, "lost": 0, "leased": 0, "blocks_per_s": 9.0}]}


def view(rows, st=None, darl=DARL, saved=False, now=2e9, alarms=()):
    return {"status": st or status(len(rows)), "alarms": list(alarms), "rows": rows, "now": now, "saved": saved,
            "darl": darl,
            "darl_error": None, "blob": {"used_bytes": 3 << 30, "quota_bytes": 64 << 30, "blobs": 2, "uploads": 0},
            "blob_error": None, "disk": {"state_bytes": 5 << 20, "state_free_bytes": 100 << 30}}


class PureTest(unittest.TestCase):
    def test_ticks_are_round_numbers_that_cover_the_range(self):
        for lo, hi in ((0, 1), (3.7, 9.2), (1e6, 3.3e7), (-5, 5), (2.0, 2.0), (0.0012, 0.0049)):
            t = sp.nice_ticks(lo, hi)
            self.assertLessEqual(t[0], lo)
            self.assertGreaterEqual(t[-1], hi)
            self.assertTrue(3 <= len(t) <= 9, (lo, hi, t))
            steps = {round(b - a, 12) for a, b in zip(t, t[1:])}
            self.assertEqual(len({round(s / min(steps), 6) for s in steps}), 1, t)   # evenly spaced
            mant = min(steps) / 10 ** math.floor(math.log10(min(steps)))
            self.assertIn(round(mant, 6), (1, 2, 2.5, 5), t)
        t = sp.time_ticks(1000, 1000 + 3 * 3600)
        self.assertEqual(t[1] - t[0], 3600)
        self.assertEqual(t[0] % 3600, 0)
        for lo, hi in ((100.2, 100.9), (100.0, 100.0), (59.5, 61.2), (1000.3, 1004.1)):   # a run of seconds
            t = sp.time_ticks(lo, hi)
            self.assertTrue(len(t) >= 2 and t[0] <= lo and t[-1] >= hi, (lo, hi, t))
        # the membership lanes of a run a second long still get two time ticks
        events = [{"t": 100.2, "event": "join", "cluster": "a", "incarnation": "i", "why": "", "round": 0}]
        svg = sp.membership_plot(events, [{"sites": ["a"], "time": 100.6}], now=100.9)
        self.assertGreaterEqual(svg.split('<g class="axis x">')[1].split("</g>")[0].count('class="tick"'), 2, svg)

    def test_decimation_bounds_the_points_and_keeps_a_spike(self):
        pts = [(i, 1.0 + 0.001 * i) for i in range(100000)]
        pts[77777] = (77777, 50.0)
        out = sp.decimate(pts, 250)
        self.assertLessEqual(len(out), 500)
        self.assertIn((77777, 50.0), out)
        self.assertEqual(out[0], pts[0])
        self.assertEqual([p[0] for p in out], sorted(p[0] for p in out))
        self.assertEqual(sp.decimate(pts[:10], 250), pts[:10])

    def test_coverage_eta_is_the_blocks_left_at_the_live_sites_measured_rate(self):
        cov = sp.coverage(DARL, now=1000.0)
        self.assertEqual(cov["pct"], 40.0)
        self.assertEqual(cov["rate"], 2.5)                       # the dead cluster's rate does not count
        self.assertEqual(cov["eta_s"], 600 / 2.5)
        self.assertEqual(cov["eta_at"], 1240.0)
        idle = dict(DARL, clusters=[dict(c, live=False) for c in DARL["clusters"]])
        self.assertIsNone(sp.coverage(idle, 0)["eta_s"])
        self.assertIsNone(sp.coverage(None, 0))

    def test_the_page_has_every_section_and_a_text_browser_reads_the_numbers(self):
        rows, cum = [], 0
        for r in range(1, 301):                                 # more than the aggregator keeps in memory
            sites = {"lumi": {"incarnation": "a", "tokens": 4096, "loss": 8 - r / 100, "tokens_per_s": 900.0,
                              "mfu": 0.41, "peak_mem_gib": 30.5, "inner_s": 8.0},
                     "snellius": {"incarnation": "b", "tokens": 2048, "loss": 8.2 - r / 100, "tokens_per_s": 500.0,
                                  "peak_mem_gib": 12.0, "inner_s": 5.0}}
            if r % 50 == 0:
                sites["lumi"].update(heldout_loss=8.5 - r / 100, heldout_round=r - 1)
            rows.append(sp.compact(record(r, 1.9e9 + 10 * r, 6144, 8 - r / 100, sites), cum))
            cum = rows[-1]["cum_tokens"]
        st = status(300, members=[{"cluster": "lumi", "incarnation": "a", "heard_s_ago": 1.5, "sent": False}],
                    events=[{"t": 1.9e9, "event": "join", "cluster": "lumi"},
                            {"t": 1.9e9 + 5, "event": "join", "cluster": "snellius"},
                            {"t": 1.9e9 + 2000, "event": "drop", "cluster": "snellius"}])
        page = sp.render(view(rows, st))
        self.assertEqual(page.count('<svg class="plot"'), 4)
        self.assertEqual(page.count('<g class="axis x">'), 4)
        self.assertIn('http-equiv="refresh"', page)
        self.assertIn("rounds.jsonl", page)                       # 300 rounds: the table says where the rest are
        self.assertIn(">300<", page)                              # the x axis of the drift plot reaches round 300
        text = text_outside_svg(page)
        for want in ("40.0 % of 1,000 blocks committed", "ETA 4 min 00 s", "2.5 blocks/s", "committed 400",
                     "quarantined 10", "10 block(s) QUARANTINED", "2 block(s) LOST", "lumi", "snellius",
                     "41.0%", "30.50 GiB",
                     # utilisation: 8 s and 5 s of 10 s rounds; records without the phase's fields: "-"
                     "lumi 80% 80% (300 rounds) - - - -", "snellius 50% 50% (300 rounds) - - - -",
                     "1.84M tokens merged", "first 8.0000 (lumi, theta of round 49), last 5.5000 (lumi, theta of round 299)",
                     "3.00 GiB", "quota 64.00 GiB", "5.00 MiB", "Live page, rendered 2033-05-18 03:33:20 UTC"):
            self.assertIn(want, text)
        self.assertIn("n/a (CPU)", text)                          # snellius sent no MFU
        self.assertNotIn('class="warn"', page)                    # no waited_s recorded: no round counts

    def test_a_site_that_waits_in_most_rounds_is_a_line_naming_what_it_waited_on(self):
        rows = waiting_rows()
        page = sp.render(view(rows, darl=dict(DARL, quarantined=0, clusters=[])))
        warns = re.findall(r'<p class="warn">(.*?)</p>', page)
        # 10 waits: 8 x 13 s on beta's delta, 2 x 6 s on the grace; beta waited in 2 of 10 rounds: no line
        self.assertEqual(warns, ["alpha waited in 10 of 12 rounds (83%), 11.6 s on average, "
                                 "mostly on beta&#x27;s delta"])
        self.assertIn("no delta excluded", page)                  # a wait loses no work: the quiet line stays
        self.assertNotIn('class="alarm"', page)
        text = text_outside_svg(page)
        # last round: alpha's own util; beta reports none: 16 s / 20 s. Whole run: alpha 168 s / 236 s,
        # beta 160 s / 200 s. alpha's last phase, step time and wait; beta's wait of round 12
        self.assertIn("alpha 65% 71% (12 rounds) 120 (lease) 0.117 s 1.0 s 10 of 12", text)
        self.assertIn("beta 80% 80% (10 rounds) - - 15.0 s 2 of 10", text)
        self.assertIn("Utilisation, last round: the share of its cycle before", text)   # the figures defined
        self.assertIn('title="inner training time summed / round periods summed', page)

    def test_what_a_round_kept_a_site_waiting_for(self):
        both = {"alpha": {"arrived_s": 2.0}, "beta": {"arrived_s": 9.0}}
        self.assertEqual(sp.waited_on({"reason": "every live member sent its delta", "sites": both}, "alpha"),
                         "beta's delta")
        self.assertEqual(sp.waited_on({"reason": "deadline of 1800 s passed without ['beta']",
                                       "sites": {"alpha": {"arrived_s": 2.0}}}, "alpha"), "the deadline")
        self.assertEqual(sp.waited_on({"reason": "quorum: 90% of ...; grace 3 s passed without ['gamma']",
                                       "sites": both}, "alpha"), "the quorum grace")
        self.assertIn("the aggregator after its own delta",
                      sp.waited_on({"reason": "every live member sent its delta", "sites": both}, "beta"))
        # a round counts as a wait over a tenth of its period: period_s, else wall_s + merge_s
        row = {"period_s": None, "wall_s": 18.0, "merge_s": 2.0, "reason": "", "sites": {"alpha": {"waited_s": 2.0}}}
        self.assertEqual(sp.site_waits([row], "alpha"), {"rounds": 1, "waits": []})
        row = dict(row, period_s=19.0)                      # alpha alone: no other delta kept it waiting
        self.assertEqual(sp.site_waits([row], "alpha"),
                         {"rounds": 1, "waits": [(2.0, "the aggregator after its own delta (custody at DARL, a merge "
                                                       "retried)")]})

    def test_old_records_render_beside_new_ones(self):
        old = [sp.compact(record(r, 1.8e9 + r, 100, 4.0, {"alpha": {"tokens": 100, "inner_s": 5.0}}), 100 * (r - 1))
               for r in (1, 2)]
        rows = old + waiting_rows(first=3, cum=200)
        text = text_outside_svg(sp.render(view(rows)))
        # the old rounds add 5 s of 10 s each to the run's utilisation (178 s / 256 s) and no round to the waits
        self.assertIn("alpha 65% 70% (14 rounds) 120 (lease) 0.117 s 1.0 s 10 of 12", text)
        self.assertIn("alpha waited in 10 of 12 rounds (83%)", text)
        only_old = text_outside_svg(sp.render(view(old)))
        self.assertIn("alpha 50% 50% (2 rounds) - - - -", only_old)

    def test_a_saved_copy_says_when_and_does_not_refresh(self):
        page = sp.render(view([], saved=True, now=1.7e9))
        self.assertNotIn("refresh", page.split("</head>")[0])
        self.assertIn("Saved copy, captured 2023-11-14 22:13:20 UTC; it does not refresh.", page)
        self.assertIn("no data yet", page)

    def test_excluded_deltas_violations_and_refused_commits_are_loud(self):
        import fedmom_server
        rows = [sp.compact(record(1, 1e9, 10, 2.0, {}, excluded=[{"cluster": "lumi", "why": "NaN in w"}]), 0)]
        st = dict(status(1), violations={"refused_commits": 1, "aborted_custody": 0, "blocks_trained_twice": 0})
        darl = dict(DARL, quarantined=0, clusters=[], violations={"refused_commits": 0, "blocks_trained_twice": 3})
        page = sp.render(view(rows, st, darl=darl, alarms=fedmom_server.alarm_lines(st)))
        alarms = re.findall(r'<p class="alarm">(.*?)</p>', page)
        self.assertEqual(len(alarms), 3, alarms)
        self.assertIn("EXACTLY-ONCE VIOLATED: refused_commits 1", alarms[0])     # the aggregator's counters first
        self.assertIn("DARL: !!! EXACTLY-ONCE VIOLATED", alarms[1])
        self.assertIn("blocks_trained_twice 3", alarms[1])
        self.assertIn("1 delta(s) EXCLUDED", alarms[2])
        self.assertIn("round 1: lumi: NaN in w", alarms[2])
        quiet = sp.render(view([], darl=dict(DARL, quarantined=0, clusters=[])))
        self.assertNotIn('class="alarm"', quiet)
        self.assertIn("no delta excluded, no DARL commit refused", quiet)
        down = dict(view([]), darl=None, darl_error="unreachable (ConnectionRefusedError: refused)")
        self.assertIn("DARL status unavailable: unreachable", sp.render(down))

    def test_the_rounds_log_is_read_incrementally_and_a_torn_line_waits(self):
        d = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, d)
        path = os.path.join(d, "rounds.jsonl")
        tail = sp.RoundsTail(path)
        self.assertEqual(tail.read(), [])
        with open(path, "w") as f:
            f.write(json.dumps(record(1, 1.0, 100, 3.0, {})) + "\n" + json.dumps(record(2, 2.0, 50, 2.0, {}))[:30])
        self.assertEqual([(r["round"], r["cum_tokens"]) for r in tail.read()], [(1, 100)])
        with open(path, "w") as f:                                  # the torn line completed (rewritten whole)
            f.write(json.dumps(record(1, 1.0, 100, 3.0, {})) + "\n" + json.dumps(record(2, 2.0, 50, 2.0, {})) + "\n")
        self.assertEqual([(r["round"], r["cum_tokens"]) for r in tail.read()], [(1, 100), (2, 150)])
        with open(path, "w") as f:                                  # replaced by a shorter file: read again
            f.write(json.dumps(record(1, 1.0, 7, 3.0, {})) + "\n")
        self.assertEqual([(r["round"], r["cum_tokens"]) for r in tail.read()], [(1, 7)])


# ---------------------------------------------------------------- a live run behind the page

def write_tensors(path, arrays):
    with tensorio.TensorWriter(path, [(k, "F32", a.shape) for k, a in arrays.items()], fsync=False) as w:
        for k, a in arrays.items():
            w.write(k, a)


class LiveRun:
    """darl_server.py, blobstore.py and fedmom_server.py as processes on 127.0.0.1 with a
    token, and four merged rounds from two sites (one NaN delta refused and excluded)."""

    def __init__(self, case, d):
        self.dir, self.procs, self.rng = d, [], np.random.default_rng(0)
        self.token = "page-t0ken"
        tf = os.path.join(d, "token")
        with open(tf, "w") as f:
            f.write(self.token + "\n")
        init = os.path.join(d, "init.safetensors")
        write_tensors(init, {k: self.rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()})
        net = ["--port", "0", "--token-file", tf]
        self.darl = self.start(case, "darl_server.py", "--num-samples", "400", "--block-size", "4",
                               "--state-dir", os.path.join(d, "darl"), *net)
        self.blob = self.start(case, "blobstore.py", "--root", os.path.join(d, "blobs"), *net)
        self.fedmom = self.start(case, "fedmom_server.py", "--state-dir", os.path.join(d, "fedmom"), "--init", init,
                                 "--darl", self.darl, "--blob-url", self.blob, "--round-deadline-s", "600", *net)
        self.rounds()

    def start(self, case, script, *args):
        p = subprocess.Popen([sys.executable, script, *args], cwd=ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
        self.procs.append(p)
        case.addClassCleanup(lambda: p.poll() is None and (p.kill(), p.wait(30)))
        return listening_url(p, timeout=120)[0]

    def lease(self, cluster, inc, blocks):
        call = lambda path, body: httpc.call(self.darl, "POST", path, body, token=self.token)
        digest = httpc.call(self.darl, "GET", "/status", token=self.token)["digest"]
        call("/register", {"cluster": cluster, "incarnation": inc, "digest": digest})
        return call("/acquire", {"cluster": cluster, "incarnation": inc, "blocks": blocks})["lease"]

    def delta(self, nan=False):
        path = os.path.join(self.dir, f"delta-{self.rng.integers(1 << 40)}.safetensors")
        arrays = {k: (0.01 * self.rng.standard_normal(s)).astype(np.float32) for k, s in SHAPES.items()}
        if nan:
            arrays["w"][0, 0] = np.nan
        write_tensors(path, arrays)
        return path

    def rounds(self):
        sites = {"lumi": fedmom_client.FedMomClient(self.fedmom, "lumi", "inc-l", token=self.token, blob_url=self.blob),
                 "snellius": fedmom_client.FedMomClient(self.fedmom, "snellius", "inc-s", token=self.token,
                                                        blob_url=self.blob)}
        for c in sites.values():
            c.join()
        for rnd in range(4):
            for i, (name, c) in enumerate(sites.items()):
                tokens = (2 - i) * 4 * 64
                metrics = {"loss": 6.0 - 0.5 * rnd - 0.2 * i, "tokens_per_s": 1000.0 / (i + 1),
                           "peak_mem_gib": 1.5 + i, "inner_s": 4.0 + i, "util": 0.8 - 0.1 * i, "steps": 10.0 + i,
                           "step_s": 0.4 + 0.1 * i, "ended_by": "clock" if i else "lease"}
                if rnd == 2 and i == 0:
                    metrics.update(heldout_loss=5.5, heldout_round=1)
                if rnd == 1 and i == 1:                       # a NaN delta: refused, and excluded in the record
                    try:
                        c.send_delta(self.delta(nan=True), rnd, tokens, [self.lease(name, c.incarnation, 1)], {})
                        raise AssertionError("a NaN delta was accepted")
                    except httpc.CallError as e:
                        assert e.reply.get("code") == "bad_delta", e.reply
                c.send_delta(self.delta(), rnd, tokens, [self.lease(name, c.incarnation, 2 - i)], metrics,
                             transport="inline" if i else "blob")
            for c in sites.values():
                assert c.wait_round_after(rnd, timeout_s=120) == rnd + 1
        deadline = time.monotonic() + 120                     # the aggregator commits in DARL after each merge
        while httpc.call(self.fedmom, "GET", "/status", token=self.token)["pending_commits"]:
            assert time.monotonic() < deadline, "DARL commits still owed after 120 s"
            time.sleep(0.05)


def get(url):
    with urllib.request.urlopen(url, timeout=60) as r:
        return r.read().decode(), r.headers.get("Content-Type")


class LivePageTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.mkdtemp(prefix="status-page-")
        cls.addClassCleanup(shutil.rmtree, cls.dir, True)
        cls.run_ = LiveRun(cls, cls.dir)

    def test_the_served_page_shows_darl_rounds_sites_and_disk(self):
        page, ctype = get(self.run_.fedmom + "/")                 # public: no token
        self.assertEqual(ctype, "text/html; charset=utf-8")
        text = text_outside_svg(page)
        for want in ("12.0 % of 100 blocks committed",           # 4 rounds x (2 + 1) blocks of 100
                     "round 4", "4 merged round(s)", "lumi", "snellius", "blob store", "aggregator state",
                     "1 delta(s) EXCLUDED", "first 5.5000 (lumi, theta of round 1)"):
            self.assertIn(want, text)
        self.assertEqual(page.count('<svg class="plot"'), 4)
        self.assertNotIn(self.run_.token, page)
        self.assertNotIn(self.dir, page)                          # no file path on a public page
        saved, _ = get(self.run_.fedmom + "/?saved=1")
        self.assertIn("Saved copy, captured", saved)
        self.assertNotIn("refresh", saved.split("</head>")[0])

    @unittest.skipUnless(os.access(W3M, os.X_OK), "no w3m (make test installs it: apt-get install -y w3m)")
    def test_a_text_browser_reads_the_page(self):
        p = subprocess.run([W3M, "-dump", "-cols", "100", self.run_.fedmom + "/"], capture_output=True, text=True,
                           timeout=120)
        self.assertEqual(p.returncode, 0, p.stderr)
        lines = [" ".join(l.split()) for l in p.stdout.splitlines()]
        for want in ("pww central VM: round 4", "12.0 % of 100 blocks committed", "committed 12 12.0 %",
                     "Loss against tokens train loss (token-weighted)", "wall time (UTC)", "loss (nats)"):
            self.assertTrue(any(want in l for l in lines), f"w3m shows no line with {want!r}:\n{p.stdout}")
        self.assertTrue(any(l.startswith("lumi ") and "2.05k" in l for l in lines), p.stdout)   # a row per site
        self.assertTrue(any(l.startswith("snellius ") and "1.02k" in l for l in lines), p.stdout)
        # the compute table: each site's own util of its last cycle, its last phase's steps and what ended it
        self.assertTrue(any(l.startswith("lumi 80% ") and "10 (lease) 0.4 s" in l for l in lines), p.stdout)
        self.assertTrue(any(l.startswith("snellius 70% ") and "11 (clock) 0.5 s" in l for l in lines), p.stdout)

    def test_rounds_jsonl_exports_to_csv_and_tensorboard(self):
        import csv
        rounds = os.path.join(self.dir, "fedmom", "rounds.jsonl")
        out, tb = os.path.join(self.dir, "rounds.csv"), os.path.join(self.dir, "tb")
        p = subprocess.run([sys.executable, "rounds_export.py", rounds, "--csv", out, "--tensorboard", tb], cwd=ROOT,
                           capture_output=True, text=True, timeout=300)
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertIn("4 rounds (1..4), 3,072 tokens", p.stdout)
        with open(out) as f:
            rows = list(csv.DictReader(f))
        with open(rounds) as f:
            recs = [json.loads(line) for line in f]
        self.assertEqual([int(r["round"]) for r in rows], [1, 2, 3, 4])
        self.assertEqual([int(r["tokens_total"]) for r in rows], list(np.cumsum([r["tokens"] for r in recs])))
        self.assertEqual([float(r["loss"]) for r in rows], [r["loss"] for r in recs])
        self.assertEqual([r["excluded"] for r in rows], ["0", "1", "0", "0"])     # the NaN delta of round 2
        self.assertEqual(rows[2]["lumi_heldout_loss"], "5.5")
        self.assertEqual(rows[0]["snellius_tokens_per_s"], "500.0")
        self.assertEqual({r["lumi_incarnation"] for r in rows}, {"inc-l"})
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
        acc = EventAccumulator(tb)
        acc.Reload()
        by_tokens = acc.Scalars("rounds/loss_by_tokens")
        self.assertEqual([e.step for e in by_tokens], [int(r["tokens_total"]) for r in rows])
        self.assertAlmostEqual(by_tokens[-1].value, recs[-1]["loss"], places=5)
        self.assertEqual(len(acc.Scalars("sites/lumi/tokens_per_s")), 4)
        empty = os.path.join(self.dir, "none.jsonl")
        p = subprocess.run([sys.executable, "rounds_export.py", empty, "--csv", out], cwd=ROOT, capture_output=True,
                           text=True, timeout=60)
        self.assertEqual((p.returncode, len(p.stderr.strip().splitlines())), (1, 1), p.stderr)
        self.assertIn("no round records", p.stderr)


# ---------------------------------------------------------------- a real browser

class TLSPageTest(unittest.TestCase):
    """As central.sh runs it: every server on https, FedMom given --ca-file. The page reads
    DARL and the blob store through the same CA; a CA that does not sign them is a line on
    the page, not a 500."""

    @classmethod
    def setUpClass(cls):
        d = cls.dir = tempfile.mkdtemp(prefix="status-page-tls-")
        cls.addClassCleanup(shutil.rmtree, d, True)
        os.makedirs(os.path.join(d, "other"))
        cls.ca, cert, key = certs.make_tls(d)
        cls.other_ca = certs.make_tls(os.path.join(d, "other"))[0]
        tf = os.path.join(d, "token")
        with open(tf, "w") as f:
            f.write("page-t0ken\n")
        init = os.path.join(d, "init.safetensors")
        write_tensors(init, {k: np.zeros(s, np.float32) for k, s in SHAPES.items()})
        net = ["--port", "0", "--token-file", tf, "--tls-cert", cert, "--tls-key", key]
        cls.darl = cls.start("darl_server.py", "--num-samples", "400", "--block-size", "4",
                             "--state-dir", os.path.join(d, "darl"), *net)
        cls.blob = cls.start("blobstore.py", "--root", os.path.join(d, "blobs"), *net)
        cls.fedmom = cls.start("fedmom_server.py", "--state-dir", os.path.join(d, "fedmom"), "--init", init,
                               "--darl", cls.darl, "--blob-url", cls.blob, "--ca-file", cls.ca, *net)

    @classmethod
    def start(cls, script, *args):
        p = subprocess.Popen([sys.executable, script, *args], cwd=ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
        cls.addClassCleanup(lambda: p.poll() is None and (p.kill(), p.wait(30)))
        url = listening_url(p, timeout=120)[0]
        assert url.startswith("https://"), url
        return url

    def test_the_page_reads_darl_and_the_blob_store_over_https(self):
        ctx = ssl.create_default_context(cafile=self.ca)
        with urllib.request.urlopen(self.fedmom + "/", timeout=60, context=ctx) as r:
            self.assertEqual(r.status, 200)
            text = text_outside_svg(r.read().decode())
        self.assertIn("0.0 % of 100 blocks committed", text)
        self.assertNotIn("not trusted", text)
        self.assertNotIn("unreachable", text)

    def test_a_ca_that_does_not_sign_them_is_a_line_on_the_page(self):
        page = sp.Page(os.path.join(self.dir, "fedmom", "rounds.jsonl"), os.path.join(self.dir, "fedmom"),
                       self.darl, self.blob, "page-t0ken", ca_file=self.other_ca)
        view = page.view({})
        self.assertIsNone(view["darl"])
        self.assertIn("not trusted", view["darl_error"])
        self.assertIn("not trusted", view["blob_error"])


class WebDriver:
    """The few W3C WebDriver commands the test needs, over chromedriver's HTTP API (stdlib)."""

    def __init__(self, case, log_path):
        self.log = open(log_path, "w")
        case.addClassCleanup(self.log.close)
        self.proc = subprocess.Popen([CHROMEDRIVER, "--port=0"], stdout=subprocess.PIPE, stderr=self.log, text=True)
        case.addClassCleanup(lambda: self.proc.poll() is None and (self.proc.kill(), self.proc.wait(30)))
        port = Output(self.proc).wait_for(r"started successfully on port (\d+)", 60).group(1)
        self.url = f"http://127.0.0.1:{port}"
        caps = {"capabilities": {"alwaysMatch": {
            "browserName": "chrome", "goog:loggingPrefs": {"browser": "ALL"},
            "goog:chromeOptions": {"binary": CHROMIUM, "args": [
                "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--hide-scrollbars", "--no-first-run", "--disable-extensions"]}}}}
        self.session = self.cmd("POST", "/session", caps)["sessionId"]
        case.addClassCleanup(self.quit)

    def cmd(self, method, path, body=None):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                return json.loads(r.read())["value"]
        except urllib.error.HTTPError as e:
            raise AssertionError(f"WebDriver {method} {path}: {e.code} {e.read()[:500]!r}") from None

    def s(self, method, path, body=None):
        return self.cmd(method, f"/session/{self.session}{path}", body)

    def js(self, script, *args):
        return self.s("POST", "/execute/sync", {"script": script, "args": list(args)})

    def quit(self):
        try:
            self.s("DELETE", "")
        except (AssertionError, OSError):
            pass


@unittest.skipUnless(os.access(CHROMEDRIVER, os.X_OK) and os.access(CHROMIUM, os.X_OK),
                     "no Debian chromium + chromium-driver (make test installs them: apt-get install -y chromium "
                     "chromium-driver)")
class BrowserTest(unittest.TestCase):
    WIDTHS = (1400, 480)

    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.mkdtemp(prefix="status-browser-")
        cls.addClassCleanup(shutil.rmtree, cls.dir, True)
        cls.run_ = LiveRun(cls, cls.dir)
        os.makedirs(SHOTS, exist_ok=True)
        cls.wd = WebDriver(cls, os.path.join(SHOTS, "chromedriver.log"))

    def render(self, width, url=None, title="pww round 4", name="status"):
        wd = self.wd
        wd.s("POST", "/window/rect", {"width": width, "height": 900})
        wd.s("POST", "/url", {"url": url or self.run_.fedmom + "/"})
        self.assertTrue(wd.s("GET", "/title").startswith(title))
        inner = wd.js("return window.innerWidth")
        height = wd.js("return document.documentElement.scrollHeight")
        wd.s("POST", "/window/rect", {"width": width, "height": min(height + 200, 8000)})  # the whole page
        shot = os.path.join(SHOTS, f"{name}-{width}px.png")
        with open(shot, "wb") as f:
            f.write(base64.b64decode(wd.s("GET", "/screenshot")))
        facts = wd.js("""
            const plots = [...document.querySelectorAll('svg.plot')];
            const box = e => { const r = e.getBoundingClientRect(); return {left: r.left, right: r.right}; };
            return {inner: window.innerWidth, scrollW: document.documentElement.scrollWidth,
                    warns: [...document.querySelectorAll('p.warn')].map(box),
                    notes: [...document.querySelectorAll('p.note')].map(box),
                    plots: plots.map(p => ({w: p.getBoundingClientRect().width, h: p.getBoundingClientRect().height,
                        x: p.querySelectorAll('g.axis.x line.tick').length,
                        y: p.querySelectorAll('g.axis.y line.tick, g.axis.y text.tick-label').length,
                        labels: [...p.querySelectorAll('.axis-label')].map(t => t.textContent),
                        data: p.querySelectorAll('polyline.series, g.series circle, rect[fill="#7bc28f"]').length,
                        legend: p.querySelector('g.legend') ? p.querySelector('g.legend').getBBox().y +
                            p.querySelector('g.legend').getBBox().height : null,
                        top: p.querySelector('rect[stroke="#999"]').getBBox().y}))};""")
        logs = wd.s("POST", "/se/log", {"type": "browser"})
        return inner, facts, logs, shot

    def test_the_page_renders_at_two_widths_with_plots_axes_and_no_console_error(self):
        widths = {}
        for width in self.WIDTHS:
            with self.subTest(width=width):
                inner, facts, logs, shot = self.render(width)
                errors = [e for e in logs if e.get("level") in ("SEVERE", "ERROR")]
                self.assertEqual(errors, [], f"console errors at {width} px")
                self.assertEqual(len(facts["plots"]), 4, facts)
                for p in facts["plots"]:
                    self.assertGreaterEqual(p["x"], 2, p)             # ticks on both axes
                    self.assertGreaterEqual(p["y"], 2, p)
                    self.assertTrue(p["labels"] and all(p["labels"]), p)
                    self.assertGreater(p["data"], 0, p)               # something is drawn
                    if p["legend"] is not None:
                        self.assertLessEqual(p["legend"], p["top"], p)   # the legend sits above the plot area
                self.assertLessEqual(facts["scrollW"], facts["inner"] + 1, "the page scrolls sideways")
                self.assertGreater(os.path.getsize(shot), 10000)
                widths[width] = max(p["w"] for p in facts["plots"])
        wide, narrow = (widths[w] for w in self.WIDTHS)
        self.assertGreater(wide, narrow)                                # the plots follow the window
        self.assertLessEqual(narrow, self.WIDTHS[1])

    def test_a_waiting_site_s_line_and_the_utilisation_note_wrap_at_both_widths(self):
        path = os.path.join(self.dir, "waiting.html")
        with open(path, "w") as f:
            f.write(sp.render(view(waiting_rows(), saved=True, now=1.9e9 + 300)))   # a page just after round 12
        for width in self.WIDTHS:
            with self.subTest(width=width):
                inner, facts, logs, _ = self.render(width, "file://" + path, "pww round 12", "waiting")
                self.assertEqual([e for e in logs if e.get("level") in ("SEVERE", "ERROR")], [])
                self.assertEqual(len(facts["warns"]), 1, facts)
                self.assertEqual(len(facts["notes"]), 1, facts)
                for box in facts["warns"] + facts["notes"]:
                    self.assertGreaterEqual(box["left"], 0, facts)
                    self.assertLessEqual(box["right"], facts["inner"] + 1, facts)
                self.assertLessEqual(facts["scrollW"], facts["inner"] + 1, "the page scrolls sideways")


if __name__ == "__main__":
    unittest.main()
