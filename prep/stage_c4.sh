#!/usr/bin/env bash
# prep/stage_c4.sh - download C4 (English) training shards once, on a LOGIN node.
#
#   prep/stage_c4.sh                         # shards 0..7 (~2.5 GB) -> $PWW_DATA/c4/en/
#   C4_FIRST=8 C4_SHARDS=24 prep/stage_c4.sh # more, later: existing shards are kept
#
# Each shard is c4-train.NNNNN-of-01024.json.gz (one {"text": ...} per line, ~350k
# documents). Downloads resume (curl -C -) into .part files; a shard is renamed into place
# only after `gzip -t` passes, so a half-fetched file is never tokenized. Re-running skips
# the shards already present. C4_BASE_URL replaces the Hugging Face location (a mirror).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=env.sh
source "$ROOT/env.sh"

BASE=${C4_BASE_URL:-${HF_ENDPOINT:-https://huggingface.co}/datasets/allenai/c4/resolve/main/en}
FIRST=${C4_FIRST:-0}
COUNT=${C4_SHARDS:-8}
OUT=${OUT:-$PWW_DATA/c4/en}

mkdir -p "$OUT"
for ((i = FIRST; i < FIRST + COUNT; i++)); do
    name=$(printf 'c4-train.%05d-of-01024.json.gz' "$i")
    if [ -s "$OUT/$name" ]; then echo "have $name"; continue; fi
    echo "fetching $name"
    curl -fsSL --retry 5 --retry-delay 2 -C - -o "$OUT/$name.part" "$BASE/$name"
    if ! gzip -t "$OUT/$name.part"; then
        echo "stage_c4: $name is corrupt; removed, re-run to fetch it again" >&2
        rm -f "$OUT/$name.part"
        exit 1
    fi
    mv "$OUT/$name.part" "$OUT/$name"
done
echo "staged $(find "$OUT" -name 'c4-train.*.json.gz' | wc -l) shards in $OUT ($(du -sh "$OUT" | cut -f1))"
echo "next: prep/tokenize.sh"
