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

# The runtime: our own image (containers/lumi-titan.def). LUMI's maintained PyTorch image
# carries torch 2.7.1, too old for torchtitan 0.2.2.
export PWW_RUNNER=${PWW_RUNNER:-container}
export PWW_CONTAINER=${PWW_CONTAINER:-$PWW_PROJECT_DIR/containers/lumi-titan.sif}
# What the singularity-AI-bindings module would bind, inlined so that login shells, batch
# scripts and containers all behave the same without `module load`: the Slurm spool, Cray's
# libfabric (CXI provider for Slingshot) and the two host libraries it links against.
export PWW_CONTAINER_BINDS=${PWW_CONTAINER_BINDS:-/var/spool/slurmd,/opt/cray,/usr/lib64/libcxi.so.1,/usr/lib64/libjansson.so.4,/pfs,/scratch,/projappl,/project,/flash,/appl}
# RCCL reaches Slingshot through the aws-ofi-rccl plugin (librccl-net.so). Point this at a
# directory holding it (e.g. the lib/ of LUMI's aws-ofi-rccl module) to put it on the
# container's library path. Without it RCCL falls back to TCP sockets over hsn*: it works,
# but the smoke test's cross-node all-reduce drops to single-digit GB/s (vs 88 GB/s).
export PWW_RCCL_PLUGIN_DIR=${PWW_RCCL_PLUGIN_DIR:-}
export PWW_CRAY_LIBFABRIC=${PWW_CRAY_LIBFABRIC:-/opt/cray/libfabric/1.15.2.0/lib64}

# RCCL / libfabric on Slingshot-11.
# hsn0..3 are the four Slingshot NICs (one per MI250X); without this RCCL's bootstrap may
# pick the management Ethernet and crawl.
export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-hsn0,hsn1,hsn2,hsn3}
# allow GPU-direct RDMA when GPU and NIC share a PCIe host bridge (PHB), the LUMI-G layout.
export NCCL_NET_GDR_LEVEL=${NCCL_NET_GDR_LEVEL:-PHB}
# dataloader workers fork after libfabric registered memory: without the fork-safe flags
# the children corrupt the parent's registrations.
export CXI_FORK_SAFE=${CXI_FORK_SAFE:-1}
export CXI_FORK_SAFE_HP=${CXI_FORK_SAFE_HP:-1}
export FI_CXI_DISABLE_CQ_HUGETLB=${FI_CXI_DISABLE_CQ_HUGETLB:-1}
# large all-reduces overflow the default completion queue ("Cassini Event Queue overflow").
export FI_CXI_DEFAULT_CQ_SIZE=${FI_CXI_DEFAULT_CQ_SIZE:-131072}
# MIOpen keeps its kernel database in $HOME by default and it is not multi-process safe:
# concurrent ranks corrupt the SQLite file and die. task_wrapper.sh fills in {job} and {rank};
# node-local /tmp, so the first steps of a new shape are slow (autotuning) in every job.
export PWW_MIOPEN_CACHE_TEMPLATE=${PWW_MIOPEN_CACHE_TEMPLATE:-"/tmp/${USER:-$(id -un)}-miopen-{job}-{rank}"}

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
