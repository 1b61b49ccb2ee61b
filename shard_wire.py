"""shard_wire.py - the site's share of the wire format on its devices: each rank encodes the
rows of the delta it holds (its FSDP2 shard), rank 0 gathers only their codes and scales,
and each rank adds the update of theta_global to its own rows where they are.

Runs on: compute nodes, imported by diloco.py (FedMomCarrier under train.py --encode-on
device). No port, no state directory, nothing to run from the shell. Every function that
takes a group is a collective: every rank of the site calls it, in the same order.
tests/test_wire_torch.py checks the result against the host path (numpy, wire.py) bit for
bit on real gloo groups of 2 and 3 ranks; bench/gpu_check.sh does it on a GPU.

    places = shard_wire.plan(codec, params, rank, world)       # once: who encodes which rows
    parts, sent = wire_torch.encode(codec, x_local)            # each rank, its own rows
    whole = shard_wire.gather(codec, places[i], parts, rank, world)   # rank 0: the tensor's parts
    buf = shard_wire.broadcast(codec, shape, file_parts, device, rank, world)  # an update's parts
    theta_local += shard_wire.local_values(codec, buf, places[i], rank)

Why rows: wire.py's blocks run along a tensor's last dimension, so a dim-0 shard of a
tensor of two or more dimensions holds whole blocks and encodes to exactly its rows' part
of the whole tensor's parts (int4, int2: if every shard but the last holds an even number
of values, a multiple of 4 for int2, the packed bytes concatenate too): wire_torch.shard_ok. FSDP2 splits dim 0 in
rank order (torch.chunk: ceil(rows / world) rows a rank, the last ones short or empty),
so rank 0 concatenates what it gathers in rank order. Anything else - a 1-D tensor (its
blocks cross the shards: norm weights), an odd int4 shard (int2: not a multiple of 4) before the last, another mesh
or placement, a DDP replica - is gathered whole and encoded on rank 0's device, as before.

What moves: per tensor, the codes and scales of each shard to rank 0 (an eighth of the
fp32 bytes for int4, padded to the largest shard for the gather), and for an update the
whole tensor's codes and scales from rank 0 to every rank (the same eighth), where a full
gather or scatter of theta moves the fp32 tensor.
"""
import dataclasses
import itertools
import math

import numpy as np
import torch
import torch.distributed as dist

import wire_torch


@dataclasses.dataclass
class Place:
    """One parameter at this site. shape: the whole tensor's; locals: every rank's local
    shape (the whole shape on every rank of a replicated one); rows: every rank's
    [start, stop) of dim 0 when the parameter is split along dim 0 over the site's ranks in
    rank order (FSDP2's Shard(0)), else None; sharded: it is a DTensor; per_rank: each
    rank encodes its own rows (rows known and wire_torch.shard_ok for every shard)."""
    shape: tuple
    locals: list
    rows: list = None
    sharded: bool = False
    per_rank: bool = False


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _dim0_split(p, world):
    """True if DTensor p is split along dim 0 over ranks 0..world-1 in order (FSDP2 on one mesh
    dimension over the whole site; a strided or 2-D placement is not)."""
    from torch.distributed.tensor import Shard
    mesh = p.device_mesh
    return (mesh.ndim == 1 and mesh.mesh.flatten().tolist() == list(range(world)) and len(p.placements) == 1
            and type(p.placements[0]) is Shard and p.placements[0].dim == 0)


def plan(codec, params, rank, world, group=None):
    """Collective (one all_gather of the local shapes, when sharded): a Place per parameter."""
    mine = [tuple(_local(p).shape) for p in params]
    every = [mine]
    if world > 1 and any(hasattr(p, "to_local") for p in params):
        every = [None] * world
        dist.all_gather_object(every, mine, group=group)
    places = []
    for i, p in enumerate(params):
        shape = tuple(p.shape)
        if not hasattr(p, "to_local"):
            places.append(Place(shape, [shape] * world))
            continue
        locs = [tuple(e[i]) for e in every]
        rows = None
        if (_dim0_split(p, world) and len(shape) >= 1 and all(s[1:] == shape[1:] for s in locs)
                and sum(s[0] for s in locs) == shape[0]):
            starts = list(itertools.accumulate([0] + [s[0] for s in locs]))
            rows = list(zip(starts[:-1], starts[1:]))
        ends = max([i for i, s in enumerate(locs) if math.prod(s)] + [0])     # the shard that ends the tensor
        per_rank = rows is not None and all(wire_torch.shard_ok(codec, s, shape, last=i >= ends)
                                            for i, s in enumerate(locs))
        places.append(Place(shape, locs, rows, True, per_rank))
    return places


