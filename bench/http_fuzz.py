"""bench/http_fuzz.py - throw hostile HTTP at a central server, count what comes back, then
prove with one legitimate epoch that the server still keeps its promises.

Runs on: any box that reaches the server (an operator's, CI's). Standard library +
numpy (hostile delta files are built byte by byte, no torch).

    python bench/http_fuzz.py --server darl --url https://127.0.0.1:29510 --token-file T --ca-file C \\
        [--count 10000] [--seed 0] [--workers 8] [--timeout-s 10] [--no-epoch] [--json]
    python bench/http_fuzz.py --server fedmom ... --only 4711      # send request 4711 of seed 0 again

Who may run it: the operator of a TEST deployment. It holds the token and many of its
requests are valid writes (registrations, leases, joins, uploads, deltas of absurd
values), so never point it at a production run. The test servers should run with
short timeouts (--header-timeout-s 1; DARL --max-ttl 2; FedMom --member-timeout-s 3),
or the slow requests and the fuzzer's own leases and memberships make it slow.

What it sends (request i of seed s is a pure function of (s, i) and, for FedMom deltas,
the current round, so a failure replays):
malformed JSON, absurd nesting, wrong field types, huge and negative numbers, NaN and
Infinity literals, hostile ids and paths, random methods, header floods and oversized
headers, conflicting/negative/malformed Content-Length, Transfer-Encoding, truncated
bodies, random bytes, slowloris (partial headers, then silence), and per server the
valid-but-hostile kind: DARL leases asked with absurd sizes and TTLs; FedMom deltas of
the right names and shapes holding NaN, Inf, 3e38, denormals, wrong shapes, lying
headers; blob uploads with wrong checksums, ranges and sizes.

Outcomes per request: the status class (2xx, 4xx, 5xx), "closed" or "reset" (the server
hung up without a reply: right for garbage and TLS-level junk), "timeout" (no reply and
no hang-up within --timeout-s: a hung server). Exit 1 on any 5xx or timeout, on a server
that stops answering /health, or on an epoch that breaks an invariant:
  darl    a fresh cluster leases and commits until DARL says done; the books must add
          up (committed + quarantined = every block, no lease left, no invariant error);
  fedmom  a member sends finite deltas for two rounds and sees them merged; theta_global
          must be finite and every round record well formed;
  blob    a 1 MiB blob goes up and comes back with its checksum, then is deleted.
"""
import argparse
import collections
import concurrent.futures
import hashlib
import http.client
import json
import os
import random
import socket
import ssl
import struct
import sys
import threading
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)      # run as `python bench/http_fuzz.py`: httpd.py lives one level up

import httpc  # noqa: E402
import httpd  # noqa: E402

SERVERS = ("darl", "fedmom", "blob")
DARL_OPS = {"register": {"cluster": "c", "incarnation": "i", "digest": "d"},
            "acquire": {"cluster": "c", "incarnation": "i", "blocks": 1, "ttl": 1.0, "request_id": "r"},
            "heartbeat": {"cluster": "c", "incarnation": "i", "leases": [{"lease": 1, "cursor": 1}], "ttl": 1.0,
                          "throughput": 1.0},
            "commit": {"cluster": "c", "incarnation": "i", "lease": 1, "end": 1},
            "release": {"cluster": "c", "incarnation": "i", "leases": [1], "leave": False}}
FEDMOM_OPS = {"join": {"cluster": "c", "incarnation": "i"},
              "heartbeat": {"cluster": "c", "incarnation": "i", "metrics": {"loss": 1.0},
                            "wait_round_after": 0, "wait_s": 0.1},
              "leave": {"cluster": "c", "incarnation": "i"},
              "delta_check": {"cluster": "c", "incarnation": "i", "base_round": 0, "tokens": 1, "leases": [],
                              "metrics": {}},
              "delta_blob": {"cluster": "c", "incarnation": "i", "base_round": 0, "tokens": 1, "leases": [],
                             "blob": "b", "sha256": "0" * 64}}
GETS = {"darl": ["/status", "/health"], "fedmom": ["/status", "/health", "/", "/round", "/theta", "/theta_blob"],
        "blob": ["/blobs", "/status", "/health", "/blobs/x"]}
