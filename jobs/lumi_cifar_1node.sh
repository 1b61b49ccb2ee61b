#!/bin/bash
# jobs/lumi_cifar_1node.sh - LUMI-G, cifar_1node.
# ResNet/CIFAR-10 data parallel (DDP; --parallel fsdp for the LLM path) on one node.
#
# Submit from the checkout (logs/ must exist: `source env.sh && pww_setup_dirs` once):
#   sbatch jobs/lumi_cifar_1node.sh --config configs/cifar10_resnet18.yaml
#   sbatch jobs/lumi_cifar_1node.sh --parallel fsdp --dtype bf16
#   sbatch jobs/lumi_cifar_1node.sh --resume auto
# Flags after the script name go to the Python entry point; the last one given wins.
# Override any header on the command line (sbatch -p ... --time ...), and any default
# below from the environment (VAR=value sbatch ...). Log: logs/lumi_cifar_1node-<jobid>.out
#SBATCH --job-name=lumi_cifar_1node
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
