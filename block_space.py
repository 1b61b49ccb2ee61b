"""block_space.py - which samples a DARL lease position means: the corpus cut into blocks of K
consecutive samples, visited in one seeded order that every site computes on its own.

Runs on: the central VM (darl_server.py builds the space it leases positions of and serves
its describe() and digest()) and the sites (darl_client.py, fedsite.py and data.py turn a
leased position into samples). Python standard library only; never torch. No server, no
port, no state; nothing to run from the shell. The lease table over the positions is
darl_table.py's, which does not import this file: the table only counts positions.

Use:
    space = block_space.BlockSpace.from_manifest("data/c4-tokens/manifest.json", block_size=1, seed=0)
    # or BlockSpace(num_samples=N, block_size=K, seed=S) for a corpus without a manifest
    for p in range(lease_start, lease_end):
        for sample in space.samples_of(space.block_at(p)): ...

The order is a Feistel network keyed by SplitMix64 (PERMUTATION_VERSION): O(1) per
position, no O(M) table, and the same on every Python version and machine.

A tokenized corpus (tokenize_corpus.py, read by data.py's TokenWindows) keeps its last
`heldout_windows` windows as the held-out split. from_manifest takes
N = num_windows - heldout_windows, so sample i is training window i and the positions
cover exactly the training windows [0, N): DARL never leases a held-out window. The
manifest's digest (which covers heldout_windows) joins the space's digest, so sites whose
corpora or splits differ are refused at registration. The coordinator's GET /status and
/register replies carry describe() (num_samples, block_size, seed, num_blocks, algorithm,
manifest_digest) and the digest, so a site can check that its own manifest gives the same
space.
"""
import hashlib
import json

PERMUTATION_VERSION = "feistel-splitmix64/1"
MASK64 = (1 << 64) - 1


def splitmix64(x):
    """One step of SplitMix64 (Steele, Lea, Flood 2014): a fixed, portable 64-bit mix."""
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


class BlockSpace:
    """M = ceil(N/K) blocks of K consecutive samples, visited in a seeded order.

    Position p (what leases are made of) maps to block block_at(p). The order
    is a Feistel network over the smallest even-bit domain >= M, with cycle
    walking to stay inside [0, M): O(1) per lookup, no O(M) table, and the
    same on every Python version and machine (random.shuffle promises neither).
    """
    ROUNDS = 6

    def __init__(self, num_samples, block_size, seed, manifest_digest=None):
        if num_samples < 1:
            raise ValueError(f"--num-samples must be >= 1, got {num_samples}")
        if block_size < 1:
            raise ValueError(f"--block-size must be >= 1, got {block_size}")
        self.num_samples, self.block_size, self.seed = int(num_samples), int(block_size), int(seed)
        self.manifest_digest = manifest_digest
        self.num_blocks = -(-self.num_samples // self.block_size)
        bits = max(2, (self.num_blocks - 1).bit_length())
        self._half = (bits + 1) // 2
        self._mask = (1 << self._half) - 1
        self._keys = [splitmix64((self.seed & MASK64) ^ splitmix64(r + 1)) for r in range(self.ROUNDS)]

    def _feistel(self, x):
        left, right = x >> self._half, x & self._mask
        for key in self._keys:
            left, right = right, left ^ (splitmix64(key ^ right) & self._mask)
        return (left << self._half) | right

    def _feistel_inverse(self, x):
        left, right = x >> self._half, x & self._mask
        for key in reversed(self._keys):
            left, right = right ^ (splitmix64(key ^ left) & self._mask), left
        return (left << self._half) | right

    def block_at(self, position):
        """The block visited at `position` (0 <= position < num_blocks)."""
        if not 0 <= position < self.num_blocks:
            raise IndexError(f"position {position} outside [0, {self.num_blocks})")
        x = self._feistel(position)
        while x >= self.num_blocks:      # cycle walking: < 4 steps on average (domain < 4M)
            x = self._feistel(x)
        return x

    def position_of(self, block):
        """Inverse of block_at."""
        if not 0 <= block < self.num_blocks:
            raise IndexError(f"block {block} outside [0, {self.num_blocks})")
        x = self._feistel_inverse(block)
        while x >= self.num_blocks:
            x = self._feistel_inverse(x)
        return x

    def samples_of(self, block):
        """Sample indices of a block: range(block*K, min(N, (block+1)*K))."""
        if not 0 <= block < self.num_blocks:
            raise IndexError(f"block {block} outside [0, {self.num_blocks})")
        return range(block * self.block_size, min(self.num_samples, (block + 1) * self.block_size))

    def describe(self):
        return {"num_samples": self.num_samples, "block_size": self.block_size, "seed": self.seed,
                "num_blocks": self.num_blocks, "algorithm": PERMUTATION_VERSION,
                "manifest_digest": self.manifest_digest}

    def digest(self):
        """Everything that decides which samples a position means, hashed."""
        blob = json.dumps(self.describe(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:32]

    @classmethod
    def from_manifest(cls, path, block_size, seed):
        """The training windows of a tokenized corpus' manifest.json (tokenize_corpus.py):
        N = num_windows - heldout_windows, so positions never reach the held-out tail."""
        try:
            with open(path) as f:
                m = json.load(f)
        except (OSError, ValueError) as e:
            raise ValueError(f"--manifest {path}: cannot read it as JSON ({e})")
        n, held, d = m.get("num_windows"), m.get("heldout_windows"), m.get("digest")
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (n, held)) or not isinstance(d, str):
            raise ValueError(f"--manifest {path}: needs integers 'num_windows' and 'heldout_windows' and a "
                             "string 'digest' (written by tokenize_corpus.py; re-run it for an older manifest)")
        if not 0 <= held < n:
            raise ValueError(f"--manifest {path}: heldout_windows {held} leaves no training windows out of "
                             f"num_windows {n}; re-run tokenize_corpus.py with a smaller --heldout-windows")
        return cls(n - held, block_size, seed, manifest_digest=d)