HOSTILE_STRINGS = ["", " ", "../../etc/passwd", "a" * 5000, "\x00", "é\u202e", "a/b", ".hidden", "-", "_",
                   "%00", "a" * 129, "lumi\n", "{}", "null", "\ud7ff", "CON", "a b"]
HOSTILE_NUMBERS = [0, -1, -2 ** 63, 2 ** 63, 2 ** 64, 10 ** 30, 10 ** 4000, 1e308, -1e308, 1e-320, -0.0, 0.5,
                   3.4e38, 2 ** 53 + 1, True, False]
LITERALS = [b"NaN", b"Infinity", b"-Infinity", b"1e999", b"-1e999", b"1" * 5000, b"0x10", b"01", b"+1", b".5"]


class Ctx:
    """What the generators know of the server under test."""

    def __init__(self, server, host, port, token, specs=None, current_round=0, digest="d"):
        self.server, self.host, self.port, self.token = server, host, port, token
        self.specs, self.round, self.digest = specs or {}, current_round, digest


class Case:
    """One request: raw bytes; `slow`: send them and then wait for the server to hang up."""

    def __init__(self, kind, data, slow=False):
        self.kind, self.data, self.slow = kind, data, slow


def request(ctx, method, path, body=b"", headers=(), auth=True, length=True, close=True):
    lines = [f"{method} {path} HTTP/1.1", f"Host: {ctx.host}:{ctx.port}"]
    if auth and ctx.token:
        lines.append(f"Authorization: Bearer {ctx.token}")
    if length:
        lines.append(f"Content-Length: {len(body)}")
    if close:
        lines.append("Connection: close")
    lines += [f"{k}: {v}" for k, v in headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("utf-8", "surrogateescape") + body


def _jdump(obj):
    return json.dumps(obj, allow_nan=True).encode()


def _mutate_value(rng, v):
    choice = rng.randrange(6)
    if choice == 0:
        return rng.choice(HOSTILE_NUMBERS)
    if choice == 1:
        return rng.choice(HOSTILE_STRINGS)
    if choice == 2:
        return rng.choice([None, [], {}, [v], {"x": v}, [[[[]]]]])
    if choice == 3:
        return rng.choice([float("nan"), float("inf"), float("-inf")])
    if choice == 4:
        return [rng.choice(HOSTILE_NUMBERS + HOSTILE_STRINGS) for _ in range(rng.randrange(1, 50))]
    return v


def _ops(ctx):
    if ctx.server == "darl":
        return {f"/{k}": {**v, "digest": ctx.digest} if k == "register" else v for k, v in DARL_OPS.items()}
    if ctx.server == "fedmom":
        return {f"/{k}": {**v, "base_round": ctx.round} if "base_round" in v else v for k, v in FEDMOM_OPS.items()}
    return {}


def _template(rng, ctx):
    ops = _ops(ctx)
    if not ops:
        return "/blobs/x", {}
    path = rng.choice(sorted(ops))
    body = dict(ops[path])
    ident = f"fz{rng.randrange(20)}"
    if "cluster" in body:
        body["cluster"], body["incarnation"] = ident, f"{ident}-i"
    return path, body


# ---------------------------------------------------------------- generators

def g_malformed_json(rng, ctx):
    path, body = _template(rng, ctx)
    raw = _jdump(body)
    cut = [raw[:rng.randrange(len(raw) + 1)], raw + b"}", b"{" + raw, raw.replace(b":", b"", 1),
           raw.replace(b'"', b"'"), b"\xff\xfe" + raw, raw + b"\x00" * rng.randrange(1, 50), b"[" + raw + b"]",
           b"\"just a string\"", b"123", b"", b"{\"a\":}", b"{" * 3 + b"}" * 2]
    return Case("malformed JSON", request(ctx, "POST", path, rng.choice(cut)))


def g_nested(rng, ctx):
    path, _ = _template(rng, ctx)
    depth = rng.choice([100, 1000, 10000, 100000, 400000])
    opener, closer = rng.choice([(b"[", b"]"), (b'{"a":', b"}")])
    body = opener * depth + b"1" + closer * depth
    return Case("deeply nested JSON", request(ctx, "POST", path, body))


def g_wrong_types(rng, ctx):
    path, body = _template(rng, ctx)
    for k in list(body):
        if rng.random() < 0.5:
            body[k] = _mutate_value(rng, body[k])
    if rng.random() < 0.2:
        body[rng.choice(HOSTILE_STRINGS)] = _mutate_value(rng, 1)
    return Case("wrong types", request(ctx, "POST", path, _jdump(body)))


def g_numbers(rng, ctx):
    path, body = _template(rng, ctx)
    keys = [k for k, v in body.items() if isinstance(v, (int, float)) and not isinstance(v, bool)] or list(body) or ["x"]
    k = rng.choice(keys)
    raw = _jdump({**body, k: 0}).replace(f'"{k}": 0'.encode(), f'"{k}": '.encode() + rng.choice(
        [str(n).encode() for n in HOSTILE_NUMBERS[:12]] + LITERALS), 1)
    return Case("huge/negative numbers, NaN literals", request(ctx, "POST", path, raw))


def g_ids(rng, ctx):
    s = rng.choice(HOSTILE_STRINGS)
    if ctx.server == "blob":
        enc = "".join(c if c.isalnum() else f"%{ord(c) & 0xFF:02x}" for c in s[:300])
        method = rng.choice(["GET", "HEAD", "DELETE", "PUT"])
        body = b"x" * rng.randrange(4)
        headers = [("X-Content-Sha256", hashlib.sha256(body).hexdigest())] if method == "PUT" else []
        return Case("hostile ids", request(ctx, method, f"/blobs/{enc or s[:300]}", body if method == "PUT" else b"",
                                           headers))
    path, body = _template(rng, ctx)
    body["cluster" if rng.random() < 0.5 else "incarnation"] = s
    return Case("hostile ids", request(ctx, "POST", path, _jdump(body)))


def g_paths_methods(rng, ctx):
    method = rng.choice(["GET", "POST", "PUT", "DELETE", "HEAD", "PATCH", "OPTIONS", "TRACE", "CONNECT", "FOO",
                         "get", "G\x00T", "X" * 300])
    path = rng.choice(GETS[ctx.server] + list(_ops(ctx)) + ["/", "//", "/../../etc", "/%2e%2e/", "*",
                      "/status?x=" + "y" * 5000, "http://evil/", "/\x7f", "/" + "a/" * 500, "/health#frag"])
    body = b"" if rng.random() < 0.7 else rng.randbytes(rng.randrange(200))
    return Case("methods and paths", request(ctx, method, path, body, auth=rng.random() < 0.8))


def g_auth(rng, ctx):
    path = rng.choice(GETS[ctx.server] + list(_ops(ctx)))
    value = rng.choice(["", "Bearer", "Bearer ", f"Basic {ctx.token}", f"bearer {ctx.token}x", "Bearer " + "a" * 60000,
                        f"Bearer {ctx.token}\x00", "\x00", f"Bearer  {ctx.token} ",
                        # per-site credentials' form (httpd.py site): a key no one has, torn, huge, not hex
                        "Bearer pww1." + "0" * 8 + "." + "0" * 64, "Bearer pww1..", "Bearer pww1." + "f" * 60000,
                        f"Bearer pww1.zzzzzzzz.{ctx.token}", "Bearer pww1.0000000\u00e9." + "0" * 64])
    return Case("auth", request(ctx, "GET", path, auth=False, headers=[("Authorization", value)]))


def g_header_flood(rng, ctx):
    path = rng.choice(GETS[ctx.server])
    kind = rng.randrange(4)
    if kind == 0:
        headers = [(f"X-{i}", "v") for i in range(rng.choice([99, 101, 150, 1000]))]
    elif kind == 1:
        headers = [("X-Big", "v" * rng.choice([8000, 65000, 70000, 200000]))]
    elif kind == 2:
        headers = [("Bad Header", "x"), (":", "x"), ("X", "a\rb")]
    else:
        headers = [("Host", "a"), ("Host", "b"), ("Expect", "100-continue"), ("Expect", "weird"),
                   ("Connection", "upgrade"), ("Upgrade", "h2c")]
    return Case("header floods", request(ctx, "GET", path, headers=headers))


def g_content_length(rng, ctx):
    path, body = _template(rng, ctx)
    raw = _jdump(body)
    cl = rng.choice([["-1"], ["5", "7"], ["+5"], ["5_0"], [" 5"], ["0x10"], ["99999999999999999999"],
                     [str(len(raw)), str(len(raw) + 1)], ["1e3"], [""], [str(len(raw) * 1000)]])
    return Case("Content-Length", request(ctx, "POST", path, raw, length=False,
                                          headers=[("Content-Length", v) for v in cl]))


def g_transfer_encoding(rng, ctx):
    path, body = _template(rng, ctx)
    raw = _jdump(body)
    te = rng.choice(["chunked", "gzip", "chunked, chunked", "identity", "x"])
    chunked = f"{len(raw):x}\r\n".encode() + raw + b"\r\n0\r\n\r\n"
    headers = [("Transfer-Encoding", te)] + ([("Content-Length", str(len(raw)))] if rng.random() < 0.5 else [])
    return Case("Transfer-Encoding", request(ctx, "POST", path, chunked, length=False, headers=headers))


def g_truncated(rng, ctx):
    path, body = _template(rng, ctx)
    raw = _jdump(body) * rng.randrange(1, 10)
    return Case("truncated bodies", request(ctx, "POST", path, raw, length=False,
                                            headers=[("Content-Length", str(len(raw) + rng.randrange(1, 10000)))]))


def g_random_bytes(rng, ctx):
    kind = rng.randrange(3)
    if kind == 0:
        data = rng.randbytes(rng.randrange(1, 4000))
    elif kind == 1:
        data = rng.randbytes(rng.randrange(1, 200)) + b"\r\n\r\n"
    else:
        data = b"GET / HTTP/1.1\r\n" + rng.randbytes(rng.randrange(1, 500)) + b"\r\n\r\n"
    return Case("random bytes", data)


def g_slowloris(rng, ctx):
    full = request(ctx, "POST", rng.choice(list(_ops(ctx)) or ["/blobs/x"]), b'{"cluster": "x"}')
    cut = rng.choice([1, 10, full.index(b"\r\n\r\n"), len(full) - 3])
    return Case("slowloris", full[:cut], slow=True)


def _tensor_file(rng, specs, mode):
    """A delta file of theta's names and shapes, with hostile values or a lying header."""
    names = sorted(specs)
    dtype = rng.choice(["F32", "F16", "BF16"])
    item = {"F32": 4, "F16": 2, "BF16": 2}[dtype]
    header, blobs, off = {"__metadata__": {"format": "pww-tensors/1"}}, [], 0
    for n in names:
        shape = list(specs[n])
        if mode == "shape" and n == names[0]:
            shape = [s + 1 for s in shape] or [2]
        count = int(np.prod(shape)) if shape else 1
        value = {"nan": np.nan, "inf": np.inf, "huge": rng.choice([3e38, -3e38, 1e30, 6e4]),
                 "tiny": 1e-45}.get(mode, 0.0)
        if dtype == "F16" and mode == "huge":
            value = rng.choice([6e4, -6e4, 65504.0])        # the largest finite float16 values
        a = np.full(count, value, np.float32)
        if mode in ("nan", "inf"):
            a[:] = 0.0
            a[rng.randrange(count)] = value
        data = (a.astype(np.float16).tobytes() if dtype == "F16" else
                (a.view(np.uint32) >> 16).astype(np.uint16).tobytes() if dtype == "BF16" else a.tobytes())
        header[n] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + count * item]}
        blobs.append(data)
        off += count * item
    if mode == "missing":
        header.pop(names[-1])
    if mode == "offsets":
        header[names[0]]["data_offsets"] = [0, off * 1000]
    if mode == "dtype":
        header[names[0]]["dtype"] = rng.choice(["F64", "I8", "BOOL", "Q4"])
    hb = json.dumps(header).encode()
    hb += b" " * (-len(hb) % 8)
    n = len(hb)
    if mode == "length":
        n = rng.choice([0, 2 ** 63, 2 ** 40, len(hb) + 1000])
    return struct.pack("<Q", n) + hb + b"".join(blobs)


