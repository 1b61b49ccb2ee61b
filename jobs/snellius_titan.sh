#!/bin/bash
# jobs/snellius_titan.sh - Snellius, titan.
# the LLM federation site job: torchtitan Qwen3 inner loop, leases from DARL, deltas
# to the central FedMom aggregator every H steps. Queue it whenever: the server waits.
#
# Submit from the checkout (logs/ must exist: `sites/bootstrap.sh` once):
#   sbatch jobs/snellius_titan.sh
#   REPLICA=b sbatch jobs/snellius_titan.sh                 # a second concurrent job at this site
# Flags after the script name go to the Python entry point; the last one given wins.
# Override any header on the command line (sbatch -p ... --time ...), and any default
# (jobs/common.sh lists them) from the environment (VAR=value sbatch ...).
# Log: logs/snellius_titan-<jobid>.out
#SBATCH --job-name=snellius_titan
#SBATCH --partition=gpu_h100
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=4
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=16
#SBATCH --time=12:00:00
#SBATCH --output=logs/%x-%j.out
set -euo pipefail
PWW_ROOT=${PWW_ROOT:-${SLURM_SUBMIT_DIR:-$PWD}}
# shellcheck source=jobs/common.sh
source "$PWW_ROOT/jobs/common.sh"         # env.sh and the pww_job_* functions
pww_job_titan snellius --distribution=block:block -- "$@"
