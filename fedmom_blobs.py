"""fedmom_blobs.py - the aggregator's side of the blob store: a delta sent as a blob fetched
into the spool, theta and its updates published once per round, and the retention rule
that deletes what no site can use.

Runs on: the central VM, imported by fedmom_server.py (which builds a BlobLink and a
BlobRetention with --blob-url) and fedmom_state.py (which hands them the files); Python
standard library + httpc.py's client call + blob_client.py (put_file, get_file) +
fedmom_round.py (Refused) + fedmom_store.py (log); never torch. blobstore.py's docstring
has the store's protocol; RUNBOOK.md section 1 the disk the retention bounds.

Names: the aggregator publishes round r's theta and update as <aggregator id>.theta-<r>
and <aggregator id>.update-<r> (blob_name): its own id first, so runs sharing a store never
collide, nor delete each other's blobs. A site's delta blob is the site's name; once
fetched (or refused for good) the aggregator deletes it.
"""
import collections
import http.client
import os
import re
import threading
import time

import blob_client
import durable
import httpc
import testhooks
from fedmom_round import Refused
from fedmom_store import log

BLOB_KINDS = ("theta", "update")
BLOB_ID_RE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,199}")
BLOB_FETCH_S = 4.0            # POST /delta_blob's download from the store: s without progress, then 502 (the
                              # site holds the request open and repeats a 502 under its own deadline)
BLOB_PUBLISH_S = 90.0         # a theta/update blob put into the store: s without progress (a site's GET waits)
SWEEP_RETRY_S = 30.0          # a sweep of the blob store that failed (store down) is tried again this often
BLOB_CALL_TIMEOUT_S = 30.0    # one listing or DELETE of a sweep; on its own thread, so it delays no merge


def blob_name(aggregator, kind, rnd):
    """The blob store id under which this aggregator publishes round `rnd`'s theta or update."""
    return f"{aggregator}.{kind}-{rnd}"


def blob_plan(ids, aggregator, round_, keep_rounds):
    """The retention rule for the blobs `aggregator` published, at durable round `round_`:
    round s's theta and update are kept while s > round_ - keep_rounds (--keep-rounds), so a
    download that began up to keep_rounds - 1 merges ago can finish or resume; older ones no
    site can use (the server serves only the current round's update, and a site further
    behind takes the full theta: 409 no_update) and go. A round after round_ is kept: one
    published since round_ was read (or, after a state dir was restored from an older copy,
    one this run will replace under its name: BlobLink.publish). Other ids (other
    aggregators', the sites' deltas) are not this aggregator's to judge and are left out.
    -> [{"blob", "kind", "round", "keep", "why"}], oldest round first."""
    pat = re.compile(rf"{re.escape(aggregator)}\.({'|'.join(BLOB_KINDS)})-(\d+)")
    out = []
    for i in ids:
        m = pat.fullmatch(i)
        if not m:
            continue
        kind, s = m.group(1), int(m.group(2))
        if s > round_:
            keep, why = True, f"newer than round {round_}, which this sweep read"
        elif s == round_:
            keep, why = True, f"the current round's {kind}"
        elif s > round_ - keep_rounds:
            keep, why = True, (f"{kind} of one of the last {keep_rounds} rounds (--keep-rounds): a download "
                               f"begun before round {s + 1} merged can finish")
        else:
            keep, why = False, (f"older than the last {keep_rounds} rounds (--keep-rounds): no site can use it, "
                                "one that far behind takes the full theta")
        out.append({"blob": i, "kind": kind, "round": s, "keep": keep, "why": why})
    return sorted(out, key=lambda b: (b["round"], b["kind"]))


def unlink_with_parts(path):
    """`path` and the temp files a download made beside it (path.part-...)."""
    d, base = os.path.split(path)
    for fn in os.listdir(d):
        if fn == base or fn.startswith(base + "."):
            durable.unlink(os.path.join(d, fn))


