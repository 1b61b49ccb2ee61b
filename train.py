"""train.py - THE site-side training entrypoint (ResNet/CIFAR-10 and Qwen3 via torchtitan).

Runs on: compute nodes (one process per GPU, by srun or torchrun), or any CPU with gloo (tests,
the demo). No port; the rendezvous, device dispatch and rank/world are dist_env.py's.

Command lines:
    # one CPU process
    python train.py --device cpu --model resnet18 --data data/cifar-10-batches-py --epochs 1
    # 2 CPU ranks, DDP (a GPU node's layout, with gloo)
    torchrun --nproc-per-node 2 train.py --device cpu --config configs/cifar10_resnet18.yaml
    # a Slurm job step (jobs/*.sh): one task per GPU; rank/world come from SLURM_*
    srun python train.py --config configs/qwen3_0.6B.yaml --data data/c4/manifest.json
    # DiLoCo inside one allocation: 2 replicas of 4 ranks, outer step every 100 steps
    srun python train.py ... --diloco-replicas 2 --diloco-inner-steps 100
    # once, anywhere: the initial global model for fedmom_server.py --init
    python train.py --export-init init.safetensors --model qwen3-0.6B --data data/c4/manifest.json
    # one site of a federated run (requeue with the same flags + --resume auto)
    srun python train.py --config configs/qwen3_0.6B.yaml --data data/c4/manifest.json \\
        --federation https://central:29511 --darl-url https://central:29510 \\
        --blob-url https://central:29512 --token-file ~/.pww/central.token \\
        --ca-file ~/.pww/central-ca.pem --site lumi --diloco-inner-steps 100 --resume auto
    # (jobs/*_titan.sh take the URLs, $PWW_TOKEN_FILE and $PWW_CA_FILE from central.env)

What it owns: the model, the data, the loop and the run (stages 3-6); the config is
train_config.py (flags > --config YAML > defaults; a flag this run would not read is refused,
naming the fix), the federation's phases fedphase.py, the logs and rows metrics.py. Seeds:
--seed on every rank for the model, seed*1000 + rank for augmentation and dropout, data order
from (--seed, epoch) only, so a resume continues exactly where the checkpoint stopped.

Outputs, only under --runs-dir (runs/<run>/): config.yaml (the resolved config, usable as
--config, + provenance), train.log (what rank 0 printed), metrics.jsonl (one JSON row per
line, by "split": "train", "eval" (the first, "first": true, before any training; the last,
"final": true), "diloco", and with --federation "federation" and "phase"; every row carries
tokens_total (img_total for CIFAR) and the incarnation), checkpoints/ (--resume auto continues
from the newest), federation/ (rank 0's delta and theta files, the error-feedback residual:
error_feedback.py). --tensorboard DIR: the same rows as TensorBoard scalars.

Federation: FEDERATION_GUIDE.md, "Identity" (cluster id, incarnation, requeues), "A round,
from the site's side" and "Knobs"; the rows' keys: FEDERATION_GUIDE.md, "Reading the metrics".
"""
import contextlib
import dataclasses
import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import checkpoint
import data
import diloco
import fedphase
import fedsite
import httpc
import testhooks
import models
from dist_env import ConfigError, DeviceError, Dist, init_distributed   # noqa: F401 (train.DeviceError)
from metrics import RunLog, fmt_row, provenance
from train_config import Config, parse_config, write_config_yaml
from train_step import HostToDevice, Stepper, autocast_ctx, grad_sync

# Stage 1, the process's place in the job, is dist_env.py; stage 2, the config (Config, its
# flags and --config YAML), is train_config.py; the logs and metrics rows are metrics.py's.

# ---------------------------------------------------------------------------
# Stage 3: model - built on meta, sharded or wrapped, then initialised
# ---------------------------------------------------------------------------

