"""blobstore.py - a streaming, resumable, checksummed blob store for multi-GB weight files.

Runs on: the central VM, beside darl_server.py and fedmom_server.py. Standard library only.

    python blobstore.py --root DIR [--host 0.0.0.0 --token-file ~/.pww_token \\
                        --tls-cert server.pem --tls-key server.key --quota-gb 500 --max-blob-gb 128]   # default 127.0.0.1:29512
    python blobstore.py status --url https://127.0.0.1:29512 --token-file ~/.pww_token --ca-file ca.pem \\
                               [--fedmom https://127.0.0.1:29511]     # + why the aggregator keeps each blob

Callers: sites (fedmom_client: the shared token, or a site's own credential: its blobs
delta.<cluster>.* only) and fedmom_server.py (--aggregator-token-file's token); GET /health public.
Clients use blob_client.py's put_file() and get_file() (resumable, in parallel streams). Bodies go
to disk in chunks, an upload resumes where its bytes end, a blob is visible only complete and checked.
HTTP (ids: [A-Za-z0-9._-]{1,200}, not starting with "."):
    PUT    /blobs/<id>    the bytes, X-Content-Sha256 required; Content-Range: bytes START-END/TOTAL
                          continues at START = the offset HEAD reports (else 416). -> 201 complete,
                          202 {"offset"} not yet; 409 while another PUT holds the id. Send
                          `Expect: 100-continue` (put_file does): a refusal then comes before the body.
    PUT    /blobs/<id>?ranged=1  one piece, Content-Range required, at any offset and order, several at
                          once (409 only for a byte another request is writing); a landed byte never
                          changes. -> 202 {"ranges"}; 201 once every byte landed and the sha256 matches.
    HEAD   /blobs/<id>    complete: Content-Length, X-Content-Sha256; unfinished: X-Upload-Offset (0 for
                          pieces), X-Upload-Complete: 0, X-Upload-Total, X-Content-Sha256, X-Upload-Ranges
                          "A-B,..." (pieces: what landed durably); absent: 404.
    GET    /blobs/<id>    the bytes; honours Range: bytes=A-B, A-, -N (206). ?follow=1: an upload's landed
                          ranges as they land, framed (blob_client.FOLLOW), ending "complete"+sha256 or "gone".
    DELETE /blobs/<id>    the blob and/or its unfinished upload (no retention rule: fedmom_server.py
                          deletes its own blobs). GET /blobs: {"blobs", "uploads", "used_bytes",
                          "quota_bytes"}; GET /health: liveness.
Every refusal is a 4xx {"error"}; "retry": true when it may be sent again (httpc.py). A full disk
mid-upload is a 507 disk_full: the upload is discarded, start again at byte 0.

State directory (--root):
    partial/<id>          an unfinished upload: in order, its size IS the resume offset; or in pieces,
                          preallocated, with partial/.<id>.ranges: [start, end] lines, each after fdatasync
    partial/.<id>.json    {"total", "sha256"[, "ranged"]} declared when the upload began
    blobs/<id>, .<id>.json  finished blobs (renamed in after fsync and checksum check) and their
                          {"size", "sha256", "created"}, written before the rename
The protocol: FEDERATION_GUIDE.md, "Endpoints"; the disk it needs: RUNBOOK.md, "Central VM".
"""
import dataclasses
import hashlib
import http.client
import json
import os
import queue
import re
import sys
import threading
import time

import blob_client
import durable
import httpc
import httpd
import testhooks

DEFAULT_PORT = 29512
CHUNK = 4 << 20                       # bytes per read/write/hash step; 4 MiB keeps a PUT near disk speed
ID_RE = re.compile(r"[A-Za-z0-9._-]{1,200}")
SHA_RE = re.compile(r"[0-9a-f]{64}")
RANGE_RE = re.compile(r"bytes (\d+)-(\d+)/(\d+)")
GB = 10 ** 9
# an upload in pieces fdatasyncs and records what landed every this many bytes of a piece: what a
# crash of the store may lose of each piece being written (a broken connection loses nothing)
RECORD_BYTES = 32 << 20
FOLLOW_WAIT_S = 120.0     # a follow of an upload not begun yet waits this long for its first byte
FOLLOW_IDLE_S = 20.0      # a follow sends a keep-alive record after this long without news


@dataclasses.dataclass
class Config:
    root: str
    quota_gb: float = 500.0          # all blobs plus unfinished uploads (their declared totals)
    max_blob_gb: float = 128.0       # one blob; a 32B model's fp16 delta is 65 GB
    chunk_mb: float = 4.0

    def validate(self):
        if not self.root:
            raise SystemExit("--root is required: the directory that holds the blobs")
        if self.quota_gb <= 0 or self.max_blob_gb <= 0:
            raise SystemExit("--quota-gb and --max-blob-gb must be positive")
        if self.max_blob_gb > self.quota_gb:
            raise SystemExit(f"--max-blob-gb {self.max_blob_gb} exceeds --quota-gb {self.quota_gb}; "
                             "lower it or raise the quota")
        if not 0.0625 <= self.chunk_mb <= 64:
            raise SystemExit(f"--chunk-mb {self.chunk_mb} is out of range; use 0.0625..64 (default 4)")
        return self


