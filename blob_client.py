"""blob_client.py - the client of the blob store (blobstore.py): resumable, checksummed
uploads and downloads of multi-GB files.

Runs on: the sites (through fedmom_client.FedMomClient's blob transport), the central VM
(fedmom_server.py fetching delta blobs and publishing theta), and the tools. Python
standard library only (durable.py, httpc.py); no server, no port, no state beyond the
file being moved.

    info = blob_client.put_file("https://central:29512", "delta.lumi.r4", "delta.safetensors",
                                token=TOKEN, ca_file="ca.pem")      # {"id", "size", "sha256", "sent"}
    sha = blob_client.get_file(url, "theta-r5", "theta.safetensors", token=TOKEN, ca_file="ca.pem")

An upload HEADs the blob first and continues where the store's bytes end (or does
nothing when the blob is already there, complete and with that checksum); a download
resumes with Range requests into `<path>.part-<sha prefix>` (across calls too: its
`.ranges` sidecar says which bytes are there), checks the sha256 the store declared and
renames the file into place. Both print one progress line on stderr for a transfer that
runs longer than 2 s. The protocol is blobstore.py's docstring.

Streams: a blob of STREAM_BYTES or more moves in several TCP connections at once (one
connection is window-limited on a long path: 4 MiB per 30 ms round trip is ~140 MB/s),
pick_streams(); streams= or $PWW_BLOB_STREAMS sets the count. The blob is cut into pieces
taken in order by the streams, so the bytes that landed stay close to one growing prefix,
which a hashing thread (PrefixHasher) follows: the checksum ends right after the last byte.
"""
import hashlib
import http.client
import json
import os
import struct
import sys
import threading
import time

import durable
import httpc

CHUNK = 4 << 20                       # bytes per read/hash step of sha256_file
# bytes per socket read/write and file write of a transfer: a buffer that stays in the CPU's
# cache. Measured on a 2-core VM, 1 GiB over TLS: reads into 4 MiB buffers ran at ~680 MB/s,
# into 256 KiB ones at ~1000; dd to a file: 4 MiB blocks 770-980 MB/s, 256 KiB 3.4 GB/s.
IO_CHUNK = 256 << 10
STREAMS_ENV = "PWW_BLOB_STREAMS"
# One stream per 64 MiB, at most 8: a piece of 64 MiB takes ~0.5 s at one window-limited
# stream's ~140 MB/s (30 ms, 4 MiB), so a stream's TCP slow start (~8 round trips) and its
# one request round trip per piece stay under a tenth of it; 8 streams fill ~1 GB/s of WAN.
STREAM_BYTES = 64 << 20
MAX_AUTO_STREAMS = 8
MAX_STREAMS = 32
SIDECAR_EVERY = 64 << 20              # a download's .ranges sidecar is rewritten per this many bytes
# a record of GET /blobs/<id>?follow=1 (blobstore.BlobStore.follow): kind, offset, length, then
# `length` bytes. b"R": bytes [offset, offset + length) landed; b"K": keep-alive; b"E" (last):
# JSON {"complete": true, "sha256", "size"} or {"gone": why}
FOLLOW = struct.Struct(">cQQ")


