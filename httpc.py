"""httpc.py - the HTTP client every caller of the central servers uses: one JSON call, the
connection under it (https with the caller's CA, direct or through the site's proxy), the token.
Runs everywhere (sites' rank 0, the central servers' calls to each other, status commands,
tools, tests). Python standard library only; no server, no port, no state.

    reply = httpc.call("https://central:29510", "GET", "/status", token=TOKEN, ca_file="ca.pem")
    conn = httpc.connect(url, timeout, ca_file)          # a keep-alive connection of your own

Errors: status >= 400 is a CallError (.status, .reply: the server's JSON, its reason in
.reply["error"]); an unreachable server an OSError or http.client.HTTPException, its str()
naming the route tried and the fix; a setup no retry fixes (an untrusted certificate, no TLS,
a proxy's 403/407, a bad proxy URL) a TLSConfigError (RouteError: the proxy's). call() never repeats.

The route (route(url).describe() names it, never with credentials), decided per connection:
loopback (127/8, ::1, localhost) is always direct; else the explicit override, --proxy URL|none
(add_client_args; train.py's --proxy via set_proxy), else $PWW_PROXY (none: direct); else curl's
rules: no_proxy/NO_PROXY (* alone, or comma/space separated host or domain suffix, leading dot
optional, IP or CIDR for IP literals) means direct, else https_proxy/HTTPS_PROXY (https://),
http_proxy (http://, lowercase only), then all_proxy/ALL_PROXY. Proxies: http:// (a CONNECT
tunnel, http:// targets too; user:pass in the URL, percent-encoded, as Basic auth), socks5h://
(the proxy resolves the name), socks5:// (resolved here); port 1080 when none, as curl. TLS is
verified against the URL's host through the tunnel. TCP connect + the proxy's handshake get
CONNECT_TIMEOUT_S, then the caller's timeout applies to reads.

The retry policy, used by every client and the servers' calls to each other:
  - One Deadline per call, made by the outermost caller and passed down: how long the call may
    go WITHOUT PROGRESS (no answer, no byte moved) before it gives up. retry() is the one loop
    that repeats anything: the worst case is that one number (a site's: RETRY_S, 900 s).
  - Repeated (repeatable()): an unreachable server or a broken connection, and a 5xx; a 4xx
    only when the server says "retry": true or the caller names the 409 code it waits out
    (incarnation_conflict). Never another 4xx. Every call of ours is safe to send twice.
  - Between attempts: 0.2 s, doubling, at most max_wait_s (5 s), with jitter, never past the
    deadline; each repeat is logged at once (its line names the route). Then GaveUp (a
    TimeoutError) naming the call, the seconds, the attempts and the last error.

    d = httpc.Deadline(httpc.RETRY_S, what="send delta")
    client.send_delta(path, ..., deadline=d)          # repeats inside, under d; raises GaveUp
A client method given no deadline makes one attempt and raises what it met. Why each repeat
is safe: FEDERATION_GUIDE.md, "What a site repeats, and for how long".
"""
import argparse
import base64
import functools
import http.client
import ipaddress
import json
import os
import random
import re
import socket
import ssl
import sys
import time
import urllib.parse

import durable

RETRY_S = 900.0           # a site's call to the central VM: seconds without progress before it gives up
MAX_WAIT_S = 5.0          # the longest pause between two attempts of a call
FIRST_WAIT_S = 0.2        # the first pause; each next one doubles
MIN_TIMEOUT_S = 1.0       # an attempt's socket timeout is what the deadline has left, but not below this
INCARNATION_CONFLICT = "incarnation_conflict"   # the 409 code a register or join waits out
# TCP connect plus a proxy's handshake: a path that drops packets is named within 10 s, not
# after the read timeout (30 s for a call, up to RETRY_S's share for a transfer)
CONNECT_TIMEOUT_S = 10.0


