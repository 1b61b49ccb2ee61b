"""hf_export.py - the global model as a Hugging Face checkpoint directory (Qwen3ForCausalLM).

Runs on: a login node or any CPU with the site environment (torch, torchtitan); never
on the central VM (numpy only there: this file alone needs torch). No server, no port,
no state. Take the final theta off the central VM (`fedmom_server.py export --state-dir
runs/central/fedmom theta-final.safetensors`, or GET /theta), then:

    python hf_export.py theta-final.safetensors runs/hf/qwen3-0.6B \\
        --model qwen3-0.6B --data data/c4-qwen3-2048/manifest.json \\
        --tokenizer data/tokenizers/Qwen3-0.6B/tokenizer.json --dtype bf16
    python hf_export.py theta-40.safetensors runs/hf/tiny --model qwen3-tiny \\
        --data data/stdlib-256/manifest.json        # the demo's model, byte tokenizer

OUT_DIR then loads with `AutoModelForCausalLM.from_pretrained(OUT_DIR)` and
`AutoTokenizer.from_pretrained(OUT_DIR)`, offline. It holds:
    config.json             Qwen3Config: the --model flavor's shapes, rope theta, rms eps,
                            qk-norm, tied head; vocab_size = the embedding's rows (below)
    generation_config.json  the corpus' end-of-text and pad ids (with --data)
    model.safetensors       every tensor under its HF name, fp32 (or --dtype)
    tokenizer files         with --data: the run's own tokenizer.json (checked against the
                            manifest's sha256) and its tokenizer_config.json etc. from the
                            same directory; for the built-in byte tokenizer an equivalent
                            tokenizer.json (ids 0-255 = bytes, 256 end of text, 257 pad)

Names: torchtitan 0.2.2's Qwen3StateDictAdapter.to_hf maps our names (those of
named_parameters(), as train.py --export-init and the aggregator write them) to HF's;
a tied embedding is in the file once and HF re-ties lm_head from
tie_word_embeddings. Before anything is written, every tensor's shape is checked
against the --model flavor built on the meta device (no memory).

Vocabulary: the embedding has the tokenizer's vocabulary padded to a multiple of 64
(258 -> 320 rows, 151,669 -> 151,680); config.json's vocab_size is the padded row count,
as in Qwen's own checkpoints (151,936 rows for 151,669 tokens). The padding rows were
never a training target, so their logits stay low; they are not in the tokenizer.

The directory appears whole or not at all: it is written as OUT_DIR.tmp-<pid>, every
file fsynced, then renamed. Tensors are copied one at a time, so memory stays at the
largest tensor (the 151,936 x 5,120 embedding of the 32B model: 3.1 GB in fp32).
"""
import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import sys
import time

import numpy as np

try:                  # a site's environment; run where they are missing, the command says so in one line
    import torch
    from tokenizers import AddedToken, Tokenizer, decoders, models as tokenizer_models, pre_tokenizers
    from torchtitan.models.qwen3 import Qwen3Model
    from torchtitan.models.qwen3.model.state_dict_adapter import Qwen3StateDictAdapter
except ModuleNotFoundError as e:
    if __name__ != "__main__" or (e.name or "").split(".")[0] not in ("torch", "torchtitan", "tokenizers"):
        raise
    sys.exit(f"hf_export.py: error: no module {e.name!r}: the export needs torch and torchtitan, a site's "
             "environment (the central VM has numpy only); run it at a site")

import blob_client
import durable
import models
import tensorio
from data import MANIFEST_FORMAT
from tokenize_corpus import ByteTokenizer

