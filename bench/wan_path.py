"""bench/wan_path.py - the path a site's blobs take to the central VM: our client against
curl on the same server, one stream against N, direct and through a real Squid, and on a
path that limits each connection the way a long WAN path does. Not a test.

Runs on: this machine (Debian's squid: `make netpeers`; curl). Binds 127.0.0.1 only.
    .venv/bin/python bench/wan_path.py                 # 1 GiB, every table (~10 min on 2 cores)
    .venv/bin/python bench/wan_path.py --quick         # 256 MiB, what `make bench` runs
    .venv/bin/python bench/wan_path.py --size-mib 2048 --streams 1,4,8 --window-kib 4096

Measured in the same run, each arm in a client process of its own against one blobstore.py
with TLS and a token (the arms run one after another; MB/s = 1e6 bytes/s):
  curl          `curl --cacert` GET into /dev/null and PUT (-T) of the same file
  ours N        blob_client.get_file / put_file with N ranged streams (get_file: temp file,
                sha256 over the whole file, fsync, rename; put_file: sha256 given, as the
                sites pass it)
  via Squid     the same through a real Squid (its own instance, CONNECT to the store's port;
                the stock rule that refuses CONNECT to other ports kept)
  WAN window    through bench/wan_relay.py with --rtt-ms round trips and --window-kib per
                connection, one stream against N: what N streams buy on a long path
Then the seconds of one round's transfers at 8B and 32B on a 10 Gbit/s link, from these
ratios, beside `fedmom_server.py plan`'s central seconds (the arithmetic is printed).
"""
import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests"), HERE]  # certs.py: the CA and certificate, as central.sh makes them

import blob_client  # noqa: E402
import certs  # noqa: E402
import httpc  # noqa: E402
import netpeers  # noqa: E402
import wan_relay  # noqa: E402

TOKEN = "wan-path-bench-token"
LINK_BYTES_S = 10e9 / 8          # the central VM's 10 Gbit/s link
WAN_RTT_S, WAN_WINDOW = 0.030, 4 << 20   # a 30 ms path, a 4 MiB window: one connection <= 140 MB/s


def make_file(path, size):
    h = hashlib.sha256()
    with open(path, "wb") as f:
        left = size
        while left:
            b = os.urandom(min(left, 16 << 20))
            f.write(b)
            h.update(b)
            left -= len(b)
    return h.hexdigest()


# ---------------------------------------------------------------- one arm, in its own process

def client(op, url, blob_id, path, sha, streams):
    """The client process of one arm: prints the seconds of one get or put."""
    token, ca = TOKEN, os.environ["BENCH_CA"]
    t0 = time.perf_counter()
    if op == "get":
        got = blob_client.get_file(url, blob_id, path, token=token, ca_file=ca, progress=False,
                                   streams=int(streams))
        assert got == sha, "the downloaded blob's sha256 differs"
    else:
        got = blob_client.put_file(url, blob_id, path, token=token, ca_file=ca, progress=False, sha256=sha,
                                   streams=int(streams))
        assert got["sha256"] == sha
    print(json.dumps({"s": time.perf_counter() - t0}), flush=True)