def part_bytes(codec, shape):
    """(bytes of the scale bits, bytes of the codes) of one tensor of `shape` in int8/int4/int2."""
    n = math.prod(shape)
    cols = shape[-1] if shape else 1
    rows = n // cols if cols else 0
    return 2 * rows * -(-cols // codec.block), (n * wire_torch.CODE_BITS[codec.fmt] + 7) // 8


def to_bytes(parts):
    """One tensor's parts (wire_torch.encode's) as one uint8 buffer on their device: the
    scale bits first (an even offset, so the int16 view back needs no copy), then the codes."""
    return torch.cat([parts[wire_torch.SCALE].reshape(-1).view(torch.uint8),
                      parts[""].reshape(-1).view(torch.uint8)])


def from_bytes(codec, buf, shape):
    """to_bytes' buffer (at the front of `buf`) -> (codes, int16 scale bits) of a tensor of `shape`."""
    s, c = part_bytes(codec, shape)
    cols = shape[-1] if shape else 1
    rows = math.prod(shape) // cols if cols else 0
    sbits = buf[:s].view(torch.int16).reshape(rows, -(-cols // codec.block))
    codes = buf[s:s + c]
    return (codes.view(torch.int8).reshape(shape) if codec.fmt == "int8" else codes), sbits


def gather(codec, place, parts, rank, world, group=None):
    """Collective: every rank's parts of its own rows -> on rank 0 the whole tensor's parts
    ({"": codes, "#scale": int16 bits}, torch, on its device), None elsewhere. One gather
    of uint8 buffers padded to the largest shard; every rank knows every size from the plan."""
    sizes = [sum(part_bytes(codec, s)) for s in place.locals]
    buf = to_bytes(parts)
    top = max(sizes)
    if world > 1 and top > 0:
        if buf.numel() < top:
            buf = torch.cat([buf, buf.new_zeros(top - buf.numel())])
        bufs = [torch.empty_like(buf) for _ in range(world)] if rank == 0 else None
        dist.gather(buf, bufs, dst=0, group=group)
    else:
        bufs = [buf] * world                  # alone, or every shard empty
    if rank != 0:
        return None
    pieces = [from_bytes(codec, b, s) for b, s in zip(bufs, place.locals)]
    cols = place.shape[-1]
    rows = math.prod(place.shape) // cols if cols else 0
    sbits = torch.cat([sb.reshape(-1) for _, sb in pieces]).reshape(rows, -(-cols // codec.block))
    codes = torch.cat([c.reshape(-1) for c, _ in pieces])
    return {"": codes.reshape(place.shape) if codec.fmt == "int8" else codes, wire_torch.SCALE: sbits}


def broadcast(codec, shape, parts, device, rank, world, group=None):
    """Collective: rank 0's parts of one tensor (numpy, as a wire file holds them: codes,
    "#scale" uint16 bits) -> the same to_bytes buffer on every rank's `device`."""
    s, c = part_bytes(codec, shape)
    if rank == 0:
        flat = np.concatenate([np.ascontiguousarray(parts[wire_torch.SCALE]).reshape(-1).view(np.uint8),
                               np.ascontiguousarray(parts[""]).reshape(-1).view(np.uint8)])
        buf = torch.from_numpy(flat).to(device)
    else:
        buf = torch.empty(s + c, dtype=torch.uint8, device=device)
    if world > 1 and s + c:
        dist.broadcast(buf, src=0, group=group)
    return buf


def local_values(codec, buf, place, rank):
    """The decoded float32 values of this rank's part of one tensor, from the whole tensor's
    parts (broadcast's buffer): its rows of dim 0 when the tensor is split, all of it
    when it is replicated. A split 1-D tensor (its blocks cross the rows) is decoded whole."""
    codes, sbits = from_bytes(codec, buf, place.shape)
    if place.rows is None:
        if place.sharded:
            raise ValueError("shard_wire.local_values: a DTensor not split along dim 0 in rank order has no "
                             "known rows here (FedMomCarrier reads the whole theta instead)")
        return wire_torch.decode(codec, codes, sbits, place.shape)
    a, b = place.rows[rank]
    if len(place.shape) < 2:
        return wire_torch.decode(codec, codes, sbits, place.shape)[a:b]
    return wire_torch.decode_rows(codec, codes, sbits, place.shape, a, b)
