"""httpd.py - the HTTP plumbing shared by the three central servers: routes, JSON errors, the
token and per-site credentials, TLS, body limits, and the connection engine under them.

Used on the central VM inside darl_server.py, fedmom_server.py and blobstore.py (make_server,
add_server_args, serve_forever); run on its own only as `python httpd.py site ...`, the
operator's per-site credentials (SITE_DOC; central.sh site wraps it). Standard library +
durable.py and httpc.py; no numpy, no torch. Clients use httpc.py.

What every server gets from here, written once:
  - a route table: {("GET", "/status"): fn, ("PUT", "/blobs/*"): fn, ...}; a trailing "/*"
    matches any suffix, handed to the function as `req.tail`. A route function takes a
    Request and returns a dict (sent as JSON, 200), a (status, dict) pair, or a Response (raw
    bytes or a file range, streamed with sendfile).
  - errors: raise HTTPError(4xx, "one-line reason") anywhere; the client gets {"error": reason,
    ...} and the server keeps serving. Every reply is JSON, the stdlib's own refusals included
    (a malformed request line is a 400, an unknown method a 405 with Allow). A full disk
    (ENOSPC, EDQUOT) in a route is a 507 {"code": "disk_full"} naming the disk, with
    Retry-After; an unexpected exception is a 500 with its one-line text, and is logged.
  - auth: every route but the public ones (/health) requires `Authorization: Bearer <token>`:
    the shared token, a scoped path's own token, or a --credentials one (a site's, a reader's),
    compared with hmac.compare_digest. req.principal says who; req.acts_as(cluster) is a 403
    naming the credential (never the secret) when a site's credential names another cluster.
  - TLS (--tls-cert, --tls-key; TLS 1.2+). Binding beyond loopback needs a token and TLS, or
    --insecure. A plain-HTTP request on a TLS port gets a plain 400 saying "use https://".
  - per request (Handler): JSON bodies capped (--max-body-mb, 413), Transfer-Encoding refused
    (411), conflicting or malformed Content-Length a 400 that ends the connection, a small
    unread body read away, TCP_NODELAY set (with Nagle, a small request after a small response
    waits ~40 ms).

Its parts, in reading order: HTTPError, Response, Request and field(); Handler (one request
on a connection whose headers are in); the server's setup (check_bind, make_server,
add_server_args, server_from_args, base_parser); the connection engine: Limits, Reader and
Writer (a connection's bytes under a deadline) and Server (the poller, the worker pool, the
connection cap and the timeouts); last, per-site credentials (Principal, Keyring, site_main).

    routes = {("GET", "/health"): lambda req: {"ok": True}}
    server = make_server(routes, "127.0.0.1", 0, token=None)
    threading.Thread(target=server.serve_forever).start()    # server.url says where
"""
import argparse
import collections
import contextlib
import dataclasses
import errno
import fcntl
import hashlib
import hmac
import http.server
import io
import ipaddress
import json
import math
import os
import queue
import re
import secrets
import select
import selectors
import signal
import socket
import ssl
import sys
import tempfile
import threading
import time
import traceback
import urllib.parse

import durable
import httpc

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
    """A non-JSON reply: `body` bytes, or `path` + `offset` + `length` streamed from a file,
    or `stream`, an iterable of bytes made while the reply goes out."""

    def __init__(self, status=200, headers=None, body=b"", path=None, offset=0, length=None,
                 content_type="application/octet-stream", file=None, stream=None):
        self.status, self.headers, self.body = status, dict(headers or {}), body
        self.path, self.offset, self.length, self.content_type = path, offset, length, content_type
        # `file`: an already open binary file to stream instead of opening `path` (closed after
        # sending). A route that opens the file itself keeps serving it even if the name is
        # replaced or unlinked before the reply goes out.
        self.file = file
        # `stream`: bytes produced while they are sent (a file still being written, a follow):
        # with `length`, exactly that many bytes (Content-Length; fewer cut the connection, so
        # the client sees a short body); without, chunked. Its close() is called at the end.
        self.stream = stream


