"""tests/test_site_env.py - the LUMI image's library path, the Snellius venv script, the ranks' MIOpen caches.

Real shells, real files, real processes; no container runtime is needed:
  - containers/lumi-env.sh (what the image runs at every start, under dash) against a
    fake /opt/cray/libfabric tree: the newest version directory that holds libfabric.so.1
    first, then the image's plugin, then /usr/lib64 for the bound libcxi; overrides win;
  - the image definition installs that file and sources it, and sites/lumi.sh binds what
    it points at;
  - env.sh's container command binds a host plugin directory when one is given and leaves
    the library path to the image;
  - jobs/snellius_setup_venv.sh runs to its end on a login node whose nvidia-smi fails
    (with a note), and checks the driver where one answers;
  - jobs/task_wrapper.sh gives every live rank its own node-local copy of the persistent
    MIOpen cache, rank 0 publishes its copy when the job ends (also on SIGTERM), the root
    keeps two generations, a SIGKILLed wrapper leaves its rank on a private copy, and an
    unwritable root warns; the rank's exit status is passed on.
Run: .venv/bin/python tests/run.py test_site_env
"""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHELLCHECK = os.path.join(ROOT, ".venv", "bin", "shellcheck")
ENV_SH = os.path.join(ROOT, "containers", "lumi-env.sh")


def sh(script, env, shell="sh"):
    base = {"PATH": os.environ["PATH"], "HOME": env.get("HOME", "/tmp"), "USER": "tester", "LANG": "C.UTF-8"}
    r = subprocess.run([shell, "-c", script], env=dict(base, **env), cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    if r.returncode != 0:
        raise AssertionError(f"{shell} failed ({r.returncode}): {script}\n{r.stdout}\n{r.stderr}")
    return r.stdout


class ImageLibraryPathTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, self.tmp)
        self.fab = os.path.join(self.tmp, "libfabric")
        for version, has_lib in (("1.9.0", True), ("1.15.2.0", True), ("1.22.0", True), ("2.0.0", False)):
            lib = os.path.join(self.fab, version, "lib64")
            os.makedirs(lib)
            if has_lib:
                open(os.path.join(lib, "libfabric.so.1"), "w").close()

    def path_after_start(self, **env):
        out = sh(f'. "{ENV_SH}"; echo "$LD_LIBRARY_PATH"; echo "$PWW_FABRIC_LIBDIR"',
                 dict({"PWW_CRAY_LIBFABRIC_ROOT": self.fab}, **env))
        ld, chosen = out.split("\n")[:2]
        return ld.split(":"), chosen

    def test_newest_host_libfabric_then_plugin_then_usr_lib64(self):
        ld, chosen = self.path_after_start()
        newest = os.path.join(self.fab, "1.22.0", "lib64")       # by version, not by name; 2.0.0 lacks the library
        self.assertEqual(chosen, newest)
        self.assertEqual(ld, [newest, "/opt/aws-ofi-nccl/lib", "/usr/lib64"])

    def test_overrides_and_an_existing_path(self):
        ld, _ = self.path_after_start(PWW_CRAY_LIBFABRIC="/opt/cray/libfabric/1.15.2.0/lib64",
                                      PWW_RCCL_PLUGIN_DIR="/appl/plugin", LD_LIBRARY_PATH="/.singularity.d/libs")
        self.assertEqual(ld, ["/appl/plugin", "/opt/cray/libfabric/1.15.2.0/lib64", "/opt/aws-ofi-nccl/lib",
                              "/usr/lib64", "/.singularity.d/libs"])

    def test_without_host_libfabric_the_plugin_has_none(self):
        ld, chosen = self.path_after_start(PWW_CRAY_LIBFABRIC_ROOT=os.path.join(self.tmp, "absent"))
        self.assertEqual((ld, chosen), (["/opt/aws-ofi-nccl/lib", "/usr/lib64"], ""))

    def test_posix_sh_clean(self):
        r = subprocess.run([SHELLCHECK, "-s", "sh", ENV_SH], capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stdout)

    def test_the_image_runs_it_and_the_site_binds_what_it_points_at(self):
        with open(os.path.join(ROOT, "containers", "lumi-titan.def")) as f:
            spec = f.read()
        section = lambda name: re.search(rf"^%{name}\n(.*?)(?=^%|\Z)", spec, re.M | re.S).group(1)
        self.assertIn("containers/lumi-env.sh /opt/pww/lumi-env.sh", section("files"))
        self.assertIn(". /opt/pww/lumi-env.sh", section("environment"))
        self.assertIn("--with-rocm=/opt/rocm", section("post"))
        self.assertIn("apt-get purge -y -qq --auto-remove libfabric-dev libfabric1", section("post"),
                      "no TCP-only libfabric left, and no abort when a package depends on it")
        self.assertIn("ldconfig -p | grep -q 'libfabric\\.so'", section("test"))
        self.assertIn("test -f /opt/aws-ofi-nccl/lib/librccl-net.so", section("test"))
        binds = sh('. sites/lumi.sh; echo "$PWW_CONTAINER_BINDS"', {"PWW_ROOT": ROOT}, shell="bash").strip().split(",")
        for b in ("/opt/cray", "/usr/lib64/libcxi.so.1", "/var/spool/slurmd"):
            self.assertIn(b, binds)

    def test_env_sh_binds_a_host_plugin_and_leaves_the_path_to_the_image(self):
        sif = os.path.join(self.tmp, "image.sif")
        open(sif, "w").close()
        script = 'source env.sh && pww_runtime_cmd python -V && printf "%s\\n" "${PWW_CMD[@]}"'
        env = {"PWW_SITE": "lumi", "PWW_CONTAINER": sif, "PWW_SINGULARITY": "singularity"}
        plain = sh(script, env, shell="bash").splitlines()
        self.assertEqual(plain[:2], ["singularity", "exec"])
        self.assertNotIn("--env", plain)
        self.assertNotIn("/appl/plugin", plain[plain.index("--bind") + 1])
        withp = sh(script, dict(env, PWW_RCCL_PLUGIN_DIR="/appl/plugin"), shell="bash").splitlines()
        self.assertTrue(withp[withp.index("--bind") + 1].endswith(",/appl/plugin"), withp)


