#!/bin/bash
# jobs/snellius_smoke.sh - Snellius, smoke.
# infrastructure self-test: one distinct GPU per rank, a numerically exact all-reduce,
# plausible collective bandwidth (and, with --diloco-replicas K, the DiLoCo groups; first
# of all, each group's first all-reduce under a timeout, --first-collective-timeout-s).
#
# Submit from the checkout (logs/ must exist: `sites/bootstrap.sh` once):
#   sbatch jobs/snellius_smoke.sh
#   sbatch jobs/snellius_smoke.sh --diloco-replicas 2       # before any DiLoCo job
# Flags after the script name go to the Python entry point; the last one given wins.
# Override any header on the command line (sbatch -p ... --time ...), and any default
# (jobs/common.sh lists them) from the environment (VAR=value sbatch ...).
# Log: logs/snellius_smoke-<jobid>.out
#SBATCH --job-name=snellius_smoke
#SBATCH --partition=gpu_h100
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=4
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=16
#SBATCH --time=00:15:00
#SBATCH --output=logs/%x-%j.out
set -euo pipefail
PWW_ROOT=${PWW_ROOT:-${SLURM_SUBMIT_DIR:-$PWD}}
# shellcheck source=jobs/common.sh
source "$PWW_ROOT/jobs/common.sh"         # env.sh and the pww_job_* functions
pww_job_smoke --distribution=block:block -- "$@"