DTYPES = {"fp32": ("F32", "float32"), "bf16": ("BF16", "bfloat16"), "fp16": ("F16", "float16")}
# Files that travel with an HF tokenizer.json when they sit beside it (Qwen's repository has these).
TOKENIZER_SIDE_FILES = ("tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                        "merges.txt", "chat_template.jinja")
DEFAULT_MAX_POSITIONS = 4096        # torchtitan's flavors' max_seq_len, when no --data says seq_len


class ExportError(ValueError):
    """A bad input to the export; the message names the flag and the fix."""


@dataclasses.dataclass
class ExportConfig:
    theta: str
    out: str
    model: str
    data: str | None = None
    tokenizer: str | None = None
    dtype: str = "fp32"

    def validate(self):
        if not models.is_llm(self.model):
            llms = ", ".join(models.QWEN3_FLAVORS)
            raise ExportError(f"--model {self.model!r}: hf_export.py writes Qwen3 causal LMs; use one of {llms}")
        if not os.path.isfile(self.theta):
            raise ExportError(f"{self.theta}: no such file; name the global model "
                              f"(fedmom_server.py export's file or train.py --export-init's file)")
        if os.path.exists(self.out) and (not os.path.isdir(self.out) or os.listdir(self.out)):
            raise ExportError(f"OUT_DIR {self.out} already exists and is not an empty directory; "
                              f"name a new one or remove it")
        if self.tokenizer and not self.data:
            raise ExportError("--tokenizer needs --data MANIFEST: the manifest records which tokenizer "
                              "the corpus was made with, and the file is checked against it")
        if self.data and not os.path.isfile(self.data):
            raise ExportError(f"--data {self.data}: no such file; name the manifest.json the run trained on")
        if self.tokenizer and not os.path.isfile(self.tokenizer):
            raise ExportError(f"--tokenizer {self.tokenizer}: no such file; name the tokenizer.json "
                              f"given to tokenize_corpus.py")
        return self


# ---------------------------------------------------------------- the model's shapes and names

def _param_specs(model_args):
    """{name: shape} of named_parameters() of the model, built on the meta device."""
    with torch.device("meta"):
        model = Qwen3Model(model_args)
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


def _fitting_flavors(file_specs, rows):
    return [name for name in models.QWEN3_FLAVORS
            if _param_specs(models.qwen3_args(name, rows, DEFAULT_MAX_POSITIONS)) == file_specs]


def check_shapes(model_args, file_specs, model_name, theta):
    """Every tensor of the file is a parameter of --model with the same shape, and none is missing."""
    want = _param_specs(model_args)
    extra = sorted(set(file_specs) - set(want))
    missing = sorted(set(want) - set(file_specs))
    wrong = [n for n in want if n in file_specs and file_specs[n] != want[n]]
    if not (extra or missing or wrong):
        return
    if wrong:
        n = wrong[0]
        what = f"tensor {n!r} is {list(file_specs[n])} in the file, {list(want[n])} in {model_name}"
    elif missing:
        what = f"the file lacks {len(missing)} tensor(s) of {model_name}, e.g. {missing[0]!r}"
    else:
        what = f"the file has {len(extra)} tensor(s) {model_name} does not, e.g. {extra[0]!r}"
    fits = _fitting_flavors(file_specs, model_args.vocab_size)
    fix = f"it fits --model {' or '.join(fits)}" if fits else "pass the --model the run trained"
    raise ExportError(f"--model {model_name} does not match {theta}: {what}; {fix}")


def hf_names(model_args, names):
    """{our name: HF name} through torchtitan's Qwen3 state-dict adapter (the values it is
    given are our names, so what it returns maps each HF name back to ours)."""
    adapter = Qwen3StateDictAdapter(model_args, hf_assets_path=None)
    mapped = {ours: hf for hf, ours in adapter.to_hf({n: n for n in names}).items()}
    unmapped = [n for n in names if n not in mapped]
    if unmapped:
        raise ExportError(f"tensor {unmapped[0]!r} has no Hugging Face name in torchtitan's Qwen3 "
                          f"adapter; hf_export.py handles the dense Qwen3 flavors only")
    return mapped


def hf_config(model_args, dtype, manifest):
    """config.json for Qwen3ForCausalLM. rope_theta sits both at the top (transformers 4.x)
    and in rope_parameters (5.x reads that, and moves a top-level one there itself)."""
    if not model_args.qk_norm or model_args.moe_enabled:
        raise ExportError("hf_export.py writes dense Qwen3 with qk-norm (what HF's Qwen3 is); this "
                          "flavor has qk_norm off or experts")
    seq_len = int(manifest["seq_len"]) if manifest else DEFAULT_MAX_POSITIONS
    return {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
        "vocab_size": model_args.vocab_size, "hidden_size": model_args.dim,
        "intermediate_size": model_args.hidden_dim, "num_hidden_layers": model_args.n_layers,
        "num_attention_heads": model_args.n_heads,
        "num_key_value_heads": model_args.n_kv_heads or model_args.n_heads,
        "head_dim": model_args.head_dim, "hidden_act": "silu",
        "max_position_embeddings": seq_len, "rms_norm_eps": model_args.norm_eps,
        "rope_theta": float(model_args.rope_theta), "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": float(model_args.rope_theta)},
        "attention_bias": False, "attention_dropout": 0.0,
        "use_sliding_window": False, "sliding_window": None, "max_window_layers": model_args.n_layers,
        "tie_word_embeddings": bool(model_args.enable_weight_tying),
        "initializer_range": 0.02, "use_cache": True, "torch_dtype": DTYPES[dtype][1],
        "bos_token_id": None,
        "eos_token_id": int(manifest["eos_id"]) if manifest else None,
        "pad_token_id": int(manifest["pad_id"]) if manifest else None,
    }


