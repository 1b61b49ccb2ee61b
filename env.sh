# shellcheck shell=bash
# env.sh - the one file every job, wrapper and interactive shell sources first.
#
#   source env.sh                     # detect the site, export PWW_*, define the helpers
#   source env.sh && pww_run python tests/run.py test_shell   # in the site's container/venv
#   PWW_SITE=local source env.sh      # force a site (lumi | snellius | local)
#
# Site: $PWW_SITE if set, else from the hostname (LUMI: uan* login, nid* compute;
# Snellius: int* login, tcn*/gcn* compute), else `local`. The machine facts live in
# sites/<site>.sh; this file holds only what is the same everywhere. Every variable is
# a default (VAR=${VAR:-default}): export it before sourcing to override.
#
# Exports: PWW_ROOT (this checkout), PWW_SITE, PWW_SCRATCH, PWW_RUNS, PWW_DATA, PWW_LOGS,
# and whatever sites/<site>.sh exports (PWW_ACCEL, PWW_PIN_VAR, PWW_DEVICE,
# PWW_RANKS_PER_NODE, PWW_RUNNER, PWW_CONTAINER or PWW_VENV, ...).
# Functions: pww_detect_site, pww_run, pww_runtime_cmd, pww_rendezvous, pww_setup_dirs,
# pww_cpu_bind (from the site file).

PWW_ROOT=${PWW_ROOT:-$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)}
export PWW_ROOT

# pww_detect_site [HOSTNAME]: prints lumi | snellius | local.
pww_detect_site() {
    local host=${1:-$(hostname -s 2>/dev/null || hostname)}
    case "$host" in
        uan[0-9]*|nid[0-9]*) echo lumi ;;
        int[0-9]*|tcn[0-9]*|gcn[0-9]*) echo snellius ;;
        *) echo local ;;
    esac
}

PWW_SITE=${PWW_SITE:-$(pww_detect_site)}
export PWW_SITE
# sites/ also holds the tools siteinfo.sh and bootstrap.sh, which are no site
if [ ! -f "$PWW_ROOT/sites/$PWW_SITE.sh" ] || [ "$PWW_SITE" = siteinfo ] || [ "$PWW_SITE" = bootstrap ]; then
    echo "env.sh: unknown site '$PWW_SITE' (no site file sites/$PWW_SITE.sh); set PWW_SITE to lumi, snellius or local" >&2
    return 1                            # env.sh is sourced, never run
fi
# shellcheck source=sites/local.sh
source "$PWW_ROOT/sites/$PWW_SITE.sh"

# Code in $PWW_ROOT; data, runs and logs may live on scratch (pww_setup_dirs links them).
export PWW_SCRATCH=${PWW_SCRATCH:-$PWW_ROOT}
export PWW_RUNS=${PWW_RUNS:-$PWW_ROOT/runs}
export PWW_DATA=${PWW_DATA:-$PWW_ROOT/data}
export PWW_LOGS=${PWW_LOGS:-$PWW_ROOT/logs}
export PYTHONUNBUFFERED=1               # rank output reaches logs/<job>-<id>.out as it happens
export PWW_SINGULARITY=${PWW_SINGULARITY:-singularity}

# pww_runtime_cmd CMD...: sets the array PWW_CMD to CMD wrapped in the site's runtime
# (container: singularity exec with the binds; venv: the venv's bin first on PATH).
pww_runtime_cmd() {
    case "$PWW_RUNNER" in
        container)
            if [ ! -f "$PWW_CONTAINER" ]; then
                echo "pww_run: container $PWW_CONTAINER not found; build it (RUNBOOK.md, containers/lumi-titan.def) or set PWW_CONTAINER" >&2
                return 1
            fi
            local binds="$PWW_ROOT,$PWW_CONTAINER_BINDS"
            # the image sets its own library path at start (containers/lumi-env.sh), from
            # PWW_RCCL_PLUGIN_DIR and PWW_CRAY_LIBFABRIC, which reach it with the environment
            [ -n "${PWW_RCCL_PLUGIN_DIR:-}" ] && binds+=",$PWW_RCCL_PLUGIN_DIR"
            PWW_CMD=("$PWW_SINGULARITY" exec --bind "$binds" --pwd "$PWD" "$PWW_CONTAINER" "$@")
            ;;
        venv)
            if [ ! -x "$PWW_VENV/bin/python" ]; then
                echo "pww_run: no venv at $PWW_VENV; build it (snellius: jobs/snellius_setup_venv.sh, local: make setup) or set PWW_VENV" >&2
                return 1
            fi
            PWW_CMD=(env "PATH=$PWW_VENV/bin:$PATH" "VIRTUAL_ENV=$PWW_VENV" "$@")
            ;;
        *)
            echo "pww_run: PWW_RUNNER='$PWW_RUNNER' is not container or venv (sites/$PWW_SITE.sh)" >&2
            return 1
            ;;
    esac
}

