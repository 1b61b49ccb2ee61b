"""smoke.py as its users run it: torchrun subprocesses on CPU ranks over loopback; its
network row on NCCL's own log lines (the formats NCCL/RCCL and aws-ofi-nccl print), which
must be read even when the user set NCCL_DEBUG, and must fail a multi-node run when they
say nothing."""
import os
import subprocess
import sys
import tempfile
import unittest
import unittest.mock

import torch

import dist_env
import smoke

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")
DEADLINE_S = 240          # generous: 4 processes importing torch on 2 loaded cores


def run_smoke(nproc, *flags, env=None):
    env = {k: v for k, v in dict(os.environ, **(env or {})).items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    if nproc:
        cmd = [TORCHRUN, "--standalone", f"--nproc-per-node={nproc}", "smoke.py", "--device", "cpu", *flags]
    else:
        cmd = [sys.executable, "smoke.py", "--device", "cpu", *flags]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=DEADLINE_S)
    return p.returncode, p.stdout + p.stderr


class SmokeTest(unittest.TestCase):
    def test_passes_on_4_cpu_ranks_with_k2_and_k4(self):
        rc, out = run_smoke(4, "--diloco-replicas", "2", "4")
        self.assertEqual(rc, 0, out)
        self.assertIn("SMOKE TEST PASSED", out)
        table = [l for l in out.splitlines() if l.split(" ")[0] in ("first", "distinct", "all-reduce", "diloco")]
        self.assertEqual(len(table), 8, out)
        for line in table:
            self.assertRegex(line, r"\s+PASS\s+", out)
        # the first row: the world's first all-reduce, then each layout's sub-groups, timed
        self.assertTrue(table[0].startswith("first collective"), out)
        self.assertRegex(table[0], r"world \d+\.\d ms; k=2: groups made in \d+\.\d ms, inner \[0, 1\] "
                                   r"\d+\.\d ms, outer \[0, 2\] \d+\.\d ms; k=4: .*outer \[0, 1, 2, 3\]")
        self.assertIn("PWW_EAGER_PG_INIT", table[0])
        self.assertIn("sum of 1..4 = 10", out)
        self.assertRegex(out, r"diloco k=2 outer step\s+PASS\s+exactly 0\.5000")
        self.assertRegex(out, r"diloco k=4 outer step\s+PASS\s+exactly 1\.5000")
        self.assertIn("inner [0, 1], outer [0, 2]", out)
        self.assertRegex(out, r"busbw \d+\.\d+ GB/s")
        self.assertRegex(out, r"network\s+PASS\s+gloo")
        self.assertRegex(out, r"attention kernel\s+PASS\s+flash ran; plan flash \(GQA native\)")

    def test_a_failed_check_exits_1(self):
        rc, out = run_smoke(2, "--min-busbw-gbs", "1e9", "--allreduce-mb", "1")
        self.assertEqual(rc, 1, out)
        self.assertRegex(out, r"all-reduce bandwidth\s+FAIL")
        self.assertIn("SMOKE TEST FAILED", out)
        self.assertRegex(out, r"all-reduce exact\s+PASS")

    def test_a_first_collective_that_never_finishes_fails_the_job_naming_the_group(self):
        """One rank never reaches its first all-reduce on a k=2 sub-group (a fault point holds
        it, as LUMI's hang would): every rank's watchdog ends the job with exit 1 and a line
        naming the group and the mitigations set, instead of a job that waits for its
        allocation to end."""
        with tempfile.TemporaryDirectory() as faults:
            with open(os.path.join(faults, "smoke.first_collective.rank0"), "w") as f:
                f.write("1")           # rank 0 passes the world's all-reduce, stops before k=2's inner one
            rc, out = run_smoke(4, "--diloco-replicas", "2", "--first-collective-timeout-s", "5",
                                env={"PWW_TEST_FAULT_DIR": faults, "RCCL_MSCCL_ENABLE": "0"})
            self.assertTrue(os.path.exists(os.path.join(faults, "smoke.first_collective.rank0.hit")),
                            "the fault point was never reached:\n" + out)
        self.assertNotEqual(rc, 0, out)
        self.assertRegex(out, r"smoke\.py: FAIL first collective: the first all-reduce on k=2 (inner|outer) "
                              r"group \[\d, \d\] did not finish within 5 s on rank \d")
        self.assertRegex(out, r"PWW_EAGER_PG_INIT unset, TORCH_NCCL_USE_COMM_NONBLOCKING unset, RCCL_MSCCL_ENABLE=0; "
                              r"see RUNBOOK.md section 2")
        self.assertNotIn("SMOKE TEST PASSED", out)

    def test_replicas_that_do_not_divide_exit_2_naming_the_flag(self):
        rc, out = run_smoke(0, "--diloco-replicas", "3")
        self.assertEqual(rc, 2, out)
        self.assertIn("--diloco-replicas 3 does not divide 1 ranks; use 1", out)
        rc, out = run_smoke(0, env={"PWW_EAGER_PG_INIT": "yes"})
        self.assertEqual(rc, 2, out)
        self.assertIn("smoke.py: PWW_EAGER_PG_INIT='yes': use 1", out)
        self.assertNotIn("Traceback", out)


