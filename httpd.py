"""httpd.py - the HTTP plumbing shared by the three central servers.

Runs on: the central VM, inside darl_server.py, fedmom_server.py and blobstore.py.
Not started on its own. Python standard library only (no numpy, no torch).

What every server gets from here, written once:
  - a route table: {("GET", "/status"): fn, ("PUT", "/blobs/*"): fn, ...}; a
    trailing "/*" matches any suffix, handed to the function as `req.tail`.
    Route functions take a Request and return a dict (sent as JSON, 200), a
    (status, dict) pair, or a Response (raw bytes or a file range, streamed
    with os.sendfile).
  - errors: raise HTTPError(4xx, "one-line reason") anywhere; the client gets
    {"error": reason, ...} and the server keeps serving. An unexpected
    exception is a 500 with the exception's one-line text, and is logged.
  - limits: JSON bodies are capped (--max-body-mb), every socket has a timeout,
    TCP_NODELAY is set (with Nagle on, a keep-alive client that sends a small
    request after a small response waits ~40 ms per call: ~23 requests/s).
  - auth: every route but those listed as public (health) requires
    `Authorization: Bearer <token>`, compared with hmac.compare_digest.
    A server refuses to bind beyond loopback without a token unless told
    --insecure.

Clients use `call()` below: one JSON request over http.client, no retries
(retry policy belongs to the caller, which knows what is safe to repeat).

Test hooks, inert unless their variable is set (bench/fault_schedule.py and the
tests set them; a production start never does):
  - PWW_TEST_CLOCK_OFFSET_FILE=FILE: wall_time() is time.time() plus the number of
    seconds in FILE (re-read at every call; absent or empty = 0), so a test can step
    the wall clock of a running server by +-1 h without touching the machine's clock.
  - PWW_TEST_FAULT_DIR=DIR: fault_point(name) stops the calling thread at a named
    protocol phase while DIR/<name> exists. The file holds how many hits to let pass
    first; at the hit that stops, DIR/<name>.hit appears (holding the pid) and the
    thread waits until DIR/<name> is removed. A test SIGKILLs the process there, or
    removes the file to let it go on (the thread removes <name>.hit as it leaves, so
    the point can be armed again): a crash or a stall at an exact phase, with no sleep.
"""
import argparse
import errno
import fcntl
import hmac
import http.client
import http.server
import ipaddress
import json
import os
import signal
import socket
import socketserver
import sys
import tempfile
import threading
import time
import traceback
import urllib.parse

DEFAULT_MAX_BODY = 1 << 20        # 1 MiB: every JSON RPC is a few hundred bytes
SOCKET_TIMEOUT_S = 120            # a stalled peer frees its thread after this


class HTTPError(Exception):
    """Raise from a route function: becomes a JSON error reply with this status."""

    def __init__(self, status, reason, **extra):
        super().__init__(reason)
        self.status, self.reason, self.extra = int(status), str(reason), extra


class Response:
    """A non-JSON reply: `body` bytes, or `path` + `offset` + `length` streamed from a file."""

    def __init__(self, status=200, headers=None, body=b"", path=None, offset=0, length=None,
                 content_type="application/octet-stream", file=None):
        self.status, self.headers, self.body = status, dict(headers or {}), body
        self.path, self.offset, self.length, self.content_type = path, offset, length, content_type
        # `file`: an already open binary file to stream instead of opening `path` (closed after
        # sending). A route that opens the file itself keeps serving it even if the name is
        # replaced or unlinked before the reply goes out.
        self.file = file


