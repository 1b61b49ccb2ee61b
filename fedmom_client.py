"""fedmom_client.py - the site side of the FedMom round protocol (fedmom_server.py).

Runs on: the sites, in rank 0 of a training job (diloco.py's HTTP carrier, through
FedMomClient), or on any box that can reach the aggregator. Python standard library
only (httpc.py, durable.py, and blob_client.py for the blob transport); never torch, so
it also runs in a plain Python 3 for tests and drills.

One outer round, as a site runs it:

    import fedmom_client
    c = fedmom_client.FedMomClient("http://central:29511", cluster="lumi",
                                   incarnation=secrets.token_hex(8), token=TOKEN,
                                   blob_url="http://central:29512")   # blob_url: optional
    d = lambda: httpc.Deadline(httpc.RETRY_S)     # each call's budget: repeated under it (httpc.py's rule)
    c.join(deadline=d())                # waits out an older incarnation of "lumi" timing out
    rnd = c.download_theta("theta.safetensors")         # atomic; returns theta's round
    with c.keepalive():                 # background heartbeats while the inner steps run
        train(H)                        # ... then write delta = theta_local - theta_global
    try:
        c.send_delta("delta.safetensors", base_round=rnd, tokens=n, leases=[{"id": 7, "end": 120}],
                     metrics={"loss": 2.31, "tokens_per_s": 9.1e5}, deadline=d())
        rnd = c.wait_round_after(rnd, timeout_s=3600)   # the merge of that round is durable
    except fedmom_client.StaleRound as e:
        rnd = e.current_round            # another round went by: reload theta, train again
    # the next theta: with the aggregator's --down-wire, the update from the theta we hold
    # (fedsite.py adds it with wire.apply_update), else (None) the whole file again
    got = c.download_update("update.safetensors", base_round, wire.theta_digest("theta.safetensors"))
    c.leave()                           # at the end of the allocation

Transports: "inline" streams the file as the PUT body; "blob" uploads it to the blob store
(resumable) and names it; "auto" (default) uses the blob store for files of AUTO_BLOB_BYTES
or more when blob_url is set. Repeats: a call given `deadline` (an httpc.Deadline) is
repeated under it by httpc.py's rule; without one it is one attempt. Nothing here repeats on
its own, except that a 409 not_member joins again and sends the call once more. Each call's
"deltas" (join/heartbeat replies) say what became of this cluster's deltas: merged,
excluded or pending. Who may call: anyone holding the aggregator's bearer token.

The protocol (why a repeat is safe, the outcomes and who settles the leases): FEDERATION_GUIDE.md,
"A round, from the site's side" and "What a site repeats, and for how long".
"""
import http.client
import json
import os
import secrets
import socket
import threading
import time
import urllib.parse

import blob_client
import durable
import httpc


def log(msg):
    print(time.strftime("%Y-%m-%d %H:%M:%S ") + msg, flush=True)


class StaleRound(Exception):
    """The server is on another round than the delta's base: reload theta and train again."""

    def __init__(self, current_round, reason=""):
        super().__init__(reason or f"the server is at round {current_round}")
        self.current_round = current_round


AUTO_BLOB_BYTES = 256 << 20     # "auto" sends larger deltas through the blob store (resumable)