class BlobLink:
    """The aggregator's calls to the blob store at `url` (--blob-url): fetch a delta blob,
    delete it, publish a file of a round once per name. `retention` (a BlobRetention, or
    None) is told of every blob published."""

    def __init__(self, url, token=None, ca_file=None, retention=None):
        self.url, self.token, self.ca_file, self.retention = url, token, ca_file, retention
        self.published = {}               # blob -> {"blob", "sha256", "round"}, this round and newer
        self.publish_lock = threading.Lock()

    @staticmethod
    def check_id(blob):
        if not BLOB_ID_RE.fullmatch(blob):
            raise Refused(400, f"blob id {blob!r} must match [A-Za-z0-9_-][A-Za-z0-9._-]{{0,199}}")

    def fetch(self, blob, part):
        """Download `blob` into the part file `part` -> its sha256; on any failure nothing is
        left and the refusal says why (502: the store unreachable, send again; 503 disk_full:
        the store's disk; 400: no such blob). A short deadline (BLOB_FETCH_S without progress):
        the site holds this request open and repeats a 502 under its own."""
        try:
            return blob_client.get_file(self.url, blob, part, token=self.token, ca_file=self.ca_file,
                                        deadline=httpc.Deadline(BLOB_FETCH_S, what=f"fetch blob {blob}",
                                                                log=_said))
        except BaseException as e:
            unlink_with_parts(part)
            refusal = self._refusal(blob, e.last if isinstance(e, httpc.GaveUp) else e)
            if refusal is None:
                raise
            raise refusal from None

    def _refusal(self, blob, e):
        """The answer to a delta blob the store would not give (what it said last), or None:
        raise `e` as it is (our own spool's full disk is a 507 naming our disk; anything else
        unexpected is a 500)."""
        if isinstance(e, httpc.CallError) and e.status == 507:
            return Refused(503, f"blob store: {e.reply.get('error')}", headers={"Retry-After": "30"},
                           code="disk_full", retry_after_s=30)
        if isinstance(e, (httpc.CallError, ValueError)):
            return Refused(400 if isinstance(e, ValueError) or e.status == 404 else 502, f"blob {blob!r}: {e}")
        if isinstance(e, (OSError, http.client.HTTPException)) and not durable.is_disk_full(e):
            return Refused(502, f"blob store {self.url} unreachable fetching {blob!r} ({type(e).__name__}: {e}); "
                                "nothing was stored, send it again")
        return None

    def delete(self, blob):
        """Delete a fetched delta's blob; best effort (the site's next delta has another name)."""
        try:
            httpc.call(self.url, "DELETE", f"/blobs/{blob}", token=self.token, ca_file=self.ca_file)
        except (httpc.CallError, OSError, http.client.HTTPException):
            pass

    def publish(self, blob, opened, rnd):
        """Put `opened` (a file of round `rnd`, opened by the state) into the store as `blob`,
        once per name -> {blob, sha256, round}; the file is closed."""
        with self.publish_lock, opened as f:
            if blob in self.published:
                return self.published[blob]
            # put_file reads by path; /proc/self/fd keeps it on the file that was opened
            path = f"/proc/self/fd/{f.fileno()}"
            try:
                info = blob_client.put_file(self.url, blob, path, token=self.token, ca_file=self.ca_file,
                                            deadline=_publish_deadline(blob))
            except httpc.CallError as e:
                if e.status != 409 or e.reply.get("retry"):
                    raise
                # a blob of this name with other bytes: left by a run of this state dir that was
                # rolled back (restored from an older copy); this round's file replaces it
                log(f"fedmom: blob {blob} holds other bytes than round {rnd}'s file (a restored state dir?); "
                    "replacing it")
                httpc.call(self.url, "DELETE", f"/blobs/{blob}", token=self.token, ca_file=self.ca_file)
                info = blob_client.put_file(self.url, blob, path, token=self.token, ca_file=self.ca_file,
                                            deadline=_publish_deadline(blob))
            out = {"blob": blob, "sha256": info["sha256"], "round": rnd}
            if self.retention is not None:
                self.retention.published(blob, rnd, info["size"])
            self.published = {b: v for b, v in self.published.items() if v["round"] >= rnd}
            self.published[blob] = out
            return out