class Request:
    """What a route function sees: method, path, query, headers, the body reader."""

    def __init__(self, handler, method, path, query, tail, max_body):
        self.handler, self.method, self.path, self.query, self.tail = handler, method, path, query, tail
        self.headers = handler.headers
        self.rfile = handler.rfile
        self.max_body = max_body
        self.client = handler.client_address[0]

    def content_length(self, required=True):
        raw = self.headers.get("Content-Length")
        if raw is None:
            if required:
                raise HTTPError(411, "Content-Length header is required")
            return None
        try:
            n = int(raw)
        except ValueError:
            raise HTTPError(400, f"Content-Length is not an integer: {raw!r}")
        if n < 0:
            raise HTTPError(400, f"Content-Length is negative: {n}")
        return n

    def body(self, max_bytes=None):
        limit = self.max_body if max_bytes is None else max_bytes
        n = self.content_length()
        if n > limit:
            raise HTTPError(413, f"body of {n} bytes exceeds the limit of {limit} bytes")
        self.handler.send_continue()
        data = self.rfile.read(n)
        if len(data) != n:
            raise HTTPError(400, f"body ended after {len(data)} of {n} bytes")
        self.handler.body_consumed = True
        return data

    def stream(self, chunk_bytes=1 << 20, length=None):
        """Yield the body in chunks of at most `chunk_bytes`, never holding it whole.
        Raises ConnectionError if the peer stops before Content-Length bytes."""
        left = self.content_length() if length is None else length
        self.handler.send_continue()
        self.handler.body_consumed = True
        while left > 0:
            chunk = self.rfile.read(min(chunk_bytes, left))
            if not chunk:
                self.handler.close_connection = True
                raise ConnectionError(f"body ended with {left} bytes still to come")
            left -= len(chunk)
            yield chunk

    def json(self, max_bytes=None):
        data = self.body(max_bytes)
        try:
            obj = json.loads(data or b"{}")
        except (ValueError, UnicodeDecodeError, RecursionError) as e:   # RecursionError: absurd nesting
            raise HTTPError(400, f"malformed JSON body: {type(e).__name__}: {e}".splitlines()[0])
        if not isinstance(obj, dict):
            raise HTTPError(400, "JSON body must be an object")
        return obj


def field(obj, name, kind, required=True, default=None):
    """Fetch obj[name] and check its type; a 400 naming the field otherwise."""
    if name not in obj or obj[name] is None:
        if required:
            raise HTTPError(400, f"missing field {name!r}")
        return default
    value = obj[name]
    ok = isinstance(value, kind) and not (kind in (int, (int, float)) and isinstance(value, bool))
    if not ok:
        want = getattr(kind, "__name__", None) or "/".join(k.__name__ for k in kind)
        raise HTTPError(400, f"field {name!r} must be {want}, got {type(value).__name__}")
    return value


