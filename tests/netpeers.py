"""tests/netpeers.py - real network peers for the tests and benches: an instance of Debian's
Squid of our own (`make netpeers` installs it), on a port and in a directory of our own, never
the system's. Not a part of the run.

    squid = netpeers.Squid(ssl_ports=(443,)).start()     # 127.0.0.1:<squid.port>
    ... https_proxy=http://127.0.0.1:<squid.port> ...
    squid.connects()        # CONNECT tunnels its access log recorded
    squid.stop()

The configuration is Squid's stock access rules, trimmed to what a site proxy keeps: CONNECT
only to `ssl_ports` (stock: 443), requests only from `allow` (stock: localnet/localhost).
"""
import os
import shutil
import socket
import subprocess
import tempfile
import time

SQUID = shutil.which("squid") or "/usr/sbin/squid"


def free_port(host="127.0.0.1"):
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class Squid:
    def __init__(self, ssl_ports=(443,), host="127.0.0.1", port=None, allow=("127.0.0.0/8",), extra=()):
        self.dir, self.host, self.port = None, host, port or free_port(host)
        self.ssl_ports, self.allow, self.extra = ssl_ports, allow, extra
        self.proc = None

    def config(self):
        d = self.dir
        return "\n".join([
            f"http_port {self.host}:{self.port}",
            f"acl SSL_ports port {' '.join(str(p) for p in self.ssl_ports)}",
            "acl CONNECT method CONNECT",
            f"acl clients src {' '.join(self.allow)}",
            *self.extra,
            "http_access deny CONNECT !SSL_ports",   # the stock rule a site proxy keeps
            "http_access allow clients",
            "http_access deny all",
            f"pid_filename {d}/squid.pid", f"access_log stdio:{d}/access.log", f"cache_log {d}/cache.log",
            "cache deny all", "cache_mem 8 MB", f"coredump_dir {d}", "shutdown_lifetime 0 seconds",
            "logfile_rotate 0", "cache_store_log none",
            ""])

    def start(self, timeout_s=60.0):
        # a directory of its own in /tmp, open to the user Squid drops to (proxy) when started as
        # root: a test's own temporary directory (mode 700) would refuse it its logs
        self.dir = tempfile.mkdtemp(prefix="pww-squid-")
        os.chmod(self.dir, 0o777)
        conf = os.path.join(self.dir, "squid.conf")
        with open(conf, "w") as f:
            f.write(self.config())
        self.proc = subprocess.Popen([SQUID, "-N", "-f", conf], stdout=subprocess.DEVNULL,
                                     stderr=open(os.path.join(self.dir, "stderr.log"), "wb"))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"squid exited {self.proc.returncode}: {self.log()}")
            try:
                socket.create_connection((self.host, self.port), timeout=1).close()
                return self
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"squid did not listen on {self.host}:{self.port} in {timeout_s:g} s: {self.log()}")

    def log(self):
        out = []
        for name in ("stderr.log", "cache.log"):
            try:
                with open(os.path.join(self.dir, name), errors="replace") as f:
                    out.append(f.read()[-1500:])
            except OSError:
                pass
        return " | ".join(out)

    def access_log(self):
        try:
            with open(os.path.join(self.dir, "access.log")) as f:
                return f.read()
        except OSError:
            return ""

    def connects(self):
        return sum(" CONNECT " in line for line in self.access_log().splitlines())

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)