def check_id(blob_id):
    """Ids never start with ".", so sidecars and temporary files cannot collide with a blob."""
    if not ID_RE.fullmatch(blob_id or "") or blob_id.startswith("."):
        raise httpd.HTTPError(400, f"bad blob id {blob_id[:80]!r}: use [A-Za-z0-9._-], 1-200 chars, "
                                   "not starting with '.'")
    return blob_id


def _read_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return None
    except ValueError:
        return None            # a torn sidecar counts as absent: the upload starts again


class _ChunkWriter:
    """Writes chunks at increasing offsets on one background thread, at most `depth`
    chunks behind the caller; the first write error is raised by the next put()/drain().
    put(n) with an int skips n bytes (already on disk). With `on_durable(a, b)`: every
    `every` bytes (and at close) it fdatasyncs and reports the bytes now durable, on the
    writer's thread, so the receiving thread never waits for the disk."""

    def __init__(self, fd, offset, depth=2, on_durable=None, every=0, on_write=None):
        self.fd, self.offset, self.queued, self.error = fd, offset, 0, None
        self.on_durable, self.every, self.mark, self.on_write = on_durable, every, offset, on_write
        self.q = queue.Queue(maxsize=depth)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while True:
            chunk = self.q.get()
            try:
                if chunk is None:
                    self._durable()
                    return
                if self.error is None:
                    self._write(chunk)
                    if self.on_write is not None:       # an in-order upload's followers (follow())
                        self.on_write()
                    if self.on_durable and self.offset - self.mark >= self.every:
                        self._durable()
            except OSError as e:
                self.error = e
            finally:
                self.q.task_done()

    def _write(self, chunk):
        if isinstance(chunk, int):
            self.offset += chunk
            return
        view = memoryview(chunk)
        while view:
            n = os.pwrite(self.fd, view, self.offset)
            view, self.offset = view[n:], self.offset + n

    def _durable(self):
        if self.on_durable and self.offset > self.mark:
            os.fdatasync(self.fd)
            self.on_durable(self.mark, self.offset)
            self.mark = self.offset

    def put(self, chunk):
        if self.error is not None:
            raise self.error
        self.queued += chunk if isinstance(chunk, int) else len(chunk)
        self.q.put(chunk)

    def drain(self):
        self.q.join()
        if self.error is not None:
            raise self.error

    def close(self):
        """Stop the thread (with on_durable: after reporting what landed, errors aside)."""
        self.q.put(None)
        self.thread.join()


def _segments(a, b, skip):
    """[a, b) cut at the edges of the sorted ranges `skip`: [(x, y, inside skip)]."""
    out = []
    for x, y in skip:
        x, y = max(x, a), min(y, b)
        if x < y:
            if a < x:
                out.append((a, x, False))
            out.append((x, y, True))
            a = y
    if a < b:
        out.append((a, b, False))
    return out


class _Pieces:
    """An upload in pieces (PUT ?ranged=1) while this process knows it: the ranges that
    landed (each fdatasynced, then appended to the log partial/.<id>.ranges, then counted
    here), the ranges requests are writing now, and the hash of the landed prefix."""

    def __init__(self, data, log, total, landed, notify=None):
        self.data, self.log, self.total, self.landed, self.notify = data, log, total, landed, notify
        self.writing, self.finishing, self.lock = [], False, threading.Lock()
        self.hasher = blob_client.PrefixHasher(data, total, landed)

    def record(self, a, b):
        with self.lock:                                 # the writers of several requests record here
            durable.append_json_line(self.log, [a, b])  # the acknowledgement: after the bytes are durable
            self.landed = blob_client.add_range(self.landed, a, b)
        self.hasher.add(a, b)
        if self.notify is not None:                     # the followers (BlobStore.follow)
            self.notify()

    def all_landed(self):
        return blob_client.prefix_end(self.landed) >= self.total


