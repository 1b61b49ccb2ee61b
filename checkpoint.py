"""checkpoint.py - atomic training checkpoints, consolidated or sharded, loadable at any world size.

Runs on: compute nodes, imported by train.py. Not started on its own; no port.
State: runs/<run>/checkpoints/
    step_000001000.pt     consolidated: one file written by rank 0 (full tensors, by name)
    step_000002000/       sharded: a torch.distributed.checkpoint (DCP) directory + meta.json
    latest                the name of the newest complete checkpoint (replaced atomically)

    import checkpoint
    checkpoint.save(run_dir, step, model, optimizer, extra={"epoch": 3}, diloco=outer, sharded=False, keep=2)
    extra = checkpoint.load_latest(run_dir, model, optimizer, diloco=outer)   # None: nothing to resume
    step = extra["step"]

Both calls are collectives: every rank calls them, in the same order.

What is stored: the model's weights (under DiLoCo: theta, the global weights, not
whichever replica rank 0 holds - DiLoCo.global_weights()), the inner optimizer
state, the DiLoCo outer momentum and counters, and `extra` (JSON-serialisable:
epoch, data position, lease ids). Under DiLoCo the inner optimizer state is
replica 0's: it is per replica by construction and has no meaningful average,
so a resume restarts every replica from theta with replica 0's inner state. The
outer momentum, shared by all replicas, is restored exactly.

Any world size: tensors are stored by parameter name, either whole (consolidated)
or as DCP shards with their global offsets (sharded), so a checkpoint written by
4 ranks under FSDP loads onto 2 ranks or onto 1 plain process.

Atomic: a checkpoint is written under a temporary name, fsynced, then renamed; the
`latest` pointer is replaced the same way after it. A crash at any moment leaves
the previous checkpoint intact and `latest` naming a complete one. Loading never
unpickles code: consolidated files are read with torch.load(weights_only=True) and
the sharded metadata is JSON.
"""
import contextlib
import json
import os
import re
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

import durable

FORMAT = "pww-checkpoint/1"
DEFAULT_KEEP = 2
_NAME = re.compile(r"^step_(\d{9})(\.pt)?$")


def checkpoint_dir(run_dir):
    return os.path.join(run_dir, "checkpoints")


def _rank():
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier():
    if dist.is_initialized():
        dist.barrier()


# ----------------------------------------------------------------------------- DiLoCo outer state

def _is_dtensor(p):
    return hasattr(p, "to_local")


def _momentum_sharded(diloco):
    """name -> the outer momentum as this rank stores it, wrapped as a DTensor under FSDP."""
    from torch.distributed.tensor import DTensor
    out = {}
    for name, p, m in zip(diloco.names, diloco.params, diloco.momentum()):
        if _is_dtensor(p):
            m = DTensor.from_local(m.to(p.to_local().device), p.device_mesh, p.placements,
                                   shape=p.shape, stride=p.stride())
        out[name] = m
    return out


def _momentum_full(diloco):
    """name -> whole momentum tensor on the CPU (gathers shards: collective under FSDP)."""
    return {n: (m.full_tensor() if _is_dtensor(m) else m).detach().cpu()
            for n, m in _momentum_sharded(diloco).items()}


def _momentum_local(diloco, full):
    """This rank's part of whole momentum tensors, in the current run's sharding."""
    from torch.distributed.tensor import distribute_tensor
    out = {}
    for name, p in zip(diloco.names, diloco.params):
        t = full[name]
        if _is_dtensor(p):
            # src_data_rank=None: every rank holds the whole tensor and slices locally
            t = distribute_tensor(t.to(p.to_local().device), p.device_mesh, p.placements,
                                  src_data_rank=None).to_local()
        out[name] = t
    return out


def _restore_diloco(diloco, counters, momentum):
    if diloco is None:
        return
    if counters is None:         # a checkpoint from a run without DiLoCo: start the outer loop here
        counters = {"inner_step": 0, "phase_steps": 0, "outer_step": 0}
    have = len(diloco.momentum()) > 0
    diloco.load_state_dict({"counters": counters,
                            "momentum": momentum if (have and momentum) else
                            {n: torch.zeros_like(m) for n, m in zip(diloco.names, diloco.momentum())}})