# NCCL_DEBUG=INFO lines as NCCL 2.2x / RCCL and aws-ofi-nccl 1.18 print them
LUMI_LOG = """nid005001:1234:1234 [0] NCCL INFO NET/OFI Initializing aws-ofi-nccl 1.18.0
nid005001:1234:1234 [0] NCCL INFO NET/OFI Using Libfabric version 1.22
nid005001:1234:1234 [0] NCCL INFO NET/OFI Selected provider is cxi, fabric is cxi (found 4 nics)
nid005001:1234:1234 [0] NCCL INFO Using network Libfabric
"""
SOCKET_LOG = """nid005001:1234:1234 [0] NCCL INFO NET/Plugin: Could not find: librccl-net.so.
nid005001:1234:1234 [0] NCCL INFO NET/Socket : Using [0]hsn0:10.253.1.2<0>
nid005001:1234:1234 [0] NCCL INFO Using network Socket
"""


class NetworkRowTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.addCleanup(self.tmp.cleanup)
        self.gpu = dist_env.Dist(rank=0, local_rank=0, world_size=16, device=torch.device("cuda", 0),
                              backend="nccl", accel="rocm")

    def check(self, text, hosts):
        """(ok, detail, lines) of the network row for a rank whose NCCL log holds `text`."""
        with open(os.path.join(self.tmp.name, f"nccl.nid005001.{os.getpid()}.log"), "w") as f:
            f.write(text)
        return smoke.check_network(self.gpu, hosts, os.path.join(self.tmp.name, f"nccl.*.{os.getpid()}.log"))

    def test_the_plugin_lines_are_read(self):
        self.assertEqual(smoke.network_summary(LUMI_LOG), {"network": "Libfabric", "plugin": "aws-ofi-nccl 1.18.0",
                                                           "libfabric": "1.22", "provider": "cxi"})
        ok, detail, _ = self.check(LUMI_LOG, hosts=2)
        self.assertTrue(ok, detail)
        self.assertIn("Libfabric via aws-ofi-nccl 1.18.0, libfabric 1.22, provider cxi; 2 node(s)", detail)

    def test_tcp_across_nodes_fails_and_within_a_node_passes(self):
        ok, detail, _ = self.check(SOCKET_LOG, hosts=2)
        self.assertFalse(ok)
        self.assertIn("run over TCP", detail)
        self.assertTrue(self.check(SOCKET_LOG, hosts=1)[0], "one node: the network is not used")
        tcp_provider = LUMI_LOG.replace("provider is cxi, fabric is cxi", "provider is tcp;ofi_rxm, fabric is TCP-IP")
        self.assertFalse(self.check(tcp_provider, hosts=4)[0])

    def test_a_log_without_the_network_line_fails_across_nodes(self):
        ok, detail, _ = self.check("nothing here\n", hosts=2)
        self.assertFalse(ok, "a multi-node run whose transport nobody saw must not pass")
        self.assertIn("cannot tell which transport 2 nodes use", detail)
        ok, detail, _ = smoke.check_network(self.gpu, 2, os.path.join(self.tmp.name, "absent", "nccl.*.1.log"))
        self.assertFalse(ok)
        self.assertIn("no NCCL log at", detail)
        ok, detail, _ = self.check("nothing here\n", hosts=1)
        self.assertTrue(ok, detail)
        self.assertIn("one node", detail)

    def test_the_lines_are_handed_back_for_the_report(self):
        _, _, lines = self.check(LUMI_LOG, hosts=2)
        self.assertEqual(len(lines), 4)
        self.assertTrue(lines[-1].endswith("Using network Libfabric"))