def make_model(cfg, d, vocab_size, group=None, mesh=None):
    """(model to train, parameter count, training FLOPs per token or per image)."""
    torch.manual_seed(cfg.seed)       # the same on every rank: FSDP shards draw one init
    meta = models.build_model(cfg.model, vocab_size=vocab_size, seq_len=cfg.seq_len)
    n_params = models.count_params(meta)
    if cfg.llm:
        flops = models.llm_flops_per_token(meta.model_args, n_params)
    else:
        flops = models.resnet_flops_per_image(cfg.model)
    param_dtype = torch.bfloat16 if (cfg.parallel == "fsdp" and cfg.dtype == "bf16") else None
    model = models.parallelize(meta, cfg.parallel, d.device, group=group, mesh=mesh,
                               param_dtype=param_dtype,
                               activation_checkpointing=cfg.activation_checkpointing,
                               compile=cfg.compile)
    return model, n_params, flops


COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def make_optimizer(cfg, model, replica_ranks, device_type="cpu"):
    """AdamW for Qwen3; SGD + Nesterov for CIFAR with the LR scaled to the replica batch.

    AdamW on a GPU is the fused implementation (one kernel per parameter group for the
    whole update; torchtitan's default) instead of the foreach default, which launches a
    chain of multi-tensor kernels per step. CPU runs keep foreach: the numbers the tests
    compare against stay those of the default implementation."""
    if cfg.llm:
        return torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95),
                                 weight_decay=cfg.weight_decay,
                                 fused=True if device_type == "cuda" else None), cfg.lr
    replica_batch = cfg.batch_size * cfg.grad_accum * replica_ranks
    lr = cfg.lr * replica_batch / 128
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, nesterov=True,
                           weight_decay=cfg.weight_decay), lr


def lr_lambda(total, warmup, floor):
    """Linear warmup to 1, then cosine down to floor (= min_lr / lr) at step `total`."""
    def f(step):
        if step < warmup:
            return (step + 1) / warmup
        t = min(1.0, (step - warmup) / max(1, total - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t))
    return f


# ---------------------------------------------------------------------------
# Stage 4: data - index lists per rank, batches on the device
# ---------------------------------------------------------------------------

class CifarSource:
    """CIFAR-10 on the device; DistributedSampler(drop_last=True) over all ranks, so each
    DiLoCo replica trains on its own shard; crop + flip on the device."""

    def __init__(self, cfg, d):
        tx, ty, vx, vy = data.load_cifar10(cfg.data)
        self.x, self.y = torch.from_numpy(tx).to(d.device), torch.from_numpy(ty).to(d.device)
        self.vx, self.vy = torch.from_numpy(vx).to(d.device), torch.from_numpy(vy).to(d.device)
        from torch.utils.data.distributed import DistributedSampler
        # drop_last: a ragged last batch desynchronises the DiLoCo outer step (a collective
        # counted per rank) and hangs the all-reduce instead of failing.
        self.sampler = DistributedSampler(range(len(tx)), num_replicas=d.world_size, rank=d.rank,
                                          shuffle=True, seed=cfg.seed, drop_last=True)
        self.batch, self.gen = cfg.batch_size, torch.Generator(device=d.device)
        self.gen.manual_seed(cfg.seed * 1000 + d.rank)
        self.micro_per_epoch = len(self.sampler) // self.batch
        self.samples_per_micro = self.batch

    def micro_batches(self, epoch, skip=0):
        self.sampler.set_epoch(epoch)
        idx = torch.tensor(list(self.sampler), device=self.x.device)
        for b in range(skip, self.micro_per_epoch):
            i = idx[b * self.batch:(b + 1) * self.batch]
            yield data.cifar_augment(self.x[i], self.gen), self.y[i]



class WindowSource:
    """Token windows from the manifest; every rank reads a disjoint slice of one
    seeded permutation per epoch (equal whole batches: drop_last by construction)."""

    def __init__(self, cfg, d, windows):
        self.w, self.d, self.cfg = windows, d, cfg
        self.micro_per_epoch = windows.train_windows // (d.world_size * cfg.batch_size)
        self.samples_per_micro = cfg.batch_size * windows.seq_len      # tokens
        self.to_device = HostToDevice(d.device)

    def micro_batches(self, epoch, skip=0):
        order = data.epoch_order(self.w.train_windows, epoch, self.cfg.seed)
        batches = data.shard_for_rank(order, self.d.rank, self.d.world_size, self.cfg.batch_size)
        for idx in batches[skip:]:
            t = self.to_device(self.w.batch(idx))
            yield t[:, :-1], t[:, 1:]