def pick_streams(size, streams=None):
    """How many connections move a `size`-byte blob: `streams`, else $PWW_BLOB_STREAMS, else
    one per STREAM_BYTES up to MAX_AUTO_STREAMS (1 below 128 MiB)."""
    env = os.environ.get(STREAMS_ENV, "").strip()
    if streams is None and not env:
        return max(1, min(MAX_AUTO_STREAMS, size // STREAM_BYTES))
    try:
        streams = int(env if streams is None else streams)
    except ValueError:
        streams = 0
    if not 1 <= streams <= MAX_STREAMS:
        raise ValueError(f"blob streams {env if env else streams!r} (streams= or ${STREAMS_ENV}): "
                         f"use a whole number 1..{MAX_STREAMS}, or leave it unset (chosen from the size)")
    return streams


def pieces(size, streams):
    """[start, end) pieces in order: 4 per stream, at least 1 MiB each (one piece per stream
    would let the checksum start only when the first stream ends)."""
    if streams <= 1 or size <= 0:
        return [(0, size)]
    step = max(1 << 20, -(-size // (4 * streams)))
    return [(a, min(a + step, size)) for a in range(0, size, step)]


# ---------------------------------------------------------------- sets of byte ranges

def add_range(ranges, a, b):
    """ranges (sorted, disjoint [start, end) lists) with [a, b) merged in; a new list."""
    if b <= a:
        return list(ranges)
    out = []
    for x, y in ranges:
        if y < a or x > b:
            out.append([x, y])
        else:
            a, b = min(a, x), max(b, y)
    out.append([a, b])
    return sorted(out)


def prefix_end(ranges):
    """Where the contiguous run of bytes from 0 ends."""
    return ranges[0][1] if ranges and ranges[0][0] == 0 else 0


def gaps(ranges, a, b):
    """The parts of [a, b) that `ranges` does not cover, in order."""
    out = []
    for x, y in ranges:
        if y <= a or x >= b:
            continue
        if x > a:
            out.append((a, x))
        a = max(a, y)
    if a < b:
        out.append((a, b))
    return out


def format_ranges(ranges):
    return ",".join(f"{a}-{b - 1}" for a, b in ranges)


def parse_ranges(text):
    """"A-B,C-D" (inclusive ends) -> [[A, B+1], ...]; ValueError when malformed."""
    out = []
    for item in filter(None, (text or "").split(",")):
        a, b = item.split("-")
        out = add_range(out, int(a), int(b) + 1)
    return out


class PrefixHasher:
    """The sha256 of a file whose ranges land in any order. Bytes that extend the hashed
    prefix are hashed by the writer from its own buffer (feed()); a thread hashes what
    lands beyond it once the prefix reaches it, reading it back (from the page cache). So
    the checksum ends right after the last byte, and one stream reads nothing back (handing
    each buffer to a hashing thread measured no faster on 2 cores, 1 GiB over TLS)."""

    def __init__(self, path, total, landed=()):
        self.path, self.total, self.ranges = path, total, [list(r) for r in landed]
        self.h, self.hashed, self.error, self.stopped, self.busy = hashlib.sha256(), 0, None, False, False
        self.cond = threading.Condition()
        self.thread = threading.Thread(target=self._run, daemon=True, name=f"sha256 {os.path.basename(path)}")
        self.thread.start()

    def add(self, a, b):
        """Bytes [a, b) are in the file."""
        with self.cond:
            self.ranges = add_range(self.ranges, a, b)
            self.cond.notify_all()

    def feed(self, a, view):
        """Bytes [a, a + len(view)) are in the file and in `view`: hashed now if they extend
        the prefix and the thread is idle, else left to the thread."""
        b = a + len(view)
        with self.cond:
            self.ranges = add_range(self.ranges, a, b)
            if a != self.hashed or self.busy:
                self.cond.notify_all()
                return
            self.busy = True
        try:
            self.h.update(view)
        finally:
            with self.cond:
                self.hashed, self.busy = b, False
                if prefix_end(self.ranges) > b or b >= self.total:
                    self.cond.notify_all()

    def _run(self):
        buf = memoryview(bytearray(IO_CHUNK))
        fd = None
        try:
            while True:
                with self.cond:
                    while (self.busy or prefix_end(self.ranges) <= self.hashed) and not self.stopped:
                        self.cond.wait()
                    end = prefix_end(self.ranges)
                    if self.stopped or end <= self.hashed:
                        return
                    self.busy = True
                fd = os.open(self.path, os.O_RDONLY) if fd is None else fd
                try:
                    pos = self.hashed
                    while pos < end:
                        n = os.preadv(fd, [buf[:min(IO_CHUNK, end - pos)]], pos)
                        if not n:
                            raise OSError(f"{self.path} ended at byte {pos}, before {end}")
                        self.h.update(buf[:n])
                        pos += n
                finally:
                    with self.cond:
                        self.hashed, self.busy = pos, False
                        self.cond.notify_all()
        except OSError as e:
            with self.cond:
                self.error = e
                self.cond.notify_all()
        finally:
            if fd is not None:
                os.close(fd)

    def result(self):
        """The hex digest once every byte is hashed (call when all ranges landed)."""
        with self.cond:
            while self.hashed < self.total and self.error is None:
                if prefix_end(self.ranges) < self.total:
                    raise ValueError(f"{self.path}: bytes {format_ranges(gaps(self.ranges, 0, self.total))} "
                                     "have not landed")
                self.cond.wait()
        if self.error is not None:
            raise self.error
        return self.h.hexdigest()

    def close(self):
        with self.cond:
            self.stopped = True
            self.cond.notify_all()
        self.thread.join()


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
    if absent; an unfinished upload in pieces adds "ranges" (the [start, end) that landed).
    deadline: an httpc.Deadline to repeat it under (None: one attempt)."""
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
            out = {"complete": False, "offset": int(resp.getheader("X-Upload-Offset")),
                   "total": int(resp.getheader("X-Upload-Total")), "sha256": sha}
            if resp.getheader("X-Upload-Ranges") is not None:
                out["ranges"] = parse_ranges(resp.getheader("X-Upload-Ranges"))
            return out
        size = int(resp.getheader("Content-Length"))
        return {"complete": True, "size": size, "total": size, "sha256": sha}
    finally:
        conn.close()


def _run_streams(n, work, step):
    """`step(item, state)` for every item of `work` (in order), on `n` threads that each take
    the next item; state: a dict per thread (its connection). Once a step fails (its own
    retries spent), the other threads end their current item and stop; the error is raised."""
    lock, errors, items = threading.Lock(), [], list(work)

    def run():
        state = {}
        try:
            while True:
                with lock:
                    if not items or errors:
                        return
                    item = items.pop(0)
                try:
                    step(item, state)
                except Exception as e:
                    with lock:
                        errors.append(e)
                    return
        finally:
            if state.get("conn") is not None:
                state["conn"].close()
    threads = [threading.Thread(target=run, daemon=True) for _ in range(min(n, len(items)))]
    if len(threads) == 1:
        threads[0].run()                            # one stream: this thread
    else:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    if errors:
        raise errors[0]


def put_file(url, blob_id, path, token=None, progress=None, sha256=None, timeout=120.0, ca_file=None,
             deadline=None, streams=None):
    """Upload `path` as blob `blob_id`. Returns {"id", "size", "sha256", "sent"} (sent: body
    bytes put on the wire, all attempts). Pass sha256= if already known (saves a read of
    the file). `timeout`: seconds one send or receive may stall before the attempt is
    abandoned. deadline: an httpc.Deadline under which a failed attempt is repeated,
    continuing where the store's bytes end (None: one attempt). ca_file: the CA for https.
    streams: connections at once (None: $PWW_BLOB_STREAMS, else from the size: pick_streams)."""
    up = Upload(url, blob_id, path, token, progress, sha256, timeout, ca_file, streams)
    out = httpc.retry(f"put {blob_id}", lambda: up.attempt(deadline), deadline)
    up.close()
    return out


class Upload:
    """One file on its way to the store, across attempts: its size and checksum (read once),
    the progress line, the bytes sent. attempt() is one try: HEAD, then PUT what the store
    lacks (nothing when the blob is already there); the caller repeats it (put_file, or
    FedMomClient.send_delta under its own Deadline). One stream: one PUT from the offset the
    store holds. Several: pieces PUT in order by `streams` connections (`?ranged=1`,
    blobstore.py), each piece repeated on its own under the deadline from the bytes the store
    recorded, so a broken stream resends only its unacknowledged tail."""

    def __init__(self, url, blob_id, path, token=None, progress=None, sha256=None, timeout=120.0, ca_file=None,
                 streams=None):
        self.url, self.blob_id, self.path, self.token, self.timeout, self.ca_file = \
            url, blob_id, path, token, timeout, ca_file
        self.size = os.path.getsize(path)
        self.streams = pick_streams(self.size, streams)
        self.sha = sha256 or sha256_file(path)
        self.bar = Progress(f"put {blob_id}", self.size, progress)
        self.sent, self.moved, self.lock, self.finished = 0, 0, threading.Lock(), None

    def attempt(self, deadline=None):
        """-> {"id", "size", "sha256", "sent"}; an OSError, HTTPException or CallError otherwise."""
        info = _head(self.url, self.blob_id, self.token, self.timeout, self.ca_file, deadline)
        size, sha = self.size, self.sha
        if info and info["complete"] and info["sha256"] == sha and info["size"] == size:
            return self._result()
        same = info is not None and not info["complete"] and info["total"] == size and info["sha256"] == sha
        if self.streams > 1:
            return self._put_pieces(info["ranges"] if same and "ranges" in info else [], deadline)
        start = info["offset"] if same else 0
        if start == size and size > 0:
            start = 0                                  # every byte arrived but no finish: resend the last ones
        self.moved = start
        out = self._send(None, start, size, deadline, expect=True, ranged=False)
        return {"id": out["id"], "size": out["size"], "sha256": out["sha256"], "sent": self.sent}

    def _result(self):
        return {"id": self.blob_id, "size": self.size, "sha256": self.sha, "sent": self.sent}

    def close(self):
        self.bar.close(self.size)

    def _put_pieces(self, landed, deadline):
        todo = [g for a, b in pieces(self.size, self.streams) for g in gaps(landed, a, b)]
        if not todo:                                   # every byte landed but no finish: resend the last piece
            todo = [pieces(self.size, self.streams)[-1]]
        self.moved, self.finished = sum(b - a for a, b in landed), None

        def piece(ab, state):
            first = [True]

            def once():
                a, b = ab
                if not first[0]:                        # a repeat: resume from what the store recorded
                    info = _head(self.url, self.blob_id, self.token, self.timeout, self.ca_file, deadline) or {}
                    if info.get("complete"):
                        return
                    a = next(iter(gaps(info.get("ranges") or [], *ab)), (b, b))[0]
                first[0] = False
                if a < b:
                    self._send(state, a, b, deadline, expect="conn" not in state, ranged=True)
            httpc.retry(f"put {self.blob_id} bytes {ab[0]}-{ab[1] - 1}", once, deadline)
        _run_streams(self.streams, todo, piece)
        if self.finished is None:
            info = _head(self.url, self.blob_id, self.token, self.timeout, self.ca_file, deadline) or {}
            if not (info.get("complete") and info["sha256"] == self.sha):
                raise ConnectionError(f"every byte of {self.blob_id!r} was sent but the store has not finished it; "
                                      "the upload is repeated")
        return self._result()

    def _send(self, state, start, end, deadline, expect, ranged):
        """PUT bytes [start, end) on state["conn"] (kept for the stream's next piece) or a new
        connection; -> the store's JSON reply."""
        conn = (state or {}).get("conn") or httpc.connect(self.url, httpc.io_timeout(self.timeout, deadline),
                                                          self.ca_file)
        if state is not None:
            state["conn"] = conn
        ok = False
        try:
            reply = self._put_on(conn, start, end, deadline, expect, ranged)
            ok = True
            return reply
        finally:
            if not ok or state is None or conn.sock is None:     # broken, one-off, or closed by a refusal
                conn.close()
                if state is not None:
                    state.pop("conn", None)

    def _put_on(self, conn, start, end, deadline, expect, ranged):
        size = self.size
        path = f"{httpc.split_url(self.url)[3]}/blobs/{self.blob_id}" + ("?ranged=1" if ranged else "")
        conn.putrequest("PUT", path, skip_accept_encoding=True)
        headers = {"Content-Length": str(end - start), "X-Content-Sha256": self.sha,
                   "Content-Type": "application/octet-stream", **httpc.auth_headers(self.token)}
        if expect:                                     # a refusal comes before the body; later pieces on the
            headers["Expect"] = "100-continue"         # same connection skip the wait (one round trip each)
        if start > 0 or ranged:
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{size}"
        for k, v in headers.items():
            conn.putheader(k, v)
        conn.endheaders()
        if expect:
            refusal = _await_continue(conn)
            if refusal is not None:                    # answered before we sent a byte of the body
                conn.close()
                return self._answer(*refusal)
        self._send_body(conn, start, end, deadline)
        resp = conn.getresponse()
        return self._answer(resp.status, resp.read())

    def _answer(self, status, raw):
        reply = _decode(status, raw)
        if status in (200, 201):
            self.finished = reply
        return reply

    def _send_body(self, conn, start, end, deadline):
        # read + sendall from one reused buffer: socket.sendfile on a TLS socket falls back to 8 KiB
        # send() calls
        view = memoryview(bytearray(min(IO_CHUNK, max(end - start, 1))))
        fd = os.open(self.path, os.O_RDONLY)
        try:
            pos = start
            while pos < end:
                n = os.preadv(fd, [view[:min(len(view), end - pos)]], pos)
                if n == 0:
                    raise OSError(f"{self.path} shrank during the upload")
                conn.sock.sendall(view[:n])
                pos += n
                with self.lock:
                    self.sent += n
                    self.moved += n
                    self.bar.update(self.moved)
                httpc.made_progress(deadline)
        finally:
            os.close(fd)


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


def follow(url, blob_id, token=None, ca_file=None, timeout=120.0):
    """Follow an upload as it lands (blobstore.py's GET ?follow=1): yields (b"R", offset, bytes)
    for each landed range, then (b"E", 0, {"complete", "sha256", "size"} or {"gone"}), the last.
    A connection cut before that raises ConnectionError; a refusal, httpc.CallError."""
    conn = httpc.connect(url, timeout, ca_file)
    try:
        conn.request("GET", f"{httpc.split_url(url)[3]}/blobs/{blob_id}?follow=1", headers=httpc.auth_headers(token))
        resp = conn.getresponse()
        if resp.status != 200:
            _reply(resp)
            raise httpc.CallError(502, {"error": f"GET /blobs/{blob_id}?follow=1 answered {resp.status}"})
        while True:
            kind, offset, n = FOLLOW.unpack(_read_exact(resp, FOLLOW.size))
            payload = _read_exact(resp, n)
            if kind == b"E":
                yield kind, 0, json.loads(payload)
                return
            if kind == b"R":
                yield kind, offset, payload
    finally:
        conn.close()


def _read_exact(resp, n):
    out = bytearray()
    while len(out) < n:
        got = resp.read(n - len(out))
        if not got:
            raise ConnectionError(f"the follow stream was cut ({len(out)} of a {n}-byte record)")
        out += got
    return bytes(out)


def get_file(url, blob_id, path, token=None, progress=None, timeout=120.0, ca_file=None, deadline=None,
             streams=None):
    """Download blob `blob_id` to `path` atomically (temp + fsync + rename); resumes with
    Range where the last attempt (or an earlier call: the temp file names the checksum)
    stopped. Returns the sha256, checked against the store's. `timeout` bounds a stalled
    read. deadline: an httpc.Deadline under which a failed attempt is repeated (None: one).
    streams: connections at once (None: $PWW_BLOB_STREAMS, else from the size: pick_streams)."""
    down = Download(url, blob_id, path, token, progress, timeout, ca_file, streams)
    httpc.retry(f"get {blob_id}", lambda: down.attempt(deadline), deadline)
    return down.finish()


class Download:
    """One blob on its way to a file, across attempts: attempt() HEADs it (once it knows
    the size and checksum, no more) and GETs, in pieces on `streams` connections, the bytes
    the temp file lacks (each piece repeated on its own under the deadline, from its own
    offset); finish() checks the checksum and renames the file into place.

    The temp file `<path>.part-<sha prefix>` is preallocated; its sidecar `<temp>.ranges`
    ({"size", "sha256", "ranges"}) says which bytes are in it, rewritten every
    SIDECAR_EVERY bytes and after every attempt. The data is not fsynced before that: after
    a power loss the file may hold less than the sidecar says, which the checksum catches
    (the download then starts over)."""

    def __init__(self, url, blob_id, path, token=None, progress=None, timeout=120.0, ca_file=None, streams=None):
        self.url, self.blob_id, self.path, self.token, self.timeout, self.ca_file = \
            url, blob_id, path, token, timeout, ca_file
        self.progress, self.streams, self.info, self.hasher, self.fd = progress, streams, None, None, None
        self.lock = threading.Lock()

    def attempt(self, deadline=None):
        if self.info is None:
            info = _head(self.url, self.blob_id, self.token, self.timeout, self.ca_file, deadline) or {}
            if not info.get("complete"):
                raise httpc.CallError(404, {"error": f"no complete blob {self.blob_id!r} at {self.url}"})
            self.info, self.tmp = info, f"{self.path}.part-{info['sha256'][:16]}"
            self.side = self.tmp + ".ranges"
            self.bar = Progress(f"get {self.blob_id}", info["size"], self.progress)
            self.n = pick_streams(info["size"], self.streams)
        if self.hasher is None:
            self._open()
        size = self.info["size"]
        todo = [g for a, b in pieces(size, self.n) for g in gaps(self.landed, a, b)]
        try:
            _run_streams(self.n, todo, lambda ab, state: httpc.retry(
                f"get {self.blob_id} bytes {ab[0]}-{ab[1] - 1}", lambda: self._get_piece(ab, state, deadline),
                deadline))
        finally:
            self._save()

    def _open(self):
        """Load what the temp file holds (its sidecar; a temp without one, of an older client,
        holds a prefix), preallocate it and start hashing."""
        size, sha, tmp = self.info["size"], self.info["sha256"], self.tmp
        meta = None
        try:
            with open(self.side) as f:
                meta = json.load(f)
        except (OSError, ValueError):
            pass
        have = os.path.getsize(tmp) if os.path.exists(tmp) else None
        if meta and meta.get("size") == size and meta.get("sha256") == sha and have is not None:
            landed = [[a, min(b, size)] for a, b in meta["ranges"] if a < min(b, size)]
        elif have is not None and meta is None and have <= size:
            landed = [[0, have]] if have else []
        else:
            landed = []
            durable.unlink(tmp)
        self.landed, self.unsaved = landed, 0
        self._save()                                   # before the file grows past what it says
        self.fd = os.open(tmp, os.O_RDWR | os.O_CREAT, 0o644)
        if os.fstat(self.fd).st_size < size:
            os.ftruncate(self.fd, size)
        self.hasher = PrefixHasher(tmp, size, landed)
        self.bar.update(sum(b - a for a, b in landed))

    def _save(self):
        with self.lock:
            durable.write_json(self.side, {"size": self.info["size"], "sha256": self.info["sha256"],
                                           "ranges": self.landed})
            self.unsaved = 0

    def _landed(self, a, view, deadline):
        b = a + len(view)
        with self.lock:
            self.landed = add_range(self.landed, a, b)
            self.unsaved += b - a
            save = self.unsaved >= SIDECAR_EVERY
            self.bar.update(sum(y - x for x, y in self.landed))
        self.hasher.feed(a, view)
        httpc.made_progress(deadline)
        if save:
            self._save()

    def _get_piece(self, ab, state, deadline):
        with self.lock:
            todo = gaps(self.landed, *ab)              # a repeat continues from its own offset
        for a, b in todo:
            conn = state.get("conn") or httpc.connect(self.url, httpc.io_timeout(self.timeout, deadline),
                                                      self.ca_file)
            state["conn"] = conn
            try:
                self._get_range(conn, a, b, deadline)
            except BaseException:
                state.pop("conn").close()
                raise

    def _get_range(self, conn, a, b, deadline):
        sha = self.info["sha256"]
        headers = {**httpc.auth_headers(self.token), "Range": f"bytes={a}-{b - 1}"}
        conn.request("GET", f"{httpc.split_url(self.url)[3]}/blobs/{self.blob_id}", headers=headers)
        resp = conn.getresponse()
        if resp.status != 206:
            _reply(resp)
            raise httpc.CallError(502, {"error": f"expected 206 for a Range GET, got {resp.status}"})
        if resp.getheader("X-Content-Sha256") != sha:
            raise ValueError(f"blob {self.blob_id!r} changed during the download; start again")
        if not (resp.getheader("Content-Range") or "").startswith(f"bytes {a}-{b - 1}/"):
            raise httpc.CallError(502, {"error": f"asked for bytes {a}-{b - 1}, got {resp.getheader('Content-Range')}"})
        # reads into one reused buffer, written at their offset; the checksum is the hasher's
        # (PrefixHasher): hashed here, in series, a 1 GiB GET ran at 0.3 of curl's rate
        view = memoryview(bytearray(min(IO_CHUNK, b - a)))
        pos = a
        while pos < b:
            n = resp.readinto(view[:min(len(view), b - pos)])
            if not n:
                raise ConnectionError(f"connection closed at byte {pos} of {self.info['size']}")
            done = 0
            while done < n:
                done += os.pwrite(self.fd, view[done:n], pos + done)
            self._landed(pos, view[:n], deadline)
            pos += n

    def close(self):
        """Stop the hashing thread and close the temp file (kept, with its sidecar, to resume)."""
        if getattr(self, "hasher", None) is not None:
            self.hasher.close()
            self.hasher = None
        if getattr(self, "fd", None) is not None:
            os.close(self.fd)
            self.fd = None

    def __del__(self):                  # a caller that gives up between attempts leaks no thread
        self.close()

    def finish(self):
        """-> the sha256 of the file now at `path` (the store's: else ValueError, the temp removed)."""
        sha, tmp = self.info["sha256"], self.tmp
        try:
            got = self.hasher.result()
            if got == sha:
                os.fsync(self.fd)
        finally:
            self.close()
        if got != sha:
            durable.unlink(tmp)
            durable.unlink(self.side)
            raise ValueError(f"downloaded {self.blob_id!r} has sha256 {got}, the store says {sha}; removed {tmp}")
        durable.rename(tmp, self.path)
        durable.unlink(self.side)
        self.bar.close(self.info["size"])
        return got
