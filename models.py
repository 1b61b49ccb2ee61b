"""models.py - the models train.py builds: CIFAR ResNets (written here) and Qwen3 (torchtitan 0.2.2).

Runs on: compute nodes and CPUs, imported by train.py, tests and bench. Not started on its own.

Every model is built the same way, so a 32B model never exists unsharded anywhere:
    model = build_model(name, vocab_size=..., seq_len=...)   # on the meta device: shapes only
    model = parallelize(model, name, mode="fsdp"|"ddp", ...)  # FSDP2 per block, then the root
    materialize(model, device)                                # to_empty + init_weights, per shard

Names (train.py --model):
    resnet18 resnet34 resnet50          CIFAR stem: 3x3 conv, stride 1, no max-pool (32x32 inputs)
    qwen3-tiny                          2 layers, dim 64, byte vocabulary: tests and the local demo
    qwen3-debugmodel qwen3-0.6B qwen3-1.7B qwen3-8B qwen3-14B qwen3-32B   torchtitan's flavors
The Qwen3 vocabulary comes from the tokenizer (the corpus manifest), padded up to a
multiple of 64 rows; attention is SDPA (runs on CPU, flash/cuDNN kernels on GPUs).
Parameter names are those of the unwrapped module: activation checkpointing uses
the composable API, which does not insert wrapper modules, so checkpoints and the
deltas sent across sites carry the same names with or without it.
"""
import dataclasses
import math
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB_MULTIPLE = 64

# ---------------------------------------------------------------------------
# ResNet with the CIFAR stem
# ---------------------------------------------------------------------------


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))

    def last_bn(self):
        return self.bn2


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin, width, stride):
        super().__init__()
        cout = width * self.expansion
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return F.relu(out + self.shortcut(x))

    def last_bn(self):
        return self.bn3


class ResNet(nn.Module):
    """ResNet for 32x32 inputs: 3x3 stem at stride 1 and no max-pool (the ImageNet stem's
    7x7/2 conv + pool would shrink CIFAR images to 8x8 before the first stage)."""

    def __init__(self, block, layers, num_classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        cin, stages = 64, []
        for i, (n, width) in enumerate(zip(layers, (64, 128, 256, 512))):
            blocks = []
            for j in range(n):
                blocks.append(block(cin, width, 2 if (i > 0 and j == 0) else 1))
                cin = width * block.expansion
            stages.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.fc = nn.Linear(cin, num_classes)

    def stages(self):
        return [self.layer1, self.layer2, self.layer3, self.layer4]

    def blocks(self):
        return [b for s in self.stages() for b in s]

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        for stage in self.stages():
            x = stage(x)
        x = F.adaptive_avg_pool2d(x, 1).flatten(1)
        return self.fc(x)

    @torch.no_grad()
    def init_weights(self, buffer_device=None):
        """He init for convs; BN scale 1, shift 0, except the last BN of each residual
        branch at 0, so every block starts as the identity (Goyal et al. 2017: stabler at
        the large global batches both sites use, 1024 = 8 x 128 or 4 x 256)."""
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                m.reset_parameters()          # weight 1, bias 0, running stats reset
            elif isinstance(m, nn.Linear):
                m.reset_parameters()
        for b in self.blocks():
            nn.init.zeros_(b.last_bn().weight)


RESNETS = {"resnet18": (BasicBlock, [2, 2, 2, 2]),
           "resnet34": (BasicBlock, [3, 4, 6, 3]),
           "resnet50": (Bottleneck, [3, 4, 6, 3])}

# ---------------------------------------------------------------------------
# Qwen3 through torchtitan
# ---------------------------------------------------------------------------

# --model name -> torchtitan 0.2.2 flavor in torchtitan.models.qwen3.qwen3_args
# ("tiny" is ours, below). 4B and the MoE flavors exist there too; add a row to use them.
QWEN3_FLAVORS = {"qwen3-tiny": "tiny", "qwen3-debugmodel": "debugmodel", "qwen3-0.6B": "0.6B",
                 "qwen3-1.7B": "1.7B", "qwen3-8B": "8B", "qwen3-14B": "14B", "qwen3-32B": "32B"}
MODEL_NAMES = tuple(RESNETS) + tuple(QWEN3_FLAVORS)


def is_llm(name):
    return name in QWEN3_FLAVORS


def pad_vocab(n, multiple=VOCAB_MULTIPLE):
    """Round the tokenizer's vocabulary up (259 -> 320, 151,669 -> 151,680): aligned matmuls."""
    return int(math.ceil(n / multiple) * multiple)


def qwen3_args(name, vocab_size, seq_len):
    """torchtitan Qwen3ModelArgs for --model NAME with the tokenizer's (padded) vocabulary."""
    from torchtitan.models.qwen3 import qwen3_args as flavors, Qwen3ModelArgs
    flavor = QWEN3_FLAVORS[name]
    if flavor == "tiny":
        base = Qwen3ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                              hidden_dim=192, qk_norm=True, rope_theta=10000,
                              enable_weight_tying=True)
    else:
        base = flavors[flavor]
    return dataclasses.replace(base, vocab_size=pad_vocab(vocab_size), max_seq_len=seq_len,
                               attn_type="sdpa", attn_mask_type="causal")