# ----------------------------------------------------------------------------- save

def _state_dicts(model, optimizer, full):
    opts = StateDictOptions(full_state_dict=full, cpu_offload=full)
    if optimizer is None:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict
        return get_model_state_dict(model, options=opts), None
    return get_state_dict(model, optimizer, options=opts)


def save(run_dir, step, model, optimizer, extra=None, diloco=None, sharded=False, keep=DEFAULT_KEEP):
    """Write checkpoint `step` (collective). Returns its path. Keeps the newest `keep`."""
    if keep < 1:
        raise ValueError(f"--keep-checkpoints {keep}: must be >= 1")
    extra = dict(extra or {})
    json.dumps(extra)                                     # refuse a non-JSON extra before any write
    cdir = checkpoint_dir(run_dir)
    name = f"step_{int(step):09d}" + ("" if sharded else ".pt")
    final, tmp = os.path.join(cdir, name), os.path.join(cdir, name + ".tmp")
    if _rank() == 0:
        os.makedirs(cdir, exist_ok=True)
        for old in os.listdir(cdir):                      # leftovers of a crash mid-save
            if old.endswith(".tmp") or durable.is_tmp(old):
                _remove(os.path.join(cdir, old))
    _barrier()
    meta = {"format": FORMAT, "step": int(step), "extra": extra,
            "world_size": dist.get_world_size() if dist.is_initialized() else 1,
            "diloco": diloco.counters() if diloco is not None else None}
    swap = diloco.global_weights() if diloco is not None else contextlib.nullcontext()
    with swap:
        if sharded:
            _save_sharded(tmp, model, optimizer, diloco, meta)
        else:
            _save_consolidated(tmp, model, optimizer, diloco, meta)
    if _rank() == 0:
        durable.rename(tmp, final)
        durable.write_text(os.path.join(cdir, "latest"), name + "\n")
        _prune(cdir, keep)
    _barrier()
    return final


def _save_consolidated(tmp, model, optimizer, diloco, meta):
    msd, osd = _state_dicts(model, optimizer, full=True)
    mom = _momentum_full(diloco) if diloco is not None else {}
    if _rank() != 0:
        return
    blob = {"meta_json": json.dumps(meta), "model": msd, "optimizer": osd, "diloco_momentum": mom}
    with open(tmp, "wb") as f:
        torch.save(blob, f)
        f.flush()
        os.fsync(f.fileno())


def _save_sharded(tmp, model, optimizer, diloco, meta):
    msd, osd = _state_dicts(model, optimizer, full=False)
    state = {"model": msd}
    if osd is not None:
        state["optimizer"] = osd
    if diloco is not None:
        state["diloco_momentum"] = _momentum_sharded(diloco)
    meta = dict(meta, has_optimizer=osd is not None,
                has_momentum=bool(state.get("diloco_momentum")))
    # Under DiLoCo only replica 0 writes: theta is the same on every replica, and the
    # inner optimizer state then is replica 0's, as in the consolidated format.
    group = None
    if diloco is not None and diloco.layout.replicas > 1:
        group = diloco.layout.inner_group
        writes = diloco.layout.replica == 0
    else:
        writes = True
    if writes:
        dcp.save(state, checkpoint_id=tmp, process_group=group, no_dist=not dist.is_initialized())
    _barrier()
    if _rank() == 0:
        durable.write_json(os.path.join(tmp, "meta.json"), meta, indent=1)
        durable.fsync_tree(tmp)


def _remove(path):
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.exists(path):
        os.unlink(path)


def _entries(cdir):
    """Complete checkpoints in cdir as [(step, name)], oldest first."""
    if not os.path.isdir(cdir):
        return []
    found = []
    for n in os.listdir(cdir):
        m = _NAME.match(n)
        if m:
            found.append((int(m.group(1)), n))
    return sorted(found)


def _prune(cdir, keep):
    for _, n in _entries(cdir)[:-keep]:
        _remove(os.path.join(cdir, n))


