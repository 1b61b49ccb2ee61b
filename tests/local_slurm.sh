#!/usr/bin/env bash
# tests/local_slurm.sh - a real one-node Slurm on this machine, for `make test-slurm`
# (tests/slurm_jobs.py) and for trying jobs/*.sh by hand with PWW_SITE=local.
#
# Runs on: a Debian/Ubuntu machine or container without systemd, as root (it installs
# packages, writes /etc/slurm and /etc/munge, starts daemons). Nothing listens beyond
# this host: slurmctld and slurmd bind their usual ports 6817/6818 on 127.0.0.1.
#
#   tests/local_slurm.sh start     # install if needed, configure, start, wait until the node is idle
#   tests/local_slurm.sh status    # the daemons it started and sinfo
#   tests/local_slurm.sh stop      # cancel every job, then stop exactly the daemons it started
#
# `start` is idempotent: a second run with the same settings changes nothing; with other
# settings it rewrites the config and restarts the daemons it started (never others).
# Settings (environment):
#   LOCAL_SLURM_PARTITIONS  partition names, all on this node, the first the default
#                           (default "debug"; slurm_jobs.py names those of both sites)
#   LOCAL_SLURM_CPUS        CPUs the node advertises (default: nproc). More than the real
#                           count oversubscribes them, so a LUMI header of 8 x 7 CPUs fits.
#   LOCAL_SLURM_GPUS        fake GPUs as GRES "gpu" (default 0). Each is a character device
#                           like /dev/null: sbatch accepts --gpus-per-node and jobs get
#                           CUDA_VISIBLE_DEVICES, with no GPU behind it (the CPU path runs).
#   LOCAL_SLURM_STATE       where the started daemons' PIDs are kept (default /run/pww-local-slurm)
#   LOCAL_SLURM_WAIT_S      how long to wait for the node to be idle (default 60)
# What it leaves out: more than one node, cgroups (no CPU pinning or memory limits),
# accounting (slurmdbd; --account is ignored).
set -euo pipefail

PARTITIONS=${LOCAL_SLURM_PARTITIONS:-debug}
CPUS=${LOCAL_SLURM_CPUS:-$(nproc)}
GPUS=${LOCAL_SLURM_GPUS:-0}
STATE=${LOCAL_SLURM_STATE:-/run/pww-local-slurm}
WAIT_S=${LOCAL_SLURM_WAIT_S:-60}
NODE=$(hostname -s)
CONF=/etc/slurm/slurm.conf
GRES=/etc/slurm/gres.conf
FAKE_DEV=/var/lib/slurm/pww-fake-gpu
STAMP="# written by pww tests/local_slurm.sh"
DAEMONS="munged slurmctld slurmd"

say() { echo "local_slurm: $*"; }
fail() { echo "local_slurm: error: $*" >&2; exit 1; }

bin_of() {           # daemon -> binary
    case $1 in munged) echo /usr/sbin/munged ;; *) echo "/usr/sbin/$1" ;; esac
}
pidfile_of() {       # daemon -> the pid file it writes (the paths slurm.conf names, munge's default)
    case $1 in munged) echo /run/munge/munged.pid ;; *) echo "/run/$1.pid" ;; esac
}
our_pid() {          # daemon -> its PID if we started it and it still runs that binary
    local pid
    pid=$(awk -v d="$1" '$1 == d {print $2}' "$STATE/pids" 2>/dev/null | tail -n 1)
    [ -n "$pid" ] && [ "$(readlink -f "/proc/$pid/exe" 2>/dev/null)" = "$(readlink -f "$(bin_of "$1")")" ] \
        && echo "$pid"
    return 0
}
any_pid() {          # daemon -> the PID in its pid file if that process runs the binary (ours or not)
    local f pid
    f=$(pidfile_of "$1")
    [ -s "$f" ] || return 0
    pid=$(tr -dc 0-9 < "$f")
    [ -n "$pid" ] && [ "$(readlink -f "/proc/$pid/exe" 2>/dev/null)" = "$(readlink -f "$(bin_of "$1")")" ] \
        && echo "$pid"
    return 0
}
alive() { [ -r "/proc/$1/stat" ] && [ "$(cut -d' ' -f3 "/proc/$1/stat" 2>/dev/null)" != Z ]; }
until_true() {       # seconds what command...: poll every 0.3 s
    local end=$(( $(date +%s) + $1 )) what=$2
    shift 2
    until "$@" >/dev/null 2>&1; do
        [ "$(date +%s)" -lt "$end" ] || fail "no $what within the time allowed"
        sleep 0.3
    done
}