class FedMomClient:
    """The site side of the protocol (stdlib + numpy; no torch).

    ca_file: the CA for https:// URLs (central.sh's ca.pem). stall_s: how long a theta
    download or delta upload may make no progress before the attempt is abandoned (an
    OSError, so a deadline repeats it); the blob transport resumes where it stopped."""

    def __init__(self, url, cluster, incarnation, token=None, blob_url=None, timeout=60.0, ca_file=None,
                 stall_s=120.0):
        self.url, self.cluster, self.incarnation = url, cluster, incarnation
        self.token, self.blob_url, self.timeout = token, blob_url, timeout
        self.ca_file, self.stall_s = ca_file, stall_s
        self.heartbeat_s = 30.0

    def _request(self, method, path, body=None, timeout=None, deadline=None):
        """One JSON request (one attempt)."""
        return httpc.call(self.url, method, path, body, token=self.token, ca_file=self.ca_file,
                          timeout=httpc.io_timeout(timeout or self.timeout, deadline))

    def _call(self, method, path, body=None, timeout=None, deadline=None):
        """_request, repeated under `deadline` by httpc.retry."""
        return httpc.retry(f"FedMom {method} {path}", lambda: self._request(method, path, body, timeout, deadline),
                           deadline)

    def _as_member(self, what, fn, deadline):
        """fn(); after a 409 not_member (the aggregator dropped us: a network outage longer
        than --member-timeout-s) join again and run fn() once more."""
        try:
            return fn()
        except httpc.CallError as e:
            if e.reply.get("code") != "not_member":
                raise
            log(f"fedmom client: {what}: the aggregator no longer counts us as a member ({e.reply.get('error')}); "
                "joining again")
        self._join_once(deadline)
        return fn()

    def _ident(self, **extra):
        return {"cluster": self.cluster, "incarnation": self.incarnation, **extra}

    def join(self, deadline=None):
        """Join; under `deadline`, also wait while an older incarnation of this cluster times out
        (409 incarnation_conflict)."""
        return httpc.retry("FedMom join", lambda: self._join_once(deadline), deadline,
                           waits=(httpc.INCARNATION_CONFLICT,))

    def _join_once(self, deadline):
        reply = self._request("POST", "/join", self._ident(), deadline=deadline)
        self.heartbeat_s = reply.get("heartbeat_s", self.heartbeat_s)
        return reply

    def heartbeat(self, metrics=None, wait_round_after=None, wait_s=0.0, deadline=None):
        body = self._ident(metrics=metrics or {})
        if wait_round_after is not None:
            body.update(wait_round_after=wait_round_after, wait_s=wait_s)

        def once():
            return self._request("POST", "/heartbeat", body, timeout=self.timeout + wait_s, deadline=deadline)
        return httpc.retry("FedMom heartbeat", lambda: self._as_member("heartbeat", once, deadline), deadline)

    def leave(self, deadline=None):
        return self._call("POST", "/leave", self._ident(), deadline=deadline)

    def current_round(self, deadline=None):
        return self._call("GET", "/round", deadline=deadline)["round"]

    def wait_round_after(self, base_round, timeout_s, deadline=None):
        """Block until the server's round passes base_round (that merge is durable); heartbeats
        meanwhile (each one repeated under `deadline` when given). A wait, not a retry:
        TimeoutError after timeout_s with the round not passed."""
        end = time.monotonic() + timeout_s
        while True:
            left = end - time.monotonic()
            reply = self.heartbeat(wait_round_after=base_round, wait_s=max(0.0, min(left, self.heartbeat_s)),
                                   deadline=deadline)
            if reply["round"] > base_round:
                return reply["round"]
            if time.monotonic() >= end:
                raise TimeoutError(f"round still {reply['round']} after {timeout_s:.0f} s (waiting for > {base_round})")

    def keepalive(self, interval_s=None):
        """A background heartbeat thread for the inner phase: `with client.keepalive(): train()`."""
        return _KeepAlive(self, interval_s or self.heartbeat_s)

    # ---- theta

    def download_theta(self, path, transport="inline", deadline=None):
        """Write the current theta_global to `path` (atomically); returns its round."""
        if transport not in ("inline", "blob"):
            raise ValueError(f"transport {transport!r}: use 'inline' or 'blob'")

        def attempt():
            if transport == "inline":
                return int(self._get_file("/theta", path, deadline)["X-Round"])
            info = self._request("GET", "/theta_blob", timeout=3600, deadline=deadline)
            sha = self._get_blob(info["blob"], path, deadline)
            if sha != info["sha256"]:
                raise IOError(f"theta blob {info['blob']}: sha256 {sha} != {info['sha256']}")
            return info["round"]
        return httpc.retry("download theta_global", attempt, deadline)

    def download_update(self, path, base_round, base_digest, transport="inline", deadline=None):
        """With the aggregator's --down-wire: write the update that takes our theta of
        `base_round` (wire.Digest `base_digest`) to the current round to `path` (inline, or
        through the blob store: resumable); returns (round, the digest theta must have after
        it), or None when there is no such update (409 no_update; 404 from an aggregator
        without the route): download theta instead."""
        query = urllib.parse.urlencode({"from": base_round, "digest": base_digest})

        def attempt():
            if transport == "blob":
                info = self._request("GET", f"/theta_update_blob?{query}", timeout=3600, deadline=deadline)
                sha = self._get_blob(info["blob"], path, deadline)
                if sha != info["sha256"]:
                    raise IOError(f"update blob {info['blob']}: sha256 {sha} != {info['sha256']}")
                return info["round"], info["digest"]
            h = self._get_file(f"/theta_update?{query}", path, deadline)
            return int(h["X-Round"]), h["X-Theta-Digest"]
        try:
            return httpc.retry("download the update of theta_global", attempt, deadline)
        except httpc.CallError as e:
            if e.status == 404 or (e.status == 409 and e.reply.get("code") == "no_update"):
                return None
            raise

    def _get_blob(self, blob, path, deadline):
        """One attempt at a blob into `path` (resumed from what an earlier attempt wrote) -> its sha256."""
        down = blob_client.Download(self._blob_url(), blob, path, token=self.token, timeout=self.stall_s,
                                    ca_file=self.ca_file)
        down.attempt(deadline)
        return down.finish()

    def _get_file(self, route, path, deadline=None):
        """GET route into `path` (atomically, fsync'd) -> the reply's headers. One attempt."""
        conn = httpc.connect(self.url, httpc.io_timeout(self.stall_s, deadline), self.ca_file)
        try:
            conn.request("GET", httpc.split_url(self.url)[3] + route, headers=httpc.auth_headers(self.token))
            resp = conn.getresponse()
            if resp.status != 200:
                raise httpc.CallError(resp.status, _json_or_text(resp.read()))
            want, got = int(resp.getheader("Content-Length")), 0
            with durable.replacing(path) as tmp:
                with open(tmp, "wb") as f:
                    while chunk := resp.read(1 << 20):
                        f.write(chunk)
                        got += len(chunk)
                        httpc.made_progress(deadline)
                    f.flush()
                    os.fsync(f.fileno())
                if got != want:
                    raise ConnectionError(f"{route} download ended after {got} of {want} bytes")
            return resp.headers                 # case-insensitive
        finally:
            conn.close()

    # ---- deltas

    def send_delta(self, path, base_round, tokens, leases, metrics, transport="auto", deadline=None, follow=True):
        """Send one delta file (theta_i - theta_global). Raises StaleRound if the server has
        moved past base_round; CallError for any other refusal (the reply says why). Under
        `deadline` a failed attempt (the check, the upload, the naming of the blob) is
        repeated whole; the blob upload continues where the store's bytes end. The blob
        transport with `follow`: POST /delta_blob {"follow": true} beside the upload, so the
        aggregator checks the delta as it lands and answers right after its last byte; that
        request cut or failed (a proxy, a restart), today's POST after the upload instead."""
        meta = self._ident(base_round=base_round, tokens=tokens, leases=list(leases), metrics=dict(metrics or {}))
        if transport == "auto":
            big = os.path.getsize(path) >= AUTO_BLOB_BYTES
            transport = "blob" if (self.blob_url and big) else "inline"
        if transport not in ("inline", "blob"):
            raise ValueError(f"transport {transport!r}: use 'inline', 'blob' or 'auto'")
        upload = None
        if transport == "blob":
            # one blob name per send, kept across its attempts (so an upload resumes): a second delta
            # of the same round (after a refusal) must never meet the first one's blob
            blob = f"delta.{self.cluster}.{self.incarnation}-r{base_round}-{secrets.token_hex(4)}"
            upload = blob_client.Upload(self._blob_url(), blob, path, token=self.token, timeout=self.stall_s,
                                        ca_file=self.ca_file)

        follows = []        # the one followed POST of this send, beside its first upload attempt

        def once():
            self._stale_guard(lambda: self._request("POST", "/delta_check", meta, deadline=deadline))
            if upload is None:
                return self._stale_guard(lambda: self._send_inline(path, meta, deadline))
            if follow and not follows:
                follows.append(_FollowPost(self, {**meta, "blob": upload.blob_id, "sha256": upload.sha,
                                                  "follow": True, "size": upload.size}))
            info = upload.attempt(deadline)
            if follows and follows[-1] is not None:
                posted, follows[-1] = follows[-1], None       # answered once; a later attempt names the blob
                reply = self._stale_guard(posted.result)
                if reply is not None:
                    return reply
            return self._stale_guard(lambda: self._request(
                "POST", "/delta_blob", {**meta, "blob": upload.blob_id, "sha256": info["sha256"]}, timeout=3600,
                deadline=deadline))
        try:
            return httpc.retry("send delta", lambda: self._as_member("send delta", once, deadline), deadline)
        finally:
            if upload is not None:
                upload.close()

    def _stale_guard(self, fn):
        try:
            return fn()
        except httpc.CallError as e:
            if e.status == 409 and e.reply.get("code") == "stale_round":
                raise StaleRound(e.reply["round"], e.reply.get("error", "")) from None
            raise

    def _send_inline(self, path, meta, deadline=None):
        prefix = httpc.split_url(self.url)[3]
        conn = httpc.connect(self.url, httpc.io_timeout(self.stall_s, deadline), self.ca_file, blocksize=1 << 20)
        try:
            headers = {"Content-Length": str(os.path.getsize(path)), "X-Delta-Meta": json.dumps(meta),
                       "Content-Type": "application/octet-stream", **httpc.auth_headers(self.token)}
            with open(path, "rb") as f:
                conn.request("PUT", prefix + "/delta", body=f, headers=headers)
            resp = conn.getresponse()
            reply = _json_or_text(resp.read())
            if resp.status >= 400:
                raise httpc.CallError(resp.status, reply)
            return reply
        finally:
            conn.close()

    def _blob_url(self):
        if not self.blob_url:
            raise ValueError("the blob transport needs FedMomClient(blob_url=...)")
        return self.blob_url


