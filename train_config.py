"""train_config.py - train.py's options: one Config dataclass, the flags derived from it, --config YAML.

Runs on: compute nodes and any CPU, imported by train.py (and the tests). Not started on
its own; no port, no state. `python train.py --help` prints what this module builds.

Each option is said once, as a field of Config: its type, its default and its --help
text (the field's metadata, written with option()). build_parser() turns the fields into
flags (batch_size -> --batch-size) and appends "(default ...)" to each help text from the
field, so --help and the dataclass cannot disagree (tests/test_train.py walks every field).
Model-dependent defaults are None here, filled in by Config.resolve() once the device is
known; --help shows them as "LLM / CIFAR".

Precedence: flags > --config YAML (keys are flag names, - or _) > the fields' defaults.
parse_config() reads the YAML into the parser's defaults, so a flag always wins; train.py
writes the resolved config into runs/<run>/config.yaml (write_config_yaml), usable as
--config again.

Refusals are ConfigErrors whose one line names the flag and the fix ("train.py: error: ..."):
  - Config.validate(): values that cannot work (a range, fp16 under FSDP, a federated site
    given DiLoCo's outer step), whether a flag or the YAML set them;
  - parse_config(): a flag given on the command line in a mode where nothing reads it
    (Config.unread(): --ckpt-every on a federated site, --wire-block with --wire topk,
    --epochs for a Qwen3 model, any training flag with --export-init). A --config key is
    not refused for that: a YAML is a set of defaults shared by modes (configs/qwen3_0.6B.yaml
    serves a federated site and a single-allocation run, and its ckpt_every means something
    only in the second), whereas a flag typed for this run was meant to do something.
"""
import argparse
import dataclasses
import difflib
import os
import re
import socket
import typing

import diloco
import durable
import httpc
import models
import wire
import wire_torch
from dist_env import ConfigError
from outer_state import OUTER_LR, OUTER_MOMENTUM

# DiLoCo's outer-step flags: they mean something only inside one allocation
OUTER_STEP_FLAGS = ("diloco_outer_optimizer", "diloco_outer_lr", "diloco_outer_momentum")
# DiLoCo's own defaults (H, the optimizer, the device); lr and momentum are outer_state.py's,
# which DiLoCoConfig is given (diloco.py imports nothing of the project)
_DILOCO = diloco.DiLoCoConfig(outer_lr=OUTER_LR, outer_momentum=OUTER_MOMENTUM)

GROUPS = {"diloco": "DiLoCo (k replicas inside this allocation)",
          "federation": "federation (one model trained across sites through the central VM)"}

# the options a federated site reads and a run inside one allocation does not (--overlap and
# --encode-on are refused by validate() from the YAML too, naming what they would have done)
FEDERATION_ONLY = ("darl_url", "blob_url", "token_file", "ca_file", "proxy", "site", "replica", "transport", "wire",
                   "wire_block", "wire_topk_chunk", "wire_topk_k", "wire_topk_bits", "error_feedback",
                   "wire_feedback_decay",
                   "overlap_fold", "throttle_ms", "register_wait_s", "central_retry_s")
EXPORT_READS = ("config", "model", "data", "seed", "export_init")     # all --export-init reads


def option(default, help, shown=None, **flag):
    """A Config field: its default and its --help text, to which build_parser appends
    "(default <shown, else the default>)". `flag`: argparse's extras - choices, metavar,
    aliases (older names of the flag), negatable (--x / --no-x for a bool), env (a variable
    whose value, when set, is the default), group (a key of GROUPS)."""
    return dataclasses.field(default=default, metadata={"help": help, "shown": shown, **flag})


