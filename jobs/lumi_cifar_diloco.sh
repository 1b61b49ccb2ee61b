#!/bin/bash
# jobs/lumi_cifar_diloco.sh - LUMI-G, cifar_diloco.
# ResNet/CIFAR-10 with DiLoCo inside one allocation: REPLICAS contiguous rank
# blocks, an outer step every INNER_STEPS steps (REPLICAS must divide the rank count).
#
# Submit from the checkout (logs/ must exist: `source env.sh && pww_setup_dirs` once):
#   sbatch jobs/lumi_cifar_diloco.sh
#   REPLICAS=4 INNER_STEPS=25 sbatch jobs/lumi_cifar_diloco.sh --diloco-outer-optimizer sgd --diloco-outer-lr 1.0 --diloco-outer-momentum 0
# Flags after the script name go to the Python entry point; the last one given wins.
# Override any header on the command line (sbatch -p ... --time ...), and any default
# below from the environment (VAR=value sbatch ...). Log: logs/lumi_cifar_diloco-<jobid>.out
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
# shellcheck source=env.sh
source "$PWW_ROOT/env.sh"
cd "$PWW_ROOT"
pww_rendezvous
echo "$(date -Is) job $SLURM_JOB_ID on $SLURM_JOB_NODELIST: site $PWW_SITE, $SLURM_NTASKS ranks, rendezvous $MASTER_ADDR:$MASTER_PORT"
CONFIG=${CONFIG:-configs/cifar10_resnet18.yaml}
DATA=${DATA:-$PWW_DATA/cifar-10-batches-py}
read -r -a site_args <<< "${PWW_CIFAR_ARGS:-}"    # sites/local.sh: the tiny CPU config
REPLICAS=${REPLICAS:-2}
INNER_STEPS=${INNER_STEPS:-100}
srun --cpu-bind="$(pww_cpu_bind)" jobs/task_wrapper.sh python train.py --device "$PWW_DEVICE" --config "$CONFIG" --data "$DATA" \
    --runs-dir "$PWW_RUNS" --diloco-replicas "$REPLICAS" --diloco-inner-steps "$INNER_STEPS" "${site_args[@]}" "$@"
