"""httpd.py - the HTTP plumbing shared by the three central servers.

Runs on: the central VM, inside darl_server.py, fedmom_server.py and blobstore.py.
Not started on its own. Python standard library only (and durable.py, httpc.py, httpd_loop.py beside
it; no numpy, no torch).

What every server gets from here, written once:
  - a route table: {("GET", "/status"): fn, ("PUT", "/blobs/*"): fn, ...}; a
    trailing "/*" matches any suffix, handed to the function as `req.tail`.
    Route functions take a Request and return a dict (sent as JSON, 200), a
    (status, dict) pair, or a Response (raw bytes or a file range, streamed
    with sendfile).
  - errors: raise HTTPError(4xx, "one-line reason") anywhere; the client gets
    {"error": reason, ...} and the server keeps serving. Every reply is JSON,
    the stdlib's own refusals included (a malformed request line is a 400, an
    unknown method a 405 with Allow). A full disk (ENOSPC, EDQUOT) anywhere in a
    route is a 507 {"code": "disk_full"} naming the disk, with Retry-After; an
    unexpected exception is a 500 with the exception's one-line text, and is logged.
  - auth: every route but those listed as public (health) requires
    `Authorization: Bearer <token>` (the scheme in any case, RFC 7235), compared
    with hmac.compare_digest.
  - TLS (--tls-cert, --tls-key; stdlib ssl, TLS 1.2+). A server refuses to bind
    beyond loopback without both a token and TLS unless told --insecure: without
    TLS the token crosses the network in clear. A plain-HTTP request on a TLS port
    gets a plain 400 saying "use https://".

Connections are httpd_loop.py's (its docstring says what each costs): one epoll poller
thread holds every connection between requests and enforces the timeouts and the
connection cap (--workers, --max-connections, --header-timeout-s, --idle-timeout-s,
--io-timeout-s: add_server_args below); a connection whose headers are in goes to a worker
thread, which serves it here (Handler) and hands it back. Per request, here: JSON bodies
are capped (--max-body-mb, 413), Transfer-Encoding is refused (411: send Content-Length),
conflicting or malformed Content-Length headers are a 400 and end the connection, a small
body a route left unread is read away (a large one closes the connection), TCP_NODELAY is
set (with Nagle on, a keep-alive client that sends a small request after a small response
waits ~40 ms per call: ~23 requests/s).

Clients use httpc.py (one JSON call, TLS with the caller's CA file, the bearer token, the
retry policy); the test hooks the servers carry (fault points, the wall clock) are
testhooks.py's; the lock on a state directory is durable.lock_state_dir.
"""
import argparse
import hmac
import http.server
import io
import ipaddress
import json
import math
import os
import re
import select
import signal
import socket
import ssl
import sys
import tempfile
import threading
import traceback
import urllib.parse

import durable
import httpc
import httpd_loop

DEFAULT_MAX_BODY = 1 << 20        # 1 MiB: every JSON RPC is a few hundred bytes
DRAIN_MAX = 64 << 10              # an unread body up to this size is read away to keep the connection
DISK_FULL_RETRY_S = 30            # Retry-After of a 507: long enough for an operator to notice
LINGER_S = 0.005                  # a worker waits this long for a keep-alive client's next request
_CONTENT_LENGTH_RE = re.compile(r"[0-9]{1,19}")


class HTTPError(Exception):
    """Raise from a route function: becomes a JSON error reply with this status.
    `headers` are sent as HTTP headers (Retry-After, Allow); `extra` joins the JSON."""

    def __init__(self, status, reason, headers=None, **extra):
        super().__init__(reason)
        self.status, self.reason, self.extra = int(status), str(reason), extra
        self.headers = dict(headers or {})


def mount_of(path):
    path = os.path.realpath(path)
    while not os.path.ismount(path):
        path = os.path.dirname(path)
    return path