def g_hostile_delta(rng, ctx):
    if ctx.server == "blob":
        size = rng.choice([0, 1, 100, 5000])
        body = rng.randbytes(size)
        sha = rng.choice([hashlib.sha256(body).hexdigest(), "0" * 64, "z" * 64, "", hashlib.sha256(b"x").hexdigest()])
        rngs = rng.choice([None, f"bytes 0-{size - 1}/{size}", f"bytes 5-2/{size}", "bytes 0-0/0",
                           f"bytes {2 ** 63}-{2 ** 63}/{2 ** 64}", "bytes -1-3/4", "garbage"])
        headers = [("X-Content-Sha256", sha)] + ([("Content-Range", rngs)] if rngs else [])
        if rng.random() < 0.3:
            headers.append(("Range", rng.choice(["bytes=0-", "bytes=-1", "bytes=5-2", f"bytes=0-{2 ** 70}",
                                                 "bytes=x", "bytes=0-1,2-3"])))
        method = "PUT" if rng.random() < 0.7 else "GET"
        return Case("hostile uploads", request(ctx, method, f"/blobs/fz{rng.randrange(30)}",
                                               body if method == "PUT" else b"", headers))
    if ctx.server == "darl":
        op = rng.choice(["acquire", "heartbeat", "commit", "release"])
        ident = f"fz{rng.randrange(20)}"
        body = {"cluster": ident, "incarnation": f"{ident}-i",
                "blocks": rng.choice([1, 0, -1, 10 ** 9, 2 ** 62]), "ttl": rng.choice([0.001, 1e9, -5, 1.0]),
                "lease": rng.randrange(-5, 200), "end": rng.choice([0, -1, 10 ** 12, 3]),
                "leases": [{"lease": rng.randrange(200), "cursor": rng.choice([0, -1, 10 ** 12, 5])}
                           for _ in range(rng.randrange(0, 5))],
                "throughput": rng.choice([0.0, -1.0, 1e308, 5.0]), "leave": rng.random() < 0.2}
        pre = request(ctx, "POST", "/register", _jdump({"cluster": ident, "incarnation": f"{ident}-i",
                                                        "digest": ctx.digest}), close=False)
        return Case("hostile leases", pre + request(ctx, "POST", f"/{op}", _jdump(body)))
    # fedmom: join, then a delta of theta's names and shapes that must not wreck theta_global
    ident = f"fz{rng.randrange(20)}"
    mode = rng.choice(["nan", "inf", "huge", "huge", "tiny", "zero", "shape", "missing", "offsets", "dtype",
                       "length", "garbage"])
    data = rng.randbytes(rng.randrange(1, 3000)) if mode == "garbage" else _tensor_file(rng, ctx.specs, mode)
    meta = {"cluster": ident, "incarnation": f"{ident}-i", "base_round": ctx.round,
            "tokens": rng.choice([1, 10, 2 ** 62, 0, -1]), "leases": rng.choice([[], [{"id": 10 ** 15}], [{"id": -1}]]),
            "metrics": rng.choice([{}, {"loss": 2.0}, {"loss": 1e308}, {"mfu": "high"}])}
    pre = request(ctx, "POST", "/join", _jdump({"cluster": ident, "incarnation": f"{ident}-i"}), close=False)
    return Case("hostile deltas", pre + request(ctx, "PUT", "/delta", data,
                                                headers=[("X-Delta-Meta", json.dumps(meta))]))


