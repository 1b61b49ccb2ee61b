#!/usr/bin/env bash
# shellcheck shell=bash
# sites/bootstrap.sh - a site's first-time setup, from the checkout (RUNBOOK.md section 1).
#
#   sites/bootstrap.sh               # once per site and checkout (again at any time: it repairs)
#   sites/bootstrap.sh --dry-run     # say what it would change, change nothing
#   PWW_SITE=snellius PWW_SCRATCH=/projects/0/myproj/$USER sites/bootstrap.sh
#
# Runs on: a login node (or any node), as you. The site is env.sh's (PWW_SITE, else the
# hostname); every value comes from env.sh and sites/<site>.sh. In order, it:
#   1. makes the scratch directories $PWW_SCRATCH/runs and $PWW_SCRATCH/data and links them
#      into the checkout as runs/ and data/ (code stays in $HOME, bulk data on scratch; at the
#      local site, where PWW_SCRATCH is the checkout, they are plain directories), and makes
#      logs/ ($PWW_LOGS), which must exist before sbatch opens logs/%x-%j.out. A link left
#      after scratch was purged gets its directory back; a link elsewhere is left as it is;
#      a non-empty runs/ or data/ directory in the checkout is never moved (it says how);
#   2. checks the runtime: the venv (PWW_VENV) or the container (PWW_CONTAINER and
#      singularity/apptainer) exists and its python imports torch and torchtitan; on LUMI
#      also that the RCCL plugin's libraries resolve in the container (RUNBOOK.md section 1);
#   3. checks that sbatch knows your project where the site has projects (SBATCH_ACCOUNT);
#   4. checks the central services' files when central.env is there (RUNBOOK.md section 5:
#      PWW_TOKEN_FILE present and mode 600, made so if it is not; PWW_CA_FILE present).
# Idempotent: a second run changes nothing and says so. What it cannot do (build the venv
# or the container, copy the token) it names with the command that does it.
# Options: --dry-run (changes nothing; the checks still run), --dirs-only (step 1 alone:
# env.sh's pww_setup_dirs), --help.
# Exit status: 0 when everything is in place (or, with --dry-run, would be); 1 when
# something is missing that it cannot make (each said, with its fix); 2 for a usage error.
set -uo pipefail

DRY=0 DIRS_ONLY=0
for arg in "$@"; do
    case $arg in
        --dry-run|-n) DRY=1 ;;
        --dirs-only) DIRS_ONLY=1 ;;
        -h|--help) sed -n '3,/^set -uo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) echo "bootstrap: unknown argument '$arg' (--help)" >&2; exit 2 ;;
    esac
done