class UpdateGone(Exception):
    """The followed update will not be the round's (no_update, or a merge that started
    over): the caller takes the round's theta the usual way once it is durable."""


class FollowedUpdate:
    """The next round's update (GET /theta_update_next), downloaded into `path` while the
    aggregator merges it: run() on a thread fills the file (its full size allocated at the
    first reply) in order; wait_for(offset) blocks the reader (wire.apply_update's `ready`)
    until the first `offset` bytes are in, or raises why they never will be. A cut reply
    resumes at its last byte (Range, the same merge's id) under `deadline`; an answer from
    another merge of that round raises UpdateGone. Nothing here says the round is durable:
    the caller compares the digest of the theta it builds with the heartbeat's (fedsite.py)."""

    def __init__(self, client, path, base_round, base_digest, chunk=1 << 20):
        self.c, self.path, self.base = client, path, base_round
        self.query = {"from": base_round, "digest": base_digest}
        self.cond, self.chunk = threading.Condition(), chunk
        self.have, self.total, self.error = 0, None, None
        self.round = self.id = None
        self.durable = False
        self.stop, self.conn = threading.Event(), None

    def cancel(self):
        """Stop now: set stop and cut the request in flight (a 202's long poll, a body)."""
        self.stop.set()
        conn = self.conn
        if conn is not None and conn.sock is not None:
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def wait_for(self, offset):
        with self.cond:
            while self.have < offset and self.error is None:
                self.cond.wait()
            if self.have < offset:
                raise self.error

    def run(self, deadline=None):
        """Until the whole file is in (-> True) or it never will be (the error also reaches wait_for)."""
        try:
            httpc.retry("follow the update of theta_global", lambda: self._attempt(deadline), deadline)
            return True
        except BaseException as e:
            with self.cond:
                self.error = e if isinstance(e, Exception) else UpdateGone(f"stopped: {type(e).__name__}")
                self.cond.notify_all()
            if not isinstance(e, Exception):
                raise
            return False

    def _attempt(self, deadline):
        while self.total is None or self.have < self.total:
            try:
                if self.stop.is_set():
                    raise UpdateGone("no longer wanted")
                self._get(deadline)
            except (OSError, http.client.HTTPException):
                if self.stop.is_set():                # cut by cancel(): not a fault to retry
                    raise UpdateGone("no longer wanted") from None
                raise

    def _get(self, deadline):
        wait = min(self.c.heartbeat_s, 30.0)
        q = urllib.parse.urlencode({**self.query, "wait_s": wait, "id": self.id or ""})
        headers = httpc.auth_headers(self.c.token)
        if self.have:
            headers["Range"] = f"bytes={self.have}-"
        conn = self.conn = httpc.connect(self.c.url, httpc.io_timeout(self.c.stall_s + wait, deadline), self.c.ca_file)
        try:
            if self.stop.is_set():                    # cancel() before this connection existed
                raise UpdateGone("no longer wanted")
            conn.request("GET", httpc.split_url(self.c.url)[3] + "/theta_update_next?" + q, headers=headers)
            resp = conn.getresponse()
            if resp.status == 202:
                resp.read()
                httpc.made_progress(deadline)          # an answer: the merge has not started yet
                return
            if resp.status in (404, 409):
                raise UpdateGone(f"{resp.status}: {_json_or_text(resp.read())}")
            if resp.status not in (200, 206):
                raise httpc.CallError(resp.status, _json_or_text(resp.read()))
            if resp.status == 200 and self.have:
                raise UpdateGone("the round's merge started over: its update is another file")
            if self.total is None or (resp.status == 200 and not self.have):   # a first reply cut before its body
                self.total, self.id, self.round = (int(resp.getheader("X-Update-Total")),
                                                   resp.getheader("X-Update-Id"), int(resp.getheader("X-Round")))
                with open(self.path, "wb") as f:
                    f.truncate(self.total)
            self.durable = resp.getheader("X-Durable") == "1"
            self._read_body(resp, deadline)
        finally:
            conn.close()

    def _read_body(self, resp, deadline):
        with open(self.path, "r+b", buffering=0) as f:
            while self.have < self.total:
                if self.stop.is_set():
                    raise UpdateGone("no longer wanted")
                piece = resp.read1(self.chunk)        # what has come, not a full chunk: the merge may pause
                n = len(piece)
                if not n:
                    raise ConnectionError(f"the update's reply ended at byte {self.have} of {self.total}")
                os.pwrite(f.fileno(), piece, self.have)
                with self.cond:
                    self.have += n
                    self.cond.notify_all()
                httpc.made_progress(deadline)