class Bench:
    def __init__(self, tmp, size):
        self.tmp, self.size = tmp, size
        self.src = os.path.join(tmp, "src")
        self.sha = make_file(self.src, size)
        self.ca, cert, key = certs.make_tls(os.path.join(tmp, "tls"))
        tok = os.path.join(tmp, "token")
        with open(tok, "w") as f:
            f.write(TOKEN + "\n")
        self.server = subprocess.Popen(
            [sys.executable, os.path.join(ROOT, "blobstore.py"), "--root", os.path.join(tmp, "root"), "--port", "0",
             "--max-blob-gb", "100", "--token-file", tok, "--tls-cert", cert, "--tls-key", key],
            stdout=subprocess.PIPE, text=True)
        self.url = self.server.stdout.readline().split("listening on ")[1].strip()
        self.port = int(self.url.rsplit(":", 1)[1])
        # the blob every GET arm reads: put once by curl (the baseline client)
        self.curl("put", self.url, "src")
        self.n = 0

    def close(self):
        self.server.kill()
        self.server.wait()

    def _env(self, proxy):
        env = {**os.environ, "BENCH_CA": self.ca, "PWW_PROXY": proxy or "none"}
        for k in ("https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY", "no_proxy", "NO_PROXY"):
            env.pop(k, None)
        if proxy:
            env["https_proxy"] = proxy
        return env

    def delete(self, url, blob_id):
        httpc.call(url, "DELETE", f"/blobs/{blob_id}", token=TOKEN, ca_file=self.ca)

    def curl(self, op, url, blob_id, proxy=None):
        """curl's seconds for a GET into /dev/null or a PUT of the source file."""
        cmd = ["curl", "-sS", "--fail", "--cacert", self.ca, "-H", f"Authorization: Bearer {TOKEN}",
               "-w", "%{time_total}", f"{url}/blobs/{blob_id}"]
        cmd += ["-o", "/dev/null"] if op == "get" else ["-o", "/dev/null", "-T", self.src,
                                                       "-H", f"X-Content-Sha256: {self.sha}"]
        cmd += ["--proxy", proxy] if proxy else ["--noproxy", "*"]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=self._env(None))
        return float(out.stdout.strip())

    def ours(self, op, url, streams, proxy=None):
        """Our client's seconds: get_file of the source blob, or put_file as a new blob."""
        self.n += 1
        blob_id, path = ("src", os.path.join(self.tmp, "back")) if op == "get" else (f"up-{self.n}", self.src)
        out = subprocess.run([sys.executable, __file__, "--role", "client", op, url, blob_id, path, self.sha,
                              str(streams)], capture_output=True, text=True, env=self._env(proxy))
        if out.returncode:
            raise SystemExit(f"wan_path: the {op} client ({streams} streams) failed: {out.stderr.strip()[-600:]}")
        if op == "get":
            os.unlink(path)
        else:
            self.delete(self.url, blob_id)
        return json.loads(out.stdout.strip().splitlines()[-1])["s"]

    def rate(self, seconds):
        return self.size / seconds / 1e6


# ---------------------------------------------------------------- the tables

def row(label, get_mbs, put_mbs, base=None):
    ratio = "" if base is None else f"   {get_mbs / base[0]:>5.2f} x {put_mbs / base[1]:>5.2f} x"
    print(f"  {label:<32} {get_mbs:>8.0f} {put_mbs:>8.0f}{ratio}")


def loopback_table(b, streams, squid):
    print(f"\n1. {b.size / 2**30:g} GiB over TLS on loopback (MB/s; ratios against curl on the same server)")
    print(f"  {'':<32} {'GET':>8} {'PUT':>8}   GET/curl PUT/curl")
    curl = (b.rate(b.curl("get", b.url, "src")), b.rate(b.curl("put", b.url, "curl-put")))
    b.delete(b.url, "curl-put")
    row("curl", *curl)
    out = {"curl": curl}
    for n in streams:
        ours = (b.rate(b.ours("get", b.url, n)), b.rate(b.ours("put", b.url, n)))
        row(f"ours, {n} stream{'s' * (n > 1)}", *ours, base=curl)
        out[f"ours{n}"] = ours
    proxy = f"http://127.0.0.1:{squid.port}"
    print(f"\n2. the same through a real Squid ({proxy}; ratios against our client direct)")
    sc = (b.rate(b.curl("get", b.url, "src", proxy)), b.rate(b.curl("put", b.url, "curl-put", proxy)))
    b.delete(b.url, "curl-put")
    row("curl via Squid", *sc, base=curl)
    for n in (1, max(streams)):
        via = (b.rate(b.ours("get", b.url, n, proxy)), b.rate(b.ours("put", b.url, n, proxy)))
        row(f"ours via Squid, {n} stream{'s' * (n > 1)}", *via, base=out[f"ours{n}"])
        out[f"squid{n}"] = via
    out["squid_connects"] = squid.connects()
    print(f"  (Squid's access log: {out['squid_connects']} CONNECT tunnels)")
    return out


def window_table(b, streams, rtt_ms, window_kib):
    relay = wan_relay.Link(("127.0.0.1", b.port), None, rtt_ms / 2, window_kib=window_kib).start()
    url = f"https://127.0.0.1:{relay.port}"
    per_conn = window_kib * 1024 / (rtt_ms / 1e3) / 1e6
    print(f"\n3. a long path: {rtt_ms:g} ms round trip, a {window_kib} KiB window per connection "
          f"(one connection <= {per_conn:.0f} MB/s); ratios against one stream")
    print(f"  {'':<32} {'GET':>8} {'PUT':>8}   GET/1    PUT/1")
    out = {}
    try:
        for n in streams:
            out[n] = (b.rate(b.ours("get", url, n)), b.rate(b.ours("put", url, n)))
            row(f"ours, {n} stream{'s' * (n > 1)}", *out[n], base=out[streams[0]] if n != streams[0] else None)
    finally:
        relay.close()
    return out