def disk_full(path, err=None):
    """The 507 for a full disk under `path`: names the mount and what is free there."""
    where = os.path.abspath(path)
    try:
        st = os.statvfs(where if os.path.exists(where) else os.path.dirname(where))
        free = f"{st.f_bavail * st.f_frsize:,} bytes free"
        mount = mount_of(where)
    except OSError:
        free, mount = "free space unknown", "?"
    detail = f" ({err.strerror})" if isinstance(err, OSError) and err.strerror else ""
    return HTTPError(507, f"disk full{detail}: the disk holding {where} (mount {mount}, {free}); "
                          "nothing of this request was kept: free space there and retry",
                     headers={"Retry-After": str(DISK_FULL_RETRY_S)}, code="disk_full", disk=mount,
                     retry_after_s=DISK_FULL_RETRY_S)


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
        raw = self.headers.get("Content-Length")      # its form and uniqueness: Handler._check_framing
        if raw is None:
            if required:
                raise HTTPError(411, "Content-Length header is required")
            return None
        return int(raw)

    def body(self, max_bytes=None):
        """The whole body (a JSON request: small), read within --header-timeout-s."""
        limit = self.max_body if max_bytes is None else max_bytes
        n = self.content_length()
        if n > limit:
            raise HTTPError(413, f"body of {n} bytes exceeds the limit of {limit} bytes")
        self.handler.send_continue()
        self.handler.body_consumed = True
        with self.handler.reader.deadline_in(self.handler.server.limits.header_timeout_s):
            data = self.rfile.read(n)
        self.handler.reader.reset_timeout()
        if len(data) != n:
            self.handler.close_connection = True
            raise HTTPError(400, f"body ended after {len(data)} of {n} bytes")
        return data

    def stream(self, chunk_bytes=1 << 20, length=None):
        """Yield the body in chunks of at most `chunk_bytes`, never holding it whole.
        Raises ConnectionError if the peer stops before Content-Length bytes, and
        socket.timeout if no byte arrives for --io-timeout-s."""
        left = self.content_length() if length is None else length
        self.handler.send_continue()
        self.handler.body_consumed = self.handler.body_partial = True
        while left > 0:
            chunk = self.rfile.read(min(chunk_bytes, left))
            if not chunk:
                self.handler.close_connection = True
                raise ConnectionError(f"body ended with {left} bytes still to come")
            left -= len(chunk)
            yield chunk
        self.handler.body_partial = False

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
    """Fetch obj[name] and check its type; a 400 naming the field otherwise.
    Numbers must be finite (JSON has no NaN, but Python's parser takes the literal)
    and integers within 64 bits (a 4000-digit one overflows every float it meets)."""
    if name not in obj or obj[name] is None:
        if required:
            raise HTTPError(400, f"missing field {name!r}")
        return default
    value = obj[name]
    ok = isinstance(value, kind) and not (kind in (int, (int, float)) and isinstance(value, bool))
    if not ok:
        want = getattr(kind, "__name__", None) or "/".join(k.__name__ for k in kind)
        raise HTTPError(400, f"field {name!r} must be {want}, got {type(value).__name__}")
    if isinstance(value, float) and not math.isfinite(value):
        raise HTTPError(400, f"field {name!r} must be a finite number, got {value!r}")
    if isinstance(value, int) and not isinstance(value, bool) and not -2 ** 63 <= value < 2 ** 63:
        raise HTTPError(400, f"field {name!r} is out of range (|{name}| < 2**63)")
    return value