@dataclasses.dataclass
class Config:
    config: str | None = option(None, "YAML file of defaults for these flags (keys as flag names, - or _); "
                                      "flags win", shown="none")
    model: str = option("resnet18", "a CIFAR ResNet, or a Qwen3 flavor (qwen3-tiny for tests and the demo)",
                        choices=models.MODEL_NAMES)
    data: str | None = option(None, "CIFAR-10 python-pickle directory, or a tokenize_corpus.py manifest.json",
                              shown="data/tokens/manifest.json / data/cifar-10-batches-py")
    parallel: str = option("ddp", "DDP, or FSDP2 sharded per block then at the root", choices=("ddp", "fsdp"))
    device: str = option("auto", "auto: ROCm or CUDA when a GPU is visible, else CPU with gloo",
                         choices=("auto", "cpu", "cuda", "rocm"))
    # bf16 on GPUs, fp32 on CPUs: resolve() says why
    dtype: str = option("auto", "compute dtype; auto = bf16 on GPUs, fp32 on CPUs; fp16 only with --parallel ddp "
                                "(GradScaler)", choices=("auto", "bf16", "fp32", "fp16"))
    batch_size: int | None = option(None, "micro-batch per rank, sequences or images", shown="8 / 128")
    grad_accum: int = option(1, "micro-batches per optimizer step")
    steps: int = option(0, "optimizer steps; 0 = one epoch of windows / --epochs of CIFAR")
    epochs: int = option(1, "CIFAR epochs when --steps is 0")
    lr: float | None = option(None, "peak LR: AdamW for Qwen3; SGD for CIFAR per 128 images of replica batch, "
                                    "scaled linearly (0.1 -> 0.8 at 1024)", shown="3e-4 / 0.1")
    min_lr: float | None = option(None, "LR at the end of the cosine", shown="lr/10 / 0")
    warmup_steps: int | None = option(None, "linear warmup, optimizer steps", shown="5% of the run")
    weight_decay: float | None = option(None, "decoupled (AdamW) / L2 (SGD) weight decay", shown="0.1 / 5e-4")
    grad_clip: float | None = option(None, "max global gradient norm, 0 = off", shown="1.0 / 0")
    seq_len: int | None = option(None, "tokens per Qwen3 sequence; must match the corpus manifest",
                                 shown="the manifest's")
    seed: int = option(0, "model init seed; data and augmentation add the rank")
    eval_every: int = option(0, "evaluate every N optimizer steps (with --federation: every N outer phases, "
                                "of theta_global); 0 = each CIFAR epoch and the end")
    eval_windows: int = option(64, "held-out windows scored per Qwen3 eval, a fixed set whatever the rank count")
    ckpt_every: int = option(0, "checkpoint every N optimizer steps; 0 = at the end only (a federated site "
                                "checkpoints at every phase's end)")
    keep_checkpoints: int = option(2, "newest checkpoints kept")
    sharded_checkpoint: bool = option(False, "torch.distributed.checkpoint shards instead of one file")
    activation_checkpointing: bool = option(False, "recompute each transformer block in backward (Qwen3)")
    compile: bool = option(False, "torch.compile each block (transformer block / ResNet stage), fullgraph, as "
                                  "torchtitan does: faster steps after a one-off compile per shape (a ResNet "
                                  "only with --parallel ddp)")
    fsdp_defer_grad_sync: bool = option(
        False, "with --grad-accum > 1 under FSDP: reduce-scatter gradients only on the last micro-batch. Fewer "
               "collectives, but every rank then holds a full unsharded fp32 gradient between micro-batches "
               "(4 bytes x parameters: ~32 GB per GPU for qwen3-8B); off: reduce-scatter every micro-batch "
               "into sharded gradients, as torchtitan does")
    run_name: str | None = option(None, "the run directory runs/<run-name>/",
                                  shown="<model>-<SLURM_JOB_ID>, else <model>-<date-time>; with --federation "
                                        "<model>-<cluster id>")
    runs_dir: str = option("runs", "parent of run directories")
    resume: str = option("none", "none | auto (newest checkpoint of this run) | PATH")
    log_every: int = option(10, "optimizer steps per train row")
    tensorboard: str | None = option(None, "also write every metrics row as TensorBoard scalars into DIR "
                                           "(torch.utils.tensorboard; needs the tensorboard package)",
                                     shown="none, metrics.jsonl only", metavar="DIR")

    diloco_replicas: int = option(1, "k: model replicas, contiguous equal rank blocks; must divide the rank "
                                     "count; 1 = plain data parallel, no outer step", group="diloco")
    diloco_inner_steps: int = option(_DILOCO.inner_steps, "H: inner steps between outer steps (with "
                                                          "--federation: per phase)", group="diloco")
    diloco_phase_s: float | None = option(
        None, "T: phases measured in time instead of steps: each phase runs as many inner steps as fit in "
              "T s of training, judged from the measured step time, ended on the same step by every rank. "
              "With --federation the default is the aggregator's offer (fedmom_server.py --phase-s: one "
              "cadence for every site) and a site counts its own round trip in T; 0 = off (H steps a phase). "
              "Use it when sites (or replicas) differ in speed or the speed changes; use "
              "--diloco-inner-steps for a fixed, reproducible phase (FEDERATION_GUIDE.md, 'Phases measured "
              "in time')", shown="the aggregator's --phase-s, else off", metavar="T", group="diloco")
    # None = not given: resolve() fills DiLoCo's defaults inside one allocation; with
    # --federation the outer step is the aggregator's, and validate() refuses a given value
    diloco_outer_optimizer: str | None = option(
        None, "outer optimizer; sgd + lr 1.0 + momentum 0 = FedAvg; refused with --federation, where "
              "fedmom_server.py sets the outer step", shown=_DILOCO.outer_optimizer,
        choices=diloco.OUTER_OPTIMIZERS, group="diloco")
    diloco_outer_lr: float | None = option(None, "outer learning rate; refused with --federation: "
                                                 "fedmom_server.py --outer-lr", shown=_DILOCO.outer_lr, group="diloco")
    diloco_outer_momentum: float | None = option(None, "outer (Nesterov) momentum; refused with --federation: "
                                                       "fedmom_server.py --outer-momentum",
                                                 shown=_DILOCO.outer_momentum, group="diloco")
    diloco_outer_device: str = option(_DILOCO.outer_device, "where theta and the outer momentum live: 'same' as "
                                      "the model, or 'cpu' (saves two fp32 parameter copies of device memory "
                                      "for two host<->device copies per outer step)",
                                      choices=diloco.OUTER_DEVICES, group="diloco")

    federation: str | None = option(None, "train as one site of a federated run: the aggregator "
                                          "fedmom_server.py (http://central:29511); H = --diloco-inner-steps",
                                    shown="off", metavar="FEDMOM_URL", group="federation")
    darl_url: str | None = option(None, "the DARL coordinator darl_server.py (http://central:29510); required "
                                        "with --federation", shown="none", group="federation")
    blob_url: str | None = option(None, "the blob store blobstore.py (http://central:29512) for the blob "
                                        "transport", shown="none, everything inline", group="federation")
    token_file: str | None = option(None, "file holding the central services' bearer token",
                                    shown="$PWW_TOKEN_FILE, else $PWW_TOKEN, else no token", env="PWW_TOKEN_FILE",
                                    group="federation")
    ca_file: str | None = option(None, "CA certificate of the central services' https:// URLs (central.sh's "
                                       "ca.pem)", shown="$PWW_CA_FILE, else the system's CAs", env="PWW_CA_FILE",
                                 group="federation")
    proxy: str | None = option(None, "the site's proxy to the central VM (http://HOST:PORT, socks5h://HOST:PORT) "
                                     "or none for direct; beats the environment (httpc.py's docstring)",
                               shown="$PWW_PROXY, else https_proxy/all_proxy/no_proxy as curl reads them",
                               metavar="URL|none", group="federation")
    site: str | None = option(None, "site name in the cluster id", shown="$PWW_SITE, else the short host name",
                              group="federation")
    replica: str | None = option(None, "a second stream at the same site: cluster id <site>-<replica>",
                                 shown="none, cluster id = site", group="federation")
    transport: str = option("auto", "how deltas and theta move: inline HTTP, the blob store, or auto = blob "
                                    "above 256 MiB when --blob-url is set", choices=("inline", "blob", "auto"),
                            group="federation")
    wire: str = option("f32", "format of the delta sent each round (wire.py; FEDERATION_GUIDE.md section 4, "
                              "'Wire formats'): f32 4 B/param, bf16 2, int8 1.02, int4 0.52, int2 0.27, topk 0.03",
                       choices=wire.FORMATS, aliases=("--delta-dtype",), group="federation")
    wire_block: int = option(128, "int8/int4/int2: values per scale along the last dimension, 64-256",
                             group="federation")
    wire_topk_chunk: int = option(4096, "topk: values per chunk of each flattened tensor", group="federation")
    wire_topk_k: int = option(64, "topk: largest-magnitude values kept per chunk", group="federation")
    wire_topk_bits: int = option(4, "topk: bits per kept value (2: the int2 grid, SparseLoCo's 2-bit values)",
                                 choices=(2, 4, 8), group="federation")
    encode_on: str = option("auto", "where the site encodes its delta and adds theta_global's update: host = "
                                    "numpy on rank 0's CPU (wire.py, the reference; the update file to file); "
                                    "device = every rank on its training device, the same bits (int8/int4/int2 only): "
                                    "each rank encodes its own FSDP shard (wire_torch.py, shard_wire.py), rank 0 "
                                    "gathers only codes and scales, error feedback is kept per rank, and an "
                                    "int8/int4/int2 update (--down-wire) is added to each rank's shard, rank 0's host "
                                    "checking the aggregator's digest behind the training; auto = device for "
                                    "--wire int8/int4/int2 on a GPU, else host", choices=("host", "device", "auto"),
                            group="federation")
    error_feedback: bool = option(True, "add what the wire format dropped to the next round's delta; the buffer "
                                        "is kept in runs/<run>/federation/ across --resume auto (f32 drops "
                                        "nothing)", negatable=True, group="federation")
    wire_feedback_decay: float = option(1.0, "error feedback: the residual carried into the next delta is this x "
                                             "what the last one left (beta: delta + beta x e is encoded; 1 = "
                                             "all of it; SparseLoCo runs 0.95, with --wire topk "
                                             "--wire-topk-bits 2)", group="federation")
    overlap: bool = option(False, "train the next phase while the delta's round trip runs, and fold the new "
                                  "theta_global in when it arrives (one-step-delayed outer update; "
                                  "FEDERATION_GUIDE.md section 4, 'Overlap'); costs 4 B/param of host memory "
                                  "per rank", group="federation")
    overlap_fold: str = option("arrival", "with --overlap, when the new theta_global is folded in: at the first "
                                          "inner step after it arrived (one small broadcast per step while a "
                                          "round trip runs), or at the end of the phase it arrived in; eager: "
                                          "on arrival, and each phase after a send starts from a local "
                                          "step of the aggregator's outer optimizer on the site's own delta "
                                          "(eager updates), which the fold replaces by theta_global; costs "
                                          "4 B/param more per rank, on the device (the momentum estimate)",
                               choices=("arrival", "end", "eager"), group="federation")
    throttle_ms: int = option(0, "sleep this many ms after every inner step: for demos and tests only, to make "
                                 "one site slower", group="federation")
    register_wait_s: float = option(600.0, "how long to wait, in s, for a previous incarnation of this cluster "
                                           "id (a killed, requeued job) to expire at DARL and FedMom",
                                    group="federation")
    central_retry_s: float = option(httpc.RETRY_S, "the one retry budget of every call to the central VM: "
                                                   "a call is repeated (connection errors, 5xx; never a "
                                                   "refusal) until this many s pass without progress, then "
                                                   "the site stops with one error naming the call. Any call's "
                                                   "worst-case wait is this number (a transfer that keeps "
                                                   "moving bytes is progress)", group="federation")
    export_init: str | None = option(None, "write the model built from --seed as an fp32 tensor file "
                                           "(fedmom_server.py --init) and exit; needs --model and, for Qwen3, "
                                           "--data", shown="off", metavar="PATH", group="federation")

    @property
    def cluster(self):
        """The stream's id at DARL and FedMom: --site (or $PWW_SITE, else the short host
        name), plus -<replica> with --replica. Stable across requeues by construction."""
        site = self.site or os.environ.get("PWW_SITE") or socket.gethostname().split(".")[0]
        return site if not self.replica else f"{site}-{self.replica}"

    @property
    def llm(self):
        return models.is_llm(self.model)

    def resolve(self, accel):
        """Fill the model-dependent defaults (None above); returns self."""
        llm, gpu = self.llm, accel != "cpu"
        pick = lambda v, for_llm, for_cifar: v if v is not None else (for_llm if llm else for_cifar)
        self.data = pick(self.data, "data/tokens/manifest.json", "data/cifar-10-batches-py")
        self.batch_size = pick(self.batch_size, 8, 128)
        self.lr = pick(self.lr, 3e-4, 0.1)
        self.min_lr = pick(self.min_lr, self.lr / 10, 0.0)
        self.weight_decay = pick(self.weight_decay, 0.1, 5e-4)
        self.grad_clip = pick(self.grad_clip, 1.0, 0.0)
        # bf16 on GPUs (MI250X and H100 do it natively, with fp32's range: no loss scaler);
        # fp32 on CPUs, where runs are tests and demos and fp32 gives the same numbers on
        # every machine (CPU bf16 speed varies with the instruction set: AMX, AVX512-BF16).
        if self.dtype == "auto":
            self.dtype = "bf16" if gpu else "fp32"
        if self.federation is None:      # federated: left unset (validate refuses a given one)
            for name in OUTER_STEP_FLAGS:
                if getattr(self, name) is None:
                    setattr(self, name, getattr(_DILOCO, name.removeprefix("diloco_")))
        elif self.encode_on == "auto":
            # on a GPU, int8/int4/int2 encode where the delta was gathered: only the codes and
            # scales (an eighth of fp32 for int4) cross to the host, not the fp32 tensor,
            # and rank 0's CPU does not run the numpy codec; the bits are the same
            self.encode_on = "device" if gpu and self.wire in wire_torch.LEVELS else "host"
        return self

    def validate(self):
        """Checks that need no process group. Errors name the flag to change."""
        if self.dtype == "fp16" and self.parallel == "fsdp":
            raise ConfigError("--dtype fp16 needs a GradScaler, and FSDP2's mixed precision has "
                              "none (gradients would silently underflow); use --dtype bf16, or "
                              "--parallel ddp for fp16 with a scaler")
        for flag, v, lo in (("--batch-size", self.batch_size, 1), ("--grad-accum", self.grad_accum, 1),
                            ("--steps", self.steps, 0), ("--epochs", self.epochs, 1),
                            ("--log-every", self.log_every, 1), ("--eval-every", self.eval_every, 0),
                            ("--ckpt-every", self.ckpt_every, 0), ("--keep-checkpoints", self.keep_checkpoints, 1),
                            ("--warmup-steps", self.warmup_steps, 0), ("--eval-windows", self.eval_windows, 0),
                            ("--diloco-replicas", self.diloco_replicas, 1)):
            if v is not None and v < lo:
                raise ConfigError(f"{flag} {v}: must be >= {lo}")
        if not self.lr > 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ConfigError(f"--lr {self.lr} / --min-lr {self.min_lr}: need 0 <= min-lr <= lr and lr > 0")
        if self.llm and not self.data.endswith(".json"):
            raise ConfigError(f"--data {self.data}: --model {self.model} reads a tokenized corpus; "
                              f"give its manifest.json (python tokenize_corpus.py --out DIR)")
        self.check_phase_s()
        if self.federation is not None:
            self.validate_federation()
        elif self.overlap:
            raise ConfigError("--overlap is for federated sites (--federation): inside one allocation "
                              "the outer all-reduce is not worth hiding")
        elif self.encode_on != "auto":
            raise ConfigError(f"--encode-on {self.encode_on} is for federated sites (--federation): inside "
                              "one allocation no delta is encoded; drop it")
        if self.fsdp_defer_grad_sync and self.parallel != "fsdp":
            raise ConfigError(f"--fsdp-defer-grad-sync is for --parallel fsdp (DDP always defers the "
                              f"all-reduce to the last micro-batch); drop it with --parallel {self.parallel}")
        if not self.llm and self.compile and self.parallel == "fsdp":
            # measured with torch 2.13 on CPU: bf16 stops in Dynamo ("Attempted to call function
            # marked as skipped": the FSDP2 hooks of the BatchNorm layers sharded on their own,
            # inside the fullgraph stage), fp32 in Inductor ("Cannot convert expression to float")
            raise ConfigError(f"--compile with --parallel fsdp is for the Qwen3 models: a compiled "
                              f"ResNet stage under FSDP2 does not build; use --parallel ddp for "
                              f"--model {self.model} --compile (ResNets fit on one GPU), or drop --compile")
        if not self.llm and self.activation_checkpointing:
            raise ConfigError("--activation-checkpointing is for the Qwen3 models: recomputing a "
                              "ResNet stage would update its BatchNorm statistics twice")
        if self.resume not in ("none", "auto") and not os.path.exists(self.resume):
            raise ConfigError(f"--resume {self.resume}: no such checkpoint; use none, auto or a path "
                              f"under runs/<run>/checkpoints/")
        if self.diloco_replicas > 1:
            diloco.DiLoCoConfig.from_args(self)          # raises naming the --diloco-* flag

    def wire_codec(self):
        """The delta's wire format (wire.py), validated; errors name the --wire-* flag."""
        try:
            return wire.Codec(self.wire, self.wire_block, self.wire_topk_chunk, self.wire_topk_k,
                              self.wire_topk_bits).validate()
        except ValueError as e:
            raise ConfigError(str(e)) from None

    def validate_federation(self):
        self.wire_codec()
        if self.proxy and self.proxy.strip().lower() != "none":
            try:
                httpc.parse_proxy(self.proxy, "--proxy")
            except httpc.RouteError as e:
                raise ConfigError(str(e)) from None
        if self.encode_on == "device" and self.wire not in wire_torch.LEVELS:
            raise ConfigError(f"--encode-on device encodes int8, int4 and int2 (wire_torch.py); --wire {self.wire} "
                              f"is encoded on the host: use --encode-on host or auto, or --wire int8/int4/int2")
        if not 0 < self.wire_feedback_decay <= 1:
            raise ConfigError(f"--wire-feedback-decay {self.wire_feedback_decay:g}: use a factor in (0, 1] "
                              "(1 = the residual carried whole; SparseLoCo runs 0.95)")
        given = [name for name in OUTER_STEP_FLAGS if getattr(self, name) is not None]
        if given:
            flags = ", ".join(f"--{n.replace('_', '-')} {getattr(self, n)}" for n in given)
            raise ConfigError(f"{flags} with --federation: the outer step is the aggregator's, set by "
                              f"fedmom_server.py --outer-lr and --outer-momentum (Nesterov); a site only "
                              f"takes theta_global, so drop {'them' if len(given) > 1 else 'it'} "
                              f"(from --config too)")
        if self.diloco_outer_device != "same":
            raise ConfigError(f"--diloco-outer-device {self.diloco_outer_device} with --federation: a federated "
                              "site keeps its copy of theta_global on the training device (no outer momentum: the "
                              "aggregator owns the outer step), so the flag would do nothing; drop it")
        if not self.llm:
            raise ConfigError(f"--federation trains a Qwen3 model on DARL-leased token windows; "
                              f"--model {self.model} reads no tokenized corpus (use qwen3-*)")
        if self.diloco_replicas != 1:
            raise ConfigError(f"--federation with --diloco-replicas {self.diloco_replicas}: a federated "
                              "site is ONE stream; run one job per stream with --replica a, --replica b "
                              "(cluster ids <site>-a, <site>-b) instead")
        if not self.darl_url:
            raise ConfigError("--federation needs --darl-url (the DARL coordinator, :29510): the site "
                              "trains only on windows it leased there")
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}", self.cluster):
            raise ConfigError(f"cluster id {self.cluster!r} (from --site/$PWW_SITE/the host name and "
                              f"--replica) must match [A-Za-z0-9][A-Za-z0-9._-]{{0,127}}; set --site")
        if self.dtype == "fp16":
            raise ConfigError("--dtype fp16 with --federation: the federated loop has no GradScaler; "
                              "use --dtype bf16 (or fp32)")
        if self.transport == "blob" and not self.blob_url:
            raise ConfigError("--transport blob needs --blob-url (the blob store, :29512)")
        if self.diloco_inner_steps < 1:
            raise ConfigError(f"--diloco-inner-steps {self.diloco_inner_steps}: H must be >= 1")
        if self.throttle_ms < 0 or self.register_wait_s < 0:
            raise ConfigError("--throttle-ms and --register-wait-s must be >= 0")
        if self.central_retry_s <= 0:
            raise ConfigError(f"--central-retry-s {self.central_retry_s:g}: use a positive number of seconds "
                              f"(default {httpc.RETRY_S:g})")

    def check_phase_s(self):
        v = self.diloco_phase_s
        if v is not None and not (v == 0 or (v > 0 and v == v and v != float("inf"))):
            raise ConfigError(f"--diloco-phase-s {v:g}: use a positive number of seconds (a phase's length; "
                              "several times the step time and the round trip), or 0 for H steps a phase")

    def unread(self):
        """{field: why} of the options nothing reads in this config's mode; each why says the
        mode and the fix. parse_config refuses those among the flags given on the command line."""
        if self.export_init:
            return {f.name: "with --export-init: the export builds the model from --seed, writes it and exits, "
                            "so nothing reads it; drop it"
                    for f in dataclasses.fields(self) if f.name not in EXPORT_READS}
        out = {}
        if self.federation is None:
            out.update(dict.fromkeys(FEDERATION_ONLY, "without --federation: it is a federated site's option "
                                     "(FEDERATION_GUIDE.md section 5) and a run inside one allocation sends "
                                     "nothing to the central VM; add --federation URL or drop it"))
            if self.diloco_replicas == 1:
                out.update(dict.fromkeys(("diloco_inner_steps", "diloco_phase_s", "diloco_outer_device")
                                         + OUTER_STEP_FLAGS,
                                         "without --diloco-replicas > 1: one replica has no outer step; add "
                                         "--diloco-replicas k (k divides the rank count) or drop it"))
        else:
            out["ckpt_every"] = ("with --federation: a site checkpoints at the end of every phase, before "
                                 "its delta leaves; drop it")
            if self.wire not in wire.LEVELS:
                out["wire_block"] = (f"with --wire {self.wire}: only int8, int4 and int2 have scale blocks; use "
                                     f"--wire int8, int4 or int2, or drop it")
            if self.wire != "topk":
                out.update(dict.fromkeys(("wire_topk_chunk", "wire_topk_k", "wire_topk_bits"),
                                         f"with --wire {self.wire}: it shapes the topk format; use --wire "
                                         f"topk, or drop it"))
            if self.wire == "f32":
                out["error_feedback"] = ("with --wire f32: f32 drops nothing, so there is no error to feed "
                                         "back; drop it")
            if self.wire == "f32" or not self.error_feedback:
                out["wire_feedback_decay"] = (f"with --wire {self.wire}: " + (
                    "f32 drops nothing, so there is no residual to decay; drop it" if self.wire == "f32" else
                    "without error feedback (--no-error-feedback) there is no residual to decay; drop it, or "
                    "drop --no-error-feedback"))
            if not self.overlap:
                out["overlap_fold"] = ("without --overlap: each round trip ends before the next phase "
                                       "starts, so nothing is folded in; add --overlap or drop it")
        if self.llm:
            out["epochs"] = (f"with --model {self.model}: a Qwen3 run is one pass over the training "
                             f"windows unless --steps says otherwise; use --steps")
        else:
            out["seq_len"] = f"with --model {self.model}: a ResNet reads 32x32 images, not token windows; drop it"
            out["eval_windows"] = f"with --model {self.model}: a CIFAR eval scores the whole test set; drop it"
            if self.steps:
                out["epochs"] = (f"with --steps {self.steps}: --steps sets the run's length and --epochs "
                                 f"counts only when it is 0; drop one of them")
        if self.parallel == "fsdp" and self.grad_accum == 1:
            out["fsdp_defer_grad_sync"] = ("with --grad-accum 1: one micro-batch per step, so there is no "
                                           "gradient sync to defer; raise --grad-accum or drop it")
        return out


