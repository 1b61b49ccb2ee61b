"""tests/test_lumi_api.py - LUMI's torch runs our code, on CI's CPU.

The LUMI image (containers/lumi-titan.def) runs an older torch than requirements.txt's: the
newest whose ROCm build LUMI-G's driver runs (2.10.0+rocm7.0; tests/test_pins.py says why).
A pin that CI never imports is a guess, so `make test` builds a second venv,
.venv/lumi-api, from requirements-lumi-api.txt (the same torch version from PyPI, whose
CUDA build runs on a CPU and whose Python side is the ROCm build's; the same torchtitan),
and each test here runs a part of this suite under that interpreter, in a subprocess
(tests/run.py, each part well under its deadline):
  stack        torch 2.10.0, triton 3.6.0 and torchtitan 0.2.2 installed and imported
               (test_pins.InstalledStackTest against requirements-lumi-api.txt); the SDPA
               kernel plan and the profiler's kernel names (private torch APIs that move
               between releases); fp64 DiLoCo norms; tensor files against safetensors;
               checkpoints of one process (both formats; the optimizer keeps its kernel choice)
  fsdp_dcp     qwen3-tiny, FSDP2 on 2 gloo ranks under torchrun, a sharded DCP checkpoint,
               then --resume auto on 1 rank (test_train)
  distributed  smoke.py on 4 ranks with DiLoCo k=2 and k=4; FSDP2 gradient accumulation with
               and without deferred reduce-scatter; fused AdamW on DTensor shards; the
               DiLoCo outer step against torch's SGD and its state dict
  compile      torch.compile per block equals eager and renames no parameter
The venv costs ~7.5 GB and ~3 minutes once; `make demo` never builds it. Under `make test`
(which sets PWW_LUMI_API_VENV) a missing venv fails; a plain `tests/run.py` skips, naming
`make lumi-api`.
Run: make lumi-api && .venv/bin/python tests/run.py test_lumi_api
"""
import os
import re
import signal
import subprocess
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LUMI_API = "requirements-lumi-api.txt"

REQUIRED = os.environ.get("PWW_LUMI_API_VENV")
VENV = os.path.join(ROOT, REQUIRED) if REQUIRED else os.path.join(ROOT, ".venv", "lumi-api")
PYTHON = os.path.join(VENV, "bin", "python")
INNER_TIMEOUT_S = 300      # tests/run.py's watchdog, per test, inside the venv
DEADLINE_S = 540           # a part of the suite, whole: under the outer watchdog's 600 s

PARTS = {
    "stack": ["test_pins.InstalledStackTest", "test_gpu_path.AttentionPlanTest",
              "test_gpu_path.DiLoCoNormTest", "test_tensorio", "test_checkpoint.SingleProcessTest"],
    "fsdp_dcp": ["test_train.TrainRunTest.test_fsdp_qwen3_tiny_loss_falls_then_resumes_on_one_rank"],
    "distributed": ["test_smoke.SmokeTest.test_passes_on_4_cpu_ranks_with_k2_and_k4",
                    "test_gpu_path.SpawnedTest.test_fsdp_grad_accumulation_same_update_with_and_without_deferred_sync",
                    "test_gpu_path.SpawnedTest.test_gpu_optimizer_is_fused_and_steps_sharded_params_like_foreach",
                    "test_diloco.DiLoCoGlooTest.test_nesterov_matches_torch_sgd_k2",
                    "test_diloco.DiLoCoGlooTest.test_state_dict_round_trip"],
    "compile": ["test_gpu_path.SpawnedTest.test_compile_per_block_matches_eager_and_keeps_every_name"],
}
SUMMARY = re.compile(r"^(\d+) passed, (\d+) failed, (\d+) skipped$", re.M)


def lumi_torch_pin():
    """The torch of requirements-lumi-api.txt: its one `torch==VERSION` line (test_pins.py
    keeps that line equal to the LUMI image's torch)."""
    with open(os.path.join(ROOT, LUMI_API)) as f:
        return re.search(r"^torch==(\S+)\s*$", f.read(), re.M).group(1)


class LumiTorchTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        if not os.path.exists(PYTHON):
            msg = (f"{VENV} is missing: `make lumi-api` builds it (make test does, ~7.5 GB): "
                   f"the LUMI image's torch, for this module")
            if REQUIRED:
                raise AssertionError(msg)
            raise unittest.SkipTest(msg)
        got = subprocess.run([PYTHON, "-c", "import importlib.metadata as m; print(m.version('torch'))"],
                             capture_output=True, text=True, timeout=120).stdout.strip()
        want = lumi_torch_pin()
        if got.partition("+")[0] != want:
            raise AssertionError(f"{VENV} holds torch {got!r}, {LUMI_API} pins {want}: "
                                 f"`make lumi-api` reinstalls")

    def run_part(self, name):
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("SLURM_", "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_", "VIRTUAL_ENV"))}
        env.update(PWW_STACK_REQUIREMENTS=LUMI_API, PYTHONUNBUFFERED="1")
        cmd = [PYTHON, "tests/run.py", "--timeout", str(INNER_TIMEOUT_S), *PARTS[name]]
        # a session of its own: torchrun and spawned ranks go with it if the deadline passes
        p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, start_new_session=True)
        try:
            out = p.communicate(timeout=DEADLINE_S)[0]
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            out = p.communicate()[0]
            self.fail(f"{' '.join(cmd)} still running after {DEADLINE_S} s:\n{out[-6000:]}")
        found = SUMMARY.findall(out)
        self.assertTrue(found, f"no summary line from {' '.join(cmd)}:\n{out[-6000:]}")
        passed, failed, skipped = map(int, found[-1])
        self.assertEqual((failed, skipped, p.returncode), (0, 0, 0),
                         f"under torch {lumi_torch_pin()} ({VENV}):\n{out[-6000:]}")
        self.assertGreaterEqual(passed, len(PARTS[name]), out[-2000:])

    def test_stack(self):
        self.run_part("stack")

    def test_fsdp_dcp(self):
        self.run_part("fsdp_dcp")

    def test_distributed(self):
        self.run_part("distributed")

    def test_compile(self):
        self.run_part("compile")


if __name__ == "__main__":
    unittest.main()
