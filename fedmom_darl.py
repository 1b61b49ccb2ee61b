"""fedmom_darl.py - the aggregator's side of DARL custody: the calls (DarlLink) and sending
what the books owe until DARL answers (Custodian).

Runs on: the central VM, imported by fedmom_state.py (FedMomState holds one Custodian when
started with --darl) and fedmom_server.py (which builds the DarlLink); Python standard
library + httpc.py's client call + fedmom_round.py + fedmom_store.py; never torch.

The protocol (the aggregator coordinates a two-phase commit, DARL participates) is
fedmom_round.py's docstring and FEDERATION_GUIDE.md section 3; DARL's endpoints are
darl_server.py's docstring. Each DarlLink call returns a fedmom_round.Answer and never
retries; the Custodian asks, the books (fedmom_round) decide what the answer means, and
whatever is still owed is asked again by the next tick (fedmom_server.darl_loop: every
--darl-retry-s at most while DARL does not answer). Every decision the answer brings is
made durable (fedmom_store.Ledger.change) before the next call goes out. Test hooks
(testhooks.fault_point): fedmom.custody_held (DARL holds a delta, the spool does not say so
yet), fedmom.epoch_durable (the issued epoch durable, not confirmed), fedmom.committed
(DARL committed, the books still owe it).
"""
import http.client
import secrets
import threading
import urllib.parse

import fedmom_store
import httpc
import testhooks
from fedmom_round import DEFINITIVE, OK, REFUSED, UNKNOWN, Answer, Custody, Refused


class DarlLink:
    """The custody calls the aggregator makes (darl_server.py's protocol), each answered
    with an Answer; nothing here retries: the aggregator re-sends what it still owes."""

    def __init__(self, url, token=None, timeout=30.0, ca_file=None):
        self.url, self.token, self.timeout, self.ca_file = url, token, timeout, ca_file

    def _ask(self, method, path, body, key, want):
        try:
            reply = httpc.call(self.url, method, path, body, token=self.token, timeout=self.timeout,
                               ca_file=self.ca_file)
        except httpc.CallError as e:
            if e.status == 409 and e.reply.get("code") in DEFINITIVE:
                return Answer(REFUSED, e.reply, str(e))
            return Answer(UNKNOWN, e.reply, f"HTTP {e.status}: {e.reply.get('error', e.reply)}")
        except (OSError, http.client.HTTPException, ValueError, httpc.TLSConfigError) as e:
            return Answer(UNKNOWN, {}, f"{type(e).__name__}: {e}")
        if not isinstance(reply, dict) or reply.get(key) != want:
            return Answer(UNKNOWN, {}, f"{path}: the reply is not DARL's ({str(reply)[:120]})")
        return Answer(OK, reply)

    def fence(self, aggregator, last_epoch, claim, last_holder=None, round=None):
        body = {"aggregator": aggregator, "last_epoch": last_epoch, "claim": claim}
        body.update({k: v for k, v in (("last_holder", last_holder), ("round", round)) if v is not None})
        return self._ask("POST", "/fence", body, "aggregator", aggregator)

    def confirm_fence(self, aggregator, epoch, claim, holder):
        return self._ask("POST", "/fence/confirm", {"aggregator": aggregator, "epoch": epoch, "claim": claim,
                                                    "holder": holder}, "aggregator", aggregator)

    def custody(self, aggregator, epoch, delta, cluster, incarnation, leases):
        body = {"aggregator": aggregator, "epoch": epoch, "delta": delta, "cluster": cluster,
                "incarnation": incarnation,
                "leases": [{k: v for k, v in (("lease", l["id"]), ("start", l.get("start")), ("end", l.get("end")))
                            if v is not None} for l in leases]}
        return self._ask("POST", "/custody", body, "state", "held")

    def commit(self, aggregator, epoch, delta, round=None):
        body = {"aggregator": aggregator, "epoch": epoch, "delta": delta}
        if round is not None:
            body["round"] = round
        return self._ask("POST", "/custody/commit", body, "state", "committed")

    def abort(self, aggregator, epoch, delta, why):
        return self._ask("POST", "/custody/abort", {"aggregator": aggregator, "epoch": epoch, "delta": delta,
                                                    "why": why[:200]}, "state", "aborted")

    def held(self, aggregator):
        """The custody DARL holds for `aggregator`: an Answer whose reply has "custody"."""
        query = urllib.parse.urlencode({"aggregator": aggregator, "state": "held"})
        try:
            reply = httpc.call(self.url, "GET", f"/custody?{query}", token=self.token, timeout=self.timeout,
                               ca_file=self.ca_file)
        except httpc.CallError as e:
            return Answer(UNKNOWN, e.reply, f"HTTP {e.status}: {e.reply.get('error', e.reply)}")
        except (OSError, http.client.HTTPException, ValueError, httpc.TLSConfigError) as e:
            return Answer(UNKNOWN, {}, f"{type(e).__name__}: {e}")
        if not isinstance(reply, dict) or not isinstance(reply.get("custody"), list):
            return Answer(UNKNOWN, {}, "GET /custody: the reply is not DARL's")
        return Answer(OK, reply)


