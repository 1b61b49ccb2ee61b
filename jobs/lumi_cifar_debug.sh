#!/bin/bash
# jobs/lumi_cifar_debug.sh - LUMI-G, cifar_debug.
# ResNet/CIFAR-10 on ONE GCD: the "does this change run at all" job; a
# 1-GPU share starts in seconds when whole nodes queue for an hour.
#
# Submit from the checkout (logs/ must exist: `sites/bootstrap.sh` once):
#   sbatch jobs/lumi_cifar_debug.sh
#   sbatch jobs/lumi_cifar_debug.sh --epochs 1 --dtype bf16
# Flags after the script name go to the Python entry point; the last one given wins.
# Override any header on the command line (sbatch -p ... --time ...), and any default
# (jobs/common.sh lists them) from the environment (VAR=value sbatch ...).
# Log: logs/lumi_cifar_debug-<jobid>.out
#SBATCH --job-name=lumi_cifar_debug
#SBATCH --partition=dev-g
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=1
#SBATCH --cpus-per-task=7
#SBATCH --mem-per-gpu=60G        # a 1-GCD share; --mem=0 would claim (and bill) the whole node
#SBATCH --time=00:30:00
#SBATCH --output=logs/%x-%j.out
set -euo pipefail
PWW_ROOT=${PWW_ROOT:-${SLURM_SUBMIT_DIR:-$PWD}}
# shellcheck source=jobs/common.sh
source "$PWW_ROOT/jobs/common.sh"         # env.sh and the pww_job_* functions
pww_job_cifar -- "$@"
