"""tokenize_corpus.py - one offline pass: text -> fixed-width token windows + manifest.json.

Runs on: a login node or any CPU, once per (corpus, tokenizer, seq_len), before
training. No network, no GPU. Output goes to --out (default data/tokens/):
    tokens-00000.bin ...   raw uint16/uint32 memmaps, shape (windows, seq_len+1)
    manifest.json          format, num_windows, seq_len, dtype, vocab_size, tokenizer,
                           tokenizer_sha256, shards [{file, sha256, windows}],
                           heldout_windows, digest

Command lines:
    # the embedded default corpus: this Python's own standard-library *.py sources
    python tokenize_corpus.py --out data/stdlib-256 --seq-len 256
    # C4 (json.gz, one {"text": ...} per line) with Qwen's tokenizer
    python tokenize_corpus.py data/c4/en/c4-train.0000*-of-01024.json.gz \\
        --tokenizer data/qwen3/tokenizer.json --seq-len 2048 --out data/c4-qwen3-2048
    # a capped slice for tests and the demo
    python tokenize_corpus.py --max-files 40 --max-bytes 2000000 --out data/tiny

Inputs: *.txt (a file is one document), *.jsonl / *.json / *.jsonl.gz / *.json.gz
(one JSON object per line, text under --text-key, default "text"), *.py, or
directories (searched recursively for those suffixes, in sorted order).

Documents are joined into one stream, each followed by the tokenizer's end-of-text
id, and cut into consecutive windows of seq_len+1 tokens (inputs [:-1], targets
[1:]); the tail shorter than a window is dropped and reported. The last
--heldout-windows windows are the held-out split: training never reads them.

The digest is what DARL and both sites compare: sha256 over the manifest's
content fields (window count, seq_len, dtype, vocab, tokenizer sha256, shard
sha256s, held-out count) - no paths, no timestamps. Two sites with a different
tokenizer or seq_len get different digests and are refused at registration
instead of silently leasing two different partitions of "the corpus".
"""
import argparse
import dataclasses
import gzip
import hashlib
import io
import json
import os
import sys
import sysconfig
import time

import numpy as np

import durable
from data import MANIFEST_FORMAT   # the reader and the writer share one format string
TEXT_SUFFIXES = (".txt", ".py", ".md")
JSONL_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz")


# ---------------------------------------------------------------------------
# Tokenizers: built-in bytes, or an HF tokenizer.json through `tokenizers`
# ---------------------------------------------------------------------------

class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; 256 = end of text, 257 = pad. vocab_size 258.

    The model pads the embedding to a multiple of 64 (320 rows) for aligned matmuls.
    """
    name = "bytes"
    eos_id, pad_id, vocab_size = 256, 257, 258
    spec = "pww-bytes/1 utf-8 ids 0-255 eos=256 pad=257"

    def sha256(self):
        return hashlib.sha256(self.spec.encode()).hexdigest()

    def encode(self, text):
        return np.frombuffer(text.encode("utf-8", errors="replace"), dtype=np.uint8).astype(np.uint32)

    def encode_many(self, texts):
        return [self.encode(t) for t in texts]

    def decode(self, ids):
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A HuggingFace tokenizer.json (Qwen3's, Llama's, ...) through the `tokenizers` package."""
    EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|im_end|>")

    def __init__(self, path, eos_token=None):
        from tokenizers import Tokenizer      # only this path needs the package
        self.path, self.name = path, f"hf:{os.path.basename(path)}"
        self.tok = Tokenizer.from_file(path)
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        names = [eos_token] if eos_token else list(self.EOS_CANDIDATES)
        ids = [self.tok.token_to_id(t) for t in names]
        found = [(t, i) for t, i in zip(names, ids) if i is not None]
        if not found:
            raise ValueError(f"{path}: none of {names} is a token; name the end-of-text "
                             f"token with --eos-token")
        self.eos_token, self.eos_id = found[0]
        self.pad_id = self.eos_id

    def sha256(self):
        h = hashlib.sha256()
        with open(self.path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        return h.hexdigest()

    def encode(self, text):
        return np.asarray(self.tok.encode(text, add_special_tokens=False).ids, dtype=np.uint32)

    def encode_many(self, texts):
        """A list at once: the Rust side spreads it over all cores."""
        return [np.asarray(e.ids, dtype=np.uint32)
                for e in self.tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids):
        return self.tok.decode([int(i) for i in ids])


# ---------------------------------------------------------------------------
# Inputs: files -> documents
# ---------------------------------------------------------------------------

def stdlib_sources():
    """The embedded default corpus: this interpreter's standard library *.py files, sorted."""
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for d, dirs, names in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in ("site-packages", "dist-packages", "__pycache__"))
        files += [os.path.join(d, n) for n in sorted(names) if n.endswith(".py")]
    return files


