"""bench/blob_throughput.py - PUT and GET of a large blob over loopback, against baselines.

Runs on: any machine with the venv (the central VM is the one that matters). Not a test.

    .venv/bin/python bench/blob_throughput.py                      # 256 MiB and 2 GiB
    .venv/bin/python bench/blob_throughput.py --sizes-mib 256 --dir /scratch/tmp

Measured in the same run, per size:
  socket  raw-socket copy of the same bytes: sendfile() into a TCP socket, a second
          process recv_into()s and discards them (the ceiling for GET)
  fsync   the same bytes written to a new file in 4 MiB writes, then fsync (the
          ceiling for a durable PUT, which must land on disk)
  PUT     put_file() to a blobstore.py subprocess (checksum declared up front; the
          client's own sha256 pass over the file is timed separately)
  GET     an HTTP GET whose body the client reads and discards (the server's
          os.sendfile path), and get_file() end to end (write + sha256 + fsync)
Ratios: PUT / min(socket, fsync) and GET / socket (targets >= 0.7). Peak RSS
(VmHWM) of the server and of the client process, per size (target < 100 MiB and
not growing with size). Temporary files go under --dir and are removed.
"""
import argparse
import hashlib
import http.client
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

import blob_client  # noqa: E402
import httpc  # noqa: E402

CHUNK = 4 << 20


def vmhwm_mib(pid="self"):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def make_file(path, size):
    """Pseudo-random bytes, 1 MiB at a time; returns the sha256 (computed while writing)."""
    base = os.urandom(2**20)
    h = hashlib.sha256()
    with open(path, "wb") as f:
        for i in range(0, size, 2**20):
            piece = (i.to_bytes(8, "little") + base[8:])[:size - i]
            f.write(piece)
            h.update(piece)
        os.fsync(f.fileno())            # clean pages: its writeback must not slow the baselines
    return h.hexdigest()


# ---------------------------------------------------------------- baselines

def sink():
    """Child: accept one connection, read everything into one buffer, answer b"k"."""
    srv = socket.create_server(("127.0.0.1", 0))
    print(srv.getsockname()[1], flush=True)
    conn, _ = srv.accept()
    buf = memoryview(bytearray(CHUNK))
    while conn.recv_into(buf):
        pass
    conn.sendall(b"k")
    conn.close()


def raw_socket_copy(path):
    child = subprocess.Popen([sys.executable, __file__, "--role", "sink"], stdout=subprocess.PIPE, text=True)
    port = int(child.stdout.readline())
    sock = socket.create_connection(("127.0.0.1", port))
    t0 = time.perf_counter()
    with open(path, "rb") as f:
        sock.sendfile(f)
    sock.shutdown(socket.SHUT_WR)
    assert sock.recv(1) == b"k"
    dt = time.perf_counter() - t0
    sock.close()
    child.wait()
    return dt


def fsync_write(path, dst):
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as src, open(dst, "wb", buffering=0) as out:
        while True:
            n = src.readinto(view)
            if not n:
                break
            out.write(view[:n])
        os.fsync(out.fileno())
    dt = time.perf_counter() - t0
    os.unlink(dst)
    return dt


# ---------------------------------------------------------------- the client, in its own process

def client(url, path, sha, out_path):
    size = os.path.getsize(path)
    res = {}
    t0 = time.perf_counter()
    blob_client.sha256_file(path)
    res["client_hash_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    got = blob_client.put_file(url, "bench", path, sha256=sha, progress=False)
    res["put_s"] = time.perf_counter() - t0
    assert got["sha256"] == sha and got["size"] == size
    t0 = time.perf_counter()
    conn = httpc.connect(url, 120)
    conn.request("GET", "/blobs/bench")
    resp = conn.getresponse()
    buf = memoryview(bytearray(CHUNK))
    n = 0
    while True:
        k = resp.readinto(buf)
        if not k:
            break
        n += k
    conn.close()
    res["get_raw_s"] = time.perf_counter() - t0
    assert n == size
    t0 = time.perf_counter()
    assert blob_client.get_file(url, "bench", out_path, progress=False) == sha
    res["get_file_s"] = time.perf_counter() - t0
    os.unlink(out_path)
    res["client_peak_mib"] = vmhwm_mib()
    print(json.dumps(res), flush=True)


# ---------------------------------------------------------------- one size

def measure(size, tmp):
    src = os.path.join(tmp, "src")
    sha = make_file(src, size)
    out = {"size": size, "socket_s": raw_socket_copy(src), "fsync_s": fsync_write(src, os.path.join(tmp, "copy"))}
    root = os.path.join(tmp, "root")
    server = subprocess.Popen([sys.executable, os.path.join(ROOT, "blobstore.py"), "--root", root, "--port", "0",
                               "--max-blob-gb", "100"], stdout=subprocess.PIPE, text=True)
    try:
        url = server.stdout.readline().split("listening on ")[1].strip()
        child = subprocess.run([sys.executable, __file__, "--role", "client", url, src, sha,
                                os.path.join(tmp, "back")], capture_output=True, text=True, check=True)
        out.update(json.loads(child.stdout.strip().splitlines()[-1]))
        out["server_peak_mib"] = vmhwm_mib(server.pid)
    finally:
        server.kill()
        server.wait()
    shutil.rmtree(root)
    os.unlink(src)
    return out


def report(rows):
    mbs = lambda size, s: size / s / 1e6
    print(f"{'size':>9} {'socket':>8} {'fsync':>8} {'PUT':>8} {'GET':>8} {'get_file':>8} {'cli sha':>8}"
          f" {'PUT/min':>8} {'GET/sock':>8} {'srv MiB':>8} {'cli MiB':>8}   (MB/s; ratios; peak RSS)")
    for r in rows:
        s = r["size"]
        sock, fs, put = mbs(s, r["socket_s"]), mbs(s, r["fsync_s"]), mbs(s, r["put_s"])
        get, gf, ch = mbs(s, r["get_raw_s"]), mbs(s, r["get_file_s"]), mbs(s, r["client_hash_s"])
        print(f"{s / 2**20:>5.0f} MiB {sock:>8.0f} {fs:>8.0f} {put:>8.0f} {get:>8.0f} {gf:>8.0f} {ch:>8.0f}"
              f" {put / min(sock, fs):>8.2f} {get / sock:>8.2f} {r['server_peak_mib']:>8.1f} {r['client_peak_mib']:>8.1f}")
    print("targets: PUT/min(socket, fsync) >= 0.7, GET/socket >= 0.7, peak RSS < 100 MiB and flat in size")


def main(a):
    if a.role == "sink":
        return sink()
    if a.role == "client":
        return client(*a.args)
    tmp = tempfile.mkdtemp(prefix="blobbench-", dir=a.dir)
    try:
        rows = []
        for mib in a.sizes_mib:
            rows.append(measure(mib * 2**20, tmp))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        report(rows)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes-mib", type=lambda s: [int(x) for x in s.split(",")], default=[256, 2048],
                   help="blob sizes, MiB, comma-separated (default 256,2048)")
    p.add_argument("--dir", default=None, help="where the temporary files go (default: $TMPDIR or /tmp)")
    p.add_argument("--role", default="main", choices=["main", "sink", "client"], help=argparse.SUPPRESS)
    p.add_argument("args", nargs="*", help=argparse.SUPPRESS)
    main(p.parse_args())
