"""tests/fixtures.py - what several test modules share, in one place: test modules import
this (and testbed/harness.py: processes, ports, services), never each other. Not a test module
(tests/run.py collects tests/test_*.py only); nothing here runs at import, and torch is
imported only by the helpers that need it.

    FedMomFixture     a temp dir with an initial model and an aggregator state to drive
                      through rounds (test_fedmom, test_custody, test_audit, test_chaos)
    SHAPES, FakeClock, write_tensors, widened, read_all   its parts
    serve_in_thread   an httpd server for a route table, in a thread, stopped at cleanup
    TmpDirTest        a temp dir per test, self.p(name), write_all, assert_no_leftovers
    hard_values       float32 over the whole range, for the wire codecs
    spawn             fn on N processes in one gloo group (torch), killed at a deadline
    ProxyNet, NsProcs a compute node, a site proxy host and the central VM in network
                      namespaces, and processes started in them (test_proxy, test_wan_path)
"""
import os
import pathlib
import sys
import re
import secrets
import shutil
import stat
import subprocess
import tempfile
import threading
import time
import unittest

import numpy as np

import fedmom_merge
import fedmom_state as fs
import httpd
import tensorio
from testbed import harness

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# one tensor bigger than fedmom_merge.CHUNK, so the chunk loop runs more than once
SHAPES = {"embed": (300, 1000), "layer.w": (64, 48), "layer.b": (48,), "norm": (7,)}
SPAWN_DEADLINE_S = 600      # a whole spawned group: generous on 2 loaded cores, but a hang ends


# ---------------------------------------------------------------- the aggregator's state

def widened(arrays, dtype):
    """What the server sees of a delta written in `dtype`, as float64."""
    out = {}
    for k, a in arrays.items():
        if dtype == "BF16":
            out[k] = tensorio.bf16_to_f32(tensorio.f32_to_bf16(a)).astype(np.float64)
        else:
            out[k] = a.astype(tensorio.DTYPES[dtype]).astype(np.float64)
    return out


def write_tensors(path, arrays, dtype):
    with tensorio.TensorWriter(path, [(k, dtype, a.shape) for k, a in arrays.items()], fsync=False) as w:
        for k, a in arrays.items():
            w.write(k, a)


def read_all(path):
    with tensorio.TensorReader(path) as r:
        return {k: r.read(k, as_float32=True).astype(np.float64) for k in r.names}


class FakeClock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