GENERATORS = [(g_malformed_json, 10), (g_nested, 4), (g_wrong_types, 14), (g_numbers, 10), (g_ids, 8),
              (g_paths_methods, 8), (g_auth, 5), (g_header_flood, 5), (g_content_length, 6),
              (g_transfer_encoding, 4), (g_truncated, 5), (g_random_bytes, 6), (g_slowloris, 2),
              (g_hostile_delta, 13)]


def make_case(seed, index, ctx):
    rng = random.Random(seed * 1_000_003 + index)
    gens, weights = zip(*GENERATORS)
    return rng.choices(gens, weights)[0](rng, ctx)


# ---------------------------------------------------------------- sending

def open_socket(ctx, tls, timeout):
    s = socket.create_connection((ctx.host, ctx.port), timeout=timeout)
    return tls.wrap_socket(s, server_hostname=ctx.host) if tls else s


def send_case(ctx, case, tls, timeout, slow_wait_s):
    """-> (outcome, statuses): outcome is the worst of the replies on this connection."""
    try:
        s = open_socket(ctx, tls, timeout)
    except (OSError, ssl.SSLError) as e:
        return f"connect failed: {type(e).__name__}", []
    statuses = []
    try:
        s.sendall(case.data)
        if not case.slow:
            try:       # the TCP half-close alone: SSLSocket.shutdown would also drop the TLS layer we read with
                socket.socket.shutdown(s, socket.SHUT_WR)
            except OSError:
                pass
        s.settimeout(slow_wait_s if case.slow else timeout)
        got = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            got += chunk
        statuses = _statuses(got)
        return ("closed" if not statuses else _worst(statuses)), statuses
    except socket.timeout:
        return "timeout", statuses
    except (ConnectionResetError, BrokenPipeError, ssl.SSLError):
        return "reset", statuses
    except OSError as e:
        return f"error {type(e).__name__}", statuses
    finally:
        s.close()


