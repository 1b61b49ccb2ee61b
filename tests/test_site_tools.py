"""tests/test_site_tools.py - sites/siteinfo.sh and sites/bootstrap.sh, run for real.

CPU only, no Slurm needed (tests/slurm_jobs.py runs both again inside a job step of the
local Slurm, where siteinfo.sh sees partitions and a GPU list that Slurm set):
  - (shellcheck: tests/test_shell.py checks every sites/*.sh and jobs/*.sh);
  - siteinfo.sh prints the local site's values, each next to what this machine says; a copy of
    sites/local.sh with wrong values (--site-file) gets those rows marked DIFFERS, and exit 1
    only with --strict; a missing tool is said, never fatal; it writes nothing;
  - bootstrap.sh in a checkout of its own (env.sh and sites/ copied to a temp dir, the real
    venv): --dry-run writes nothing, the first run makes the scratch dirs, links and logs/,
    the second changes nothing and says so; a missing venv, or one without torch, is named
    with its fix and exit 1; the central token is made private, a missing CA is named.
Run: .venv/bin/python tests/run.py test_site_tools
"""
import os
import pathlib
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import unittest

from fixtures import bootstrap_env, clean_env, has_gpu, rows, site_tool_run as run, temp_checkout, tree, wrong_local_site

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the tools siteinfo.sh reads the machine with; hidden from PATH, each must be said missing
OPTIONAL_TOOLS = ("sinfo", "scontrol", "lscpu", "nvidia-smi", "rocm-smi", "ibv_devinfo", "ip",
                  "singularity", "apptainer")


class SiteinfoTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, self.tmp)

    def siteinfo(self, *args, env=None):
        return run(["sites/siteinfo.sh", *args], env or clean_env())

    def test_the_local_site_is_printed_with_this_machine_beside_it(self):
        r = self.siteinfo("--site", "local")
        self.assertEqual(r.returncode, 0, r.stderr)
        got = rows(r.stdout)
        site = run(["bash", "-c", 'source env.sh && echo "$PWW_ACCEL $PWW_RANKS_PER_NODE $PWW_VENV"'],
                   clean_env(PWW_SITE="local")).stdout.split()
        self.assertEqual([got["PWW_ACCEL"][1], got["PWW_RANKS_PER_NODE"][1], got["PWW_VENV"][1]], site)
        # every variable sites/local.sh exports has its row
        exported = re.findall(r"^export (\w+)=", pathlib.Path(ROOT, "sites", "local.sh").read_text(), re.M)
        self.assertEqual(sorted(set(exported) - set(got)), [], r.stdout)
        self.assertEqual(got["PWW_ACCEL"][0], "DIFFERS" if has_gpu() else "ok", r.stdout)
        self.assertEqual(got["PWW_RANKS_PER_NODE"][0], "ok", r.stdout)     # no more ranks than CPUs
        self.assertEqual(got["PWW_VENV"][0], "ok", r.stdout)
        self.assertIn("Python 3", got["PWW_VENV"][2])
        self.assertRegex(got["PWW_CORES_PER_RANK"][2], rf"\b{os.cpu_count()} CPUs\b")
        self.assertRegex(r.stdout.splitlines()[-1], r"^siteinfo: \d+ compared: \d+ agree, \d+ differ, \d+ unknown")

    def test_a_wrong_site_file_is_marked_and_strict_fails(self):
        wrong = wrong_local_site(self.tmp)
        good = rows(self.siteinfo("--site", "local").stdout)
        for args, env in ((["--site", "local", "--site-file", wrong], None),
                          (["--site", "local"], clean_env(PWW_SITE_FILE=wrong))):
            r = self.siteinfo(*args, env=env)
            self.assertEqual(r.returncode, 0, r.stderr)                      # differences alone: still 0
            got = rows(r.stdout)
            self.assertIn(wrong, r.stdout.splitlines()[0])
            self.assertEqual(got["PWW_VENV"][:2], ("DIFFERS", "/nonexistent/venv"), r.stdout)
            self.assertIn("no /nonexistent/venv/bin/python", got["PWW_VENV"][2])
            self.assertEqual(got["PWW_INTERCONNECT"][:2], ("DIFFERS", "slingshot"), r.stdout)
            self.assertEqual(got["PWW_ACCEL"], good["PWW_ACCEL"])             # the rest as before
            strict = self.siteinfo(*args, "--strict", env=env)
            self.assertEqual(strict.returncode, 1, strict.stdout + strict.stderr)
        # the real file is not changed by any of this
        self.assertEqual(rows(self.siteinfo("--site", "local").stdout)["PWW_VENV"][0], "ok")

    def test_a_missing_tool_is_said_never_fatal(self):
        """PATH without the optional tools (a directory of links to everything else)."""
        bindir = os.path.join(self.tmp, "bin")
        os.makedirs(bindir)
        for d in os.environ["PATH"].split(os.pathsep):
            if not os.path.isdir(d):
                continue
            for name in os.listdir(d):
                if name not in OPTIONAL_TOOLS and not os.path.lexists(os.path.join(bindir, name)):
                    os.symlink(os.path.join(d, name), os.path.join(bindir, name))
        env = clean_env(PATH=bindir)
        self.assertEqual(run(["bash", "-c", "command -v sinfo lscpu || echo none"], env).stdout.strip(), "none")
        r = self.siteinfo("--site", "local", env=env)
        self.assertEqual(r.returncode, 0, r.stderr)
        got = rows(r.stdout)
        self.assertEqual(got["PWW_PARTITIONS"], ("unknown", "debug", "unknown (no sinfo)"))
        self.assertIn("no lscpu", got["PWW_CORES_PER_RANK"][2])
        self.assertEqual(got["PWW_CORES_PER_RANK"][0], "ok", r.stdout)          # /proc/cpuinfo told
        r = self.siteinfo("--site", "snellius", "--strict", env=env)            # unknowns are not failures
        self.assertEqual(rows(r.stdout)["modules (jobs/snellius_setup_venv.sh)"][0], "unknown", r.stdout)
        self.assertIn("no module command", r.stdout)

    def test_it_writes_nothing(self):
        home = os.path.join(self.tmp, "home")
        os.makedirs(home)
        status = run(["git", "status", "--porcelain"], clean_env()).stdout
        before = tree(self.tmp)
        for site in ("local", "lumi", "snellius"):
            r = run([os.path.join(ROOT, "sites", "siteinfo.sh"), "--site", site], clean_env(HOME=home), cwd=self.tmp)
            self.assertEqual(r.returncode, 0, r.stderr)
            self.assertGreater(len(rows(r.stdout)), 10, r.stdout)
        self.assertEqual(tree(self.tmp), before)
        self.assertEqual(run(["git", "status", "--porcelain"], clean_env()).stdout, status)

    def test_another_sites_file_on_this_machine_differs(self):
        r = self.siteinfo("--site", "lumi", "--strict")
        self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
        got = rows(r.stdout)
        self.assertEqual(got["site"][0], "DIFFERS")                        # this host is no LUMI node
        self.assertEqual(got["PWW_PIN_VAR"][1], "ROCR_VISIBLE_DEVICES")
        self.assertEqual(got["NCCL_SOCKET_IFNAME"][1], "hsn0,hsn1,hsn2,hsn3")
        self.assertTrue(got["pww_cpu_bind 8"][1].startswith("mask_cpu:0xfe"), got["pww_cpu_bind 8"])

    def test_usage(self):
        r = self.siteinfo("--help")
        self.assertEqual(r.returncode, 0)
        self.assertIn("--strict", r.stdout)
        self.assertEqual(self.siteinfo("--bogus").returncode, 2)
        r = self.siteinfo("--site", "nosuchsite")
        self.assertEqual(r.returncode, 2)
        self.assertIn("local lumi snellius", r.stderr)
        for name, said in (("../env", "is not a site name"), ("bootstrap", "is a tool beside the site files")):
            r = self.siteinfo("--site", name)                  # never sourced as a site file
            self.assertEqual(r.returncode, 2, r.stdout)
            self.assertIn(said, r.stderr)
            self.assertEqual(r.stdout, "")


class BootstrapTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, self.tmp)
        self.co = temp_checkout(self.tmp)
        self.scratch = os.path.join(self.tmp, "scratch")
        os.makedirs(os.path.join(self.tmp, "home"))

    def bootstrap(self, *args, **env):
        return run([os.path.join(self.co, "sites", "bootstrap.sh"), *args], bootstrap_env(self.tmp, self.co, **env))

    def test_dry_run_then_first_run_then_nothing_to_change(self):
        before = tree(self.tmp)
        r = self.bootstrap("--dry-run")
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertIn(f"would link runs -> {self.scratch}/runs", r.stdout)
        self.assertIn("nothing written", r.stdout)
        self.assertEqual(tree(self.tmp), before)                             # --dry-run wrote nothing
        r = self.bootstrap()
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        for d in ("runs", "data"):
            self.assertEqual(os.readlink(os.path.join(self.co, d)), os.path.join(self.scratch, d))
            self.assertTrue(os.path.isdir(os.path.join(self.scratch, d)))
        self.assertTrue(os.path.isdir(os.path.join(self.co, "logs")))
        self.assertRegex(r.stdout, r"runtime \(venv\): torch \d")
        self.assertIn("6 change(s) made; 0 thing(s) missing", r.stdout)
        made = tree(self.tmp)
        r = self.bootstrap()
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertIn("nothing changed", r.stdout)
        self.assertEqual(tree(self.tmp), made)                                # the second run: nothing
        # scratch purged: the links' directories come back (the directories alone: --dirs-only)
        shutil.rmtree(self.scratch)
        r = self.bootstrap("--dirs-only")
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertEqual(sorted(os.listdir(self.scratch)), ["data", "runs"])

    def test_env_sh_pww_setup_dirs_is_the_same_step(self):
        r = run(["bash", "-c", "source env.sh && pww_setup_dirs"], bootstrap_env(self.tmp, self.co), cwd=self.co)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertEqual(os.readlink(os.path.join(self.co, "data")), os.path.join(self.scratch, "data"))
        self.assertNotIn("runtime", r.stdout)                                # the directories alone

    def test_a_full_directory_in_the_checkout_is_never_moved(self):
        os.makedirs(os.path.join(self.co, "data"))
        pathlib.Path(self.co, "data", "corpus.bin").write_text("x")
        r = self.bootstrap("--dirs-only")
        self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
        self.assertIn(f"mv {self.co}/data/* {self.scratch}/data/", r.stderr)
        self.assertTrue(os.path.isfile(os.path.join(self.co, "data", "corpus.bin")))
        self.assertTrue(os.path.islink(os.path.join(self.co, "runs")))     # the rest is done

    def test_a_scratch_spelled_as_the_checkout_links_nothing_to_itself(self):
        r = self.bootstrap("--dirs-only", PWW_SCRATCH=self.co + "/")     # the checkout, spelled otherwise
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        for d in ("runs", "data"):
            self.assertFalse(os.path.islink(os.path.join(self.co, d)), r.stdout)
            self.assertTrue(os.path.isdir(os.path.join(self.co, d)))
        link = os.path.join(self.tmp, "also-checkout")                  # and through a symlink
        os.symlink(self.co, link)
        r = self.bootstrap("--dirs-only", PWW_SCRATCH=link)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertIn("nothing changed", r.stdout)
        self.assertFalse(os.path.islink(os.path.join(self.co, "runs")))

    def test_a_scratch_it_cannot_make_leaves_no_link_and_fails(self):
        pathlib.Path(self.scratch).write_text("a file where the scratch should be")
        r = self.bootstrap("--dirs-only")
        self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
        self.assertIn(f"could not make {self.scratch}", r.stderr)
        for d in ("runs", "data"):
            self.assertFalse(os.path.lexists(os.path.join(self.co, d)), r.stdout)   # no link into nothing
        self.assertNotIn("change(s) made", r.stdout)

    def test_a_missing_venv_or_one_without_torch_is_named_with_its_fix(self):
        r = self.bootstrap(PWW_VENV=os.path.join(self.tmp, "novenv"))
        self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
        self.assertIn(f"no {self.tmp}/novenv/bin/python", r.stderr)
        self.assertIn("-m venv", r.stderr)
        r = self.bootstrap(PWW_SITE="snellius", PWW_VENV=os.path.join(self.tmp, "novenv"))
        self.assertIn("jobs/snellius_setup_venv.sh", r.stderr)
        bare = os.path.join(self.tmp, "bare")                                 # a real venv, no torch in it
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", bare], check=True, timeout=120)
        self.assertNotEqual(run([os.path.join(bare, "bin", "python"), "-c", "import torch"], clean_env()).returncode, 0)
        r = self.bootstrap(PWW_VENV=bare)
        self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
        self.assertIn("cannot import torch and torchtitan", r.stderr)
        self.assertIn("No module named 'torch'", r.stderr)

    def test_the_central_token_is_made_private_and_a_missing_ca_named(self):
        home = os.path.join(self.tmp, "home")
        os.makedirs(os.path.join(home, ".pww"))
        token = os.path.join(home, ".pww", "central.token")
        pathlib.Path(token).write_text("secret\n")
        os.chmod(token, 0o644)
        pathlib.Path(self.co, "central.env").write_text(   # as `central.sh url` writes it
            "export PWW_DARL_URL=https://c:29510\nexport PWW_FEDMOM_URL=https://c:29511\n"
            "export PWW_BLOB_URL=https://c:29512\nexport PWW_TOKEN_FILE=$HOME/.pww/central.token\n"
            "export PWW_CA_FILE=$HOME/.pww/central-ca.pem\n")
        r = self.bootstrap("--dry-run")
        self.assertIn("would make the token file", r.stdout)
        self.assertEqual(stat.S_IMODE(os.stat(token).st_mode), 0o644)
        r = self.bootstrap()
        self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
        self.assertEqual(stat.S_IMODE(os.stat(token).st_mode), 0o600)
        self.assertIn(f"scp <central>:<dir>/runs/central/tls/ca.pem {home}/.pww/central-ca.pem", r.stderr)
        pathlib.Path(home, ".pww", "central-ca.pem").write_text("ca\n")
        r = self.bootstrap()
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertIn("nothing changed", r.stdout)

    def test_usage(self):
        r = self.bootstrap("--help")
        self.assertEqual(r.returncode, 0)
        self.assertIn("--dry-run", r.stdout)
        self.assertEqual(self.bootstrap("--bogus").returncode, 2)
        self.assertFalse(os.path.lexists(os.path.join(self.co, "runs")))     # neither did anything
        self.assertFalse(os.path.lexists(self.scratch))


if __name__ == "__main__":
    sys.path[:0] = [ROOT]
    unittest.main()
