# shellcheck shell=bash
# sites/lumi.sh - machine facts for LUMI-G (CSC, AMD MI250X). Sourced by env.sh; only exports.
#
# A LUMI-G node: 4 MI250X cards = 8 GCDs, each seen by ROCm as its own GPU, so 8 ranks
# per node. 64 cores in 8 L3 groups (CCDs) of 8; the first core of every CCD is kept for
# the OS, leaving 56 = 8 x 7 for us. Every value is a default: override it per job,
#   PWW_CONTAINER=/project/project_XXX/other.sif sbatch jobs/lumi_smoke.sh

export PWW_ACCEL=rocm
export PWW_PIN_VAR=ROCR_VISIBLE_DEVICES     # ROCm's own device mask; HIP sees one GCD per rank
export PWW_DEVICE=${PWW_DEVICE:-auto}
export PWW_RANKS_PER_NODE=${PWW_RANKS_PER_NODE:-8}
export PWW_CORES_PER_RANK=${PWW_CORES_PER_RANK:-7}
# dev-g: short debug turnaround (3 h cap); small-g: per-GPU billing, node sharing;
# standard-g: whole nodes, multi-node runs. small-g is often full: check with
#   sinfo -p dev-g,small-g,standard-g -o "%.12P %.15l %.14F"
export PWW_PARTITIONS="dev-g small-g standard-g"

# Storage. $HOME is 20 GB / 100k inodes: code only. Scratch is purged after inactivity,
# so the container and anything you keep go to project space (/project/<project>).
export PWW_PROJECT=${PWW_PROJECT:-project_462000226}
export PWW_SCRATCH=${PWW_SCRATCH:-/scratch/$PWW_PROJECT/${USER:-$(id -un)}}
export PWW_PROJECT_DIR=${PWW_PROJECT_DIR:-/project/$PWW_PROJECT}

# The runtime: our own image (containers/lumi-titan.def: ROCm 7.0, torch 2.10, torchtitan
# 0.2.2, the RCCL network plugin built in). LUMI's maintained PyTorch images carry a torch
# too old for torchtitan 0.2.2.
export PWW_RUNNER=${PWW_RUNNER:-container}
export PWW_CONTAINER=${PWW_CONTAINER:-$PWW_PROJECT_DIR/containers/lumi-titan.sif}
# What the singularity-AI-bindings module would bind, inlined so that login shells, batch
# scripts and containers all behave the same without `module load`: the Slurm spool, Cray's
# libfabric (CXI provider for Slingshot) under /opt/cray, the host's libcxi it links
# against (and libjansson), and the file systems. The image is Ubuntu, which does not
# search /usr/lib64: containers/lumi-env.sh puts /usr/lib64 and the newest
# /opt/cray/libfabric/<version>/lib64 on the library path inside the container.
export PWW_CONTAINER_BINDS=${PWW_CONTAINER_BINDS:-/var/spool/slurmd,/opt/cray,/usr/lib64/libcxi.so.1,/usr/lib64/libjansson.so.4,/pfs,/scratch,/projappl,/project,/flash,/appl}
# The RCCL network plugin (aws-ofi-nccl, librccl-net.so) is in the image. Set this to a
# host directory holding another build of it to use that one instead (bound and put first
# on the library path). Check which one ran: RUNBOOK.md, section 2 (NCCL_DEBUG=INFO lines).
export PWW_RCCL_PLUGIN_DIR=${PWW_RCCL_PLUGIN_DIR:-}
# Cray's libfabric directory; empty = the newest /opt/cray/libfabric/*/lib64 (the version
# changes with system updates: 1.15.2.0 before January 2026, 1.22.0 after).
export PWW_CRAY_LIBFABRIC=${PWW_CRAY_LIBFABRIC:-}