class Request:
    """What a route function sees: method, path, query, headers, the body reader."""

    def __init__(self, handler, method, path, query, tail, max_body):
        self.handler, self.method, self.path, self.query, self.tail = handler, method, path, query, tail
        self.headers = handler.headers
        self.rfile = handler.rfile
        self.max_body = max_body
        self.client = handler.client_address[0]
        self.principal = handler.principal         # Principal, or None on a public path
        self.acted_as = None                       # the cluster acts_as let it act as (its last act, /status)

    def acts_as(self, cluster):
        """cluster, if the caller may act as it; else a 403 naming the credential (counted). With
        per-site credentials a cluster id has no "." (a blob id <kind>.<cluster>.<rest> names one)."""
        p = self.principal
        if "." in cluster and self.handler.keyring is not None and self.handler.keyring.has_sites():
            raise HTTPError(400, f"cluster id {cluster[:64]!r}: no '.' in a cluster id once sites have their own "
                                 "credentials (httpd.py site add); rename the site (--site)")
        if p is not None and not p.may_act_as(cluster):
            self.handler.refuse(p, p.why_not(cluster))
        self.acted_as = cluster
        return cluster

    def may_touch_blob(self, blob_id, write):
        """A site credential (and the shared token after `site shared off`) reads and writes its
        own clusters' blobs (blob_owner) and reads the aggregator's; a 403 otherwise."""
        p, owner = self.principal, blob_owner(blob_id)
        if p is None or not p.confined() or (owner == "" and not write):
            return blob_id
        if owner is None or owner == "":
            self.handler.refuse(p, f"{p.describe()} may {'write' if write else 'read'} only blobs named "
                                   f"<{'|'.join(SITE_BLOB_KINDS)}>.<its cluster>.<...>, not {blob_id[:80]!r}")
        self.acts_as(owner)
        return blob_id

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


TLS_SEND_BYTES = 256 << 10          # one reused buffer that stays in the CPU cache


def _send_file(sock, f, offset, length):
    """`length` bytes of `f` from `offset` into `sock` -> the bytes sent. A plain socket:
    os.sendfile (zero copy). TLS: reads of TLS_SEND_BYTES into one buffer, each sent whole
    (socket.sendfile falls back to 8 KiB send() calls there: curl fetched 1 GiB at ~810 MB/s,
    now at ~1000-1300)."""
    if not isinstance(sock, ssl.SSLSocket):
        return sock.sendfile(f, offset, length)
    view = memoryview(bytearray(min(TLS_SEND_BYTES, length)))
    fd, sent = f.fileno(), 0
    while sent < length:
        n = os.preadv(fd, [view[:min(len(view), length - sent)]], offset + sent)
        if not n:
            break
        sock.sendall(view[:n])
        sent += n
    return sent


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"   # keep-alive: one TCP connection for a client's whole session
    routes, token, public, max_body, quiet = {}, None, frozenset(), DEFAULT_MAX_BODY, True
    scoped = {}                     # path -> the one token it takes (a narrower credential than `token`)
    principal = None                # who sent the request being served (_authorized)
    keyring = None                  # Keyring of --credentials: per-site and read-only ones
    aggregator_token = None         # the aggregator's own token on every path (the blob store's)
    read_paths = frozenset({"/status", "/"})      # what a read-only credential may GET
    operator_paths = frozenset()                  # what a site credential may never call
    disk = None                     # the state directory a 507 names
    server_version = "pww"

    def __init__(self, conn, server):
        """One handler per stretch of requests a worker serves on `conn` (not per
        connection: between requests the poller holds the bare socket)."""
        self.request = self.connection = conn.sock
        self.client_address, self.server = conn.addr, server
        self.reader = Reader(conn, server.limits.io_timeout_s)
        self.rfile = io.BufferedReader(self.reader, 16 << 10)
        self.wfile = Writer(conn.sock)
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
        """Who the bearer is (self.principal), or a refusal: 401 for no credential of ours,
        403 for one revoked, ended, or not for this path (counted per credential)."""
        self.principal = None
        scheme, _, cred = self.headers.get("Authorization", "").strip().partition(" ")
        cred = cred.strip() if scheme.lower() == "bearer" else ""
        scoped = self.scoped.get(path)
        if scoped is not None:
            if _same(cred, scoped):
                self.principal = Principal("aggregator", "aggregator")
            else:                             # a site's credential here: refused under its own key
                other = self.keyring.identify(cred)[0] if self.keyring is not None else None
                if other is not None:
                    self.refuse(other, f"{other.describe()} may not call {self.command} {path}: the aggregator's "
                                       "own token does")
        elif self.aggregator_token is not None and _same(cred, self.aggregator_token):
            self.principal = Principal("aggregator", "aggregator")
        elif self.token is None and self.keyring is None:
            self.principal = Principal("open", "open")
        elif self.token is not None and _same(cred, self.token):
            self.principal = self.keyring.shared() if self.keyring else Principal("shared", "shared")
        elif self.keyring is not None and cred:
            p, why = self.keyring.identify(cred)
            if why is not None and path not in self.public:
                self.refuse(p, why)
            self.principal = p if why is None else None
        self.authorized = self.principal is not None
        if not self.authorized:
            if path in self.public:
                return
            if self.keyring is not None:
                self.keyring.note_refusal(None, f"{self.command} {path}", "missing or wrong bearer token")
            raise HTTPError(401, "missing or wrong bearer token (Authorization: Bearer <token>)")
        p = self.principal
        if p.kind == "read" and not (self.command in ("GET", "HEAD") and path in self.read_paths | self.public):
            self.refuse(p, f"{p.describe()} is read-only: it may GET {', '.join(sorted(self.read_paths))}, "
                           f"not {self.command} {path}")
        if p.kind == "site" and path in self.operator_paths:
            self.refuse(p, f"{p.describe()} may not call {self.command} {path}: the aggregator's own token does")

    def refuse(self, p, why):
        """403 with one line naming the credential (counted under it on /status)."""
        if self.keyring is not None:
            self.keyring.note_refusal(p, f"{self.command} {urllib.parse.urlsplit(self.path).path}", why)
        raise HTTPError(403, why, code="forbidden")

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
            self._authorized(url.path)
            fn, tail = _lookup(self.routes, method, url.path)
            req = Request(self, method, url.path, query, tail, self.max_body)
            out = fn(req)
            if self.principal is not None and self.principal.key is not None:      # its last act: done, not tried
                self.keyring.note_act(self.principal, f"{method} {url.path}", req.acted_as)
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
        if r.stream is not None:
            return self._send_stream(r)
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
                sent = _send_file(self.connection, f, r.offset, length)
                if sent != length:
                    self.close_connection = True
                    raise ConnectionError(f"file ended after {sent} of {length} bytes")
        finally:
            if f is not None:
                f.close()

    def _send_stream(self, r):
        """A Response(stream=): each piece sent as it comes; a stream that raises, or ends
        short of `length`, ends the connection (the client's body is short, never wrong)."""
        sent, chunked = 0, r.length is None
        try:
            self.send_response(r.status)
            self.send_header("Content-Type", r.content_type)
            self.send_header("Transfer-Encoding", "chunked") if chunked else \
                self.send_header("Content-Length", str(r.length))
            for k, v in r.headers.items():
                self.send_header(k, str(v))
            self.end_headers()
            if self.command == "HEAD":
                return
            for piece in r.stream:
                if not piece:
                    continue
                if chunked:
                    self.wfile.write(b"%x\r\n" % len(piece))
                self.wfile.write(piece)
                if chunked:
                    self.wfile.write(b"\r\n")
                sent += len(piece)
            if chunked:
                self.wfile.write(b"0\r\n\r\n")
            elif sent != r.length:
                self.close_connection = True
                self.log_message("%s %s: stream ended after %d of %d bytes", self.command, self.path, sent, r.length)
        except (ConnectionError, socket.timeout, OSError) as e:
            self.close_connection = True          # the client went, or the stream's source failed
            self.log_message("%s %s: stream cut after %d bytes: %s", self.command, self.path, sent, e)
        except BaseException:
            self.close_connection = True
            raise
        finally:
            close = getattr(r.stream, "close", None)
            if close is not None:
                close()

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