def add_client_args(parser):
    """--token-file and --ca-file for a command that calls a central server."""
    parser.add_argument("--token-file", default=os.environ.get("PWW_TOKEN_FILE"),
                        help="bearer token file (default $PWW_TOKEN_FILE, or $PWW_TOKEN)")
    parser.add_argument("--ca-file", default=os.environ.get("PWW_CA_FILE"),
                        help="CA certificate for https:// URLs (default $PWW_CA_FILE, else the system's)")
    parser.add_argument("--proxy", action=ProxyFlag, metavar="URL|none",
                        help="the site's proxy to the central VM: http://HOST:PORT, socks5h://HOST:PORT, or none "
                             "(default $PWW_PROXY, else https_proxy/all_proxy/no_proxy as curl reads them)")


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


class CallError(Exception):
    """A reply with status >= 400 from a server: carries the status and the JSON reply."""

    def __init__(self, status, reply):
        super().__init__(f"HTTP {status}: {reply.get('error', reply)}")
        self.status, self.reply = status, reply


class TLSConfigError(Exception):
    """The TLS setup cannot work (an unknown CA, a server that speaks no TLS): retrying
    will not help, so this is not an OSError."""


def split_url(url):
    u = urllib.parse.urlsplit(url if "://" in url else "http://" + url)
    if u.scheme not in ("http", "https"):
        raise ValueError(f"unsupported URL scheme in {url!r}")
    return u.scheme, u.hostname or "127.0.0.1", u.port or (443 if u.scheme == "https" else 80), u.path.rstrip("/")


@functools.lru_cache(maxsize=8)
def client_tls(ca_file=None):
    """Verify the server against `ca_file` (central.sh's ca.pem), or the system's CAs."""
    try:
        return ssl.create_default_context(cafile=ca_file)
    except (OSError, ssl.SSLError) as e:
        raise TLSConfigError(f"cannot load the CA file {ca_file} (--ca-file / $PWW_CA_FILE): {e}")


# ---------------------------------------------------------------- the route (module docstring)

class RouteError(TLSConfigError):
    """A route no retry fixes: a bad proxy URL, a proxy's 403 or 407, a SOCKS refusal by rule.
    A TLSConfigError, so every caller that stops on a bad setup stops on it too."""


_override = None     # (value, source): set_proxy(), made once by a command from its --proxy


def set_proxy(value, source="--proxy"):
    """Every later connect() takes `value` (a proxy URL, or "none": direct) over $PWW_PROXY and
    the environment; None gives the choice back to them. A bad URL raises RouteError here."""
    global _override
    if value is not None and value.strip().lower() != "none":
        parse_proxy(value, source)
    _override = None if value is None else (value, source)


class ProxyFlag(argparse.Action):
    """--proxy URL|none: set_proxy() as the command line is parsed (a bad URL: the parser's error)."""

    def __call__(self, parser, namespace, value, option_string=None):
        try:
            set_proxy(value, option_string)
        except RouteError as e:
            parser.error(str(e))
        setattr(namespace, self.dest, value)


class Route:
    """How connect() reaches a host: direct, or through one proxy (scheme http, socks5 or
    socks5h). `source` says who chose it ("$https_proxy", "--proxy", "loopback", ...).
    describe(), repr() and every error name the proxy without its credentials."""

    def __init__(self, source=None, scheme=None, host=None, port=None, user=None, password=None):
        self.source, self.scheme, self.host, self.port = source, scheme, host, port
        self._user, self._password = user, password

    def describe(self):
        if self.scheme is None:
            return "direct" + (f" ({self.source})" if self.source else "")
        return f"proxy {self.scheme}://{_hostport(self.host, self.port)} (from {self.source})"

    def __repr__(self):
        return f"<Route {self.describe()}>"

    def open(self, host, port, timeout, where):
        """A socket connected to host:port along this route, its timeout `timeout` (None: blocking);
        connecting and the proxy's handshake get at most CONNECT_TIMEOUT_S. Errors name `where`."""
        quick = CONNECT_TIMEOUT_S if timeout is None else min(timeout, CONNECT_TIMEOUT_S)
        if self.scheme is None:
            sock = _tcp(host, port, quick, where, self._direct_fix(where))
        else:
            sock = _tcp(self.host, self.port, quick, where,
                        f"check {self.source} (the site's proxy host and port)", proxy=True)
            try:
                if self.scheme == "http":
                    _http_connect(sock, host, port, self, where)
                else:
                    _socks5_connect(sock, host, port, self, where)
            except BaseException:
                sock.close()
                raise
        sock.settimeout(timeout)
        return sock

    def _direct_fix(self, where):
        var = "https_proxy" if where.startswith("https:") else "http_proxy"
        if self.source == "loopback":
            return "is the server running, on that port?"
        if self.source and "none" in self.source:
            return f"this route is direct because of {self.source}: drop it to use the site's proxy"
        if self.source:
            return f"the host is in {self.source}: take it out to go through the site's proxy"
        return f"set {var} to the site's proxy (compute nodes often reach out only through it)"