# ------------------------------------------------------------------ start
install_packages() {
    local missing=0 b
    for b in /usr/sbin/munged /usr/bin/munge /usr/bin/unmunge /usr/sbin/slurmctld /usr/sbin/slurmd \
             /usr/bin/sbatch /usr/bin/sinfo /usr/bin/scontrol /usr/bin/squeue /usr/bin/scancel; do
        [ -x "$b" ] || missing=1
    done
    [ "$missing" = 1 ] || return 0
    command -v apt-get >/dev/null || fail "Slurm is not installed and there is no apt-get to install it"
    # Debian's maintainer scripts would start the daemons themselves (and fail without
    # systemd); a policy-rc.d that answers 101 ("not allowed") keeps them stopped.
    local policy=""
    if [ ! -e /usr/sbin/policy-rc.d ]; then
        policy=/usr/sbin/policy-rc.d
        printf '#!/bin/sh\nexit 101\n' > "$policy"
        chmod 755 "$policy"
    fi
    say "installing munge and Slurm (apt-get)"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        munge slurmctld slurmd slurm-client > /dev/null || { [ -z "$policy" ] || rm -f "$policy"; fail "apt-get install failed"; }
    [ -z "$policy" ] || rm -f "$policy"
}

prepare_munge() {
    id munge > /dev/null 2>&1 || fail "no user munge (the munge package creates it)"
    install -d -o munge -g munge -m 0700 /etc/munge /var/lib/munge /var/log/munge
    install -d -o munge -g munge -m 0755 /run/munge
    if [ ! -s /etc/munge/munge.key ]; then
        say "a new MUNGE key"
        head -c 1024 /dev/urandom > /etc/munge/munge.key
    fi
    chown munge:munge /etc/munge/munge.key
    chmod 0400 /etc/munge/munge.key
}

slurm_conf() {       # the whole slurm.conf for the settings, on stdout
    local user=root topo part first=YES
    id slurm > /dev/null 2>&1 && user=slurm
    if [ "$CPUS" = "$(nproc)" ]; then
        # slurmd's own view of the hardware, so it finds nothing to complain about
        topo=$(/usr/sbin/slurmd -C | head -n 1 | tr ' ' '\n' \
               | grep -E '^(CPUs|Boards|SocketsPerBoard|CoresPerSocket|ThreadsPerCore)=' | tr '\n' ' ')
    else
        topo="CPUs=$CPUS Boards=1 SocketsPerBoard=1 CoresPerSocket=$CPUS ThreadsPerCore=1 "
    fi
    cat <<EOF
$STAMP: one node ($NODE), for tests only
ClusterName=pww-local
SlurmctldHost=$NODE(127.0.0.1)
SlurmUser=$user
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation=/var/lib/slurm/slurmctld
SlurmdSpoolDir=/var/lib/slurm/slurmd
SlurmctldPidFile=$(pidfile_of slurmctld)
SlurmdPidFile=$(pidfile_of slurmd)
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
# without cgroups: processes tracked by parentage, no binding, no memory enforcement
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
# a job the node can never run is refused by sbatch instead of pending forever
EnforcePartLimits=ALL
ReturnToService=2
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MailProg=/bin/true
InactiveLimit=0
KillWait=10
MinJobAge=300
EOF
    # more CPUs than the hardware has: slurmd must take the configured count as given
    [ "$CPUS" = "$(nproc)" ] || echo "SlurmdParameters=config_overrides"
    # (no AccountingStorageTRES=gres/gpu: that needs slurmdbd, and slurmctld would exit)
    [ "$GPUS" = 0 ] || echo "GresTypes=gpu"
    local mem_mb gres=""
    mem_mb=$(( $(awk '/^MemTotal:/ {print $2}' /proc/meminfo) * 9 / 10 / 1024 ))
    [ "$GPUS" = 0 ] || gres="Gres=gpu:$GPUS "
    echo "NodeName=$NODE NodeAddr=127.0.0.1 ${topo}RealMemory=$mem_mb ${gres}State=UNKNOWN"
    for part in $PARTITIONS; do
        echo "PartitionName=$part Nodes=$NODE Default=$first MaxTime=INFINITE State=UP"
        first=NO
    done
}

