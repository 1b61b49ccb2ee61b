#!/bin/bash
# jobs/snellius_titan.sh - Snellius, titan.
# the LLM federation site job: torchtitan Qwen3 inner loop, leases from DARL, deltas
# to the central FedMom aggregator every H steps. Queue it whenever: the server waits.
#
# Submit from the checkout (logs/ must exist: `source env.sh && pww_setup_dirs` once):
#   sbatch jobs/snellius_titan.sh
#   REPLICA=b sbatch jobs/snellius_titan.sh                 # a second concurrent job at this site
# Flags after the script name go to the Python entry point; the last one given wins.
# Override any header on the command line (sbatch -p ... --time ...), and any default
# below from the environment (VAR=value sbatch ...). Log: logs/snellius_titan-<jobid>.out
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
# shellcheck source=env.sh
source "$PWW_ROOT/env.sh"
cd "$PWW_ROOT"
pww_rendezvous
echo "$(date -Is) job $SLURM_JOB_ID on $SLURM_JOB_NODELIST: site $PWW_SITE, $SLURM_NTASKS ranks, rendezvous $MASTER_ADDR:$MASTER_PORT"
pww_central_env      # the central VM's URLs and token (central.env), or a clear stop
CONFIG=${CONFIG:-${PWW_TITAN_CONFIG:-configs/qwen3_0.6B.yaml}}
DATA=${DATA:-$PWW_DATA/c4-tokens/manifest.json}
# the logical stream: stable across requeues; a second job here needs REPLICA=b
CLUSTER=${CLUSTER:-snellius}
replica_args=()
[ -n "${REPLICA:-}" ] && replica_args=(--replica "$REPLICA")
read -r -a site_args <<< "${PWW_TITAN_ARGS:-}"    # sites/local.sh: the tiny CPU config
srun --cpu-bind="$(pww_cpu_bind)" --distribution=block:block jobs/task_wrapper.sh python train.py --device "$PWW_DEVICE" --config "$CONFIG" --data "$DATA" --runs-dir "$PWW_RUNS" \
    --federation "$PWW_FEDMOM_URL" --darl-url "$PWW_DARL_URL" --blob-url "$PWW_BLOB_URL" \
    --token-file "$PWW_TOKEN_FILE" --site "$CLUSTER" "${replica_args[@]}" "${site_args[@]}" "$@"