def _hostport(host, port):
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _ip(text):
    try:
        return ipaddress.ip_address(text.strip("[]"))
    except ValueError:
        return None


def parse_proxy(value, source):
    """-> Route for the proxy URL `value` (from `source`); RouteError naming `source`, never the
    value (it may hold a password)."""
    u = urllib.parse.urlsplit(value.strip() if "://" in value else "http://" + value.strip())
    scheme = u.scheme.lower()
    if scheme not in ("http", "socks5", "socks5h"):
        raise RouteError(f"{source}: a {scheme}:// proxy is not supported: use http://HOST:PORT (a CONNECT "
                         "proxy), socks5h://HOST:PORT or socks5://HOST:PORT (ssh -D PORT on a login node)")
    try:
        port = u.port or 1080                           # curl's default proxy port, whatever the scheme
    except ValueError:
        port = None
    if not u.hostname or port is None:
        raise RouteError(f"{source}: not a proxy URL (want SCHEME://[USER:PASS@]HOST:PORT)")
    unq = urllib.parse.unquote
    return Route(source, scheme, u.hostname, port, None if u.username is None else unq(u.username),
                 None if u.password is None else unq(u.password))


def no_proxy_match(host, value):
    """Does `host` match the no_proxy list `value`, by curl's rules (module docstring)?"""
    if not value or not value.strip():
        return False
    if value.strip() == "*":
        return True
    host = host.lower().rstrip(".")
    ip = _ip(host)
    for entry in re.split(r"[\s,]+", value.lower()):
        if ip is not None:
            try:
                if ip in ipaddress.ip_network(entry.strip("[]").replace("]/", "/"), strict=False):
                    return True
            except ValueError:
                pass
        elif entry.strip("."):
            entry = entry.strip(".")
            if host == entry or host.endswith("." + entry):
                return True
    return False


def route(url):
    """The Route connect() takes to `url`, decided as the module docstring says."""
    scheme, host, _, _ = split_url(url)
    ip = _ip(host)
    if host.lower().rstrip(".") == "localhost" or (ip is not None and ip.is_loopback):
        return Route("loopback")
    value, source = _override or (os.environ.get("PWW_PROXY"), "$PWW_PROXY")
    if value:
        if value.strip().lower() == "none":
            return Route(f"{source} none" if source.startswith("-") else f"{source}=none")
        return parse_proxy(value, source)
    for var in ("no_proxy", "NO_PROXY"):
        if os.environ.get(var):
            if no_proxy_match(host, os.environ[var]):
                return Route(f"${var}")
            break                                       # curl reads NO_PROXY only without no_proxy
    # curl never reads HTTP_PROXY (a CGI server sets it from a request's Proxy: header)
    for var in ("https_proxy", "HTTPS_PROXY") if scheme == "https" else ("http_proxy",):
        if os.environ.get(var):
            return parse_proxy(os.environ[var], f"${var}")
    for var in ("all_proxy", "ALL_PROXY"):
        if os.environ.get(var):
            return parse_proxy(os.environ[var], f"${var}")
    return Route()


def _tcp(host, port, timeout, where, fix, proxy=False):
    """socket.create_connection, its errors one line: `where`, what happened, the fix."""
    what = f"the proxy {_hostport(host, port)}: " if proxy else ""
    try:
        return socket.create_connection((host, port), timeout)
    except socket.gaierror as e:
        raise _same(e, f"{where}: this node cannot resolve {host} ({e.strerror}): fix: {fix}") from None
    except TimeoutError as e:
        raise _same(e, f"{where}: {what}no answer within {timeout:g} s (packets dropped): fix: {fix}") from None
    except OSError as e:
        if isinstance(e, ConnectionRefusedError) and not proxy:
            fix = "is the server running, on that port?"     # the host answered: the route is fine
        raise _same(e, f"{where}: {what}{e.strerror or e}: fix: {fix}") from None