class FedMomFixture(unittest.TestCase):
    """A temp dir with an init model; helpers to run a state through rounds."""

    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="fedmom-")
        self.addCleanup(shutil.rmtree, self.dir, True)
        self.rng = np.random.default_rng(1)
        self.theta0 = {k: self.rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
        self.init = os.path.join(self.dir, "init.safetensors")
        write_tensors(self.init, self.theta0, "BF16")       # init in bf16: theta_global is still fp32
        self.theta0 = widened(self.theta0, "BF16")
        self.clock = FakeClock()

    def state(self, **kw):
        cfg = fs.ServerConfig(os.path.join(self.dir, "st"), init=kw.pop("init", self.init), **kw)
        return fs.FedMomState(cfg.validate(), clock=self.clock, darl=kw.get("darl"))

    def delta(self, dtype="F16", scale=0.01, names=None, shapes=None):
        shapes = shapes or SHAPES
        arrays = {k: (scale * self.rng.standard_normal(s)).astype(np.float32) for k, s in shapes.items()
                  if names is None or k in names}
        path = os.path.join(self.dir, f"delta-{self.rng.integers(1 << 40)}.safetensors")
        write_tensors(path, arrays, dtype)
        return path, widened(arrays, dtype)

    def send(self, st, cluster, path, tokens, base_round=None, **meta):
        m = st.check_delta_meta({"cluster": cluster, "incarnation": f"{cluster}-inc", "tokens": tokens,
                                 "base_round": st.round if base_round is None else base_round, **meta})
        part = st.spool.part()                              # as PUT /delta: metadata first, then the body
        shutil.copyfile(path, part)
        return st.accept_delta(m, part)

    def theta(self, st):
        return read_all(os.path.join(st.dir, st.theta_file))

    def snapshot(self, st):
        """Every file under the state dir with its bytes: 'nothing on disk changed' is this, equal."""
        out = {}
        for base, _, files in os.walk(st.dir):
            for fn in files:
                with open(os.path.join(base, fn), "rb") as f:
                    out[os.path.relpath(os.path.join(base, fn), st.dir)] = f.read()
        return out


# ---------------------------------------------------------------- servers in a thread

def serve_in_thread(test, routes, **kw):
    """httpd.make_server(routes, **kw) on 127.0.0.1, served by a thread, stopped at `test`'s
    cleanup -> its URL."""
    server = httpd.make_server(routes, **kw)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    test.addCleanup(server.server_close)
    test.addCleanup(server.shutdown)
    return server.url


# ---------------------------------------------------------------- files and values

class TmpDirTest(unittest.TestCase):
    def setUp(self):
        self._tmp = tempfile.TemporaryDirectory()
        self.addCleanup(self._tmp.cleanup)
        self.dir = self._tmp.name

    def p(self, name):
        return os.path.join(self.dir, name)

    def write_all(self, path, arrays, dtypes, metadata=None):
        """A tensor file of `arrays`, each in dtypes[name]."""
        specs = [(n, dtypes[n], a.shape) for n, a in arrays.items()]
        with tensorio.TensorWriter(path, specs, metadata) as w:
            for n, a in arrays.items():
                w.write(n, a)

    def assert_no_leftovers(self, keep=()):
        self.assertEqual(sorted(set(os.listdir(self.dir)) - set(keep)), [])


def hard_values(rng, shape):
    """Finite float32 over the whole range: normals, subnormals, zeros of both signs, a zero
    block, and blocks whose largest magnitude is a subnormal or below the bf16 range."""
    x = rng.standard_normal(shape).astype(np.float32)
    flat = x.reshape(-1)
    flat *= (np.float32(10) ** rng.integers(-44, 37, flat.size)).astype(np.float32)
    flat[::7] = 0
    flat[::13] = -0.0
    if flat.size >= 192 and shape[-1] >= 64:
        flat[:64] = 0                                     # a zero block (any block size >= 64)
        flat[64:128] = np.float32(1e-45) * rng.integers(-3, 4, 64)    # amax / L underflows to 0
        flat[128:192] = rng.standard_normal(64).astype(np.float32) * np.float32(1e-40)
    return x


# ---------------------------------------------------------------- process groups (torch)

def spawn(fn, world, tmp, *args, deadline_s=SPAWN_DEADLINE_S):
    """Run fn(rank, world, tmp, *args) on `world` processes joined in one gloo group
    (FileStore under tmp, traffic on the loopback interface only). A group still running
    after deadline_s (a collective that never completes) is killed and the test fails."""
    import torch.multiprocessing as mp
    ctx = mp.start_processes(_entry, args=(fn, world, tmp) + args, nprocs=world, join=False,
                             start_method="spawn")
    end = time.monotonic() + deadline_s
    try:
        while not ctx.join(timeout=1.0):              # raises if a rank failed
            if time.monotonic() > end:
                raise AssertionError(f"{fn.__name__} on {world} ranks still running after {deadline_s} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(30)


def _entry(rank, fn, world, tmp, *args):
    import torch
    import torch.distributed as dist
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    store = os.path.join(tmp, f"store-{fn.__name__}-{world}")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        fn(rank, world, tmp, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def outer_bits(arrays):
    """{name: the float32 bits, flat} of an outer state's arrays (in memory or FileTensors)."""
    return {n: np.ascontiguousarray(fedmom_merge.whole(a), np.float32).reshape(-1).view(np.uint32).copy()
            for n, a in arrays.items()}


def assert_same_outer(test, a, b, names, what):
    """Two outer_state.OuterStates hold the same theta, momentum and residual, bit for bit, and digest."""
    for which in ("theta", "momentum", "residual"):
        x, y = getattr(a, which), getattr(b, which)
        test.assertEqual(x is None, y is None, f"{what}: {which}")
        if x is not None:
            bx, by = outer_bits(x), outer_bits(y)
            for n in names:
                test.assertTrue(np.array_equal(bx[n], by[n]), f"{what}: {which} of {n} differs")
    test.assertEqual(a.digest, b.digest, what)


def checkpoint_and_log(test, shapes, theta, step, codec, rounds=(1, 2, 3)):
    """A checkpoint in segments of 64 KiB (outer_state.SEGMENT_ENV, for the test) of an outer state
    from `theta`, then `rounds` applied with their logged Steps (test.step(rnd, codec)) ->
    (the state after them, the checkpoint, the log as state.json keeps it)."""
    import dataclasses
    import outer_state
    os.environ[outer_state.SEGMENT_ENV] = str(1 << 16)
    test.addCleanup(os.environ.pop, outer_state.SEGMENT_ENV)
    state = outer_state.OuterState(shapes, {n: a.copy() for n, a in theta.items()})
    ckpt = outer_state.write_checkpoint(state, test.dir, None, fsync=False)
    log = []
    for rnd in rounds:
        s = step(rnd, codec)
        outer_state.apply_round(state, s, fsync=False, threads=1)
        s.digest = state.digest
        log.append(dataclasses.replace(s, deltas=[(os.path.relpath(p, test.dir), w) for p, w in s.deltas]))
    return state, ckpt, log


def cut_checkpoint(test, outer, state_dir, last, files):
    """outer_state.write_checkpoint of `outer` over the checkpoint `last`, stopped as by a crash
    right after its `files`-th file is written: a checkpoint cut short."""
    import outer_state

    class Cut(Exception):
        pass
    written = []

    def after():
        written.append(1)
        if len(written) == files:
            raise Cut
    with test.assertRaises(Cut):
        outer_state.write_checkpoint(outer, state_dir, last, fsync=False, after_file=after)


# ---- sites/siteinfo.sh and sites/bootstrap.sh (test_site_tools, slurm_jobs)

def clean_env(**extra):
    """A predictable environment: no PWW_* or Slurm variables from the caller."""
    env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp"), "USER": "tester",
           "LANG": "C.UTF-8"}
    env.update(extra)
    return env


def site_tool_run(argv, env, cwd=ROOT, timeout=180):
    return subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def rows(stdout):
    """siteinfo.sh's lines -> {name: (mark, site value, observed)}."""
    out = {}
    for line in stdout.splitlines():
        m = re.match(r"^(ok|DIFFERS|unknown|info)\s+(.+?)\s+site: (.*?)  observed: (.*)$", line)
        if m:
            out[m.group(2)] = (m.group(1), m.group(3), m.group(4))
    return out


def tree(top):
    """Everything under top, links not followed: {relative path: (kind, link target or mode)}."""
    found = {}
    for dirpath, dirnames, filenames in os.walk(top):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            kind = "link" if stat.S_ISLNK(st.st_mode) else "dir" if stat.S_ISDIR(st.st_mode) else "file"
            found[os.path.relpath(path, top)] = (kind, os.readlink(path) if kind == "link"
                                                 else stat.S_IMODE(st.st_mode), st.st_mtime_ns)
    return found


def temp_checkout(tmp):
    """A checkout of env.sh, sites/ and jobs/ in tmp/checkout (what bootstrap.sh reads)."""
    co = os.path.join(tmp, "checkout")
    for sub in ("sites", "jobs"):
        shutil.copytree(os.path.join(ROOT, sub), os.path.join(co, sub))
    shutil.copy(os.path.join(ROOT, "env.sh"), co)
    return co


def bootstrap_env(tmp, co, **extra):
    env = dict(PWW_SITE="local", PWW_ROOT=co, PWW_SCRATCH=os.path.join(tmp, "scratch"), PWW_VENV=os.path.join(ROOT, ".venv"),
               HOME=os.path.join(tmp, "home"))
    env.update(extra)
    return clean_env(**env)


def has_gpu():
    return (bool(os.path.isdir("/proc/driver/nvidia/gpus") and os.listdir("/proc/driver/nvidia/gpus"))
            or os.path.exists("/dev/kfd") or shutil.which("nvidia-smi") is not None)


def wrong_local_site(tmp):
    """A copy of sites/local.sh whose venv, interconnect and partitions are not this machine's."""
    text = pathlib.Path(ROOT, "sites", "local.sh").read_text()
    for old, new in (('export PWW_VENV=${PWW_VENV:-$PWW_ROOT/.venv}', 'export PWW_VENV=/nonexistent/venv'),
                     ('export PWW_INTERCONNECT=${PWW_INTERCONNECT:-none}', 'export PWW_INTERCONNECT=slingshot'),
                     ('export PWW_PARTITIONS="debug"', 'export PWW_PARTITIONS="debug no_such_partition"')):
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    path = os.path.join(tmp, "local.sh")
    pathlib.Path(path).write_text(text)
    return path


# ---- a site behind its proxy: network namespaces (test_proxy, test_wan_path; root only)

PROXY_VARS = ("https_proxy", "HTTPS_PROXY", "http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY", "no_proxy",
              "NO_PROXY", "PWW_PROXY")


def proxy_free_env(**extra):
    """harness.child_env without any proxy variable of the caller's, plus `extra`."""
    env = {k: v for k, v in harness.child_env().items() if k not in PROXY_VARS}
    env.update(extra)
    return env


def need_root_and(*tools):
    if os.geteuid() != 0:
        raise unittest.SkipTest("needs root (network namespaces); CI runs as root")
    for tool in ("ip", *tools):
        if not shutil.which(tool):
            raise unittest.SkipTest(f"{tool} is missing: make netpeers")


def sh(*cmd, check=True):
    return subprocess.run(cmd, check=check, capture_output=True, text=True)


def in_ns(ns, *cmd):
    return ["ip", "netns", "exec", ns, *cmd]


class ProxyNet:
    """<p>-node (N.1.2) <-> <p>-px (N.1.1 and N.2.1) <-> <p>-vm (N.2.2), N = `net` (two
    octets), each with its own /etc/netns hosts and resolv.conf (nameserver 127.0.0.1: no
    lookup leaves the namespace). The node has no route to N.2.0/24 and the proxy host
    forwards nothing: the node reaches the VM only through a proxy on the proxy host, the
    only one that resolves `vm_name` (and `px_hosts`, lines of its hosts file)."""

    def __init__(self, prefix, net, vm_name, px_hosts=""):
        self.prefix, self.vm_name = prefix, vm_name
        self.node, self.px, self.vm = (f"{prefix}-{x}" for x in ("node", "px", "vm"))
        self.node_ip, self.px_ip, self.px_vm_ip, self.vm_ip = (f"{net}.{x}" for x in ("1.2", "1.1", "2.1", "2.2"))
        self.node_net = f"{net}.1.0/24"
        self.hosts = {self.node: "", self.px: f"{self.vm_ip} {vm_name}\n{px_hosts}", self.vm: ""}

    def remove(self):
        for ns in self.hosts:
            sh("ip", "netns", "del", ns, check=False)
            shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)

    def make(self):
        self.remove()
        p = self.prefix
        for ns, hosts in self.hosts.items():
            sh("ip", "netns", "add", ns)
            os.makedirs(f"/etc/netns/{ns}", exist_ok=True)
            with open(f"/etc/netns/{ns}/hosts", "w") as f:
                f.write("127.0.0.1 localhost\n" + hosts)
            with open(f"/etc/netns/{ns}/resolv.conf", "w") as f:
                f.write("nameserver 127.0.0.1\n")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("ip", "link", "add", f"{p}-n1", "netns", self.node, "type", "veth", "peer", "name", f"{p}-n0", "netns", self.px)
        sh("ip", "link", "add", f"{p}-v1", "netns", self.vm, "type", "veth", "peer", "name", f"{p}-v0", "netns", self.px)
        for ns, dev, addr in ((self.node, f"{p}-n1", self.node_ip), (self.px, f"{p}-n0", self.px_ip),
                              (self.px, f"{p}-v0", self.px_vm_ip), (self.vm, f"{p}-v1", self.vm_ip)):
            sh("ip", "-n", ns, "addr", "add", addr + "/24", "dev", dev)
            sh("ip", "-n", ns, "link", "set", dev, "up")
        sh("ip", "netns", "exec", self.px, "sysctl", "-qw", "net.ipv4.ip_forward=0")   # the proxy host routes nothing


def wait_port(ns, host, port, proc):
    """Until host:port accepts in `ns` (an event: the listener is up), while `proc` lives; 120 s at most."""
    code = (f"import socket, sys, time\nend = time.monotonic() + 2\nwhile True:\n"
            f"    try:\n        socket.create_connection(({host!r}, {port}), 1).close(); break\n"
            f"    except OSError:\n        if time.monotonic() > end: sys.exit(1)\n        time.sleep(0.05)\n")
    for _ in range(60):
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[4:]} exited ({proc.returncode}) before listening on {host}:{port}")
        if subprocess.run(in_ns(ns, sys.executable, "-c", code), timeout=60).returncode == 0:
            return
    raise RuntimeError(f"nothing listens on {host}:{port} in {ns}")