write_if_changed() {  # path (content on stdin) -> exit 0 if it changed
    local new
    new=$(cat)
    if [ -f "$1" ] && [ "$(cat "$1")" = "$new" ]; then
        return 1
    fi
    if [ -f "$1" ] && ! head -n 1 "$1" | grep -qF "$STAMP"; then
        cp -p "$1" "$1.before-pww"            # someone else's file: keep it
        say "kept the previous $1 as $1.before-pww"
    fi
    printf '%s\n' "$new" > "$1"
    chmod 0644 "$1"
    say "wrote $1"
}

configure() {        # -> exit 0 if anything changed
    local changed=1 i
    install -d -m 0755 /etc/slurm /var/lib/slurm /var/lib/slurm/slurmd /var/log/slurm "$STATE"
    if id slurm > /dev/null 2>&1; then chown slurm:slurm /var/lib/slurm /var/log/slurm; fi
    install -d -m 0755 /var/lib/slurm/slurmctld
    if id slurm > /dev/null 2>&1; then chown slurm:slurm /var/lib/slurm/slurmctld; fi
    getent hosts "$NODE" > /dev/null || { echo "127.0.0.1 $NODE" >> /etc/hosts; say "$NODE added to /etc/hosts"; }
    slurm_conf | write_if_changed "$CONF" && changed=0
    if [ "$GPUS" != 0 ]; then
        install -d -m 0755 "$FAKE_DEV"
        for ((i = 0; i < GPUS; i++)); do
            [ -c "$FAKE_DEV/gpu$i" ] || mknod -m 0666 "$FAKE_DEV/gpu$i" c 1 3     # /dev/null's numbers
        done
        printf '%s\nNodeName=%s Name=gpu File=%s/gpu[0-%d]\n' "$STAMP" "$NODE" "$FAKE_DEV" $((GPUS - 1)) \
            | write_if_changed "$GRES" && changed=0
    elif [ -f "$GRES" ] && head -n 1 "$GRES" | grep -qF "$STAMP"; then
        rm -f "$GRES"
        changed=0
    fi
    return $changed
}

stop_daemon() {      # daemon: SIGTERM the PID we recorded, SIGKILL after 20 s
    local pid n
    pid=$(our_pid "$1")
    [ -n "$pid" ] || return 0
    say "stopping $1 (PID $pid)"
    kill -TERM "$pid"
    for ((n = 0; n < 100; n++)); do alive "$pid" || break; sleep 0.2; done
    if alive "$pid"; then
        say "$1 (PID $pid) still there after 20 s: SIGKILL"
        kill -KILL "$pid"
        for ((n = 0; n < 25; n++)); do alive "$pid" || break; sleep 0.2; done
    fi
    ! alive "$pid" || fail "could not stop $1 (PID $pid)"
    awk -v d="$1" '$1 != d' "$STATE/pids" > "$STATE/pids.new"
    mv "$STATE/pids.new" "$STATE/pids"
}

munge_works() { munge -n | unmunge > /dev/null; }
queue_empty() { [ -z "$(squeue -h -o %A 2>/dev/null)" ]; }
controller_up() { scontrol ping | grep -q UP; }

start_daemon() {     # daemon ready-check: start it unless it runs, record its PID
    local d=$1 check=$2 pid log
    pid=$(any_pid "$d")
    if [ -n "$pid" ]; then
        say "$d already running (PID $pid)"
        return 0
    fi
    rm -f "$(pidfile_of "$d")"
    if [ "$d" = munged ]; then runuser -u munge -- "$(bin_of munged)"; else "$(bin_of "$d")"; fi
    log=/var/log/slurm/$d.log
    [ "$d" != munged ] || log=/var/log/munge/munged.log
    local end=$(( $(date +%s) + 30 ))
    until pid=$(any_pid "$d") && [ -n "$pid" ] && $check > /dev/null 2>&1; do
        if [ "$(date +%s)" -ge "$end" ]; then
            tail -n 10 "$log" 2>/dev/null | sed 's/^/    /' >&2
            fail "$d did not come up within 30 s (its log above: $log)"
        fi
        sleep 0.3
    done
    echo "$d $pid" >> "$STATE/pids"
    say "started $d (PID $pid)"
}

