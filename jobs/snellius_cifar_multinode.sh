#!/bin/bash
# jobs/snellius_cifar_multinode.sh - Snellius, cifar_multinode.
# ResNet/CIFAR-10 data parallel across nodes (default 2; sbatch --nodes=N).
#
# Submit from the checkout (logs/ must exist: `sites/bootstrap.sh` once):
#   sbatch --nodes=4 jobs/snellius_cifar_multinode.sh
# Flags after the script name go to the Python entry point; the last one given wins.
# Override any header on the command line (sbatch -p ... --time ...), and any default
# (jobs/common.sh lists them) from the environment (VAR=value sbatch ...).
# Log: logs/snellius_cifar_multinode-<jobid>.out
#SBATCH --job-name=snellius_cifar_multinode
#SBATCH --partition=gpu_h100
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=4
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=16
#SBATCH --time=01:00:00
#SBATCH --output=logs/%x-%j.out
set -euo pipefail
PWW_ROOT=${PWW_ROOT:-${SLURM_SUBMIT_DIR:-$PWD}}
# shellcheck source=jobs/common.sh
source "$PWW_ROOT/jobs/common.sh"         # env.sh and the pww_job_* functions
pww_job_cifar --distribution=block:block -- "$@"