def _same(cred, token):
    return hmac.compare_digest(cred.encode("utf-8", "replace"), token.encode("utf-8"))


def check_bind(host, token, tls, insecure, keyring=None):
    """A public bind needs a token (who may call) and TLS (so the token is not sent in clear)."""
    if is_loopback(host) or insecure:
        return
    missing = ([] if token or keyring else ["a token (--token-file FILE, or $PWW_TOKEN)"]) + \
              ([] if tls else ["TLS (--tls-cert FILE --tls-key FILE)"])
    if missing:
        raise SystemExit(f"refusing to listen on {host!r} without {' and '.join(missing)}: "
                         "pass them, or --insecure if the network is private")


def make_server(routes, host="127.0.0.1", port=0, token=None, insecure=False,
                public=("/health",), max_body=DEFAULT_MAX_BODY, quiet=True, tls=None, limits=None,
                disk=None, scoped=None, keyring=None, read_paths=None, operator_paths=(), aggregator_token=None):
    """Bind a server for `routes`. Port 0 picks a free one (tests). `tls`: an
    ssl.SSLContext (server_tls) or None; `disk`: the state directory a 507 names;
    `scoped` {path: token}: those paths take that token alone, not `token`; `keyring`: a
    Keyring (per-site and read-only credentials), `read_paths` what a read one
    may GET (default /status and /), `operator_paths` what a site one may never call;
    `aggregator_token`: the aggregator's own token, which may do anything here.
    Nothing but the socket is created, so a refused bind leaves nothing behind."""
    check_bind(host, token, tls, insecure, keyring)
    attrs = dict(routes=dict(routes), token=token or None, public=frozenset(public),
                 max_body=max_body, quiet=quiet, disk=disk, scoped=dict(scoped or {}), keyring=keyring,
                 read_paths=frozenset(read_paths or Handler.read_paths), operator_paths=frozenset(operator_paths),
                 aggregator_token=aggregator_token or None)
    handler = type("BoundHandler", (Handler,), attrs)
    return Server((host, port), handler, tls, limits)      # a refused bind: SystemExit, one line


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
    d = Limits()
    g.add_argument("--host", default="127.0.0.1",
                   help="bind address (default 127.0.0.1; a public one needs a token and TLS, or --insecure)")
    g.add_argument("--port", type=int, default=default_port, help=f"TCP port (default {default_port})")
    g.add_argument("--token-file", default=os.environ.get("PWW_TOKEN_FILE"),
                   help="file holding the shared bearer token (default: $PWW_TOKEN_FILE, or $PWW_TOKEN)")
    g.add_argument("--credentials", default=os.environ.get("PWW_CREDENTIALS_FILE"),
                   help="the per-site credentials file (httpd.py site --help; re-read within a second of a change, "
                        "no restart); with --token-file both are taken (default $PWW_CREDENTIALS_FILE)")
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


