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
    c.join(wait_s=600)                  # waits out an older incarnation of "lumi" timing out
    rnd = c.download_theta("theta.safetensors")         # atomic; returns theta's round
    with c.keepalive():                 # background heartbeats while the inner steps run
        train(H)                        # ... then write delta = theta_local - theta_global
    try:
        c.send_delta("delta.safetensors", base_round=rnd, tokens=n, leases=[{"id": 7, "end": 120}],
                     metrics={"loss": 2.31, "tokens_per_s": 9.1e5})
        rnd = c.wait_round_after(rnd, timeout_s=3600)   # the merge of that round is durable
    except fedmom_client.StaleRound as e:
        rnd = e.current_round            # another round went by: reload theta, train again
    # the next theta: with the aggregator's --down-wire, the update from the theta we hold
    # (fedsite.py adds it with wire.apply_update), else (None) the whole file again
    got = c.download_update("update.safetensors", base_round, wire.theta_digest("theta.safetensors"))
    c.leave()                           # at the end of the allocation

Transports: "inline" streams the file as the PUT body; "blob" uploads it to the blob
store (resumable) and names it; "auto" (default) uses the blob store for files of
AUTO_BLOB_BYTES or more when blob_url is set. Retries: send_delta re-sends after a
network error (the server treats a repeat of an accepted delta as a duplicate, not a
second delta); every other call raises httpc.CallError (4xx/5xx, the server's reason
in .reply) or OSError, and the caller decides.

Whether a delta was merged: every join/heartbeat reply (so also the one that ends
wait_round_after) carries "deltas", this cluster's outcome objects: merged (with
merged_into, the round), excluded (with why) or pending, each with the DARL leases the
delta carried; GET /status "recent" has the same per round ("outcomes").
fedmom_server.py's docstring lists the fields. The aggregator takes an accepted delta's
leases into custody at DARL and commits them once merged; for an excluded delta the
site releases what is left of its leases in DARL, so the blocks are trained again.