node_state() { sinfo -h -N -n "$NODE" -o %T 2>/dev/null | head -n 1 | tr -d '*~#$@^-'; }
slurmd_since() {     # epoch of the node's last slurmd start, as the controller knows it
    date -d "$(scontrol show node "$NODE" 2>/dev/null | grep -o 'SlurmdStartTime=[^ ]*' | cut -d= -f2)" +%s 2>/dev/null \
        || echo 0
}

wait_idle() {        # since: the node idle and registered by a slurmd started at or after `since`
    local since=$1 end=$(( $(date +%s) + WAIT_S )) st resumed=0
    while :; do
        st=$(node_state)
        case $st in
            idle | mixed | allocated | completing)
                [ "$(slurmd_since)" -ge "$since" ] && break ;;
            down | drained | draining | fail | failing | inval | invalid)
                # a state saved by an earlier controller (other CPU or GPU counts) outlives it
                if [ "$resumed" = 0 ]; then
                    say "node $NODE is $st: resuming it"
                    scontrol update nodename="$NODE" state=resume || true
                    resumed=1
                fi ;;
        esac
        [ "$(date +%s)" -lt "$end" ] || fail "node $NODE is '$st', not idle, after $WAIT_S s; see /var/log/slurm/"
        sleep 0.5
    done
    say "node $NODE is $st: $(sinfo -h -o '%P' | tr '\n' ' ')"
}

start() {
    [ "$(id -u)" = 0 ] || fail "start needs root (packages, /etc/slurm, daemons)"
    [[ $CPUS =~ ^[1-9][0-9]*$ ]] || fail "LOCAL_SLURM_CPUS=$CPUS: give a positive integer"
    [[ $GPUS =~ ^[0-9]+$ ]] || fail "LOCAL_SLURM_GPUS=$GPUS: give an integer >= 0"
    [ -n "${PARTITIONS// /}" ] || fail "LOCAL_SLURM_PARTITIONS is empty: name at least one partition"
    install_packages
    prepare_munge
    if configure; then   # a new config: the daemons we started reread it by restarting
        stop_daemon slurmd
        stop_daemon slurmctld
    fi
    for d in slurmctld slurmd; do
        if [ -n "$(any_pid "$d")" ] && [ -z "$(our_pid "$d")" ]; then
            say "note: $d (PID $(any_pid "$d")) was started by someone else; it is used as it is"
        fi
    done
    touch "$STATE/pids"
    start_daemon munged munge_works
    start_daemon slurmctld controller_up
    local since=$(( $(date +%s) - 1 ))
    [ -n "$(any_pid slurmd)" ] && since=0       # already running: any registration counts
    start_daemon slurmd true
    wait_idle "$since"
}

# ------------------------------------------------------------------ stop, status
stop() {
    [ "$(id -u)" = 0 ] || fail "stop needs root"
    if [ ! -s "$STATE/pids" ]; then
        say "nothing to stop: no daemon recorded in $STATE/pids"
        return 0
    fi
    if [ -n "$(our_pid slurmctld)" ] && [ -n "$(squeue -h -o %A 2>/dev/null)" ]; then
        say "cancelling jobs $(squeue -h -o %A | tr '\n' ' ')"
        # shellcheck disable=SC2046  # one argument per job id
        scancel $(squeue -h -o %A) 2>/dev/null || true
        until_true 60 "empty queue" queue_empty
    fi
    for d in slurmd slurmctld munged; do stop_daemon "$d"; done
    rm -f "$STATE/pids"
    say "stopped"
}

status() {
    local d pid
    for d in $DAEMONS; do
        pid=$(our_pid "$d")
        if [ -n "$pid" ]; then say "$d: PID $pid (started here)"; else say "$d: not started here"; fi
    done
    if [ -n "$(any_pid slurmctld)" ]; then sinfo; fi
}

case ${1:-} in
    start) start ;;
    stop) stop ;;
    status) status ;;
    *) echo "usage: tests/local_slurm.sh start|stop|status   (settings: see the top of this file)" >&2; exit 2 ;;
esac
