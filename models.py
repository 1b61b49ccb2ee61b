"""models.py - the models train.py builds: CIFAR ResNets (written here) and Qwen3 (torchtitan 0.2.2).

Runs on: compute nodes and CPUs, imported by train.py, tests and bench. Not started on its own.

Every model is built the same way, so a 32B model never exists unsharded anywhere:
    model = build_model(name, vocab_size=..., seq_len=...)   # on the meta device: shapes only
    model = parallelize(model, name, mode="fsdp"|"ddp", ...)  # FSDP2 per block, then the root
    materialize(model, device)                                # to_empty + init_weights, per shard

Names (train.py --model):
    resnet18 resnet34 resnet50          CIFAR stem: 3x3 conv, stride 1, no max-pool (32x32 inputs)
    qwen3-tiny                          2 layers, dim 64, byte vocabulary: tests and the local demo
    qwen3-mini                          4 layers, dim 256 (3.2M parameters at the byte vocabulary):
                                        bench/wan_tricks.py's second size, still trainable on a CPU
    qwen3-debugmodel qwen3-0.6B qwen3-1.7B qwen3-8B qwen3-14B qwen3-32B   torchtitan's flavors
The Qwen3 vocabulary comes from the tokenizer (the corpus manifest), padded up to a
multiple of 64 rows. Attention is SDPA through our own GQAAttention: configure_attention()
asks torch's dispatcher, on the real device with the real shapes, which kernel a
grouped-query call gets, and when the answer is the S x S math kernel (an efficient
kernel that does not take GQA on that build, e.g. ROCm's) it expands K/V to full heads,
which flash/cuDNN/memory-efficient kernels all take: memory O(S), not O(S^2).
parallelize(compile=True) compiles each block's forward (torch.compile, fullgraph), as
torchtitan does, without renaming any parameter.
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
from torch.nn.attention import SDPBackend, sdpa_kernel

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
# ("tiny" and "mini" are ours, OWN_FLAVORS below). 4B and the MoE flavors exist there too;
# add a row to use them.
QWEN3_FLAVORS = {"qwen3-tiny": "tiny", "qwen3-mini": "mini", "qwen3-debugmodel": "debugmodel", "qwen3-0.6B": "0.6B",
                 "qwen3-1.7B": "1.7B", "qwen3-8B": "8B", "qwen3-14B": "14B", "qwen3-32B": "32B"}
MODEL_NAMES = tuple(RESNETS) + tuple(QWEN3_FLAVORS)


# Our flavors for CPU runs on a byte vocabulary (320 rows): tiny for the tests and the demo
# (119,168 parameters), mini for a second model size in bench/wan_tricks.py (~27x tiny).
OWN_FLAVORS = {"tiny": dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, hidden_dim=192),
               "mini": dict(dim=256, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=64, hidden_dim=768)}


def is_llm(name):
    return name in QWEN3_FLAVORS


def pad_vocab(n, multiple=VOCAB_MULTIPLE):
    """Round the tokenizer's vocabulary up (259 -> 320, 151,669 -> 151,680): aligned matmuls."""
    return int(math.ceil(n / multiple) * multiple)


def qwen3_args(name, vocab_size, seq_len):
    """torchtitan Qwen3ModelArgs for --model NAME with the tokenizer's (padded) vocabulary."""
    from torchtitan.models.qwen3 import qwen3_args as flavors, Qwen3ModelArgs
    flavor = QWEN3_FLAVORS[name]
    if flavor in OWN_FLAVORS:
        base = Qwen3ModelArgs(**OWN_FLAVORS[flavor], qk_norm=True, rope_theta=10000, enable_weight_tying=True)
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
            model = Qwen3Model(qwen3_args(name, vocab_size, seq_len))
            for block in blocks_of(model):
                block.attention.inner_attention = GQAAttention()
            return model
    raise ValueError(f"--model {name!r}: use one of {', '.join(MODEL_NAMES)}")