def forward_loss(model, cfg, batch):
    x, y = batch
    out = model(x)
    if cfg.llm:
        return F.cross_entropy(out.flatten(0, 1).float(), y.flatten())
    return F.cross_entropy(out.float(), y)


def _padded_share(n, d):
    """Indices of a fixed set of n items for this rank, every rank the same count:
    FSDP's forward is a collective, so a rank with one batch fewer would hang the rest."""
    per = -(-n // d.world_size)
    idx = [r * d.world_size + d.rank for r in range(per)]
    return [min(i, n - 1) for i in idx], [i < n for i in idx]


@torch.no_grad()
def evaluate(model, cfg, d, source, windows):
    """Held-out loss (+ perplexity) for Qwen3, test accuracy for CIFAR; pooled over ranks."""
    model.eval()
    sums = torch.zeros(3, dtype=torch.float64, device=d.device)     # loss*count, correct, count
    if cfg.llm:
        idx, keep = _padded_share(min(cfg.eval_windows, windows.heldout_windows), d)
        base = windows.train_windows
        for i in range(0, len(idx), cfg.batch_size):
            t = torch.from_numpy(windows.batch([base + j for j in idx[i:i + cfg.batch_size]])).to(d.device)
            k = torch.tensor(keep[i:i + cfg.batch_size], device=d.device)
            with autocast_ctx(cfg, d):
                logits = model(t[:, :-1])
            nll = F.cross_entropy(logits.flatten(0, 1).float(), t[:, 1:].flatten(), reduction="none")
            nll = nll.view(len(k), -1)[k]
            sums += torch.stack([nll.sum().double(), torch.zeros((), device=d.device, dtype=torch.float64),
                                 torch.tensor(float(nll.numel()), device=d.device, dtype=torch.float64)])
    else:
        idx, keep = _padded_share(len(source.vx), d)
        for i in range(0, len(idx), cfg.batch_size):
            j = torch.tensor(idx[i:i + cfg.batch_size], device=d.device)
            k = torch.tensor(keep[i:i + cfg.batch_size], device=d.device)
            with autocast_ctx(cfg, d):
                logits = model(data.cifar_augment(source.vx[j], train=False)).float()
            y = source.vy[j]
            nll = F.cross_entropy(logits, y, reduction="none")[k]
            sums += torch.stack([nll.sum().double(), (logits.argmax(1) == y)[k].sum().double(),
                                 k.sum().double()])
    dist.all_reduce(sums)
    model.train()
    loss = (sums[0] / sums[2]).item()
    if cfg.llm:   # perplexity from the pooled loss (averaging perplexities overstates them)
        return {"loss": loss, "ppl": math.exp(min(loss, 50.0)), "windows": int(sums[2].item()) // windows.seq_len}
    return {"loss": loss, "acc": (sums[1] / sums[2]).item(), "images": int(sums[2].item())}


# ---------------------------------------------------------------------------
# --export-init: the initial global model
# ---------------------------------------------------------------------------

def export_init(cfg):
    """--export-init: the model from --seed, unsharded on the CPU, as an fp32 tensor file
    named like named_parameters() of the unwrapped model (a tied weight appears once)."""
    import tensorio
    windows = data.TokenWindows(cfg.data) if cfg.llm else None
    torch.manual_seed(cfg.seed)
    model = models.build_model(cfg.model, vocab_size=windows.vocab_size if windows else None,
                               seq_len=windows.seq_len if windows else None)
    models.materialize(model, torch.device("cpu"))
    named = list(model.named_parameters())
    tensorio.save_torch(((n, p.detach().float()) for n, p in named), cfg.export_init,
                        metadata={"model": cfg.model, "seed": str(cfg.seed),
                                  "corpus_digest": windows.digest if windows else ""},
                        specs=[(n, "F32", tuple(p.shape)) for n, p in named])
    n = sum(p.numel() for _, p in named)
    print(f"wrote {cfg.export_init}: {cfg.model}, {len(named)} tensors, {n:,} parameters (fp32, seed {cfg.seed})")
    return cfg.export_init


# ---------------------------------------------------------------------------
# Stage 5: the loop - the local one here; a federated site's phases are fedphase.py's
# (the step body both share is train_step.py)
# ---------------------------------------------------------------------------

def local_loop(run, start):
    """The job inside this allocation: --steps optimizer steps (or the epochs), DiLoCo's
    outer step every H with --diloco-replicas; then the last eval and checkpoint. Every rank
    runs this; returns the step count at the end."""
    cfg, d, log, model, outer, source = run.cfg, run.d, run.log, run.model, run.outer, run.source
    per_epoch, total, scaler = run.steps_per_epoch, run.total, run.scaler
    unit = "tokens" if cfg.llm else "img"
    if cfg.llm and cfg.eval_every and not start:
        run.log_eval(0, first=True)              # the held-out loss before training
    stepper = Stepper(run, start)
    step, (epoch, skip) = start, divmod(start, per_epoch)
    loss_sum = torch.zeros((), device=d.device)
    model.train()
    if outer:
        outer.begin_phase()                      # --diloco-phase-s: the first phase's clock
    while step < total:
        micro = source.micro_batches(epoch, skip * cfg.grad_accum)
        skip = 0
        for _ in range(per_epoch - (step % per_epoch)):
            if step >= total:
                break
            stepper.begin(step)
            for i in range(cfg.grad_accum):
                batch = next(micro)
                with grad_sync(model, cfg, i == cfg.grad_accum - 1), autocast_ctx(cfg, d):
                    loss = forward_loss(model, cfg, batch)
                if cfg.grad_accum > 1:
                    loss = loss / cfg.grad_accum
                (scaler.scale(loss) if scaler else loss).backward()
                loss_sum += loss.detach()
            stepper.end()
            step += 1
            log.total += run.units_per_step
            row = outer.after_inner_step() if outer else None     # collective every H steps
            if row:
                log.metric(dict(row, step=step))
                log.log("outer " + fmt_row(row))
            if stepper.due(step, step == total):
                dist.all_reduce(loss_sum)
                n = step - stepper.step_mark
                stepper.train_row(step, loss_sum.item() / (n * d.world_size),
                                  n * cfg.grad_accum * source.samples_per_micro * d.world_size, unit,
                                  epoch=round(step / per_epoch, 4))
                loss_sum.zero_()
            t_pause = time.perf_counter()
            with stepper.pause():
                if cfg.eval_every and step % cfg.eval_every == 0 and step < total:
                    run.log_eval(step)
                if cfg.ckpt_every and step % cfg.ckpt_every == 0 and step < total:
                    run.save(step)
            if outer and outer.phase_clock is not None:     # evals and checkpoints are not inner steps
                outer.phase_clock.pause(time.perf_counter() - t_pause)
        epoch += 1
        if not cfg.llm and cfg.eval_every == 0 and step < total:
            with stepper.pause():
                run.log_eval(step)                # CIFAR: one eval row per epoch

    # -- finish
    row = outer.finish() if outer else None         # a trailing partial phase, before the last eval
    if row:
        log.metric(dict(row, step=step))
        log.log("outer " + fmt_row(row))
    run.log_eval(step)
    if start < step or cfg.resume == "none":
        run.save(step)
    return step


# ---------------------------------------------------------------------------
# Stage 6: the run - its parts, built in order by train()
# ---------------------------------------------------------------------------

@dataclasses.dataclass
class Run:
    """One job's parts, filled in by train()'s stages in order; both loops read them."""
    cfg: Config
    d: Dist
    log: RunLog
    run_dir: str
    windows: object                    # data.TokenWindows, or None (CIFAR)
    prov: dict
    model: object = None
    n_params: int = 0
    flops: float = 0.0                 # training FLOPs per token / per image
    opt: object = None
    peak_lr: float = 0.0
    scaler: object = None              # torch.amp.GradScaler with --dtype fp16
    source: object = None              # CifarSource | WindowSource | fedsite.LeasedSource
    steps_per_epoch: int = 1
    total: int = 0
    units_per_step: int = 0            # tokens (images) one optimizer step trains, all ranks
    schedule: object = None            # step -> LR factor
    outer: object = None               # diloco.DiLoCo with --diloco-replicas > 1 or --federation
    fed_round: int = None              # --federation, resumed: the round of the theta_global the checkpoint holds

    def save(self, step, fed_round=None):
        cfg = self.cfg
        fed = {"cluster": cfg.cluster, "round": fed_round} if cfg.federation else None
        checkpoint.save(self.run_dir, step, self.model, self.opt, diloco=self.outer,
                        sharded=cfg.sharded_checkpoint, keep=cfg.keep_checkpoints,
                        extra={"epoch": step // self.steps_per_epoch,
                               "digest": self.windows.digest if self.windows else None, "federation": fed,
                               "units_total": self.log.total})

    def log_eval(self, step, fed_round=None, **extra):
        """Score theta (the global weights under DiLoCo), log the "eval" row and return it."""
        with self.outer.global_weights() if self.outer else contextlib.nullcontext():
            row = dict(split="eval", step=step, epoch=round(step / self.steps_per_epoch, 4),
                       **({"round": fed_round} if self.cfg.federation else {}), **extra,
                       **evaluate(self.model, self.cfg, self.d, self.source, self.windows))
        self.log.metric(row)
        self.log.log("eval  " + fmt_row(row))
        return row


def settle_config(cfg, d):
    """Resolve the defaults, check the flags against the world size and the corpus; returns
    the corpus (data.TokenWindows), or None for CIFAR."""
    cfg.resolve(d.accel)
    cfg.validate()
    if d.accel != "cpu":
        torch.set_float32_matmul_precision("high")        # TF32 where fp32 matmuls remain
    try:
        diloco.ReplicaLayout.check(d.world_size, cfg.diloco_replicas)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    windows = data.TokenWindows(cfg.data) if cfg.llm else None
    if windows is not None:
        if cfg.seq_len is None:
            cfg.seq_len = windows.seq_len
        elif cfg.seq_len != windows.seq_len:
            raise ConfigError(f"--seq-len {cfg.seq_len}: {cfg.data} holds windows of "
                              f"{windows.seq_len}+1 tokens; drop --seq-len or re-run "
                              f"tokenize_corpus.py --seq-len {cfg.seq_len}")
        if cfg.eval_windows > windows.heldout_windows:
            raise ConfigError(f"--eval-windows {cfg.eval_windows}: the corpus holds out only "
                              f"{windows.heldout_windows}; lower it")
    return windows


def default_run_name(cfg, d):
    """<model>-<SLURM_JOB_ID> (stable across a requeue), else <model>-<rank 0's date-time>;
    with --federation <model>-<cluster id>, stable across resubmissions too."""
    job = os.environ.get("SLURM_JOB_ID")
    name = [f"{cfg.model}-{job}" if job else f"{cfg.model}-{time.strftime('%Y%m%d-%H%M%S')}"]
    if cfg.federation:         # the stream's name: a requeued job (new job id) finds its checkpoints
        name = [f"{cfg.model}-{cfg.cluster}"]
    dist.broadcast_object_list(name, src=0)
    return name[0]



def open_run_dir(cfg, d, windows):
    """runs/<run>/ (made by rank 0; checkpoints there need --resume), its train.log and
    metrics.jsonl, and the provenance line; returns the Run the later stages fill in."""
    cfg.run_name = cfg.run_name or default_run_name(cfg, d)
    run_dir = os.path.join(cfg.runs_dir, cfg.run_name)
    if d.is_main:
        os.makedirs(run_dir, exist_ok=True)
    dist.barrier()
    if cfg.resume == "none" and checkpoint.latest(run_dir):
        raise ConfigError(f"{run_dir} already has checkpoints and --resume is none: "
                          f"use --resume auto to continue it, or another --run-name")
    log = RunLog(run_dir, d.is_main, cfg.tensorboard)
    log.total_key = "tokens_total" if cfg.llm else "img_total"
    prov = provenance(d)
    log.log(f"run {cfg.run_name}: {d.world_size} ranks, {d.accel} ({d.backend}), "
            f"{prov['devices'][0]}, torch {prov['torch']}, torchtitan {prov['torchtitan']}, "
            f"code {prov.get('git', 'sha256 of *.py')[:12]}")
    return Run(cfg, d, log, run_dir, windows, prov)


def build_model(run):
    """The model (sharded or wrapped, initialised from --seed), its optimizer and attention
    kernel, into `run`; returns DiLoCo's replica layout (None without --diloco-replicas)."""
    cfg, d, windows = run.cfg, run.d, run.windows
    k = cfg.diloco_replicas
    layout = diloco.ReplicaLayout.build(d.world_size, d.rank, k) if k > 1 else None
    run.model, run.n_params, run.flops = make_model(
        cfg, d, windows.vocab_size if windows else None,
        group=layout.inner_group if layout else None, mesh=layout.mesh["shard"] if layout else None)
    torch.manual_seed(cfg.seed * 1000 + d.rank)      # per-rank streams from here on
    run.opt, run.peak_lr = make_optimizer(cfg, run.model, d.world_size // k, d.device.type)
    attention = models.configure_attention(run.model, d.device, COMPUTE_DTYPES[cfg.dtype])
    run.scaler = torch.amp.GradScaler(d.device.type) if cfg.dtype == "fp16" else None
    run.log.log(f"model {cfg.model}: {run.n_params:,} parameters, {run.flops / 1e9:.3g} GFLOP per "
                f"{'token' if cfg.llm else 'image'} (train), {cfg.parallel}, dtype {cfg.dtype}, "
                f"peak lr {run.peak_lr:.4g}" + (f", DiLoCo k={k} H={cfg.diloco_inner_steps}" if k > 1 else "")
                + (f", attention {attention}" if attention else "") + (", compiled per block" if cfg.compile else ""))
    if attention and attention.startswith("math") and d.accel != "cpu":
        run.log.log(f"WARNING: attention falls back to the math kernel on {run.prov['devices'][0]}: an S x S "
                    f"score matrix per head (memory O(seq_len^2)); check the torch build (smoke.py)")
    return layout


def plan_steps(run):
    """Steps per epoch, the total, warmup and the LR schedule; then config.yaml, every
    default resolved now (the config a rerun would need)."""
    cfg, d = run.cfg, run.d
    if cfg.federation:                 # the whole corpus at this site's step
        run.steps_per_epoch = -(-run.windows.train_windows // (cfg.batch_size * d.world_size * cfg.grad_accum))
    else:
        run.steps_per_epoch = run.source.micro_per_epoch // cfg.grad_accum
    if run.steps_per_epoch < 1:
        raise ConfigError(f"{cfg.data} gives each of {d.world_size} ranks {run.source.micro_per_epoch} "
                          f"micro-batches per epoch, fewer than --grad-accum {cfg.grad_accum}: lower "
                          f"--batch-size or --grad-accum, or use more data")
    run.total = cfg.steps or run.steps_per_epoch * (1 if cfg.llm else cfg.epochs)
    run.units_per_step = cfg.grad_accum * cfg.batch_size * d.world_size * (run.windows.seq_len if cfg.llm else 1)
    warmup = cfg.warmup_steps = cfg.warmup_steps if cfg.warmup_steps is not None else run.total // 20
    if d.is_main:
        write_config_yaml(os.path.join(run.run_dir, "config.yaml"), cfg, run.prov)
    run.log.log("config " + json.dumps(dataclasses.asdict(cfg)))
    run.schedule = lr_lambda(run.total, warmup, cfg.min_lr / cfg.lr)
    run.log.log(f"data {cfg.data}: {run.steps_per_epoch} steps per epoch of {cfg.grad_accum} x "
                f"{cfg.batch_size} per rank; {run.total} steps, warmup {warmup}")


def make_outer(run, layout, carrier):
    """DiLoCo over the replicas of this allocation, or (federation) over one replica whose
    outer step goes through the carrier, which says the local outer step (FedMomCarrier.outer_config:
    plain replacement, or under --overlap-fold eager the aggregator's lr and momentum)."""
    cfg, d = run.cfg, run.d
    dcfg = carrier.outer_config(cfg.diloco_inner_steps) if cfg.federation \
        else diloco.DiLoCoConfig.from_args(cfg)
    # --diloco-phase-s inside one allocation: DiLoCo ends each phase by the clock; a federated
    # site's phases are fedphase's (one DARL span, ended on a block boundary)
    timed = cfg.diloco_phase_s if not cfg.federation and cfg.diloco_phase_s else None
    clock = diloco.PhaseClock(device=d.device, clock=testhooks.phase_clock(d.rank)) if timed else None
    return diloco.DiLoCo(run.model, layout or diloco.ReplicaLayout.plan(d.world_size, d.rank, 1), dcfg, carrier,
                         phase_clock=clock, phase_s=timed)


def resume(run):
    """--resume auto | PATH: model, optimizer and DiLoCo state from a checkpoint of the same
    corpus; returns the step to start at (0 without one)."""
    cfg, log = run.cfg, run.log
    if cfg.resume == "none":
        return 0
    extra = (checkpoint.load_latest(run.run_dir, run.model, run.opt, diloco=run.outer) if cfg.resume == "auto"
             else checkpoint.load(cfg.resume, run.model, run.opt, diloco=run.outer))
    if extra is None:
        log.log(f"--resume auto: no checkpoint in {run.run_dir}; starting at step 0")
        return 0
    w = run.windows
    if w is not None and extra.get("digest") not in (None, w.digest):
        raise ConfigError(f"--data {cfg.data}: corpus digest {w.digest[:12]} differs "
                          f"from the checkpoint's {extra['digest'][:12]}; resume on the same corpus")
    run.fed_round = (extra.get("federation") or {}).get("round")
    log.total = extra.get("units_total", extra["step"] * run.units_per_step)
    log.log(f"resumed at step {extra['step']} from {cfg.resume} ({run.run_dir})")
    return extra["step"]


def train(cfg: Config):
    """Run one training job from a parsed Config (every rank calls this); returns the run directory."""
    d = init_distributed(cfg.device)
    windows = settle_config(cfg, d)
    run = open_run_dir(cfg, d, windows)
    layout = build_model(run)
    site = carrier = None
    if cfg.federation:
        site, carrier = fedphase.join(run)
    else:
        run.source = WindowSource(cfg, d, windows) if cfg.llm else CifarSource(cfg, d)
    plan_steps(run)
    if cfg.diloco_replicas > 1 or carrier is not None:
        run.outer = make_outer(run, layout, carrier)
    start = resume(run)
    if cfg.federation:
        step = fedphase.train_site(run, site, carrier, start)
    else:
        step = local_loop(run, start)
    run.log.log(f"done: {step} steps, run directory {run.run_dir}")
    run.log.close()
    dist.barrier()
    dist.destroy_process_group()
    return run.run_dir


def main(argv=None):
    try:
        cfg = parse_config(argv)
        if cfg.export_init:
            return export_init(cfg.resolve("cpu"))
        return train(cfg)
    except (ConfigError, fedsite.CorpusMismatch, data.CorpusError) as e:
        if os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0":
            print(f"train.py: error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    except fedphase.RankZeroFailed as e:          # rank 0 prints the real error and traceback
        print(f"train.py: {e}", file=sys.stderr, flush=True)
        sys.exit(1)
    except (httpc.GaveUp, httpc.TLSConfigError) as e:   # rank 0: the central VM out of reach, one line
        print(f"train.py: error: {e}", file=sys.stderr, flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
    # Every file is closed and fsynced and the process group is gone: skip the interpreter's
    # teardown. Unloading torch + torchtitan costs 1.1-1.4 s of CPU per process (measured:
    # atexit to exit); 8 ranks sharing 2 cores took 9 s after "done:" to exit, ~25 s on a
    # loaded Slurm node. No thread or process-group wait is involved (barrier and destroy
    # return in < 0.01 s).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
