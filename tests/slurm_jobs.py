"""tests/slurm_jobs.py - every site's jobs, for real, under a single-node Slurm on this machine.

Outside the test_*.py pattern (it needs root, apt and several minutes): `make test` adds it
to its run when root, as CI runs (tests/run.py --with slurm_jobs), and leaves it out
otherwise. On its own:
    make test-slurm            # = .venv/bin/python tests/run.py slurm_jobs
It installs and starts a local Slurm with tests/local_slurm.sh start: 8 fake GPUs (GRES),
64 advertised CPUs (so the LUMI 8 x 7 and Snellius 4 x 16 headers fit) and the partitions
both sites use. Then, with
PWW_SITE=local (the CPU device, gloo, a few steps), it submits the unmodified
jobs/{lumi,snellius}_{smoke,cifar_debug,titan}.sh with their own #SBATCH headers (and
snellius_cifar_1node, snellius_cifar_diloco, lumi_cifar_multinode on one node), and checks
each ends COMPLETED with exit 0 and that its log shows the run succeeding: one
task_wrapper line per rank with a distinct GPU, then the entry point's success line.
The titan jobs need the central services: central.sh starts them on free ports with a
corpus made by prep/tokenize.sh, and both sites' jobs run against them, set up as RUNBOOK.md
section 5 has a user do it: `central.sh url > central.env`, the token and the CA copied
where those lines say, under a $HOME of the test's own that the jobs get as theirs.
A job that fails cancels its partner, so a failure is reported at once. The node's 64
CPUs hold one titan job at a time: the second starts once the first has ended and may
find the corpus covered (0 steps); checked are both jobs' success, both sites'
membership and at least one merged round, not that each site trained.
Then sites/siteinfo.sh and sites/bootstrap.sh in job steps (srun): siteinfo sees the
partitions and the GPU list Slurm hands the step, and marks a wrong site file; bootstrap's
--dry-run writes nothing, its first run sets up a temp checkout, its second changes nothing.
Skips when not root, or without apt-get where Slurm is not installed (TESTING.md's
"Expected skips" lists neither, so under `make test` as root the second fails the run).
Slurm is left running afterwards (`tests/local_slurm.sh stop` stops it).
"""
import json
import os
import pathlib
import re
import shutil
import subprocess
import tempfile
import time
import unittest

import fixtures as site_tools     # the site tools helpers (clean_env, rows, tree, ...)
from testbed.harness import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYTHON = os.path.join(ROOT, ".venv", "bin", "python")
RANKS = {"lumi": 8, "snellius": 4}
PARTITIONS = "debug dev-g small-g standard-g gpu_h100 gpu_a100"
JOB_DEADLINE_S = 1200      # generous: 8 CPU ranks on 2 cores are slow, not stuck (the titan
                           # test: ~9 min on a loaded 2-core machine, its two jobs one after the other)
WATCHDOG_S = JOB_DEADLINE_S + 300   # tests/run.py's budget for these tests: the job deadline decides
STATE = {}


