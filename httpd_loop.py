"""httpd_loop.py - the connection engine under httpd.py: one epoll poller thread and a pool of
worker threads, with the timeouts and the connection cap.

Runs on: the central VM, inside darl_server.py, fedmom_server.py and blobstore.py (through
httpd.make_server; not started on its own). Python standard library only; no numpy, no torch.

What each connection costs (the server is an epoll loop plus a thread pool, not a thread
per connection):
  - one poller thread accepts, runs TLS handshakes and reads request headers without
    blocking; a request runs on one of --workers threads (default 64) only once its
    headers are complete. An idle keep-alive connection, or a half-open one that sends
    nothing, costs a socket in the epoll set and a few KiB, never a thread.
  - --max-connections (default 4096) open at once; a new connection beyond it closes the
    one that has been idle longest.
  - timeouts: a new connection's first request, and every request's headers (and a JSON
    body), must arrive within --header-timeout-s (10 s) - a slowloris is cut off there; a
    keep-alive connection idle for --idle-timeout-s (60 s) is closed; a streamed body or
    reply that makes no progress for --io-timeout-s (60 s) ends.
  - headers are capped at 64 KiB (431); a plain-HTTP request on a TLS port gets a plain
    400 saying "use https://", a TLS hello on a plain port is hung up on; TCP_NODELAY is
    set on every connection (httpd.py says why).

The HTTP itself (routes, JSON errors, the token, the body's framing) is httpd.py's: a worker
hands a connection whose headers are in to `handler_class(conn, server).serve_ready()`
(httpd.Handler), which reads through a Reader (the bytes the poller already read, then the
socket, under a deadline) and writes through a Writer, and says whether to keep the
connection; a kept one goes back to the poller. This module knows nothing of routes or
tokens.

    server = httpd_loop.Server(("127.0.0.1", 0), handler_class, tls=None, limits=httpd_loop.Limits())
    threading.Thread(target=server.serve_forever).start()    # the poller; server.url says where
    server.shutdown(); server.server_close()
"""
import collections
import dataclasses
import errno
import http.server
import io
import queue
import selectors
import socket
import ssl
import sys
import threading
import time
import traceback

_HEADER_END = (b"\r\n\r\n", b"\n\n")   # the blank line that ends a request's headers


@dataclasses.dataclass
class Limits:
    """What the connections of one server may cost; every field has a flag (httpd.add_server_args)."""
    workers: int = 64                 # threads running requests (long polls and transfers included)
    max_connections: int = 4096       # open sockets, idle ones included
    header_timeout_s: float = 10.0    # first request after connect; headers and JSON body of each request
    idle_timeout_s: float = 60.0      # keep-alive connection with no request
    io_timeout_s: float = 60.0        # one read or write of a streamed body/reply without progress
    max_header_bytes: int = 64 << 10

    def validate(self):
        if self.workers < 1 or self.max_connections < self.workers:
            raise SystemExit(f"--workers {self.workers} must be >= 1 and at most --max-connections "
                             f"{self.max_connections}")
        for name in ("header_timeout_s", "idle_timeout_s", "io_timeout_s"):
            if not getattr(self, name) > 0:
                raise SystemExit(f"--{name.replace('_', '-')} {getattr(self, name)} must be > 0 seconds")
        return self


# ---------------------------------------------------------------- connections

class _Conn:
    """One client connection while the poller holds it (idle, handshaking, reading headers)."""
    __slots__ = ("sock", "fd", "addr", "buf", "state", "deadline", "since")

    def __init__(self, sock, addr, state, deadline):
        self.sock, self.fd, self.addr, self.buf = sock, sock.fileno(), addr, bytearray()
        self.state, self.deadline, self.since = state, deadline, time.monotonic()