class BlobStore:
    """The store on disk, without HTTP. One upload per id at a time (409 otherwise)."""

    def __init__(self, root, quota_bytes, max_blob_bytes, chunk=CHUNK):
        self.root, self.quota, self.max_blob, self.chunk = root, int(quota_bytes), int(max_blob_bytes), chunk
        self.blobs, self.partial = os.path.join(root, "blobs"), os.path.join(root, "partial")
        for d in (self.blobs, self.partial):
            os.makedirs(d, exist_ok=True)
            for name in os.listdir(d):
                if name.startswith(".") and durable.is_tmp(name):   # a sidecar torn by a crash
                    durable.unlink(os.path.join(d, name))
        self.lock = threading.Lock()
        self.uploading = set()                          # ids with a PUT in progress
        self.hash_cache = {}                            # id -> (offset, sha256 state) of the last PUT
        self.pieces = {}                                # id -> _Pieces of an upload in pieces
        self.cond = threading.Condition()               # notified at every change a follower sees

    def notify(self):
        with self.cond:
            self.cond.notify_all()

    # ---- paths and state
    def _blob(self, i):
        return os.path.join(self.blobs, i), os.path.join(self.blobs, f".{i}.json")

    def _part(self, i):
        return os.path.join(self.partial, i), os.path.join(self.partial, f".{i}.json")

    def _log(self, i):
        return os.path.join(self.partial, f".{i}.ranges")

    def complete(self, blob_id):
        """{"size", "sha256"} of a finished blob, or None."""
        data, side = self._blob(blob_id)
        meta = _read_json(side)
        if meta is None or not os.path.exists(data):
            return None
        return meta

    def unfinished(self, blob_id):
        """{"offset", "total", "sha256"} of an unfinished upload, or None; one in pieces adds
        "ranges" (what landed) and its offset counts the landed bytes."""
        data, side = self._part(blob_id)
        meta = _read_json(side)
        if meta is None or not os.path.exists(data):
            return None
        if not meta.get("ranged"):
            return {**meta, "offset": os.path.getsize(data)}
        up = self.pieces.get(blob_id)
        landed = up.landed if up is not None else self._logged(blob_id, meta["total"])
        return {**meta, "offset": sum(b - a for a, b in landed), "ranges": landed}

    def _logged(self, blob_id, total):
        """The ranges the log of an upload in pieces names (a line torn by a crash: skipped)."""
        landed = []
        for row in durable.read_jsonl(self._log(blob_id)):
            if isinstance(row, list) and len(row) == 2 and 0 <= row[0] < row[1] <= total:
                landed = blob_client.add_range(landed, *row)
        return landed

    def used_bytes(self, except_id=None):
        used = 0
        for d, key in ((self.blobs, "size"), (self.partial, "total")):
            for name in os.listdir(d):
                if name.startswith(".") and name.endswith(".json") \
                        and name[1:-5] != except_id:
                    used += (_read_json(os.path.join(d, name)) or {}).get(key, 0)
        return used

    def listing(self):
        blobs, uploads = [], []
        for name in sorted(os.listdir(self.blobs)):
            if not name.startswith("."):
                meta = self.complete(name)
                if meta:
                    blobs.append({"id": name, "size": meta["size"], "sha256": meta["sha256"]})
        for name in sorted(os.listdir(self.partial)):
            if not name.startswith("."):
                meta = self.unfinished(name)
                if meta:
                    uploads.append({"id": name, "offset": meta["offset"], "total": meta["total"],
                                    "uploading": name in self.uploading or bool(
                                        name in self.pieces and self.pieces[name].writing)})
        return {"blobs": blobs, "uploads": uploads, "used_bytes": self.used_bytes(), "quota_bytes": self.quota}

    # ---- upload
    def claim(self, blob_id):
        with self.lock:
            up = self.pieces.get(blob_id)
            if blob_id in self.uploading or (up is not None and up.writing):
                raise httpd.HTTPError(409, f"blob {blob_id!r} is being uploaded by another request; "
                                           "retry when it ends", retry=True)
            self.uploading.add(blob_id)

    def release(self, blob_id):
        with self.lock:
            self.uploading.discard(blob_id)

    def _existing(self, blob_id, total, sha):
        """The finished blob with this size and checksum (nothing to do), or None; 409 when it has
        another, 413 above the per-blob limit."""
        if total > self.max_blob:
            raise httpd.HTTPError(413, f"blob of {total} bytes exceeds the per-blob limit of {self.max_blob} "
                                       "bytes (--max-blob-gb)")
        done = self.complete(blob_id)
        if done is not None:
            if done["sha256"] == sha and done["size"] == total:
                return done
            raise httpd.HTTPError(409, f"blob {blob_id!r} already exists with another checksum; DELETE it first")
        return None

    def prepare(self, blob_id, start, total, sha):
        """Check a PUT against what is on disk; returns an existing blob (nothing to do) or None."""
        done = self._existing(blob_id, total, sha)
        if done is not None:
            return done
        part = self.unfinished(blob_id)
        if start > 0:
            if part is None or part["total"] != total or part["sha256"] != sha or "ranges" in part:
                raise httpd.HTTPError(416, f"no unfinished upload of {blob_id!r} with that size and checksum "
                                           "to continue; start again at byte 0", offset=0, retry=True)
            if part["offset"] != start:
                raise httpd.HTTPError(416, f"upload of {blob_id!r} continues at byte {part['offset']}, "
                                           f"not {start}; HEAD it for X-Upload-Offset",
                                      offset=part["offset"], retry=True)
            return None
        data, side = self._part(blob_id)
        with self.lock:                 # quota: a new upload reserves its declared total, atomically
            used = self.used_bytes(except_id=blob_id)
            if used + total > self.quota:
                raise httpd.HTTPError(413, f"blob of {total} bytes would exceed the store quota "
                                           f"({used} of {self.quota} bytes used; --quota-gb)")
            self.hash_cache.pop(blob_id, None)
            self._drop_pieces(blob_id)
            durable.write_json(side, {"total": total, "sha256": sha, "started": time.time()})
            open(data, "wb").close()
            self.notify()
        return None

    def receive(self, blob_id, start, total, chunks):
        """Append `chunks` at `start`, hashing as they land; finish the blob if it is complete.
        A dropped connection leaves the bytes received so far for the next PUT.

        The socket read and the sha256 run in this thread while a second thread writes
        the previous chunk: done in series, a PUT ran at ~0.6 of the disk's speed."""
        data, side = self._part(blob_id)
        h = self._hash_prefix(blob_id, data, start)
        fd = os.open(data, os.O_WRONLY)
        writer = _ChunkWriter(fd, start, on_write=self.notify)
        try:
            for chunk in chunks:
                h.update(chunk)
                writer.put(chunk)
                testhooks.fault_point("blob.chunk")      # test hook (testhooks.py): killed mid-upload
            writer.drain()
            if writer.offset == total:
                os.fsync(fd)
        finally:
            writer.close()
            os.close(fd)
            if writer.offset == start + writer.queued:      # every chunk hashed is on disk
                self.hash_cache[blob_id] = (writer.offset, h)
        if writer.offset < total:
            return None
        return self._finish(blob_id, total, h.hexdigest())

    def _hash_prefix(self, blob_id, data, start):
        """The sha256 state of the bytes before `start`. hashlib cannot save a state to disk,
        so a PUT that continues an upload re-hashes the prefix on disk (a sequential read,
        ~2 s per 3.6 GiB); the state of this process's last PUT is kept in memory, so a
        resume after a dropped connection costs nothing. The prefix is not fsynced chunk by
        chunk: after a power loss it may hold garbage, which the final checksum catches."""
        cached = self.hash_cache.pop(blob_id, None)
        if cached is not None and cached[0] == start:
            return cached[1]
        return blob_client.sha256_file(data, 0, start, hashlib.sha256())

    def _finish(self, blob_id, total, got):
        data, side = self._part(blob_id)
        meta = _read_json(side)
        self.hash_cache.pop(blob_id, None)
        if got != meta["sha256"]:
            durable.unlink(data)
            durable.unlink(side)
            self.notify()
            raise httpd.HTTPError(400, f"checksum mismatch for {blob_id!r}: declared {meta['sha256']}, "
                                       f"received {got}; the upload was discarded, PUT it again from byte 0")
        final, final_side = self._blob(blob_id)
        durable.write_json(final_side, {"size": total, "sha256": got, "created": time.time()})
        durable.rename(data, final)                     # the blob appears whole, or not at all
        durable.unlink(side)
        self.notify()
        return {"id": blob_id, "size": total, "sha256": got}

    # ---- upload in pieces (PUT ?ranged=1)
    def prepare_pieces(self, blob_id, a, b, total, sha):
        """The _Pieces of this upload with [a, b) marked as being written by this request (two
        writers of one byte, or beside a one-stream PUT: 409), or an existing blob with that
        checksum (nothing to do). A new upload, or one with another size or checksum (replaced,
        as a PUT from byte 0 does), reserves its total against the quota and on disk."""
        data, side = self._part(blob_id)
        with self.lock:
            done = self._existing(blob_id, total, sha)
            if done is not None:
                return done
            up = self.pieces.get(blob_id)
            if blob_id in self.uploading or (up is not None and (up.finishing or any(
                    x < b and a < y for x, y in up.writing))):
                raise httpd.HTTPError(409, f"bytes {a}-{b - 1} of blob {blob_id!r} are being uploaded by another "
                                           "request; retry when it ends", retry=True)
            meta = _read_json(side)
            same = bool(meta and meta.get("ranged") and meta["total"] == total and meta["sha256"] == sha
                        and os.path.exists(data))
            if not same and up is not None and up.writing:
                raise httpd.HTTPError(409, f"blob {blob_id!r} is being uploaded with another size or checksum; "
                                           "retry when it ends", retry=True)
            if not same:
                self._start_pieces(blob_id, total, sha)
            elif up is None:
                self.pieces[blob_id] = _Pieces(data, self._log(blob_id), total, self._logged(blob_id, total),
                                               self.notify)
            up = self.pieces[blob_id]
            up.writing.append((a, b))
            return up

    def _start_pieces(self, blob_id, total, sha):
        used = self.used_bytes(except_id=blob_id)
        if used + total > self.quota:
            raise httpd.HTTPError(413, f"blob of {total} bytes would exceed the store quota "
                                       f"({used} of {self.quota} bytes used; --quota-gb)")
        data, side = self._part(blob_id)
        self.hash_cache.pop(blob_id, None)
        self._drop_pieces(blob_id)
        durable.write_json(side, {"total": total, "sha256": sha, "ranged": True, "started": time.time()})
        with open(data, "wb") as f:             # the space now: a full disk answers 507 before the body
            if total:
                try:
                    os.posix_fallocate(f.fileno(), 0, total)
                except OSError as e:
                    if durable.is_disk_full(e):
                        raise
                    f.truncate(total)           # a file system without fallocate: a sparse file
        self.pieces[blob_id] = _Pieces(data, self._log(blob_id), total, [], self.notify)
        self.notify()

    def receive_piece(self, blob_id, up, a, b, chunks):
        """Write bytes [a, b) at their offset; bytes that already landed are read and dropped
        (a landed byte never changes: the hash may have read it). Every RECORD_BYTES, and when
        the body ends or breaks, the writer fdatasyncs and records what landed. Then, if every
        byte landed and no other piece is being written: check the checksum and finish."""
        skip = [(x, y) for x, y in up.landed if x < b and a < y]
        fd = os.open(up.data, os.O_WRONLY)
        writer = _ChunkWriter(fd, a, on_durable=up.record, every=RECORD_BYTES)
        pos = a
        try:
            for chunk in chunks:
                view = memoryview(chunk)
                for x, y, landed in _segments(pos, pos + len(chunk), skip):
                    writer.put(y - x if landed else view[x - pos:y - pos])
                pos += len(chunk)
                testhooks.fault_point("blob.piece")     # test hook (testhooks.py): killed mid-piece
            writer.drain()
        finally:
            writer.close()                              # records what landed, also of a broken body
            os.close(fd)
            with self.lock:
                up.writing.remove((a, b))
                last = up.all_landed() and not up.writing and not up.finishing and self.pieces.get(blob_id) is up
                up.finishing = up.finishing or last
        if writer.error is not None:
            raise writer.error
        return self._finish_pieces(blob_id, up) if last else None

    def _finish_pieces(self, blob_id, up):
        data, side = self._part(blob_id)
        try:
            got, want = up.hasher.result(), _read_json(side)["sha256"]
            if got != want:
                self.discard(blob_id)
                raise httpd.HTTPError(400, f"checksum mismatch for {blob_id!r}: declared {want}, received {got}; "
                                           "the upload was discarded, PUT it again from byte 0")
            durable.fsync_file(data)
            out = self._finish(blob_id, up.total, got)
            self._drop_pieces(blob_id)
            return out
        finally:
            up.finishing = False

    def discard(self, blob_id):
        """Drop an unfinished upload and its sidecar (after a full disk: give the space back)."""
        data, side = self._part(blob_id)
        durable.unlink(data)
        durable.unlink(side)
        durable.unlink(self._log(blob_id))
        self.hash_cache.pop(blob_id, None)
        self._drop_pieces(blob_id)
        self.notify()

    def _drop_pieces(self, blob_id):
        up = self.pieces.pop(blob_id, None)
        if up is not None:
            up.hasher.close()
        durable.unlink(self._log(blob_id))

    def delete(self, blob_id):
        with self.lock:
            up = self.pieces.get(blob_id)
            if blob_id in self.uploading or (up is not None and (up.writing or up.finishing)):
                raise httpd.HTTPError(409, f"blob {blob_id!r} is being uploaded; DELETE it when the PUT ends")
            found = False
            for data, side in (self._blob(blob_id), self._part(blob_id)):
                found |= os.path.exists(data) or os.path.exists(side)
                durable.unlink(data)                    # data first: a sidecar alone is not a blob
                durable.unlink(side)
            self.hash_cache.pop(blob_id, None)
            self._drop_pieces(blob_id)
        self.notify()
        if not found:
            raise httpd.HTTPError(404, f"no blob {blob_id!r}")
        return {"id": blob_id, "deleted": True}

    # ---- follow (GET ?follow=1)
    def _view(self, blob_id):
        """What a follower may send now: (path, total, sha256, landed ranges, complete), or None."""
        meta = self.complete(blob_id)
        if meta is not None:
            return self._blob(blob_id)[0], meta["size"], meta["sha256"], [[0, meta["size"]]], True
        part = self.unfinished(blob_id)
        if part is None:
            return None
        landed = part.get("ranges", [[0, part["offset"]]] if part["offset"] else [])
        return self._part(blob_id)[0], part["total"], part["sha256"], landed, False

    def _await(self, blob_id, ident, sent, begin_by):
        """Wait for news for a follower that sent `sent` of the upload `ident` (total, sha256):
        ("send", view) bytes to send or the blob complete; ("gone", None) it went or changed
        under the follower, or was not begun by `begin_by`; ("idle", None) FOLLOW_IDLE_S without."""
        with self.cond:
            while True:
                view = self._view(blob_id)
                if view is None:
                    if ident is not None or time.monotonic() >= begin_by:
                        return "gone", None
                elif ident is not None and (view[1:3] != ident or
                                            any(blob_client.gaps(view[3], a, b) for a, b in sent)):
                    return "gone", None
                elif view[4] or any(blob_client.gaps(sent, a, b) for a, b in view[3]):
                    return "send", view
                wait = FOLLOW_IDLE_S if view is not None else min(FOLLOW_IDLE_S, begin_by - time.monotonic())
                if not self.cond.wait(max(wait, 0.0)):
                    if view is not None or time.monotonic() < begin_by:
                        return "idle", None

    def follow(self, blob_id, wait_s=FOLLOW_WAIT_S):
        """GET ?follow=1: framed records (blob_client.FOLLOW) of every range as it lands (in
        pieces: fdatasync'd and logged; in order: written), read from the file the upload
        writes (kept open, so its rename on completion changes nothing); then an end record:
        {"complete", "sha256", "size"} once the checksum matched and the blob is in place, or
        {"gone"} (deleted, discarded, replaced, or not begun within wait_s). Woken by
        self.cond; a keep-alive record after FOLLOW_IDLE_S without news."""
        sent, fd, ident, t0 = [], None, None, time.monotonic()
        try:
            while True:
                what, view = self._await(blob_id, ident, sent, t0 + wait_s)
                if what == "gone":
                    why = "not begun" if ident is None else "deleted, discarded or replaced"
                    yield _record(b"E", 0, json.dumps({"gone": why}).encode())
                    return
                if what == "idle":
                    yield _record(b"K", 0, b"")          # the follower's read timeout does not fire
                    continue
                path, total, sha, landed, done = view
                if fd is None:
                    fd, ident = os.open(path, os.O_RDONLY), (total, sha)
                for a, b in landed:
                    for x, y in blob_client.gaps(sent, a, b):
                        for pos in range(x, y, self.chunk):
                            data = os.pread(fd, min(self.chunk, y - pos), pos)
                            yield _record(b"R", pos, data)
                            sent = blob_client.add_range(sent, pos, pos + len(data))
                if done and blob_client.prefix_end(sent) >= total:
                    yield _record(b"E", 0, json.dumps({"complete": True, "sha256": sha, "size": total}).encode())
                    return
        finally:
            if fd is not None:
                os.close(fd)


