"""wire_torch.py - wire.py's int8/int4/int2 codec in torch, on the device: a site encodes its
delta and applies a downloaded update where the tensors already are.

Runs on: a site (train.py's side; imported only there: wire.py stays numpy-only and
the central VM never imports torch). No server, no port, no state directory, nothing to
run from the shell; tests/test_wire_torch.py checks it against wire.py on the CPU and
bench/gpu_check.sh ("wire-torch") on a GPU.

The formats are wire.py's (its module docstring is their one statement): per block of
--wire-block values along the last dimension, scale = bf16 rounded UP of absmax / L
(L = 127, 7), q = rint(x / scale) (0 in a zero-scale block), value = q x scale, all in
float32; int4 codes q + 8, two a byte over the flattened tensor, element 2i in the low
nibble. int2: scale = bf16 rounded UP of absmax / 3, q = the nearest odd level
2 floor(x / 2s) + 1 clipped to [-3, 3], codes (q + 3) / 2 four a byte. Every step
is one IEEE operation (a division, a round half to even or a floor, a multiply, integer
bit shifts), so torch on the CPU or a GPU and numpy produce the same bits (no fused
multiply-add: each product is rounded before it is added).

    parts, sent = wire_torch.encode(codec, x)          # x float32 on any device
    wire_writer.write_parts(name, wire_torch.to_numpy(parts))   # the bytes wire.WireWriter writes
    theta = wire_torch.apply_(theta, codec, codes, sbits)       # theta += decode(...), in place

A sharded tensor (FSDP2 shards along dim 0) encodes shard by shard with the same result
as the whole tensor, provided it has two or more dimensions (the blocks run along the last
one, so a dim-0 shard holds whole blocks; a 1-D tensor's blocks cross the shard boundary),
and for int4 (int2) each shard but the one that ends the tensor holds an even number of
values (a multiple of 4: the packing joins values across a shard boundary otherwise):
shard_ok(). decode_rows() decodes the rows of one shard from the whole tensor's parts
(shard_wire.py: a site adds an update to each rank's rows).
"""
import math

import torch

LEVELS = {"int8": 127, "int4": 7, "int2": 3}
CODE_BITS = {"int8": 8, "int4": 4, "int2": 2}     # wire.CODE_BITS
SCALE = "#scale"


def _check(codec):
    if codec.fmt not in LEVELS:
        raise ValueError(f"wire_torch encodes int8, int4 and int2; --wire {codec.fmt} goes through wire.py (numpy)")


