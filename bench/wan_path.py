"""bench/wan_path.py - the path a site's blobs take to the central VM: our client against
curl on the same server, one stream against N, direct and through a real Squid, and on a
path that limits each connection the way a long WAN path does. Not a test.

Runs on: this machine (Debian's squid and nginx: `make netpeers`; curl). Binds 127.0.0.1 only.
    .venv/bin/python bench/wan_path.py                 # 1 GiB, every table (~10 min on 2 cores)
    .venv/bin/python bench/wan_path.py --quick         # 256 MiB, what `make bench` runs
    .venv/bin/python bench/wan_path.py --size-mib 2048 --streams 1,4,8 --window-kib 4096

Measured in the same run, each arm in a client process of its own against the blob store of
`central.sh start` (TLS, the token, the front; the arms run one after another; MB/s = 1e6 B/s):
  curl          `curl --cacert` GET into /dev/null and PUT (-T) of the same file
  ours N        blob_client.get_file / put_file with N ranged streams (get_file: temp file,
                sha256 over the whole file, fsync, rename; put_file: sha256 given, as the
                sites pass it)
  the front     the same through nginx on one port (https://HOST/blob), as the sites reach it
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
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests"), HERE]  # tests/: central.sh's services and Squid, as the tests start them

import blob_client  # noqa: E402
import fixtures  # noqa: E402
import httpc  # noqa: E402
import wan_relay  # noqa: E402
from test_front import Central  # noqa: E402

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
    token, ca = os.environ["BENCH_TOKEN"], os.environ["BENCH_CA"]
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
    """The central services as central.sh starts them (a temporary state dir, ports of its own,
    TLS, the token, the front on one port); the source file put once by curl."""

    def __init__(self, tmp, size, repeat=1):
        self.tmp, self.size, self.repeat = tmp, size, repeat
        self.src = os.path.join(tmp, "src")
        self.sha = make_file(self.src, size)
        self.central = Central()
        self.central.start()
        self.token, self.ca = self.central.token, self.central.ca
        self.url, self.front = self.central.direct("blob"), self.central.front("blob")
        self.port = int(self.url.rsplit(":", 1)[1])
        self.n = 0
        self.curl("put", self.url, "src")        # the blob every GET arm reads

    def close(self):
        self.central.close()

    def _env(self, proxy):
        env = {**os.environ, "BENCH_CA": self.ca, "BENCH_TOKEN": self.token, "PWW_PROXY": proxy or "none"}
        for k in ("https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY", "no_proxy", "NO_PROXY"):
            env.pop(k, None)
        if proxy:
            env["https_proxy"] = proxy
        return env

    def delete(self, url, blob_id):
        httpc.call(url, "DELETE", f"/blobs/{blob_id}", token=self.token, ca_file=self.ca)

    def curl(self, op, url, blob_id, proxy=None):
        """curl's seconds for a GET into /dev/null or a PUT of the source file (as a new blob,
        deleted after; blob_id "src" is the first, the one every GET reads)."""
        if op == "put" and blob_id != "src":
            self.n += 1
            blob_id = f"curl-{self.n}"
        cmd = ["curl", "-sS", "--fail", "--cacert", self.ca, "-H", f"Authorization: Bearer {self.token}",
               "-w", "%{time_total}", f"{url}/blobs/{blob_id}"]
        cmd += ["-o", "/dev/null"] if op == "get" else ["-o", "/dev/null", "-T", self.src,
                                                       "-H", f"X-Content-Sha256: {self.sha}"]
        cmd += ["--proxy", proxy] if proxy else ["--noproxy", "*"]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=self._env(None))
        if op == "put" and blob_id != "src":
            self.delete(self.url, blob_id)
        return float(out.stdout.strip())

    def curl_file(self, url):
        """curl's GET into a file, then the file's sha256 and fsync: the work get_file does."""
        path = os.path.join(self.tmp, "curl-back")
        t0 = time.perf_counter()
        subprocess.run(["curl", "-sS", "--fail", "--noproxy", "*", "--cacert", self.ca, "-H",
                        f"Authorization: Bearer {self.token}", "-o", path, f"{url}/blobs/src"], check=True, env=self._env(None))
        sha = subprocess.run(["sha256sum", path], capture_output=True, text=True, check=True).stdout.split()[0]
        with open(path, "rb") as f:
            os.fsync(f.fileno())
        took = time.perf_counter() - t0
        os.unlink(path)
        assert sha == self.sha
        return took

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

    def rate(self, arm):
        """MB/s of arm() (seconds), the best of --repeat runs: the machine is shared and noisy."""
        return max(self.size / arm() / 1e6 for _ in range(self.repeat))


# ---------------------------------------------------------------- the tables

def row(label, get_mbs, put_mbs, base=None):
    ratio = "" if base is None else f"   {get_mbs / base[0]:>5.2f} x {put_mbs / base[1]:>5.2f} x"
    print(f"  {label:<32} {get_mbs:>8.0f} {put_mbs:>8.0f}{ratio}")


def loopback_table(b, streams, squid):
    print(f"\n1. {b.size / 2**30:g} GiB over TLS on loopback (MB/s, best of {b.repeat}; ratios against curl on the same server)")
    print(f"  {'':<32} {'GET':>8} {'PUT':>8}   GET/curl PUT/curl")
    curl = (b.rate(lambda: b.curl("get", b.url, "src")), b.rate(lambda: b.curl("put", b.url, "curl-put")))
    row("curl (GET into /dev/null)", *curl)
    same = b.rate(lambda: b.curl_file(b.url))
    print(f"  {'curl GET into a file + sha256sum':<32} {same:>8.0f}        -   (the work get_file does: {same / curl[0]:.2f} x curl's GET)")
    out = {"curl": curl, "curl_file": same}
    for n in streams:
        ours = (b.rate(lambda: b.ours("get", b.url, n)), b.rate(lambda: b.ours("put", b.url, n)))
        row(f"ours, {n} stream{'s' * (n > 1)}", *ours, base=curl)
        out[f"ours{n}"] = ours
    print(f"  through the front ({b.front}: nginx, one more TLS hop; ratios against the same client direct)")
    fc = (b.rate(lambda: b.curl("get", b.front, "src")), b.rate(lambda: b.curl("put", b.front, "curl-put")))
    row("curl via the front", *fc, base=curl)
    for n in (1, max(streams)):
        via = (b.rate(lambda: b.ours("get", b.front, n)), b.rate(lambda: b.ours("put", b.front, n)))
        row(f"ours via the front, {n} stream{'s' * (n > 1)}", *via, base=out[f"ours{n}"])
    proxy = f"http://127.0.0.1:{squid.port}"
    print(f"\n2. the same through a real Squid ({proxy}; ratios against our client direct)")
    sc = (b.rate(lambda: b.curl("get", b.url, "src", proxy)), b.rate(lambda: b.curl("put", b.url, "curl-put", proxy)))
    row("curl via Squid", *sc, base=curl)
    for n in (1, max(streams)):
        via = (b.rate(lambda: b.ours("get", b.url, n, proxy)), b.rate(lambda: b.ours("put", b.url, n, proxy)))
        row(f"ours via Squid, {n} stream{'s' * (n > 1)}", *via, base=out[f"ours{n}"])
        out[f"squid{n}"] = via
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
            out[n] = (b.rate(lambda: b.ours("get", url, n)), b.rate(lambda: b.ours("put", url, n)))
            row(f"ours, {n} stream{'s' * (n > 1)}", *out[n], base=out[streams[0]] if n != streams[0] else None)
    finally:
        relay.close()
    return out


def plan_seconds(params):
    """fedmom_server.py plan's central seconds of a round, in memory, two int4 sites, int4 down."""
    out = subprocess.run([sys.executable, os.path.join(ROOT, "fedmom_server.py"), "plan", "--params", str(params),
                          "--sites", "2", "--wire", "int4", "--down-wire", "int4"], capture_output=True, text=True)
    for line in out.stdout.splitlines():              # "  all in memory  96.24 GB  14.4  23.7  0.0  8.3  46.4"
        if line.strip().startswith("all in memory") and "GB" in line:
            return float(line.split()[-1])
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
        b = Bench(tmp, a.size_mib << 20, a.repeat)
        squid = fixtures.LoopbackSquid(ssl_ports=(443, b.port)).start()
        print(f"wan_path: {a.size_mib} MiB blob, TLS, token, central.sh's blob store at {b.url}; {os.cpu_count()} cores")
        loop = loopback_table(b, streams, squid)
        window = window_table(b, streams, a.rtt_ms, a.window_kib)
        projection(window, streams)
        one = loop["ours1"]
        print(f"\ntargets: one stream >= 0.8 x curl: GET {one[0] / loop['curl'][0]:.2f} (against curl doing get_file's work,"
              f" into a file with its sha256: {one[0] / loop['curl_file']:.2f}), PUT {one[1] / loop['curl'][1]:.2f};"
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
    p.add_argument("--repeat", type=int, default=2, help="runs of each arm; the best is printed (default 2; "
                                                         "--quick: 1)")
    p.add_argument("--rtt-ms", type=float, default=30.0, help="the long path's round trip, ms (default 30)")
    p.add_argument("--window-kib", type=int, default=512,
                   help="the long path's window per connection, KiB (default 512: a 4 MiB window's 140 MB/s a "
                        "connection times 8 is more than this relay and TLS move on 2 cores; the ratio is the point)")
    p.add_argument("--dir", default=None, help="where the temporary files go (default $TMPDIR or /tmp)")
    p.add_argument("--role", default="main", choices=["main", "client"], help=argparse.SUPPRESS)
    p.add_argument("args", nargs="*", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.quick:
        a.size_mib, a.repeat = 256, 1
    main(a)