def _lookup(routes, method, path):
    fn = routes.get((method, path))
    if fn is not None:
        return fn, ""
    for (m, pattern), fn in routes.items():
        if m == method and pattern.endswith("/*") and path.startswith(pattern[:-1]):
            return fn, path[len(pattern) - 1:]
    allowed = sorted({m for m, p in routes if p == path or (p.endswith("/*") and path.startswith(p[:-1]))})
    if allowed:
        raise HTTPError(405, f"method {method} not allowed on {path}", headers={"Allow": ", ".join(allowed)})
    if method not in {m for m, _ in routes}:
        raise HTTPError(405, f"method {method[:20]!r} is not supported by this server",
                        headers={"Allow": ", ".join(sorted({m for m, _ in routes}))})
    raise HTTPError(404, f"no such endpoint: {path[:200]}")


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"   # keep-alive: one TCP connection for a client's whole session
    routes, token, public, max_body, quiet = {}, None, frozenset(), DEFAULT_MAX_BODY, True
    scoped = {}                     # path -> the one token it takes (a narrower credential than `token`)
    disk = None                     # the state directory a 507 names
    server_version = "pww"

    def __init__(self, conn, server):
        """One handler per stretch of requests a worker serves on `conn` (not per
        connection: between requests the poller holds the bare socket)."""
        self.request = self.connection = conn.sock
        self.client_address, self.server = conn.addr, server
        self.reader = httpd_loop.Reader(conn, server.limits.io_timeout_s)
        self.rfile = io.BufferedReader(self.reader, 16 << 10)
        self.wfile = httpd_loop.Writer(conn.sock)
        self.setup()

    def setup(self):
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def serve_ready(self):
        """Serve requests while one is already waiting on the connection. True: keep the
        connection (hand it back to the poller); False: close it.

        After an authorized request, and while no other connection waits for a worker,
        wait LINGER_S for the client's next request before handing the connection back:
        a keep-alive client in a loop sends it within a millisecond, and the round trip
        through the poller costs two thread switches (measured: no-op RPCs ~30 % slower)."""
        while True:
            self.authorized = False
            with self.reader.deadline_in(self.server.limits.header_timeout_s):
                self.handle_one_request()
            if self.close_connection:
                return False
            self.reader.probe = True
            try:
                waiting = self.rfile.peek(1)
            finally:
                self.reader.probe = False
            if not waiting and not (self.authorized and self.server.no_backlog() and self._linger()):
                return True

    def _linger(self):
        poller = select.poll()            # not select.select: descriptors above 1024 are normal here
        try:
            poller.register(self.connection.fileno(), select.POLLIN)
            return bool(poller.poll(LINGER_S * 1000))
        except (OSError, ValueError):
            return False

    def __getattr__(self, name):
        # every method reaches _dispatch, so an unknown one is a JSON 405, not the stdlib's HTML 501
        if name.startswith("do_"):
            return lambda: self._dispatch(name[3:])
        raise AttributeError(name)

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

    def send_error(self, code, message=None, explain=None):
        """The stdlib's refusals (bad request line, too many headers, ...) as one-line JSON;
        the connection closes after them, since the request's framing is not known."""
        if code == 501:
            code, message = 405, f"method {(self.command or '')[:20]!r} is not supported by this server"
        elif code == 505:             # "HTTP/2.0 GET ...": a client error here, not a server fault
            code, message = 400, f"unsupported HTTP version in {self.requestline[:60]!r}: speak HTTP/1.1"
        if self.request_version in ("HTTP/0.9", ""):
            self.request_version = "HTTP/1.1"   # answer with a status line even to a garbled request
        self.close_connection = True
        self.body_consumed = True
        self._send_json(code, {"error": message or self.responses.get(code, ("error",))[0]})

    def _authorized(self, path):
        token = self.scoped.get(path, self.token)
        scheme, _, cred = self.headers.get("Authorization", "").strip().partition(" ")
        self.authorized = token is None or (scheme.lower() == "bearer" and hmac.compare_digest(
            cred.strip().encode("utf-8", "replace"), token.encode("utf-8")))
        return self.authorized or path in self.public

    def _check_framing(self):
        """A body's length must be certain, or the next request on this connection would be
        read from the middle of it (request smuggling): one Content-Length of digits only."""
        if self.headers.get("Transfer-Encoding") is not None:
            raise HTTPError(411, "Transfer-Encoding is not supported: send the body with a Content-Length")
        lengths = self.headers.get_all("Content-Length") or []
        if len({v.strip() for v in lengths}) > 1:
            raise HTTPError(400, f"conflicting Content-Length headers {lengths[:4]}")
        if lengths and not _CONTENT_LENGTH_RE.fullmatch(lengths[0].strip()):
            raise HTTPError(400, f"Content-Length {lengths[0][:40]!r} is not a non-negative integer")
        if lengths:
            self.headers.replace_header("Content-Length", lengths[0].strip())

    def _dispatch(self, method):
        self.body_consumed = self.body_partial = False
        self.expect_continue = (self.headers.get("Expect", "").lower() == "100-continue"
                                and self.request_version >= "HTTP/1.1")
        self.reader.deadline = None          # headers are in: a streamed body has --io-timeout-s per read
        self.reader.reset_timeout()
        url = urllib.parse.urlsplit(self.path)
        try:
            try:
                self._check_framing()
            except HTTPError:
                self.close_connection = self.body_consumed = True
                raise
            query = dict(urllib.parse.parse_qsl(url.query))
            if not self._authorized(url.path):
                raise HTTPError(401, "missing or wrong bearer token (Authorization: Bearer <token>)")
            fn, tail = _lookup(self.routes, method, url.path)
            out = fn(Request(self, method, url.path, query, tail, self.max_body))
        except HTTPError as e:
            self._send_json(e.status, {"error": e.reason, **e.extra}, e.headers)
            return
        except (ConnectionError, socket.timeout) as e:
            self.close_connection = True
            self.log_message("connection lost during %s %s: %s", method, url.path, e)
            return
        except Exception as e:
            if durable.is_disk_full(e):
                err = disk_full(self.disk or ".", e)
                self.log_message("%s %s: %s", method, url.path, err.reason)
                self._send_json(507, {"error": err.reason, **err.extra}, err.headers)
                return
            traceback.print_exc(file=sys.stderr)      # a bug: answer 500, log the trace, keep serving
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
        connection: read a small one away (within the header timeout), hang up on a
        large one."""
        if self.body_consumed:
            return
        self.body_consumed = True
        if self.expect_continue:     # the client still holds the body back: do not wait for it
            self.close_connection = True
            return
        n = int(self.headers.get("Content-Length", "0"))
        if n > DRAIN_MAX:
            self.close_connection = True
            return
        try:
            with self.reader.deadline_in(self.server.limits.header_timeout_s):
                if len(self.rfile.read(n)) != n:
                    self.close_connection = True
        except (OSError, socket.timeout):
            self.close_connection = True

    def _send_json(self, status, obj, headers=None):
        data = (json.dumps(obj, separators=(",", ":")) + "\n").encode()
        if status >= 400:
            self._drain_body()
            if getattr(self, "body_partial", False):    # refused mid-body: the rest is still coming
                self.close_connection = True
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
        f = r.file
        try:
            if f is None and r.path is not None:
                f = open(r.path, "rb")
            if f is None:
                length = len(r.body)
            else:
                length = r.length if r.length is not None else os.fstat(f.fileno()).st_size - r.offset
            self.send_response(r.status)
            self.send_header("Content-Type", r.content_type)
            self.send_header("Content-Length", str(length))
            for k, v in r.headers.items():
                self.send_header(k, str(v))
            self.end_headers()
            if self.command == "HEAD":
                return
            if f is None:
                self.wfile.write(r.body)
            elif length:
                # socket.sendfile: os.sendfile on a plain socket (zero copy), send() under TLS
                sent = self.connection.sendfile(f, r.offset, length)
                if sent != length:
                    self.close_connection = True
                    raise ConnectionError(f"file ended after {sent} of {length} bytes")
        finally:
            if f is not None:
                f.close()

    def log_message(self, fmt, *args):
        if not self.quiet:
            sys.stderr.write("%s %s\n" % (self.address_string(), fmt % args))

    def log_request(self, code="-", size="-"):
        if not self.quiet:
            super().log_request(code, size)


def is_loopback(host):
    if host in ("localhost", ""):
        return host == "localhost"
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def server_tls(cert_file, key_file):
    """The server's TLS context (TLS 1.2 or newer) from a PEM certificate chain and key."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(cert_file, key_file)
    except (OSError, ssl.SSLError) as e:
        raise SystemExit(f"cannot load --tls-cert {cert_file} / --tls-key {key_file}: {e}")
    return ctx


