"""tests/test_gpu_check.py - bench/gpu_check.sh, run as on a lent GPU but tiny and on the CPU.

GPU_CHECK_DEVICE=cpu GPU_CHECK_QUICK=1 takes every step of the script (preflight, smoke,
staging, DiLoCo on the host, wire_torch and the carrier's device encode and apply, whole
tensors and FSDP2 shards, the ResNet and Qwen3 runs, the DCP resume, --compile, both
gradient-accumulation modes) with CPU-sized models, so the script's plumbing, summaries
and failure handling are tested here; its GPU figures come only from a GPU.
Run: .venv/bin/python tests/run.py test_gpu_check
"""
import os
import re
import subprocess
import sys
import tempfile
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = ("resnet-bf16", "resnet-fp16", "resnet-fsdp", "qwen-fsdp", "qwen-resume", "qwen-compile",
        "qwen-accum", "qwen-defer")


def gpu_check(**env):
    full = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "MASTER_"))}
    full.update(GPU_CHECK_DEVICE="cpu", GPU_CHECK_QUICK="1", PYTHON=sys.executable, OMP_NUM_THREADS="1", **env)
    return subprocess.run(["bash", "bench/gpu_check.sh"], cwd=ROOT, env=full, capture_output=True, text=True,
                          timeout=1200)


class GpuCheckTest(unittest.TestCase):
    def test_every_run_reports_its_figures_and_the_check_passes(self):
        with tempfile.TemporaryDirectory() as out:
            r = gpu_check(GPU_CHECK_OUT=out)
            self.assertEqual(r.returncode, 0, r.stdout[-3000:] + r.stderr[-3000:])
            self.assertTrue(os.path.isfile(os.path.join(out, "runs", "qwen-fsdp", "metrics.jsonl")))
        self.assertIn("GPU CHECK PASSED", r.stdout)
        for name in RUNS:
            self.assertRegex(r.stdout, rf"{name}\s+steps\s+\d+\s+step\s+[\d.]+ ms\s+(tokens|img)/s\s+[\d.]+\s+"
                                       rf"mfu\s+\S+\s+peak\s+[\d.]+ GiB", name)
        self.assertRegex(r.stdout, r"qwen-resume\s+steps\s+8 ")           # continued 4 -> 8
        self.assertRegex(r.stdout, r"attention kernel\s+PASS")
        self.assertIn("16 batches staged", r.stdout)
        self.assertRegex(r.stdout, r"\d+ tensors: encode and apply on cpu == wire.py \(numpy\) bit for bit")
        self.assertIn("6 int4 rounds with error feedback encoded on cpu, replicated and FSDP2-sharded (wire_torch, "
                      "shard_wire): delta and residual == the host path's (numpy), bit for bit; the int4 update "
                      "added on cpu == wire.apply_update's digest", r.stdout)
        self.assertIn("== theta on the device", r.stdout)

    def test_shellcheck_clean(self):
        sc = os.path.join(ROOT, ".venv", "bin", "shellcheck")
        r = subprocess.run([sc, "-x", "bench/gpu_check.sh"], cwd=ROOT, capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stdout)

    def test_a_failing_run_stops_the_check_loudly(self):
        r = gpu_check(GPU_CHECK_EXTRA_TRAIN_ARGS="--no-such-flag")
        self.assertEqual(r.returncode, 1)
        self.assertIn("GPU CHECK FAILED: resnet-bf16 (exit 2)", r.stderr)
        self.assertIn("unrecognized arguments: --no-such-flag", r.stderr)     # the run's own log tail
        self.assertNotIn("GPU CHECK PASSED", r.stdout)
        self.assertFalse(re.search(r"resnet-fp16\s+steps", r.stdout), "it went on after the failure")


if __name__ == "__main__":
    unittest.main()