# ---------------------------------------------------------------------------
# Attention: an efficient SDPA kernel for grouped-query attention on both vendors
# ---------------------------------------------------------------------------

# Kernel preference, best first. torchtitan's SDPA wrapper offers cuDNN -> flash -> math
# only; the memory-efficient kernel is added before math here, and math stays last so
# that no shape ever fails, it only gets slow (and loud: configure_attention names it).
SDPA_ORDER = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
              SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
SDPA_NAMES = {SDPBackend.CUDNN_ATTENTION: "cudnn", SDPBackend.FLASH_ATTENTION: "flash",
              SDPBackend.EFFICIENT_ATTENTION: "efficient", SDPBackend.MATH: "math"}


class GQAAttention(nn.Module):
    """torchtitan's inner SDPA call (same arguments), with the kernel plan of
    configure_attention: the SDPA_ORDER priority and, where the build's efficient kernels
    reject grouped-query shapes, K/V repeated to the query's head count. Expanding costs
    n_heads / n_kv_heads times the K/V activations (O(S)); the math kernel it avoids holds
    an S x S score matrix per head (O(S^2): 2048^2 x 16 heads x 4 bytes = 256 MiB per
    sequence for qwen3-0.6B, before its backward)."""

    def __init__(self):
        super().__init__()
        self.expand_kv = False

    def forward(self, q, k, v, *, scale=None, enable_gqa=False, is_causal=True):
        if self.expand_kv and enable_gqa:
            rep = q.shape[1] // k.shape[1]
            # repeat along heads in the (batch, seq, heads, dim) memory order torchtitan's
            # transposed views have, so cuDNN's layout check still passes
            k = k.transpose(1, 2).repeat_interleave(rep, dim=2).transpose(1, 2)
            v = v.transpose(1, 2).repeat_interleave(rep, dim=2).transpose(1, 2)
            enable_gqa = False
        with sdpa_kernel(SDPA_ORDER, set_priority=True):
            return F.scaled_dot_product_attention(q, k, v, scale=scale, is_causal=is_causal,
                                                  enable_gqa=enable_gqa)


def sdpa_choice(device, dtype, n_heads, kv_heads, head_dim, seq_len):
    """The kernel torch's dispatcher picks, under SDPA_ORDER, for a causal training call
    of these shapes (batch 1; torchtitan's transposed layout): asks, runs nothing."""
    def qkv(heads):
        return torch.empty(1, seq_len, heads, head_dim, device=device, dtype=dtype,
                           requires_grad=True).transpose(1, 2)
    q, k, v = qkv(n_heads), qkv(kv_heads), qkv(kv_heads)
    with sdpa_kernel(SDPA_ORDER, set_priority=True):
        return SDPBackend(torch._fused_sdp_choice(q, k, v, is_causal=True, scale=head_dim ** -0.5,
                                                  enable_gqa=kv_heads != n_heads))


def attention_plan(device, dtype, n_heads, n_kv_heads, head_dim, seq_len, choose=sdpa_choice):
    """(kernel, expand_kv): grouped-query natively when an efficient kernel takes it,
    else K/V expanded when that gets an efficient kernel, else math. `choose` is the
    dispatcher's answer for given shapes (sdpa_choice; a test passes a rule instead)."""
    native = choose(device, dtype, n_heads, n_kv_heads, head_dim, seq_len)
    if native != SDPBackend.MATH or n_heads == n_kv_heads:
        return native, False
    expanded = choose(device, dtype, n_heads, n_heads, head_dim, seq_len)
    if expanded != SDPBackend.MATH:
        return expanded, True
    return SDPBackend.MATH, False


def describe_plan(kernel, expand_kv, n_heads, n_kv_heads):
    how = (f"K/V expanded {n_heads // n_kv_heads}x for GQA" if expand_kv else
           "GQA native" if n_heads != n_kv_heads else "MHA")
    return f"{SDPA_NAMES[kernel]} ({how})"