PWW_ROOT=${PWW_ROOT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
# shellcheck source=env.sh
source "$PWW_ROOT/env.sh" || exit 2

CHANGES=0 PROBLEMS=0
say() { echo "bootstrap: $*"; }
problem() { echo "bootstrap: MISSING: $*" >&2; PROBLEMS=$((PROBLEMS + 1)); }
# act DESCRIPTION CMD...: run CMD (or, with --dry-run, only say it would)
act() {
    local what=$1
    shift
    CHANGES=$((CHANGES + 1))
    if [ "$DRY" = 1 ]; then
        say "would $what"
        return 0
    fi
    if "$@"; then
        say "$what"
    else
        CHANGES=$((CHANGES - 1))
        problem "could not $what"
        return 1
    fi
}
# same_dir A B: A and B are the same directory, however each is spelled (a trailing slash,
# a symlinked path); a path that does not exist yet is compared as given, made absolute
same_dir() {
    local a b
    a=$(cd "$1" 2>/dev/null && pwd -P) || a=$1
    b=$(cd "$2" 2>/dev/null && pwd -P) || b=$2
    [ "${a%/}" = "${b%/}" ]
}

say "site $PWW_SITE (sites/$PWW_SITE.sh), checkout $PWW_ROOT, scratch $PWW_SCRATCH$([ "$DRY" = 0 ] || echo ', dry run')"

# ------------------------------------------------------------------ 1. directories
# shellcheck disable=SC2329  # run through act
relink() { rmdir "$1" && ln -s "$2" "$1"; }
# link_dir NAME: $PWW_ROOT/NAME -> $PWW_SCRATCH/NAME (setup_dirs: never when the scratch is the checkout)
link_dir() {
    local name=$1 link=$PWW_ROOT/$1 target=${PWW_SCRATCH%/}/$1 now
    if [ ! -d "$target" ]; then
        act "make $target" mkdir "$target" || return
    fi
    if [ -L "$link" ]; then
        now=$(readlink "$link")
        if [ "$now" = "$target" ]; then
            say "$name -> $target (already)"
        elif [ -d "$link" ]; then
            say "$name -> $now, not $target: left as it is"
        else
            problem "$name -> $now, which does not exist: mkdir -p $now, or rm $link && sites/bootstrap.sh"
        fi
    elif [ -d "$link" ]; then
        if [ -z "$(find "$link" -mindepth 1 -maxdepth 1 -print -quit 2>/dev/null)" ]; then
            act "replace the empty directory $link by a link to $target" relink "$link" "$target"
        else
            problem "$link is a directory with files in the checkout, not a link to scratch: $(printf 'mv %q/* %q/ && rmdir %q' "$link" "$target" "$link") && sites/bootstrap.sh"
        fi
    elif [ -e "$link" ]; then
        problem "$link is a file, not a directory or a link: move it away, then sites/bootstrap.sh"
    else
        act "link $name -> $target" ln -s "$target" "$link"
    fi
}

setup_dirs() {
    local d
    if same_dir "$PWW_SCRATCH" "$PWW_ROOT"; then
        for d in runs data; do
            [ -d "$PWW_ROOT/$d" ] || act "make $PWW_ROOT/$d" mkdir -p "$PWW_ROOT/$d"
        done
    elif [ ! -d "$(dirname "$PWW_SCRATCH")" ]; then
        problem "PWW_SCRATCH=$PWW_SCRATCH: $(dirname "$PWW_SCRATCH") does not exist (${PWW_PROJECT:+is PWW_PROJECT=$PWW_PROJECT your project? }set PWW_SCRATCH to your scratch space)"
        return
    else
        if [ ! -d "$PWW_SCRATCH" ]; then
            act "make $PWW_SCRATCH" mkdir "$PWW_SCRATCH" || return
        fi
        for d in runs data; do
            link_dir "$d"
        done
    fi
    [ -d "$PWW_LOGS" ] || act "make $PWW_LOGS" mkdir -p "$PWW_LOGS"
    if [ "$DRY" = 0 ] && [ -d "$PWW_ROOT/runs" ] && [ -d "$PWW_ROOT/data" ]; then
        say "runs -> $(readlink -f "$PWW_ROOT/runs"), data -> $(readlink -f "$PWW_ROOT/data"), logs $PWW_LOGS"
    fi
}
setup_dirs

# ------------------------------------------------------------------ 2. the runtime
# how_to_build: the command that makes this site's venv or container
how_to_build() {
    if [ "$PWW_RUNNER" = container ]; then
        echo "build it once (RUNBOOK.md section 1): apptainer build --fakeroot lumi-titan.sif containers/lumi-titan.def" \
             "&& mkdir -p $(dirname "$PWW_CONTAINER") && mv lumi-titan.sif $PWW_CONTAINER; or set PWW_CONTAINER"
    elif [ -x "$PWW_ROOT/jobs/${PWW_SITE}_setup_venv.sh" ]; then
        echo "build it once: jobs/${PWW_SITE}_setup_venv.sh (login node), or set PWW_VENV"
    elif [ "$PWW_VENV" = "$PWW_ROOT/.venv" ]; then
        echo "build it: make setup"
    else
        echo "build it: python3 -m venv $PWW_VENV && $PWW_VENV/bin/pip install -r requirements.txt; or set PWW_VENV"
    fi
}

check_runtime() {
    local out
    case $PWW_RUNNER in
        venv)
            if [ ! -x "$PWW_VENV/bin/python" ]; then
                problem "the venv: no $PWW_VENV/bin/python; $(how_to_build)"
                return
            fi ;;
        container)
            if ! command -v "$PWW_SINGULARITY" >/dev/null 2>&1; then
                problem "the container runtime: no $PWW_SINGULARITY in PATH (set PWW_SINGULARITY=apptainer where that is the name)"
                return
            fi
            if [ ! -f "$PWW_CONTAINER" ]; then
                problem "the container: no $PWW_CONTAINER; $(how_to_build)"
                return
            fi ;;
        *) problem "PWW_RUNNER=$PWW_RUNNER is neither venv nor container (sites/$PWW_SITE.sh)"; return ;;
    esac
    # the import a job does first; no bytecode written while checking
    if out=$(PYTHONDONTWRITEBYTECODE=1 pww_run python -c \
            'import torch, torchtitan; print("torch", torch.__version__, "(hip %s, cuda %s)" % (torch.version.hip, torch.version.cuda))' 2>&1); then
        say "runtime ($PWW_RUNNER): ${out##*$'\n'}"
    else
        problem "the runtime ($PWW_RUNNER) cannot import torch and torchtitan: $(tail -n 1 <<< "$out"); $(how_to_build)"
        return
    fi
    if [ "$PWW_RUNNER" = container ] && [ "$PWW_ACCEL" = rocm ]; then      # RUNBOOK.md section 1's ldd check
        # shellcheck disable=SC2016  # expanded inside the container
        out=$(pww_run bash -c 'ldd /opt/aws-ofi-nccl/lib/librccl-net.so "$PWW_FABRIC_LIBDIR/libfabric.so.1" 2>&1 | grep "not found"')
        if [ -n "$out" ]; then
            problem "libraries of the RCCL plugin do not resolve in the container (check PWW_CONTAINER_BINDS, PWW_CRAY_LIBFABRIC): $out"
        else
            say "the RCCL plugin's libraries resolve in the container"
        fi
    fi
}