def _said(what, err, left):
    log(f"fedmom: {what}: {type(err).__name__}: {err}; retrying ({left:.1f} s left)")


def _publish_deadline(blob):
    return httpc.Deadline(BLOB_PUBLISH_S, what=f"publish blob {blob}", log=_said)


class BlobRetention:
    """The blob store side of the retention rule (blob_plan): after each durable round, and
    once at start, list the store (GET /blobs) and DELETE this aggregator's theta and update
    blobs no site can use. Working from the listing makes it idempotent and leak-free across
    crashes: nothing needs recording before a delete, a blob already gone is a 404 that counts
    as done, and a start sweeps what the last process left. Only the round number is read from
    the state; every call here is made outside the state lock. Test hook (testhooks.fault_point):
    fedmom.blob_delete, each DELETE of a sweep."""

    def __init__(self, url, aggregator, keep_rounds, token=None, ca_file=None):
        self.url, self.aggregator, self.keep = url, aggregator, keep_rounds
        self.token, self.ca_file = token, ca_file
        self.swept_round, self.retry_at = None, 0.0
        self.deleted, self.recent, self.error, self.kept = 0, collections.deque(maxlen=20), None, []
        self.lock = threading.Lock()         # kept: written by the sweep and by publish's thread

    def _call(self, method, path):
        return httpc.call(self.url, method, path, token=self.token, ca_file=self.ca_file,
                          timeout=BLOB_CALL_TIMEOUT_S)

    def due(self, round_, now):
        return round_ != self.swept_round and now >= self.retry_at

    def sweep(self, round_, now=None):
        """One pass at durable round `round_`; True when every blob the rule drops is gone."""
        now = time.monotonic() if now is None else now
        try:
            listing = self._call("GET", "/blobs")
            sizes = {b["id"]: b["size"] for b in listing["blobs"]}
            sizes.update({u["id"]: u["total"] for u in listing["uploads"] if u["id"] not in sizes})
            plan = blob_plan(sizes, self.aggregator, round_, self.keep)
            for b in plan:
                b["bytes"] = sizes[b["blob"]]
                if not b["keep"]:
                    self._delete(b)
        except (httpc.CallError, OSError, http.client.HTTPException, ValueError, KeyError, TypeError) as e:
            self.error, self.retry_at = f"{type(e).__name__}: {e}", now + SWEEP_RETRY_S
            log(f"fedmom: retention sweep of the blob store at round {round_} failed ({self.error}); "
                f"tried again in {SWEEP_RETRY_S:g} s")
            return False
        with self.lock:
            self.kept = [b for b in plan if b["keep"]]
        self.swept_round, self.error = round_, None
        return True

    def _delete(self, b):
        testhooks.fault_point("fedmom.blob_delete")        # test hook: a deletion held mid-sweep
        try:
            self._call("DELETE", f"/blobs/{b['blob']}")
        except httpc.CallError as e:
            if e.status == 409:                        # still being uploaded: judged again next round
                return
            if e.status != 404:                        # 404: already gone (a crash after the delete)
                raise
        self.deleted += 1
        self.recent.append({"blob": b["blob"], "bytes": b["bytes"], "why": b["why"]})
        log(f"fedmom: deleted blob {b['blob']} ({b['bytes'] / 2**20:.1f} MiB): {b['why']}")

    def published(self, blob, rnd, size):
        """publish put `blob` of round `rnd` into the store: shown as kept until the next sweep judges it."""
        with self.lock:
            if all(b["blob"] != blob for b in self.kept):
                plan = blob_plan([blob], self.aggregator, rnd, self.keep)
                self.kept = self.kept + [{**b, "bytes": size} for b in plan]

    def view(self):
        """/status "retention" "blobs": what the store keeps of ours and why, what went."""
        with self.lock:
            kept = [dict(b) for b in self.kept]
        return {"keep_rounds": self.keep, "swept_round": self.swept_round, "error": self.error, "kept": kept,
                "deleted": self.deleted, "recent_deleted": list(self.recent)}