def _record(kind, offset, payload):
    return blob_client.FOLLOW.pack(kind, offset, len(payload)) + payload


# ---------------------------------------------------------------- HTTP routes

def parse_put_headers(req):
    """(start, total, sha) from Content-Length, Content-Range and X-Content-Sha256."""
    sha = (req.headers.get("X-Content-Sha256") or "").strip().lower()
    if not SHA_RE.fullmatch(sha):
        raise httpd.HTTPError(400, "X-Content-Sha256 header must be the 64-hex-digit sha256 of the whole blob")
    length = req.content_length()
    raw = req.headers.get("Content-Range")
    if raw is None:
        return 0, length, sha
    m = RANGE_RE.fullmatch(raw.strip())
    if not m:
        raise httpd.HTTPError(400, f"Content-Range {raw[:80]!r} is not 'bytes START-END/TOTAL'")
    start, end, total = map(int, m.groups())
    if not start <= end < total or end - start + 1 != length:
        raise httpd.HTTPError(400, f"Content-Range {raw!r} does not match Content-Length {length} "
                                   "(END is inclusive and below TOTAL)")
    return start, total, sha


def parse_range(raw, size):
    """Range header -> (offset, length) or None for the whole blob; 416 when unsatisfiable."""
    m = re.fullmatch(r"bytes=(\d*)-(\d*)", (raw or "").strip())
    if not m or m.groups() == ("", ""):
        raise httpd.HTTPError(416, f"Range {raw[:80]!r} is not one 'bytes=A-B', 'bytes=A-' or 'bytes=-N'")
    a, b = m.groups()
    if a == "":
        n = min(int(b), size)
        start, end = size - n, size - 1
    else:
        start, end = int(a), min(int(b), size - 1) if b else size - 1
    if start >= size or end < start:
        raise httpd.HTTPError(416, f"Range {raw!r} is outside the {size}-byte blob")
    return start, end - start + 1


