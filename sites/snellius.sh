# shellcheck shell=bash
# sites/snellius.sh - machine facts for Snellius (SURF, NVIDIA H100 / A100). Sourced by
# env.sh; only exports. Every value is a default: override it per job.
#
# gpu_h100: 4 x H100 and 64 cores (4 sockets x 16) per node, one GPU per socket.
# gpu_a100: 4 x A100 and 72 cores (4 x 18): override both together,
#   sbatch -p gpu_a100 --cpus-per-task=18 jobs/snellius_cifar_1node.sh
# There is no partition called `gpu`. Jobs of <= 1 h go to a short-job pool and start much
# sooner; 1 GPU + 16 cores is nearly always free, a whole node often waits over an hour.

export PWW_ACCEL=cuda
export PWW_PIN_VAR=CUDA_VISIBLE_DEVICES
export PWW_DEVICE=${PWW_DEVICE:-auto}
export PWW_RANKS_PER_NODE=${PWW_RANKS_PER_NODE:-4}
export PWW_CORES_PER_RANK=${PWW_CORES_PER_RANK:-16}
export PWW_PARTITIONS="gpu_h100 gpu_a100"

# Storage: /scratch-shared is 8 TiB but purged at ~14 days on file age. Point
# PWW_SCRATCH at a /projects space for anything you mean to keep.
export PWW_SCRATCH=${PWW_SCRATCH:-/scratch-shared/${USER:-$(id -un)}}

# The runtime: a venv built once by jobs/snellius_setup_venv.sh. Kept in $HOME, not on
# /scratch-shared: an environment that is purged after two idle weeks is worse than none.
# The module tree's PyTorch (2.1.2) predates device_mesh and DCP's state_dict API.
export PWW_RUNNER=${PWW_RUNNER:-venv}
export PWW_VENV=${PWW_VENV:-$HOME/venvs/pww-snellius}

# InfiniBand (mlx5 HCAs, /sys/class/infiniband; sites/siteinfo.sh checks it).
export PWW_INTERCONNECT=${PWW_INTERCONNECT:-infiniband}
# NCCL finds InfiniBand unaided here (300.8 GB/s in a node, 133.1 GB/s across two).
# If the smoke test shows single-digit GB/s across nodes, NCCL fell back to TCP: set the
# IB-side interface explicitly (names are ibp*/mlx5 on Snellius, not ib0):
# export NCCL_SOCKET_IFNAME=ibp
# export NCCL_IB_HCA=mlx5

# No --mem=0: memory comes with the GPUs (180 GiB per H100, 120 GiB per A100).
# CPU binding needs no mask: one GPU per socket, so block:block + cores is NUMA-correct.
pww_cpu_bind() {
    echo cores
}