class Custodian:
    """Asks DARL what the books (ledger.table: fedmom_round.RoundTable and its CustodyBooks)
    need asked, settles the books by each answer, and removes the spool files of a delta DARL
    refused. `wall` is the wall clock of the records."""

    def __init__(self, link, ledger, spool, wall):
        self.link, self.ledger, self.spool, self.wall = link, ledger, spool, wall
        self.table, self.books = ledger.table, ledger.table.books
        self.process_id = secrets.token_hex(8)   # binds DARL's epoch to this process (/fence/confirm)
        self.fence_lock = threading.Lock()       # one fence at a time: the upload threads and the DARL loop

    def tick(self):
        """One pass over what DARL still owes an answer to, oldest first: this epoch's fence,
        then (once) the reconciliation of DARL's custody with our books, the custody of
        unconfirmed deltas, the aborts and the commits owed. True when everything owed was
        answered definitively; False when DARL must be asked again later."""
        if self.books.fenced:
            return False
        if not self.books.epoch_held and not self.fence():
            return False
        if not self.table.reconciled and not self.reconcile():
            return False
        with self.ledger.lock:
            unconfirmed = self.table.unconfirmed()
        for p in unconfirmed:
            self.take(p)
            if p.custody == Custody.UNCONFIRMED and self.table.pending.get((p.cluster, p.incarnation)) is p:
                return False
        return self.send_owed("abort") and self.send_owed("commit")

    def take(self, p, at_upload=False):
        """Ask DARL to hold p's leases for this aggregator; settle p by the answer. At upload a
        refusal is the upload's 409 (nothing stays stored); later it excludes p, named."""
        if not (self.books.epoch_held or self.fence()):
            return
        ans = self.link.custody(self.books.aggregator, self.books.epoch, p.delta_id, p.cluster, p.incarnation,
                                p.leases)
        if ans.kind == OK:
            testhooks.fault_point("fedmom.custody_held")   # DARL holds it, our spool does not say so yet
            with self.ledger.lock:
                if self.table.custody_held(p, ans.reply.get("pieces", [])):
                    self.spool.record(p)
                self.books.heard()
                self.ledger.wake()
            return
        if ans.kind == UNKNOWN:
            self._definitive(ans, f"custody of {p.cluster}'s delta {p.delta_id}")
            return
        why = ans.reply.get("error") or ans.error
        if ans.code == "fenced":
            self._stop(why)
            if not at_upload:
                return              # the newer process of this aggregator finds the spooled delta
        with self.ledger.lock:
            self.books.heard()
            if not self.table.custody_refused(p, why, at_upload, self.wall()):
                return
            gone = fedmom_store.bury([p.path, p.meta_path])
            self.ledger.wake()
        fedmom_store.remove(gone)
        if at_upload and ans.code == "fenced":      # this process is stopping: the upload never happened
            raise Refused(503, f"this aggregator process was fenced by DARL ({why}); send again")
        if at_upload:
            raise Refused(409, why, code="lease_lost", leases=ans.reply.get("leases", [l["id"] for l in p.leases]))

    def fence(self):
        """Ask DARL for this process's epoch (DARL issues it; see darl_custody.CustodyTable.fence)."""
        with self.fence_lock:
            return self.books.epoch_held or self._ask_epoch()

    def _ask_epoch(self):
        if self.books.fenced:
            return False
        with self.ledger.change():        # a new claim is durable before it is sent
            last_epoch, claim, last_holder = self.books.fence_request(secrets.token_hex(8))
            durable_round = self.table.round
        ans = self.link.fence(self.books.aggregator, last_epoch, claim, last_holder, durable_round)
        if ans.kind == REFUSED:
            return self._stop(ans.reply.get("error", ans.error))
        if ans.kind != OK:
            with self.ledger.lock:
                self.books.silent("fence", ans.error, self.wall())
            return False
        with self.ledger.change():        # the issued epoch and its holder are durable before the confirm
            issued = self.books.fence_issued(ans.reply["epoch"], ans.reply.get("digest"), self.process_id,
                                             self.link.url)
        if not issued:
            return self._stop(None)
        testhooks.fault_point("fedmom.epoch_durable")   # epoch and holder durable, the confirm not sent
        # then bind it to this process: a copy of our state taken while the ask was in
        # flight holds the same claim and may have been given the same epoch. This state
        # names this process as the holder from now on, so if the copy confirms first,
        # DARL fences this state at every later ask (darl_custody.CustodyTable.fence)
        ans = self.link.confirm_fence(self.books.aggregator, self.books.epoch, claim, self.process_id)
        if ans.kind == REFUSED:
            return self._stop(ans.reply.get("error", ans.error))
        if ans.kind != OK:          # asked again later: a new claim; the next epoch unless another
            #                         process confirmed this one
            with self.ledger.lock:
                self.books.silent("confirm the fence", ans.error, self.wall())
            return False
        with self.ledger.lock:
            self.books.fence_confirmed(ans.reply.get("held", 0))
        return True

    def reconcile(self):
        """Once after a start: DARL's list of what it holds for us against our books
        (fedmom_round.RoundTable.reconcile); the deltas it no longer holds leave the spool."""
        ans = self.link.held(self.books.aggregator)
        if ans.kind != OK:
            with self.ledger.lock:
                self.books.silent("list our custody", ans.error, self.wall())
            return False
        with self.ledger.change():
            gone = self.table.reconcile(ans.reply["custody"], self.wall())
            tombs = fedmom_store.bury([f for p in gone for f in (p.path, p.meta_path)])
        fedmom_store.remove(tombs)
        return True

    def send_owed(self, kind):
        """Send the owed commits or aborts (kind "commit" | "abort") oldest first, until one gets
        no definitive answer; each answer is durable before the next call."""
        with self.ledger.lock:
            todo = list(self.books.commits if kind == "commit" else self.books.aborts)
        for c in todo:
            if kind == "commit":
                ans = self.link.commit(self.books.aggregator, self.books.epoch, c["delta"], c.get("round"))
                what = f"commit of {c['cluster']}'s delta {c['delta']} (round {c['round']})"
            else:
                ans = self.link.abort(self.books.aggregator, self.books.epoch, c["delta"], c["why"])
                what = f"abort of {c['cluster']}'s delta {c['delta']}"
            if not self._definitive(ans, what):
                return False
            if kind == "commit":
                testhooks.fault_point("fedmom.committed")      # DARL committed it, our state still owes it
            with self.ledger.change():
                self.books.settle(kind, c, ans)
        return True

    def _definitive(self, ans, what):
        """Does DARL's answer settle the call? Else it stays owed (the alarm goes up), or this
        process was fenced and stops."""
        if ans.kind == UNKNOWN:
            with self.ledger.lock:
                self.books.not_fenced(ans)
                self.books.silent(what, ans.error, self.wall())
            return False
        if ans.code == "fenced":
            self._stop(ans.reply.get("error", ans.error))
            return False
        return True

    def _stop(self, why):
        """DARL fenced this process (`why`; None: the books stopped it already) -> False."""
        with self.ledger.lock:
            if why is not None:
                self.books.stop(why)
            self.ledger.wake()
        return False
