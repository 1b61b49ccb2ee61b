"""bench/train_overhead.py - train.py's inner step against a bare torch loop, same model, same batch.

Runs on: any machine with the venv (CPU by default; --device cuda/rocm on a GPU node).
    python bench/train_overhead.py                       # qwen3-tiny, 8 x 256 tokens, CPU
    python bench/train_overhead.py --model qwen3-debugmodel --batch-size 4 --steps 40

What it measures, in ONE process, alternating so that machine load hits both alike:
  bare      ~30 lines: the model from models.py, AdamW, next-token loss, clip at 1.0,
            one fixed batch already on the device; mean ms per step after a warmup.
  train.py  train.main() with the same model, batch size, sequence length and
            optimizer, reading windows from a corpus memmap, scheduling the LR,
            logging; its own step_ms rows (mean per log interval; the first
            interval, which holds the warmup, is dropped).
Target: train.py within 3 % of bare. Not a test: it prints figures and the ratio.
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch                                    # noqa: E402
import torch.nn.functional as F                 # noqa: E402

import data                                     # noqa: E402
import durable                                  # noqa: E402
import models                                   # noqa: E402
import tokenize_corpus                          # noqa: E402
import train                                    # noqa: E402


def bare_loop(model_name, windows, batch, steps, warmup, device, lr=3e-3):
    """The reference: nothing but the step. Returns mean ms per step after `warmup`."""
    torch.manual_seed(0)
    model = models.materialize(models.build_model(model_name, windows.vocab_size, windows.seq_len), device)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    t = torch.from_numpy(windows.batch(range(batch))).to(device)
    x, y = t[:, :-1], t[:, 1:]
    for i in range(warmup + steps):
        if i == warmup:
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
        loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    loss.item()                                 # waits for the device, like train.py's log step
    return 1e3 * (time.perf_counter() - t0) / steps


def train_py(model_name, manifest, batch, steps, log_every, device, runs_dir, tag, lr=3e-3):
    """train.py's own step_ms, first interval (warmup) dropped. Returns mean ms per step."""
    train.main(["--model", model_name, "--data", manifest, "--device", device, "--parallel", "ddp",
                "--batch-size", str(batch), "--steps", str(steps), "--log-every", str(log_every),
                "--lr", str(lr), "--eval-windows", "8", "--runs-dir", runs_dir, "--run-name", tag])
    rows = durable.read_jsonl(os.path.join(runs_dir, tag, "metrics.jsonl"))
    ms = [r["step_ms"] for r in rows if r["split"] == "train"][1:]
    return statistics.mean(ms)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="qwen3-tiny", help="default qwen3-tiny")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step (default 8)")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per sequence (default 256)")
    p.add_argument("--steps", type=int, default=100, help="timed steps per measurement (default 100)")
    p.add_argument("--rounds", type=int, default=3, help="bare/train.py alternations (default 3)")
    p.add_argument("--device", default="cpu", help="cpu | cuda | rocm (default cpu)")
    a = p.parse_args()
    log_every = 10
    with tempfile.TemporaryDirectory() as tmp:
        corpus = os.path.join(tmp, "tokens")
        tokenize_corpus.tokenize(tokenize_corpus.TokenizeConfig(
            inputs=[], out=corpus, seq_len=a.seq_len, max_files=80, heldout_windows=8, progress=False))
        manifest = os.path.join(corpus, "manifest.json")
        windows = data.TokenWindows(manifest)
        dev = torch.device("cpu" if a.device == "cpu" else "cuda")
        bare, full = [], []
        for r in range(a.rounds):
            bare.append(bare_loop(a.model, windows, a.batch_size, a.steps, log_every, dev))
            full.append(train_py(a.model, manifest, a.batch_size, a.steps + log_every, log_every,
                                 a.device, os.path.join(tmp, "runs"), f"r{r}"))
            print(f"round {r}: bare {bare[-1]:8.2f} ms/step   train.py {full[-1]:8.2f} ms/step   "
                  f"ratio {full[-1] / bare[-1]:.3f}", flush=True)
    b, t = statistics.median(bare), statistics.median(full)
    print()
    print(f"model {a.model}, {a.batch_size} x {a.seq_len} tokens per step, {a.device}, "
          f"{torch.get_num_threads()} threads, {a.steps} timed steps x {a.rounds} rounds")
    print(f"{'':10s} {'ms/step':>10s} {'tokens/s':>10s}")
    print(f"{'bare':10s} {b:10.2f} {a.batch_size * a.seq_len / b * 1e3:10.0f}")
    print(f"{'train.py':10s} {t:10.2f} {a.batch_size * a.seq_len / t * 1e3:10.0f}")
    ratios = [f / b_ for f, b_ in zip(full, bare)]
    print(f"train.py / bare = {t / b:.3f}  (overhead {100 * (t / b - 1):+.1f} %, target within 3 %); "
          f"per-round ratios {min(ratios):.3f} .. {max(ratios):.3f}")


if __name__ == "__main__":
    main()
