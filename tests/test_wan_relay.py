"""bench/wan_relay.py: the WAN-shaped loopback link the benches put between sites and the
central services. Bytes arrive intact and counted per direction; the cap and the latency
are lower bounds on the time a transfer takes (a loaded machine can only be slower)."""
import hashlib
import os
import socket
import sys
import threading
import time
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.append(os.path.join(ROOT, "bench"))

import wan_relay  # noqa: E402


class EchoServer:
    """Answers each connection with the sha256 of what it received, then the bytes back."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.conns = []
        threading.Thread(target=self.serve, daemon=True).start()

    def close(self):
        self.sock.close()
        for conn in self.conns:
            conn.close()

    def serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)
            with conn:
                data = b""
                while chunk := conn.recv(1 << 16):
                    data += chunk
                conn.sendall(hashlib.sha256(data).digest() + data)


def exchange(port, payload):
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(payload)
        s.shutdown(socket.SHUT_WR)
        out = b""
        while chunk := s.recv(1 << 16):
            out += chunk
    return out


class RelayTest(unittest.TestCase):
    def setUp(self):
        self.echo = EchoServer()
        self.addCleanup(self.echo.close)

    def relay(self, mbit_s, latency_ms):
        r = wan_relay.Link(("127.0.0.1", self.echo.port), mbit_s, latency_ms).start()
        self.addCleanup(r.close)
        return r

    def test_bytes_cross_intact_and_counted_each_way(self):
        r = self.relay(1000, 0)
        payload = os.urandom(3 << 20)
        out = exchange(r.port, payload)
        self.assertEqual(out[:32], hashlib.sha256(payload).digest())
        self.assertEqual(out[32:], payload)
        self.assertEqual(r.stats(), {"up_bytes": len(payload), "down_bytes": len(payload) + 32})

    def test_the_cap_and_the_latency_bound_the_time(self):
        r = self.relay(8, 200)                     # 8 Mbit/s = 1 MB/s each way, 200 ms one way
        payload = os.urandom(1 << 19)              # 0.5 MiB up, the same back: >= 2 x 0.52 s + 2 x 0.2 s
        t0 = time.monotonic()
        out = exchange(r.port, payload)
        took = time.monotonic() - t0
        self.assertEqual(out[32:], payload)
        self.assertGreaterEqual(took, 2 * len(payload) / 1e6 + 2 * 0.2)

    def test_a_window_bounds_each_connection(self):
        """window_kib: a connection moves at most one window per round trip, so 8 windows take
        >= 7 round trips each way; four connections at once each keep that bound (a lower
        bound on time only: a loaded machine can be slower) and arrive intact."""
        r = wan_relay.Link(("127.0.0.1", self.echo.port), None, 50, window_kib=64).start()
        self.addCleanup(r.close)
        payload = os.urandom(8 * 64 << 10)                   # 8 windows up, 8 (+32 B) back
        outs = [None] * 4
        def one(i):
            t0 = time.monotonic()
            outs[i] = (exchange(r.port, payload), time.monotonic() - t0)
        threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for out, took in outs:
            self.assertEqual(out[32:], payload)
            self.assertGreaterEqual(took, 2 * 7 * 0.1)      # >= 7 round trips of 100 ms each way
        self.assertEqual(r.stats()["up_bytes"], 4 * len(payload))


if __name__ == "__main__":
    unittest.main()