def _same(err, message):
    """`err`'s own class (and errno) with `message`: callers that test the type still can."""
    out = type(err)(message)
    out.errno = err.errno
    return out


def _recv_exact(sock, n, where, who):
    data = b""
    while len(data) < n:
        try:
            part = sock.recv(n - len(data))
        except TimeoutError:
            raise TimeoutError(f"{where}: {who} did not answer within {sock.gettimeout():g} s: the proxy "
                               "cannot reach the central VM (packets dropped?) or is overloaded") from None
        if not part:
            raise ConnectionError(f"{where}: {who} closed the connection mid-handshake: is it the right "
                                  "kind of proxy (http:// vs socks5h://)?")
        data += part
    return data


def _http_connect(sock, host, port, proxy, where):
    """Open a CONNECT tunnel to host:port through the HTTP proxy on `sock` (RFC 9110 9.3.6).
    The reply is read to its blank line and no further: the tunnel's bytes follow it."""
    target = _hostport(host, port)
    head = f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n"
    if proxy._user is not None:
        cred = base64.b64encode(f"{proxy._user}:{proxy._password or ''}".encode()).decode()
        head += f"Proxy-Authorization: Basic {cred}\r\n"
    sock.sendall((head + "\r\n").encode())
    reply = b""
    while b"\r\n\r\n" not in reply:
        if len(reply) > 65536:
            raise RouteError(f"{where}: the proxy's answer to CONNECT has no end: is it an HTTP proxy?")
        reply += _recv_exact(sock, 1, where, "the proxy")
    status_line, *headers = reply.decode("latin-1").split("\r\n")
    parts = status_line.split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
        raise RouteError(f"{where}: the proxy answered CONNECT with {status_line[:60]!r}: not an HTTP "
                         "proxy? use socks5h:// for a SOCKS one")
    code, reason = int(parts[1]), (parts[2] if len(parts) > 2 else "").strip()
    if 200 <= code < 300:
        return
    said = f"{code} {reason}".strip()
    squid = [h.split(":", 1)[1].strip() for h in headers if h.lower().startswith("x-squid-error:")]
    if squid:
        said += f", {squid[0]}"
    var = proxy.source
    if code == 407:
        given = "its credentials were refused" if proxy._user is not None else "none were given"
        raise RouteError(f"{where}: the proxy wants credentials ({said}; {given}): fix: put them in {var} as "
                         "http://USER:PASS@HOST:PORT (percent-encode special characters)")
    if code == 403 and port != 443:
        raise RouteError(f"{where}: the proxy refused CONNECT to port {port} ({said}): fix: serve the central "
                         "VM on 443 (central.sh's one public port) or ask the site to allow the port")
    if code in (403, 405):
        raise RouteError(f"{where}: the proxy refused CONNECT to {target} ({said}): ask the site to allow it")
    if code >= 500:
        raise ConnectionError(f"{where}: the proxy could not reach {target} ({said}): is the central VM up and "
                              "its port open to the site's proxy?")
    raise RouteError(f"{where}: the proxy answered CONNECT with {said}: check {var}")


SOCKS_REPLIES = {1: "general failure", 2: "not allowed by its rules", 3: "network unreachable",
                 4: "host unreachable", 5: "connection refused", 6: "TTL expired",
                 7: "command not supported", 8: "address type not supported"}


