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


def head(url, blob_id, token=None, timeout=30.0, ca_file=None, deadline=None):
    """The HEAD answer as a dict: {"complete": bool, "size"/"offset", "total", "sha256"} or None
    if absent. deadline: an httpc.Deadline to repeat it under (None: one attempt)."""
    return httpc.retry(f"HEAD /blobs/{blob_id}", lambda: _head(url, blob_id, token, timeout, ca_file, deadline),
                       deadline)


def _head(url, blob_id, token, timeout, ca_file, deadline):
    conn = httpc.connect(url, httpc.io_timeout(timeout, deadline), ca_file)
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


def put_file(url, blob_id, path, token=None, progress=None, sha256=None, timeout=120.0, ca_file=None,
             deadline=None):
    """Upload `path` as blob `blob_id`. Returns {"id", "size", "sha256", "sent"} (sent: body
    bytes put on the wire, all attempts). Pass sha256= if already known (saves a read of
    the file). `timeout`: seconds one send or receive may stall before the attempt is
    abandoned. deadline: an httpc.Deadline under which a failed attempt is repeated,
    continuing where the store's bytes end (None: one attempt). ca_file: the CA for https."""
    up = Upload(url, blob_id, path, token, progress, sha256, timeout, ca_file)
    out = httpc.retry(f"put {blob_id}", lambda: up.attempt(deadline), deadline)
    up.close()
    return out


class Upload:
    """One file on its way to the store, across attempts: its size and checksum (read once),
    the progress line, the bytes sent. attempt() is one try: HEAD, then PUT from the offset
    the store holds (nothing when the blob is already there); the caller repeats it
    (put_file, or FedMomClient.send_delta under its own Deadline)."""

    def __init__(self, url, blob_id, path, token=None, progress=None, sha256=None, timeout=120.0, ca_file=None):
        self.url, self.blob_id, self.path, self.token, self.timeout, self.ca_file = \
            url, blob_id, path, token, timeout, ca_file
        self.size = os.path.getsize(path)
        self.sha = sha256 or sha256_file(path)
        self.bar = Progress(f"put {blob_id}", self.size, progress)
        self.sent = 0

    def attempt(self, deadline=None):
        """-> {"id", "size", "sha256", "sent"}; an OSError, HTTPException or CallError otherwise."""
        info = _head(self.url, self.blob_id, self.token, self.timeout, self.ca_file, deadline)
        size, sha = self.size, self.sha
        if info and info["complete"] and info["sha256"] == sha and info["size"] == size:
            return {"id": self.blob_id, "size": size, "sha256": sha, "sent": self.sent}
        start = info["offset"] if info and not info["complete"] and info["total"] == size \
            and info["sha256"] == sha else 0
        if start == size and size > 0:
            start = 0                                  # every byte arrived but no finish: resend the last ones
        out = self._put_from(start, deadline)
        return {"id": out["id"], "size": out["size"], "sha256": out["sha256"], "sent": self.sent}

    def close(self):
        self.bar.close(self.size)

    def _put_from(self, start, deadline):
        conn = httpc.connect(self.url, httpc.io_timeout(self.timeout, deadline), self.ca_file)
        try:
            conn.putrequest("PUT", f"{httpc.split_url(self.url)[3]}/blobs/{self.blob_id}", skip_accept_encoding=True)
            size = self.size
            headers = {"Content-Length": str(size - start), "X-Content-Sha256": self.sha,
                       "Expect": "100-continue", "Content-Type": "application/octet-stream",
                       **httpc.auth_headers(self.token)}
            if start > 0:
                headers["Content-Range"] = f"bytes {start}-{size - 1}/{size}"
            for k, v in headers.items():
                conn.putheader(k, v)
            conn.endheaders()
            refusal = _await_continue(conn)
            if refusal is not None:                    # answered before we sent a byte of the body
                return _decode(*refusal)
            with open(self.path, "rb") as f:
                pos = start
                while pos < size:                      # zero-copy file -> socket, 8 MiB per step
                    n = conn.sock.sendfile(f, pos, min(8 << 20, size - pos))
                    if n == 0:
                        raise OSError(f"{self.path} shrank during the upload")
                    pos += n
                    self.sent += n
                    httpc.made_progress(deadline)
                    self.bar.update(pos)
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


