# shellcheck shell=bash
# sites/local.sh - this kind of machine: a CPU-only box (a laptop, a CI runner, a VM with a
# single-node Slurm for testing the job scripts). Sourced by env.sh; only exports.
# The device is forced to cpu (gloo) whatever GPU GRES the local Slurm pretends to have.

export PWW_ACCEL=cpu
# A local Slurm with fake GPU GRES hands each job CUDA_VISIBLE_DEVICES like a real one;
# pinning it exercises task_wrapper.sh's per-rank selection. torch on the CPU ignores it.
export PWW_PIN_VAR=CUDA_VISIBLE_DEVICES
export PWW_DEVICE=cpu
_pww_nproc=$(nproc 2>/dev/null || echo 2)
export PWW_RANKS_PER_NODE=${PWW_RANKS_PER_NODE:-$(( _pww_nproc < 4 ? _pww_nproc : 4 ))}
export PWW_CORES_PER_RANK=${PWW_CORES_PER_RANK:-1}
unset _pww_nproc
export PWW_PARTITIONS="debug"
export PWW_INTERCONNECT=${PWW_INTERCONNECT:-none}          # one node: no fabric between nodes
export PWW_SCRATCH=${PWW_SCRATCH:-$PWW_ROOT}
export PWW_RUNNER=${PWW_RUNNER:-venv}
export PWW_VENV=${PWW_VENV:-$PWW_ROOT/.venv}
# A LUMI-shaped job puts 8 ranks on this machine's few cores; with torch's default of
# one OpenMP thread per core each, the ranks' threads oversubscribe the cores many
# times over. One thread per rank keeps the tiny jobs from fighting for them.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

# The jobs' real configs are hours of GPU work; here they shrink to a few CPU steps.
# Flags after the script name still win (sbatch jobs/lumi_cifar_debug.sh --steps 5).
export PWW_CIFAR_ARGS=${PWW_CIFAR_ARGS-"--batch-size 8 --steps 2"}
export PWW_TITAN_CONFIG=${PWW_TITAN_CONFIG:-configs/qwen3_tiny.yaml}
export PWW_TITAN_ARGS=${PWW_TITAN_ARGS-"--steps 8 --diloco-inner-steps 4 --eval-every 0 --eval-windows 8"}

pww_cpu_bind() {
    echo none
}