# Squid's stock access rules as a site keeps them (CONNECT to `ssl_ports` only, stock 443), for
# the node's subnet: `port` open, `auth_port` the same with basic auth (user:password in {d}/passwd)
SQUID_CONF = """\
http_port {px}:{port}
http_port {px}:{auth_port}
pid_filename {d}/squid.pid
cache_log {d}/cache.log
access_log stdio:{d}/access.log
coredump_dir {d}
cache deny all
dns_nameservers 127.0.0.1
shutdown_lifetime 0 seconds
visible_hostname site-proxy
auth_param basic program /usr/lib/squid/basic_ncsa_auth {d}/passwd
auth_param basic children 1 startup=1
auth_param basic realm site
acl SSL_ports port {ssl_ports}
acl Safe_ports port 80 21 443 70 210 1025-65535 280 488 591 777
acl CONNECT method CONNECT
acl node src {nodes}
acl authport localport {auth_port}
acl authed proxy_auth REQUIRED
http_access deny !Safe_ports
http_access deny CONNECT !SSL_ports
http_access allow authport node authed
http_access deny authport
http_access allow node
http_access deny all
"""


def squid_dir(d, net, user, password, port=3128, auth_port=3129, ssl_ports=(443,)):
    """Squid's config, password file and logs in `d` (made open to the user Squid drops to)
    -> the argv that starts it in the foreground. net: .px_ip (where it listens), .node_net
    (who may use it)."""
    os.makedirs(d, exist_ok=True)
    os.chmod(d, 0o777)
    hashed = sh("openssl", "passwd", "-apr1", password).stdout.strip()
    with open(os.path.join(d, "passwd"), "w") as f:
        f.write(f"{user}:{hashed}\n")
    with open(os.path.join(d, "squid.conf"), "w") as f:
        f.write(SQUID_CONF.format(px=net.px_ip, port=port, auth_port=auth_port, d=d, nodes=net.node_net,
                                  ssl_ports=" ".join(str(p) for p in ssl_ports)))
    return ["squid", "-N", "-f", os.path.join(d, "squid.conf")]


