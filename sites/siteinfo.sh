#!/usr/bin/env bash
# shellcheck shell=bash
# sites/siteinfo.sh - every machine fact sites/<site>.sh sets, next to what this machine says.
#
#   sites/siteinfo.sh                      # the site env.sh detects (PWW_SITE, else the hostname)
#   sites/siteinfo.sh --site snellius      # another site's file against this machine
#   sites/siteinfo.sh --site-file /tmp/x.sh --site local   # a copy under test (or PWW_SITE_FILE=...)
#   sites/siteinfo.sh --strict             # exit 1 when a value disagrees
#   srun -p dev-g -N1 -n1 --gpus-per-node=8 -t 5 sites/siteinfo.sh   # LUMI: where the jobs run
#   srun -p gpu_h100 -N1 -n1 --gpus-per-node=4 -t 5 sites/siteinfo.sh   # Snellius
#   srun -p small-g -N1 -n1 -t 5 sites/siteinfo.sh --central    # the route to the central VM, as a job
#                                          # takes it (python fedsite.py check in the site's runtime;
#                                          # its flags after --central, e.g. --mib 256 or --proxy URL)
#
# Run it on a compute node, through srun as above: a login node has no GPU, so the GPU rows
# disagree there. One line per value:
#   MARK NAME  site: VALUE  observed: WHAT THIS MACHINE SAYS
# MARK: ok (agrees), DIFFERS (disagrees: the site file, or the machine, is not what the
# jobs assume), unknown (the tool that would tell is missing, said which), info (printed,
# nothing to compare). The site file's value is what a job from this shell gets: the file
# sourced in this environment; "(environment; the file says X)" where an exported variable
# overrides the file's own default.
# Observed with whatever is present, each optional: sinfo (partitions, GRES, CPUs, memory),
# /proc/driver/nvidia, nvidia-smi, /sys/class/kfd, rocm-smi (GPUs), lscpu or /proc/cpuinfo
# (cores, L3 groups for a CPU mask), /proc/meminfo, the module command, /sys/class/cxi
# (Slingshot), /sys/class/infiniband or ibv_devinfo (InfiniBand), /sys/class/net or ip
# (interfaces), singularity/apptainer. A missing tool is never an error.
# Read-only: it writes nothing anywhere (no temporary files either), but for --central, whose
# transfer writes a temporary file and a test blob, both removed.
# Exit status: 0; 1 only with --strict when some value DIFFERS; 2 for a usage error.
set -uo pipefail

usage() {
    sed -n '3,/^set -uo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'
}

SITE="" SITE_FILE=${PWW_SITE_FILE:-} STRICT=0 CENTRAL=0
while [ $# -gt 0 ]; do
    case $1 in
        --site) [ $# -ge 2 ] || { echo "siteinfo: --site needs a name" >&2; exit 2; }; SITE=$2; shift 2 ;;
        --site=*) SITE=${1#--site=}; shift ;;
        --site-file) [ $# -ge 2 ] || { echo "siteinfo: --site-file needs a path" >&2; exit 2; }; SITE_FILE=$2; shift 2 ;;
        --site-file=*) SITE_FILE=${1#--site-file=}; shift ;;
        --strict) STRICT=1; shift ;;
        --central) shift; CENTRAL=1; break ;;
        -h|--help) usage; exit 0 ;;
        *) echo "siteinfo: unknown argument '$1' (--help)" >&2; exit 2 ;;
    esac
done

