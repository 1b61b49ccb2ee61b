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
#      a private node-local copy of the persistent per-user cache (PWW_MIOPEN_CACHE_ROOT,
#      see "MIOpen's cache" below), or PWW_MIOPEN_CACHE_TEMPLATE used in place,
#   4. prints one line per rank (host, GPU, CPU affinity), then execs CMD inside the
#      site's container or venv (pww_run); with a private MIOpen copy it runs CMD as its
#      child instead (forwarding SIGTERM/SIGINT), then rank 0 publishes its copy, the copy
#      is removed, and it exits with CMD's status.
#
# MIOpen's cache, persistent without sharing a live file: PWW_MIOPEN_CACHE_ROOT holds
# immutable generations (gen.<UTC time>.<job>.<host>.<pid>) and `current`, a symlink to
# the newest. Each rank copies `current` into ${TMPDIR:-/tmp} at start and MIOpen works on
# that copy alone; when CMD ends (a time limit's SIGTERM included), global rank 0 copies its
# cache into a new generation and swaps `current` to it (a rename: atomic, also across
# nodes), then keeps the two newest generations and removes older ones. So no lock is
# needed (file locks on a parallel file system may be local to one node), the next job
# starts warm (a cold cache makes the first epoch of a new shape ~25x slower), the root
# holds at most three copies of one rank's cache however many nodes and jobs ran (LUMI's
# $HOME is 20 GB), and a wrapper killed with SIGKILL leaves its rank on a private copy.
# Concurrent jobs each publish; the last one wins (caches only grow, so little is lost). A
# root that cannot be written or read leaves the rank on an empty private copy, with a warning.
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

warn() { echo "task_wrapper: $*" >&2; }

# miopen_seed ROOT DIR: DIR becomes a fresh private copy of ROOT/current (empty without one).
miopen_seed() {
    { rm -rf "$2" && mkdir -p "$2"; } || die "cannot create the MIOpen cache $2"
    if [ -e "$1/current" ]; then
        cp -a "$1/current/." "$2/" 2>/dev/null \
            || warn "could not copy the MIOpen cache $1/current (pruned meanwhile?); kernels missing from $2 are tuned again"
    fi
}

# miopen_publish ROOT DIR: DIR becomes ROOT's newest generation and ROOT/current points at it;
# the two newest generations stay, older ones and half-copied ones go.
miopen_publish() {
    local root=$1 dir=$2 gen keep
    gen="gen.$(date -u +%Y%m%dT%H%M%S).${SLURM_JOB_ID:-nojob}.$(hostname -s).$$"
    if ! { mkdir -p "$root" && cp -a "$dir" "$root/.$gen.tmp" && touch "$root/.$gen.tmp" \
           && mv "$root/.$gen.tmp" "$root/$gen" && ln -sfn "$gen" "$root/.current.$$" \
           && mv -T "$root/.current.$$" "$root/current"; } 2>/dev/null; then
        warn "could not publish the MIOpen cache to $root; the next job starts from the previous one"
        rm -rf "${root:?}/.$gen.tmp" "$root/.current.$$" 2>/dev/null
        return 0
    fi
    keep=$(readlink "$root/current")
    # names sort by their UTC time: all but the two newest, never the one current names
    find "$root" -maxdepth 1 -name 'gen.*' -printf '%f\n' | sort | head -n -2 | while read -r old; do
        [ "$old" = "$keep" ] || rm -rf "${root:?}/$old"
    done
    find "$root" -maxdepth 1 -name '.gen.*.tmp' -mmin +60 -exec rm -rf {} + 2>/dev/null || true
}

cache="" private=0
if [ -n "${PWW_MIOPEN_CACHE_TEMPLATE:-}" ]; then             # an explicit directory per job and rank
    cache=${PWW_MIOPEN_CACHE_TEMPLATE//\{job\}/${SLURM_JOB_ID:-nojob}}
    cache=${cache//\{rank\}/$LOCAL_RANK}
    mkdir -p "$cache"
elif [ -n "${PWW_MIOPEN_CACHE_ROOT:-}" ]; then                # a private copy of the persistent cache
    cache="${TMPDIR:-/tmp}/${USER:-$(id -un)}-miopen-${SLURM_JOB_ID:-nojob}.${SLURM_STEP_ID:-0}-$LOCAL_RANK"
    miopen_seed "$PWW_MIOPEN_CACHE_ROOT" "$cache"
    private=1
fi
if [ -n "$cache" ]; then
    export MIOPEN_USER_DB_PATH=$cache MIOPEN_CUSTOM_CACHE_DIR=$cache
fi

affinity=$(taskset -cp $$ 2>/dev/null | sed 's/.*: //' || echo "?")
echo "task_wrapper: rank $RANK/$WORLD_SIZE local $LOCAL_RANK on $(hostname -s) site $PWW_SITE ${PWW_PIN_VAR:-gpu}=$gpu cpus $affinity"

pww_runtime_cmd "$@"
if [ "$private" = 0 ]; then
    exec "${PWW_CMD[@]}"
fi
# the traps before the child exists, so that no signal finds the shell without them; stdin
# passed on explicitly (a background command would otherwise read /dev/null)
child=""
trap '[ -z "$child" ] || kill -TERM "$child" 2>/dev/null || true' TERM
trap '[ -z "$child" ] || kill -INT "$child" 2>/dev/null || true' INT
"${PWW_CMD[@]}" <&0 &
child=$!
rc=0
wait "$child" || rc=$?
while kill -0 "$child" 2>/dev/null; do      # a trapped signal ended the first wait early
    rc=0
    wait "$child" || rc=$?
done
trap - TERM INT
if [ "$RANK" = 0 ]; then
    miopen_publish "$PWW_MIOPEN_CACHE_ROOT" "$cache"
fi
rm -rf "$cache"
exit "$rc"