def check_bind(host, token, tls, insecure):
    """A public bind needs a token (who may call) and TLS (so the token is not sent in clear)."""
    if is_loopback(host) or insecure:
        return
    missing = ([] if token else ["a token (--token-file FILE, or $PWW_TOKEN)"]) + \
              ([] if tls else ["TLS (--tls-cert FILE --tls-key FILE)"])
    if missing:
        raise SystemExit(f"refusing to listen on {host!r} without {' and '.join(missing)}: "
                         "pass them, or --insecure if the network is private")


def make_server(routes, host="127.0.0.1", port=0, token=None, insecure=False,
                public=("/health",), max_body=DEFAULT_MAX_BODY, quiet=True, tls=None, limits=None,
                disk=None, scoped=None):
    """Bind a server for `routes`. Port 0 picks a free one (tests). `tls`: an
    ssl.SSLContext (server_tls) or None; `disk`: the state directory a 507 names;
    `scoped` {path: token}: those paths take that token alone, not `token`.
    Nothing but the socket is created, so a refused bind leaves nothing behind."""
    check_bind(host, token, tls, insecure)
    attrs = dict(routes=dict(routes), token=token or None, public=frozenset(public),
                 max_body=max_body, quiet=quiet, disk=disk, scoped=dict(scoped or {}))
    handler = type("BoundHandler", (Handler,), attrs)
    return httpd_loop.Server((host, port), handler, tls, limits)      # a refused bind: SystemExit, one line


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
    d = httpd_loop.Limits()
    g.add_argument("--host", default="127.0.0.1",
                   help="bind address (default 127.0.0.1; a public one needs a token and TLS, or --insecure)")
    g.add_argument("--port", type=int, default=default_port, help=f"TCP port (default {default_port})")
    g.add_argument("--token-file", default=os.environ.get("PWW_TOKEN_FILE"),
                   help="file holding the shared bearer token (default: $PWW_TOKEN_FILE, or $PWW_TOKEN)")
    g.add_argument("--tls-cert", help="PEM certificate (chain) to serve https with (central.sh makes one)")
    g.add_argument("--tls-key", help="PEM private key of --tls-cert")
    g.add_argument("--insecure", action="store_true",
                   help="allow a non-loopback bind without a token or TLS (private networks only)")
    g.add_argument("--max-body-mb", type=float, default=DEFAULT_MAX_BODY / 2**20,
                   help="largest JSON request body accepted, MiB (default 1)")
    g.add_argument("--workers", type=int, default=d.workers,
                   help=f"threads that run requests; idle connections use none (default {d.workers})")
    g.add_argument("--max-connections", type=int, default=d.max_connections,
                   help=f"open connections; beyond it the longest-idle one is closed (default {d.max_connections})")
    g.add_argument("--header-timeout-s", type=float, default=d.header_timeout_s,
                   help=f"a request's headers and JSON body must arrive within this, s (default {d.header_timeout_s:g})")
    g.add_argument("--idle-timeout-s", type=float, default=d.idle_timeout_s,
                   help=f"close a keep-alive connection idle this long, s (default {d.idle_timeout_s:g})")
    g.add_argument("--io-timeout-s", type=float, default=d.io_timeout_s,
                   help=f"a streamed body or reply stalled this long ends, s (default {d.io_timeout_s:g})")
    g.add_argument("--verbose", action="store_true", help="log every request to stderr")
    return g


def server_from_args(a, routes=None, public=("/health",), disk=None, scoped=None):
    """make_server() from add_server_args' flags; bind before creating any state."""
    if bool(a.tls_cert) != bool(a.tls_key):
        raise SystemExit("--tls-cert and --tls-key go together (a certificate and its private key)")
    tls = server_tls(a.tls_cert, a.tls_key) if a.tls_cert else None
    limits = httpd_loop.Limits(a.workers, a.max_connections, a.header_timeout_s, a.idle_timeout_s, a.io_timeout_s)
    return make_server(routes or {}, a.host, a.port, httpc.load_token(a.token_file), a.insecure, public=public,
                       max_body=int(a.max_body_mb * 2**20), quiet=not a.verbose, tls=tls, limits=limits,
                       disk=disk, scoped=scoped)


def with_http_stats(routes, server):
    """GET /status also reports the server's connections (httpd_loop.Server.stats)."""
    status = routes[("GET", "/status")]
    return {**routes, ("GET", "/status"): lambda req: {**status(req), "http": server.stats()}}

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
