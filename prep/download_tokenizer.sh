#!/usr/bin/env bash
# prep/download_tokenizer.sh - fetch the tokenizer files once, on a LOGIN node (compute
# nodes reach the internet only through a slow proxy, if at all).
#
#   prep/download_tokenizer.sh                                   # Qwen/Qwen3-0.6B
#   TOKENIZER_REPO=org/name TOKENIZER_REVISION=<commit> prep/download_tokenizer.sh
#
# Writes $PWW_DATA/tokenizers/<name>/tokenizer.json (+ tokenizer_config.json) and prints
# its sha256. Both sites must tokenize with the byte-identical file: the manifest digest
# covers it, and DARL refuses a site whose digest differs. Pin TOKENIZER_REVISION to a
# commit for a run you mean to repeat. HF_TOKEN is sent if set (gated repositories);
# HF_ENDPOINT replaces https://huggingface.co (a mirror).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=env.sh
source "$ROOT/env.sh"

REPO=${TOKENIZER_REPO:-Qwen/Qwen3-0.6B}
REVISION=${TOKENIZER_REVISION:-main}
ENDPOINT=${HF_ENDPOINT:-https://huggingface.co}
OUT=${OUT:-$PWW_DATA/tokenizers/${REPO##*/}}
FILES=${TOKENIZER_FILES:-tokenizer.json tokenizer_config.json}

auth=()
[ -n "${HF_TOKEN:-}" ] && auth=(-H "Authorization: Bearer $HF_TOKEN")
mkdir -p "$OUT"
for f in $FILES; do
    url="$ENDPOINT/$REPO/resolve/$REVISION/$f"
    echo "fetching $url"
    curl -fsSL --retry 5 --retry-delay 2 "${auth[@]}" -o "$OUT/$f.part" "$url"
    mv "$OUT/$f.part" "$OUT/$f"
done
echo "tokenizer: $OUT/tokenizer.json sha256 $(sha256sum "$OUT/tokenizer.json" | cut -d' ' -f1)"
echo "next: prep/stage_c4.sh, then TOKENIZER=$OUT/tokenizer.json prep/tokenize.sh"