# pww_run CMD...: run CMD inside the site's container or venv, e.g. `pww_run python smoke.py`.
pww_run() {
    local PWW_CMD
    pww_runtime_cmd "$@" || return 1
    "${PWW_CMD[@]}"
}

# pww_rendezvous: export MASTER_ADDR (the job's first host) and MASTER_PORT (from the job
# id, as train.py derives it: 20000 + SLURM_JOB_ID % 9000). A constant port breaks when two
# of your jobs share a node: the second dies in TCPStore with "address already in use".
pww_rendezvous() {
    local nodes=${SLURM_JOB_NODELIST:-${SLURM_NODELIST:-}}
    if [ -z "${MASTER_ADDR:-}" ]; then
        if [ -n "$nodes" ] && command -v scontrol >/dev/null; then
            MASTER_ADDR=$(scontrol show hostnames "$nodes" | head -n 1)
        else
            MASTER_ADDR=$(hostname)
        fi
    fi
    MASTER_PORT=${MASTER_PORT:-$((20000 + ${SLURM_JOB_ID:-0} % 9000))}
    export MASTER_ADDR MASTER_PORT
}

# pww_central_env: for a federation site job. The central URLs, token and CA: `central.sh
# url` on the central VM prints the lines for $PWW_CENTRAL_ENV (default: central.env in
# the checkout); a variable already set before the call wins over the file's line for it
# (PWW_DARL_URL=... sbatch jobs/lumi_titan.sh points one job elsewhere). Stops the job,
# naming what is missing. PWW_CA_FILE (the copy of the central CA, read by train.py) is
# checked when set; a literal '$' in it or PWW_TOKEN_FILE (`central.sh url`'s `$HOME/...`
# passed on as a value, never through a shell) stops the job, saying so.
pww_central_env() {
    PWW_CENTRAL_ENV=${PWW_CENTRAL_ENV:-$PWW_ROOT/central.env}
    local var kept=()
    for var in PWW_DARL_URL PWW_FEDMOM_URL PWW_BLOB_URL PWW_TOKEN_FILE PWW_CA_FILE; do
        [ -n "${!var:-}" ] && kept+=("$var=${!var}")
    done
    if [ -f "$PWW_CENTRAL_ENV" ]; then
        # shellcheck source=/dev/null
        source "$PWW_CENTRAL_ENV"
    fi
    for var in "${kept[@]}"; do                 # the values set before the file win
        export "${var%%=*}=${var#*=}"
    done
    : "${PWW_DARL_URL:?set PWW_DARL_URL (see central.sh url)}"
    : "${PWW_FEDMOM_URL:?set PWW_FEDMOM_URL (see central.sh url)}"
    : "${PWW_BLOB_URL:?set PWW_BLOB_URL (see central.sh url)}"
    : "${PWW_TOKEN_FILE:?set PWW_TOKEN_FILE to the copy of the central token (mode 600)}"
    for var in PWW_TOKEN_FILE PWW_CA_FILE; do   # a central.sh url line taken as a value, not by a shell
        if [[ ${!var:-} == *'$'* ]]; then
            echo "pww_central_env: $var=${!var}: a literal '\$' (the line from central.sh url was passed on" \
                 "unexpanded): source central.env, or set $var to the path itself" >&2
            return 1
        fi
    done
    if [ -n "${PWW_CA_FILE:-}" ] && [ ! -f "$PWW_CA_FILE" ]; then
        echo "pww_central_env: PWW_CA_FILE=$PWW_CA_FILE: no such file; copy runs/central/tls/ca.pem from the central VM there" >&2
        return 1
    fi
}

# pww_setup_dirs: the directories of a site's first-time setup: $PWW_SCRATCH/{runs,data}
# linked into the checkout as runs/ and data/ (code stays in $HOME, bulk data on scratch),
# and logs/, which must exist before sbatch opens logs/%x-%j.out. sites/bootstrap.sh does
# this and checks the rest (the venv or container, the account, the central files).
pww_setup_dirs() {
    "$PWW_ROOT/sites/bootstrap.sh" --dirs-only
}
