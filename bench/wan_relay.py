"""bench/wan_relay.py - a WAN-shaped link on loopback: a TCP relay with a bandwidth cap and
an added one-way latency, for benches and tests (not a part of the run).

Runs on: this machine, in the bench's (or test's) own process, between a site and a
central service; binds 127.0.0.1 on a free port. No state.

    relay = Link(("127.0.0.1", 29511), mbit_s=2.5, latency_ms=50).start()
    url = f"http://127.0.0.1:{relay.port}"       # give this to the site instead of the service's
    ...
    relay.stats()       # {"up_bytes", "down_bytes"}: what crossed, each direction
    relay.close()

Each direction is one link for every connection through the relay (a site's uplink is
shared by its uploads, its downlink by its downloads), serialised at mbit_s: a chunk
read at t leaves at max(t, when the link is free) + its size / rate + latency_ms. One
reader and one writer thread per direction and connection, so the latency delays bytes
without slowing the stream (a chunk in flight does not stop the next one being read).

    relay = Link(target, mbit_s=None, latency_ms=15, window_kib=512).start()   # a long path

window_kib: what limits ONE TCP connection on a long WAN path, its window. Each direction of
each connection may have at most that many bytes in flight: a chunk's bytes count from when
it is read until its acknowledgement would be back (sent at its due time, plus latency_ms
for the return trip), so one connection moves at most window / (2 x latency_ms), and N
connections N times that, however fast the link (mbit_s None: no shared cap).
"""
import collections
import socket
import threading
import time

CHUNK = 64 << 10


class _Direction:
    """One direction's shared link: when it is next free, and the bytes it carried
    (rate_bps None: no cap, only the latency)."""

    def __init__(self, rate_bps, latency_s):
        self.rate, self.latency = rate_bps or float("inf"), latency_s
        self.free_at, self.bytes = 0.0, 0
        self.lock = threading.Lock()

    def due(self, n, now):
        with self.lock:
            start = max(now, self.free_at)
            self.free_at = start + n / self.rate
            self.bytes += n
            return self.free_at + self.latency


class _Window:
    """One direction of one connection: at most `size` bytes in flight. take(n) waits until
    they fit (or nothing is in flight), ack(n, at) frees them at time `at`."""

    def __init__(self, size):
        self.size, self.inflight, self.acks = size, 0, collections.deque()
        self.cond = threading.Condition()

    def take(self, n):
        with self.cond:
            while self.inflight and self.inflight + n > self.size:
                now = time.monotonic()
                while self.acks and self.acks[0][0] <= now:
                    self.inflight -= self.acks.popleft()[1]
                if self.inflight and self.inflight + n > self.size:
                    self.cond.wait(max(0.0, self.acks[0][0] - now) if self.acks else None)
            self.inflight += n

    def ack(self, n, at):
        with self.cond:
            self.acks.append((at, n))
            self.cond.notify()


class Link:
    def __init__(self, target, mbit_s, latency_ms=0.0, host="127.0.0.1", window_kib=None):
        self.target = target
        rate = mbit_s * 1e6 / 8 if mbit_s else None
        self.up, self.down = _Direction(rate, latency_ms / 1e3), _Direction(rate, latency_ms / 1e3)
        self.window = window_kib << 10 if window_kib else None
        self.conns = []                  # every socket the relay opened or accepted, closed by close()
        self.sock = socket.create_server((host, 0))
        self.port = self.sock.getsockname()[1]
        self.closed = False

    def start(self):
        threading.Thread(target=self._accept, name="wan-relay", daemon=True).start()
        return self

    def _accept(self):
        while not self.closed:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            for sock in (client, server):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self.conns.append(sock)
            _pipe(client, server, self.up, self.window and _Window(self.window))
            _pipe(server, client, self.down, self.window and _Window(self.window))

    def stats(self):
        return {"up_bytes": self.up.bytes, "down_bytes": self.down.bytes}

    def close(self):
        self.closed = True
        self.sock.close()
        for sock in self.conns:
            sock.close()


def _pipe(src, dst, link, window=None):
    """src -> dst through `link`: a reader stamps each chunk with its due time, a writer
    sends it then. EOF (or an error) on either side closes both directions' sockets.
    window: this connection's _Window in this direction (None: unlimited)."""
    q, cond = collections.deque(), threading.Condition()

    def read():
        try:
            while chunk := src.recv(CHUNK):
                if window is not None:
                    window.take(len(chunk))
                due = link.due(len(chunk), time.monotonic())
                with cond:
                    q.append((due, chunk))
                    cond.notify()
        except OSError:
            pass
        with cond:
            q.append((0.0, None))
            cond.notify()

    def write():
        try:
            while True:
                with cond:
                    while not q:
                        cond.wait()
                    due, chunk = q.popleft()
                if chunk is None:
                    break
                time.sleep(max(0.0, due - time.monotonic()))
                dst.sendall(chunk)
                if window is not None:
                    window.ack(len(chunk), due + link.latency)
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    threading.Thread(target=read, daemon=True).start()
    threading.Thread(target=write, daemon=True).start()
