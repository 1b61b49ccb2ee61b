#!/usr/bin/env bash
# bench/gpu_check.sh - the GPU path on ONE GPU, offline, in under 10 minutes.
#
#   bench/gpu_check.sh                                     # GPU 0, CUDA or ROCm; python from PATH
#   PYTHON=/path/to/venv/bin/python bench/gpu_check.sh
#   GPU_CHECK_WHEELS=wheelhouse bench/gpu_check.sh         # torchtitan & co. from local wheels, no network
#   GPU_CHECK_DEVICE=cpu GPU_CHECK_QUICK=1 bench/gpu_check.sh   # the same runs, tiny, on the CPU (a test)
#
# Runs on: any machine with one GPU and a torch built for it (plus numpy, pyyaml and
# torchtitan 0.2.2 with what it imports; GPU_CHECK_WHEELS names a directory of wheels to
# install them from, offline, into the scratch directory). Needs no network, no Slurm, no
# port beyond loopback. Writes only under GPU_CHECK_OUT (default: a fresh temp directory,
# removed at the end unless GPU_CHECK_KEEP=1).
#
# Each run is its own process, in this order; the first failure stops the script with
# "GPU CHECK FAILED: <run>" and the tail of that run's log, exit 1:
#   preflight     torch, torchtitan and the device: versions, name, bf16 support
#   smoke         smoke.py: device, exact all-reduce, network, the SDPA kernel of Qwen3's GQA
#   staging       pinned host->device copies (train_step.HostToDevice) equal plain copies, 16 batches
#   diloco-cpu    DiLoCo's outer step with theta in pinned host memory equals the on-device one
#                 (within 8 ulp: FMA contraction may differ between the CPU's and GPU's kernels)
#   wire-torch    wire_torch.py's int8/int4/int2 encode and apply on the device == wire.py's numpy, bit for bit
#   encode-on     fedphase.FedMomCarrier(encode_on="device"), train.py --encode-on device's path, on whole
#                 tensors (DDP) and on FSDP2 shards (one rank: shard_wire's per-shard encode): three int4
#                 rounds with error feedback give the host path's delta file and residual, bit for bit,
#                 and an int4 update added on the device gives wire.apply_update's digest
#   resnet-bf16   ResNet-18, DDP path, bf16 autocast, a generated CIFAR-10
#   resnet-fp16   the same in fp16 with a GradScaler
#   resnet-fsdp   ResNet-18 under FSDP2, bf16 parameters (BatchNorm kept in fp32)
#   qwen-fsdp     Qwen3-0.6B (byte vocabulary) under FSDP2, bf16, activation checkpointing,
#                 fused AdamW, a sharded DCP checkpoint
#   qwen-resume   the same run continued from that checkpoint with --resume auto
#   qwen-compile  Qwen3-0.6B with --compile (torch.compile per block)
#   qwen-accum    grad-accum 4: reduce-scatter every micro-batch (default) ...
#   qwen-defer    ... and --fsdp-defer-grad-sync: both paths run, peak memory side by side
#                 (on one GPU a shard is the whole gradient, so the two peaks match; the
#                 saving appears from 2 ranks on: bench/fsdp_grad_accum_memory.py)
# Per run it prints steps, step time (after the first logged interval), tokens/s or
# images/s, MFU against the device's bf16 peak (metrics.PEAK_BF16_FLOPS), and peak memory;
# then GPU CHECK PASSED.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python3}
DEVICE=${GPU_CHECK_DEVICE:-auto}
QUICK=${GPU_CHECK_QUICK:-0}
RUN_TIMEOUT=${GPU_CHECK_RUN_TIMEOUT:-300}        # seconds per run: a hang fails, it does not wait
OUT=${GPU_CHECK_OUT:-$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX")}
mkdir -p "$OUT"
if [ -z "${GPU_CHECK_OUT:-}" ] && [ "${GPU_CHECK_KEEP:-0}" != 1 ]; then
    trap 'rm -rf "$OUT"' EXIT
fi
cd "$ROOT"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4} GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-lo}
unset RANK WORLD_SIZE LOCAL_RANK MASTER_ADDR MASTER_PORT SLURM_PROCID SLURM_NTASKS SLURM_JOB_ID
EXTRA_ARGS=()
read -r -a EXTRA_ARGS <<< "${GPU_CHECK_EXTRA_TRAIN_ARGS:-}"   # appended to every train.py run

