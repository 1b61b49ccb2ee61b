#!/usr/bin/env bash
# prep/tokenize.sh - the offline tokenization pass (login node, CPU, no network), then the
# two facts the central VM needs: the WINDOW COUNT and manifest.json.
#
#   prep/tokenize.sh                                  # $PWW_DATA/c4/en/*.json.gz, Qwen3, 2048
#   SEQ_LEN=4096 OUT=data/c4-tokens-4096 prep/tokenize.sh
#   INPUTS="data/mytext" TOKENIZER=none prep/tokenize.sh --max-files 40   # built-in bytes
#
# Flags after the script name go to tokenize_corpus.py. Runs inside the site's container
# or venv (pww_run). Output: $OUT/tokens-*.bin + $OUT/manifest.json (default
# $PWW_DATA/c4-tokens, which is what jobs/*_titan.sh read). Carry the manifest (a few
# hundred bytes) to the central VM rather than the count by hand:
#   scp $OUT/manifest.json <central>:/tmp/manifest.json
#   MANIFEST=/tmp/manifest.json INIT=... ./central.sh start
# Tokenize the same shards with the same tokenizer at both sites: the digest printed here
# must be equal at both, or DARL refuses the second site at registration.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=env.sh
source "$ROOT/env.sh"
cd "$PWW_ROOT"

TOKENIZER=${TOKENIZER:-$PWW_DATA/tokenizers/Qwen3-0.6B/tokenizer.json}
SEQ_LEN=${SEQ_LEN:-2048}
OUT=${OUT:-$PWW_DATA/c4-tokens}
if [ -n "${INPUTS:-}" ]; then
    read -r -a inputs <<< "$INPUTS"
else
    inputs=("$PWW_DATA"/c4/en/c4-train.*.json.gz)
    [ -e "${inputs[0]}" ] || { echo "tokenize.sh: no shards in $PWW_DATA/c4/en; run prep/stage_c4.sh first or set INPUTS" >&2; exit 1; }
fi
tok_args=()
if [ "$TOKENIZER" != none ]; then
    [ -f "$TOKENIZER" ] || { echo "tokenize.sh: $TOKENIZER not found; run prep/download_tokenizer.sh or set TOKENIZER (none = built-in bytes)" >&2; exit 1; }
    tok_args=(--tokenizer "$TOKENIZER")
fi

pww_run python tokenize_corpus.py "${inputs[@]}" "${tok_args[@]}" --seq-len "$SEQ_LEN" --out "$OUT" "$@"
pww_run python - "$OUT/manifest.json" <<'PY'
import json, sys
m = json.load(open(sys.argv[1]))
print(f"WINDOWS={m['num_windows']}")
print(f"DIGEST={m['digest']}")
print(f"MANIFEST={sys.argv[1]}")
PY
echo "next: scp $OUT/manifest.json <central>:/tmp/manifest.json   (then MANIFEST=/tmp/manifest.json ./central.sh start)"