def make_routes(store):
    def put_piece(req, blob_id):
        start, total, sha = parse_put_headers(req)
        if req.headers.get("Content-Range") is None:
            raise httpd.HTTPError(400, "a PUT ?ranged=1 needs Content-Range: bytes START-END/TOTAL")
        end = start + req.content_length()
        up = store.prepare_pieces(blob_id, start, end, total, sha)
        if isinstance(up, dict):
            return 200, {"id": blob_id, "size": up["size"], "sha256": up["sha256"], "existing": True}
        try:
            out = store.receive_piece(blob_id, up, start, end, req.stream(store.chunk, end - start))
        except OSError as e:
            if not durable.is_disk_full(e):
                raise
            with store.lock:
                idle = not up.writing
            if idle:                    # a full disk: the upload gives its space back (start it again)
                store.discard(blob_id)
            raise httpd.disk_full(store.root, e) from None
        if out is None:
            return 202, {"id": blob_id, "total": total, "complete": False,
                         "ranges": blob_client.format_ranges(up.landed)}
        return 201, out

    def put(req):
        blob_id = req.may_touch_blob(check_id(req.tail), write=True)
        if req.query.get("ranged") == "1":
            return put_piece(req, blob_id)
        start, total, sha = parse_put_headers(req)
        store.claim(blob_id)
        try:
            done = store.prepare(blob_id, start, total, sha)
            if done is not None:
                return 200, {"id": blob_id, "size": done["size"], "sha256": done["sha256"], "existing": True}
            length = req.content_length()
            out = store.receive(blob_id, start, total, req.stream(store.chunk, length))
        except OSError as e:
            if not durable.is_disk_full(e):
                raise
            # a full disk: the unfinished upload gives its space back (the client starts it again)
            store.discard(blob_id)
            raise httpd.disk_full(store.root, e) from None
        finally:
            store.release(blob_id)
        if out is None:
            return 202, {"id": blob_id, "offset": start + length, "total": total, "complete": False}
        return 201, out

    def head_or_get(req):
        blob_id = req.may_touch_blob(check_id(req.tail), write=False)
        if req.method == "GET" and req.query.get("follow") == "1":
            return httpd.Response(200, {"X-Follow": "1"}, stream=store.follow(blob_id),
                                  content_type="application/x-pww-follow")
        meta = store.complete(blob_id)
        if meta is None:
            part = store.unfinished(blob_id)
            if part is None:
                raise httpd.HTTPError(404, f"no blob {blob_id!r}")
            if req.method == "GET":
                raise httpd.HTTPError(404, f"blob {blob_id!r} is still uploading ({part['offset']} of "
                                           f"{part['total']} bytes)")
            headers = {"X-Upload-Offset": part["offset"], "X-Upload-Complete": "0",
                       "X-Upload-Total": part["total"], "X-Content-Sha256": part["sha256"]}
            if "ranges" in part:        # in pieces: a one-stream client starts again at byte 0
                headers.update({"X-Upload-Offset": 0, "X-Upload-Ranges": blob_client.format_ranges(part["ranges"])})
            return httpd.Response(200, headers)
        size = meta["size"]
        headers = {"X-Content-Sha256": meta["sha256"], "Accept-Ranges": "bytes", "X-Upload-Complete": "1"}
        raw = req.headers.get("Range")
        status, offset, length = 200, 0, size
        if raw is not None and req.method == "GET":
            offset, length = parse_range(raw, size)
            headers["Content-Range"] = f"bytes {offset}-{offset + length - 1}/{size}"
            status = 206
        try:                    # opened here: a DELETE before the reply goes out cannot cut it short
            f = open(store._blob(blob_id)[0], "rb")
        except FileNotFoundError:
            raise httpd.HTTPError(404, f"no blob {blob_id!r}")
        return httpd.Response(status, headers, file=f, offset=offset, length=length)

    return {
        ("GET", "/health"): lambda req: {"ok": True, "service": "blobstore"},
        ("GET", "/blobs"): lambda req: store.listing(),
        ("PUT", "/blobs/*"): put,
        ("HEAD", "/blobs/*"): head_or_get,
        ("GET", "/blobs/*"): head_or_get,
        ("DELETE", "/blobs/*"): lambda req: store.delete(req.may_touch_blob(check_id(req.tail), write=True)),
    }