class Reader(io.RawIOBase):
    """The socket as a raw stream for the handler's BufferedReader: first the bytes the
    poller already read, then the socket. `deadline_in(s)` bounds the reads inside a
    `with` to s seconds in all (headers, JSON bodies); `probe` answers only what is
    already here, never waits (is another request waiting on this connection?)."""

    def __init__(self, conn, io_timeout_s):
        self.conn, self.io_timeout_s, self.deadline, self.probe = conn, io_timeout_s, None, False
        self.timeout_now = io_timeout_s
        conn.sock.settimeout(io_timeout_s)

    def readable(self):
        return True

    def readinto(self, b):
        buf = self.conn.buf
        if buf:
            n = min(len(b), len(buf))
            b[:n] = buf[:n]
            del buf[:n]
            return n
        sock = self.conn.sock
        if self.probe:
            pending = sock.pending() if isinstance(sock, ssl.SSLSocket) else 0
            return sock.recv_into(b, min(len(b), pending)) if pending else None
        want = self.io_timeout_s
        if self.deadline is not None:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise socket.timeout("request not complete within --header-timeout-s")
            want = min(want, left)
        if want != self.timeout_now:
            sock.settimeout(want)
            self.timeout_now = want
        return sock.recv_into(b)

    def deadline_in(self, seconds):
        return _Deadline(self, seconds)

    def reset_timeout(self):
        """Back to --io-timeout-s (a reply must not inherit what was left of a deadline)."""
        if self.timeout_now != self.io_timeout_s:
            self.conn.sock.settimeout(self.io_timeout_s)
            self.timeout_now = self.io_timeout_s


class _Deadline:
    """`with reader.deadline_in(s):` every read inside ends within s seconds in all."""

    def __init__(self, reader, seconds):
        self.reader, self.seconds = reader, seconds

    def __enter__(self):
        self.old, self.reader.deadline = self.reader.deadline, time.monotonic() + self.seconds

    def __exit__(self, *exc):
        self.reader.deadline = self.old


class Writer:
    """Unbuffered writes straight to the socket (what the stdlib's wbufsize=0 gives)."""

    def __init__(self, sock):
        self.sock = sock

    def write(self, data):
        self.sock.sendall(data)
        return len(data)

    def flush(self):
        pass


