#!/bin/bash
# jobs/lumi_cifar_diloco.sh - LUMI-G, cifar_diloco.
# ResNet/CIFAR-10 with DiLoCo inside one allocation: REPLICAS (default 2) contiguous
# rank blocks, an outer step every INNER_STEPS (default 100) steps (REPLICAS must divide
# the rank count).
#
# Submit from the checkout (logs/ must exist: `sites/bootstrap.sh` once):
#   sbatch jobs/lumi_cifar_diloco.sh
#   REPLICAS=4 INNER_STEPS=25 sbatch jobs/lumi_cifar_diloco.sh --diloco-outer-optimizer sgd --diloco-outer-lr 1.0 --diloco-outer-momentum 0
# Flags after the script name go to the Python entry point; the last one given wins.
# Override any header on the command line (sbatch -p ... --time ...), and any default
# (jobs/common.sh lists them) from the environment (VAR=value sbatch ...).
# Log: logs/lumi_cifar_diloco-<jobid>.out
#SBATCH --job-name=lumi_cifar_diloco
#SBATCH --partition=small-g
#SBATCH --nodes=1
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
pww_job_cifar_diloco -- "$@"