if [ "$QUICK" = 1 ]; then        # CPU-sized: the runs, the summaries and the failures, not speed
    SEQ=32 FILES=20 QWEN=qwen3-tiny QB=4 QSTEPS=4 RB=8 RSTEPS=2 NTRAIN=64 NTEST=16 EVALW=8
else
    SEQ=2048 FILES=400 QWEN=qwen3-0.6B QB=4 QSTEPS=20 RB=256 RSTEPS=20 NTRAIN=5120 NTEST=512 EVALW=16
fi

fail() {
    echo "GPU CHECK FAILED: $1" >&2
    [ -f "${2:-}" ] && { echo "--- last lines of $2:" >&2; tail -n 30 "$2" >&2; }
    exit 1
}

# run NAME CMD...: CMD with its output in $OUT/NAME.log; a non-zero exit or a timeout fails
run() {
    local name=$1
    shift
    echo "== $name"
    local rc=0
    timeout "$RUN_TIMEOUT" "$@" > "$OUT/$name.log" 2>&1 || rc=$?
    [ "$rc" = 0 ] || fail "$name (exit $rc$([ "$rc" = 124 ] && echo ", timed out after ${RUN_TIMEOUT} s"))" "$OUT/$name.log"
}

# summary NAME RUN_DIR SKIP: one line from the run's metrics.jsonl rows after the first SKIP
# (an earlier run's, when this one resumed it), leaving out the first train row
summary() {
    "$PYTHON" - "$1" "$2" "$3" <<'EOF' || fail "$1: no usable metrics in $2" "$2/train.log"
import json, sys
name, run, skip = sys.argv[1], sys.argv[2], int(sys.argv[3])
rows = [json.loads(l) for l in open(f"{run}/metrics.jsonl")][skip:]
train = [r for r in rows if r["split"] == "train"]
if not train:
    sys.exit(f"{name}: no train rows")
steady = train[1:] or train
rate_key = "tokens_per_s" if "tokens_per_s" in train[-1] else "img_per_s"
mean = lambda k: sum(r[k] for r in steady) / len(steady)
mfu = [r["mfu"] for r in steady if r.get("mfu") is not None]
loss = [r["loss"] for r in train]
if any(l != l for l in loss):
    sys.exit(f"{name}: loss is NaN")
attn = next((l.split(", attention ", 1)[1].split(",")[0].strip() for l in open(f"{run}/train.log")
             if ", attention " in l), "-")
print(f"   {name:<13} steps {train[-1]['step']:>3}  step {mean('step_ms'):8.1f} ms  "
      f"{rate_key.replace('_per_s', '')}/s {mean(rate_key):10.1f}  "
      f"mfu {f'{sum(mfu) / len(mfu):.3f}' if mfu else '   -'}  "
      f"peak {max(r['peak_mem_gib'] for r in train):6.2f} GiB  loss {loss[0]:.3f} -> {loss[-1]:.3f}  attention {attn}")
EOF
}

# train_py NAME ARGS...: one train.py run on the device, in run directory ${RUN_DIR:-NAME},
# then its summary line
train_py() {
    local name=$1 dir=${RUN_DIR:-$1} before=0
    shift
    [ -f "$OUT/runs/$dir/metrics.jsonl" ] && before=$(wc -l < "$OUT/runs/$dir/metrics.jsonl")
    run "$name" "$PYTHON" train.py --device "$DEVICE" --runs-dir "$OUT/runs" --run-name "$dir" \
        --log-every 2 "$@" "${EXTRA_ARGS[@]}"
    summary "$name" "$OUT/runs/$dir" "$before"
}