class NsProcs:
    """Processes started in network namespaces, each with its output in `dir`/log-N-NAME."""

    def __init__(self, dir, env):
        self.dir, self.env, self.procs = dir, env, []

    def start(self, ns, *cmd):
        with open(os.path.join(self.dir, f"log-{len(self.procs)}-{os.path.basename(cmd[0])}"), "w") as log:
            self.procs.append(subprocess.Popen(in_ns(ns, *cmd), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                               env=self.env))
        return self.procs[-1]

    def stop_all(self):
        for proc in self.procs:                        # ip netns exec execs the command: this is its pid
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def logs(self):
        """The started processes' output, for a failure's message."""
        out = []
        for name in sorted(n for n in os.listdir(self.dir) if n.startswith("log-")):
            with open(os.path.join(self.dir, name), errors="replace") as f:
                out.append(f"--- {name}\n{f.read()[-2000:]}")
        return "\n".join(out)


class LoopbackSquid:
    """A Squid of our own on 127.0.0.1 (SQUID_CONF's rules, CONNECT to `ssl_ports` only), for a
    bench or test without namespaces: start(), .port, stop() (its directory removed)."""

    px_ip, node_net = "127.0.0.1", "127.0.0.0/8"

    def __init__(self, ssl_ports=(443,)):
        self.ssl_ports, self.port, self.proc = ssl_ports, harness.free_port(), None
        # its own directory in /tmp, open to the user Squid drops to (proxy) when started as root
        self.dir = tempfile.mkdtemp(prefix="pww-squid-")

    def start(self):
        argv = squid_dir(self.dir, self, "bench", secrets.token_hex(8), self.port, harness.free_port(), self.ssl_ports)
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if harness.wait_for(lambda: self.proc.poll() is not None or not harness.port_is_free(self.port), 60) \
                is None or self.proc.poll() is not None:
            self.stop()
            raise RuntimeError(f"squid did not listen on 127.0.0.1:{self.port}")
        return self

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)