def serve(cfg, net):
    cfg.validate()
    agg_token = httpc.load_token(net.aggregator_token_file, env=None)
    if agg_token and agg_token == httpc.load_token(net.token_file):
        raise SystemExit("blobstore: --aggregator-token-file holds the sites' token; give the aggregator its own "
                         "(central.sh's STATE/aggregator.token)")
    # bind first: a refusal creates nothing. The listing names every site's blobs: no site's to call
    server = httpd.server_from_args(net, disk=cfg.root, read_paths=("/status", "/blobs"), aggregator_token=agg_token,
                                    operator_paths=("/blobs", "/status"))
    httpd.writable_dir(cfg.root, "--root")
    store = BlobStore(cfg.root, cfg.quota_gb * GB, cfg.max_blob_gb * GB, int(cfg.chunk_mb * 2**20))
    listing = make_routes(store)
    server.RequestHandlerClass.routes.update(httpd.with_http_stats(
        {**listing, ("GET", "/status"): listing[("GET", "/blobs")]}, server))
    httpd.serve_forever(server, f"blobstore (root {cfg.root})")


# ---------------------------------------------------------------- the status command

def kept_by(fedmom_url, token=None, ca_file=None):
    """{blob id: why} for the blobs the aggregator at `fedmom_url` keeps (its GET /status
    "retention"), and a line saying its rule. The store itself enforces no retention: the
    aggregator deletes its own theta/update blobs once no site can use them."""
    try:
        st = httpc.call(fedmom_url, "GET", "/status", token=token, ca_file=ca_file)
    except (httpc.CallError, OSError, http.client.HTTPException, ValueError) as e:
        return {}, f"!!! the aggregator at {fedmom_url} does not say what it keeps ({type(e).__name__}: {e})"
    ret = ((st.get("retention") or {}).get("blobs")) if isinstance(st, dict) else None
    if not ret:
        return {}, f"the aggregator at {fedmom_url} names no blob retention (no --blob-url, or an older version)"
    swept = "not swept yet" if ret["swept_round"] is None else f"last swept at round {ret['swept_round']}"
    line = (f"aggregator {st.get('aggregator')} keeps its theta/update blobs of the last {ret['keep_rounds']} "
            f"rounds (--keep-rounds; {swept}; {ret['deleted']} deleted)")
    return {k["blob"]: k["why"] for k in ret["kept"]}, line