def _json_or_text(raw):
    try:
        out = json.loads(raw) if raw else {}
        return out if isinstance(out, dict) else {"reply": out}
    except ValueError:
        return {"error": raw[:200].decode("utf-8", "replace")}


class _FollowPost:
    """POST /delta_blob with "follow": true on a thread, beside the upload. result() -> the
    reply, or None when the request failed without a refusal of the delta (cut, 5xx, an
    aggregator that fetched before the upload ended): the caller posts again, and the
    aggregator joins that request to its follow of the blob (fedmom_state.Follows)."""

    def __init__(self, client, body):
        self.client, self.body, self.reply, self.error = client, body, None, None
        self.thread = threading.Thread(target=self._run, name="fedmom-follow", daemon=True)
        self.thread.start()

    def _run(self):
        try:
            self.reply = self.client._request("POST", "/delta_blob", self.body, timeout=3600)
        except (httpc.CallError, OSError, http.client.HTTPException) as e:
            self.error = e

    def result(self):
        self.thread.join()
        e = self.error
        if isinstance(e, httpc.CallError) and (e.reply.get("code") in ("bad_delta", "stale_round", "not_member")):
            raise e
        if e is not None:
            log(f"fedmom client: the followed send of {self.body['blob']} failed ({type(e).__name__}: {e}); "
                "naming the blob after its upload instead")
        return self.reply


class _KeepAlive:
    def __init__(self, client, interval_s):
        self.client, self.interval_s, self.stop = client, interval_s, threading.Event()
        self.thread = threading.Thread(target=self._run, name="fedmom-heartbeat", daemon=True)

    def _run(self):
        while not self.stop.wait(self.interval_s):
            try:
                self.client.heartbeat()
            except (httpc.CallError, OSError, http.client.HTTPException) as e:
                log(f"fedmom client: heartbeat failed: {e}")

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()
        return False