def server_from_args(a, routes=None, public=("/health",), disk=None, scoped=None, read_paths=None,
                     operator_paths=(), aggregator_token=None):
    """make_server() from add_server_args' flags; bind before creating any state."""
    if bool(a.tls_cert) != bool(a.tls_key):
        raise SystemExit("--tls-cert and --tls-key go together (a certificate and its private key)")
    tls = server_tls(a.tls_cert, a.tls_key) if a.tls_cert else None
    limits = Limits(a.workers, a.max_connections, a.header_timeout_s, a.idle_timeout_s, a.io_timeout_s)
    return make_server(routes or {}, a.host, a.port, httpc.load_token(a.token_file), a.insecure, public=public,
                       max_body=int(a.max_body_mb * 2**20), quiet=not a.verbose, tls=tls, limits=limits,
                       disk=disk, scoped=scoped, keyring=Keyring(a.credentials) if a.credentials else None,
                       read_paths=read_paths, operator_paths=operator_paths, aggregator_token=aggregator_token)


def with_http_stats(routes, server):
    """GET /status also reports the server's connections (Server.stats) and, with
    --credentials, each credential's state, last act and refusals (Keyring.view)."""
    status, keyring = routes[("GET", "/status")], server.RequestHandlerClass.keyring
    return {**routes, ("GET", "/status"): lambda req: {**status(req), "http": server.stats(),
                                                       **({"auth": keyring.view()} if keyring and sees_auth(req) else {})}}


def sees_auth(req):
    """Who may see the credentials' list and counts (never a secret, but an inventory): the
    shared or aggregator token, a read credential; not a site's, not an anonymous caller."""
    return req.principal is not None and req.principal.kind in ("shared", "aggregator", "read", "open")

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


# ==== the connection engine: one epoll poller thread, a pool of workers ===========================
# The poller accepts, runs TLS handshakes and reads request headers without blocking; a request
# runs on one of --workers threads (64) only once its headers are in, so an idle keep-alive or a
# half-open connection costs a socket in the epoll set and a few KiB, never a thread. At most
# --max-connections (4096) are open; one more closes the one idle longest. Timeouts: the first
# request, and every request's headers and JSON body, within --header-timeout-s (10 s: a
# slowloris is cut off there); a keep-alive connection idle --idle-timeout-s (60 s) is closed; a
# streamed body or reply without progress for --io-timeout-s (60 s) ends. Headers are capped at
# 64 KiB (431); a TLS hello on a plain port is hung up on. A worker hands a connection to
# `handler_class(conn, server).serve_ready()` (Handler), which reads through a Reader (the bytes
# the poller read, then the socket, under a deadline), writes through a Writer, and says whether
# to keep it; a kept one goes back to the poller. Nothing here knows routes or tokens.

_HEADER_END = (b"\r\n\r\n", b"\n\n")   # the blank line that ends a request's headers


@dataclasses.dataclass
class Limits:
    """What the connections of one server may cost; every field has a flag (add_server_args)."""
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