def _lookup(routes, method, path):
    fn = routes.get((method, path))
    if fn is not None:
        return fn, ""
    for (m, pattern), fn in routes.items():
        if m == method and pattern.endswith("/*") and path.startswith(pattern[:-1]):
            return fn, path[len(pattern) - 1:]
    if any(p == path or (p.endswith("/*") and path.startswith(p[:-1])) for _, p in routes):
        raise HTTPError(405, f"method {method} not allowed on {path}")
    raise HTTPError(404, f"no such endpoint: {path}")


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"   # keep-alive: one TCP connection for a client's whole session
    timeout = SOCKET_TIMEOUT_S
    routes, token, public, max_body, quiet = {}, None, frozenset(), DEFAULT_MAX_BODY, True
    scoped = {}                     # path -> the one token it takes (a narrower credential than `token`)
    server_version = "pww"

    def setup(self):
        super().setup()
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def handle_expect_100(self):
        # `Expect: 100-continue` (a client about to send GBs): answer 100 only when the
        # route starts reading the body, so a refusal (401, 409, 413...) arrives before
        # the client has sent a byte of it. Sent by Request.body()/stream().
        return True

    def send_continue(self):
        if self.expect_continue:
            self.expect_continue = False
            self.send_response_only(100)
            self.end_headers()

    def do_GET(self):
        self._dispatch("GET")

    def do_POST(self):
        self._dispatch("POST")

    def do_PUT(self):
        self._dispatch("PUT")

    def do_HEAD(self):
        self._dispatch("HEAD")

    def do_DELETE(self):
        self._dispatch("DELETE")

    def _authorized(self, path):
        token = self.scoped.get(path, self.token)
        if token is None or path in self.public:
            return True
        got = self.headers.get("Authorization", "")
        want = "Bearer " + token
        return hmac.compare_digest(got.encode("utf-8", "replace"), want.encode("utf-8"))

    def _dispatch(self, method):
        self.body_consumed = False
        self.expect_continue = (self.headers.get("Expect", "").lower() == "100-continue"
                                and self.request_version >= "HTTP/1.1")
        url = urllib.parse.urlsplit(self.path)
        query = dict(urllib.parse.parse_qsl(url.query))
        try:
            if not self._authorized(url.path):
                raise HTTPError(401, "missing or wrong bearer token (Authorization: Bearer <token>)")
            fn, tail = _lookup(self.routes, method, url.path)
            out = fn(Request(self, method, url.path, query, tail, self.max_body))
        except HTTPError as e:
            self._send_json(e.status, {"error": e.reason, **e.extra})
            return
        except (ConnectionError, socket.timeout) as e:
            self.close_connection = True
            self.log_message("connection lost during %s %s: %s", method, url.path, e)
            return
        except Exception as e:     # a bug: answer 500, log the trace, keep serving
            traceback.print_exc(file=sys.stderr)
            self._send_json(500, {"error": f"internal error: {type(e).__name__}: {e}".splitlines()[0]})
            return
        self._drain_body()
        if isinstance(out, Response):
            self._send_response(out)
        elif isinstance(out, tuple):
            self._send_json(out[0], out[1])
        else:
            self._send_json(200, out if out is not None else {})

    def _drain_body(self):
        """An unread body would be parsed as the next request on this keep-alive
        connection: read a small one away, hang up on a large one."""
        if self.body_consumed:
            return
        self.body_consumed = True
        if self.expect_continue:     # the client still holds the body back: do not wait for it
            self.close_connection = True
            return
        try:
            n = int(self.headers.get("Content-Length", "0"))
        except ValueError:
            n = -1
        if 0 <= n <= self.max_body:
            self.rfile.read(n)
        else:
            self.close_connection = True

    def _send_json(self, status, obj, headers=None):
        data = (json.dumps(obj, separators=(",", ":")) + "\n").encode()
        if status >= 400:
            self._drain_body()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _send_response(self, r):
        if r.file is not None:
            try:
                self._send_file_response(r)
            finally:
                r.file.close()
            return
        length = len(r.body) if r.path is None else r.length
        self.send_response(r.status)
        self.send_header("Content-Type", r.content_type)
        self.send_header("Content-Length", str(length))
        for k, v in r.headers.items():
            self.send_header(k, str(v))
        self.end_headers()
        if self.command == "HEAD":
            return
        if r.path is None:
            self.wfile.write(r.body)
            return
        self.wfile.flush()
        with open(r.path, "rb") as f:
            _sendfile(self.connection, f, r.offset, length)

    def _send_file_response(self, r):
        length = r.length if r.length is not None else os.fstat(r.file.fileno()).st_size - r.offset
        self.send_response(r.status)
        self.send_header("Content-Type", r.content_type)
        self.send_header("Content-Length", str(length))
        for k, v in r.headers.items():
            self.send_header(k, str(v))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.flush()
            _sendfile(self.connection, r.file, r.offset, length)

    def log_message(self, fmt, *args):
        if not self.quiet:
            sys.stderr.write("%s %s\n" % (self.address_string(), fmt % args))

    def log_request(self, code="-", size="-"):
        if not self.quiet:
            super().log_request(code, size)


def _sendfile(sock, f, offset, length):
    """Zero-copy file -> socket (os.sendfile), with a read/write fallback."""
    end = offset + length
    try:
        while offset < end:
            sent = os.sendfile(sock.fileno(), f.fileno(), offset, min(end - offset, 1 << 30))
            if sent == 0:
                raise ConnectionError("sendfile: file shorter than expected")
            offset += sent
    except (AttributeError, OSError) as e:
        if isinstance(e, (BrokenPipeError, ConnectionResetError)):
            raise
        f.seek(offset)
        while offset < end:
            chunk = f.read(min(end - offset, 1 << 20))
            if not chunk:
                raise ConnectionError("file shorter than expected")
            sock.sendall(chunk)
            offset += len(chunk)


class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128

    @property
    def url(self):
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"


