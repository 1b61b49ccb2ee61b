"""bench/front_throughput.py - a blob PUT and GET through the front (nginx on one HTTPS port)
against the same through the blob store's own port, in the same run. Not a test.

    .venv/bin/python bench/front_throughput.py                 # 1 GiB, 2 repeats
    .venv/bin/python bench/front_throughput.py --mib 256 --repeat 1

Starts `central.sh start` in a temporary state dir (its own free ports, the front on one of
them), then for each path (direct https://127.0.0.1:BLOB_PORT, front https://127.0.0.1:PORT/blob):
blob_client.put_file and get_file (checksums included, as a site pays them), and curl
(`curl -T` and `curl -o /dev/null`, one stream, no checksum). Prints MB/s per path and the
front / direct ratio. Needs nginx (`make netpeers`) and curl.
"""
import argparse
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT]

import blob_client  # noqa: E402
from tests.test_front import Central, write_file  # noqa: E402


def timed(fn):
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def curl(args):
    subprocess.run(["curl", "-sS", "--fail", *args], check=True, stdout=subprocess.DEVNULL)


def run(c, tmp, size, repeat):
    src = os.path.join(tmp, "src.bin")
    write_file(src, size)
    sha = blob_client.sha256_file(src)
    auth = ["-H", f"Authorization: Bearer {c.token}", "--cacert", c.ca]
    rows = {}
    for i in range(repeat):
        for path, url in (("direct", c.direct("blob")), ("front", c.front("blob"))):
            bid = f"b-{path}-{i}"
            put = timed(lambda: blob_client.put_file(url, bid, src, token=c.token, ca_file=c.ca, sha256=sha))
            dst = os.path.join(tmp, "dst.bin")
            get = timed(lambda: blob_client.get_file(url, bid, dst, token=c.token, ca_file=c.ca))
            os.unlink(dst)
            cget = timed(lambda: curl([*auth, "-o", "/dev/null", f"{url}/blobs/{bid}"]))
            cput = timed(lambda: curl([*auth, "-T", src, "-H", f"X-Content-Sha256: {sha}", f"{url}/blobs/c-{bid}"]))
            for k, s in (("blob_client PUT", put), ("blob_client GET", get), ("curl PUT", cput), ("curl GET", cget)):
                rows.setdefault((k, path), []).append(size / s / 1e6)
    print(f"{size / 2**20:.0f} MiB, best of {repeat}, MB/s (TLS both ways; the front adds nginx's TLS hop)")
    print(f"{'':18}{'direct':>10}{'front':>10}{'front/direct':>14}")
    for k in ("blob_client PUT", "blob_client GET", "curl PUT", "curl GET"):
        d, f = max(rows[(k, "direct")]), max(rows[(k, "front")])
        print(f"{k:18}{d:10.0f}{f:10.0f}{f / d:14.2f}")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=1024)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--dir", default=None, help="where the files go (default: a temp dir)")
    a = p.parse_args()
    c = Central()
    tmp = tempfile.mkdtemp(dir=a.dir, prefix="pww-front-bench-")
    try:
        c.start()
        run(c, tmp, a.mib << 20, a.repeat)
        print("front access log: " + pathlib.Path(c.state, "front", "access.log").read_text().splitlines()[-1])
    finally:
        c.close()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