def _statuses(raw):
    """The final status of each response in `raw`, walking them by Content-Length."""
    out, pos = [], 0
    while raw.startswith(b"HTTP/1.", pos):
        end = raw.find(b"\r\n\r\n", pos)
        if end < 0:
            break
        head = raw[pos:end].split(b"\r\n")
        parts = head[0].split()
        if len(parts) < 2 or not parts[1].isdigit():
            break
        length = 0
        for line in head[1:]:
            k, _, v = line.partition(b":")
            if k.strip().lower() == b"content-length" and v.strip().isdigit():
                length = int(v.strip())
        if int(parts[1]) >= 200:
            out.append(int(parts[1]))
        pos = end + 4 + (length if int(parts[1]) >= 200 else 0)
    return out


def _worst(statuses):
    worst = max(statuses, key=lambda c: (c >= 500, c >= 400, c))
    return f"{worst // 100}xx"


def fuzz(ctx, count, seed=0, workers=8, timeout=10.0, slow_wait_s=30.0, ca_file=None, tls=False, only=None):
    """Send `count` cases; -> {"by_kind": {kind: Counter(outcome)}, "bad": [(index, kind, outcome, statuses)]}."""
    ctx_tls = httpc.client_tls(ca_file) if tls else None
    by_kind, bad = collections.defaultdict(collections.Counter), []
    indices = [only] if only is not None else range(count)

    def one(i):
        case = make_case(seed, i, ctx)
        return i, case.kind, *send_case(ctx, case, ctx_tls, timeout, slow_wait_s)
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        for i, kind, outcome, statuses in pool.map(one, indices):
            by_kind[kind][outcome] += 1
            if outcome in ("5xx", "timeout") or outcome.startswith(("error", "connect")) \
                    or any(c >= 500 for c in statuses):
                bad.append((i, kind, outcome, statuses))
    return {"by_kind": {k: dict(v) for k, v in sorted(by_kind.items())}, "bad": bad}