def build_model(name, vocab_size=None, seq_len=None, num_classes=10):
    """The model on the meta device (no memory): parallelize() it, then materialize() it."""
    with torch.device("meta"):
        if name in RESNETS:
            block, layers = RESNETS[name]
            return ResNet(block, layers, num_classes)
        if name in QWEN3_FLAVORS:
            if not vocab_size or not seq_len:
                raise ValueError(f"--model {name} needs the vocabulary and --seq-len from a "
                                 f"tokenized corpus: pass --data <manifest.json>")
            from torchtitan.models.qwen3 import Qwen3Model
            return Qwen3Model(qwen3_args(name, vocab_size, seq_len))
    raise ValueError(f"--model {name!r}: use one of {', '.join(MODEL_NAMES)}")


def blocks_of(model):
    """The units FSDP2 shards one by one and activation checkpointing recomputes:
    transformer blocks, or ResNet stages."""
    if isinstance(model, ResNet):
        return model.stages()
    return list(model.layers.values())


# ---------------------------------------------------------------------------
# Parallelism: FSDP2 or DDP over a process group (the replica's inner group under DiLoCo)
# ---------------------------------------------------------------------------

def parallelize(model, mode, device, group=None, mesh=None, param_dtype=None, activation_checkpointing=False):
    """Wrap or shard a meta-device model; returns the module to train.

    mode "fsdp": fully_shard every block, then the root (embeddings, final norm and
    the tied output head share the root's group). param_dtype=torch.bfloat16 gives
    MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32): bf16 compute and
    all-gathers, fp32 gradient reduction and fp32 master weights.
    mode "ddp": materialize first (DDP broadcasts rank 0's values at construction),
    then DistributedDataParallel over `group` (left unwrapped when the group has one rank).
    """
    if activation_checkpointing:
        from torch.distributed._composable import checkpoint
        for block in blocks_of(model):
            checkpoint(block)
    if mode == "fsdp":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        if mesh is None:
            from torch.distributed.device_mesh import DeviceMesh
            mesh = DeviceMesh.from_group(group or torch.distributed.group.WORLD, device.type)
        mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32) \
            if param_dtype is not None else MixedPrecisionPolicy()
        for block in blocks_of(model):
            fully_shard(block, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        materialize(model, device)
        return model
    if mode == "ddp":
        materialize(model, device)
        if torch.distributed.get_world_size(group) == 1:
            return model          # nothing to synchronise: DDP would only add a 1-rank all-reduce
        ids = [device.index] if device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(model, device_ids=ids, process_group=group)
    raise ValueError(f"--parallel {mode!r}: use ddp or fsdp")


@torch.no_grad()
def materialize(model, device):
    """Allocate the (sharded) meta parameters on `device`, then run the model's own init."""
    model.to_empty(device=device)
    with warnings.catch_warnings():
        # DTensor's coordinated RNG is GPU-only; on a CPU mesh each shard draws from the
        # local generator (seeded alike on every rank), which is what tests want anyway.
        warnings.filterwarnings("ignore", message="DTensor random operators")
        model.init_weights(buffer_device=device)
    return model


def unwrap(model):
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


# ---------------------------------------------------------------------------
# Sizes and FLOPs (for MFU)
# ---------------------------------------------------------------------------

def count_params(model):
    """Unique parameters (a tied embedding/output weight counts once); works on meta models."""
    return sum(p.numel() for p in unwrap(model).parameters())


def llm_flops_per_token(args, n_params):
    """Training FLOPs per token: 6 x (matmul parameters) + the attention term.

    Matmul parameters are all parameters but the embedding lookup, plus the output
    head (V x d), which is a real matmul even when tied to the embedding. Attention
    scores and values add 6 x layers x heads x 2 x head_dim x seq_len (as
    torchtitan counts it, without halving for the causal mask).
    """
    emb = args.vocab_size * args.dim
    matmul = n_params - emb + (emb if args.enable_weight_tying else 0)
    return 6 * matmul + 6 * args.n_layers * args.n_heads * 2 * args.head_dim * args.max_seq_len


def resnet_flops_per_image(name, num_classes=10):
    """Training FLOPs per 32x32 image (3 x forward: backward costs about twice the forward).

    Counts conv and linear multiply-adds with hooks on a forward over the meta device:
    shapes only, no memory, no compute.
    """
    model, macs = build_model(name, num_classes=num_classes), [0]

    def hook(m, inp, out):
        if isinstance(m, nn.Conv2d):
            macs[0] += out.numel() * (m.in_channels // m.groups) * m.kernel_size[0] * m.kernel_size[1]
        else:
            macs[0] += m.in_features * m.out_features * out.shape[0]

    for m in model.modules():
        if isinstance(m, (nn.Conv2d, nn.Linear)):
            m.register_forward_hook(hook)
    model(torch.empty(1, 3, 32, 32, device="meta"))
    return 3 * 2 * macs[0]
