#!/bin/bash
# jobs/snellius_cifar_debug.sh - Snellius, cifar_debug.
# ResNet/CIFAR-10 on ONE GPU: the "does this change run at all" job; a
# 1-GPU share starts in seconds when whole nodes queue for an hour.
#
# Submit from the checkout (logs/ must exist: `sites/bootstrap.sh` once):
#   sbatch jobs/snellius_cifar_debug.sh
#   sbatch jobs/snellius_cifar_debug.sh --epochs 1 --dtype bf16
# Flags after the script name go to the Python entry point; the last one given wins.
# Override any header on the command line (sbatch -p ... --time ...), and any default
# (jobs/common.sh lists them) from the environment (VAR=value sbatch ...).
# Log: logs/snellius_cifar_debug-<jobid>.out
#SBATCH --job-name=snellius_cifar_debug
#SBATCH --partition=gpu_h100
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=1
#SBATCH --cpus-per-task=16
#SBATCH --time=00:30:00
#SBATCH --output=logs/%x-%j.out
set -euo pipefail
PWW_ROOT=${PWW_ROOT:-${SLURM_SUBMIT_DIR:-$PWD}}
# shellcheck source=jobs/common.sh
source "$PWW_ROOT/jobs/common.sh"         # env.sh and the pww_job_* functions
pww_job_cifar --distribution=block:block -- "$@"