# ==== per-site credentials: who a request is (Keyring), and the operator's commands ==========
SITE_DOC = """httpd.py site - one bearer credential per site, made and revoked on the central VM; the
three servers check every request against it and see a change within a second, with no restart.

  python httpd.py site add lumi --clusters lumi,lumi-b --out DIR   # DIR/lumi.token (mode 600)
  python httpd.py site rotate lumi --grace-s 3600 --out DIR        # a new one; the old one ends later
  python httpd.py site revoke lumi                                  # refused within a second
  python httpd.py site read alice --out DIR      # read-only: GET /status and the status page
  python httpd.py site shared off                # the shared token no longer acts as any site
  python httpd.py site list                      # every credential, its state; never a secret
  every command takes --file FILE (default $PWW_CREDENTIALS_FILE; central.sh: $STATE/credentials.json)

central.sh site add|rotate|revoke|read|shared|list runs these with its state dir. The servers
read the file given by --credentials (httpd.py); the file holds each credential's sha256, never
the secret, so reading it gives no one a way in. A credential is `pww1.<key>.<secret>`: the key
(8 hex digits) names it in logs, /status and refusals; the secret (256 bits) is only in the
token file the site keeps. Stdlib only (runs on the central VM and at the sites).

A site credential may act only as its cluster ids (register, lease, heartbeat, release at DARL;
join, heartbeat, deltas at FedMom; its own blobs `delta.<cluster>.*` and `check.<cluster>.*` in
the blob store) and read theta; never DARL's custody routes (the aggregator's own token) nor the
blob listing. A read credential may GET /status, /health and the status page only. The shared
token (--token-file) keeps every right until `shared off`; then it acts as no site and reaches no
site's blob (the aggregator uses its own token there: blobstore.py --aggregator-token-file). The
file is checked as it is read: a missing, unreadable or invalid one keeps the last good contents
(and says so on /status). FEDERATION_GUIDE.md, "Identity"; RUNBOOK.md section 1.
"""

VERSION = 1
PREFIX = "pww1"
RELOAD_S = 1.0                     # a server looks at the file at most this often: a revocation's delay
ALARM_WINDOW_S = 300.0             # refusals of one credential counted over this window...
ALARM_REFUSALS = 20                # ...alarm at this many (a stolen or stale credential knocking)
NAME_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")      # site names and cluster ids: no "." (blob ids use it)
SITE_BLOB_KINDS = ("delta", "check")               # blob ids a site writes: <kind>.<cluster>.<rest>


class Principal:
    """Who a request is. kind: "site" (its cluster ids), "read", "shared" (the --token-file
    token), "aggregator" (a scoped path's token), "open" (a server with no auth at all)."""

    def __init__(self, kind, name, clusters=(), key=None, acts=True):
        self.kind, self.name, self.clusters, self.key, self.acts = kind, name, tuple(clusters), key, acts

    def may_act_as(self, cluster):
        if self.kind == "site":
            return cluster in self.clusters
        return self.kind in ("aggregator", "open") or (self.kind == "shared" and self.acts)

    def confined(self):
        """Held to its own blobs: a site's credential, and the shared token after `shared off`."""
        return self.kind == "site" or (self.kind == "shared" and not self.acts)

    def why_not(self, cluster):
        if self.kind == "shared":
            return (f"the shared token no longer acts as a site (httpd.py site shared off): give cluster "
                    f"{cluster!r} its site's own credential")
        if self.kind == "read":
            return f"{self.describe()} is read-only"
        return f"{self.describe()} may not act as cluster {cluster!r} (it may: {', '.join(self.clusters)})"

    def describe(self):
        if self.key is None:
            return f"the {self.kind} token"
        return f"credential of {'site' if self.kind == 'site' else 'reader'} {self.name!r} (key {self.key})"


def blob_owner(blob_id):
    """The cluster id a site-written blob id names (<kind>.<cluster>.<rest>), or "" for one no
    site writes (the aggregator's theta and update blobs); None for the old `delta-...` ids,
    which name their cluster ambiguously (only the shared token may touch those)."""
    parts = blob_id.split(".", 2)
    if len(parts) == 3 and parts[0] in SITE_BLOB_KINDS:
        return parts[1]
    if blob_id.startswith(tuple(k + "-" for k in SITE_BLOB_KINDS)):
        return None
    return ""


def digest(secret):
    return hashlib.sha256(secret.encode()).hexdigest()