def expand_inputs(paths):
    files = []
    for p in paths:
        if os.path.isdir(p):
            for d, dirs, names in os.walk(p):
                dirs.sort()
                files += [os.path.join(d, n) for n in sorted(names)
                          if n.endswith(TEXT_SUFFIXES + JSONL_SUFFIXES)]
        elif os.path.isfile(p):
            files.append(p)
        else:
            raise FileNotFoundError(f"input {p} does not exist: name existing files or directories (no input "
                                    "at all reads the Python standard library)")
    return files


class _CountingReader(io.RawIOBase):
    """Counts bytes read from the file on disk (compressed bytes for .gz): the progress bar."""

    def __init__(self, f, counter):
        self.f, self.counter = f, counter

    def readable(self):
        return True

    def readinto(self, b):
        n = self.f.readinto(b)
        self.counter[0] += n or 0
        return n


def iter_documents(path, text_key, counter):
    """Yield the documents of one file (a whole text file, or one JSON line's text)."""
    with open(path, "rb") as raw:
        stream = io.BufferedReader(_CountingReader(raw, counter), 1 << 20)
        if path.endswith(".gz"):
            stream = gzip.GzipFile(fileobj=stream)
        if path.endswith(JSONL_SUFFIXES):
            for line in io.TextIOWrapper(stream, encoding="utf-8"):
                if line.strip():
                    yield json.loads(line)[text_key]
        else:
            yield stream.read().decode("utf-8", errors="replace")


# ---------------------------------------------------------------------------
# Windows -> shards
# ---------------------------------------------------------------------------

class ShardWriter:
    """Appends windows to tokens-NNNNN.bin files of at most shard_windows each; hashes as it writes."""

    def __init__(self, out, width, dtype, shard_windows):
        self.out, self.width, self.dtype, self.cap = out, width, dtype, shard_windows
        self.shards, self.f, self.n, self.h = [], None, 0, None

    def _open(self):
        name = f"tokens-{len(self.shards):05d}.bin"
        self.f, self.n, self.h = open(os.path.join(self.out, name + ".tmp"), "wb"), 0, hashlib.sha256()
        self.shards.append({"file": name, "sha256": None, "windows": 0})

    def _close(self):
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        name = self.shards[-1]["file"]
        durable.rename(os.path.join(self.out, name + ".tmp"), os.path.join(self.out, name))
        self.shards[-1].update(sha256=self.h.hexdigest(), windows=self.n)
        self.f = None

    def write(self, windows):
        while len(windows):
            if self.f is None:
                self._open()
            take = windows[: self.cap - self.n]
            data = take.astype(self.dtype).tobytes()
            self.f.write(data)
            self.h.update(data)
            self.n += len(take)
            windows = windows[len(take):]
            if self.n == self.cap:
                self._close()

    def finish(self):
        if self.f is not None:
            self._close()
        return self.shards


def manifest_digest(m):
    """sha256 over the content fields only: stable across paths, machines and runs."""
    keys = ("format", "num_windows", "seq_len", "dtype", "vocab_size", "tokenizer_sha256",
            "heldout_windows")
    body = {k: m[k] for k in keys}
    body["shards"] = [[s["sha256"], s["windows"]] for s in m["shards"]]
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


@dataclasses.dataclass
class TokenizeConfig:
    inputs: list
    out: str = "data/tokens"
    seq_len: int = 256
    tokenizer: str | None = None
    eos_token: str | None = None
    text_key: str = "text"
    heldout_windows: int = 64
    shard_windows: int = 65536
    max_bytes: int = 0
    max_files: int = 0
    progress: bool = True

    def validate(self):
        if self.seq_len < 1:
            raise ValueError(f"--seq-len {self.seq_len} must be >= 1")
        if self.heldout_windows < 0:
            raise ValueError(f"--heldout-windows {self.heldout_windows} must be >= 0")
        if self.shard_windows < 1:
            raise ValueError(f"--shard-windows {self.shard_windows} must be >= 1")
        if self.tokenizer and not os.path.isfile(self.tokenizer):
            raise FileNotFoundError(f"--tokenizer {self.tokenizer}: no such file (a tokenizer.json)")


def _doc_batches(files, cfg, counter, size=256):
    """Documents in corpus order, in lists of `size` (HF tokenizers encode a list in parallel)."""
    batch = []
    for path in files:
        for doc in iter_documents(path, cfg.text_key, counter):
            batch.append(doc)
            if len(batch) == size:
                yield batch
                batch = []
            if cfg.max_bytes and counter[0] >= cfg.max_bytes:
                break
        if cfg.max_bytes and counter[0] >= cfg.max_bytes:
            break
    if batch:
        yield batch


