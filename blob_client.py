"""blob_client.py - the client of the blob store (blobstore.py): resumable, checksummed
uploads and downloads of multi-GB files.

Runs on: the sites (through fedmom_client.FedMomClient's blob transport), the central VM
(fedmom_server.py fetching delta blobs and publishing theta), and the tools. Python
standard library only (durable.py, httpc.py); no server, no port, no state beyond the
file being moved.

    info = blob_client.put_file("https://central:29512", "delta-lumi-r4", "delta.safetensors",
                                token=TOKEN, ca_file="ca.pem")      # {"id", "size", "sha256", "sent"}
    sha = blob_client.get_file(url, "theta-r5", "theta.safetensors", token=TOKEN, ca_file="ca.pem")

An upload HEADs the blob first and continues at the offset the store holds (or does
nothing when the blob is already there, complete and with that checksum); a download
resumes with a Range request into `<path>.part-<sha prefix>` (across calls too), checks
the sha256 the store declared and renames the file into place. Both print progress on
stderr for a transfer that runs longer than 2 s. The protocol is blobstore.py's
docstring.
"""
import hashlib
import http.client
import json
import os
import sys
import time

import durable
import httpc

CHUNK = 4 << 20                       # bytes per read/hash step of a download or a checksum


def sha256_file(path, start=0, end=None, hasher=None):
    """sha256 hex of a file (or of bytes [start, end) fed into `hasher`), read in chunks."""
    h = hasher or hashlib.sha256()
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        f.seek(start)
        left = (os.fstat(f.fileno()).st_size if end is None else end) - start
        while left > 0:
            n = f.readinto(view[:min(left, CHUNK)])
            if not n:
                raise OSError(f"{path} ended {left} bytes early")
            h.update(view[:n])
            left -= n
    return h.hexdigest() if hasher is None else h


class Progress:
    """Bytes done, MB/s and ETA on stderr, at most once a second. progress=None: only
    once the transfer has run for more than `after_s` seconds; True: always; False: never."""

    def __init__(self, label, total, enabled=None, after_s=2.0, clock=time.monotonic, out=None):
        self.label, self.total, self.enabled, self.after_s, self.clock = label, total, enabled, after_s, clock
        self.out = out or sys.stderr
        self.t0 = self.last = clock()
        self.base = None
        self.printed = False

    def update(self, done, final=False):
        if self.base is None:
            self.base = done                           # bytes already there when we (re)started
        now = self.clock()
        if self.enabled is False or (self.enabled is None and now - self.t0 < self.after_s):
            return
        if not final and now - self.last < 1.0 and self.printed:
            return
        self.last, self.printed = now, True
        rate = (done - self.base) / max(now - self.t0, 1e-9)
        eta = (self.total - done) / rate if rate > 0 else float("inf")
        self.out.write(f"{self.label}: {done / 2**20:.1f}/{self.total / 2**20:.1f} MiB "
                       f"{rate / 1e6:.0f} MB/s ETA {eta:.0f} s\n")
        self.out.flush()

    def close(self, done):
        if self.printed:
            self.update(done, final=True)


def _retryable(e):
    if isinstance(e, httpc.CallError):     # 409 only while another PUT holds the id; 416: re-HEAD
        return (e.status == 409 and e.reply.get("retry")) or e.status == 416 or e.status >= 500
    return isinstance(e, (OSError, http.client.HTTPException)) and not durable.is_disk_full(e)


def _with_retries(what, attempt, retries, backoff_s=0.5, max_backoff_s=30.0):
    """Run attempt() until it returns; back off exponentially between failures. The
    count resets whenever an attempt made progress (it returns None to mean 'again')."""
    failures, delay = 0, backoff_s
    while True:
        try:
            out = attempt()
            if out is not None:
                return out
            failures, delay = 0, backoff_s
            continue
        except Exception as e:
            if not _retryable(e) or failures >= retries:
                raise
            failures += 1
            sys.stderr.write(f"{what}: {type(e).__name__}: {e}; retry {failures}/{retries} in {delay:.1f} s\n")
        time.sleep(delay)
        delay = min(delay * 2, max_backoff_s)