# -- preflight: the stack, offline
if [ -n "${GPU_CHECK_WHEELS:-}" ]; then
    run wheels "$PYTHON" -m pip install --no-index --find-links "$GPU_CHECK_WHEELS" --target "$OUT/site" \
        torchtitan numpy pyyaml
    export PYTHONPATH="$OUT/site${PYTHONPATH:+:$PYTHONPATH}"
fi
run preflight "$PYTHON" - "$DEVICE" <<'EOF'
import sys
import torch, torchtitan.models.qwen3, numpy, yaml
import dist_env
import metrics
import train
accel = dist_env.detect_accel(sys.argv[1])
name = "cpu" if accel == "cpu" else torch.cuda.get_device_name(0)
print(f"torch {torch.__version__} (cuda {torch.version.cuda}, hip {torch.version.hip}), torchtitan "
      f"{torchtitan.__version__}, device {name} [{accel}], bf16 peak "
      f"{metrics.peak_flops_for(name, torch.cuda.get_device_properties(0).multi_processor_count) if accel != 'cpu' else None}")
if accel != "cpu" and not torch.cuda.is_bf16_supported():
    sys.exit("this GPU has no bf16")
EOF
sed 's/^/   /' "$OUT/preflight.log"

# -- the infrastructure
run smoke "$PYTHON" smoke.py --device "$DEVICE" --diloco-replicas 1
grep -E "^(network|attention kernel|all-reduce exact)" "$OUT/smoke.log" | sed 's/^/   /'

run staging "$PYTHON" - "$DEVICE" <<'EOF'
import sys, numpy as np, torch, dist_env, train_step
d = dist_env.init_distributed(sys.argv[1])
stage, rng = train_step.HostToDevice(d.device), np.random.default_rng(0)
arrays = [rng.integers(0, 50000, size=(4, 2049 if i % 5 else 1025)) for i in range(16)]
outs = [stage(a) for a in arrays]                  # all in flight before any is read
for a, o in zip(arrays, outs):
    assert torch.equal(o.cpu(), torch.from_numpy(a)), "a staged batch was overwritten in flight"
print(f"16 batches staged ({'pinned, non_blocking' if d.device.type == 'cuda' else 'cpu: no copy'}): equal")
EOF
sed 's/^/   /' "$OUT/staging.log"

run diloco-cpu "$PYTHON" - "$DEVICE" <<'EOF'
import sys, torch, diloco, dist_env
from outer_state import OUTER_LR, OUTER_MOMENTUM
d = dist_env.init_distributed(sys.argv[1])
lay = diloco.ReplicaLayout.build(1, 0, 1)
def outer_run(where):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 8)).to(d.device)
    o = diloco.DiLoCo(m, lay, diloco.DiLoCoConfig(inner_steps=2, outer_device=where, outer_lr=OUTER_LR,
                                                 outer_momentum=OUTER_MOMENTUM))
    for step in range(6):
        with torch.no_grad():
            for p in m.parameters():
                p.add_(0.01 * (step + 1))
        o.after_inner_step()
    return o, [t.detach().cpu().clone() for t in o.theta]
pinned, a = outer_run("cpu")
_, b = outer_run("same")
# not bit for bit: the CPU's and the GPU's SGD kernels may contract multiply-adds (FMA)
# differently; 3 Nesterov steps of a few roundings each stay within a few ulp of theta
ulps = max(float(((x - y).abs() / torch.finfo(torch.float32).eps / y.abs().clamp_min(1e-30)).max())
           for x, y in zip(a, b))
assert ulps <= 8, f"theta differs between host and device outer steps by {ulps:.1f} ulp"
on_gpu = d.device.type == "cuda"
assert pinned.pinned == on_gpu and (not on_gpu or pinned.theta[0].is_pinned()), "theta is not in pinned memory"
print(f"3 outer steps, theta on the host ({'pinned' if on_gpu else 'cpu run'}) == theta on the device "
      f"within {ulps:.1f} ulp")
EOF
sed 's/^/   /' "$OUT/diloco-cpu.log"