def _progress(done, total, windows, t0, final=False):
    frac = done / total if total else 1.0
    bar = "#" * int(30 * frac)
    mb_s = done / max(time.monotonic() - t0, 1e-9) / 1e6
    end = "\n" if final else ""
    sys.stderr.write(f"\r[{bar:<30}] {100 * frac:5.1f}%  {done / 1e6:8.1f} MB  "
                     f"{windows:,} windows  {mb_s:.1f} MB/s{end}")
    sys.stderr.flush()


def tokenize(cfg: TokenizeConfig):
    """Run the pass; returns the manifest dict (also written to <out>/manifest.json)."""
    cfg.validate()
    tok = HFTokenizer(cfg.tokenizer, cfg.eos_token) if cfg.tokenizer else ByteTokenizer()
    files = expand_inputs(cfg.inputs) if cfg.inputs else stdlib_sources()
    if cfg.max_files:
        files = files[: cfg.max_files]
    if not files:
        raise ValueError(f"no input files in {' '.join(cfg.inputs)}: directories are searched for "
                         f"{', '.join(TEXT_SUFFIXES + JSONL_SUFFIXES)}; name files with those suffixes "
                         "(or no input at all, for the Python standard library)")
    dtype = np.uint16 if tok.vocab_size <= 65536 else np.uint32
    width = cfg.seq_len + 1
    os.makedirs(cfg.out, exist_ok=True)
    writer = ShardWriter(cfg.out, width, dtype, cfg.shard_windows)
    total = sum(os.path.getsize(f) for f in files)
    total = min(total, cfg.max_bytes) if cfg.max_bytes else total
    counter, pending, t0, tokens, last = [0], np.zeros(0, np.uint32), time.monotonic(), 0, 0.0
    eos = np.array([tok.eos_id], np.uint32)
    for batch in _doc_batches(files, cfg, counter):
        ids = np.concatenate([pending] + [a for arr in tok.encode_many(batch) for a in (arr, eos)])
        tokens += len(ids) - len(pending)
        full = len(ids) // width * width
        writer.write(ids[:full].reshape(-1, width))
        pending = ids[full:]
        if cfg.progress and time.monotonic() - last > 0.5:
            last = time.monotonic()
            _progress(counter[0], total, sum(s["windows"] for s in writer.shards), t0)
    shards = writer.finish()
    num_windows = sum(s["windows"] for s in shards)
    if cfg.progress:
        _progress(min(counter[0], total), total, num_windows, t0, final=True)
    if num_windows <= cfg.heldout_windows:
        raise ValueError(f"only {num_windows} windows of {width} tokens, not more than "
                         f"--heldout-windows {cfg.heldout_windows}: give more text or lower "
                         f"--seq-len / --heldout-windows")
    m = {"format": MANIFEST_FORMAT, "num_windows": num_windows, "seq_len": cfg.seq_len,
         "dtype": np.dtype(dtype).name, "vocab_size": tok.vocab_size, "tokenizer": tok.name,
         "tokenizer_sha256": tok.sha256(), "eos_id": tok.eos_id, "pad_id": tok.pad_id,
         "shards": shards, "heldout_windows": cfg.heldout_windows,
         "tokens_total": tokens, "tokens_dropped_tail": len(pending), "files": len(files)}
    m["digest"] = manifest_digest(m)
    durable.write_json(os.path.join(cfg.out, "manifest.json"), m, indent=1)
    return m


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("inputs", nargs="*", help="files or directories (default: the Python stdlib's *.py)")
    p.add_argument("--out", default="data/tokens", help="output directory (default data/tokens)")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per training sequence; "
                   "windows hold seq_len+1 (default 256)")
    p.add_argument("--tokenizer", default=None, help="HF tokenizer.json (default: built-in bytes)")
    p.add_argument("--eos-token", default=None, help="end-of-text token of --tokenizer "
                   "(default: the first of <|endoftext|>, </s>, ... that exists)")
    p.add_argument("--text-key", default="text", help="JSON field holding the text (default text)")
    p.add_argument("--heldout-windows", type=int, default=64,
                   help="last windows kept out of training for eval (default 64)")
    p.add_argument("--shard-windows", type=int, default=65536, help="windows per shard file (default 65536)")
    p.add_argument("--max-bytes", type=int, default=0, help="stop after the document that crosses this many input bytes "
                   "(read in 1 MiB chunks; 0 = all)")
    p.add_argument("--max-files", type=int, default=0, help="read at most this many files (0 = all)")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    a = p.parse_args()
    try:
        m = tokenize(TokenizeConfig(**vars(a)))
    except (ValueError, OSError) as e:      # each names the input or flag and the fix
        raise SystemExit(f"tokenize_corpus.py: {e}") from None
    print(f"{m['num_windows']} windows of {m['seq_len'] + 1} tokens "
          f"({m['heldout_windows']} held out), vocab {m['vocab_size']}, digest {m['digest'][:16]} "
          f"-> {os.path.join(a.out, 'manifest.json')}")


if __name__ == "__main__":
    main()