class Keyring:
    """The credentials file as the servers see it: reloaded when it changes (checked at most
    every RELOAD_S), the last acts and refusals of each credential in memory (view())."""

    def __init__(self, path, reload_s=RELOAD_S):
        self.path, self.reload_s = path, reload_s
        self.lock = threading.Lock()
        self.entries, self.shared_acts, self.sig, self.checked = {}, True, None, -1e18
        self.file_error = None
        self.acted, self.refused = {}, {}      # key -> last act {...}; key ("unknown") -> refusal stats
        self._reload()
        if self.file_error:
            raise SystemExit(f"--credentials {path}: {self.file_error}")

    def _reload(self):
        """The file's contents if it changed; the last good ones kept (and file_error set) while
        it is missing, unreadable or invalid: a bad edit never opens a door nor locks every site out."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            if self.sig is not None:          # it was there: keep what it said
                self.file_error = "missing; the previous contents kept"
            return                            # never there: none made yet, the shared token only
        except OSError as e:
            self.file_error = f"cannot read: {e.strerror}; the previous contents kept"
            return
        sig = (st.st_ino, st.st_size, st.st_mtime_ns)
        if sig == self.sig and self.file_error is None:
            return
        try:
            with open(self.path) as f:
                doc = json.load(f)
            entries = {e["key"]: _valid(e) for e in doc["credentials"]}
            shared_acts = doc.get("shared_acts_as_site", True)
            if not isinstance(shared_acts, bool):
                raise ValueError(f"shared_acts_as_site is {shared_acts!r}, not true or false")
            self.entries, self.shared_acts, self.sig, self.file_error = entries, shared_acts, sig, None
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            self.file_error = f"unreadable, the previous contents kept: {type(e).__name__}: {e}"

    def current(self):
        with self.lock:
            now = time.monotonic()
            if now - self.checked >= self.reload_s:
                self.checked = now
                self._reload()
            return self.entries, self.shared_acts

    def shared(self):
        return Principal("shared", "shared", acts=self.current()[1])

    def has_sites(self):
        return any(e["role"] == "site" for e in self.current()[0].values())

    def identify(self, bearer):
        """-> (Principal, None) for a live credential; (None, reason) for one revoked or
        expired (the caller answers 403); (None, None) when the bearer is none of ours."""
        m = re.fullmatch(PREFIX + r"\.([0-9a-f]{8})\.([0-9a-f]{64})", bearer or "")
        e = m and self.current()[0].get(m.group(1))
        if not e or not hmac.compare_digest(digest(bearer), e["sha256"]):
            return None, None
        p = Principal(e["role"], e["name"], e.get("clusters", ()), e["key"])
        if e.get("revoked_at") is not None:
            return p, f"{p.describe()} was revoked at {_utc(e['revoked_at'])}"
        if e.get("not_after") is not None and time.time() >= e["not_after"]:
            return p, f"{p.describe()} was replaced; it ended at {_utc(e['not_after'])}"
        return p, None

    def note_act(self, p, route, cluster=None):
        if p.key is None:
            return
        with self.lock:
            row = self.acted.setdefault(p.key, {"key": p.key, "name": p.name, "role": p.kind})
            row.update(at=time.time(), route=route, **({"as": cluster} if cluster else {}))

    def note_refusal(self, p, route, why):
        """Count a refused request under its credential ("unknown" for a bearer none of ours)."""
        key = p.key if p is not None and p.key else (p.kind if p is not None else "unknown")
        with self.lock:
            r = self.refused.setdefault(key, {"key": key, "name": p.name if p else "unknown", "count": 0,
                                              "recent": []})
            now = time.time()
            r["count"] += 1
            r["last"], r["route"], r["why"] = now, route, why
            r["recent"] = [t for t in r["recent"] if t > now - ALARM_WINDOW_S][-ALARM_REFUSALS:] + [now]

    def view(self):
        """For /status: each credential's site, state, last act and refusals; never a secret."""
        entries, shared_acts = self.current()
        now = time.time()
        with self.lock:
            rows = []
            for e in entries.values():
                state = "revoked" if e.get("revoked_at") is not None else \
                    "ended" if e.get("not_after") is not None and now >= e["not_after"] else \
                    "ending" if e.get("not_after") is not None else "live"
                rows.append({k: e.get(k) for k in ("key", "name", "role", "clusters", "created", "not_after",
                                                   "revoked_at")} | {"state": state,
                                                                     "last_act": self.acted.get(e["key"])})
            refused = [{k: v for k, v in r.items() if k != "recent"} | {"last_5min": len(r["recent"])}
                       for r in self.refused.values()]
            alarms = [f"{r['count']} requests refused for {r['name']!r} (key {r['key']}), "
                      f"{len([t for t in r['recent'] if t > now - ALARM_WINDOW_S])} in the last "
                      f"{ALARM_WINDOW_S / 60:.0f} min; last: {r['route']}: {r['why']}"
                      for r in self.refused.values()
                      if len([t for t in r["recent"] if t > now - ALARM_WINDOW_S]) >= ALARM_REFUSALS]
        return {"file": self.path, "file_error": self.file_error, "shared_acts_as_site": shared_acts,
                "credentials": rows, "refused": refused, "alarms": alarms}