class MIOpenCacheTest(unittest.TestCase):
    """task_wrapper.sh on LUMI: each rank's MIOpen cache, persistent and never shared live."""
    PROBE = ("import os, sys, json; d = os.environ['MIOPEN_USER_DB_PATH']; "
             "open(os.path.join(d, 'tuned-by-job-' + os.environ['SLURM_JOB_ID']), 'w').write('x'); "
             "print(json.dumps({'db': d, 'kernels': os.environ.get('MIOPEN_CUSTOM_CACHE_DIR'), "
             "'files': sorted(os.listdir(d)), 'pid': os.getpid()}), flush=True); "
             "sys.exit(int(sys.stdin.readline() or 0))")

    def setUp(self):
        self.tmp = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, self.tmp)
        self.root = os.path.join(self.tmp, "miopen")
        self.node_tmp = os.path.join(self.tmp, "node-tmp")
        os.makedirs(self.node_tmp)
        self.live, self.started = [], []
        self.addCleanup(self.close_pipes)           # last: after release_all
        self.addCleanup(self.release_all)

    def env(self, rank, job, root=None):
        return {"PATH": os.environ["PATH"], "HOME": self.tmp, "USER": "tester", "LANG": "C.UTF-8",
                "TMPDIR": self.node_tmp, "PWW_SITE": "lumi", "PWW_RUNNER": "venv",
                "PWW_VENV": os.path.join(ROOT, ".venv"), "PWW_MIOPEN_CACHE_ROOT": root or self.root,
                "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank % 8), "SLURM_NTASKS": "16",
                "SLURM_NTASKS_PER_NODE": "8", "SLURM_JOB_ID": str(job)}

    def start(self, rank, job, root=None):
        """A rank that reports its cache and runs until released (with the exit status given)."""
        p = subprocess.Popen(["jobs/task_wrapper.sh", sys.executable, "-c", self.PROBE], cwd=ROOT,
                             env=self.env(rank, job, root), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
        self.live.append(p)
        self.started.append(p)
        for line in p.stdout:
            if line.startswith("{"):
                return p, json.loads(line)
        raise AssertionError(f"rank exited without reporting: {p.wait()} {p.stderr.read()}")

    def release(self, p, status=0):
        """End a rank; returns (exit status, what it wrote to stderr)."""
        p.stdin.write(f"{status}\n")
        p.stdin.close()
        rc, err = p.wait(timeout=120), p.stderr.read()
        self.live.remove(p)
        return rc, err

    def release_all(self):
        for p in list(self.live):
            p.stdin.close()
            p.wait(timeout=120)

    def close_pipes(self):
        for p in self.started:
            for f in (p.stdin, p.stdout, p.stderr):
                f.close()

    def generations(self):
        return sorted(n for n in os.listdir(self.root) if n.startswith("gen."))

    def test_ranks_work_on_private_copies_and_rank_0_publishes_the_next_jobs_start(self):
        a0, got_a0 = self.start(0, 101)
        a3, got_a3 = self.start(3, 101)
        b0, got_b0 = self.start(0, 102)                    # another job's rank 0, meanwhile
        dirs = {got_a0["db"], got_a3["db"], got_b0["db"]}
        self.assertEqual(len(dirs), 3, "no two live ranks share a cache")
        self.assertTrue(all(d.startswith(self.node_tmp) for d in dirs), dirs)
        self.assertEqual(got_a0["kernels"], got_a0["db"])
        self.assertEqual(self.release(a3), (0, ""))
        self.assertFalse(os.path.exists(os.path.join(self.root, "current")), "only rank 0 publishes")
        self.assertEqual(self.release(a0)[0], 0)
        self.assertFalse(os.path.exists(got_a0["db"]), "the private copy is removed")
        current = os.path.join(self.root, "current")
        self.assertEqual(os.listdir(current), ["tuned-by-job-101"])
        c5, got_c5 = self.start(5, 103)                    # a later job starts from it
        self.assertEqual(got_c5["files"], ["tuned-by-job-101", "tuned-by-job-103"])
        self.release(c5)
        self.assertEqual(self.release(b0, status=3)[0], 3, "the rank's exit status comes through")
        self.assertEqual(os.listdir(current), ["tuned-by-job-102"], "the last publisher wins")

    def test_the_root_keeps_two_generations_whatever_ran(self):
        for job in range(1, 6):
            self.release(self.start(0, job)[0])
        gens = self.generations()
        self.assertEqual(len(gens), 2, gens)
        self.assertEqual(os.readlink(os.path.join(self.root, "current")), gens[-1])
        self.assertEqual(sorted(os.listdir(os.path.join(self.root, "current"))),
                         [f"tuned-by-job-{j}" for j in range(1, 6)], "each job started from the last")

    def test_a_time_limit_sigterm_still_publishes(self):
        p, got = self.start(0, 7)
        p.send_signal(signal.SIGTERM)                      # to the wrapper only; it forwards
        rc = p.wait(timeout=120)
        self.live.remove(p)
        self.assertEqual(rc, 128 + signal.SIGTERM, p.stderr.read())
        self.assertEqual(os.listdir(os.path.join(self.root, "current")), ["tuned-by-job-7"])

    def test_a_killed_wrapper_leaves_its_rank_on_a_private_copy(self):
        p, got = self.start(0, 8)
        p.kill()                                           # SIGKILL: no publish, no cleanup
        p.wait(timeout=120)
        os.kill(got["pid"], 0)                             # the rank itself still runs ...
        q, got_q = self.start(0, 9)
        self.assertNotEqual(got_q["db"], got["db"], "... on a cache no other rank is given")
        self.release(q)
        p.stdin.close()                                    # now end the orphan
        self.live.remove(p)

    def test_a_root_that_cannot_be_written_leaves_a_cold_private_cache_loudly(self):
        blocker = os.path.join(self.tmp, "a-file")
        open(blocker, "w").close()
        p, got = self.start(0, 10, root=os.path.join(blocker, "miopen"))
        self.assertTrue(got["db"].startswith(self.node_tmp))
        rc, err = self.release(p)
        self.assertEqual(rc, 0)
        self.assertIn("could not publish the MIOpen cache", err)


class SnelliusSetupTest(unittest.TestCase):
    """jobs/snellius_setup_venv.sh to its end, pip and the venv's python stood in by scripts
    (the install itself is pip's), the NVIDIA driver as a login or GPU node answers."""

    def setUp(self):
        self.tmp = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, self.tmp)
        self.venv, self.bin = os.path.join(self.tmp, "venv"), os.path.join(self.tmp, "bin")
        os.makedirs(os.path.join(self.venv, "bin"))
        os.makedirs(self.bin)
        self.stub(os.path.join(self.venv, "bin", "pip"), 'echo "pip $*" >> "$(dirname "$0")/../pip.log"\n'
                  '[ "$1" = freeze ] && echo torch==2.13.0+cu126\nexit 0')
        self.stub(os.path.join(self.venv, "bin", "python"), "echo torch 2.13.0+cu126 cuda 12.6 torchtitan ok")

    def stub(self, path, body):
        with open(path, "w") as f:
            f.write("#!/bin/sh\n" + body + "\n")
        os.chmod(path, 0o755)

    def setup_venv(self, nvidia_smi=None):
        if nvidia_smi is not None:
            self.stub(os.path.join(self.bin, "nvidia-smi"), nvidia_smi)
        env = {"PATH": f"{self.bin}:/usr/bin:/bin", "HOME": self.tmp, "USER": "tester", "LANG": "C.UTF-8",
               "PWW_VENV": self.venv, "PYTHON": sys.executable}
        return subprocess.run(["bash", "jobs/snellius_setup_venv.sh"], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=120)

    def test_a_login_node_whose_nvidia_smi_fails_finishes_with_a_note(self):
        r = self.setup_venv('echo "NVIDIA-SMI has failed because it could not communicate with the '
                            'NVIDIA driver" >&2; exit 9')
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertIn("driver: not checked here", r.stdout)
        self.assertIn("venv ready:", r.stdout)
        with open(os.path.join(self.venv, "pip.log")) as f:
            self.assertIn("torch==2.13.0+cu126", f.read())
        r = self.setup_venv()                               # no nvidia-smi at all
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertIn("driver: not checked here", r.stdout)

    def test_a_gpu_node_checks_the_driver(self):
        r = self.setup_venv("echo 550.54.15")
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertIn("driver 550.54.15: runs the CUDA 12.6 build", r.stdout)
        r = self.setup_venv("echo 470.57.02")
        self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
        self.assertIn("NVIDIA driver 470.57.02 is older than R525", r.stderr)


if __name__ == "__main__":
    unittest.main()