# ---------------------------------------------------------------- the legitimate epoch afterwards

def epoch_darl(url, token, ca_file, deadline_s=120.0):
    import darl_client
    with darl_client.LeaseClient(url, token=token, ca_file=ca_file) as c:
        digest = httpc.call(url, "GET", "/health", ca_file=ca_file)["digest"]
        c.register("legit", "legit-1", digest)
        deadline = time.monotonic() + deadline_s
        while time.monotonic() < deadline:
            r = c.acquire("legit", "legit-1", blocks=8, ttl=60)
            if r["status"] == "done":
                break
            if r["status"] == "wait":                      # the fuzzer's leases still run out their TTL
                time.sleep(min(1.0, r["retry_after"]))
                continue
            c.commit("legit", "legit-1", r["lease"]["id"])
        else:
            return ["the epoch did not finish"]
        st = c.status()
    problems = []
    if st.get("invariant_error"):
        problems.append(f"invariant error: {st['invariant_error']}")
    if st["committed"] + st["quarantined"] != st["num_blocks"] or st["leased"] or st["free"]:
        problems.append(f"books: committed {st['committed']} + quarantined {st['quarantined']} of "
                        f"{st['num_blocks']}, leased {st['leased']}, free {st['free']}")
    if sum(x["committed"] for x in st["clusters"]) != st["committed"]:
        problems.append("per-cluster committed does not add up")
    return problems