def as_blocks(shape, block):
    """wire.as_blocks: (R, C, nb), X = x as [R, C] with nb blocks per row of X."""
    cols = shape[-1] if len(shape) else 1
    rows = math.prod(shape) // cols if cols else 0
    if cols and cols % block == 0:
        return rows * (cols // block), block, 1
    return rows, cols, -(-cols // block)


def bf16_up(a):
    """float32 >= 0 -> bfloat16 bits as int32 (< 0x8000), rounded UP: wire.bf16_up."""
    u = a.contiguous().view(torch.int32)
    return (u >> 16) + ((u & 0xFFFF) != 0).to(torch.int32)


def bits_to_f32(bits):
    """bfloat16 bits (int16 or int32, the low 16 bits) -> float32, exactly."""
    return ((bits.to(torch.int32) & 0xFFFF) << 16).view(torch.float32)


# encode's rows per pass on a CPU: temporaries of ~1 MB each stay in the allocator's reused
# memory and in cache; whole-tensor passes fault in fresh pages for every temporary (a
# 1024 x 8192 tensor measured 0.36 s whole, 0.08 s in chunks of 256 K values, on a
# 2-core VM). A GPU takes each tensor in one pass: a chunk costs ~15 kernel launches.
CPU_CHUNK = 1 << 18


@torch.no_grad()
def encode(codec, x, chunk=None):
    """float32 tensor -> ({"": codes, "#scale": int16 scale bits [rows, nb]}, the decoded
    values, float32 of x's shape), on x's device, the bits of wire.Codec.encode.
    chunk: values per pass (default CPU_CHUNK on a CPU, the whole tensor elsewhere); every
    pass takes whole blocks and whole rows in fours (the int4/int2 packed bytes never straddle two passes)."""
    _check(codec)
    x = x.detach().to(torch.float32).contiguous()
    shape = tuple(x.shape)
    cols = shape[-1] if shape else 1
    rows = math.prod(shape) // cols if cols else 0
    R, C, nb = as_blocks(shape, codec.block)
    X = x.reshape(R, C)
    chunk = chunk or (CPU_CHUNK if x.device.type == "cpu" else None)
    step = max(R, 1) if not chunk or not C else max(4, chunk // C // 4 * 4)
    pieces = [_encode_rows(codec, X[a:a + step], nb) for a in range(0, R, step)] or [_encode_rows(codec, X, nb)]
    codes, bits, sent = (torch.cat(t) if len(pieces) > 1 else t[0] for t in zip(*pieces))
    if codec.fmt == "int8":
        codes = codes.reshape(shape)
    return {"": codes, SCALE: bits.to(torch.int16).reshape(rows, -(-cols // codec.block))}, sent.reshape(shape)


def _encode_rows(codec, X, nb):
    """Rows X [r, C] of as_blocks' view, nb blocks a row (a ragged row zero-padded) ->
    (codes, flat: int4's q + 8 packed two a byte, int8's q; scale bits [r, nb] int32; decoded
    values, flat)."""
    levels, block = LEVELS[codec.fmt], codec.block
    r, C = X.shape
    if codec.fmt == "int2":
        return _encode2_rows(codec, X, nb)
    if nb * block != C:
        X = torch.nn.functional.pad(X, (0, nb * block - C))
    xb = X.reshape(r, nb, block)
    amax = xb.abs().amax(dim=2) if xb.numel() else xb.new_zeros((r, nb))
    bits = bf16_up(amax / levels)
    scale = bits_to_f32(bits)[:, :, None]
    q = torch.round(xb / scale)                  # round half to even, as numpy's rint
    q = torch.where(scale == 0, torch.zeros((), dtype=q.dtype, device=q.device), q)
    if codec.fmt == "int4":
        q = q + 8                                # codes 1..15; -0.0 + 8 - 8 is +0.0 (the reference's int8 pass)
        codes = pack4(q.to(torch.uint8).reshape(r, nb * block)[:, :C].reshape(-1))
        q = q - 8
    else:
        q = q + 0.0                              # -0.0 -> +0.0
        codes = q.to(torch.int8).reshape(r, nb * block)[:, :C].reshape(-1)
    sent = (q * scale).reshape(r, nb * block)[:, :C].reshape(-1)
    return codes, bits, sent


def int2_bits(X, block):
    """wire.int2_scale_bits: bf16 scale bits (int32) [r, nb] of X [r, C], each block's
    (a short last block's too) largest magnitude / 3, rounded UP."""
    r, C = X.shape
    nfull, tail = divmod(C, block)
    mag = X.abs()
    parts = ([mag[:, :nfull * block].reshape(r, nfull, block).amax(dim=2)] if nfull else []) + \
            ([mag[:, nfull * block:].amax(dim=1, keepdim=True)] if tail else [])
    amax = torch.cat(parts, dim=1) if parts else X.new_zeros((r, 0))
    return bf16_up(amax / 3)


def _encode2_rows(codec, X, nb):
    """int2: rows X [r, C] -> (codes packed four a byte, scale bits [r, nb], decoded values), flat."""
    r, C = X.shape
    bits = int2_bits(X, codec.block)
    per = bits_to_f32(bits).repeat_interleave(codec.block, dim=1)[:, :C]
    t = torch.where(per == 0, torch.zeros((), dtype=X.dtype, device=X.device), X / per)
    q = (torch.floor(t * 0.5) * 2 + 1).clamp_(-3, 3)       # the nearest odd level; exact in float32
    codes = pack2(((q + 3) * 0.5).to(torch.uint8).reshape(-1))
    return codes, bits, (q * per).reshape(-1)


def pack2(c):
    """uint8 codes < 4 -> bytes: value 4i + j at bits 2j of byte i (a last byte's unused bits 0)."""
    if c.numel() % 4:
        c = torch.cat([c, c.new_zeros(4 - c.numel() % 4)])
    c = c.reshape(-1, 4)
    return c[:, 0] | (c[:, 1] << 2) | (c[:, 2] << 4) | (c[:, 3] << 6)


def unpack2(packed, count):
    out = torch.stack([(packed >> (2 * j)) & 3 for j in range(4)], dim=1)
    return out.reshape(-1)[:count]


def pack4(c):
    """uint8 codes < 16 -> bytes: element 2i in the low nibble of byte i (an odd last high nibble 0)."""
    if c.numel() % 2:
        c = torch.cat([c, c.new_zeros(1)])
    return c[0::2] | (c[1::2] << 4)


def unpack4(packed, count):
    out = torch.empty(packed.numel() * 2, dtype=torch.uint8, device=packed.device)
    out[0::2] = packed & 0x0F
    out[1::2] = packed >> 4
    return out[:count]


@torch.no_grad()
def decode(codec, codes, sbits, shape):
    """Parts (torch, on any device: int4/int8 codes and int16 scale bits) -> float32 of
    `shape`, the bits of wire.Codec.decode. The parts are trusted: a site decodes only an
    update whose digest it checks, and a file goes through wire.WireReader's checks first."""
    _check(codec)
    shape = tuple(shape)
    if codec.fmt == "int4":
        q = unpack4(codes.reshape(-1), math.prod(shape)).to(torch.float32) - 8
    elif codec.fmt == "int2":
        q = unpack2(codes.reshape(-1), math.prod(shape)).to(torch.float32) * 2 - 3
    else:
        q = codes.reshape(-1).to(torch.float32)
    return _values(codec, q, sbits, shape)


def _values(codec, q, sbits, shape):
    """q (float32, flat) x its block's scale, in float32: the one multiply of wire.py's decode."""
    block = codec.block
    R, C, nb = as_blocks(shape, block)
    scale = bits_to_f32(sbits.reshape(R, nb))
    q = q.reshape(R, C)
    if nb * block != C:
        per = scale.repeat_interleave(block, dim=1)[:, :C]
        return (q * per).reshape(shape)
    return (q.reshape(R, nb, block) * scale[:, :, None]).reshape(shape)


@torch.no_grad()
def decode_rows(codec, codes, sbits, shape, start, stop):
    """decode(codec, codes, sbits, shape)[start:stop], decoding only those rows of dim 0:
    the parts are the whole tensor's (of two or more dimensions: its blocks lie inside its
    rows, so the rows' scales are a slice of the whole's; int4 codes from the nibble of
    value start x row size, which may be a high one). The same float32 bits as decode."""
    _check(codec)
    shape = tuple(shape)
    if len(shape) < 2:
        raise ValueError(f"decode_rows needs a tensor of two or more dimensions, not {shape}: a 1-D "
                         "tensor's blocks cross its rows (decode it whole)")
    local = (stop - start,) + shape[1:]
    per = math.prod(shape[1:])
    if math.prod(local) == 0:
        return torch.zeros(local, dtype=torch.float32, device=codes.device)
    frows = per // shape[-1]                      # rows of the [rows, cols] view per dim-0 row
    sb = sbits.reshape(math.prod(shape[:-1]), -1)[start * frows:stop * frows]
    v0, v1 = start * per, stop * per
    if codec.fmt == "int4":
        packed = codes.reshape(-1)[v0 // 2:(v1 + 1) // 2]
        q = unpack4(packed, packed.numel() * 2)[v0 % 2:v0 % 2 + v1 - v0].to(torch.float32) - 8
    elif codec.fmt == "int2":
        packed = codes.reshape(-1)[v0 // 4:(v1 + 3) // 4]
        q = unpack2(packed, packed.numel() * 4)[v0 % 4:v0 % 4 + v1 - v0].to(torch.float32) * 2 - 3
    else:
        q = codes.reshape(-1)[v0:v1].to(torch.float32)
    return _values(codec, q, sb, local)


@torch.no_grad()
def apply_(theta, codec, codes, sbits):
    """theta += decode(codes, sbits) in float32, in place: wire.add_update's bits."""
    return theta.add_(decode(codec, codes, sbits, tuple(theta.shape)).to(theta.device))


def shard_ok(codec, shard_shape, full_shape, last=False):
    """True if a dim-0 shard of a tensor encodes to exactly its part of the whole tensor's parts:
    two or more dimensions (a 1-D tensor's blocks run along dim 0, across the shards), the
    shard's rows whole, and for int4 an even number of values, for int2 a multiple of 4 (an
    empty shard is fine) - or any number for the shard that ends the tensor (last): its last
    codes pad the whole tensor's last byte too."""
    if len(full_shape) < 2 or len(shard_shape) != len(full_shape) or tuple(shard_shape[1:]) != tuple(full_shape[1:]):
        return False
    return last or math.prod(shard_shape) % (8 // CODE_BITS[codec.fmt]) == 0


def to_numpy(parts):
    """Parts as torch tensors -> what wire.Codec.encode returns (scales as uint16 bits), on the host."""
    import numpy as np
    out = {}
    for k, t in parts.items():
        a = t.detach().cpu().contiguous().numpy()
        out[k] = a.view(np.uint16) if k == SCALE else a
    return out


def from_numpy(parts, device="cpu"):
    """wire's parts (numpy) -> torch tensors on `device` (scales as int16 bits)."""
    import numpy as np
    return {k: torch.from_numpy(np.ascontiguousarray(a).view(np.int16) if k == SCALE else np.ascontiguousarray(a))
            .to(device) for k, a in parts.items()}
