"""smoke.py as its users run it: torchrun subprocesses on CPU ranks over loopback."""
import os
import subprocess
import sys
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")
DEADLINE_S = 240          # generous: 4 processes importing torch on 2 loaded cores


def run_smoke(nproc, *flags):
    env = {k: v for k, v in os.environ.items()
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
        table = [l for l in out.splitlines() if l.split(" ")[0] in ("distinct", "all-reduce", "diloco")]
        self.assertEqual(len(table), 7, out)
        for line in table:
            self.assertRegex(line, r"\s+PASS\s+", out)
        self.assertIn("sum of 1..4 = 10", out)
        self.assertRegex(out, r"diloco k=2 outer step\s+PASS\s+exactly 0\.5000")
        self.assertRegex(out, r"diloco k=4 outer step\s+PASS\s+exactly 1\.5000")
        self.assertIn("inner [0, 1], outer [0, 2]", out)
        self.assertRegex(out, r"busbw \d+\.\d+ GB/s")

    def test_a_failed_check_exits_1(self):
        rc, out = run_smoke(2, "--min-busbw-gbs", "1e9", "--allreduce-mb", "1")
        self.assertEqual(rc, 1, out)
        self.assertRegex(out, r"all-reduce bandwidth\s+FAIL")
        self.assertIn("SMOKE TEST FAILED", out)
        self.assertRegex(out, r"all-reduce exact\s+PASS")

    def test_replicas_that_do_not_divide_exit_2_naming_the_flag(self):
        rc, out = run_smoke(0, "--diloco-replicas", "3")
        self.assertEqual(rc, 2, out)
        self.assertIn("--diloco-replicas 3 does not divide 1 ranks; use 1", out)


if __name__ == "__main__":
    sys.exit("run with: .venv/bin/python tests/run.py test_smoke")