def epoch_fedmom(url, token, ca_file, workdir, rounds=2, deadline_s=180.0):
    import fedmom_client
    import tensorio
    c = fedmom_client.FedMomClient(url, "legit", "legit-1", token=token, ca_file=ca_file)
    c.join(deadline=httpc.Deadline(deadline_s))
    problems, theta = [], os.path.join(workdir, "theta.safetensors")
    for _ in range(rounds):
        deadline = time.monotonic() + deadline_s
        while True:
            rnd = c.download_theta(theta)
            with tensorio.TensorReader(theta) as r:
                specs = {n: r.specs[n][1] for n in r.names}
                if not all(np.isfinite(r.read(n)).all() for n in r.names):
                    return [f"theta_global of round {rnd} holds NaN or Inf"]
            delta = os.path.join(workdir, "delta.safetensors")
            with tensorio.TensorWriter(delta, [(n, "F32", s) for n, s in specs.items()], fsync=False) as w:
                for n, s in specs.items():
                    w.write(n, np.full(s, 1e-3, np.float32))
            try:
                c.send_delta(delta, rnd, 100, [], {"loss": 1.0}, transport="inline")
                break
            except fedmom_client.StaleRound:
                if time.monotonic() > deadline:
                    return ["a legitimate delta stayed stale"]
        c.wait_round_after(rnd, timeout_s=deadline_s)
        mine = [o for o in c.heartbeat()["deltas"] if o["incarnation"] == "legit-1" and o["base_round"] == rnd]
        if not mine or mine[0]["outcome"] != "merged":
            problems.append(f"the legitimate delta of round {rnd} was not merged: {mine}")
    st = httpc.call(url, "GET", "/status", token=token, ca_file=ca_file)
    for rec in st["recent"]:
        if not isinstance(rec.get("round"), int) or "outcomes" not in rec:
            problems.append(f"a malformed round record: {str(rec)[:200]}")
    rnds = [r["round"] for r in st["recent"]]
    if rnds != sorted(set(rnds)):
        problems.append(f"round records out of order or repeated: {rnds}")
    c.leave()
    return problems


def epoch_blob(url, token, ca_file, workdir):
    import blob_client
    src, dst = os.path.join(workdir, "legit.bin"), os.path.join(workdir, "legit.back")
    with open(src, "wb") as f:
        f.write(os.urandom(1 << 20))
    out = blob_client.put_file(url, "legit-blob", src, token=token, ca_file=ca_file, deadline=httpc.Deadline(5))
    got = blob_client.get_file(url, "legit-blob", dst, token=token, ca_file=ca_file, deadline=httpc.Deadline(5))
    problems = [] if got == out["sha256"] == blob_client.sha256_file(src) else ["the blob came back different"]
    httpc.call(url, "DELETE", "/blobs/legit-blob", token=token, ca_file=ca_file)
    return problems


def context(server, url, token, ca_file):
    _, host, port, _ = httpc.split_url(url)
    ctx = Ctx(server, host, port, token)
    if server == "darl":
        ctx.digest = httpc.call(url, "GET", "/health", ca_file=ca_file)["digest"]
    if server == "fedmom":
        import tensorio
        import tempfile
        ctx.round = httpc.call(url, "GET", "/round", token=token, ca_file=ca_file)["round"]
        with tempfile.TemporaryDirectory() as tmp:
            import fedmom_client
            path = os.path.join(tmp, "theta")
            fedmom_client.FedMomClient(url, "x", "y", token=token, ca_file=ca_file).download_theta(path)
            with tensorio.TensorReader(path) as r:
                ctx.specs = {n: r.specs[n][1] for n in r.names}
    return ctx