MAPS = """7f0000000000-7f0000100000 r-xp 00000000 00:2a 1234  /opt/venv/lib/python3.12/site-packages/torch/lib/libamdhip64.so
7f0000100000-7f0000200000 r--p 00100000 00:2a 1234  /opt/venv/lib/python3.12/site-packages/torch/lib/libamdhip64.so
7f0000300000-7f0000400000 r-xp 00000000 00:2a 99    /opt/aws-ofi-nccl/lib/librccl-net.so
7f0000500000-7f0000600000 rw-p 00000000 00:00 0
"""


class HipRuntimeRowTest(unittest.TestCase):
    def test_one_runtime_passes_two_fail(self):
        rocm = dist_env.Dist(rank=0, local_rank=0, world_size=8, device=torch.device("cuda", 0), backend="nccl",
                          accel="rocm")
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "maps")
            with open(path, "w") as f:
                f.write(MAPS)
            ok, detail = smoke.check_hip_runtime(rocm, path)
            self.assertTrue(ok, detail)
            self.assertIn("torch/lib/libamdhip64.so", detail)
            with open(path, "a") as f:
                f.write("7f0000700000-7f0000800000 r-xp 00000000 00:2a 77  /opt/rocm-7.0.2/lib/libamdhip64.so.7.0.70002\n")
            ok, detail = smoke.check_hip_runtime(rocm, path)
            self.assertFalse(ok)
            self.assertIn("2 HIP runtimes", detail)
        cpu = dist_env.Dist(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), backend="gloo", accel="cpu")
        self.assertEqual(smoke.check_hip_runtime(cpu), (True, "not a ROCm run"))


class DebugFileTest(unittest.TestCase):
    """nccl_debug_to_file() with what a user may have set (RUNBOOK's checklist sets NCCL_DEBUG)."""

    def env_after(self, **given):
        keys = ("NCCL_DEBUG", "NCCL_DEBUG_SUBSYS", "NCCL_DEBUG_FILE")
        with unittest.mock.patch.dict(os.environ, {k: v for k, v in given.items()}, clear=False):
            for k in keys:
                if k not in given:
                    os.environ.pop(k, None)
            pattern = smoke.nccl_debug_to_file()
            return pattern, {k: os.environ.get(k) for k in keys}

    def test_the_callers_nccl_debug_still_gets_a_file_read_back(self):
        pattern, env = self.env_after(NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="INIT,NET")
        self.assertEqual((env["NCCL_DEBUG"], env["NCCL_DEBUG_SUBSYS"]), ("INFO", "INIT,NET"))
        self.assertTrue(env["NCCL_DEBUG_FILE"].endswith("nccl.%h.%p.log"), env)
        self.assertEqual(pattern, env["NCCL_DEBUG_FILE"].replace("%h", "*").replace("%p", str(os.getpid())))

    def test_too_little_is_raised_and_the_callers_file_is_used(self):
        pattern, env = self.env_after(NCCL_DEBUG="WARN", NCCL_DEBUG_SUBSYS="COLL",
                                      NCCL_DEBUG_FILE="/scratch/me/nccl-%h-%p.txt")
        self.assertEqual(env, {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "COLL,INIT,NET",
                               "NCCL_DEBUG_FILE": "/scratch/me/nccl-%h-%p.txt"})
        self.assertEqual(pattern, f"/scratch/me/nccl-*-{os.getpid()}.txt")
        _, env = self.env_after()
        self.assertEqual((env["NCCL_DEBUG"], env["NCCL_DEBUG_SUBSYS"]), ("INFO", "INIT,NET"))
        _, env = self.env_after(NCCL_DEBUG="TRACE", NCCL_DEBUG_SUBSYS="ALL")
        self.assertEqual((env["NCCL_DEBUG"], env["NCCL_DEBUG_SUBSYS"]), ("TRACE", "ALL"))


if __name__ == "__main__":
    sys.exit("run with: .venv/bin/python tests/run.py test_smoke")