# RCCL / libfabric on Slingshot-11 (HPE Cassini NICs, /sys/class/cxi; sites/siteinfo.sh checks it).
export PWW_INTERCONNECT=${PWW_INTERCONNECT:-slingshot}
# hsn0..3 are the four Slingshot NICs (one per MI250X); without this RCCL's bootstrap may
# pick the management Ethernet and crawl.
export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-hsn0,hsn1,hsn2,hsn3}
# NCCL_NET_GDR_LEVEL: leave it unset, to RCCL's own topology detection. Forcing PHB or SYS
# (the old LUMI advice) hangs multi-node jobs with the ROCm 7.0 stack: LUMI AI Factory,
# github.com/lumi-ai-factory/laifs-container-recipes issue #30 (April 2026), where removing
# it fixed the LUMI AI Guide's multi-node examples. RUNBOOK.md section 2 says the same.
# The first collective of a group made with new_group() (DiLoCo's inner and outer groups,
# --diloco-replicas > 1) hangs on every rank at >= 4 nodes in most attempts with LUMI's
# torch 2.10 + ROCm 7.0 images; one group alone always passed (lumi-ai-factory/
# laifs-container-recipes issue #44, open). A federated site makes no group beyond the
# default one. smoke.py's first row times each group's first all-reduce and ends the job
# naming the group. The candidate mitigations the issue names, untested by us at scale,
# each one a switch (RUNBOOK.md section 2, "first collective"):
#   PWW_EAGER_PG_INIT: 1 = dist_env.py binds the process group to the GPU (device_id),
#     communicators made eagerly; 0 = lazily, at each group's first collective.
#   TORCH_NCCL_USE_COMM_NONBLOCKING=0: torch sets communicators up with blocking calls,
#     not in NCCL's non-blocking mode.
#   RCCL_MSCCL_ENABLE=0: RCCL without its MSCCL algorithm set.
export PWW_EAGER_PG_INIT=${PWW_EAGER_PG_INIT:-1}
export TORCH_NCCL_USE_COMM_NONBLOCKING=${TORCH_NCCL_USE_COMM_NONBLOCKING:-0}
export RCCL_MSCCL_ENABLE=${RCCL_MSCCL_ENABLE:-0}
# libfabric's memory-registration cache watches unmapped memory through userfaultfd;
# the default monitor has hung RCCL jobs in the LUMI AI Factory's images.
export FI_MR_CACHE_MONITOR=${FI_MR_CACHE_MONITOR:-userfaultfd}
# dataloader workers fork after libfabric registered memory: without the fork-safe flags
# the children corrupt the parent's registrations.
export CXI_FORK_SAFE=${CXI_FORK_SAFE:-1}
export CXI_FORK_SAFE_HP=${CXI_FORK_SAFE_HP:-1}
export FI_CXI_DISABLE_CQ_HUGETLB=${FI_CXI_DISABLE_CQ_HUGETLB:-1}
# large all-reduces overflow the default completion queue ("Cassini Event Queue overflow").
export FI_CXI_DEFAULT_CQ_SIZE=${FI_CXI_DEFAULT_CQ_SIZE:-131072}
# MIOpen keeps its kernel cache and tuning database in SQLite files that are not safe for
# two processes at once: concurrent ranks corrupt them and die. task_wrapper.sh gives each
# rank a private node-local copy of the persistent per-user cache under this root, and
# rank 0 publishes its copy back as a new generation when the job ends, so the next job
# reuses what the last one compiled and tuned (a cold cache makes the first epoch of a new
# shape ~25x slower). No file locks (they may not span nodes on Lustre), at most three
# generations of one rank's cache kept (LUMI's $HOME is 20 GB): task_wrapper.sh, "MIOpen's cache".
export PWW_MIOPEN_CACHE_ROOT=${PWW_MIOPEN_CACHE_ROOT:-${XDG_CACHE_HOME:-${HOME:-/tmp}/.cache}/pww/miopen}

# pww_cpu_bind [TASKS_PER_NODE]: the srun --cpu-bind value for this node shape.
# With 8 tasks per node, local rank i is bound to the 7 cores of the CCD nearest GCD i.
# The GCD -> CCD wiring is not in order (LUMI-G documentation): GCD 0..7 sit on
# CCD 6,7,2,3,0,1,4,5. Each mask is 0xfe shifted to its CCD: bit 0 of every byte (the
# CCD's first core) is the one left to the OS. A wrong order costs 10-30 % throughput
# silently; a mask on a partial node fails ("CPU binding outside of job step allocation"),
# so any other task count falls back to cores.
pww_cpu_bind() {
    local tasks=${1:-${SLURM_NTASKS_PER_NODE:-0}}
    if [ "$tasks" != 8 ]; then
        echo cores
        return
    fi
    local ccd zeros masks=""
    for ccd in 6 7 2 3 0 1 4 5; do
        zeros=$(printf '%*s' $((ccd * 2)) '')     # two hex digits per 8-core CCD
        masks+="0xfe${zeros// /0},"
    done
    echo "mask_cpu:${masks%,}"
}