# ---------------------------------------------------------------------------
# the flags, derived from the fields
# ---------------------------------------------------------------------------

def flag_of(name):
    return "--" + name.replace("_", "-")


def value_type(field):
    """int for `int | None`, bool for `bool`: what a flag's text is converted to."""
    return next((t for t in typing.get_args(field.type) if t is not type(None)), field.type)


def shown_default(field):
    """The default as --help prints it: the field's `shown` text, else its value."""
    d, shown = field.default, field.metadata["shown"]
    if shown is not None:
        return str(shown)
    if isinstance(d, bool):
        return "on" if d else "off"
    return "none" if d is None else f"{d:g}" if isinstance(d, float) else str(d)


def build_parser(with_defaults=True):
    """argparse from Config's fields, in their order, grouped by their `group`. With
    with_defaults=False every default is argparse.SUPPRESS: the namespace then holds only
    the flags given (parse_config's "given on the command line")."""
    p = argparse.ArgumentParser(description="Train ResNet/CIFAR-10 or Qwen3 on ROCm, CUDA or CPU "
                                "(DDP/FSDP2, DiLoCo inside the allocation, or one site of a federation).",
                                epilog="Model-dependent defaults are given as LLM / CIFAR.",
                                add_help=with_defaults,
                                argument_default=None if with_defaults else argparse.SUPPRESS)
    groups = {}
    for f in dataclasses.fields(Config):
        meta, kind = f.metadata, value_type(f)
        key = meta.get("group")
        if key and key not in groups:
            groups[key] = p.add_argument_group(GROUPS[key])
        kw = {"help": f"{meta['help']} (default {shown_default(f)})".replace("%", "%%")}
        if kind is bool:
            kw["action"] = argparse.BooleanOptionalAction if meta.get("negatable") else "store_true"
        elif kind is not str:
            kw["type"] = kind
        for k in ("choices", "metavar"):
            if k in meta:
                kw[k] = meta[k]
        if with_defaults:
            kw["default"] = os.environ.get(meta["env"], f.default) if "env" in meta else f.default
        action = (groups[key] if key else p).add_argument(flag_of(f.name), *meta.get("aliases", ()),
                                                          dest=f.name, **kw)
        action.help = kw["help"]       # BooleanOptionalAction appends "(default: True)" of its own
    return p


