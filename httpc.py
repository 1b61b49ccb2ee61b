"""httpc.py - the HTTP client every caller of the central servers uses: one JSON call,
the connection under it (https with the caller's CA), the bearer token.

Runs on: everywhere (the sites' rank 0 through fedsite.py, fedmom_client.py,
darl_client.py and blob_client.py; the central servers' own calls to each other; the
status commands, the tools and the tests). Python standard library only; no server, no
port, no state.

    reply = httpc.call("https://central:29510", "GET", "/status", token=TOKEN, ca_file="ca.pem")
    conn = httpc.connect(url, timeout, ca_file)          # a keep-alive connection of your own
    httpc.call(url, "POST", "/heartbeat", body, token=TOKEN, conn=conn)

Errors: a reply with status >= 400 is a CallError (.status, .reply: the server's JSON,
its one-line reason in .reply["error"]); a server that cannot be reached is an OSError
or an http.client.HTTPException; a certificate that cannot be verified, or a server
that speaks no TLS, is a TLSConfigError (not an OSError: no retry will help). call()
makes one request and never repeats it.

The retry policy, said once here and used by every client and the servers' calls to each other:
  - One Deadline per call, made by the outermost caller and passed down: how long the call
    may go WITHOUT PROGRESS (no answer, no byte moved) before it gives up. retry() is the
    one loop that repeats anything, so the worst case is that one number, never a product
    of attempt counts. A site's number is RETRY_S (900 s; fedsite.FedSite's calls).
  - What is repeated (repeatable()): a server that cannot be reached or a connection that
    broke, and a 5xx (a restart, a full disk's 507); a 4xx only when the server says
    "retry": true or the caller names the 409 code it waits out (incarnation_conflict).
    Never another 4xx: that is the server's answer. Every call of ours is safe to send twice.
  - Between attempts: 0.2 s, doubling, at most the Deadline's max_wait_s (5 s), with
    jitter, never past the deadline. When the deadline passes: GaveUp (a TimeoutError)
    naming the call, the seconds, the attempts and the last error.

    d = httpc.Deadline(httpc.RETRY_S, what="send delta")
    client.send_delta(path, ..., deadline=d)          # repeats inside, under d; raises GaveUp
    httpc.retry("GET /status", lambda: httpc.call(url, "GET", "/status"), d)
A client method given no deadline makes one attempt and raises what it met. Why each
repeat is safe: FEDERATION_GUIDE.md, "What a site repeats, and for how long".
"""
import functools
import http.client
import json
import os
import random
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


def add_client_args(parser):
    """--token-file and --ca-file for a command that calls a central server."""
    parser.add_argument("--token-file", default=os.environ.get("PWW_TOKEN_FILE"),
                        help="bearer token file (default $PWW_TOKEN_FILE, or $PWW_TOKEN)")
    parser.add_argument("--ca-file", default=os.environ.get("PWW_CA_FILE"),
                        help="CA certificate for https:// URLs (default $PWW_CA_FILE, else the system's)")


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


def connect(url, timeout=30.0, ca_file=None, blocksize=8192):
    scheme, host, port, _ = split_url(url)
    if scheme == "https":
        conn = http.client.HTTPSConnection(host, port, timeout=timeout, context=client_tls(ca_file),
                                           blocksize=blocksize)
    else:
        conn = http.client.HTTPConnection(host, port, timeout=timeout, blocksize=blocksize)
    try:
        conn.connect()
    except ssl.SSLCertVerificationError as e:
        raise TLSConfigError(f"{url}: the server's certificate is not trusted ({e.verify_message}): "
                             "give the CA that signed it with --ca-file or $PWW_CA_FILE "
                             "(`central.sh url` names it)") from None
    except ssl.SSLError as e:
        if e.reason in ("WRONG_VERSION_NUMBER", "UNKNOWN_PROTOCOL", "HTTP_REQUEST", "RECORD_LAYER_FAILURE"):
            raise TLSConfigError(f"{url}: the server does not speak TLS ({e.reason}): use http://") from None
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