def _reply(resp):
    return _decode(resp.status, resp.read())


def _decode(status, raw):
    try:
        body = json.loads(raw) if raw else {}
    except ValueError:
        body = {"error": raw[:200].decode("utf-8", "replace")}
    if status >= 400:
        raise httpc.CallError(status, body)
    return body


def head(url, blob_id, token=None, timeout=30.0, ca_file=None):
    """The HEAD answer as a dict: {"complete": bool, "size"/"offset", "total", "sha256"} or None if absent."""
    conn = httpc.connect(url, timeout, ca_file)
    try:
        conn.request("HEAD", f"{httpc.split_url(url)[3]}/blobs/{blob_id}", headers=httpc.auth_headers(token))
        resp = conn.getresponse()
        resp.read()
        if resp.status == 404:
            return None
        if resp.status >= 400:
            raise httpc.CallError(resp.status, {"error": f"HEAD /blobs/{blob_id} answered {resp.status}"})
        sha = resp.getheader("X-Content-Sha256")
        if resp.getheader("X-Upload-Complete") == "0":
            return {"complete": False, "offset": int(resp.getheader("X-Upload-Offset")),
                    "total": int(resp.getheader("X-Upload-Total")), "sha256": sha}
        size = int(resp.getheader("Content-Length"))
        return {"complete": True, "size": size, "total": size, "sha256": sha}
    finally:
        conn.close()


def put_file(url, blob_id, path, token=None, progress=None, retries=8, sha256=None, timeout=120.0, ca_file=None):
    """Upload `path` as blob `blob_id`; resumes after a dropped connection.
    Returns {"id", "size", "sha256", "sent"} (sent: body bytes put on the wire, all attempts).
    Pass sha256= if already known (saves a read of the file). `timeout`: seconds one
    send or receive may stall before the attempt is abandoned (and resumed).
    ca_file: the CA for an https:// url."""
    size = os.path.getsize(path)
    sha = sha256 or sha256_file(path)
    bar = Progress(f"put {blob_id}", size, progress)
    state = {"done": 0, "sent": 0}

    def attempt():
        info = head(url, blob_id, token, timeout, ca_file)
        if info and info["complete"] and info["sha256"] == sha and info["size"] == size:
            return {"id": blob_id, "size": size, "sha256": sha}
        start = info["offset"] if info and not info["complete"] and info["total"] == size \
            and info["sha256"] == sha else 0
        if start == size and size > 0:
            start = 0                                  # every byte arrived but no finish: resend the last ones
        state["done"] = start
        return _put_from(url, blob_id, path, start, size, sha, token, timeout, bar, state, ca_file)

    def tracked():
        before = state["done"]
        try:
            return attempt()
        except Exception as e:
            if state["done"] > before and _retryable(e):   # progress was made: not a failure
                return None
            raise
    out = _with_retries(f"put {blob_id}", tracked, retries)
    bar.close(size)
    return {"id": out["id"], "size": out["size"], "sha256": out["sha256"], "sent": state["sent"]}


def _put_from(url, blob_id, path, start, size, sha, token, timeout, bar, state, ca_file=None):
    conn = httpc.connect(url, timeout, ca_file)
    try:
        conn.putrequest("PUT", f"{httpc.split_url(url)[3]}/blobs/{blob_id}", skip_accept_encoding=True)
        headers = {"Content-Length": str(size - start), "X-Content-Sha256": sha, "Expect": "100-continue",
                   "Content-Type": "application/octet-stream", **httpc.auth_headers(token)}
        if start > 0:
            headers["Content-Range"] = f"bytes {start}-{size - 1}/{size}"
        for k, v in headers.items():
            conn.putheader(k, v)
        conn.endheaders()
        refusal = _await_continue(conn)
        if refusal is not None:                        # answered before we sent a byte of the body
            return _decode(*refusal)
        with open(path, "rb") as f:
            pos = start
            while pos < size:                          # zero-copy file -> socket, 8 MiB per step
                n = conn.sock.sendfile(f, pos, min(8 << 20, size - pos))
                if n == 0:
                    raise OSError(f"{path} shrank during the upload")
                pos += n
                state["done"], state["sent"] = pos, state["sent"] + n
                bar.update(pos)
        return _reply(conn.getresponse())
    finally:
        conn.close()