Who may call: anyone holding the aggregator's bearer token (token=..., or none on a
loopback test server).
"""
import http.client
import json
import os
import secrets
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
    download or delta upload may make no progress before it is abandoned (an OSError,
    so the caller retries); the blob transport resumes where it stopped."""

    def __init__(self, url, cluster, incarnation, token=None, blob_url=None, timeout=60.0, retries=3,
                 ca_file=None, stall_s=120.0):
        self.url, self.cluster, self.incarnation = url, cluster, incarnation
        self.token, self.blob_url, self.timeout, self.retries = token, blob_url, timeout, retries
        self.ca_file, self.stall_s = ca_file, stall_s
        self.heartbeat_s = 30.0

    def _call(self, method, path, body=None, timeout=None):
        return httpc.call(self.url, method, path, body, token=self.token, timeout=timeout or self.timeout,
                          ca_file=self.ca_file)

    def _ident(self, **extra):
        return {"cluster": self.cluster, "incarnation": self.incarnation, **extra}

    def join(self, wait_s=0.0):
        """Join; with wait_s, keep trying while an older incarnation of this cluster times out."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                reply = self._call("POST", "/join", self._ident())
                self.heartbeat_s = reply.get("heartbeat_s", self.heartbeat_s)
                return reply
            except httpc.CallError as e:
                if e.reply.get("code") != "incarnation_conflict" or time.monotonic() >= deadline:
                    raise
                time.sleep(min(max(1.0, e.reply.get("retry_after_s", 1.0)), max(0.0, deadline - time.monotonic())))

    def heartbeat(self, metrics=None, wait_round_after=None, wait_s=0.0):
        body = self._ident(metrics=metrics or {})
        if wait_round_after is not None:
            body.update(wait_round_after=wait_round_after, wait_s=wait_s)
        try:
            return self._call("POST", "/heartbeat", body, timeout=self.timeout + wait_s)
        except httpc.CallError as e:
            if e.reply.get("code") != "not_member":
                raise
            self.join()                   # dropped (e.g. a network outage): come back
            return self._call("POST", "/heartbeat", body, timeout=self.timeout + wait_s)

    def leave(self):
        return self._call("POST", "/leave", self._ident())

    def current_round(self):
        return self._call("GET", "/round")["round"]

    def wait_round_after(self, base_round, timeout_s):
        """Block until the server's round passes base_round (that merge is durable); heartbeats meanwhile."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            reply = self.heartbeat(wait_round_after=base_round, wait_s=max(0.0, min(left, self.heartbeat_s)))
            if reply["round"] > base_round:
                return reply["round"]
            if time.monotonic() >= deadline:
                raise TimeoutError(f"round still {reply['round']} after {timeout_s:.0f} s (waiting for > {base_round})")

    def keepalive(self, interval_s=None):
        """A background heartbeat thread for the inner phase: `with client.keepalive(): train()`."""
        return _KeepAlive(self, interval_s or self.heartbeat_s)

    # ---- theta

    def download_theta(self, path, transport="inline"):
        """Write the current theta_global to `path` (atomically); returns its round."""
        if transport == "blob":
            info = self._call("GET", "/theta_blob", timeout=3600)
            sha = blob_client.get_file(self._blob_url(), info["blob"], path, token=self.token,
                                     timeout=self.stall_s, ca_file=self.ca_file)
            if sha != info["sha256"]:
                raise IOError(f"theta blob {info['blob']}: sha256 {sha} != {info['sha256']}")
            return info["round"]
        if transport != "inline":
            raise ValueError(f"transport {transport!r}: use 'inline' or 'blob'")
        return int(self._get_file("/theta", path)["X-Round"])

    def download_update(self, path, base_round, base_digest, transport="inline"):
        """With the aggregator's --down-wire: write the update that takes our theta of
        `base_round` (wire.Digest `base_digest`) to the current round to `path` (inline, or
        through the blob store: resumable); returns (round, the digest theta must have after
        it), or None when there is no such update (409 no_update; 404 from an aggregator
        without the route): download theta instead."""
        query = urllib.parse.urlencode({"from": base_round, "digest": base_digest})
        try:
            if transport == "blob":
                info = self._call("GET", f"/theta_update_blob?{query}", timeout=3600)
                sha = blob_client.get_file(self._blob_url(), info["blob"], path, token=self.token,
                                         timeout=self.stall_s, ca_file=self.ca_file)
                if sha != info["sha256"]:
                    raise IOError(f"update blob {info['blob']}: sha256 {sha} != {info['sha256']}")
                return info["round"], info["digest"]
            h = self._get_file(f"/theta_update?{query}", path)
        except httpc.CallError as e:
            if e.status == 404 or (e.status == 409 and e.reply.get("code") == "no_update"):
                return None
            raise
        return int(h["X-Round"]), h["X-Theta-Digest"]

    def _get_file(self, route, path):
        """GET route into `path` (atomically, fsync'd) -> the reply's headers."""
        conn = httpc.connect(self.url, self.stall_s, self.ca_file)
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
                    f.flush()
                    os.fsync(f.fileno())
                if got != want:
                    raise ConnectionError(f"{route} download ended after {got} of {want} bytes")
            return resp.headers                 # case-insensitive
        finally:
            conn.close()

    # ---- deltas

    def send_delta(self, path, base_round, tokens, leases, metrics, transport="auto"):
        """Send one delta file (theta_i - theta_global). Raises StaleRound if the server has
        moved past base_round; CallError for any other refusal (the reply says why)."""
        meta = self._ident(base_round=base_round, tokens=tokens, leases=list(leases), metrics=dict(metrics or {}))
        if transport == "auto":
            big = os.path.getsize(path) >= AUTO_BLOB_BYTES
            transport = "blob" if (self.blob_url and big) else "inline"
        if transport not in ("inline", "blob"):
            raise ValueError(f"transport {transport!r}: use 'inline', 'blob' or 'auto'")
        # one blob name per send, kept across its retries (so an upload resumes): a second delta
        # of the same round (after a refusal) must never meet the first one's blob
        blob = f"delta-{self.cluster}-{self.incarnation}-r{base_round}-{secrets.token_hex(4)}"
        for attempt in range(self.retries + 1):
            self._stale_guard(lambda: self._call("POST", "/delta_check", meta))
            try:
                if transport == "blob":
                    return self._stale_guard(lambda: self._send_blob(path, meta, blob))
                return self._stale_guard(lambda: self._send_inline(path, meta))
            except (OSError, http.client.HTTPException) as e:
                if attempt == self.retries:
                    raise
                log(f"fedmom client: delta upload failed ({e}); retrying")
                time.sleep(min(30.0, 2.0 ** attempt))

    def _stale_guard(self, fn):
        try:
            return fn()
        except httpc.CallError as e:
            if e.status == 409 and e.reply.get("code") == "stale_round":
                raise StaleRound(e.reply["round"], e.reply.get("error", "")) from None
            raise

    def _send_inline(self, path, meta):
        prefix = httpc.split_url(self.url)[3]
        conn = httpc.connect(self.url, self.stall_s, self.ca_file, blocksize=1 << 20)
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

    def _send_blob(self, path, meta, blob):
        info = blob_client.put_file(self._blob_url(), blob, path, token=self.token, timeout=self.stall_s,
                                  ca_file=self.ca_file)
        return self._call("POST", "/delta_blob", {**meta, "blob": blob, "sha256": info["sha256"]}, timeout=3600)

    def _blob_url(self):
        if not self.blob_url:
            raise ValueError("the blob transport needs FedMomClient(blob_url=...)")
        return self.blob_url


def _json_or_text(raw):
    try:
        out = json.loads(raw) if raw else {}
        return out if isinstance(out, dict) else {"reply": out}
    except ValueError:
        return {"error": raw[:200].decode("utf-8", "replace")}


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