RENAMED_KEYS = {"delta_dtype": "wire"}      # config keys whose flag was renamed: old -> new


def _yaml_defaults(path):
    """{field: value} from a YAML file, each key checked against Config's fields and typed like them."""
    import yaml
    try:
        with open(path) as f:
            raw = yaml.safe_load(f) or {}
    except OSError as e:
        raise ConfigError(f"--config {path}: {e.strerror}; pass an existing YAML file (configs/*.yaml)") from None
    except yaml.YAMLError as e:
        # the context mark is where the broken entry starts (line 3 for "steps 200"), the
        # problem mark where the parser gave up (often the next line)
        mark = getattr(e, "context_mark", None) or getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}" if mark else "somewhere"
        raise ConfigError(f"--config {path}: not valid YAML at {where} ({getattr(e, 'problem', None) or e}); "
                          "fix that line: one `flag_name: value` per line, as in configs/*.yaml") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"--config {path}: expected a mapping of flag names to values")
    fields = {f.name: f for f in dataclasses.fields(Config) if f.name != "config"}
    out = {}
    for key, value in raw.items():
        dest = str(key).replace("-", "_")
        dest = RENAMED_KEYS.get(dest, dest)      # an older run's config.yaml
        if dest == "provenance":                 # a run's config.yaml can be passed back as --config
            continue
        if dest not in fields:
            near = difflib.get_close_matches(dest, fields, n=1)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            raise ConfigError(f"--config {path}: unknown key {key!r}{hint}")
        f, flag = fields[dest], flag_of(dest)
        kind, choices = value_type(f), f.metadata.get("choices")
        if kind is bool:
            if not isinstance(value, bool):
                raise ConfigError(f"--config {path}: {key}: {value!r} is not true/false ({flag})")
        elif value is not None and kind is not str:
            try:
                value = kind(value)     # YAML reads 3e-4 as a string; int("8") etc.
            except (TypeError, ValueError):
                raise ConfigError(f"--config {path}: {key}: {value!r} is not a valid {flag} value")
        unset = value is None and f.default is None     # null: "not given", as the flag's default
        if choices is not None and value not in choices and not unset:
            raise ConfigError(f"--config {path}: {key}: {value!r} is not one of "
                              f"{', '.join(map(str, choices))} ({flag})")
        out[dest] = value
    return out


