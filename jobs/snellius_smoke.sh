#!/bin/bash
# jobs/snellius_smoke.sh - Snellius, smoke.
# infrastructure self-test: one distinct GPU per rank, a numerically exact all-reduce,
# plausible collective bandwidth (and, with --diloco-replicas K, the DiLoCo groups; first
# of all, each group's first all-reduce under a timeout, --first-collective-timeout-s).
#
# Submit from the checkout (logs/ must exist: `source env.sh && pww_setup_dirs` once):
#   sbatch jobs/snellius_smoke.sh
#   sbatch jobs/snellius_smoke.sh --diloco-replicas 2       # before any DiLoCo job
# Flags after the script name go to the Python entry point; the last one given wins.
# Override any header on the command line (sbatch -p ... --time ...), and any default
# below from the environment (VAR=value sbatch ...). Log: logs/snellius_smoke-<jobid>.out
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
# shellcheck source=env.sh
source "$PWW_ROOT/env.sh"
cd "$PWW_ROOT"
pww_rendezvous
echo "$(date -Is) job $SLURM_JOB_ID on $SLURM_JOB_NODELIST: site $PWW_SITE, $SLURM_NTASKS ranks, rendezvous $MASTER_ADDR:$MASTER_PORT"
# --kill-on-bad-exit: a rank whose first collective timed out exits 1 (smoke.py's first
# row); the others, still waiting in theirs, are ended with it instead of holding the nodes
srun --kill-on-bad-exit=1 --cpu-bind="$(pww_cpu_bind)" --distribution=block:block jobs/task_wrapper.sh python smoke.py --device "$PWW_DEVICE" "$@"
