#!/usr/bin/env bash
# jobs/snellius_setup_venv.sh - build the Snellius Python environment, ONCE, on a login node.
#
#   jobs/snellius_setup_venv.sh                       # -> $HOME/venvs/pww-snellius (~6 GB)
#   PWW_VENV=/projects/0/myproj/venvs/pww jobs/snellius_setup_venv.sh
#
# Why a venv: Snellius has no maintained AI container, and its module tree's PyTorch
# (2.1.2, 2023 tree) predates device_mesh, DCP's state_dict API and FSDP2. The pip wheels
# bundle their own CUDA runtime, so nothing depends on the EasyBuild CUDA version.
# Where: $HOME, not /scratch-shared (purged after ~14 days on file age).
# Every version is pinned: torch, torchtitan and triton to the versions the CPU test
# suite runs with (requirements.txt; tests/test_pins.py keeps them equal), so CI's
# import of torchtitan is the import this venv will do. LUMI runs an older torch (the
# newest ROCm build its GPU driver supports, containers/lumi-titan.def): the tensors the
# two sites exchange are plain fp32/bf16 arrays, the same under either version.
# Re-running with an existing venv only re-checks and reinstalls the pins.
set -euo pipefail

PWW_VENV=${PWW_VENV:-$HOME/venvs/pww-snellius}
MODULES=${SNELLIUS_MODULES:-2024 Python/3.12.3-GCCcore-13.3.0}

if type module >/dev/null 2>&1; then
    # shellcheck disable=SC2086  # the module list is meant to split
    module load $MODULES
fi
PYTHON=${PYTHON:-python3}
"$PYTHON" -c 'import sys; assert sys.version_info >= (3, 10), sys.version' \
    || { echo "snellius_setup_venv: need Python >= 3.10 (module load $MODULES, or set PYTHON)" >&2; exit 1; }

[ -x "$PWW_VENV/bin/python" ] || "$PYTHON" -m venv "$PWW_VENV"
PIP=("$PWW_VENV/bin/pip" install --no-cache-dir --disable-pip-version-check)
"${PIP[@]}" pip==25.2 setuptools==80.9.0 wheel==0.45.1
# torch 2.13.0, CUDA 12.6 build, from PyTorch's own index. Why cu126 and not the cu130
# build: CUDA 12.x wheels run on every NVIDIA driver from R525 on (CUDA minor-version
# compatibility), CUDA 13.0 wheels need R580 or newer; both carry native kernels for
# A100 (sm_80) and H100 (sm_90), so cu126 runs on gpu_a100 and gpu_h100 whatever driver
# their nodes have. triton 3.7.1 is the Triton torch 2.13.0 requires (it would refuse
# another); the index also serves the nvidia-* runtime wheels torch pins exactly.
"${PIP[@]}" --index-url https://download.pytorch.org/whl/cu126 torch==2.13.0+cu126 triton==3.7.1
# torchtitan and what it imports, at the versions the CPU test suite runs with
"${PIP[@]}" torchtitan==0.2.2 torchdata==0.11.0 datasets==5.2.0 tokenizers==0.23.3 \
    tomli==2.5.0 fsspec==2026.9.0 tyro==1.0.17 tensorboard==2.21.0 einops==0.8.2 \
    pillow==13.0.0 numpy==2.4.6 pyyaml==6.0.4 safetensors==0.8.0
"$PWW_VENV/bin/pip" freeze > "$PWW_VENV/pww-freeze.txt"
"$PWW_VENV/bin/python" -c "import torch, torchtitan, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'torchtitan ok')"
# The driver check, where a driver answers: on a login node nvidia-smi may be missing, or
# present and failing (no GPU, no driver loaded); that must not end the script, after a
# full install, without a word (set -e -o pipefail would).
driver=""
if command -v nvidia-smi >/dev/null 2>&1; then
    driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n 1) || driver=""
fi
if [[ "$driver" =~ ^[0-9]+\. ]]; then            # a GPU node: the driver must run CUDA 12.6
    [ "${driver%%.*}" -ge 525 ] || { echo "snellius_setup_venv: NVIDIA driver $driver is older than R525; the cu126 build needs >= 525.60.13" >&2; exit 1; }
    echo "driver $driver: runs the CUDA 12.6 build"
else
    echo "driver: not checked here (no NVIDIA driver answered: a login node?); the smoke job checks the GPUs"
fi
echo "venv ready: $PWW_VENV (frozen list in $PWW_VENV/pww-freeze.txt)"
echo "next: sites/bootstrap.sh && sbatch jobs/snellius_smoke.sh"
