#!/bin/bash
# jobs/lumi_titan.sh - LUMI-G, titan.
# the LLM federation site job: torchtitan Qwen3 inner loop, leases from DARL, deltas
# to the central FedMom aggregator every H steps. Queue it whenever: the server waits.
#
# Submit from the checkout (logs/ must exist: `sites/bootstrap.sh` once):
#   sbatch jobs/lumi_titan.sh
#   REPLICA=b sbatch jobs/lumi_titan.sh                 # a second concurrent job at this site
# Flags after the script name go to the Python entry point; the last one given wins.
# Override any header on the command line (sbatch -p ... --time ...), and any default
# (jobs/common.sh lists them) from the environment (VAR=value sbatch ...).
# Log: logs/lumi_titan-<jobid>.out
#SBATCH --job-name=lumi_titan
#SBATCH --partition=standard-g
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=7
#SBATCH --mem=0
#SBATCH --time=12:00:00
#SBATCH --output=logs/%x-%j.out
set -euo pipefail
PWW_ROOT=${PWW_ROOT:-${SLURM_SUBMIT_DIR:-$PWD}}
# shellcheck source=jobs/common.sh
source "$PWW_ROOT/jobs/common.sh"         # env.sh and the pww_job_* functions
pww_job_titan lumi -- "$@"