PWW_ROOT=${PWW_ROOT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
export PWW_ROOT          # the site files read it (local.sh: PWW_VENV, PWW_SCRATCH)
if [ "$CENTRAL" = 1 ]; then
    # the job's own calls, clients and environment (its proxy variables, central.env's URLs)
    # shellcheck source=env.sh
    source "$PWW_ROOT/env.sh" >/dev/null || exit 2
    pww_central_env || exit 2            # central.env, read as a job reads it
    cd "$PWW_ROOT" || exit 2
    pww_run python fedsite.py check "$@"
    exit
fi
HOST=$(hostname -s 2>/dev/null || hostname)
# env.sh's own detection (sourcing it only defines things and reads the site file)
# shellcheck disable=SC2016  # expanded by that shell
DETECTED=$(env -u PWW_SITE bash -c 'source "$1/env.sh" >/dev/null 2>&1 && pww_detect_site "$2"' _ "$PWW_ROOT" "$HOST")
SITE=${SITE:-${PWW_SITE:-$DETECTED}}
SITE_FILE=${SITE_FILE:-$PWW_ROOT/sites/$SITE.sh}
SITES=$(find "$PWW_ROOT/sites" -maxdepth 1 -name '*.sh' -printf '%f\n' | sed 's|\.sh$||' | sort \
    | grep -vx -e bootstrap -e siteinfo | paste -sd ' ')
case $SITE in
    */*|.*|"") echo "siteinfo: --site '$SITE' is not a site name (sites: $SITES)" >&2; exit 2 ;;
    bootstrap|siteinfo) echo "siteinfo: '$SITE' is a tool beside the site files, not a site (sites: $SITES)" >&2; exit 2 ;;
esac
if [ ! -f "$SITE_FILE" ]; then
    echo "siteinfo: no site file $SITE_FILE (sites: $SITES)" >&2
    exit 2
fi

# ------------------------------------------------------------------ the site file's values
# NAME<TAB>VALUE for every `export NAME=` of the file, sourced in this environment (what a job
# gets) and in an empty one (the file's own defaults); then pww_cpu_bind for the file's ranks.
read_site() {   # read_site clean|here
    # shellcheck disable=SC2016  # expanded by the shell that sources the file
    local prog='source "$1" >/dev/null 2>&1 || exit 3
        for v in $(grep -oE "^[[:space:]]*export [A-Za-z_][A-Za-z0-9_]*" "$1" | awk "{print \$2}"); do
            printf "%s\t%s\n" "$v" "${!v-}"
        done
        if declare -F pww_cpu_bind >/dev/null; then
            printf "@cpu_bind\t%s\n" "$(pww_cpu_bind "${PWW_RANKS_PER_NODE:-0}" 2>/dev/null)"
        fi'
    if [ "$1" = clean ]; then
        env -i PATH="$PATH" HOME="${HOME:-/}" USER="${USER:-$(id -un)}" PWW_ROOT="$PWW_ROOT" \
            bash -c "$prog" _ "$SITE_FILE"
    else
        bash -c "$prog" _ "$SITE_FILE"
    fi
}
declare -A VAL DEFAULT
NAMES=()
while IFS=$'\t' read -r k v; do
    [ -n "${VAL[$k]+x}" ] || NAMES+=("$k")
    VAL[$k]=$v
done < <(read_site here)
while IFS=$'\t' read -r k v; do DEFAULT[$k]=$v; done < <(read_site clean)
if [ ${#NAMES[@]} -eq 0 ]; then
    echo "siteinfo: $SITE_FILE could not be sourced, or exports nothing" >&2
    exit 2
fi
val() { printf '%s' "${VAL[$1]-}"; }

# ------------------------------------------------------------------ output
N_OK=0 N_DIFF=0 N_UNKNOWN=0 N_INFO=0
declare -A SHOWN
# row MARK NAME SITE_VALUE OBSERVED
row() {
    local mark=$1 name=$2 site=$3 obs=$4
    SHOWN[$name]=1
    if [ -n "${VAL[$name]+x}" ] && [ "${VAL[$name]}" != "${DEFAULT[$name]-}" ]; then
        site+=" (environment; the file says '${DEFAULT[$name]-}')"
    fi
    [ -n "$site" ] || site="''"
    case $mark in
        ok) N_OK=$((N_OK + 1)) ;;
        DIFFERS) N_DIFF=$((N_DIFF + 1)) ;;
        unknown) N_UNKNOWN=$((N_UNKNOWN + 1)) ;;
        *) N_INFO=$((N_INFO + 1)) ;;
    esac
    printf '%-7s %-31s site: %s  observed: %s\n' "$mark" "$name" "$site" "$obs"
}
same() { if [ "$1" = "$2" ]; then echo ok; else echo DIFFERS; fi; }
have() { command -v "$1" >/dev/null 2>&1; }

# ------------------------------------------------------------------ observations
# GPUs: node-wide counts from the drivers (no tool needed), details from the vendors' tools.
GPU_KIND="" GPU_COUNT="" GPU_HOW="" GPU_MODEL=""
observe_gpus() {
    local n=0 node
    if [ -d /proc/driver/nvidia/gpus ]; then
        n=$(find /proc/driver/nvidia/gpus -mindepth 1 -maxdepth 1 2>/dev/null | wc -l)
        GPU_HOW="/proc/driver/nvidia/gpus"
    fi
    if [ "$n" = 0 ] && have nvidia-smi; then
        n=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
        GPU_HOW="nvidia-smi -L"
    fi
    if [ "$n" -gt 0 ]; then
        GPU_KIND=cuda GPU_COUNT=$n
        if have nvidia-smi; then
            GPU_MODEL=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | sort | uniq -c \
                        | awk '{c=$1; $1=""; printf "%s%d x%s", (NR>1?", ":""), c, $0}')
            [ -n "$GPU_MODEL" ] || GPU_MODEL="unknown (nvidia-smi answered nothing)"
        else
            GPU_MODEL="unknown (no nvidia-smi)"
        fi
        return
    fi
    if [ -d /sys/class/kfd/kfd/topology/nodes ]; then     # a KFD node with SIMDs is a GPU (a GCD)
        for node in /sys/class/kfd/kfd/topology/nodes/*/properties; do
            [ -r "$node" ] && awk '$1 == "simd_count" && $2 > 0 {found=1} END {exit !found}' "$node" && n=$((n + 1))
        done
        GPU_HOW="/sys/class/kfd topology"
    fi
    if [ "$n" = 0 ] && have rocm-smi; then
        n=$(rocm-smi --showid 2>/dev/null | grep -oE '^GPU\[[0-9]+\]' | sort -u | wc -l)
        GPU_HOW="rocm-smi --showid"
    fi
    if [ "$n" -gt 0 ]; then
        GPU_KIND=rocm GPU_COUNT=$n
        if have rocm-smi; then
            GPU_MODEL=$(rocm-smi --showproductname 2>/dev/null | grep -m1 -E 'Card (series|SKU)' | sed 's/.*: *//')
            [ -n "$GPU_MODEL" ] || GPU_MODEL="unknown (rocm-smi named no card)"
        else
            GPU_MODEL="unknown (no rocm-smi)"
        fi
        return
    fi
    GPU_KIND=cpu GPU_COUNT=0
    local tools=""
    have nvidia-smi || tools+=", no nvidia-smi"
    have rocm-smi || tools+=", no rocm-smi"
    GPU_HOW="no /proc/driver/nvidia/gpus, no GPU in /sys/class/kfd$tools"
    GPU_MODEL="none"
}

