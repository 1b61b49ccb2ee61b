"""bench/credentials.py - per-site credentials: the cross-site probe, how fast a revocation
takes effect, and what a credential costs per request.

Runs on: any machine with Python 3 (stdlib only); CPU, loopback network.
    python bench/credentials.py [--requests 2000]

Starts darl_server.py, blobstore.py and fedmom_server.py as processes, as central.sh does
(--token-file, --credentials, DARL's own aggregator token), with sites lumi (lumi, lumi-b),
snellius and cscs (httpd.py site add), and prints, measured in the same run:
  1. the probe: every route of the three servers' route tables that names a cluster, plus
     the operator routes and other sites' blobs, tried with each site's credential acting as
     the other sites and as an unknown cluster: requests tried, not refused (target 0).
  2. revocation: `httpd.py site revoke cscs` while cscs and snellius call all three servers in
     a loop; the seconds from the command's start to each server's first 403 to cscs (target
     <= 5 s), snellius's failed calls meanwhile (target 0), restarts (0); beside the baseline,
     today's answer to a leaked shared token: a new token and a restart of the three services
     (SIGTERM, start, /health), measured here on the same servers.
  3. the cost: the same POST /heartbeat at DARL with a site credential and with the shared
     token, alternating, keep-alive: median microseconds and their ratio.
This is a measurement, not a test (tests/test_credentials.py asserts the behaviour).
"""
import argparse
import http.client
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)      # run as `python bench/credentials.py`: the siblings live one level up

import blobstore  # noqa: E402
import block_space  # noqa: E402
import darl_server  # noqa: E402
import fedmom_server  # noqa: E402
import fedmom_state  # noqa: E402
import httpc  # noqa: E402
import tensorio  # noqa: E402
from testbed.harness import listening_url  # noqa: E402

SITES = {"lumi": ["lumi", "lumi-b"], "snellius": ["snellius"], "cscs": ["cscs"]}