# ----------------------------------------------------------------------------- load

def latest(run_dir):
    """Path of the newest complete checkpoint, or None."""
    cdir = checkpoint_dir(run_dir)
    try:
        with open(os.path.join(cdir, "latest")) as f:
            name = f.read().strip()
        if _NAME.match(name) and os.path.exists(os.path.join(cdir, name)):
            return os.path.join(cdir, name)
    except FileNotFoundError:
        pass
    entries = _entries(cdir)
    return os.path.join(cdir, entries[-1][1]) if entries else None


def load_latest(run_dir, model, optimizer, diloco=None):
    """Load the newest checkpoint into model/optimizer/diloco (collective); return its
    extra dict with "step" added, or None when the run has no checkpoint yet."""
    path = latest(run_dir)
    return None if path is None else load(path, model, optimizer, diloco)


# How an optimizer computes, not what it learned: Optimizer.load_state_dict replaces every
# param group with the saved one, these flags included, so a checkpoint written on a CPU
# (foreach) would resume on a GPU without the fused AdamW kernel, and a GPU's (fused=True)
# on a CPU or another device type with a kernel chosen for the machine that wrote it.
# load() keeps the flags the optimizer was built with.
IMPL_FLAGS = ("fused", "foreach", "capturable", "differentiable")


def load(path, model, optimizer, diloco=None):
    """Load one checkpoint (a .pt file or a DCP directory) at this run's world size.
    The optimizer keeps its own implementation flags (IMPL_FLAGS), whatever the writer's were."""
    impl = [{k: g[k] for k in IMPL_FLAGS if k in g} for g in optimizer.param_groups] if optimizer else []
    if os.path.isdir(path):
        meta = _load_sharded(path, model, optimizer, diloco)
    elif os.path.isfile(path):
        meta = _load_consolidated(path, model, optimizer, diloco)
    else:
        raise FileNotFoundError(f"{path}: no such checkpoint; see {os.path.dirname(path)}/latest "
                                "or use --resume auto")
    for group, flags in zip(optimizer.param_groups if optimizer else [], impl):
        group.update(flags)
    return dict(meta["extra"], step=meta["step"])


def _check_meta(path, meta):
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path}: format {meta.get('format')!r}, this code reads {FORMAT!r}; "
                         "load it with the version of checkpoint.py that wrote it")
    return meta


def _load_consolidated(path, model, optimizer, diloco):
    # every rank reads the file (mmap: pages come in as tensors are sliced), no broadcast
    blob = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    meta = _check_meta(path, json.loads(blob["meta_json"]))
    opts = StateDictOptions(full_state_dict=True)
    if optimizer is not None and blob["optimizer"] is not None:
        set_state_dict(model, optimizer, model_state_dict=blob["model"],
                       optim_state_dict=blob["optimizer"], options=opts)
    else:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict
        set_model_state_dict(model, blob["model"], options=opts)
    if diloco is not None:
        mom = blob["diloco_momentum"]
        _restore_diloco(diloco, meta["diloco"], _momentum_local(diloco, mom) if mom else None)
    return meta


def _load_sharded(path, model, optimizer, diloco):
    with open(os.path.join(path, "meta.json")) as f:
        meta = _check_meta(path, json.load(f))
    msd, osd = _state_dicts(model, optimizer if meta["has_optimizer"] else None, full=False)
    state = {"model": msd}
    if osd is not None:
        state["optimizer"] = osd
    use_mom = diloco is not None and meta["has_momentum"] and len(diloco.momentum()) > 0
    if use_mom:
        state["diloco_momentum"] = _momentum_sharded(diloco)
    dcp.load(state, checkpoint_id=path, no_dist=not dist.is_initialized())
    if osd is not None:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    else:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict
        set_model_state_dict(model, state["model"])
    if diloco is not None:
        mom = ({n: (m.to_local() if _is_dtensor(m) else m) for n, m in state["diloco_momentum"].items()}
               if use_mom else None)
        _restore_diloco(diloco, meta["diloco"], mom)
    return meta