def plan_seconds(params):
    """fedmom_server.py plan's central seconds of a round, in memory, two int4 sites, int4 down."""
    out = subprocess.run([sys.executable, os.path.join(ROOT, "fedmom_server.py"), "plan", "--params", str(params),
                          "--sites", "2", "--down-wire", "int4", "--json"], capture_output=True, text=True)
    try:
        return json.loads(out.stdout)["round_s"]["in_memory"]
    except (ValueError, KeyError, TypeError):
        return None


def projection(window, streams):
    """One round's transfer seconds on a 10 Gbit/s link at 8B and 32B."""
    one, many = window[streams[0]], window[max(streams)]
    gain = min(many[0] / one[0], many[1] / one[1])        # what N streams bought on the window path
    stream_bps = WAN_WINDOW / WAN_RTT_S                    # one connection's ceiling on a 30 ms, 4 MiB path
    print(f"\n4. one round's transfers on a 10 Gbit/s link, 30 ms RTT, 4 MiB window per connection: two int4 sites,"
          f" each sends its delta (0.52 B/param) and takes the update (0.52 B/param); the VM's link carries both"
          f" sites' bytes, each connection carries <= {stream_bps / 1e6:.0f} MB/s, {max(streams)} streams carry"
          f" {gain:.1f} x one (measured in table 3)")
    print(f"  {'model':<6} {'bytes/round':>12} {'1 stream s':>11} {f'{max(streams)} streams s':>12} {'line rate s':>11}"
          f" {'plan central s':>15}")
    for name, params in (("8B", 8.02e9), ("32B", 32.55e9)):
        per_site = 2 * 0.52 * params                      # one delta up, one update down
        total = 2 * per_site
        line = total / LINK_BYTES_S
        one_s = max(per_site / stream_bps, line)           # each site's one connection, the sites in parallel
        many_s = max(per_site / (stream_bps * gain), line)
        central = plan_seconds(params)
        print(f"  {name:<6} {total / 1e9:>10.1f} GB {one_s:>11.1f} {many_s:>12.1f} {line:>11.1f}"
              f" {central if central is not None else float('nan'):>15.1f}")


def main(a):
    if a.role == "client":
        return client(*a.args)
    streams = a.streams
    tmp = tempfile.mkdtemp(prefix="wanpath-", dir=a.dir)
    b = squid = None
    try:
        b = Bench(tmp, a.size_mib << 20)
        squid = netpeers.Squid(ssl_ports=(443, b.port)).start()
        print(f"wan_path: {a.size_mib} MiB blob, TLS, token, blobstore.py at {b.url}; {os.cpu_count()} cores")
        loop = loopback_table(b, streams, squid)
        window = window_table(b, streams, a.rtt_ms, a.window_kib)
        projection(window, streams)
        one = loop["ours1"]
        print(f"\ntargets: one stream >= 0.8 x curl: GET {one[0] / loop['curl'][0]:.2f}, PUT {one[1] / loop['curl'][1]:.2f};"
              f" via Squid >= 0.8 x direct: GET {loop['squid1'][0] / one[0]:.2f}, PUT {loop['squid1'][1] / one[1]:.2f};"
              f" {max(streams)} streams >= 6 x one on the window path: GET {window[max(streams)][0] / window[streams[0]][0]:.2f},"
              f" PUT {window[max(streams)][1] / window[streams[0]][1]:.2f}")
    finally:
        if squid:
            squid.stop()
        if b:
            b.close()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--size-mib", type=int, default=1024, help="the blob's size, MiB (default 1024)")
    p.add_argument("--quick", action="store_true", help="256 MiB and a 512 KiB window: make bench's setting")
    p.add_argument("--streams", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4, 8],
                   help="stream counts to measure, comma-separated, the first the baseline (default 1,2,4,8)")
    p.add_argument("--rtt-ms", type=float, default=30.0, help="the long path's round trip, ms (default 30)")
    p.add_argument("--window-kib", type=int, default=512,
                   help="the long path's window per connection, KiB (default 512: a 4 MiB window's 140 MB/s a "
                        "connection times 8 is more than this relay and TLS move on 2 cores; the ratio is the point)")
    p.add_argument("--dir", default=None, help="where the temporary files go (default $TMPDIR or /tmp)")
    p.add_argument("--role", default="main", choices=["main", "client"], help=argparse.SUPPRESS)
    p.add_argument("args", nargs="*", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.quick:
        a.size_mib = 256
    main(a)