def _socks5_connect(sock, host, port, proxy, where):
    """Ask the SOCKS5 proxy on `sock` for a connection to host:port (RFC 1928), with
    user/password (RFC 1929) when the proxy URL has them. socks5h sends the name; socks5
    resolves it here first."""
    methods = b"\x00\x02" if proxy._user is not None else b"\x00"    # 0: no auth, 2: user/password
    sock.sendall(b"\x05" + bytes([len(methods)]) + methods)
    ver, method = _recv_exact(sock, 2, where, "the SOCKS proxy")
    if ver != 5:
        raise RouteError(f"{where}: not a SOCKS5 proxy (it answered version {ver}): check {proxy.source}")
    if method == 2 and proxy._user is not None:
        user, pw = proxy._user.encode()[:255], (proxy._password or "").encode()[:255]
        sock.sendall(b"\x01" + bytes([len(user)]) + user + bytes([len(pw)]) + pw)
        if _recv_exact(sock, 2, where, "the SOCKS proxy")[1] != 0:
            raise RouteError(f"{where}: the SOCKS proxy refused the credentials: fix them in {proxy.source}")
    elif method != 0:
        raise RouteError(f"{where}: the SOCKS proxy wants credentials (none were given): put them in "
                         f"{proxy.source} as socks5h://USER:PASS@HOST:PORT")
    ip = _ip(host)
    if ip is None and proxy.scheme == "socks5":
        ip = _ip(_tcp_resolve(host, port, where))
    if ip is None:
        name = host.encode("idna")
        addr = b"\x03" + bytes([len(name)]) + name
    else:
        addr = (b"\x01" if ip.version == 4 else b"\x04") + ip.packed
    sock.sendall(b"\x05\x01\x00" + addr + port.to_bytes(2, "big"))
    _, rep, _, atyp = _recv_exact(sock, 4, where, "the SOCKS proxy")
    skip = {1: 4, 4: 16}.get(atyp) or _recv_exact(sock, 1, where, "the SOCKS proxy")[0]
    _recv_exact(sock, skip + 2, where, "the SOCKS proxy")              # the bound address, unused
    if rep == 2:
        raise RouteError(f"{where}: the SOCKS proxy refused {_hostport(host, port)} (not allowed by its rules)")
    if rep != 0:
        raise ConnectionError(f"{where}: the SOCKS proxy could not reach {_hostport(host, port)} "
                              f"({SOCKS_REPLIES.get(rep, rep)}): is the central VM up and reachable from the proxy?")


def _tcp_resolve(host, port, where):
    """socks5://: the name resolved on this node (socks5h:// leaves it to the proxy)."""
    try:
        return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][4][0]
    except socket.gaierror as e:
        raise _same(e, f"{where}: this node cannot resolve {host} ({e.strerror}): use socks5h:// so the "
                       "proxy resolves it") from None


def connect(url, timeout=30.0, ca_file=None, blocksize=8192):
    """An http.client connection to `url`, connected along route(url) (module docstring)."""
    scheme, host, port, _ = split_url(url)
    way = route(url)
    where = f"{scheme}://{_hostport(host, port)} " + ("via " if way.scheme else "") + way.describe()
    if scheme == "https":
        conn = http.client.HTTPSConnection(host, port, timeout=timeout, context=client_tls(ca_file),
                                           blocksize=blocksize)
    else:
        conn = http.client.HTTPConnection(host, port, timeout=timeout, blocksize=blocksize)
    # http.client's one seam for the socket: it then wraps TLS with server_hostname = host
    conn._create_connection = lambda address, t=None, source=None: way.open(host, port, timeout, where)
    try:
        conn.connect()
    except ssl.SSLCertVerificationError as e:
        raise TLSConfigError(f"{where}: the server's certificate is not trusted ({e.verify_message}): "
                             "give the CA that signed it with --ca-file or $PWW_CA_FILE "
                             "(`central.sh url` names it)") from None
    except ssl.SSLError as e:
        if e.reason in ("WRONG_VERSION_NUMBER", "UNKNOWN_PROTOCOL", "HTTP_REQUEST", "RECORD_LAYER_FAILURE"):
            raise TLSConfigError(f"{where}: the server does not speak TLS ({e.reason}): use http://") from None
        raise
    conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return conn


def auth_headers(token):
    return {"Authorization": f"Bearer {token}"} if token else {}


def call(url, method, path, body=None, token=None, timeout=30.0, conn=None, ca_file=None):
    """One JSON request. Returns the decoded reply; raises CallError on 4xx/5xx,
    OSError/http.client errors when the server cannot be reached, TLSConfigError
    when its certificate cannot be verified."""
    own = conn is None
    conn = conn or connect(url, timeout, ca_file)
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
        if not isinstance(reply, dict):
            reply = {"reply": reply}
        if resp.status >= 400:
            raise CallError(resp.status, reply)
        return reply
    finally:
        if own:
            conn.close()


# ---------------------------------------------------------------- the retry policy (module docstring)

