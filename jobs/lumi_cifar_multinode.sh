#!/bin/bash
# jobs/lumi_cifar_multinode.sh - LUMI-G, cifar_multinode.
# ResNet/CIFAR-10 data parallel across nodes (default 2; sbatch --nodes=N).
#
# Submit from the checkout (logs/ must exist: `sites/bootstrap.sh` once):
#   sbatch --nodes=4 jobs/lumi_cifar_multinode.sh
# Flags after the script name go to the Python entry point; the last one given wins.
# Override any header on the command line (sbatch -p ... --time ...), and any default
# (jobs/common.sh lists them) from the environment (VAR=value sbatch ...).
# Log: logs/lumi_cifar_multinode-<jobid>.out
#SBATCH --job-name=lumi_cifar_multinode
#SBATCH --partition=standard-g
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=7
#SBATCH --mem=0
#SBATCH --time=01:00:00
#SBATCH --output=logs/%x-%j.out
set -euo pipefail
PWW_ROOT=${PWW_ROOT:-${SLURM_SUBMIT_DIR:-$PWD}}
# shellcheck source=jobs/common.sh
source "$PWW_ROOT/jobs/common.sh"         # env.sh and the pww_job_* functions
pww_job_cifar -- "$@"