def print_status(url, token=None, ca_file=None, fedmom_url=None):
    """Print the store's contents and use; 1 when it is full (every new upload is refused).
    fedmom_url: also say why the aggregator there keeps each of its blobs."""
    st = httpc.call(url, "GET", "/blobs", token=token, ca_file=ca_file)
    used, quota = st["used_bytes"], st["quota_bytes"]
    print(f"{len(st['blobs'])} blobs, {len(st['uploads'])} unfinished uploads; "
          f"{used / GB:.2f} of {quota / GB:.2f} GB used ({100 * used / quota:.0f}%)")
    whys, prefix = {}, None
    if fedmom_url:
        whys, line = kept_by(fedmom_url, token, ca_file)
        prefix = (line.split()[1] + ".") if line.startswith("aggregator ") else None
        print(line)
    for b in st["blobs"]:
        why = ""
        if fedmom_url:
            why = whys.get(b["id"]) or ("  the aggregator's, newer than its last sweep: judged at the next one"
                                        if prefix and b["id"].startswith(prefix) else
                                        "  not the aggregator's (a delta in transit, another run's)")
            why = why if why.startswith("  ") else f"  kept: {why}"
        print(f"  {b['id']:<48} {b['size'] / 2**20:>10.1f} MiB  sha256 {b['sha256'][:16]}{why}")
    for u in st["uploads"]:
        print(f"  {u['id']:<48} {u['offset'] / 2**20:>10.1f} of {u['total'] / 2**20:.1f} MiB"
              + ("  (uploading)" if u["uploading"] else ""))
    if used >= quota:
        print("!!! the store is full: uploads are refused until blobs are deleted or --quota-gb is raised")
        return 1
    return 0


