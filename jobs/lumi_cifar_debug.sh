#!/bin/bash
# jobs/lumi_cifar_debug.sh - LUMI-G, cifar_debug.
# ResNet/CIFAR-10 on ONE GCD: the "does this change run at all" job; a
# 1-GPU share starts in seconds when whole nodes queue for an hour.
#
# Submit from the checkout (logs/ must exist: `source env.sh && pww_setup_dirs` once):
#   sbatch jobs/lumi_cifar_debug.sh
#   sbatch jobs/lumi_cifar_debug.sh --epochs 1 --dtype bf16
# Flags after the script name go to the Python entry point; the last one given wins.
# Override any header on the command line (sbatch -p ... --time ...), and any default
# below from the environment (VAR=value sbatch ...). Log: logs/lumi_cifar_debug-<jobid>.out
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
# shellcheck source=env.sh
source "$PWW_ROOT/env.sh"
cd "$PWW_ROOT"
pww_rendezvous
echo "$(date -Is) job $SLURM_JOB_ID on $SLURM_JOB_NODELIST: site $PWW_SITE, $SLURM_NTASKS ranks, rendezvous $MASTER_ADDR:$MASTER_PORT"
CONFIG=${CONFIG:-configs/cifar10_resnet18.yaml}
DATA=${DATA:-$PWW_DATA/cifar-10-batches-py}
read -r -a site_args <<< "${PWW_CIFAR_ARGS:-}"    # sites/local.sh: the tiny CPU config
srun --cpu-bind="$(pww_cpu_bind)" jobs/task_wrapper.sh python train.py --device "$PWW_DEVICE" --config "$CONFIG" --data "$DATA" \
    --runs-dir "$PWW_RUNS" "${site_args[@]}" "$@"