class GaveUp(TimeoutError):
    """A call that kept failing in ways that may be repeated until its Deadline passed.
    .last is the last error (a CallError, an OSError, ...), .attempts how many were made."""

    def __init__(self, what, deadline, last):
        self.what, self.seconds, self.attempts, self.last = what, deadline.seconds, deadline.attempts, last
        super().__init__(f"{what}: gave up after {deadline.seconds:g} s without progress and {deadline.attempts} "
                         f"attempt(s); the last: {type(last).__name__}: {last}")


class Deadline:
    """The budget of one call: `seconds` without progress (counted from its start, and again
    from every answer or byte an attempt moved), and the longest pause between attempts.
    `what` names the call in GaveUp and in `log(what, err, left)`, which hears every repeat
    (default: a line on stderr). `attempts` counts the attempts made under it, every layer's."""

    def __init__(self, seconds, what=None, log=None, max_wait_s=MAX_WAIT_S, clock=time.monotonic):
        self.seconds, self.what, self.max_wait_s, self.clock = float(seconds), what, max_wait_s, clock
        self.log = log or _to_stderr
        self.mark = clock()
        self.attempts = 0

    def left(self):
        return max(0.0, self.mark + self.seconds - self.clock())

    def progress(self):
        """An answer came, or bytes moved: the call may go `seconds` more without progress."""
        self.mark = self.clock()

    def timeout(self, seconds):
        """A socket timeout for an attempt under this deadline: `seconds`, cut to what is left
        (not below MIN_TIMEOUT_S), so a stalled last attempt ends by the deadline too."""
        return max(MIN_TIMEOUT_S, min(seconds, self.left()))


def io_timeout(seconds, deadline):
    """`seconds`, or what `deadline` leaves of it (Deadline.timeout) when there is one."""
    return seconds if deadline is None else deadline.timeout(seconds)


def made_progress(deadline):
    """Deadline.progress(), when there is a deadline."""
    if deadline is not None:
        deadline.progress()


def _to_stderr(what, err, left):
    sys.stderr.write(f"{what}: {type(err).__name__}: {err}; retrying ({left:.0f} s left)\n")
    sys.stderr.flush()


def quiet(what, err, left):
    """A Deadline log that says nothing (a poll whose failures are expected)."""


def repeatable(err, waits=()):
    """THE rule (module docstring): may a call that failed with `err` be sent again?
    `waits`: the 409 codes this call waits out (INCARNATION_CONFLICT)."""
    if isinstance(err, CallError):
        return err.status >= 500 or err.reply.get("retry") is True or (
            err.status == 409 and err.reply.get("code") in waits)
    if isinstance(err, (GaveUp, TLSConfigError)) or durable.is_disk_full(err):
        return False                   # a deadline already spent; a setup no retry fixes; our own full disk
    return isinstance(err, (OSError, http.client.HTTPException))


def retry(what, attempt, deadline=None, waits=()):
    """attempt() until it returns; after a repeatable() failure wait (FIRST_WAIT_S doubling,
    at most deadline.max_wait_s, with jitter, never past the deadline) and try again. A
    failure that is not repeatable is raised at once; once the deadline has passed,
    GaveUp from the last failure. deadline None: one attempt, its error raised as it is."""
    if deadline is None:
        return attempt()
    delay = min(FIRST_WAIT_S, deadline.max_wait_s)
    while True:
        deadline.attempts += 1
        try:
            out = attempt()
        except Exception as e:
            if not repeatable(e, waits):
                raise
            left = deadline.left()
            if left <= 0:
                raise GaveUp(deadline.what or what, deadline, e) from e
            deadline.log(deadline.what or what, e, left)
            time.sleep(min(delay * random.uniform(0.5, 1.0), left))
            delay = min(2 * delay, deadline.max_wait_s)
            continue
        deadline.progress()
        return out


def wait_healthy(url, timeout=30.0, ca_file=None):
    """Poll GET /health until it answers 200; GaveUp (a TimeoutError) after `timeout` seconds."""
    d = Deadline(timeout, what=f"{url}/health", max_wait_s=0.05, log=quiet)
    return retry("GET /health", lambda: call(url, "GET", "/health", timeout=d.timeout(2.0), ca_file=ca_file), d)
