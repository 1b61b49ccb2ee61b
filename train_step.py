"""train_step.py - what every optimizer step of a site runs, in both of train.py's loops: the
local loop (train.local_loop) and a federated site's phases (fedphase.py).

Runs on: compute nodes and any CPU, imported by train.py and fedphase.py; not started on its
own. No port, no state.

    stepper = Stepper(run, step)           # run: train.Run (its cfg, d, opt, schedule, log)
    stepper.begin(step)                    # the LR of the schedule
    for i, batch in enumerate(micro):
        with grad_sync(model, cfg, last=i == n - 1), autocast_ctx(cfg, d):
            loss = ...
        loss.backward()
    stepper.end()                          # unscale, clip, step, zero
    if stepper.due(step): stepper.train_row(step, loss, samples, "tokens")

HostToDevice stages token batches through pinned memory; pooled_nll sums a loss over ranks.
"""
import contextlib
import time

import torch
import torch.distributed as dist

from metrics import fmt_row, peak_flops, peak_memory_gib


def autocast_ctx(cfg, d):
    """DDP computes under autocast; FSDP2 casts through its MixedPrecisionPolicy instead."""
    if cfg.parallel == "fsdp" or cfg.dtype == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if cfg.dtype == "bf16" else torch.float16
    return torch.autocast(device_type=d.device.type, dtype=dtype)


class HostToDevice:
    """Token batches (numpy) to the device without stalling the host: each batch is copied
    into one of two pinned host buffers and sent with non_blocking=True, so the copy
    overlaps the GPU's work. A copy from pageable numpy memory would block (the driver
    stages it through a pinned bounce buffer) whatever non_blocking says. A buffer is
    refilled only once the event recorded after its last copy has passed, so an in-flight
    copy never sees new data. On the CPU the array is used as it is."""

    def __init__(self, device, slots=2):
        self.device, self.gpu = device, device.type == "cuda"
        self.bufs, self.events, self.next = [None] * slots, [None] * slots, 0

    def __call__(self, arr):
        t = torch.from_numpy(arr)
        if not self.gpu:
            return t
        i, self.next = self.next, (self.next + 1) % len(self.bufs)
        if self.events[i] is not None:
            self.events[i].synchronize()      # the copy of two batches ago: long done
        buf = self.bufs[i]
        if buf is None or buf.numel() < t.numel() or buf.dtype != t.dtype:
            buf = self.bufs[i] = torch.empty(t.numel(), dtype=t.dtype, pin_memory=True)
        staged = buf[:t.numel()].view(t.shape)
        staged.copy_(t)
        out = staged.to(self.device, non_blocking=True)
        self.events[i] = torch.cuda.Event()
        self.events[i].record()
        return out


def grad_sync(model, cfg, last):
    """Gradient accumulation. DDP: all-reduce only on the last micro-batch (no_sync before;
    DDP's gradients are whole either way). FSDP: by default reduce-scatter after every
    micro-batch, so each rank only ever accumulates its gradient shard; with
    --fsdp-defer-grad-sync only after the last one, holding the unsharded fp32 gradient in
    between (bench/fsdp_grad_accum_memory.py measures both)."""
    if cfg.grad_accum == 1:
        return contextlib.nullcontext()
    if cfg.parallel == "fsdp":
        if cfg.fsdp_defer_grad_sync:
            model.set_requires_gradient_sync(last)
        return contextlib.nullcontext()
    if last or not hasattr(model, "no_sync"):
        return contextlib.nullcontext()
    return model.no_sync()


def pooled_nll(nll, tokens, d):
    """(nll sum, token count) summed over all ranks: one small all-reduce. nll is this
    rank's device-side sum, tokens its host-side count (counted on the host, so that no
    micro-batch pays a host-to-device copy for it)."""
    t = torch.stack([nll.reshape(()), torch.tensor(float(tokens), dtype=torch.float64).to(d.device)])
    dist.all_reduce(t)
    total, count = t.tolist()
    return total, count


def _as_float(t):
    if t is None:
        return None
    return float(t.full_tensor() if hasattr(t, "full_tensor") else t)


class Stepper:
    """The code every optimizer step runs in both loops, around the loop's own forward and
    backward: begin() sets the LR of the schedule; end() unscales, clips, steps and zeroes;
    train_row() logs the "train" row of the steps since the last one. Time spent inside
    pause() (evals, checkpoints) is not counted as step time."""

    def __init__(self, run, step):
        self.run, self.peak = run, peak_flops(run.d)
        self.lr = self.gnorm = None
        self.mark(step)

    def mark(self, step):
        """Start the next row's interval here."""
        self.t_mark, self.step_mark, self.paused = time.perf_counter(), step, 0.0

    def begin(self, step):
        self.lr = self.run.peak_lr * self.run.schedule(step)
        for g in self.run.opt.param_groups:
            g["lr"] = self.lr

    def end(self):
        opt, scaler, cfg = self.run.opt, self.run.scaler, self.run.cfg
        if scaler:
            scaler.unscale_(opt)
        if cfg.grad_clip > 0:
            self.gnorm = torch.nn.utils.clip_grad_norm_(self.run.model.parameters(), cfg.grad_clip)
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)

    def due(self, step, last=False):
        return step % self.run.cfg.log_every == 0 or last

    def train_row(self, step, loss, samples, unit, **where):
        """Log the row of the steps since mark(): `loss` pooled over ranks, `samples` (tokens or
        images) trained by all ranks together; `where` ("epoch" or "round") follows "step"."""
        d = self.run.d
        dt = time.perf_counter() - self.t_mark - self.paused
        per_s = samples / dt
        row = {"split": "train", "step": step, **where, "loss": loss, "lr": self.lr,
               "grad_norm": _as_float(self.gnorm), "step_ms": 1e3 * dt / (step - self.step_mark),
               f"{unit}_per_s": per_s, "mfu": self.run.flops * per_s / d.world_size / self.peak if self.peak else None,
               "peak_mem_gib": peak_memory_gib(d)}
        self.run.log.metric(row)
        self.run.log.log("train " + fmt_row(row))
        self.mark(step)

    @contextlib.contextmanager
    def pause(self):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.paused += time.perf_counter() - t0
