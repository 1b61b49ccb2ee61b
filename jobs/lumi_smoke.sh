#!/bin/bash
# jobs/lumi_smoke.sh - LUMI-G, smoke.
# infrastructure self-test: one distinct GPU per rank, a numerically exact all-reduce,
# plausible collective bandwidth (and, with --diloco-replicas K, the DiLoCo groups; first
# of all, each group's first all-reduce under a timeout, --first-collective-timeout-s).
#
# Submit from the checkout (logs/ must exist: `source env.sh && pww_setup_dirs` once):
#   sbatch jobs/lumi_smoke.sh
#   sbatch jobs/lumi_smoke.sh --diloco-replicas 2       # before any DiLoCo job
# Flags after the script name go to the Python entry point; the last one given wins.
# Override any header on the command line (sbatch -p ... --time ...), and any default
# below from the environment (VAR=value sbatch ...). Log: logs/lumi_smoke-<jobid>.out
#SBATCH --job-name=lumi_smoke
#SBATCH --partition=dev-g
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=7
#SBATCH --mem=0
#SBATCH --time=00:15:00
#SBATCH --output=logs/%x-%j.out
set -euo pipefail
PWW_ROOT=${PWW_ROOT:-${SLURM_SUBMIT_DIR:-$PWD}}
# shellcheck source=env.sh
source "$PWW_ROOT/env.sh"
cd "$PWW_ROOT"
pww_rendezvous
echo "$(date -Is) job $SLURM_JOB_ID on $SLURM_JOB_NODELIST: site $PWW_SITE, $SLURM_NTASKS ranks, rendezvous $MASTER_ADDR:$MASTER_PORT"
# --kill-on-bad-exit: a rank whose first collective timed out exits 1 (smoke.py's first
# row); the others, still waiting in theirs, are ended with it instead of holding the nodes
srun --kill-on-bad-exit=1 --cpu-bind="$(pww_cpu_bind)" jobs/task_wrapper.sh python smoke.py --device "$PWW_DEVICE" "$@"