def setUpModule():
    if os.geteuid() != 0:
        raise unittest.SkipTest("needs root: installs and starts a local Slurm")
    if shutil.which("sbatch") is None and shutil.which("apt-get") is None:
        raise unittest.SkipTest("needs apt-get (Debian/Ubuntu) to install Slurm")
    env = dict(os.environ, LOCAL_SLURM_GPUS="8", LOCAL_SLURM_CPUS="64", LOCAL_SLURM_PARTITIONS=PARTITIONS)
    r = subprocess.run(["bash", os.path.join(ROOT, "tests", "local_slurm.sh"), "start"], env=env,
                       capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        raise RuntimeError(f"tests/local_slurm.sh start failed:\n{r.stdout}\n{r.stderr}")
    tmp = tempfile.mkdtemp(prefix="pww-slurm-")
    STATE["tmp"] = tmp
    os.makedirs(os.path.join(ROOT, "logs"), exist_ok=True)
    subprocess.run([PYTHON, "data.py", "fake-cifar", os.path.join(tmp, "fake-cifar"),
                    "--train", "256", "--test", "64"], cwd=ROOT, check=True, capture_output=True)


def tearDownModule():
    if "tmp" in STATE:
        shutil.rmtree(STATE["tmp"], ignore_errors=True)


def job_env(**extra):
    env = dict(os.environ, PWW_SITE="local", PWW_RUNS=os.path.join(STATE["tmp"], "runs"),
               DATA=os.path.join(STATE["tmp"], "fake-cifar"))
    env.update(extra)
    return env


def submit(script, env, args=(), sbatch_opts=()):
    r = subprocess.run(["sbatch", "--parsable", *sbatch_opts, script, *args], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        raise AssertionError(f"sbatch {script} refused: {r.stderr.strip()}")
    return r.stdout.strip().split(";")[0]


def wait(*job_ids):
    """Poll until every job has ended, or until one ends other than COMPLETED with exit 0:
    the rest are cancelled then, so a failure is reported at once, not after its partner's
    timeout. Returns {job_id: (state, exit code)} for the jobs that ended by themselves.
    Any exception here (the runner's watchdog included) cancels the jobs still running."""
    deadline = time.monotonic() + JOB_DEADLINE_S
    ended = {}
    try:
        while True:
            for job_id in job_ids:
                if job_id in ended:
                    continue
                out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True,
                                     text=True).stdout
                state = re.search(r"JobState=(\S+)", out)
                state = state.group(1) if state else "UNKNOWN"
                if state not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "UNKNOWN"):
                    code = re.search(r"ExitCode=(\d+):(\d+)", out)
                    ended[job_id] = state, (int(code.group(1)), int(code.group(2))) if code else None
                    if ended[job_id] != ("COMPLETED", (0, 0)):
                        return ended
            if len(ended) == len(job_ids):
                return ended
            if time.monotonic() > deadline:
                raise AssertionError(f"jobs {sorted(set(job_ids) - set(ended))} still running after "
                                     f"{JOB_DEADLINE_S} s; cancelled")
            time.sleep(0.5)
    finally:
        left = [j for j in job_ids if j not in ended]
        if left:
            subprocess.run(["scancel", *left])


class JobTest(unittest.TestCase):
    def run_job(self, site, job, env, args=(), sbatch_opts=()):
        job_id = submit(f"jobs/{site}_{job}.sh", env, args, sbatch_opts)
        state, code = wait(job_id)[job_id]
        log_path = os.path.join(ROOT, "logs", f"{site}_{job}-{job_id}.out")
        log = pathlib.Path(log_path).read_text() if os.path.exists(log_path) else "(no log)"
        self.assertEqual((state, code), ("COMPLETED", (0, 0)), f"{log_path}:\n{log[-4000:]}")
        return log

    def check_ranks(self, log, n):
        gpus = re.findall(r"^task_wrapper: rank (\d+)/(\d+) .* CUDA_VISIBLE_DEVICES=(\S+)", log, re.M)
        self.assertEqual(sorted(int(r) for r, _, _ in gpus), list(range(n)), log[-3000:])
        self.assertTrue(all(int(w) == n for _, w, _ in gpus))
        self.assertEqual(len({g for _, _, g in gpus}), n, "two ranks pinned to one GPU")


class SmokeAndCifarTest(JobTest):
    def test_lumi_smoke(self):
        log = self.run_job("lumi", "smoke", job_env())
        self.check_ranks(log, 8)
        self.assertIn("SMOKE TEST PASSED", log)

    def test_snellius_smoke_with_diloco_groups(self):
        log = self.run_job("snellius", "smoke", job_env(), ["--diloco-replicas", "2"])
        self.check_ranks(log, 4)
        self.assertRegex(log, r"diloco k=2 outer step\s+PASS")
        self.assertIn("SMOKE TEST PASSED", log)

    def test_cifar_debug_both_sites(self):
        for site in ("lumi", "snellius"):
            log = self.run_job(site, "cifar_debug", job_env())
            self.check_ranks(log, 1)
            self.assertRegex(log, r"done: 2 steps, run directory ")
            run_dir = re.search(r"done: 2 steps, run directory (\S+)", log).group(1)
            rows = [json.loads(l) for l in pathlib.Path(run_dir, "metrics.jsonl").read_text().splitlines()]
            self.assertTrue(any(r.get("split") == "eval" for r in rows), rows)


    def test_full_node_multinode_and_diloco_jobs(self):
        log = self.run_job("snellius", "cifar_1node", job_env())
        self.check_ranks(log, 4)
        self.assertIn("done: 2 steps", log)
        # one node is all this Slurm has: the multi-node script on --nodes=1
        log = self.run_job("lumi", "cifar_multinode", job_env(), sbatch_opts=["--nodes=1"])
        self.check_ranks(log, 8)
        self.assertIn("done: 2 steps", log)
        log = self.run_job("snellius", "cifar_diloco", job_env(REPLICAS="2", INNER_STEPS="1"))
        self.check_ranks(log, 4)
        self.assertIn("done: 2 steps", log)