class Central:
    def __init__(self, d):
        self.d, self.procs, self.urls = d, {}, {}
        self.creds = os.path.join(d, "credentials.json")
        for name in ("token", "agg-token"):
            with open(os.path.join(d, name), "w") as f:
                f.write(os.urandom(16).hex() + "\n")
        self.shared = httpc.load_token(os.path.join(d, "token"))
        for site, clusters in SITES.items():
            self.site("add", site, "--clusters", ",".join(clusters), "--out", os.path.join(d, "sites"))
        self.tokens = {s: httpc.load_token(os.path.join(d, "sites", f"{s}.token")) for s in SITES}
        self.init = os.path.join(d, "init.safetensors")
        with tensorio.TensorWriter(self.init, [("w", "F32", (4,))]) as w:
            import numpy as np
            w.write("w", np.zeros(4, np.float32))
        common = ["--token-file", os.path.join(d, "token"), "--credentials", self.creds]
        self.cmds = {"darl": ["darl_server.py", "--num-samples", "100", "--state-dir", os.path.join(d, "darl"),
                              "--aggregator-token-file", os.path.join(d, "agg-token"), *common],
                     "blob": ["blobstore.py", "--root", os.path.join(d, "blob"), *common]}
        for name in ("darl", "blob"):
            self.start(name, "0")
        self.cmds["fedmom"] = ["fedmom_server.py", "--state-dir", os.path.join(d, "fedmom"), "--init", self.init,
                               "--darl", self.urls["darl"], "--darl-token-file", os.path.join(d, "agg-token"),
                               "--blob-url", self.urls["blob"], "--member-timeout-s", "600", *common]
        self.start("fedmom", "0")

    def site(self, *args):
        subprocess.run([sys.executable, "httpd.py", "site", "--file", self.creds, *args], cwd=ROOT, check=True,
                       capture_output=True, text=True)

    def start(self, name, port):
        env = {k: v for k, v in os.environ.items() if not k.startswith("PWW_")}
        p = subprocess.Popen([sys.executable, *self.cmds[name], "--port", port], cwd=ROOT, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.procs[name] = p
        self.urls[name] = listening_url(p, timeout=120)[0]

    def restart_all(self):
        """Today's revocation of a leaked shared token: all three stopped and started again."""
        t0 = time.perf_counter()
        for name in ("fedmom", "darl", "blob"):
            self.procs[name].terminate()
            self.procs[name].wait(60)
        for name in ("darl", "blob", "fedmom"):
            self.start(name, self.urls[name].rsplit(":", 1)[1])
            httpc.wait_healthy(self.urls[name], 60)
        return time.perf_counter() - t0

    def close(self):
        for p in self.procs.values():
            p.kill()
            p.wait(30)


class Conn:
    """One keep-alive connection: (status, reply) of a request."""

    def __init__(self, url):
        _, host, port, self.base = httpc.split_url(url)
        self.c = http.client.HTTPConnection(host, port, timeout=30)

    def __call__(self, method, path, token, body=None, headers=None):
        data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
        h = {**httpc.auth_headers(token), **(headers or {}), **({"Content-Length": str(len(data))} if data else {})}
        self.c.request(method, self.base + path, body=data, headers=h)
        r = self.c.getresponse()
        r.read()
        if r.getheader("Connection", "").lower() == "close":
            self.c.close()
        return r.status


def cluster_routes(d):
    """(server, method, path) of every route that names a cluster or is an operator's, from the route tables."""
    coord = darl_server.Coordinator(block_space.BlockSpace(10, 1, 0))
    init = os.path.join(d, "init.safetensors")
    fed = fedmom_state.FedMomState(fedmom_state.ServerConfig(os.path.join(d, "tables"), init).validate())
    store = blobstore.BlobStore(os.path.join(d, "tables-blob"), 1 << 20, 1 << 20)
    names = {"/register", "/acquire", "/heartbeat", "/commit", "/release", "/join", "/leave", "/delta_check",
             "/delta", "/delta_blob", "/blobs/*", "/blobs", *darl_server.CUSTODY_PATHS}
    out = []
    for server, table in (("darl", darl_server.make_routes(coord)), ("fedmom", fedmom_server.make_routes(fed)),
                          ("blob", blobstore.make_routes(store))):
        out += [(server, m, p) for m, p in sorted(table) if p in names]
    return out + [("blob", "GET", "/status")]


def probe(c, d):
    """Each site's credential acting as every other cluster (and one no site has) on every such route."""
    tried, accepted = 0, []
    conns = {s: Conn(c.urls[s]) for s in c.urls}
    for site, clusters in SITES.items():
        others = [x for s, cl in SITES.items() if s != site for x in cl] + ["mallory"]
        for other in others:
            meta = {"cluster": other, "incarnation": "probe", "digest": "d", "lease": 1, "leases": [], "base_round": 0,
                    "tokens": 1, "blob": f"delta.{other}.x", "sha256": "0" * 64, "aggregator": "a", "epoch": 1,
                    "delta": "x", "last_epoch": 0, "claim": "c", "reason": "r"}
            for server, method, path in cluster_routes(d):
                for blob in ((f"delta.{other}.r0", f"check.{other}.x", f"delta-{other}-r0")
                             if path == "/blobs/*" else (None,)):
                    p = path.replace("/*", f"/{blob}")
                    body = b"abc" if method == "PUT" and blob else (meta if method == "POST" else None)
                    headers = {"X-Content-Sha256": "0" * 64, "X-Delta-Meta": json.dumps(meta)}
                    status = conns[server](method, p, c.tokens[site], body, headers)
                    tried += 1
                    if status not in (401, 403):    # a 404 or 400 would mean the route went past the check
                        accepted.append(f"{site} as {other}: {server} {method} {p} -> {status}")
    return tried, accepted


def revocation(c):
    """Seconds from `site revoke cscs` to each server's first 403 to cscs; snellius's failures meanwhile."""
    first, fails, calls, stop = {}, [], [0], threading.Event()
    probes = {"darl": ("POST", "/heartbeat", {"incarnation": "i"}), "fedmom": ("POST", "/heartbeat", {"incarnation": "i"}),
              "blob": ("HEAD", "/blobs/delta.{c}.x", None)}

    def loop(site, cluster, server, t0_box):
        conn = Conn(c.urls[server])
        method, path, body = probes[server]
        body = None if body is None else {**body, "cluster": cluster}
        while not stop.is_set():
            status = conn(method, path.format(c=cluster), c.tokens[site], body)
            calls[0] += 1
            if site == "cscs" and status == 403 and server not in first and t0_box:
                first[server] = time.perf_counter() - t0_box[0]
            if site == "snellius" and status in (401, 403):
                fails.append((server, status))
            time.sleep(0.005)

    t0_box = []
    threads = [threading.Thread(target=loop, args=(s, s, srv, t0_box), daemon=True)
               for s in ("cscs", "snellius") for srv in probes]
    for t in threads:
        t.start()
    time.sleep(1.0)
    t0_box.append(time.perf_counter())
    c.site("revoke", "cscs")
    cli_s = time.perf_counter() - t0_box[0]
    deadline = time.perf_counter() + 30
    while len(first) < 3 and time.perf_counter() < deadline:
        time.sleep(0.01)
    time.sleep(1.0)
    stop.set()
    for t in threads:
        t.join(30)
    return first, cli_s, fails, calls[0]


def cost(c, n):
    """Median microseconds of POST /heartbeat at DARL, a site credential against the shared token."""
    conn = Conn(c.urls["darl"])
    body = {"cluster": "snellius", "incarnation": "cost"}
    times = {"site": [], "shared": []}
    for i in range(2 * n):
        which = "site" if i % 2 else "shared"
        t0 = time.perf_counter()
        conn("POST", "/heartbeat", c.tokens["snellius"] if which == "site" else c.shared, body)
        times[which].append(time.perf_counter() - t0)
    return {k: statistics.median(v) * 1e6 for k, v in times.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=2000, help="heartbeats per arm of the cost (default 2000)")
    a = ap.parse_args()
    d = tempfile.mkdtemp(prefix="bench-credentials-")
    c = Central(d)
    try:
        tried, accepted = probe(c, d)
        print(f"probe: {tried} requests, each site's credential acting as another site's cluster (or one no "
              f"site has) on every route that names a cluster, the operator routes and other sites' blobs: "
              f"not refused (401/403) {len(accepted)} (target 0)")
        for line in accepted[:10]:
            print(f"  ACCEPTED {line}")
        pids = [p.pid for p in c.procs.values()]
        first, cli_s, fails, calls = revocation(c)
        same = pids == [p.pid for p in c.procs.values()]
        print(f"revocation: `httpd.py site revoke cscs` took {cli_s:.2f} s; first 403 to cscs after "
              + ", ".join(f"{s} {first[s]:.2f} s" if s in first else f"{s} NEVER" for s in ("darl", "fedmom", "blob"))
              + f" (target <= 5 s; the slowest {max(first.values(), default=float('nan')):.2f} s); snellius refused "
              f"{len(fails)} of its calls meanwhile (target 0); {calls} calls in all; restarts {0 if same else 'SOME'}")
        us = cost(c, a.requests)
        print(f"cost: POST /heartbeat at DARL, median {us['site']:.0f} us with a site credential, {us['shared']:.0f} us "
              f"with the shared token: {us['site'] / us['shared']:.2f}x")
        base = c.restart_all()
        print(f"baseline: a new shared token means restarting the three services: {base:.2f} s here (SIGTERM, start, "
              f"/health), with every site refused until it has the new token; revocation above is "
              f"{max(first.values(), default=float('nan')) / base:.2f}x of that, no restart, the other sites untouched")
        return 0 if not accepted and len(first) == 3 and not fails else 1
    finally:
        c.close()
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
