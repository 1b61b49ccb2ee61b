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

    .venv/bin/python bench/blob_throughput.py --tls --sizes-mib 1024 --streams 1,4

--tls: against a blobstore.py under TLS, get_file()/put_file() with each --streams count
beside curl on the same server and the same file (`curl -o /dev/null`, `curl -o FILE`,
`curl -T`), each run --repeat times; the target is >= 0.8 of curl's rate for one stream
(tls_vs_curl()). get_file also fsyncs and checks the sha256, which curl does not.
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

sys.path.insert(0, os.path.join(ROOT, "tests"))
import certs  # noqa: E402  (the CA and certificate, as central.sh makes them)

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


# ---------------------------------------------------------------- TLS: ours against curl

TLS_TOKEN = "bench-token"


def tls_client(op, url, ca, blob_id, path, sha, streams):
    """Child: one get_file or put_file; prints its seconds."""
    t0 = time.perf_counter()
    if op == "get":
        assert blob_client.get_file(url, blob_id, path, token=TLS_TOKEN, ca_file=ca, progress=False,
                                    streams=int(streams)) == sha
        os.unlink(path)
    else:
        got = blob_client.put_file(url, blob_id, path, token=TLS_TOKEN, ca_file=ca, progress=False, sha256=sha,
                                   streams=int(streams))
        assert got["sha256"] == sha
    print(json.dumps({"s": time.perf_counter() - t0}), flush=True)


def tls_vs_curl(size, tmp, streams=(1,), repeat=2):
    """MB/s of curl and of our client (each streams count), GET and PUT of one `size`-byte
    file, against one blobstore.py under TLS: {"curl get": [MB/s, ...], "ours get 4": [...], ...}."""
    src = os.path.join(tmp, "src")
    sha = make_file(src, size)
    ca, cert, key = certs.make_tls(tmp)
    env = {**os.environ, "PWW_TOKEN": TLS_TOKEN}
    server = subprocess.Popen([sys.executable, os.path.join(ROOT, "blobstore.py"), "--root", os.path.join(tmp, "root"),
                               "--port", "0", "--max-blob-gb", "100", "--tls-cert", cert, "--tls-key", key],
                              stdout=subprocess.PIPE, text=True, env=env)
    out, n = {}, [0]
    try:
        url = server.stdout.readline().split("listening on ")[1].strip()

        def curl(op, blob_id, into="/dev/null"):
            cmd = ["curl", "-sS", "--fail", "--noproxy", "*", "--cacert", ca, "-H", f"Authorization: Bearer {TLS_TOKEN}",
                   "-w", "%{time_total}", "-o", into, f"{url}/blobs/{blob_id}"]
            cmd += ["-T", src, "-H", f"X-Content-Sha256: {sha}"] if op == "put" else []
            return float(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip())

        def ours(op, k):
            blob_id, path = ("src", os.path.join(tmp, "back")) if op == "get" else (f"up-{n[0]}", src)
            r = subprocess.run([sys.executable, __file__, "--role", "tls_client", op, url, ca, blob_id, path, sha,
                                str(k)], capture_output=True, text=True, env=env)
            if r.returncode:
                raise SystemExit(f"blob_throughput: our {op} ({k} streams) failed: {r.stderr.strip()[-600:]}")
            return float(json.loads(r.stdout.strip().splitlines()[-1])["s"])

        def delete(blob_id):
            httpc.call(url, "DELETE", f"/blobs/{blob_id}", token=TLS_TOKEN, ca_file=ca)

        curl("put", "src")
        for _ in range(repeat):
            for op in ("get", "put"):
                n[0] += 1
                secs = curl(op, "src" if op == "get" else f"up-{n[0]}")
                out.setdefault(f"curl {op}", []).append(size / secs / 1e6)
                if op == "put":
                    delete(f"up-{n[0]}")
                else:               # into a file, as get_file must (no fsync: get_file's is extra)
                    out.setdefault("curl get>file", []).append(size / curl(op, "src", os.path.join(tmp, "c")) / 1e6)
                    os.unlink(os.path.join(tmp, "c"))
                for k in streams:
                    n[0] += 1
                    out.setdefault(f"ours {op} {k}", []).append(size / ours(op, k) / 1e6)
                    if op == "put":
                        delete(f"up-{n[0]}")
    finally:
        server.kill()
        server.wait()
    return out


def tls_report(size, rates):
    print(f"{size / 2**20:.0f} MiB over TLS on loopback, MB/s per run (ratio: best / curl's best):")
    for name, r in rates.items():
        base = max(rates[f"curl {name.split()[1].split('>')[0]}"])
        print(f"  {name:<12} {' '.join(f'{x:6.0f}' for x in r)}   {max(r) / base:.2f}")


def main(a):
    if a.role == "sink":
        return sink()
    if a.role == "client":
        return client(*a.args)
    if a.role == "tls_client":
        return tls_client(*a.args)
    tmp = tempfile.mkdtemp(prefix="blobbench-", dir=a.dir)
    try:
        if a.tls:
            for mib in a.sizes_mib:
                tls_report(mib * 2**20, tls_vs_curl(mib * 2**20, tmp, a.streams, a.repeat))
            return
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
    p.add_argument("--tls", action="store_true", help="ours against curl under TLS (module docstring)")
    p.add_argument("--streams", type=lambda s: [int(x) for x in s.split(",")], default=[1],
                   help="with --tls: the stream counts of our client to measure (default 1)")
    p.add_argument("--repeat", type=int, default=2, help="with --tls: runs of each arm (default 2)")
    p.add_argument("--role", default="main", choices=["main", "sink", "client", "tls_client"],
                   help=argparse.SUPPRESS)
    p.add_argument("args", nargs="*", help=argparse.SUPPRESS)
    main(p.parse_args())