def run(server, url, token, ca_file=None, count=10000, seed=0, workers=8, timeout=10.0, slow_wait_s=30.0,
        epoch=True, workdir=None, only=None):
    """Fuzz, check /health, run the legitimate epoch. -> report dict with "ok"."""
    import tempfile
    ctx = context(server, url, token, ca_file)
    stop = threading.Event()
    if server == "fedmom":      # deltas name the current round, or they would all be stale after a merge
        def follow_round():
            while not stop.wait(0.5):
                try:
                    ctx.round = httpc.call(url, "GET", "/round", token=token, ca_file=ca_file, timeout=timeout)["round"]
                except (OSError, http.client.HTTPException, httpc.CallError):
                    pass
        threading.Thread(target=follow_round, daemon=True).start()
    t0 = time.monotonic()
    try:
        out = fuzz(ctx, count, seed, workers, timeout, slow_wait_s, ca_file, url.startswith("https://"), only)
    finally:
        stop.set()
    out.update(server=server, requests=count if only is None else 1, seconds=round(time.monotonic() - t0, 1),
               seed=seed)
    try:
        httpc.call(url, "GET", "/health", ca_file=ca_file, timeout=timeout)
        out["healthy_after"] = True
    except (OSError, http.client.HTTPException, httpc.CallError) as e:
        out["healthy_after"] = f"{type(e).__name__}: {e}"
    out["epoch_problems"] = []
    if epoch and out["healthy_after"] is True:
        with tempfile.TemporaryDirectory(dir=workdir) as tmp:
            try:
                out["epoch_problems"] = {"darl": lambda: epoch_darl(url, token, ca_file),
                                         "fedmom": lambda: epoch_fedmom(url, token, ca_file, tmp),
                                         "blob": lambda: epoch_blob(url, token, ca_file, tmp)}[server]()
            except (OSError, http.client.HTTPException, httpc.CallError, TimeoutError) as e:
                out["epoch_problems"] = [f"{type(e).__name__}: {e}"]
    out["ok"] = not out["bad"] and out["healthy_after"] is True and not out["epoch_problems"]
    return out


def format_report(out):
    lines = [f"{out['server']}: {out['requests']:,} requests in {out['seconds']} s (seed {out['seed']})"]
    for kind, outcomes in out["by_kind"].items():
        lines.append(f"  {kind:<38} {sum(outcomes.values()):>6}  " +
                     "  ".join(f"{k} {v}" for k, v in sorted(outcomes.items())))
    fives = sum(v for o in out["by_kind"].values() for k, v in o.items() if k == "5xx")
    timeouts = sum(v for o in out["by_kind"].values() for k, v in o.items() if k == "timeout")
    lines.append(f"  5xx {fives}, timeouts {timeouts}, healthy after: {out['healthy_after']}, "
                 f"legitimate epoch: {'ok' if not out['epoch_problems'] else out['epoch_problems']}")
    for i, kind, outcome, statuses in out["bad"][:20]:
        lines.append(f"  !!! request {i} ({kind}): {outcome} {statuses}  (replay: --seed {out['seed']} --only {i})")
    lines.append("PASS" if out["ok"] else "FAIL")
    return "\n".join(lines)


def main(argv):
    p = httpd.base_parser(__doc__)
    p.add_argument("--server", choices=SERVERS, required=True, help="which server --url is")
    p.add_argument("--url", required=True, help="the server's URL (https://... under TLS)")
    httpc.add_client_args(p)
    p.add_argument("--count", type=int, default=10000, help="requests to send (default 10000)")
    p.add_argument("--seed", type=int, default=0, help="request i of seed s is always the same (default 0)")
    p.add_argument("--workers", type=int, default=8, help="concurrent connections (default 8)")
    p.add_argument("--timeout-s", type=float, default=10.0, help="no reply and no hang-up for this long = a hung "
                   "server (default 10)")
    p.add_argument("--slow-wait-s", type=float, default=30.0,
                   help="how long a slowloris may be held before the server must hang up (default 30)")
    p.add_argument("--only", type=int, help="send request ONLY of --seed again, nothing else")
    p.add_argument("--no-epoch", action="store_true", help="skip the legitimate epoch afterwards")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    a = p.parse_args(argv)
    out = run(a.server, a.url, httpc.load_token(a.token_file), a.ca_file, a.count, a.seed, a.workers, a.timeout_s,
              a.slow_wait_s, not a.no_epoch, only=a.only)
    print(json.dumps(out, indent=1) if a.json else format_report(out))
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
