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
"""
import functools
import http.client
import json
import os
import socket
import ssl
import time
import urllib.parse

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


def wait_healthy(url, timeout=30.0, ca_file=None):
    """Poll GET /health until it answers 200 or `timeout` seconds pass."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return call(url, "GET", "/health", timeout=2.0, ca_file=ca_file)
        except (OSError, http.client.HTTPException, CallError):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url}/health did not answer within {timeout:.0f} s")
            time.sleep(0.05)