class TitanTest(JobTest):
    """Both sites' LLM federation job against one set of central services."""

    def setUp(self):
        tmp = STATE["tmp"]
        corpus = os.path.join(tmp, "corpus")
        os.makedirs(corpus, exist_ok=True)
        for i in range(40):
            with open(os.path.join(corpus, f"doc{i:02d}.txt"), "w") as f:
                f.write(f"document {i}: " + "the quick brown fox jumps over the lazy dog. " * 60)
        self.tokens = os.path.join(tmp, "tokens")
        subprocess.run(["prep/tokenize.sh", "--heldout-windows", "8", "--no-progress"], cwd=ROOT, check=True,
                       capture_output=True, env=dict(os.environ, PWW_SITE="local", INPUTS=corpus,
                                                     TOKENIZER="none", SEQ_LEN="64", OUT=self.tokens))
        self.state = os.path.join(tmp, "central")
        self.ports = {k: str(free_port()) for k in ("DARL_PORT", "FEDMOM_PORT", "BLOB_PORT")}
        init = os.path.join(tmp, "init.safetensors")
        subprocess.run([PYTHON, "train.py", "--config", "configs/qwen3_tiny.yaml",
                        "--data", os.path.join(self.tokens, "manifest.json"), "--export-init", init],
                       cwd=ROOT, check=True, capture_output=True)
        self.central("start", MANIFEST=os.path.join(self.tokens, "manifest.json"), BLOCK_SIZE="4", INIT=init)
        self.addCleanup(self.central, "stop")

    def central(self, cmd, **env):
        r = subprocess.run(["./central.sh", cmd, "--state-dir", self.state], cwd=ROOT, capture_output=True,
                           text=True, env=dict(os.environ, **self.ports, **env), timeout=300)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        return r.stdout

    def test_both_sites_train_one_model(self):
        # what RUNBOOK.md section 5 has a user do: `central.sh url > central.env`, copy the
        # token and the CA where its lines say (their $HOME is the site's: here a home of
        # the test's own, which the jobs get as theirs), and submit from the checkout
        text = self.central("url")
        central_env = os.path.join(STATE["tmp"], "central.env")
        with open(central_env, "w") as f:
            f.write(text)
        home = os.path.join(STATE["tmp"], "home")
        copies = re.findall(r"^#   (token|CA) file +(\S+) -> (\S+)$", text, re.M)
        self.assertEqual(sorted(k for k, _, _ in copies), ["CA", "token"], text)
        for kind, src, dst in copies:
            self.assertTrue(dst.startswith("$HOME/"), text)        # the site's home, expanded there
            dst = os.path.join(home, dst[len("$HOME/"):])
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            shutil.copyfile(src, dst)
            if kind == "token":
                os.chmod(dst, 0o600)
        env = job_env(DATA=os.path.join(self.tokens, "manifest.json"), HOME=home, PWW_CENTRAL_ENV=central_env)
        for var in ("PWW_DARL_URL", "PWW_FEDMOM_URL", "PWW_BLOB_URL", "PWW_TOKEN_FILE", "PWW_CA_FILE"):
            env.pop(var, None)                                     # central.env alone says where
        jobs = {site: submit(f"jobs/{site}_titan.sh", env) for site in ("lumi", "snellius")}
        ended = wait(*jobs.values())
        # the job that failed first, then the others (cancelled once one failed)
        for site, job_id in sorted(jobs.items(), key=lambda sj: ended.get(sj[1]) in (None, ("COMPLETED", (0, 0)))):
            state, code = ended.get(job_id, ("CANCELLED after the other job failed", None))
            log_path = os.path.join(ROOT, "logs", f"{site}_titan-{job_id}.out")
            log = pathlib.Path(log_path).read_text() if os.path.exists(log_path) else "(no log)"
            self.assertEqual((state, code), ("COMPLETED", (0, 0)), f"{log_path}:\n{log[-4000:]}")
            self.check_ranks(log, RANKS[site])
        status = self.central("status")
        merged = re.search(r"round (\d+)", status)
        self.assertTrue(merged and int(merged.group(1)) >= 1, status)
        for site in ("lumi", "snellius"):
            self.assertIn(site, status)


