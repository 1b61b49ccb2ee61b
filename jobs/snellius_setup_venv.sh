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
# Every version is pinned, to the same torch as the LUMI container (containers/lumi-titan.def):
# the two sites running different torch generations would make their results incomparable.
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
# torch 2.9.1 on PyPI is the CUDA 12.8 build for Linux x86_64 (H100 and A100); it pins
# its nvidia-* runtime wheels exactly, and triton 3.5.1 is the Triton it was built with.
"${PIP[@]}" torch==2.9.1 triton==3.5.1
# torchtitan and what it imports, at the versions the CPU test suite runs with
"${PIP[@]}" torchtitan==0.2.2 torchdata==0.11.0 datasets==5.2.0 tokenizers==0.23.3 \
    tomli==2.5.0 fsspec==2026.9.0 tyro==1.0.17 tensorboard==2.21.0 einops==0.8.2 \
    pillow==13.0.0 numpy==2.4.6 pyyaml==6.0.4 safetensors==0.8.0
"$PWW_VENV/bin/pip" freeze > "$PWW_VENV/pww-freeze.txt"
"$PWW_VENV/bin/python" -c "import torch, torchtitan; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'torchtitan ok')"
echo "venv ready: $PWW_VENV (frozen list in $PWW_VENV/pww-freeze.txt)"
echo "next: source env.sh && pww_setup_dirs && sbatch jobs/snellius_smoke.sh"
