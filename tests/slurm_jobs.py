"""tests/slurm_jobs.py - every site's jobs, for real, under a single-node Slurm on this machine.

NOT part of `make test` (the name does not match test_*.py): it needs root, apt and a
few minutes. Run it with
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
corpus made by prep/tokenize.sh, and both sites train against them.
Skips (never fails) when not root, or without apt-get where Slurm is not installed.
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

from harness import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYTHON = os.path.join(ROOT, ".venv", "bin", "python")
RANKS = {"lumi": 8, "snellius": 4}
PARTITIONS = "debug dev-g small-g standard-g gpu_h100 gpu_a100"
JOB_DEADLINE_S = 1800      # generous: 8 CPU ranks on 2 cores are slow, not stuck
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


def wait(job_id):
    """Poll until the job ends; returns (state, exit code) from scontrol."""
    deadline = time.monotonic() + JOB_DEADLINE_S
    while True:
        out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True,
                             text=True).stdout
        state = re.search(r"JobState=(\S+)", out)
        state = state.group(1) if state else "UNKNOWN"
        if state not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "UNKNOWN"):
            code = re.search(r"ExitCode=(\d+):(\d+)", out)
            return state, (int(code.group(1)), int(code.group(2))) if code else None
        if time.monotonic() > deadline:
            subprocess.run(["scancel", job_id])
            raise AssertionError(f"job {job_id} still {state} after {JOB_DEADLINE_S} s; cancelled")
        time.sleep(0.5)


class JobTest(unittest.TestCase):
    def run_job(self, site, job, env, args=(), sbatch_opts=()):
        job_id = submit(f"jobs/{site}_{job}.sh", env, args, sbatch_opts)
        state, code = wait(job_id)
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
        subprocess.run([PYTHON, "train.py", "--config", "configs/qwen3_tiny.yaml", "--device", "cpu",
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
        urls = {}
        for line in self.central("url", PWW_SITE_TOKEN_FILE=os.path.join(self.state, "token")).splitlines():
            m = re.match(r"export (PWW_\w+)=(\S+)", line)
            if m:
                urls[m.group(1)] = m.group(2)
        env = job_env(DATA=os.path.join(self.tokens, "manifest.json"), **urls)
        jobs = {site: submit(f"jobs/{site}_titan.sh", env) for site in ("lumi", "snellius")}
        for site, job_id in jobs.items():
            state, code = wait(job_id)
            log_path = os.path.join(ROOT, "logs", f"{site}_titan-{job_id}.out")
            log = pathlib.Path(log_path).read_text() if os.path.exists(log_path) else "(no log)"
            self.assertEqual((state, code), ("COMPLETED", (0, 0)), f"{log_path}:\n{log[-4000:]}")
            self.check_ranks(log, RANKS[site])
        status = self.central("status")
        merged = re.search(r"round (\d+)", status)
        self.assertTrue(merged and int(merged.group(1)) >= 1, status)
        for site in ("lumi", "snellius"):
            self.assertIn(site, status)


if __name__ == "__main__":
    unittest.main()
