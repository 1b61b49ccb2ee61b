"""data.py - the two data sources of train.py: CIFAR-10 images and tokenized text windows.

Runs on: compute nodes and CPUs (imported by train.py, tests, bench). No network:
datasets are downloaded on a login node beforehand (compute nodes reach the
internet only through a slow proxy, if at all).

CIFAR-10: the standard python-pickle batches (data_batch_1..5, test_batch; dict
keys b"data" (N x 3072 uint8, channel-major) and b"labels"). The whole training
set (150 MB as uint8) is moved to the device once; random crop + flip and the
normalisation run there on whole batches, so no dataloader workers are needed.
    python data.py fake-cifar data/fake-cifar --train 512 --test 256   # a small fixture

Token windows: the memmap shards and manifest.json written by tokenize_corpus.py;
each window holds seq_len+1 token ids (inputs are [:-1], targets [1:]). The last
`heldout_windows` windows are the held-out split, never trained on.

Leased windows (train.py --federation): DARL leases positions of a BlockSpace over the
training windows; span_windows() turns a span into window indices (positions ->
blocks -> windows, shuffled from the seed and the lease: every rank computes the
same list without any traffic) and LeasedPhase cuts them into optimizer steps and
per-rank micro-batches. Unlike the epoch order below, nothing is dropped: a short
last step is split across ranks, every rank keeps the same number of micro-batches
(some short or empty), and every leased window is trained exactly once.
"""
import argparse
import json
import os
import pickle

import numpy as np

CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)
CIFAR_TRAIN_FILES = [f"data_batch_{i}" for i in range(1, 6)]
CIFAR_TEST_FILE = "test_batch"
CIFAR_CLASSES = ("airplane", "automobile", "bird", "cat", "deer",
                 "dog", "frog", "horse", "ship", "truck")


# ---------------------------------------------------------------------------
# CIFAR-10 reader and fixture writer
# ---------------------------------------------------------------------------

class _ArrayOnlyUnpickler(pickle.Unpickler):
    """The CIFAR batches are pickles; this loads the numpy arrays in them and nothing else.

    A pickle can name any callable; allowing only numpy's array reconstructors
    means a tampered file fails here instead of running code.
    """
    ALLOWED = {("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
               ("numpy", "ndarray"), ("numpy", "dtype"),
               ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"),
               ("_codecs", "encode")}     # how protocol 2 spells a bytes object written by Python 3

    def find_class(self, module, name):
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"refusing {module}.{name}: a CIFAR batch holds only arrays")
        return super().find_class(module, name)


def _read_batch(path):
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} is missing: --data must be the cifar-10-batches-py "
                                f"directory (data_batch_1..5, test_batch), or make a fixture with "
                                f"`python data.py fake-cifar DIR`")
    with open(path, "rb") as f:
        d = _ArrayOnlyUnpickler(f, encoding="bytes").load()
    x = np.asarray(d[b"data"], dtype=np.uint8)
    y = np.asarray(d[b"labels"], dtype=np.int64)
    if x.ndim != 2 or x.shape[1] != 3072 or len(x) != len(y):
        raise ValueError(f"{path}: expected data N x 3072 and N labels, got {x.shape} and {y.shape}")
    return x.reshape(-1, 3, 32, 32), y


def load_cifar10(root):
    """-> (train_x, train_y, test_x, test_y): uint8 N x 3 x 32 x 32 images, int64 labels."""
    parts = [_read_batch(os.path.join(root, name)) for name in CIFAR_TRAIN_FILES]
    train_x = np.concatenate([p[0] for p in parts])
    train_y = np.concatenate([p[1] for p in parts])
    test_x, test_y = _read_batch(os.path.join(root, CIFAR_TEST_FILE))
    return train_x, train_y, test_x, test_y