# CPUs: physical cores, hardware threads, L3 groups (lscpu, else /proc/cpuinfo, else nproc).
CPUS="" CORES="" CPU_HOW=""
declare -A L3_OF
observe_cpus() {
    CPUS=$(getconf _NPROCESSORS_ONLN 2>/dev/null || nproc --all 2>/dev/null || echo "")
    if have lscpu; then
        local cpu rest
        CORES=$(lscpu -p=CORE,SOCKET 2>/dev/null | grep -v '^#' | sort -u | wc -l)
        while IFS=, read -r cpu _ _ rest; do
            [ -n "$cpu" ] && L3_OF[$cpu]=${rest##*,}
        done < <(lscpu -p=CPU,CORE,SOCKET,CACHE 2>/dev/null | grep -v '^#')
        CPU_HOW=lscpu
    elif [ -r /proc/cpuinfo ]; then
        CORES=$(awk -F: '/^physical id/ {p=$2} /^core id/ {print p "/" $2}' /proc/cpuinfo | sort -u | wc -l)
        [ "$CORES" -gt 0 ] || CORES=$CPUS
        CPU_HOW="/proc/cpuinfo (no lscpu)"
    else
        CORES=$CPUS
        CPU_HOW="nproc (no lscpu, no /proc/cpuinfo)"
    fi
}

# Slurm: partitions with their nodes' CPUs, memory and GRES.
SLURM_PARTS="" SLURM_HOW=""
declare -A PART_DESC
observe_slurm() {
    if ! have sinfo; then SLURM_HOW="unknown (no sinfo)"; return; fi
    local out p c m g
    if ! out=$(sinfo -h -o '%R|%c|%m|%G' 2>/dev/null) || [ -z "$out" ]; then
        SLURM_HOW="unknown (sinfo answered nothing: no controller reachable)"
        return
    fi
    while IFS='|' read -r p c m g; do
        SLURM_PARTS+=" $p"
        PART_DESC[$p]="$c CPUs, ${m} MB, GRES $g"
    done <<< "$out"
    SLURM_PARTS=${SLURM_PARTS# }
    SLURM_HOW=sinfo
}

# The interconnect: Slingshot's Cassini NICs, InfiniBand HCAs, else Ethernet only.
NET_KIND="" NET_HOW="" NET_IFACES=""
observe_net() {
    local list
    if [ -d /sys/class/net ]; then
        NET_IFACES=$(find /sys/class/net -mindepth 1 -maxdepth 1 -printf '%f\n' 2>/dev/null | sort | tr '\n' ' ')
    elif have ip; then
        NET_IFACES=$(ip -o link show 2>/dev/null | awk -F': ' '{sub(/@.*/, "", $2); print $2}' | sort | tr '\n' ' ')
    fi
    NET_IFACES=${NET_IFACES% }
    list=$(find /sys/class/cxi -mindepth 1 -maxdepth 1 -printf '%f ' 2>/dev/null)
    if [ -n "$list" ]; then NET_KIND=slingshot NET_HOW="/sys/class/cxi: ${list% }"; return; fi
    list=$(find /sys/class/infiniband -mindepth 1 -maxdepth 1 -printf '%f ' 2>/dev/null)
    if [ -z "$list" ] && have ibv_devinfo; then
        list=$(ibv_devinfo -l 2>/dev/null | awk 'NR > 1 {printf "%s ", $1}')
    fi
    if [ -n "$list" ]; then NET_KIND=infiniband NET_HOW="HCAs: ${list% }"; return; fi
    NET_KIND=none
    NET_HOW="no /sys/class/cxi, no /sys/class/infiniband$(have ibv_devinfo || echo ', no ibv_devinfo'); interfaces: ${NET_IFACES:-unknown}"
}

observe_gpus
observe_cpus
observe_slurm
observe_net

# ------------------------------------------------------------------ the rows
echo "siteinfo: site $SITE ($SITE_FILE) on $HOST${SLURM_JOB_ID:+, Slurm job $SLURM_JOB_ID}"
row "$(same "$SITE" "$DETECTED")" site "$SITE" "host $HOST -> $DETECTED (env.sh's detection)"

accel=$(val PWW_ACCEL)
if [ -n "${VAL[PWW_ACCEL]+x}" ]; then
    row "$(same "$accel" "$GPU_KIND")" PWW_ACCEL "$accel" "$GPU_KIND ($GPU_HOW)"
fi
site_gpus=0
[ "$accel" = cpu ] || site_gpus=$(val PWW_RANKS_PER_NODE)
gres=""
[ -z "$SLURM_PARTS" ] || gres="; Slurm GRES: ${PART_DESC[${SLURM_PARTS%% *}]##*GRES }"
gpus_why="PWW_RANKS_PER_NODE: one rank per GPU"
[ "$accel" != cpu ] || gpus_why="PWW_ACCEL=cpu"
row "$(same "$site_gpus" "$GPU_COUNT")" "GPUs per node" "$site_gpus ($gpus_why)" \
    "$GPU_COUNT ($GPU_HOW)$gres"
row info "GPU model" "-" "$GPU_MODEL"

if [ -n "${VAL[PWW_PIN_VAR]+x}" ]; then
    pin=$(val PWW_PIN_VAR)
    case $GPU_KIND in
        rocm) row "$(same "$pin" ROCR_VISIBLE_DEVICES)" PWW_PIN_VAR "$pin" "ROCR_VISIBLE_DEVICES (AMD GPUs)" ;;
        cuda) row "$(same "$pin" CUDA_VISIBLE_DEVICES)" PWW_PIN_VAR "$pin" "CUDA_VISIBLE_DEVICES (NVIDIA GPUs)" ;;
        *)
            # no GPU: the list Slurm handed this step (Slurm sets CUDA_ and ROCR_VISIBLE_DEVICES both)
            if [ -n "${!pin:-}" ]; then
                row ok PWW_PIN_VAR "$pin" "$pin=${!pin} (set by Slurm here)"
            elif [ -n "${ROCR_VISIBLE_DEVICES:-}" ]; then
                row "$(same "$pin" ROCR_VISIBLE_DEVICES)" PWW_PIN_VAR "$pin" "ROCR_VISIBLE_DEVICES=$ROCR_VISIBLE_DEVICES (set by Slurm here)"
            elif [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
                row "$(same "$pin" CUDA_VISIBLE_DEVICES)" PWW_PIN_VAR "$pin" "CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES (set by Slurm here)"
            else
                row unknown PWW_PIN_VAR "$pin" "unknown (no GPU, and no GPU list from Slurm in this environment)"
            fi ;;
    esac
fi
if [ -n "${VAL[PWW_DEVICE]+x}" ]; then
    dev=$(val PWW_DEVICE) want=auto
    [ "$GPU_KIND" != cpu ] || want=cpu
    row "$(same "$dev" "$want")" PWW_DEVICE "$dev" "$want ($GPU_COUNT GPUs here)"
fi

ranks=$(val PWW_RANKS_PER_NODE) per=$(val PWW_CORES_PER_RANK)
if [ -n "$ranks" ]; then
    if [ "$GPU_KIND" = cpu ]; then
        mark=ok
        [ -z "$CPUS" ] || [ "$ranks" -le "$CPUS" ] || mark=DIFFERS
        row "$mark" PWW_RANKS_PER_NODE "$ranks" "${CPUS:-?} CPUs, no GPU (at most one rank per CPU)"
    else
        row "$(same "$ranks" "$GPU_COUNT")" PWW_RANKS_PER_NODE "$ranks" "$GPU_COUNT GPUs (one rank per GPU)"
    fi
fi
if [ -n "$per" ] && [ -n "$ranks" ]; then
    need=$((ranks * per)) mark=ok
    [ "${CORES:-0}" -ge "$need" ] || mark=DIFFERS
    [ -n "$CORES" ] || mark=unknown
    slurm_cpus=""
    [ -z "$SLURM_PARTS" ] || slurm_cpus="; Slurm: ${PART_DESC[${SLURM_PARTS%% *}]%%,*}"
    row "$mark" PWW_CORES_PER_RANK "$per ($ranks ranks x $per = $need cores a node)" \
        "${CORES:-?} cores, ${CPUS:-?} CPUs ($CPU_HOW)$slurm_cpus"
fi
if [ -n "${VAL[@cpu_bind]+x}" ]; then
    bind=$(val @cpu_bind)
    case $bind in
        mask_cpu:*)
            bad="" groups="" absent=0 masked=0
            IFS=, read -r -a masks <<< "${bind#mask_cpu:}"
            for m in "${masks[@]}"; do
                l3="" spans=0
                while IFS= read -r c; do
                    masked=$((masked + 1))
                    if [ -z "${L3_OF[$c]+x}" ]; then absent=$((absent + 1)); continue; fi
                    [ -z "$l3" ] || [ "$l3" = "${L3_OF[$c]}" ] || spans=1
                    l3=${L3_OF[$c]}
                done < <(for ((c = 0; c < 64; c++)); do (( (m >> c) & 1 )) && echo "$c"; done)
                [ "$spans" = 0 ] || bad+=" mask $m spans two L3 groups;"
                groups+="${l3:-?} "
            done
            distinct=$(tr ' ' '\n' <<< "${groups% }" | sort -u | wc -l)
            [ "$absent" -gt 0 ] || [ "$distinct" = "${#masks[@]}" ] \
                || bad+=" the ${#masks[@]} masks share $distinct L3 groups (groups ${groups% });"
            [ "$absent" = 0 ] || bad=" $absent of the $masked CPUs the masks name do not exist (${#L3_OF[@]} CPUs here);$bad"
            if [ ${#L3_OF[@]} -eq 0 ]; then
                row unknown "pww_cpu_bind $ranks" "${bind:0:40}..." "unknown (no lscpu: the L3 groups are not known)"
            elif [ -n "$bad" ]; then
                bad=${bad# }
                row DIFFERS "pww_cpu_bind $ranks" "${bind:0:40}..." "${bad%;}"
            else
                row ok "pww_cpu_bind $ranks" "${bind:0:40}... (${#masks[@]} masks)" \
                    "each mask within one L3 group (groups ${groups% }) of ${#L3_OF[@]} CPUs"
            fi ;;
        *) row info "pww_cpu_bind $ranks" "$bind" "srun binds (nothing machine-specific to check)" ;;
    esac
fi

mem=$(awk '/^MemTotal:/ {printf "%.1f GiB", $2 / 1048576}' /proc/meminfo 2>/dev/null)
slurm_mem=""
[ -z "$SLURM_PARTS" ] || { slurm_mem=${PART_DESC[${SLURM_PARTS%% *}]#*, }; slurm_mem="; Slurm RealMemory ${slurm_mem%%,*}"; }
row info "memory per node" "- (jobs: --mem=0 or --mem-per-gpu)" "${mem:-unknown (no /proc/meminfo)}$slurm_mem"

if [ -n "${VAL[PWW_PARTITIONS]+x}" ]; then
    parts=$(val PWW_PARTITIONS)
    if [ -z "$SLURM_PARTS" ]; then
        row unknown PWW_PARTITIONS "$parts" "$SLURM_HOW"
    else
        missing="" desc=""
        for p in $parts; do
            if [[ " $SLURM_PARTS " == *" $p "* ]]; then desc+="$p ($(printf '%s' "${PART_DESC[$p]}")); "
            else missing+=" $p"; fi
        done
        if [ -n "$missing" ]; then
            row DIFFERS PWW_PARTITIONS "$parts" "missing:$missing (sinfo has: $SLURM_PARTS)"
        else
            row ok PWW_PARTITIONS "$parts" "${desc%; }"
        fi
    fi
fi

# where a directory should be: present, or at least its parent (sites/bootstrap.sh makes it)
dir_row() {    # dir_row NAME PATH
    local name=$1 d=$2 fs free parent
    if [ -z "$d" ]; then row info "$name" "" "(empty)"; return; fi
    if [ -d "$d" ]; then
        fs=$(stat -f -c %T "$d" 2>/dev/null || echo "?")
        free=$(df -Pk "$d" 2>/dev/null | awk 'NR == 2 {printf "%.0f GiB free", $4 / 1048576}')
        row ok "$name" "$d" "exists, $fs, ${free:-free space unknown}$([ -w "$d" ] || echo ', NOT writable by you')"
        return
    fi
    parent=$(dirname "$d")
    if [ -d "$parent" ]; then
        row ok "$name" "$d" "not there yet; its parent $parent is (sites/bootstrap.sh creates it)"
    else
        row DIFFERS "$name" "$d" "missing, and so is $parent"
    fi
}
[ -z "${VAL[PWW_SCRATCH]+x}" ] || dir_row PWW_SCRATCH "$(val PWW_SCRATCH)"
if [ -n "${VAL[PWW_PROJECT]+x}" ]; then
    project=$(val PWW_PROJECT)
    if id -Gn 2>/dev/null | tr ' ' '\n' | grep -qx "$project"; then
        row ok PWW_PROJECT "$project" "you ($(id -un)) are in group $project"
    else
        row DIFFERS PWW_PROJECT "$project" "you ($(id -un)) are not in a group $project (groups: $(id -Gn 2>/dev/null))"
    fi
fi
if [ -n "${VAL[PWW_PROJECT_DIR]+x}" ]; then
    d=$(val PWW_PROJECT_DIR)
    if [ -d "$d" ]; then row ok PWW_PROJECT_DIR "$d" "exists"; else row DIFFERS PWW_PROJECT_DIR "$d" "missing"; fi
fi
if [ -n "${VAL[PWW_MIOPEN_CACHE_ROOT]+x}" ]; then    # task_wrapper.sh makes it (mkdir -p) when a job ends
    d=$(val PWW_MIOPEN_CACHE_ROOT)
    row info PWW_MIOPEN_CACHE_ROOT "$d" "$([ -d "$d" ] && echo "exists, $(find "$d" -maxdepth 1 -name 'gen.*' | wc -l) generations" \
        || echo "not there yet (the first job's rank 0 makes it)")"
fi

# the runtime: a container runtime and image, or a venv
runner=$(val PWW_RUNNER)
if [ -n "$runner" ]; then
    case $runner in
        container)
            rt=""
            for t in "${PWW_SINGULARITY:-singularity}" apptainer singularity; do
                if have "$t"; then rt="$t ($(command -v "$t"), $("$t" --version 2>/dev/null | head -n 1))"; break; fi
            done
            if [ -n "$rt" ]; then row ok PWW_RUNNER container "$rt"
            else row DIFFERS PWW_RUNNER container "no ${PWW_SINGULARITY:-singularity}, no apptainer in PATH"; fi ;;
        venv)
            py=$(command -v python3 2>/dev/null || echo "no python3 in PATH (the venv brings its own)")
            row ok PWW_RUNNER venv "$py" ;;
        *) row DIFFERS PWW_RUNNER "$runner" "neither container nor venv (env.sh knows only those)" ;;
    esac
fi
if [ -n "${VAL[PWW_CONTAINER]+x}" ]; then
    c=$(val PWW_CONTAINER)
    if [ -f "$c" ]; then row ok PWW_CONTAINER "$c" "exists, $(du -h "$c" 2>/dev/null | cut -f1)"
    else row DIFFERS PWW_CONTAINER "$c" "missing (RUNBOOK.md section 1 builds it)"; fi
fi
if [ -n "${VAL[PWW_VENV]+x}" ]; then
    v=$(val PWW_VENV)
    if [ -x "$v/bin/python" ]; then row ok PWW_VENV "$v" "$("$v/bin/python" -V 2>&1)"
    else row DIFFERS PWW_VENV "$v" "no $v/bin/python (sites/bootstrap.sh says how to build it)"; fi
fi
if [ -n "${VAL[PWW_CONTAINER_BINDS]+x}" ]; then
    missing=""
    IFS=, read -r -a binds <<< "$(val PWW_CONTAINER_BINDS)"
    for b in "${binds[@]}"; do [ -e "$b" ] || missing+=" $b"; done
    if [ -z "$missing" ]; then row ok PWW_CONTAINER_BINDS "${#binds[@]} paths" "all exist"
    else row DIFFERS PWW_CONTAINER_BINDS "${#binds[@]} paths" "missing:$missing"; fi
fi
if [ -n "${VAL[PWW_RCCL_PLUGIN_DIR]+x}" ]; then
    d=$(val PWW_RCCL_PLUGIN_DIR)
    if [ -z "$d" ]; then row info PWW_RCCL_PLUGIN_DIR "" "(the image's plugin)"
    elif [ -f "$d/librccl-net.so" ]; then row ok PWW_RCCL_PLUGIN_DIR "$d" "has librccl-net.so"
    else row DIFFERS PWW_RCCL_PLUGIN_DIR "$d" "no $d/librccl-net.so"; fi
fi
if [ -n "${VAL[PWW_CRAY_LIBFABRIC]+x}" ]; then
    d=$(val PWW_CRAY_LIBFABRIC)
    newest=$(find /opt/cray/libfabric -mindepth 2 -maxdepth 2 -name lib64 2>/dev/null | sort -V | tail -n 1)
    if [ -n "$d" ]; then
        if [ -d "$d" ]; then row ok PWW_CRAY_LIBFABRIC "$d" "exists"; else row DIFFERS PWW_CRAY_LIBFABRIC "$d" "missing"; fi
    elif [ -n "$newest" ]; then
        row ok PWW_CRAY_LIBFABRIC "'' (the newest)" "$newest"
    else
        row DIFFERS PWW_CRAY_LIBFABRIC "'' (the newest)" "no /opt/cray/libfabric/*/lib64 (not a Cray system)"
    fi
fi

# the modules a site's setup script loads (jobs/<site>_setup_venv.sh: MODULES=${..._MODULES:-...})
setup="$PWW_ROOT/jobs/${SITE}_setup_venv.sh"
if [ -f "$setup" ]; then
    mods=$(sed -n 's/^MODULES=\${[A-Z_]*:-\(.*\)}$/\1/p' "$setup" | head -n 1)
    if [ -n "$mods" ]; then
        if ! type module >/dev/null 2>&1; then       # a batch shell may lack the function: its init
            for init in "${LMOD_PKG:+$LMOD_PKG/init/bash}" "${MODULESHOME:+$MODULESHOME/init/bash}"; do
                # shellcheck source=/dev/null
                if [ -n "$init" ] && [ -r "$init" ]; then source "$init" >/dev/null 2>&1; break; fi
            done
        fi
        if type module >/dev/null 2>&1; then
            missing=""
            for m in $mods; do
                module -t avail "$m" 2>&1 | grep -q "^${m%%/*}" || missing+=" $m"
            done
            if [ -z "$missing" ]; then row ok "modules (${setup#"$PWW_ROOT"/})" "$mods" "all in module avail"
            else row DIFFERS "modules (${setup#"$PWW_ROOT"/})" "$mods" "not in module avail:$missing"; fi
        else
            row unknown "modules (${setup#"$PWW_ROOT"/})" "$mods" "unknown (no module command)"
        fi
    fi
fi

# the network
if [ -n "${VAL[PWW_INTERCONNECT]+x}" ]; then
    row "$(same "$(val PWW_INTERCONNECT)" "$NET_KIND")" PWW_INTERCONNECT "$(val PWW_INTERCONNECT)" "$NET_KIND ($NET_HOW)"
fi
if [ -n "${VAL[NCCL_SOCKET_IFNAME]+x}" ]; then
    want=$(val NCCL_SOCKET_IFNAME) missing=""
    if [ -z "$NET_IFACES" ]; then
        row unknown NCCL_SOCKET_IFNAME "$want" "unknown (no /sys/class/net, no ip)"
    else
        IFS=, read -r -a ifs <<< "$want"
        for i in "${ifs[@]}"; do
            case $i in
                ^*) continue ;;                                     # NCCL: an exclusion
                =*) [[ " $NET_IFACES " == *" ${i#=} "* ]] || missing+=" $i" ;;     # an exact name
                *) [[ " $NET_IFACES" == *" $i"* ]] || missing+=" $i" ;;             # a prefix
            esac
        done
        if [ -z "$missing" ]; then row ok NCCL_SOCKET_IFNAME "$want" "interfaces: $NET_IFACES"
        else row DIFFERS NCCL_SOCKET_IFNAME "$want" "no interface$missing (interfaces: $NET_IFACES)"; fi
    fi
fi

# everything else the file exports: printed, with what it concerns
for name in "${NAMES[@]}"; do
    [ -z "${SHOWN[$name]+x}" ] || continue
    case $name in
        @cpu_bind) continue ;;
        FI_CXI_*|CXI_*|FI_MR_*)
            what="libfabric's CXI provider: applies only on Slingshot (here: $NET_KIND)" ;;
        OMP_NUM_THREADS) what="threads per rank (${CPUS:-?} CPUs here)" ;;
        PWW_EAGER_PG_INIT|TORCH_NCCL_*|RCCL_*|NCCL_*) what="a communication library switch: nothing on the machine to compare" ;;
        PWW_CIFAR_ARGS|PWW_TITAN_*) what="the jobs' sizes at this site" ;;
        *) what="no check for this value" ;;
    esac
    row info "$name" "$(val "$name")" "$what"
done

echo "siteinfo: $((N_OK + N_DIFF + N_UNKNOWN)) compared: $N_OK agree, $N_DIFF differ, $N_UNKNOWN unknown; $N_INFO more printed"
if [ "$STRICT" = 1 ] && [ "$N_DIFF" -gt 0 ]; then
    exit 1
fi
exit 0