def get_file(url, blob_id, path, token=None, progress=None, timeout=120.0, ca_file=None, deadline=None):
    """Download blob `blob_id` to `path` atomically (temp + fsync + rename); resumes with
    Range where the last attempt (or an earlier call: the temp file names the checksum)
    stopped. Returns the sha256, checked against the store's. `timeout` bounds a stalled
    read. deadline: an httpc.Deadline under which a failed attempt is repeated (None: one)."""
    down = Download(url, blob_id, path, token, progress, timeout, ca_file)
    httpc.retry(f"get {blob_id}", lambda: down.attempt(deadline), deadline)
    return down.finish()


class Download:
    """One blob on its way to a file, across attempts: attempt() HEADs it (once it knows
    the size and checksum, no more) and GETs the bytes after those the temp file holds;
    finish() checks the checksum and renames the file into place."""

    def __init__(self, url, blob_id, path, token=None, progress=None, timeout=120.0, ca_file=None):
        self.url, self.blob_id, self.path, self.token, self.timeout, self.ca_file = \
            url, blob_id, path, token, timeout, ca_file
        self.progress, self.info, self.h, self.done = progress, None, None, 0

    def attempt(self, deadline=None):
        if self.info is None:
            info = _head(self.url, self.blob_id, self.token, self.timeout, self.ca_file, deadline) or {}
            if not info.get("complete"):
                raise httpc.CallError(404, {"error": f"no complete blob {self.blob_id!r} at {self.url}"})
            self.info, self.tmp = info, f"{self.path}.part-{info['sha256'][:16]}"
            self.bar = Progress(f"get {self.blob_id}", info["size"], self.progress)
        size, tmp = self.info["size"], self.tmp
        have = os.path.getsize(tmp) if os.path.exists(tmp) else 0
        if have > size:
            os.unlink(tmp)
            have = 0
        if self.h is None or self.done != have:
            self.h = sha256_file(tmp, 0, have, hashlib.sha256()) if have else hashlib.sha256()
        self.done = have
        if have < size:
            self._get_from(have, deadline)

    def finish(self):
        """-> the sha256 of the file now at `path` (the store's: else ValueError, the temp removed)."""
        got, sha, tmp = self.h.hexdigest(), self.info["sha256"], self.tmp
        if got != sha:
            os.unlink(tmp)
            raise ValueError(f"downloaded {self.blob_id!r} has sha256 {got}, the store says {sha}; removed {tmp}")
        with open(tmp, "ab") as f:                      # "ab": also creates an empty blob's file
            os.fsync(f.fileno())
        durable.rename(tmp, self.path)
        self.bar.close(self.info["size"])
        return got

    def _get_from(self, have, deadline):
        size, sha = self.info["size"], self.info["sha256"]
        conn = httpc.connect(self.url, httpc.io_timeout(self.timeout, deadline), self.ca_file)
        try:
            headers = {**httpc.auth_headers(self.token), "Range": f"bytes={have}-"}
            conn.request("GET", f"{httpc.split_url(self.url)[3]}/blobs/{self.blob_id}", headers=headers)
            resp = conn.getresponse()
            if resp.status != 206:
                _reply(resp)
                raise httpc.CallError(502, {"error": f"expected 206 for a Range GET, got {resp.status}"})
            if resp.getheader("X-Content-Sha256") != sha:
                raise ValueError(f"blob {self.blob_id!r} changed during the download; start again")
            buf = bytearray(CHUNK)
            view = memoryview(buf)
            with open(self.tmp, "ab", buffering=0) as f:
                while self.done < size:
                    n = resp.readinto(view)
                    if not n:
                        raise ConnectionError(f"connection closed at byte {self.done} of {size}")
                    f.write(view[:n])
                    self.h.update(view[:n])
                    self.done += n
                    httpc.made_progress(deadline)
                    self.bar.update(self.done)
        finally:
            conn.close()
