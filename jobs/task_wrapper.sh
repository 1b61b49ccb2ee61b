#!/usr/bin/env bash
# jobs/task_wrapper.sh - the per-rank entry of every job: site-agnostic, one per srun task.
#
#   srun --cpu-bind="$(pww_cpu_bind)" jobs/task_wrapper.sh python train.py ARGS...
#
# Runs on: compute nodes, once per task (= per GPU). Needs the environment exported by
# env.sh in the batch script (srun passes it on). In order, it:
#   1. sets RANK / LOCAL_RANK / WORLD_SIZE / LOCAL_WORLD_SIZE from SLURM_* (kept if set),
#   2. pins this rank to one GPU through the site's $PWW_PIN_VAR: the LOCAL_RANK-th entry
#      of the list Slurm handed the job (or LOCAL_RANK itself when there is no list), so
#      each process sees exactly one GPU, as device 0,
#   3. gives each rank its own MIOpen cache when the site asks for one (LUMI: MIOpen's
#      SQLite files are not multi-process safe; concurrent ranks die on SQLite errors):
#      a persistent per-user directory, PWW_MIOPEN_CACHE_ROOT/rank<r>/slot<n>, locked
#      while the rank runs (the next job starts warm), or PWW_MIOPEN_CACHE_TEMPLATE,
#   4. prints one line per rank (host, GPU, CPU affinity), then execs CMD inside the
#      site's container or venv (pww_run); while it holds a MIOpen slot's lock it runs
#      CMD as its child instead and exits with CMD's status.
set -euo pipefail

die() { echo "task_wrapper: $*" >&2; exit 2; }
[ $# -gt 0 ] || die "usage: task_wrapper.sh CMD [ARGS...]"

export RANK=${RANK:-${SLURM_PROCID:?task_wrapper.sh runs under srun (SLURM_PROCID unset)}}
export LOCAL_RANK=${LOCAL_RANK:-${SLURM_LOCALID:-0}}
export WORLD_SIZE=${WORLD_SIZE:-${SLURM_NTASKS:-1}}
tasks_here=${SLURM_NTASKS_PER_NODE:-${SLURM_STEP_TASKS_PER_NODE:-1}}
export LOCAL_WORLD_SIZE=${LOCAL_WORLD_SIZE:-${tasks_here%%[!0-9]*}}

PWW_ROOT=${PWW_ROOT:-${SLURM_SUBMIT_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}}
# shellcheck source=env.sh
source "$PWW_ROOT/env.sh"

gpu="-"
if [ -n "${PWW_PIN_VAR:-}" ]; then
    visible=${!PWW_PIN_VAR:-}
    if [ -n "$visible" ]; then
        IFS=, read -r -a devices <<< "$visible"
        [ "$LOCAL_RANK" -lt "${#devices[@]}" ] || die "local rank $LOCAL_RANK but $PWW_PIN_VAR=$visible lists only ${#devices[@]} GPUs; ask for one GPU per task (--gpus-per-node = --ntasks-per-node)"
        gpu=${devices[$LOCAL_RANK]}
    else
        gpu=$LOCAL_RANK
    fi
    export "$PWW_PIN_VAR=$gpu"
fi

# miopen_slot ROOT: sets cache to the first ROOT/rank<local rank>/slot<n> whose lock no
# live process holds, the lock on file descriptor 9 of this shell (hence no $(...)
# subshell around the call). Returns 1 when all 64 slots are busy or the file system
# refuses locks.
miopen_slot() {
    local base="$1/rank$LOCAL_RANK" slot rc
    for slot in $(seq 0 63); do
        mkdir -p "$base/slot$slot" 2>/dev/null || return 1
        exec 9>"$base/slot$slot/.lock" || return 1
        rc=0
        flock -n -E 75 9 || rc=$?
        if [ "$rc" = 0 ]; then
            cache="$base/slot$slot"
            return 0
        fi
        exec 9>&-
        [ "$rc" = 75 ] || return 1      # not "held by another rank": locking is unsupported
    done
    return 1
}

cache="" holds_lock=0
if [ -n "${PWW_MIOPEN_CACHE_TEMPLATE:-}" ]; then             # an explicit directory per job and rank
    cache=${PWW_MIOPEN_CACHE_TEMPLATE//\{job\}/${SLURM_JOB_ID:-nojob}}
    cache=${cache//\{rank\}/$LOCAL_RANK}
elif [ -n "${PWW_MIOPEN_CACHE_ROOT:-}" ]; then                # persistent, one free slot per rank
    if miopen_slot "$PWW_MIOPEN_CACHE_ROOT"; then
        holds_lock=1
    else
        cache="/tmp/${USER:-$(id -un)}-miopen-${SLURM_JOB_ID:-nojob}-$LOCAL_RANK"
        echo "task_wrapper: no lockable slot under $PWW_MIOPEN_CACHE_ROOT (no free slot, or file locks unsupported there); MIOpen cache in $cache for this job only" >&2
    fi
fi
if [ -n "$cache" ]; then
    mkdir -p "$cache"
    export MIOPEN_USER_DB_PATH=$cache MIOPEN_CUSTOM_CACHE_DIR=$cache
fi

affinity=$(taskset -cp $$ 2>/dev/null | sed 's/.*: //' || echo "?")
echo "task_wrapper: rank $RANK/$WORLD_SIZE local $LOCAL_RANK on $(hostname -s) site $PWW_SITE ${PWW_PIN_VAR:-gpu}=$gpu cpus $affinity"

pww_runtime_cmd "$@"
if [ "$holds_lock" = 1 ]; then
    # this shell keeps the slot's lock for exactly the command's lifetime: an exec'd
    # container runtime may close inherited descriptors, and with them the lock
    "${PWW_CMD[@]}" 9>&-
    exit 0                  # set -e: a failing command has already exited with its status
fi
exec "${PWW_CMD[@]}"