def parse_config(argv=None):
    """argv -> Config: --config's YAML as defaults, then the flags; a flag given for an option
    this config does not read (Config.unread) is refused. Not yet resolve()d."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")
    known, _ = pre.parse_known_args(argv)
    parser = build_parser()
    if known.config:
        if not os.path.isfile(known.config):
            raise ConfigError(f"--config {known.config}: no such file (see configs/)")
        parser.set_defaults(**_yaml_defaults(known.config))
    cfg = Config(**vars(parser.parse_args(argv)))
    given = vars(build_parser(with_defaults=False).parse_args(argv))
    for name, why in cfg.unread().items():
        if name in given:
            value = given[name]
            flag = (flag_of(name) if value else "--no-" + flag_of(name)[2:]) if isinstance(value, bool) \
                else f"{flag_of(name)} {value}"
            raise ConfigError(f"{flag} {why}")
    return cfg


def write_config_yaml(path, cfg, prov):
    """runs/<run>/config.yaml: every field as resolved (usable as --config), and the
    provenance train.py gathered."""
    import yaml
    body = dataclasses.asdict(cfg)
    body["provenance"] = dict(prov, config_file=body.pop("config"))
    durable.write_text(path, "# resolved config of this run (flags over --config over defaults); "
                             "usable as --config\n" + yaml.safe_dump(body, sort_keys=False))