def _valid(e):
    """A credential entry as the file holds it, checked: its key, hash, role and clusters."""
    ok = (re.fullmatch(r"[0-9a-f]{8}", str(e.get("key"))) and re.fullmatch(r"[0-9a-f]{64}", str(e.get("sha256")))
          and e.get("role") in ("site", "read") and isinstance(e.get("name"), str)
          and isinstance(e.get("clusters"), list) and all(isinstance(c, str) and NAME_RE.fullmatch(c)
                                                         for c in e["clusters"])
          and all(isinstance(e.get(k), (int, float, type(None))) for k in ("not_after", "revoked_at")))
    if not ok:
        raise ValueError(f"credential {str(e.get('key'))[:8]!r} ({str(e.get('name'))[:64]!r}) is not valid: "
                         "key, sha256, role (site or read), name, clusters, not_after, revoked_at")
    return e


def _utc(t):
    return time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(t))


# ==== the operator's side: the file, changed under a lock, written atomically =====================

@contextlib.contextmanager
def _editing(path):
    """The credentials file's contents to change; written (atomically, fsynced) on exit."""
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    with open(path + ".lock", "a") as lk:
        fcntl.flock(lk, fcntl.LOCK_EX)
        try:
            doc = _load(path)
        except FileNotFoundError:
            doc = {"version": VERSION, "shared_acts_as_site": True, "credentials": []}
        yield doc
        _write_private(path, json.dumps(doc, indent=1, sort_keys=True) + "\n")


def _load(path):
    """The credentials file, checked as the servers check it (Keyring._reload); one line if it is not."""
    with open(path) as f:
        try:
            doc = json.load(f)
            for e in doc["credentials"]:
                _valid(e)
            if not isinstance(doc.get("shared_acts_as_site", True), bool):
                raise ValueError("shared_acts_as_site is not true or false")
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise SystemExit(f"{path}: not a credentials file the servers accept ({type(e).__name__}: {e}); fix "
                             "it, or restore it from a backup") from None
    return doc


def _write_private(path, text):
    """path's new content, mode 600 from its first byte, renamed in (durable.replacing)."""
    with durable.replacing(path) as tmp:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())


def _new(doc, role, name, clusters):
    key = secrets.token_hex(4)
    while any(e["key"] == key for e in doc["credentials"]):
        key = secrets.token_hex(4)
    secret = f"{PREFIX}.{key}.{secrets.token_hex(32)}"
    doc["credentials"].append({"key": key, "name": name, "role": role, "clusters": list(clusters),
                               "sha256": digest(secret), "created": time.time(), "not_after": None,
                               "revoked_at": None})
    return key, secret


def _name_free(doc, name):
    """One name, one holder: a site and a reader never share one (their token files would)."""
    held = [e for e in doc["credentials"] if e["name"] == name and e.get("revoked_at") is None]
    if held:
        raise SystemExit(f"{name!r} already has a live credential ({held[0]['role']}, key {held[0]['key']}): "
                         "rotate it, revoke it first, or pick another name")


def _live(doc, name):
    return [e for e in doc["credentials"] if e["name"] == name and e.get("revoked_at") is None
            and (e.get("not_after") is None or e["not_after"] > time.time())]


def _write_token(out, name, secret):
    os.makedirs(out, mode=0o700, exist_ok=True)
    path = os.path.join(out, f"{name}.token")
    _write_private(path, secret + "\n")
    return path


def _name(value, what):
    if not NAME_RE.fullmatch(value or ""):
        raise SystemExit(f"{what} {value!r}: use 1-64 of [A-Za-z0-9_-] (no dots)")
    return value