class Server:
    """A listening socket, one poller thread (this one, in serve_forever) and a pool of
    workers. The poller owns every connection between requests: it accepts, runs the
    TLS handshake, reads headers until the blank line, enforces the timeouts and the
    connection cap; a connection whose headers are complete goes to a worker, which
    serves it (and any request already queued behind) and hands it back."""

    COUNTERS = ("accepted", "evicted_at_cap", "refused_at_cap", "timed_out_idle", "timed_out_headers",
                "headers_too_large", "tls_handshake_failed", "plain_http_on_tls", "tls_on_plain_port",
                "dropped", "accept_errors", "poller_errors")

    def __init__(self, address, handler_class, tls=None, limits=None):
        self.RequestHandlerClass, self.tls = handler_class, tls
        self.limits = (limits or Limits()).validate()
        host, port = address
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.socket = socket.socket(family, socket.SOCK_STREAM)
        try:
            self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.socket.bind((host, port))
            self.socket.listen(1024)
        except OSError as e:
            self.socket.close()
            if e.errno == errno.EADDRINUSE:
                raise SystemExit(f"cannot listen on {host}:{port}: the address is in use (is this server already "
                                 "running?); stop the other process, or pass another --port") from None
            if e.errno == errno.EADDRNOTAVAIL:
                raise SystemExit(f"--host {host}: no interface of this machine has that address; "
                                 "pass one it has (127.0.0.1, or 0.0.0.0 for all)") from None
            raise SystemExit(f"cannot listen on {host}:{port}: {e.strerror} (--host/--port)") from None
        self.socket.setblocking(False)
        self.server_address = self.socket.getsockname()
        self.conns = {}                           # fd -> _Conn held by the poller
        self.busy = 0                             # connections in workers now
        self.counts = collections.Counter()
        self._ready, self._returned = queue.SimpleQueue(), collections.deque()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._stop, self._stopped = False, threading.Event()
        self._workers = []
        _raise_fd_limit(self.limits.max_connections + 64)

    @property
    def url(self):
        host, port = self.server_address[:2]
        return f"{'https' if self.tls else 'http'}://{host}:{port}"

    def no_backlog(self):
        """No connection is waiting for a worker (so one may linger on its client)."""
        return self._ready.empty()

    def stats(self):
        """Connection counters for /status: open now, busy now, and since the start."""
        return {"open": len(self.conns) + self.busy, "busy": self.busy, "workers": self.limits.workers,
                **{k: self.counts[k] for k in self.COUNTERS}}

    # ---- the poller
    def serve_forever(self, poll_interval=0.5):
        for i in range(self.limits.workers):
            t = threading.Thread(target=self._work, name=f"http-worker-{i}", daemon=True)
            t.start()
            self._workers.append(t)
        sel = self.sel = selectors.DefaultSelector()
        sel.register(self.socket, selectors.EVENT_READ, "listen")
        sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        next_sweep = 0.0
        try:
            while not self._stop:
                for key, _ in sel.select(timeout=min(poll_interval, 0.25)):
                    if key.data == "listen":
                        self._accept()
                    elif key.data == "wake":
                        self._take_back()
                    else:
                        self._readable(key.data)
                now = time.monotonic()
                if now >= next_sweep:
                    self._sweep(now)
                    next_sweep = now + 0.25
        finally:
            sel.close()
            self._stopped.set()

    def shutdown(self):
        self._stop = True
        self._wake()
        self._stopped.wait(10)

    def server_close(self):
        """Close the listening socket, every connection and the wake pair (after shutdown(),
        or without serve_forever ever started)."""
        self._stop = True
        self._wake()
        if self._workers:                     # the poller may still select on the wake pair
            self._stopped.wait(10)
        self.socket.close()
        for conn in list(self.conns.values()):
            self._close(conn, unregister=False)
        while self._returned:                 # handed back after the poller's last turn
            conn = self._returned.popleft()
            if conn is not None:
                conn.sock.close()
        for _ in self._workers:
            self._ready.put(None)
        self._wake_r.close()
        self._wake_w.close()

    def _wake(self):
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass

    def _accept(self):
        now = time.monotonic()
        for _ in range(256):
            try:
                sock, addr = self.socket.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:          # EMFILE and friends: the cap below keeps us under the fd limit
                self.counts["accept_errors"] += 1
                sys.stderr.write(f"httpd: accept failed: {e}\n")
                return
            if len(self.conns) + self.busy >= self.limits.max_connections and not self._evict():
                self.counts["refused_at_cap"] += 1
                sock.close()
                continue
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Conn(sock, addr, "new" if self.tls else "idle", now + self.limits.header_timeout_s)
            self.counts["accepted"] += 1
            self.conns[conn.fd] = conn
            self.sel.register(conn.fd, selectors.EVENT_READ, conn)

    def _evict(self):
        """At the connection cap: close the connection that has waited longest for a request."""
        if not self.conns:
            return False
        victim = min(self.conns.values(), key=lambda c: c.since)
        self.counts["evicted_at_cap"] += 1
        self._close(victim)
        return True

    def _sweep(self, now):
        for conn in [c for c in self.conns.values() if c.deadline <= now]:
            self.counts["timed_out_" + ("idle" if conn.state == "idle" and not conn.buf else "headers")] += 1
            self._close(conn)

    def _readable(self, conn):
        try:
            if conn.state == "new" and not self._start_tls(conn):
                return
            if conn.state == "handshake" and not self._handshake(conn):
                return
            if not self.tls and conn.state == "idle" and not conn.buf and self._tls_on_plain(conn):
                return
            self._read_headers(conn)
        except (OSError, ValueError) as e:     # reset, TLS alert, a peer gone mid-read
            self.counts["dropped"] += 1
            self._close(conn)
            if not isinstance(e, (ConnectionError, ssl.SSLError)):
                self.counts["poller_errors"] += 1

    def _start_tls(self, conn):
        """TLS starts with a handshake record (0x16); anything else is plain HTTP on a TLS
        port: say so in plain text and hang up."""
        try:
            first = conn.sock.recv(1, socket.MSG_PEEK)
        except (BlockingIOError, InterruptedError):
            return False
        if not first:
            self._close(conn)
            return False
        if first[0] != 0x16:
            self.counts["plain_http_on_tls"] += 1
            body = b'{"error":"this server speaks TLS: use an https:// URL"}\n'
            self._reply_and_close(conn, 400, body)
            return False
        conn.sock = self.tls.wrap_socket(conn.sock, server_side=True, do_handshake_on_connect=False)
        conn.state = "handshake"
        return True

    def _tls_on_plain(self, conn):
        """A TLS ClientHello (0x16) on a plain port: hang up at once (no reply it could read)."""
        try:
            first = conn.sock.recv(1, socket.MSG_PEEK)
        except (BlockingIOError, InterruptedError):
            return False
        if first[:1] == b"\x16":
            self.counts["tls_on_plain_port"] += 1
            self._close(conn)
            return True
        return False

    def _handshake(self, conn):
        try:
            conn.sock.do_handshake()
        except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
            return False
        except (ssl.SSLError, OSError):
            self.counts["tls_handshake_failed"] += 1
            self._close(conn)
            return False
        conn.state = "idle"
        return True

    def _read_headers(self, conn):
        while True:
            try:
                data = conn.sock.recv(65536)
            except (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
                break
            if not data:
                self._close(conn)
                return
            if conn.state == "idle":
                conn.state, conn.deadline = "reading", time.monotonic() + self.limits.header_timeout_s
            start = max(0, len(conn.buf) - 3)
            conn.buf += data
            if any(conn.buf.find(end, start) >= 0 for end in _HEADER_END):
                self._hand_off(conn)
                return
            if len(conn.buf) > self.limits.max_header_bytes:
                self.counts["headers_too_large"] += 1
                self._reply_and_close(conn, 431, b'{"error":"request headers exceed 64 KiB"}\n')
                return

    def _hand_off(self, conn):
        self.sel.unregister(conn.fd)
        del self.conns[conn.fd]
        self.busy += 1
        self._ready.put(conn)

    def _take_back(self):
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, InterruptedError):
            pass
        now = time.monotonic()
        while self._returned:
            conn = self._returned.popleft()
            self.busy -= 1
            if conn is None:
                continue
            if self._stop:
                conn.sock.close()
                continue
            conn.state, conn.since, conn.deadline = "idle", now, now + self.limits.idle_timeout_s
            self.conns[conn.fd] = conn
            self.sel.register(conn.fd, selectors.EVENT_READ, conn)

    def _reply_and_close(self, conn, status, body):
        reason = http.server.BaseHTTPRequestHandler.responses.get(status, ("Error",))[0]
        head = (f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
        try:
            conn.sock.send(head + body)
        except (OSError, ValueError):
            pass
        self._close(conn)

    def _close(self, conn, unregister=True):
        if self.conns.pop(conn.fd, None) is not None and unregister:
            try:
                self.sel.unregister(conn.fd)
            except (KeyError, ValueError):
                pass
        try:
            conn.sock.close()
        except OSError:
            pass

    # ---- the workers
    def _work(self):
        while (conn := self._ready.get()) is not None:
            keep = False
            try:
                keep = self.RequestHandlerClass(conn, self).serve_ready()
            except (OSError, ValueError):          # the peer went away mid-reply
                keep = False
            except Exception:
                traceback.print_exc(file=sys.stderr)
            if keep and self._stop:
                keep = False                       # the poller is gone: nobody would take it back
            if keep:
                try:
                    conn.sock.setblocking(False)
                except OSError:
                    keep = False
            if not keep:
                try:
                    conn.sock.close()
                except OSError:
                    pass
            self._returned.append(conn if keep else None)
            self._wake()


def _raise_fd_limit(want):
    """--max-connections sockets need as many file descriptors; raise the soft limit."""
    try:
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and soft < want:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want if hard == resource.RLIM_INFINITY
                                                        else min(want, hard), hard))
    except (ImportError, ValueError, OSError):
        pass