# aten ops of each SDPA kernel, as the profiler names them (the CPU build's flash kernel
# has its own op)
SDPA_OPS = {"aten::_scaled_dot_product_flash_attention": "flash",
            "aten::_scaled_dot_product_flash_attention_for_cpu": "flash",
            "aten::_scaled_dot_product_efficient_attention": "efficient",
            "aten::_scaled_dot_product_cudnn_attention": "cudnn",
            "aten::_scaled_dot_product_attention_math": "math",
            "aten::_scaled_dot_product_fused_attention_overrideable": "fused"}


def sdpa_kernels_ran(fn):
    """Run fn() under the profiler; returns the sorted names of the SDPA kernels it ran
    (what did run, not what the dispatcher was expected to pick)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sorted({SDPA_OPS[e.name] for e in prof.events() if e.name in SDPA_OPS})


def configure_attention(model, device, dtype):
    """Give every GQAAttention of a Qwen3 model the plan for this device and compute dtype;
    returns its description ("flash (GQA native)"), or None for models without one."""
    mods = [m for m in unwrap(model).modules() if isinstance(m, GQAAttention)]
    if not mods:
        return None
    a = unwrap(model).model_args
    kernel, expand = attention_plan(device, dtype, a.n_heads, a.n_kv_heads or a.n_heads,
                                    a.head_dim, a.max_seq_len)
    for m in mods:
        m.expand_kv = expand
    return describe_plan(kernel, expand, a.n_heads, a.n_kv_heads or a.n_heads)


def blocks_of(model):
    """The units FSDP2 shards one by one and activation checkpointing recomputes:
    transformer blocks, or ResNet stages."""
    if isinstance(model, ResNet):
        return model.stages()
    return list(model.layers.values())


# ---------------------------------------------------------------------------
# Parallelism: FSDP2 or DDP over a process group (the replica's inner group under DiLoCo)
# ---------------------------------------------------------------------------

def parallelize(model, mode, device, group=None, mesh=None, param_dtype=None, activation_checkpointing=False,
                compile=False):
    """Wrap or shard a meta-device model; returns the module to train.

    mode "fsdp": fully_shard every block, then the root (embeddings, final norm and
    the tied output head share the root's group). param_dtype=torch.bfloat16 gives
    MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32): bf16 compute and
    all-gathers, fp32 gradient reduction and fp32 master weights. A ResNet's BatchNorm
    layers are sharded on their own and stay in fp32 (fp32 weights and statistics over
    bf16 inputs: the mixed form cuDNN, MIOpen and the native kernels all take; MIOpen's
    BN refuses bf16 weights beside fp32 running statistics), as FSDP1's mixed
    precision did by default.
    mode "ddp": materialize first (DDP broadcasts rank 0's values at construction),
    then DistributedDataParallel over `group` (left unwrapped when the group has one rank).
    compile: torch.compile(fullgraph=True) each block's forward, after activation
    checkpointing and before sharding, as torchtitan orders them. The compiled function
    replaces block.forward, so FSDP2's hooks stay outside it and no parameter is renamed
    (torch.compile(module) would insert "_orig_mod." into every name a checkpoint or a
    delta carries); with activation checkpointing the recomputation runs inside the
    compiled function (torch.utils.checkpoint), where the compiler supports it.
    """
    if compile:
        compile_blocks(model, activation_checkpointing)
    elif activation_checkpointing:
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
        if param_dtype is not None and isinstance(model, ResNet):
            fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32,
                                        cast_forward_inputs=False)
            for m in model.modules():
                if isinstance(m, nn.modules.batchnorm._BatchNorm):
                    fully_shard(m, mesh=mesh, mp_policy=fp32)
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


def compile_blocks(model, activation_checkpointing=False):
    """torch.compile each block's forward in place (see parallelize)."""
    from torch.utils.checkpoint import checkpoint
    for block in blocks_of(model):
        forward = block.forward
        if activation_checkpointing:
            def forward(*args, _inner=forward, **kwargs):
                return checkpoint(_inner, *args, use_reentrant=False, **kwargs)
        block.forward = torch.compile(forward, fullgraph=True)


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