def site_main(argv=None):
    p = argparse.ArgumentParser(prog="httpd.py site", description=SITE_DOC.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(SITE_DOC.split("\n\n")[1:]))
    p.add_argument("--file", default=os.environ.get("PWW_CREDENTIALS_FILE"),
                   help="the credentials file the servers read with --credentials (default $PWW_CREDENTIALS_FILE)")
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("add", help="a new site and its credential")
    a.add_argument("site")
    a.add_argument("--clusters", help="cluster ids it may act as, comma-separated (default: the site's name)")
    r = sub.add_parser("rotate", help="a new credential for a site; its old ones end after --grace-s")
    r.add_argument("site")
    r.add_argument("--grace-s", type=float, default=3600.0, help="the old ones keep working this long (default 3600)")
    for s in (a, r):
        s.add_argument("--out", required=True, help="directory for <site>.token (mode 600): copy it to the site")
    v = sub.add_parser("revoke", help="end every credential of a site (or reader) now")
    v.add_argument("name")
    rd = sub.add_parser("read", help="a read-only credential for a person: GET /status and the status page")
    rd.add_argument("name")
    rd.add_argument("--out", required=True)
    sh = sub.add_parser("shared", help="whether the shared token (--token-file) still acts as any site")
    sh.add_argument("acts", choices=("on", "off"))
    sub.add_parser("list", help="every credential and its state (never a secret)")
    a = p.parse_args(argv)
    if not a.file:
        p.error("--file (or $PWW_CREDENTIALS_FILE) is required")
    return COMMANDS[a.cmd](a)


def _add(a):
    name = _name(a.site, "site")
    clusters = [_name(c.strip(), "cluster id") for c in (a.clusters or name).split(",") if c.strip()]
    with _editing(a.file) as doc:
        taken = {c: e["name"] for e in doc["credentials"] if e["role"] == "site" and e.get("revoked_at") is None
                 for c in e["clusters"] if e["name"] != name}
        _name_free(doc, name)
        clash = [f"{c} (site {taken[c]!r})" for c in clusters if c in taken]
        if clash:
            raise SystemExit(f"cluster ids already bound to another site: {', '.join(clash)}")
        key, secret = _new(doc, "site", name, clusters)
        path = _write_token(a.out, name, secret)
    print(f"site {name!r}: credential key {key}, acts as {', '.join(clusters)}; written to {path} (mode 600):\n"
          f"copy it to the site and point PWW_TOKEN_FILE at the copy (the servers take it within {RELOAD_S:g} s)")


def _rotate(a):
    with _editing(a.file) as doc:
        old = [e for e in _live(doc, a.site) if e["role"] == "site"]
        if not old:
            raise SystemExit(f"no live credential of site {a.site!r} to rotate: add it")
        end = time.time() + max(0.0, a.grace_s)
        for e in old:
            e["not_after"] = min(end, e["not_after"] or end)
        key, secret = _new(doc, "site", a.site, old[-1]["clusters"])
        path = _write_token(a.out, a.site, secret)
    print(f"site {a.site!r}: new credential key {key} in {path}; the old ({', '.join(e['key'] for e in old)}) "
          f"keep working until {_utc(end)}")


def _revoke(a):
    with _editing(a.file) as doc:
        hit = [e for e in doc["credentials"] if e["name"] == a.name and e.get("revoked_at") is None]
        if not hit:
            raise SystemExit(f"no credential named {a.name!r} to revoke (list shows them)")
        for e in hit:
            e["revoked_at"] = time.time()
    print(f"revoked {a.name!r} (keys {', '.join(e['key'] for e in hit)}): refused by every server within "
          f"{RELOAD_S:g} s; its open leases expire as a dead site's do")


def _read(a):
    name = _name(a.name, "reader")
    with _editing(a.file) as doc:
        _name_free(doc, name)
        key, secret = _new(doc, "read", name, ())
        path = _write_token(a.out, name, secret)
    print(f"reader {name!r}: key {key}, GET /status and the status page only; written to {path} (mode 600)")


def _shared(a):
    with _editing(a.file) as doc:
        doc["shared_acts_as_site"] = a.acts == "on"
    print(f"the shared token {'acts as any site again' if a.acts == 'on' else 'no longer acts as a site'} "
          f"(every server within {RELOAD_S:g} s)")


def _list(a):
    try:
        doc = _load(a.file)
    except FileNotFoundError:
        print(f"no credentials yet ({a.file}): every site uses the shared token")
        return
    print(f"shared token acts as a site: {'yes' if doc.get('shared_acts_as_site', True) else 'no'}")
    now = time.time()
    for e in doc["credentials"]:
        state = f"revoked {_utc(e['revoked_at'])}" if e.get("revoked_at") is not None else \
            (f"ends {_utc(e['not_after'])}" if e["not_after"] > now else "ended") if e.get("not_after") else "live"
        print(f"{e['name']:<16} key {e['key']}  {e['role']:<5} {','.join(e['clusters']) or '-':<24} {state}")


COMMANDS = {"add": _add, "rotate": _rotate, "revoke": _revoke, "read": _read, "shared": _shared, "list": _list}


if __name__ == "__main__":
    sys.exit(site_main(sys.argv[2:] if sys.argv[1:2] == ["site"] else ["--help"]))