def _await_continue(conn):
    """After `Expect: 100-continue`: None once the server says 100, else (status, raw body)
    of its final answer. The server sends nothing after a 100 until it has the body, so
    this buffered reader cannot swallow bytes that belong to the final response."""
    fp = conn.sock.makefile("rb")
    try:
        parts = fp.readline(65537).decode("latin-1").split(None, 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
            raise http.client.BadStatusLine(" ".join(parts))
        headers = http.client.parse_headers(fp)
        if int(parts[1]) == 100:
            return None
        return int(parts[1]), fp.read(int(headers.get("Content-Length") or 0))
    finally:
        fp.close()


def get_file(url, blob_id, path, token=None, progress=None, retries=8, timeout=120.0, ca_file=None):
    """Download blob `blob_id` to `path` atomically (temp + fsync + rename); resumes with
    Range after a dropped connection, and across calls (the temp file names the checksum).
    Returns the sha256, checked against the store's. `timeout` bounds a stalled read."""
    info = _with_retries(f"head {blob_id}", lambda: head(url, blob_id, token, timeout, ca_file) or {}, retries)
    if not info.get("complete"):
        raise httpc.CallError(404, {"error": f"no complete blob {blob_id!r} at {url}"})
    size, sha = info["size"], info["sha256"]
    tmp = f"{path}.part-{sha[:16]}"
    bar = Progress(f"get {blob_id}", size, progress)
    state = {"h": None, "done": 0}

    def attempt():
        have = os.path.getsize(tmp) if os.path.exists(tmp) else 0
        if have > size:
            os.unlink(tmp)
            have = 0
        if state["h"] is None or state["done"] != have:
            state["h"] = sha256_file(tmp, 0, have, hashlib.sha256()) if have else hashlib.sha256()
        state["done"] = have
        before = have
        try:
            _get_from(url, blob_id, tmp, have, size, sha, token, timeout, bar, state, ca_file)
        except Exception as e:
            if state["done"] > before and _retryable(e):
                return None
            raise
        return True
    _with_retries(f"get {blob_id}", attempt, retries)
    got = state["h"].hexdigest()
    if got != sha:
        os.unlink(tmp)
        raise ValueError(f"downloaded {blob_id!r} has sha256 {got}, the store says {sha}; removed {tmp}")
    with open(tmp, "ab") as f:                          # "ab": also creates an empty blob's file
        os.fsync(f.fileno())
    durable.rename(tmp, path)
    bar.close(size)
    return got


def _get_from(url, blob_id, tmp, have, size, sha, token, timeout, bar, state, ca_file=None):
    if have == size:
        return
    conn = httpc.connect(url, timeout, ca_file)
    try:
        headers = {**httpc.auth_headers(token), "Range": f"bytes={have}-"}
        conn.request("GET", f"{httpc.split_url(url)[3]}/blobs/{blob_id}", headers=headers)
        resp = conn.getresponse()
        if resp.status != 206:
            _reply(resp)
            raise httpc.CallError(502, {"error": f"expected 206 for a Range GET, got {resp.status}"})
        if resp.getheader("X-Content-Sha256") != sha:
            raise ValueError(f"blob {blob_id!r} changed during the download; start again")
        buf = bytearray(CHUNK)
        view = memoryview(buf)
        with open(tmp, "ab", buffering=0) as f:
            while state["done"] < size:
                n = resp.readinto(view)
                if not n:
                    raise ConnectionError(f"connection closed at byte {state['done']} of {size}")
                f.write(view[:n])
                state["h"].update(view[:n])
                state["done"] += n
                bar.update(state["done"])
    finally:
        conn.close()