def is_loopback(host):
    if host in ("localhost", ""):
        return host == "localhost"
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def make_server(routes, host="127.0.0.1", port=0, token=None, insecure=False,
                public=("/health",), max_body=DEFAULT_MAX_BODY, quiet=True, scoped=None):
    """Bind a threaded server for `routes`. Port 0 picks a free one (tests). `scoped`
    {path: token}: those paths take that token alone, not `token`."""
    if not is_loopback(host) and not token and not insecure:
        raise SystemExit(f"refusing to listen on {host!r} without a token: pass --token-file FILE "
                         "(or set PWW_TOKEN), or --insecure if the network is private")
    attrs = dict(routes=dict(routes), token=token or None, public=frozenset(public),
                 max_body=max_body, quiet=quiet, scoped=dict(scoped or {}))
    handler = type("BoundHandler", (Handler,), attrs)
    try:
        return Server((host, port), handler)
    except OSError as e:
        if e.errno == errno.EADDRNOTAVAIL:
            raise SystemExit(f"--host {host}: no interface of this machine has that address; "
                             "pass one it has (127.0.0.1, or 0.0.0.0 for all)") from None
        if e.errno != errno.EADDRINUSE:
            raise
        raise SystemExit(f"cannot listen on {host}:{port}: the address is in use (is this server already "
                         "running?); stop the other process, or pass another --port") from None