class SiteToolsTest(unittest.TestCase):
    """sites/siteinfo.sh and sites/bootstrap.sh as a user runs them at a site: in a job step
    (srun), where Slurm's partitions and the GPU list it hands the step are there to see."""

    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="pww-site-tools-", dir=STATE["tmp"])

    def srun(self, argv, env, cwd=ROOT):
        r = subprocess.run(["srun", "-p", "debug", "-N1", "-n1", "--gpus-per-node=1", "-t", "5", *argv], cwd=cwd,
                           env=env, capture_output=True, text=True, timeout=300)
        return r

    def test_siteinfo_in_a_job_step_sees_the_partitions_and_the_gpu_list(self):
        env = site_tools.clean_env(PWW_SITE="local")
        r = self.srun(["sites/siteinfo.sh"], env)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        got = site_tools.rows(r.stdout)
        self.assertRegex(r.stdout.splitlines()[0], r"^siteinfo: site local .*, Slurm job \d+$")
        self.assertEqual(got["PWW_PARTITIONS"][:2], ("ok", "debug"), r.stdout)
        self.assertIn("GRES gpu:8", got["PWW_PARTITIONS"][2])
        # the fake GPU GRES: no GPU, but Slurm handed the step a CUDA_VISIBLE_DEVICES, as local.sh pins
        if not site_tools.has_gpu():
            self.assertEqual(got["PWW_PIN_VAR"][0], "ok", r.stdout)
            self.assertRegex(got["PWW_PIN_VAR"][2], r"^CUDA_VISIBLE_DEVICES=\d+ \(set by Slurm here\)$")

    def test_siteinfo_in_a_job_step_marks_a_wrong_site_file(self):
        wrong = site_tools.wrong_local_site(self.tmp)
        env = site_tools.clean_env(PWW_SITE="local", PWW_SITE_FILE=wrong)
        r = self.srun(["sites/siteinfo.sh", "--strict"], env)
        self.assertEqual(r.returncode, 1, r.stdout + r.stderr)               # srun passes the exit on
        got = site_tools.rows(r.stdout)
        self.assertEqual(got["PWW_PARTITIONS"][0], "DIFFERS", r.stdout)
        self.assertIn("missing: no_such_partition", got["PWW_PARTITIONS"][2])
        self.assertEqual(got["PWW_VENV"][0], "DIFFERS", r.stdout)

    def test_bootstrap_in_a_job_step(self):
        co = site_tools.temp_checkout(self.tmp)
        os.makedirs(os.path.join(self.tmp, "home"))
        env = site_tools.bootstrap_env(self.tmp, co)
        script = os.path.join(co, "sites", "bootstrap.sh")
        before = site_tools.tree(self.tmp)
        r = self.srun([script, "--dry-run"], env, cwd=co)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertIn("would link data", r.stdout)
        self.assertEqual(site_tools.tree(self.tmp), before)
        r = self.srun([script], env, cwd=co)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        for d in ("runs", "data"):
            self.assertEqual(os.readlink(os.path.join(co, d)), os.path.join(self.tmp, "scratch", d))
        self.assertTrue(os.path.isdir(os.path.join(co, "logs")))
        made = site_tools.tree(self.tmp)
        r = self.srun([script], env, cwd=co)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertIn("nothing changed", r.stdout)
        self.assertEqual(site_tools.tree(self.tmp), made)


if __name__ == "__main__":
    unittest.main()