def main(argv):
    if argv[:1] == ["status"]:
        p = httpd.base_parser("blobstore.py status - what a running blob store holds; exit 1 when it is full.")
        p.add_argument("status")
        p.add_argument("--url", default=f"http://127.0.0.1:{DEFAULT_PORT}",
                       help=f"blob store URL, https://... under TLS (default http://127.0.0.1:{DEFAULT_PORT})")
        p.add_argument("--fedmom", metavar="URL",
                       help="also ask the aggregator there (fedmom_server.py, :29511) why it keeps each of its "
                            "theta/update blobs (its GET /status; the same token and CA)")
        httpc.add_client_args(p)
        a = p.parse_args(argv)
        try:
            return print_status(a.url, httpc.load_token(a.token_file), a.ca_file, a.fedmom)
        except (httpc.CallError, httpc.TLSConfigError, OSError) as e:
            raise SystemExit(f"status: {a.url}: {e}")
    p = httpd.base_parser(__doc__)
    p.add_argument("--root", required=True, help="state directory holding blobs/ and partial/")
    p.add_argument("--quota-gb", type=float, default=500.0,
                   help="total size of all blobs and unfinished uploads, GB = 1e9 bytes (default 500)")
    p.add_argument("--max-blob-gb", type=float, default=128.0, help="largest single blob, GB (default 128)")
    p.add_argument("--chunk-mb", type=float, default=4.0, help="PUT read/write/hash step, MiB (default 4)")
    p.add_argument("--aggregator-token-file", default=os.environ.get("PWW_BLOB_TOKEN_FILE"),
                   help="the aggregator's own token (fedmom_server.py --blob-token-file): every blob, whatever "
                        "`httpd.py site shared off` says of the shared token (default $PWW_BLOB_TOKEN_FILE, "
                        "as fedmom_server.py reads it)")
    httpd.add_server_args(p, DEFAULT_PORT)
    a = p.parse_args(argv)
    serve(Config(a.root, a.quota_gb, a.max_blob_gb, a.chunk_mb), a)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