# ---------------------------------------------------------------- the tokenizer

def _gpt2_byte_chars():
    """byte -> the printable character the ByteLevel pre-tokenizer writes for it (GPT-2's table)."""
    keep = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    chars = {b: chr(b) for b in keep}
    chars.update({b: chr(256 + i) for i, b in enumerate(b for b in range(256) if b not in keep)})
    return chars


def write_byte_tokenizer(out_dir):
    """tokenize_corpus.ByteTokenizer as an HF tokenizer: a byte-level BPE with no merges,
    so each UTF-8 byte is one token whose id is the byte; end of text and pad are added
    tokens with ByteTokenizer's ids. Unlike ByteTokenizer, HF reads the literal text
    '<|endoftext|>' as the special token (every HF tokenizer does that)."""
    bt = ByteTokenizer
    tok = Tokenizer(tokenizer_models.BPE(vocab={c: b for b, c in _gpt2_byte_chars().items()}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    specials = {bt.eos_id: "<|endoftext|>", bt.pad_id: "<|pad|>"}
    tok.add_special_tokens([AddedToken(specials[i], special=True) for i in sorted(specials)])
    got = {i: tok.id_to_token(i) for i in specials}
    if got != specials or tok.get_vocab_size() != bt.vocab_size:
        raise ExportError(f"the byte tokenizer came out as {got}, {tok.get_vocab_size()} tokens; "
                          f"ByteTokenizer says {specials}, {bt.vocab_size}")
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    _write_json(os.path.join(out_dir, "tokenizer_config.json"), {
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": specials[bt.eos_id],
        "pad_token": specials[bt.pad_id], "clean_up_tokenization_spaces": False})


def copy_hf_tokenizer(out_dir, manifest, tokenizer, data):
    """The run's tokenizer.json, after checking it is the one the corpus was tokenized with,
    and the files that sit beside it."""
    have = blob_client.sha256_file(tokenizer)
    if have != manifest["tokenizer_sha256"]:
        raise ExportError(f"--tokenizer {tokenizer} has sha256 {have[:16]}..., but --data {data} was "
                          f"tokenized with {manifest['tokenizer']} of sha256 {manifest['tokenizer_sha256'][:16]}...; "
                          f"pass that file")
    shutil.copyfile(tokenizer, os.path.join(out_dir, "tokenizer.json"))
    side = [f for f in TOKENIZER_SIDE_FILES if os.path.isfile(os.path.join(os.path.dirname(tokenizer), f))]
    for f in side:
        shutil.copyfile(os.path.join(os.path.dirname(tokenizer), f), os.path.join(out_dir, f))
    if "tokenizer_config.json" not in side:
        eos = Tokenizer.from_file(tokenizer).id_to_token(int(manifest["eos_id"]))
        _write_json(os.path.join(out_dir, "tokenizer_config.json"), {
            "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "pad_token": eos})
    return ["tokenizer.json"] + side


def write_tokenizer(out_dir, cfg, manifest):
    """What tokenizer files go with the model; returns a line for the summary."""
    if manifest is None:
        return "no tokenizer (pass --data MANIFEST, and --tokenizer for an HF tokenizer, to include it)"
    if manifest["tokenizer"] == "bytes":
        if cfg.tokenizer:
            raise ExportError(f"--data {cfg.data} was tokenized with the built-in byte tokenizer; "
                              f"drop --tokenizer {cfg.tokenizer}")
        write_byte_tokenizer(out_dir)
        return "the built-in byte tokenizer as tokenizer.json"
    if not cfg.tokenizer:
        raise ExportError(f"--data {cfg.data} was tokenized with {manifest['tokenizer']} (sha256 "
                          f"{manifest['tokenizer_sha256'][:16]}...); pass it as --tokenizer PATH/tokenizer.json")
    return "tokenizer " + ", ".join(copy_hf_tokenizer(out_dir, manifest, cfg.tokenizer, cfg.data))


# ---------------------------------------------------------------- writing

def _write_json(path, obj):
    with open(path, "w") as f:          # fsynced with the rest of the directory (durable.fsync_tree)
        json.dump(obj, f, indent=2)
        f.write("\n")


def write_weights(reader, names, path, dtype, metadata, progress=True):
    """Copy every tensor under its HF name, one at a time, narrowing to `dtype`."""
    file_dtype = DTYPES[dtype][0]
    specs = [(names[n], file_dtype, reader.specs[n][1]) for n in reader.names]
    total, done, last = sum(reader.nbytes(n) for n in reader.names), 0, time.monotonic()
    with tensorio.TensorWriter(path, specs, metadata, file_format="pt") as w:
        for i, n in enumerate(reader.names, 1):
            w.write(names[n], reader.read(n, as_float32=True))
            done += reader.nbytes(n)
            if progress and (time.monotonic() - last > 2 or i == len(reader.names)):
                last = time.monotonic()
                print(f"hf_export.py: {i}/{len(reader.names)} tensors, {done / 1e9:.2f}/{total / 1e9:.2f} GB read",
                      file=sys.stderr, flush=True)


def _read_manifest(path):
    try:
        with open(path) as f:
            m = json.load(f)
    except ValueError as e:
        raise ExportError(f"--data {path}: not JSON ({e}); name the manifest.json tokenize_corpus.py wrote")
    if not isinstance(m, dict) or m.get("format") != MANIFEST_FORMAT:
        raise ExportError(f"--data {path}: not a {MANIFEST_FORMAT} manifest; name the manifest.json "
                          f"tokenize_corpus.py wrote")
    return m


def model_args_for(cfg, file_specs, manifest):
    """--model's torchtitan args with the file's (padded) vocabulary, checked against --data."""
    if "tok_embeddings.weight" not in file_specs:
        raise ExportError(f"{cfg.theta} has no 'tok_embeddings.weight': not a Qwen3 model of this "
                          f"project (python tensorio.py {cfg.theta} lists what it holds)")
    rows = file_specs["tok_embeddings.weight"][0]
    if manifest and models.pad_vocab(int(manifest["vocab_size"])) != rows:
        raise ExportError(f"--data {cfg.data}: its tokenizer has {manifest['vocab_size']} tokens "
                          f"({models.pad_vocab(int(manifest['vocab_size']))} rows padded), the model's "
                          f"embedding has {rows}; pass the manifest of the corpus the run trained on")
    seq_len = int(manifest["seq_len"]) if manifest else DEFAULT_MAX_POSITIONS
    return models.qwen3_args(cfg.model, rows, seq_len)


@contextlib.contextmanager
def _new_directory(out):
    """Yield OUT.tmp-<pid> to fill; on success fsync it and rename it to OUT, else remove it."""
    out = os.path.abspath(out)
    tmp = durable.tmp_name(out)
    os.makedirs(tmp)
    try:
        yield tmp
        durable.fsync_tree(tmp)
        if os.path.isdir(out):
            os.rmdir(out)                       # ExportConfig.validate saw it empty
        durable.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def export(cfg, model_args=None, progress=True):
    """Write cfg.out; returns a one-line summary. model_args: torchtitan Qwen3ModelArgs to use
    instead of --model's flavor (tests use this for an untied variant of qwen3-tiny)."""
    cfg.validate()
    manifest = _read_manifest(cfg.data) if cfg.data else None
    with tensorio.TensorReader(cfg.theta) as r:
        file_specs = {n: r.specs[n][1] for n in r.names}
        model_args = model_args or model_args_for(cfg, file_specs, manifest)
        check_shapes(model_args, file_specs, cfg.model, cfg.theta)
        names = hf_names(model_args, r.names)
        config = hf_config(model_args, cfg.dtype, manifest)
        meta = {"producer": "pww hf_export", "pww_model": cfg.model, "pww_source": os.path.basename(cfg.theta)}
        meta.update({f"pww_{k}": v for k, v in r.metadata.items() if k in ("round", "seed", "corpus_digest")})
        with _new_directory(cfg.out) as tmp:
            _write_json(os.path.join(tmp, "config.json"), config)
            if manifest:
                _write_json(os.path.join(tmp, "generation_config.json"), {
                    "eos_token_id": config["eos_token_id"], "pad_token_id": config["pad_token_id"]})
            tokenizer_line = write_tokenizer(tmp, cfg, manifest)
            write_weights(r, names, os.path.join(tmp, "model.safetensors"), cfg.dtype, meta, progress)
    n = sum(int(np.prod(s)) for s in file_specs.values())
    return (f"wrote {cfg.out}: {cfg.model} as Qwen3ForCausalLM, {len(names)} tensors, {n:,} parameters "
            f"({cfg.dtype}), vocab_size {model_args.vocab_size}; {tokenizer_line}")


def main(argv=None):
    p = argparse.ArgumentParser(
        prog="hf_export.py", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Write the global model as a Hugging Face checkpoint directory (Qwen3ForCausalLM).\n"
                    "Needs torch and torchtitan (the site environment); `python tensorio.py FILE`\n"
                    "(a tensor file's header) needs numpy only.",
        epilog="\n\n".join(__doc__.split("\n\n")[1:3]))
    p.add_argument("theta", metavar="THETA", help="the global model: the file fedmom_server.py export wrote "
                                 "(or train.py --export-init's file)")
    p.add_argument("out", metavar="OUT_DIR", help="directory to create (must not exist, or be empty)")
    p.add_argument("--model", required=True, help="the --model the run trained (qwen3-tiny, qwen3-0.6B, ...)")
    p.add_argument("--data", default=None, metavar="MANIFEST",
                   help="the corpus manifest.json the run trained on: seq_len, end-of-text id and the "
                        "tokenizer to include (default: none; then no tokenizer is written)")
    p.add_argument("--tokenizer", default=None, metavar="TOKENIZER_JSON",
                   help="the HF tokenizer.json the corpus was tokenized with, when --data names one "
                        "(checked against the manifest's sha256); not for the byte tokenizer")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32",
                   help="weights in model.safetensors (default fp32, bit-exact; bf16 halves the size)")
    a = p.parse_args(argv)
    try:
        print(export(ExportConfig(**vars(a))))
    except (ExportError, tensorio.FormatError, OSError) as e:
        sys.exit(f"hf_export.py: error: {e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