def write_fake_cifar(root, n_train=500, n_test=100, seed=0):
    """Write a small CIFAR-10 fixture in the standard python-pickle format.

    Images are not noise: each class is a distinct colour/stripe pattern plus noise,
    so a few hundred steps of ResNet visibly learn it (tests can assert accuracy > chance).
    n_train is spread over the five training batches.
    """
    os.makedirs(root, exist_ok=True)
    rng = np.random.default_rng(seed)

    def make(n):
        y = rng.integers(0, 10, size=n)
        xx = np.arange(32)[None, None, :]
        base = np.zeros((n, 3, 32, 32), np.float32)
        for c in range(10):
            m = y == c
            stripes = ((xx + (np.arange(32)[:, None] * (c % 3))) // (2 + c % 4)) % 2
            colour = np.array([(c * 37) % 256, (c * 91) % 256, (c * 53) % 256], np.float32)
            base[m] = colour[:, None, None] * (0.5 + 0.5 * stripes)
        x = np.clip(base + rng.normal(0, 20, size=base.shape), 0, 255).astype(np.uint8)
        return x.reshape(n, 3072), [int(v) for v in y]

    splits = np.array_split(np.arange(n_train), len(CIFAR_TRAIN_FILES))
    names = CIFAR_TRAIN_FILES + [CIFAR_TEST_FILE]
    for name, n in zip(names, [len(s) for s in splits] + [n_test]):
        x, y = make(n)
        d = {b"batch_label": name.encode(), b"labels": y, b"data": x,
             b"filenames": [f"{name}_{i}.png".encode() for i in range(n)]}
        with open(os.path.join(root, name), "wb") as f:
            pickle.dump(d, f, protocol=2)
    with open(os.path.join(root, "batches.meta"), "wb") as f:
        pickle.dump({b"label_names": [c.encode() for c in CIFAR_CLASSES],
                     b"num_cases_per_batch": len(splits[0]), b"num_vis": 3072}, f, protocol=2)
    return root


def cifar_augment(x_uint8, generator=None, train=True):
    """uint8 N x 3 x 32 x 32 on the device -> normalised float32; random crop (pad 4) + flip if train.

    One gather builds every crop at once: per image a row offset, a column offset
    and a flip, folded into one index grid over the zero-padded batch.
    """
    import torch
    x = x_uint8.float().div_(255.0)
    if train:
        n, dev = x.shape[0], x.device
        padded = torch.nn.functional.pad(x, (4, 4, 4, 4))
        oy = torch.randint(0, 9, (n,), device=dev, generator=generator)
        ox = torch.randint(0, 9, (n,), device=dev, generator=generator)
        flip = torch.rand(n, device=dev, generator=generator) < 0.5
        ar = torch.arange(32, device=dev)
        rows = oy[:, None] + ar
        cols = ox[:, None] + torch.where(flip[:, None], 31 - ar, ar)
        x = padded[torch.arange(n, device=dev)[:, None, None, None],
                   torch.arange(3, device=dev)[None, :, None, None],
                   rows[:, None, :, None], cols[:, None, None, :]]
    mean = torch.tensor(CIFAR_MEAN, device=x.device).view(1, 3, 1, 1)
    std = torch.tensor(CIFAR_STD, device=x.device).view(1, 3, 1, 1)
    return (x - mean) / std


# ---------------------------------------------------------------------------
# Token windows (tokenize_corpus.py's output)
# ---------------------------------------------------------------------------

MANIFEST_FORMAT = "pww-windows/1"


class CorpusError(ValueError):
    """A corpus that cannot be read: one line naming the file and the command that makes it."""


def make_corpus_hint(manifest_path):
    return (f"`python tokenize_corpus.py --out {os.path.dirname(manifest_path) or '.'} --seq-len N` makes it "
            "(N = the model's sequence length; see tokenize_corpus.py --help)")


class TokenWindows:
    """Read-only view of a tokenized corpus: window index -> seq_len+1 token ids.

    Windows are numbered across shards in manifest order. train_windows are
    [0, num_windows - heldout_windows); the held-out split is the rest.
    """

    def __init__(self, manifest_path):
        try:
            with open(manifest_path) as f:
                m = json.load(f)
        except FileNotFoundError:
            raise CorpusError(f"--data {manifest_path}: no such corpus manifest; {make_corpus_hint(manifest_path)}, "
                              "or point --data at an existing manifest.json") from None
        except (OSError, ValueError) as e:
            raise CorpusError(f"--data {manifest_path}: not a readable manifest.json ({e}); "
                              f"{make_corpus_hint(manifest_path)}") from None
        if not isinstance(m, dict) or m.get("format") != MANIFEST_FORMAT:
            m = m if isinstance(m, dict) else {}
            raise CorpusError(f"{manifest_path}: format {m.get('format')!r}, expected "
                             f"{MANIFEST_FORMAT!r}; re-run tokenize_corpus.py")
        self.manifest, self.path = m, manifest_path
        self.seq_len, self.vocab_size = int(m["seq_len"]), int(m["vocab_size"])
        self.num_windows, self.heldout_windows = int(m["num_windows"]), int(m["heldout_windows"])
        self.digest = m["digest"]
        base = os.path.dirname(os.path.abspath(manifest_path))
        missing = [s["file"] for s in m["shards"] if not os.path.isfile(os.path.join(base, s["file"]))]
        if missing:
            raise CorpusError(f"--data {manifest_path}: {len(missing)} of {len(m['shards'])} shard files are missing "
                              f"beside it ({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}): copy the "
                              f"whole corpus directory, or make it again: {make_corpus_hint(manifest_path)}")
        self._shards, self._starts, start = [], [], 0
        for s in m["shards"]:
            arr = np.memmap(os.path.join(base, s["file"]), dtype=np.dtype(m["dtype"]), mode="r",
                            shape=(int(s["windows"]), self.seq_len + 1))
            self._shards.append(arr)
            self._starts.append(start)
            start += int(s["windows"])
        if start != self.num_windows:
            raise CorpusError(f"{manifest_path}: shards hold {start} windows, manifest says "
                             f"{self.num_windows}; re-run tokenize_corpus.py")

    @property
    def train_windows(self):
        return self.num_windows - self.heldout_windows

    def heldout_indices(self, limit=None):
        lo = self.train_windows
        hi = self.num_windows if limit is None else min(self.num_windows, lo + limit)
        return range(lo, hi)

    def window(self, i):
        s = int(np.searchsorted(self._starts, i, side="right")) - 1
        return self._shards[s][i - self._starts[s]]

    def batch(self, indices):
        """Window indices -> int64 array (len(indices), seq_len+1): one gather per shard."""
        idx = np.asarray(indices, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= self.num_windows):
            raise IndexError(f"window index out of range 0..{self.num_windows - 1}")
        out = np.empty((len(idx), self.seq_len + 1), dtype=np.int64)
        shard = np.searchsorted(self._starts, idx, side="right") - 1
        for s in np.unique(shard):
            m = shard == s
            out[m] = self._shards[s][idx[m] - self._starts[s]]
        return out


def epoch_order(n, epoch, seed):
    """A permutation of range(n) that every rank computes identically for (epoch, seed)."""
    return np.random.default_rng([seed, epoch]).permutation(n)


def shard_for_rank(order, rank, world, batch):
    """This rank's slice of an epoch order: equal-length, whole batches only.

    drop_last by construction: every rank gets exactly len(order) // (world * batch)
    batches, so every rank reaches each DiLoCo outer step (a collective) the same
    number of times; one rank with an extra ragged batch hangs the all-reduce.
    """
    per_rank = (len(order) // (world * batch)) * batch
    mine = order[rank::world][:per_rank]
    return [mine[i:i + batch] for i in range(0, per_rank, batch)]


# ---------------------------------------------------------------------------
# Leased windows: one DARL span per outer phase (train.py --federation)
# ---------------------------------------------------------------------------

def span_windows(space, start, end, seed, lease):
    """Training-window indices of block positions [start, end) of `space` (a
    block_space.BlockSpace over the training windows), shuffled with a seed derived
    from (seed, lease, start): every rank computes the same list with no traffic."""
    idx = [w for pos in range(start, end) for w in space.samples_of(space.block_at(pos))]
    return np.random.default_rng([seed, lease, start]).permutation(np.asarray(idx, dtype=np.int64))


def span_windows_blocked(space, start, end, seed, lease, group=1):
    """(windows, bounds, ends) of positions [start, end) for a phase the clock may end early
    (train.py --diloco-phase-s): the positions cut into runs, each run's windows shuffled
    together (seed from (seed, lease, its first position)), the runs in position order, so
    every prefix of the list that ends on a bound is exactly the windows of positions
    [start, ends[i]). bounds[i]: windows in the first i + 1 runs. Runs of `group` positions
    mix a step's windows over that many blocks (a block is consecutive text); the last
    quarter of the span, where the clock ends a phase its lease fits, is single positions,
    for a fine cut. The same lists on every rank."""
    n = end - start
    head = n - max(1, n // 4) if group > 1 else 0
    firsts = list(range(start, start + head, group)) + list(range(start + head, end))
    lasts = firsts[1:] + [end]
    parts = [np.random.default_rng([seed, lease, a]).permutation(np.asarray(
        [w for pos in range(a, b) for w in space.samples_of(space.block_at(pos))], dtype=np.int64))
        for a, b in zip(firsts, lasts)]
    windows = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    return windows, np.cumsum([len(x) for x in parts], dtype=np.int64), np.asarray(lasts, dtype=np.int64)


def step_shares(n, world, batch):
    """How `n` windows of one optimizer step split into micro-batches per rank.

    Rank r takes windows r, r+world, ... of the step; every rank runs the same number
    of micro-batches (FSDP's forward and DDP's backward are collectives): enough for
    the largest share, so a ragged last step leaves some ranks short or empty, never
    with fewer calls. Returns (micro-batches per rank, this rank's share sizes per
    rank as a list) - sizes[r] windows for rank r.
    """
    sizes = [len(range(r, n, world)) for r in range(world)]
    micro = max(1, -(-max(sizes) // batch))
    return micro, sizes


class LeasedPhase:
    """One outer phase: the windows of one DARL span, cut into optimizer steps of
    `per_step` = batch x world x grad_accum windows; the last step may be short.
    Every leased window is trained exactly once (no drop_last here: a dropped
    window would be committed in DARL without ever being trained)."""

    def __init__(self, lease, start, end, windows, per_step, world, rank, batch, bounds=None, ends=None):
        self.lease, self.start, self.end = lease, start, end
        self.windows = windows
        self.per_step, self.world, self.rank, self.batch = per_step, world, rank, batch
        self.steps = -(-len(windows) // per_step)
        self.bounds = bounds         # span_windows_blocked's: where the clock may end the phase,
        self.ends = ends             # and the position each of those ends at
        self.cut = False             # cut_at() ended it before the span's end

    def cut_point(self, trained, budget_left_s, step_s):
        """Where a phase the clock ends should stop (rank 0 decides, fedphase shares it): the
        window count of the first position bound at or after `trained` windows, when the bound
        after it would overrun `budget_left_s` (at `step_s` s a step) by more than stopping at
        the first falls short of it, so the phase ends as near its budget as blocks allow;
        None to go on. Only a bound ends a phase: DARL's custody takes whole positions."""
        if self.bounds is None or not len(self.bounds):
            return None
        i = int(np.searchsorted(self.bounds, trained, side="left"))
        if i >= len(self.bounds) - 1:
            return None                       # the span's last position: it ends there anyway
        first, after = int(self.bounds[i]), int(self.bounds[i + 1])
        t1, t2 = (-(-(b - trained) // self.per_step) * step_s for b in (first, after))
        if t2 <= budget_left_s or t2 - budget_left_s <= budget_left_s - t1:
            return None
        return first

    def cut_at(self, n):
        """End the phase after its first `n` windows (a bound, see cut_point): the last step may
        be short. -> the block position the phase ends at (its span is [start, that))."""
        i = int(np.searchsorted(self.bounds, n, side="left"))
        if i >= len(self.bounds) or int(self.bounds[i]) != n:
            raise ValueError(f"{n} windows is not a block boundary of span [{self.start}, {self.end})")
        self.windows = self.windows[:n]
        self.steps = -(-n // self.per_step)
        self.end, self.cut = int(self.ends[i]), True
        self.bounds, self.ends = self.bounds[:i + 1], self.ends[:i + 1]
        return self.end

    def __len__(self):
        return len(self.windows)

    def step_windows(self, step):
        """The windows of optimizer step `step` over all ranks (global order)."""
        return self.windows[step * self.per_step:(step + 1) * self.per_step]

    def micro_batches(self, step):
        """This rank's micro-batches of `step`: a list of window-index arrays, the same
        count on every rank; an array may be short or empty on a ragged last step."""
        w = self.step_windows(step)
        micro, _ = step_shares(len(w), self.world, self.batch)
        mine = w[self.rank::self.world]
        return [mine[i * self.batch:(i + 1) * self.batch] for i in range(micro)]


def blocks_per_phase(inner_steps, per_step, block_size):
    """Blocks that feed `inner_steps` optimizer steps of `per_step` windows, rounded
    up to whole blocks: the phase trains every window of them, so it runs H steps
    plus the round-up's ceil(extra / per_step) (several when block_size > per_step;
    none when block_size divides inner_steps x per_step), the last one short."""
    return -(-inner_steps * per_step // block_size)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fake-cifar", help="write a small CIFAR-10 fixture in the standard format")
    f.add_argument("dir")
    f.add_argument("--train", type=int, default=500, help="training images (default 500)")
    f.add_argument("--test", type=int, default=100, help="test images (default 100)")
    f.add_argument("--seed", type=int, default=0, help="RNG seed (default 0)")
    a = p.parse_args()
    print(write_fake_cifar(a.dir, a.train, a.test, a.seed))


if __name__ == "__main__":
    main()