# ------------------------------------------------------------------ 3. the account
check_account() {
    [ -n "${PWW_PROJECT:-}" ] || return 0           # a site without projects (sites/<site>.sh)
    if [ -z "${SBATCH_ACCOUNT:-}" ]; then
        problem "SBATCH_ACCOUNT is not set: sbatch needs your project. Put 'export PWW_PROJECT=$PWW_PROJECT' and 'export SBATCH_ACCOUNT=\$PWW_PROJECT' in ~/.bashrc"
    else
        say "sbatch account $SBATCH_ACCOUNT (project $PWW_PROJECT)"
    fi
}

# ------------------------------------------------------------------ 4. the central files
check_central() {
    local file=${PWW_CENTRAL_ENV:-$PWW_ROOT/central.env} got token ca mode
    if [ ! -f "$file" ]; then
        say "no $file yet: only the titan jobs need it (RUNBOOK.md section 5, once the central VM runs)"
        return
    fi
    # read as a job reads it (env.sh's pww_central_env), in a subshell; its verdict comes last
    got=$( (pww_central_env >/dev/null 2>&1; printf 'read\n%s\n%s\n' "${PWW_TOKEN_FILE:-}" "${PWW_CA_FILE:-}") 2>/dev/null)
    if [ "$(sed -n 1p <<< "$got")" != read ]; then       # a URL or the token's variable missing
        problem "$file: $( (pww_central_env) 2>&1 >/dev/null | tail -n 1)"
        return
    fi
    token=$(sed -n 2p <<< "$got") ca=$(sed -n 3p <<< "$got")
    if [ ! -f "$token" ]; then
        problem "the token file $token ($file): mkdir -p $(dirname "$token") && scp <central>:<dir>/runs/central/token $token && chmod 600 $token"
    else
        mode=$(stat -c %a "$token")
        if [ "$mode" = 600 ] || [ "$mode" = 400 ]; then
            say "token file $token (mode $mode)"
        else
            act "make the token file $token private (mode $mode -> 600)" chmod 600 "$token"
        fi
    fi
    if [ -n "$ca" ] && [ ! -f "$ca" ]; then
        problem "the CA file $ca ($file): scp <central>:<dir>/runs/central/tls/ca.pem $ca"
    elif [ -n "$ca" ]; then
        say "CA file $ca"
    fi
    if [ -f "$token" ] && { [ -z "$ca" ] || [ -f "$ca" ]; } && ! got=$( (pww_central_env) 2>&1); then
        problem "$file: $(tail -n 1 <<< "$got")"
    fi
}

if [ "$DIRS_ONLY" = 0 ]; then
    check_runtime
    check_account
    check_central
fi

if [ "$DRY" = 1 ]; then
    say "dry run: $CHANGES change(s) would be made, nothing written; $PROBLEMS thing(s) missing"
elif [ "$CHANGES" = 0 ] && [ "$PROBLEMS" = 0 ]; then
    say "nothing changed: everything it makes was already in place; 0 thing(s) missing"
elif [ "$CHANGES" = 0 ]; then
    say "nothing changed; $PROBLEMS thing(s) missing (above)"
else
    say "$CHANGES change(s) made; $PROBLEMS thing(s) missing"
fi
[ "$PROBLEMS" = 0 ] || exit 1
exit 0