run wire-torch "$PYTHON" - "$DEVICE" <<'EOF'
import sys, time, numpy as np, torch, dist_env, wire, wire_torch
d = dist_env.init_distributed(sys.argv[1])
rng, cases, t_dev = np.random.default_rng(0), 0, 0.0
shapes = [(7, 301), (2, 9001), (3, 129), (1, 127), (), (0, 4), (3072, 1024), (4099, 257)]
for codec in (wire.Codec("int4"), wire.Codec("int8"), wire.Codec("int4", block=65), wire.Codec("int2"),
              wire.Codec("int2", block=65)):
    for shape in shapes:
        x = rng.standard_normal(shape).astype(np.float32)
        x.reshape(-1)[::5] *= np.float32(1e-40)                       # subnormals
        x.reshape(-1)[:x.size // 3] = 0                               # zero blocks
        want, want_sent = codec.encode(x, threads=1)
        xd = torch.from_numpy(x.copy()).to(d.device)
        t0 = time.perf_counter()
        parts, sent = wire_torch.encode(codec, xd)
        theta = wire_torch.apply_(torch.ones_like(xd), codec, parts[""], parts["#scale"])
        if d.device.type == "cuda":
            torch.cuda.synchronize()
        t_dev += time.perf_counter() - t0
        got = wire_torch.to_numpy(parts)
        for k in want:
            assert got[k].tobytes() == want[k].tobytes(), f"{codec.fmt} {shape} part {k!r}: device != numpy"
        assert sent.cpu().numpy().tobytes() == want_sent.tobytes(), f"{codec.fmt} {shape}: decoded values differ"
        ref = wire.add_update(np.ones(shape, np.float32), want_sent)
        assert theta.cpu().numpy().tobytes() == ref.tobytes(), f"{codec.fmt} {shape}: applied theta differs"
        cases += 1
print(f"{cases} tensors: encode and apply on {d.device.type} == wire.py (numpy) bit for bit ({t_dev:.2f} s on the device)")
EOF
sed 's/^/   /' "$OUT/wire-torch.log"

run encode-on "$PYTHON" - "$DEVICE" "$OUT/encode-on" <<'EOF'
import os, sys, torch, dist_env, fedphase, tensorio, wire
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
d = dist_env.init_distributed(sys.argv[1])
g = torch.Generator().manual_seed(0)
shapes = {"embed": (1031, 64), "wq": (256, 192), "odd": (7, 301), "norm": (64,)}
deltas = {n: torch.randn(s, generator=g) for n, s in shapes.items()}

class Params(torch.nn.Module):
    def __init__(self):
        super().__init__()
        for n, s in shapes.items():
            self.register_parameter(n, torch.nn.Parameter(torch.zeros(s, device=d.device)))

    def forward(self, x):
        return x

def residual(wd):
    """The residual the last delta left, whole: rank 0's file, or the per-rank file's tensors."""
    name = "residual-next.safetensors" if os.path.exists(os.path.join(wd, "residual-next.safetensors")) \
        else "residual-rank0-next.safetensors"
    with tensorio.TensorReader(os.path.join(wd, name)) as r:
        return {n: r.read(n).tobytes() for n in r.names}

rounds = 0
for label, sharded in (("replicated", False), ("fsdp2", True)):
    m = Params()
    if sharded:          # one rank: each shard is the whole tensor, and the per-shard path runs on it
        fully_shard(m, mesh=DeviceMesh.from_group(dist.group.WORLD, d.device.type))
    names, params = list(shapes), [dict(m.named_parameters())[n] for n in shapes]
    local = [deltas[n].to(d.device) for n in names]
    files = {}
    for where in ("host", "device"):
        wd = os.path.join(sys.argv[2], label, where)
        c = fedphase.FedMomCarrier(None, wd, "int4", fresh=True, log=lambda m: None, encode_on=where)
        for rnd in (0, 1, 2):             # 1 and 2 carry what the one before left owed
            c.round = rnd
            c.write_delta(names, params, [x * (rnd + 1) for x in local])
            files[where, rnd] = (open(c.delta_path, "rb").read(), residual(wd))
            c.residual.settle(rnd, rnd + 1, "")
    if sharded:
        assert all(p.per_rank for n, p in zip(names, c.places) if n != "norm"), "2-D tensors are not encoded per shard"
    for rnd in (0, 1, 2):
        assert files["host", rnd][0] == files["device", rnd][0], f"{label} round {rnd}: the device's int4 delta differs"
        assert files["host", rnd][1] == files["device", rnd][1], f"{label} round {rnd}: the device's residual differs"
        rounds += 1
    # theta_global's int4 update added on the device: the aggregator's bits (its digest)
    wd = os.path.join(sys.argv[2], label, "apply")
    os.makedirs(wd)
    theta = {n: torch.randn(s, generator=g) for n, s in shapes.items()}
    tensorio.save_torch(theta, os.path.join(wd, "theta.safetensors"))
    want = wire.Digest()
    with wire.WireWriter(os.path.join(wd, "update.safetensors"), list(shapes.items()), wire.Codec("int4")) as w:
        for n in names:
            want.add(n, wire.add_update(theta[n].numpy(), w.write(n, 1e-3 * theta[n].numpy() ** 3)))
    on_dev = [theta[n].to(d.device) for n in names]
    c.apply_update(names, params, on_dev, os.path.join(wd, "update.safetensors"))
    have = wire.Digest()
    for n, t in zip(names, on_dev):
        have.add(n, t.cpu().numpy())
    assert have.hexdigest() == want.hexdigest(), f"{label}: the update added on the device is not the aggregator's theta"
print(f"{rounds} int4 rounds with error feedback encoded on {d.device.type}, replicated and FSDP2-sharded "
      f"(wire_torch, shard_wire): delta and residual == the host path's (numpy), bit for bit; "
      f"the int4 update added on {d.device.type} == wire.apply_update's digest")
EOF
sed 's/^/   /' "$OUT/encode-on.log"

# -- the models
"$PYTHON" -c "import data; data.write_fake_cifar('$OUT/cifar', n_train=$NTRAIN, n_test=$NTEST, seed=0)"
"$PYTHON" -c "import tokenize_corpus as tc; tc.tokenize(tc.TokenizeConfig(inputs=[], out='$OUT/tok', seq_len=$SEQ, max_files=$FILES, heldout_windows=64, progress=False))" > /dev/null
CIFAR=(--model resnet18 --data "$OUT/cifar" --batch-size "$RB" --steps "$RSTEPS")
QWEN3=(--model "$QWEN" --data "$OUT/tok/manifest.json" --batch-size "$QB" --parallel fsdp --eval-windows "$EVALW")
echo "   runs (step time and rates exclude the first logged interval):"
train_py resnet-bf16 "${CIFAR[@]}" --dtype bf16
train_py resnet-fp16 "${CIFAR[@]}" --dtype fp16
train_py resnet-fsdp "${CIFAR[@]}" --dtype bf16 --parallel fsdp
train_py qwen-fsdp "${QWEN3[@]}" --dtype bf16 --steps "$QSTEPS" --activation-checkpointing \
    --sharded-checkpoint --ckpt-every "$QSTEPS"
RUN_DIR=qwen-fsdp train_py qwen-resume "${QWEN3[@]}" --dtype bf16 --steps $((QSTEPS + 4)) \
    --activation-checkpointing --sharded-checkpoint --resume auto
grep -q "resumed at step $QSTEPS" "$OUT/qwen-resume.log" \
    || fail "qwen-resume: did not resume at step $QSTEPS from the DCP checkpoint" "$OUT/qwen-resume.log"
train_py qwen-compile "${QWEN3[@]}" --dtype bf16 --steps "$QSTEPS" --compile
train_py qwen-accum "${QWEN3[@]}" --dtype bf16 --steps 6 --grad-accum 4
train_py qwen-defer "${QWEN3[@]}" --dtype bf16 --steps 6 --grad-accum 4 --fsdp-defer-grad-sync
echo "GPU CHECK PASSED ($(basename "$OUT"))"
