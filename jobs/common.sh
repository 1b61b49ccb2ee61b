# shellcheck shell=bash
# jobs/common.sh - what every batch job does after its #SBATCH header, said once. Sourced
# by jobs/{lumi,snellius}_{smoke,cifar_*,titan}.sh right after `set -euo pipefail` and
# PWW_ROOT (the checkout: Slurm runs a copy of the script from its spool, so the script
# cannot find the checkout from its own path; it is the submit directory):
#
#   source "$PWW_ROOT/jobs/common.sh"
#   pww_job_cifar [SRUN_OPTION...] -- "$@"
#
# Sourcing it sources env.sh (the site, PWW_*, pww_cpu_bind). Each pww_job_* then cds to
# the checkout, sets MASTER_ADDR/MASTER_PORT (pww_rendezvous), prints the job's first log
# line, and launches one jobs/task_wrapper.sh per rank with srun:
#
#   srun [--kill-on-bad-exit=1] --cpu-bind=$(pww_cpu_bind) [SRUN_OPTION...] \
#        jobs/task_wrapper.sh python ENTRY --device $PWW_DEVICE ... [FLAG...]
#
# SRUN_OPTION: what the job script adds to srun (Snellius: --distribution=block:block);
# FLAG: the script's own arguments, after the `--`, last, so that the last one given wins.
# The #SBATCH header stays in each script (sbatch reads it there, not from a sourced file).
#
# Why a file of its own and not more functions in env.sh: env.sh is sourced by every shell
# (interactive ones, prep/*.sh, task_wrapper.sh once per rank); these functions make sense
# only in a batch script, which they leave (cd) and end (srun's status is the job's).
#
# The defaults each reads (VAR=value sbatch ... overrides them):
#   every train.py job: PWW_DEVICE, PWW_RUNS (env.sh / sites/<site>.sh)
#   pww_job_cifar, pww_job_cifar_diloco: CONFIG (configs/cifar10_resnet18.yaml),
#     DATA ($PWW_DATA/cifar-10-batches-py), PWW_CIFAR_ARGS (sites/local.sh: a tiny config);
#     pww_job_cifar_diloco also REPLICAS (2) and INNER_STEPS (100)
#   pww_job_titan: CONFIG ($PWW_TITAN_CONFIG, else configs/qwen3_0.6B.yaml), DATA
#     ($PWW_DATA/c4-tokens/manifest.json), CLUSTER (its first argument), REPLICA, PWW_TITAN_ARGS,
#     and the central services' URLs and token (pww_central_env: central.env)

# shellcheck source=env.sh
source "$PWW_ROOT/env.sh"

# _pww_job_split [SRUN_OPTION...] -- [FLAG...]: sets the arrays job_srun and job_flags.
_pww_job_split() {
    job_srun=()
    while [ $# -gt 0 ] && [ "$1" != -- ]; do
        job_srun+=("$1")
        shift
    done
    if [ $# -eq 0 ]; then
        echo "jobs/common.sh: pww_job_* needs a '--' before the job's own flags (${job_srun[*]})" >&2
        exit 2
    fi
    shift
    job_flags=("$@")
}

# _pww_job_start: the checkout as working directory, the rendezvous, the first log line.
_pww_job_start() {
    cd "$PWW_ROOT" || exit
    pww_rendezvous
    echo "$(date -Is) job $SLURM_JOB_ID on $SLURM_JOB_NODELIST: site $PWW_SITE, $SLURM_NTASKS ranks, rendezvous $MASTER_ADDR:$MASTER_PORT"
}

# _pww_job_srun [SRUN_OPTION...] -- ENTRY [ARG...]: one task_wrapper.sh per rank; the job
# script's srun options (job_srun) after these.
_pww_job_srun() {
    local opts=()
    while [ "$1" != -- ]; do
        opts+=("$1")
        shift
    done
    shift
    srun "${opts[@]}" --cpu-bind="$(pww_cpu_bind)" "${job_srun[@]}" jobs/task_wrapper.sh python "$@"
}

# pww_job_smoke [SRUN_OPTION...] -- [FLAG...]: smoke.py. --kill-on-bad-exit: a rank whose
# first collective timed out exits 1 (smoke.py's first row); the others, still waiting in
# theirs, are ended with it instead of holding the nodes.
pww_job_smoke() {
    _pww_job_split "$@"
    _pww_job_start
    _pww_job_srun --kill-on-bad-exit=1 -- smoke.py --device "$PWW_DEVICE" "${job_flags[@]}"
}

# _pww_job_cifar_train [TRAIN_FLAG...]: train.py on CIFAR-10 with the job's data and config;
# TRAIN_FLAG before the site's (PWW_CIFAR_ARGS) and the script's own.
_pww_job_cifar_train() {
    CONFIG=${CONFIG:-configs/cifar10_resnet18.yaml}
    DATA=${DATA:-$PWW_DATA/cifar-10-batches-py}
    read -r -a site_args <<< "${PWW_CIFAR_ARGS:-}"    # sites/local.sh: the tiny CPU config
    _pww_job_srun -- train.py --device "$PWW_DEVICE" --config "$CONFIG" --data "$DATA" \
        --runs-dir "$PWW_RUNS" "$@" "${site_args[@]}" "${job_flags[@]}"
}

# pww_job_cifar [SRUN_OPTION...] -- [FLAG...]: train.py on CIFAR-10, one data-parallel model.
pww_job_cifar() {
    _pww_job_split "$@"
    _pww_job_start
    _pww_job_cifar_train
}

# pww_job_cifar_diloco [SRUN_OPTION...] -- [FLAG...]: the same with DiLoCo inside the
# allocation: REPLICAS contiguous rank blocks, an outer step every INNER_STEPS steps.
pww_job_cifar_diloco() {
    _pww_job_split "$@"
    _pww_job_start
    REPLICAS=${REPLICAS:-2}
    INNER_STEPS=${INNER_STEPS:-100}
    _pww_job_cifar_train --diloco-replicas "$REPLICAS" --diloco-inner-steps "$INNER_STEPS"
}

# pww_job_titan CLUSTER [SRUN_OPTION...] -- [FLAG...]: the LLM federation site job, as
# cluster id $CLUSTER (default: the first argument; the logical stream, stable across
# requeues; a second concurrent job at a site needs REPLICA=b).
pww_job_titan() {
    local cluster=$1
    shift
    _pww_job_split "$@"
    _pww_job_start
    pww_central_env      # the central VM's URLs and token (central.env), or a clear stop
    CONFIG=${CONFIG:-${PWW_TITAN_CONFIG:-configs/qwen3_0.6B.yaml}}
    DATA=${DATA:-$PWW_DATA/c4-tokens/manifest.json}
    CLUSTER=${CLUSTER:-$cluster}
    replica_args=()
    [ -n "${REPLICA:-}" ] && replica_args=(--replica "$REPLICA")
    read -r -a site_args <<< "${PWW_TITAN_ARGS:-}"    # sites/local.sh: the tiny CPU config
    _pww_job_srun -- train.py --device "$PWW_DEVICE" --config "$CONFIG" --data "$DATA" --runs-dir "$PWW_RUNS" \
        --federation "$PWW_FEDMOM_URL" --darl-url "$PWW_DARL_URL" --blob-url "$PWW_BLOB_URL" \
        --token-file "$PWW_TOKEN_FILE" --site "$CLUSTER" "${replica_args[@]}" "${site_args[@]}" "${job_flags[@]}"
}
