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
  - jobs/task_wrapper.sh gives concurrent ranks with the same local rank different
    persistent MIOpen slots (a lock held for the rank's lifetime, released at exit, the
    rank's exit status passed on), and falls back to a per-job directory, with a
    warning, where it cannot lock.
Run: .venv/bin/python tests/run.py test_site_env
"""
import json
import os
import re
import shutil
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
        self.assertIn("dpkg --purge libfabric-dev libfabric1", section("post"), "no TCP-only libfabric left")
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


class MIOpenSlotTest(unittest.TestCase):
    """task_wrapper.sh on LUMI: each rank's MIOpen cache, persistent and never shared live."""
    PROBE = ("import os, sys, json; print(json.dumps({k: os.environ.get(k) for k in "
             "['MIOPEN_USER_DB_PATH', 'MIOPEN_CUSTOM_CACHE_DIR']}), flush=True); sys.stdin.readline()")

    def setUp(self):
        self.tmp = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, self.tmp)
        self.root = os.path.join(self.tmp, "miopen")
        self.live = []
        self.addCleanup(self.release_all)

    def env(self, local_rank, root=None):
        return {"PATH": os.environ["PATH"], "HOME": self.tmp, "USER": "tester", "LANG": "C.UTF-8",
                "PWW_SITE": "lumi", "PWW_RUNNER": "venv", "PWW_VENV": os.path.join(ROOT, ".venv"),
                "PWW_MIOPEN_CACHE_ROOT": root or self.root, "SLURM_PROCID": str(local_rank),
                "SLURM_LOCALID": str(local_rank), "SLURM_NTASKS": "16", "SLURM_NTASKS_PER_NODE": "8",
                "SLURM_JOB_ID": "777"}

    def start(self, local_rank, root=None):
        """A rank that reports its cache and keeps running (holding its slot) until released."""
        p = subprocess.Popen(["jobs/task_wrapper.sh", sys.executable, "-c", self.PROBE], cwd=ROOT,
                             env=self.env(local_rank, root), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
        self.live.append(p)
        for line in p.stdout:
            if line.startswith("{"):
                return p, json.loads(line)
        raise AssertionError(f"rank exited without reporting: {p.wait()} {p.stderr.read()}")

    def release(self, p):
        """End a rank; returns what it wrote to stderr."""
        p.stdin.close()
        rc, err = p.wait(timeout=120), p.stderr.read()
        self.live.remove(p)
        self.assertEqual(rc, 0, err)
        return err

    def release_all(self):
        for p in list(self.live):
            p.stdin.close()
            p.wait(timeout=120)

    def test_concurrent_ranks_get_separate_slots_and_the_next_job_reuses_them(self):
        a, got_a = self.start(0)
        slot0 = os.path.join(self.root, "rank0", "slot0")
        self.assertEqual(got_a["MIOPEN_USER_DB_PATH"], slot0)
        self.assertEqual(got_a["MIOPEN_CUSTOM_CACHE_DIR"], slot0)
        b, got_b = self.start(0)                      # another job's local rank 0, meanwhile
        self.assertEqual(got_b["MIOPEN_USER_DB_PATH"], os.path.join(self.root, "rank0", "slot1"))
        c, got_c = self.start(3)
        self.assertEqual(got_c["MIOPEN_USER_DB_PATH"], os.path.join(self.root, "rank3", "slot0"))
        self.release(a)                               # the first job ends: its slot is free again
        d, got_d = self.start(0)
        self.assertEqual(got_d["MIOPEN_USER_DB_PATH"], slot0, "a later job starts from the kept cache")
        for p in (b, c, d):
            self.release(p)

    def test_the_rank_exit_status_comes_through_the_lock_holder(self):
        r = subprocess.run(["jobs/task_wrapper.sh", sys.executable, "-c", "import sys; sys.exit(3)"], cwd=ROOT,
                           env=self.env(1), capture_output=True, text=True, timeout=120)
        self.assertEqual(r.returncode, 3, r.stderr)
        _, got = self.start(1)                        # and the slot was released on the way out
        self.assertEqual(got["MIOPEN_USER_DB_PATH"], os.path.join(self.root, "rank1", "slot0"))

    def test_no_lockable_root_falls_back_to_a_job_directory_loudly(self):
        blocker = os.path.join(self.tmp, "a-file")
        open(blocker, "w").close()
        p, got = self.start(2, root=os.path.join(blocker, "miopen"))
        fallback = "/tmp/tester-miopen-777-2"
        self.addCleanup(shutil.rmtree, fallback, True)
        self.assertEqual(got["MIOPEN_USER_DB_PATH"], fallback)
        self.assertIn("no lockable slot", self.release(p))


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