def writable_dir(path, flag):
    """Create `path` if absent and prove a file can be written there; else one line naming
    `flag` (a file where the directory should be, a read-only or foreign directory)."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise SystemExit(f"{flag} {path} is a file, not a directory: pass a directory (it is created if absent)")
    try:
        os.makedirs(path, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-probe-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise SystemExit(f"{flag} {path}: cannot write there ({e.strerror}); pass a directory this user "
                         "can write") from None
    return path


def add_server_args(parser, default_port):
    """The flags every central server shares."""
    g = parser.add_argument_group("network")
    g.add_argument("--host", default="127.0.0.1",
                   help="bind address (default 127.0.0.1; 0.0.0.0 needs a token or --insecure)")
    g.add_argument("--port", type=int, default=default_port, help=f"TCP port (default {default_port})")
    g.add_argument("--token-file", default=os.environ.get("PWW_TOKEN_FILE"),
                   help="file holding the shared bearer token (default: $PWW_TOKEN_FILE, or $PWW_TOKEN)")
    g.add_argument("--insecure", action="store_true",
                   help="allow a non-loopback bind without a token (private networks only)")
    g.add_argument("--max-body-mb", type=float, default=DEFAULT_MAX_BODY / 2**20,
                   help="largest JSON request body accepted, MiB (default 1)")
    g.add_argument("--verbose", action="store_true", help="log every request to stderr")
    return g


def load_token(path=None, env="PWW_TOKEN"):
    """The shared token: from a file (first line), else $PWW_TOKEN (`env`; None: no
    fallback), else None."""
    if path:
        try:
            with open(path) as f:
                tok = f.readline().strip()
        except OSError as e:
            raise SystemExit(f"cannot read token file {path}: {e.strerror}")
        if not tok:
            raise SystemExit(f"token file {path} is empty")
        return tok
    return (os.environ.get(env) if env else None) or None


# ---------------------------------------------------------------- one process per state dir

def lock_state_dir(path, who):
    """Hold an exclusive flock on <path>/lock for as long as the returned fd stays open (the
    kernel drops it when the process dies, so a kill -9 never leaves a stale lock). A second
    server on the same state directory would interleave its writes with the first one's;
    it stops here instead, before reading or touching anything. SystemExit names the holder."""
    os.makedirs(path, exist_ok=True)
    lock = os.path.join(path, "lock")
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise SystemExit(f"{who}: {path} is in use by another {who} (pid {holder}, holding {lock}); stop that "
                         "process first, or give this one another --state-dir") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


# ---------------------------------------------------------------- test hooks

CLOCK_OFFSET_ENV = "PWW_TEST_CLOCK_OFFSET_FILE"
FAULT_DIR_ENV = "PWW_TEST_FAULT_DIR"
_fault_lock = threading.Lock()


def wall_time():
    """time.time(), plus the test offset of $PWW_TEST_CLOCK_OFFSET_FILE when set."""
    path = os.environ.get(CLOCK_OFFSET_ENV)
    if not path:
        return time.time()
    try:
        with open(path) as f:
            text = f.read().strip()
        return time.time() + (float(text) if text else 0.0)
    except (OSError, ValueError):
        return time.time()


def fault_point(name, on_stop=None):
    """A named protocol phase a test may stop this thread at ($PWW_TEST_FAULT_DIR; see the
    module docstring). `on_stop` runs just before the thread stops (e.g. write half a log
    line, for a torn write). A no-op without the variable."""
    root = os.environ.get(FAULT_DIR_ENV)
    if not root:
        return
    arm = os.path.join(root, name)
    with _fault_lock:
        try:
            with open(arm) as f:
                text = f.read().strip()
        except OSError:
            return
        skip = int(text) if text.isdigit() else 0
        if skip > 0:
            with open(arm + ".tmp", "w") as f:
                f.write(str(skip - 1))
            os.replace(arm + ".tmp", arm)
            return
        if on_stop is not None:
            on_stop()
        with open(arm + ".hit.tmp", "w") as f:
            f.write(str(os.getpid()))
        os.replace(arm + ".hit.tmp", arm + ".hit")
    while os.path.exists(arm):
        time.sleep(0.01)
    try:                                 # gone on: the test may arm this point again
        os.unlink(arm + ".hit")
    except FileNotFoundError:
        pass


# ---------------------------------------------------------------- client side

class CallError(Exception):
    """A reply with status >= 400 from a server: carries the status and the JSON reply."""

    def __init__(self, status, reply):
        super().__init__(f"HTTP {status}: {reply.get('error', reply)}")
        self.status, self.reply = status, reply


def split_url(url):
    u = urllib.parse.urlsplit(url if "://" in url else "http://" + url)
    if u.scheme not in ("http", "https"):
        raise ValueError(f"unsupported URL scheme in {url!r}")
    return u.scheme, u.hostname or "127.0.0.1", u.port or (443 if u.scheme == "https" else 80), u.path.rstrip("/")


def connect(url, timeout=30.0):
    scheme, host, port, _ = split_url(url)
    cls = http.client.HTTPSConnection if scheme == "https" else http.client.HTTPConnection
    conn = cls(host, port, timeout=timeout)
    conn.connect()
    conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return conn


def auth_headers(token):
    return {"Authorization": f"Bearer {token}"} if token else {}


def call(url, method, path, body=None, token=None, timeout=30.0, conn=None):
    """One JSON request. Returns the decoded reply; raises CallError on 4xx/5xx,
    OSError/http.client errors when the server cannot be reached."""
    own = conn is None
    conn = conn or connect(url, timeout)
    try:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json", **auth_headers(token)}
        conn.request(method, split_url(url)[3] + path, body=data, headers=headers)
        resp = conn.getresponse()
        raw = resp.read()
        try:
            reply = json.loads(raw) if raw else {}
        except ValueError:
            reply = {"error": raw[:200].decode("utf-8", "replace")}
        if resp.status >= 400:
            raise CallError(resp.status, reply)
        return reply
    finally:
        if own:
            conn.close()


def wait_healthy(url, timeout=30.0):
    """Poll GET /health until it answers 200 or `timeout` seconds pass."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return call(url, "GET", "/health", timeout=2.0)
        except (OSError, http.client.HTTPException, CallError):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url}/health did not answer within {timeout:.0f} s")
            time.sleep(0.05)


def serve_forever(server, name):
    """Serve until SIGTERM/SIGINT; print the one line that says where.
    Both signals end the loop the same way, so the caller's `finally` runs
    (flush, snapshot) and the process exits 0 under `kill` or systemd stop."""
    def on_term(signum, frame):
        raise KeyboardInterrupt
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, on_term)
    print(f"{name} listening on {server.url}", flush=True)
    try:
        server.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


def base_parser(prog_doc):
    return argparse.ArgumentParser(description=prog_doc.split("\n\n")[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter,
                                   epilog="\n\n".join(prog_doc.split("\n\n")[1:]))
