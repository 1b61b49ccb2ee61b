#!/usr/bin/env bash
# prep/download_cifar.sh - fetch CIFAR-10 (python version, ~170 MB) once, on a LOGIN node.
#
#   prep/download_cifar.sh            # -> $PWW_DATA/cifar-10-batches-py/ (what jobs/*_cifar_*.sh read)
#
# The archive is checked against its published MD5 before it is unpacked; a partial
# download resumes (curl -C -). CIFAR_URL replaces the Toronto location (a mirror).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=env.sh
source "$ROOT/env.sh"

URL=${CIFAR_URL:-https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz}
MD5=${CIFAR_MD5:-c58f30108f718f92721af3b95e74349a}
OUT=${OUT:-$PWW_DATA}
archive=$OUT/cifar-10-python.tar.gz

mkdir -p "$OUT"
if [ -f "$OUT/cifar-10-batches-py/test_batch" ]; then
    echo "have $OUT/cifar-10-batches-py"
    exit 0
fi
curl -fsSL --retry 5 --retry-delay 2 -C - -o "$archive.part" "$URL"
got=$(md5sum "$archive.part" | cut -d' ' -f1)
if [ "$got" != "$MD5" ]; then
    echo "download_cifar: MD5 $got, expected $MD5; removed $archive.part, re-run to fetch it again" >&2
    rm -f "$archive.part"
    exit 1
fi
mv "$archive.part" "$archive"
tar -xzf "$archive" -C "$OUT"
rm -f "$archive"
echo "CIFAR-10 in $OUT/cifar-10-batches-py ($(find "$OUT/cifar-10-batches-py" -name '*_batch*' | wc -l) batch files)"
