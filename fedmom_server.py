"""fedmom_server.py - the central FedMom aggregator: one global model, merged from the sites' deltas.

Runs on: the central VM (CPU only; standard library + numpy, never torch). Port 29511, bound
to 127.0.0.1 unless --host says otherwise (beyond loopback: a token and TLS, or --insecure).
Callers: the sites' rank 0 (fedmom_client.FedMomClient) and operators (`status`, GET / in a
browser); every endpoint but GET /health and GET / (unless --private-page) needs the token.

    # first start: the initial model (any float dtype; theta_global is kept in fp32)
    python fedmom_server.py --state-dir state/fedmom --init init.safetensors
    # every later start resumes from the state dir (--init is then optional)
    python fedmom_server.py --state-dir state/fedmom [--memory-gb 48 --outer-dir /nvme/outer
        --outer-lr 0.7 --outer-momentum 0.9 --round-deadline-s 1800 --member-timeout-s 300
        --blob-url https://127.0.0.1:29512 --darl https://127.0.0.1:29510 --ca-file ca.pem
        --token-file FILE --darl-token-file AGGREGATOR_TOKEN_FILE --tls-cert server.pem
        --tls-key server.key --down-wire int4 --down-wire-block 128 --keep-rounds 3
        --phase-s 600 --quorum 0.5 --grace-frac 0.2]
    python fedmom_server.py status --url URL [--token-file FILE --ca-file ca.pem]  # exit 1 on a violation
    python fedmom_server.py plan --params 8e9 --sites 2 --down-wire int4 [--memory-gb 48 | --init FILE]
    python fedmom_server.py export --state-dir DIR theta.safetensors   # a stopped server's theta
    python fedmom_server.py checkpoint --state-dir DIR   # its round as the checkpoint: nothing to replay

What it owns: the HTTP shell (each route reads its request and makes one call on
fedmom_state.FedMomState, which knows nothing of HTTP; fedmom_round.Refused becomes the 4xx
it names), the three loops that drive the rounds, the calls to DARL and the blob store's
retention, and the command lines. The rest: fedmom_round.py (the pure round core: who may
send, the quorum, the records), fedmom_state.py (the books: round state, state.json and the
state dir's layout, the spool, blobs and their retention, the DARL custody link),
outer_state.py (the outer state, its checkpoint and replay, the --memory-gb budget, `plan`),
fedmom_merge.py (the merge rule, the clip, the --down-wire publisher, the worker processes),
httpd.py (connections), status_page.py (GET /). The VM's files: central.sh's CENTRAL_FILES.

Test hooks (testhooks.py): fault points fedmom.received, fedmom.spooled, fedmom.custody_held,
fedmom.merge, fedmom.round_durable, fedmom.committed, fedmom.epoch_durable (the issued epoch
durable, not confirmed), fedmom.checkpoint (after each file of a checkpoint), fedmom.unlink
(each file of an old round, outside the state lock) and fedmom.blob_delete (each DELETE of a
retention sweep); the wall clock through testhooks.wall_time().

The protocol: FEDERATION_GUIDE.md, "Endpoints", "A round, from the site's side", "Knobs",
"Reading the metrics"; the path of a delta: ARCHITECTURE.md, "The path of one delta".
"""
import argparse
import http.client
import json
import os
import sys
import threading
import time

import darl_table
import durable
import fedmom_state
import httpc
import httpd
import outer_state
import status_page
import testhooks
import wire
from fedmom_state import SWEEP_RETRY_S, BlobLink, BlobRetention
from fedmom_state import DarlLink
from fedmom_round import QUORUM_MIN_RECORDS, QUORUM_RECORDS, format_record
from fedmom_round import Refused
from fedmom_state import FedMomState, ServerConfig
from fedmom_state import log

DEFAULT_PORT = 29511


# ---------------------------------------------------------------- HTTP

def _refusal(fn):
    """Route wrapper: Refused from the state becomes the HTTP error it names."""
    def wrapped(req):
        try:
            return fn(req)
        except Refused as e:
            raise httpd.HTTPError(e.status, e.reason, **e.extra)
    wrapped.__name__ = fn.__name__
    return wrapped


def _ident(req, body):
    """(cluster, incarnation) the request names; a 403 unless its credential may act as that cluster."""
    return req.acts_as(httpd.field(body, "cluster", str)), httpd.field(body, "incarnation", str)


def _delta_meta(req):
    """PUT /delta's metadata: the X-Delta-Meta header, as JSON (its cluster the caller's: _ident)."""
    raw = req.headers.get("X-Delta-Meta")
    if not raw:
        raise httpd.HTTPError(400, "missing X-Delta-Meta header (JSON: cluster, incarnation, base_round, "
                                   "tokens, leases, metrics)")
    try:
        meta = json.loads(raw)
    except ValueError as e:
        raise httpd.HTTPError(400, f"X-Delta-Meta is not JSON: {e}")
    if not isinstance(meta, dict):
        raise httpd.HTTPError(400, "X-Delta-Meta must be a JSON object")
    _ident(req, meta)
    return meta


def _from_round(req):
    """GET /theta_update(_blob)'s query: (round of the site's theta, its wire.Digest)."""
    try:
        return int(req.query.get("from", "")), req.query.get("digest", "")
    except ValueError:
        raise httpd.HTTPError(400, f"GET {req.path} needs ?from=<round of your theta>&digest=<its wire.Digest>")


def _wait_s(req):
    try:
        return float(req.query.get("wait_s", "0") or 0)
    except ValueError:
        raise httpd.HTTPError(400, f"GET {req.path}: wait_s must be a number of seconds")


def _resume_at(req, uid, total):
    """Where a reply resumes: `Range: bytes=N-` of the same update (?id=), else 0."""
    rng = req.handler.headers.get("Range", "")
    if not rng or req.query.get("id") != uid:
        return 0
    try:
        start = int(rng.removeprefix("bytes=").removesuffix("-"))
    except ValueError:
        raise httpd.HTTPError(400, f"GET {req.path}: Range must be bytes=N-, got {rng[:40]!r}")
    if not 0 <= start < total:
        raise httpd.HTTPError(416, f"GET {req.path}: Range start {start} is not inside the {total} bytes")
    return start


def make_routes(state, blob_token=None, retention=None, token=None):
    """The route table: each route reads its request and makes one call on the state."""
    cfg = state.cfg
    blobs = BlobLink(cfg.blob_url, blob_token, cfg.ca_file, retention) if cfg.blob_url else None
    status_html = status_page.Page(state.rounds_path, state.dir, cfg.darl, cfg.blob_url, token or blob_token,
                                   ca_file=cfg.ca_file, blob_token=blob_token)

    def blob_store(instead):
        if blobs is None:
            raise httpd.HTTPError(400, f"this server has no blob store: start it with --blob-url, or {instead}")
        return blobs

    def heartbeat(req):
        b = req.json()
        after = httpd.field(b, "wait_round_after", int, required=False)
        wait = httpd.field(b, "wait_s", (int, float), required=False, default=0.0)
        return state.heartbeat(*_ident(req, b), b.get("metrics"), after, float(wait))

    def delta_check(req):
        b = req.json()
        _ident(req, b)
        meta = state.check_delta_meta(b)
        return {"ok": True, "round": state.round, "cluster": meta["cluster"]}

    def delta_blob(req):
        b = req.json()
        store = blob_store("send inline")
        cluster, blob = _ident(req, b)[0], httpd.field(b, "blob", str)
        if req.principal is not None and req.principal.kind == "site" and httpd.blob_owner(blob) != cluster:
            req.handler.refuse(req.principal, f"{req.principal.describe()}: blob {blob[:80]!r} is not a delta of "
                                              f"cluster {cluster!r} (delta.{cluster}.<...>)")
        return state.fetch_delta(b, blob, httpd.field(b, "sha256", str), store)

    def theta(req):
        f, rnd = state.open_theta()
        return httpd.Response(file=f, headers={"X-Round": str(rnd)})

    def theta_update(req):
        f, rnd, digest = state.open_update(*_from_round(req))
        return httpd.Response(file=f, headers={"X-Round": str(rnd), "X-Theta-Digest": digest})

    def theta_update_next(req):
        """The next round's update as it is merged (FedMomState.follow_update); `Range: bytes=N-`
        with ?id= resumes a cut reply of the same merge (else the whole file, 200)."""
        got = state.follow_update(*_from_round(req), _wait_s(req))
        if got is None:
            return 202, {"waiting": True, "round": state.round}
        if got[0] == "file":
            f, rnd, digest = got[1:]
            total, uid = os.fstat(f.fileno()).st_size, (state.ledger.update or {}).get("id", "")
            start = _resume_at(req, uid, total)
            return httpd.Response(status=206 if start else 200, file=f, offset=start, length=total - start,
                                  headers={"X-Round": rnd, "X-Theta-Digest": digest, "X-Durable": 1,
                                           "X-Update-Id": uid, "X-Update-Total": total})
        g = got[1]
        start = _resume_at(req, g.tag["id"], g.total)
        return httpd.Response(status=206 if start else 200, stream=g.follow(start), length=g.total - start,
                              headers={"X-Round": g.tag["round"], "X-Durable": 0, "X-Update-Id": g.tag["id"],
                                       "X-Update-Total": g.total})

    def theta_update_blob(req):
        store = blob_store("use GET /theta_update")
        return state.publish_update(*_from_round(req), store)

    def status(req=None):
        st = state.status()
        return {**st, "retention": {"keep_rounds": cfg.keep_rounds, "state": state.kept_files(),
                                    "checkpoint": st["checkpoint"], "blobs": retention and retention.view()}}

    def page(req):      # GET /?saved=1: the copy to keep (stamped, no auto-refresh)
        keyring = req.handler.keyring       # the credentials' list: not for an anonymous reader of the page
        st = {**status(), **({"auth": keyring.view()} if keyring and httpd.sees_auth(req) else {})}
        body = status_html.html(st, alarm_lines(st), saved=req.query.get("saved") == "1")
        return httpd.Response(body=body.encode(), content_type="text/html; charset=utf-8")

    routes = {("GET", "/health"): lambda req: {"ok": True, "round": state.round},
              ("GET", "/"): page, ("GET", "/status"): status,
              ("GET", "/round"): lambda req: state.round_info(),
              ("POST", "/join"): lambda req: state.join(*_ident(req, req.json())),
              ("POST", "/heartbeat"): heartbeat,
              ("POST", "/leave"): lambda req: state.leave(*_ident(req, req.json())),
              ("POST", "/delta_check"): delta_check,
              # a delta excluded at upload (400/422 bad_delta) is told in that reply only: an
              # exclusion not yet in a round record lives in memory (one at the merge: "deltas")
              ("PUT", "/delta"): lambda req: state.receive_delta(_delta_meta(req), req.stream()),
              ("POST", "/delta_blob"): delta_blob,
              ("GET", "/theta"): theta,
              ("GET", "/theta_blob"): lambda req: state.publish_theta(blob_store("use GET /theta")),
              ("GET", "/theta_update"): theta_update,
              ("GET", "/theta_update_blob"): theta_update_blob,
              ("GET", "/theta_update_next"): theta_update_next}
    return {k: _refusal(v) for k, v in routes.items()}


def round_loop(state, stop, interval_s=0.5):
    """Background thread 1: drop silent members, close and merge rounds."""
    while not stop.is_set():
        try:
            state.tick()
        except Exception as e:       # keep the loop alive; the log says what went wrong
            log(f"fedmom: round loop error: {type(e).__name__}: {e}")
        state.wait(interval_s)


def darl_loop(state, stop, interval_s=1.0, on_fenced=None):
    """Background thread 2: custody of deltas accepted while DARL gave no answer, and the
    commits and aborts owed, re-sent until DARL answers definitively (at most every
    --darl-retry-s after a failure). Apart from the round loop, so an unreachable
    coordinator (30 s timeouts) never holds the round lock. DARL fencing this epoch ends
    the loop and calls on_fenced (the server exits: another process owns the state)."""
    backoff = interval_s
    while not stop.is_set():
        ok = False
        try:
            ok = state.darl_tick()
        except Exception as e:
            log(f"fedmom: DARL loop error: {type(e).__name__}: {e}")
        if state.fenced:
            if on_fenced is not None:
                on_fenced()
            return
        if ok:
            backoff = interval_s
            state.wait(interval_s)       # all answered: a new delta or round wakes the loop at once
        else:                            # DARL owes an answer: back off (an upload still asks at once)
            backoff = min(max(2 * backoff, interval_s), state.cfg.darl_retry_s)
            stop.wait(backoff)


def retention_loop(state, retention, stop, interval_s=1.0):
    """Background thread 3: the blob store's retention sweep (fedmom_state.BlobRetention) once per
    durable round and once at start; apart from the round loop, so a store that does not answer
    (30 s timeouts) never delays a merge."""
    while not stop.is_set():
        rnd = state.round
        if retention.due(rnd, time.monotonic()):
            retention.sweep(rnd)
        state.wait(interval_s, round=rnd)


# ---------------------------------------------------------------- status

def alarm_lines(st):
    """The loud lines of a status: violation counters, DARL's silence, fencing."""
    out = [line for line in [darl_table.violations_line(st.get("violations"))] if line]
    d = st.get("darl") or {}
    if d.get("fenced"):
        out.append(f"!!! FENCED by DARL, this process is stopping: {d['fenced']}")
    if d.get("alarm"):
        a = d["alarm"]
        out.append(f"!!! DARL gives no definitive answer since {time.strftime('%H:%M:%S', time.localtime(a['since']))} "
                   f"({a['calls']} calls): {a.get('error')}; owed calls are kept and re-sent")
    if d.get("custody_waiting"):
        out.append(f"round waits for DARL to confirm custody of the deltas of {d['custody_waiting']}")
    sweep = ((st.get("retention") or {}).get("blobs") or {}).get("error")
    if sweep:
        out.append(f"!!! the retention sweep of the blob store failed ({sweep}); old theta/update blobs stay "
                   f"until it succeeds (retried every {SWEEP_RETRY_S:g} s)")
    if st.get("merge_error"):
        out.append(f"!!! the merge of round {st.get('round')} failed ({st['merge_error']}); nothing was published, "
                   "it is retried every 30 s (a full disk: free space on the state dir)")
    if st.get("replay_error"):
        out.append(f"!!! REPLAY MISMATCH, no round merges until a restart: {st['replay_error']}")
    auth = st.get("auth") or {}
    out += [f"!!! {a}: a leaked or revoked credential still knocking? (httpd.py site list)" for a in auth.get("alarms", ())]
    if auth.get("file_error"):
        out.append(f"!!! the credentials file {auth['file']}: {auth['file_error']}")
    return out


def retention_lines(ret):
    """What the central VM keeps for this aggregator and why (GET /status "retention")."""
    if not ret:
        return []
    out = [f"kept in the state dir ({sum(f['bytes'] for f in ret['state']) / 2**20:.1f} MiB):"]
    c = ret.get("checkpoint")
    if c:
        last = c.get("last")
        out.append(f"  checkpoint of round {c['round']} (every {c['every']} rounds; rounds {c['logged_rounds'] or 'none'} "
                   "replayed at a restart)" + (f"; the last one written: round {last['round']}, "
                                               f"{last['bytes'] / 2**30:.2f} GiB in {last['seconds']:.1f} s" if last else ""))
    out += [f"  {f['file']:<40} {f['bytes'] / 2**20:>9.1f} MiB  {f['why']}" for f in ret["state"]]
    b = ret.get("blobs")
    if b is None:
        return out
    swept = "not swept yet" if b["swept_round"] is None else f"as of the sweep at round {b['swept_round']}"
    out.append(f"kept in the blob store (--keep-rounds {b['keep_rounds']}; {swept}; {b['deleted']} blob(s) "
               "deleted by this process):")
    out += [f"  {k['blob']:<40} {k['bytes'] / 2**20:>9.1f} MiB  {k['why']}" for k in b["kept"]]
    return out


def print_status(url, token=None, last=10, ca_file=None):
    """Print the aggregator's status; 1 while a violation counter is non-zero or it is fenced."""
    st = httpc.call(url, "GET", "/status", token=token, ca_file=ca_file)
    if not isinstance(st, dict) or "round" not in st or "members" not in st:
        what = "DARL (darl_server.py status)" if isinstance(st, dict) and "num_blocks" in st else "not the aggregator"
        raise SystemExit(f"status: {url} answers /status like {what}: point --url at the aggregator "
                         f"(fedmom_server.py, port {DEFAULT_PORT} by default)")
    print(f"round {st['round']}{' (merging)' if st['merging'] else ''}; {st['parameters']:,} parameters; "
          f"outer lr {st['config']['outer_lr']} momentum {st['config']['outer_momentum']}; "
          f"aggregator {st['aggregator']} epoch {st['epoch']}; DARL commits owed {st['pending_commits']}, "
          f"aborts owed {st['pending_aborts']}")
    for line in alarm_lines(st):
        print(line)
    m = st.get("memory")
    if m:
        print(f"memory budget {outer_state.gb(m['budget_bytes'])} (fixed {outer_state.gb(m['fixed_bytes'])}): "
              f"outer state {outer_state.gb(m['in_memory_bytes'])} in memory, {outer_state.gb(m['on_disk_bytes'])} "
              f"on disk" + (f" in {m['outer_dir']}" if m["outer_dir"] else ""))
    print(f"members ({len(st['members'])}):" + ("" if st["members"] else " none"))
    for m in st["members"]:
        print(f"  {m['cluster']:<16} {m['incarnation']:<20} heard {m['heard_s_ago']:>6.1f} s ago  "
              f"{'sent' if m['sent'] else 'training'}")
    if st["deadline_in_s"] is not None:
        print(f"round closes by deadline in {st['deadline_in_s']:.0f} s")
    q = st.get("quorum")
    if q and q["reached_s_ago"] is not None:
        print(f"quorum reached {q['reached_s_ago']:.0f} s ago ({q['arrived_tokens']:,} of {q['expected_tokens']:,} "
              f"tokens expected); the round closes {q['grace_s']:g} s after it")
    print("last merges:")
    for r in st["recent"][-last:]:
        print("  " + format_record(r).removeprefix("fedmom: "))
    for line in retention_lines(st.get("retention")):
        print(line)
    return 1 if (any((st.get("violations") or {}).values()) or (st.get("darl") or {}).get("fenced")
                 or st.get("replay_error")) else 0


# ---------------------------------------------------------------- main

def serve(cfg, a):
    """Bind (a refused public bind creates nothing), lock the state dir, build the state,
    serve until SIGTERM."""
    # GET / is public unless --private-page: the page is read-only and shows round numbers,
    # cluster ids and metrics only (no token, no path), and a browser cannot send a bearer header
    public = ("/health",) if a.private_page else ("/health", "/")
    token = httpc.load_token(a.token_file)
    darl_token = httpc.load_token(a.darl_token_file, env=None)
    darl = DarlLink(cfg.darl, darl_token or token, ca_file=cfg.ca_file) if cfg.darl else None
    # bind first, then lock the state dir, then read it: a second start (port taken, or
    # another port on the same dir) stops before it deletes or rewrites anything
    server = httpd.server_from_args(a, public=public, disk=cfg.state_dir)
    httpd.writable_dir(cfg.state_dir, "--state-dir")
    lock_fd = durable.lock_state_dir(cfg.state_dir, "fedmom_server")     # held until the process ends
    state = FedMomState(cfg, darl=darl)
    blob_token = httpc.load_token(a.blob_token_file, env=None) or token
    retention = (BlobRetention(cfg.blob_url, state.aggregator_id, cfg.keep_rounds, blob_token, cfg.ca_file)
                 if cfg.blob_url else None)
    server.RequestHandlerClass.routes.update(httpd.with_http_stats(make_routes(state, blob_token, retention, token), server))
    stop = threading.Event()

    def on_fenced():                 # another process of this aggregator is newer: never serve beside it
        log("fedmom: exiting (fenced)")
        os._exit(3)
    threading.Thread(target=round_loop, args=(state, stop), name="fedmom-rounds", daemon=True).start()
    threading.Thread(target=darl_loop, args=(state, stop), kwargs={"on_fenced": on_fenced}, name="fedmom-darl",
                     daemon=True).start()
    if retention is not None:
        threading.Thread(target=retention_loop, args=(state, retention, stop), name="fedmom-retention",
                         daemon=True).start()
    try:
        httpd.serve_forever(server, f"fedmom round {state.round}")
    finally:
        stop.set()
        state.keeper.close()                  # the merge workers (they exit on their own if we are killed)
        os.close(lock_fd)


def _server_parser():
    p = httpd.base_parser(__doc__)
    p.add_argument("--state-dir", required=True, help="where theta, momentum, state.json, rounds.jsonl live")
    p.add_argument("--init", help="initial model (.safetensors, any float dtype); needed on the first start only")
    p.add_argument("--outer-lr", type=float, default=ServerConfig.outer_lr,
                   help=f"outer learning rate (default {ServerConfig.outer_lr}; 1.0 = FedAvg)")
    p.add_argument("--outer-momentum", type=float, default=ServerConfig.outer_momentum,
                   help=f"Nesterov momentum (default {ServerConfig.outer_momentum}; 0 = FedAvg)")
    p.add_argument("--round-deadline-s", type=float, default=1800.0,
                   help="seconds after a round's first delta before it merges without the rest (default 1800)")
    p.add_argument("--member-timeout-s", type=float, default=300.0,
                   help="seconds without a heartbeat before a member is dropped (default 300)")
    p.add_argument("--phase-s", type=float, default=None,
                   help="the round cadence offered to every site: seconds a phase should train, told in the "
                        "join reply (default: none offered)")
    p.add_argument("--quorum", type=float, default=None,
                   help="a round closes a grace after the tokens that arrived reach this fraction, in (0, 1], of "
                        f"the tokens it expects (default {fedmom_state.QUORUM_WITH_PHASE} with --phase-s, else "
                        "1: wait for every live member)")
    p.add_argument("--grace-frac", type=float, default=fedmom_state.GRACE_FRAC,
                   help="the grace after a round's quorum, as a fraction in (0, 1] of the median length of the "
                        f"last {QUORUM_RECORDS} rounds (of --phase-s before {QUORUM_MIN_RECORDS} rounds merged; "
                        f"default {fedmom_state.GRACE_FRAC})")
    p.add_argument("--blob-url", help="blob store URL (blobstore.py, :29512) for the blob transport (default: none)")
    p.add_argument("--darl", help="DARL coordinator URL (:29510): every accepted delta's leases go into custody "
                                  "there, and are committed once merged (default: none, no accounting)")
    p.add_argument("--blob-token-file", default=os.environ.get("PWW_BLOB_TOKEN_FILE"),   # blobstore.py reads it too
                   help="the aggregator's own token at the blob store (blobstore.py --aggregator-token-file; "
                        "default $PWW_BLOB_TOKEN_FILE, else the --token-file token)")
    p.add_argument("--darl-token-file", default=os.environ.get("PWW_AGGREGATOR_TOKEN_FILE"),
                   help="the aggregator's own credential for DARL's custody endpoints (darl_server.py "
                        "--aggregator-token-file; default $PWW_AGGREGATOR_TOKEN_FILE, else the --token-file token)")
    p.add_argument("--darl-retry-s", type=float, default=10.0,
                   help="longest wait between re-sends of a custody request, commit or abort DARL has not "
                        "answered definitively, s (default 10)")
    p.add_argument("--darl-heartbeat-s", type=float, help=argparse.SUPPRESS)
    p.add_argument("--clip-factor", type=float, default=10.0,
                   help="scale a delta down to this x the median delta norm (this round's and the last "
                        "rounds' merged ones), named in the round record; 0 = off (default 10)")
    p.add_argument("--ca-file", default=os.environ.get("PWW_CA_FILE"),
                   help="CA certificate for https:// --darl and --blob-url (default $PWW_CA_FILE, else the system's)")
    p.add_argument("--down-wire", choices=wire.FORMATS, default="f32",
                   help="publish each round as an update in this wire format, with error feedback; sites "
                        "holding the previous round download it instead of theta (default f32: theta only)")
    p.add_argument("--down-wire-block", type=int, default=128,
                   help="int8/int4/int2 update: values per scale along the last dimension, 64-256 (default 128)")
    p.add_argument("--keep-rounds", type=int, default=fedmom_state.KEEP_ROUNDS,
                   help="the blob store keeps the theta and update blobs of the current round and the "
                        "keep-rounds - 1 before it (so a download begun before a merge can finish); older "
                        "ones are deleted once a later round is durable, and a site that far behind takes "
                        f"the full theta (default {fedmom_state.KEEP_ROUNDS}; RUNBOOK.md has the disk formula)")
    p.add_argument("--checkpoint-rounds", type=int, default=fedmom_state.CHECKPOINT_ROUNDS,
                   help="write theta, momentum and the update residual whole (fsync'd) every this many rounds; "
                        "the rounds between are durable as their deltas and updates and are replayed in memory "
                        "at a restart (at most this many merges). 1 writes them every round (default "
                        f"{fedmom_state.CHECKPOINT_ROUNDS})")
    p.add_argument("--threads", type=int, default=None,
                   help="threads for a delta's decode at acceptance and for a round run in this process "
                        "(default $WIRE_THREADS, else every core); any number gives the same bits")
    p.add_argument("--merge-procs", type=int, default=None,
                   help="worker processes a round (and a restart's replay) runs on, the outer state's memory "
                        "part in shared memory ($PWW_SHM_DIR, default /dev/shm; --memory-gb counts it): numpy "
                        "threads share one interpreter lock and barely help, processes do (fedmom_merge.py); "
                        "1 = this process alone; any number gives the same bits (default every core)")
    p.add_argument("--memory-gb", type=float, default=None,
                   help="GB the aggregator and its merge workers may hold, shared memory included: the outer "
                        "state (12 B/param with --down-wire) stays in memory as far as it fits, the rest in file "
                        "blocks in --outer-dir; below the fixed part (its processes, a round's working memory) the "
                        "start refuses. Default: 3/4 of the machine's memory, at most 9/10 of what is available "
                        "and, with --merge-procs, what shared memory holds (outer_state.py; `plan` prints a run's)")
    p.add_argument("--outer-dir", default=None,
                   help="where the outer state that --memory-gb leaves out of memory lives, as scratch file blocks "
                        "(never a checkpoint; a start sweeps them): a local disk, the faster the better "
                        f"(default {outer_state.OUTER_DIR}/ in --state-dir)")
    p.add_argument("--private-page", action="store_true", help="require the token for GET / too (default: public)")
    p.add_argument("--accept-config-change", action="store_true",
                   help="--outer-lr/--outer-momentum differ from those the state was run with: apply the new "
                        "values from the current round on instead of refusing to start")
    httpd.add_server_args(p, DEFAULT_PORT)
    return p


def _offline(what, fn, a):
    """fn(state_dir, threads, store) on a stopped aggregator's state dir, holding its lock (never
    beside a running server), its outer state placed by --memory-gb as a server's is (no merge
    workers); a state it cannot rebuild is a one-line SystemExit."""
    fd = durable.lock_state_dir(a.state_dir, "fedmom_server")
    store = None
    try:
        sd = os.path.abspath(a.state_dir)
        ckpt, _ = outer_state.read_record(outer_state.read_state(sd), f"{sd}/state.json")
        _, store = outer_state.make_store(outer_state.read_shapes(sd, ckpt), outer_state.ARRAYS, None, 0,
                                           a.memory_gb, a.outer_dir or os.path.join(sd, outer_state.OUTER_DIR),
                                           lambda m: print(f"{what}: {m}", file=sys.stderr))
        return fn(a.state_dir, a.threads, store)
    except ValueError as e:
        raise SystemExit(f"{what}: {e}")
    finally:
        if store is not None:
            store.release()
        os.close(fd)


def _offline_args(p):
    p.add_argument("--threads", type=int, default=None, help="cores for the replay (default every core)")
    p.add_argument("--memory-gb", type=float, default=None,
                   help="GB the outer state may take in memory, the rest in file blocks in --outer-dir (default: "
                        "the machine's, as the server's)")
    p.add_argument("--outer-dir", default=None, help=f"(default {outer_state.OUTER_DIR}/ in --state-dir)")


def export(argv):
    """fedmom_server.py export: theta (and the momentum, the residual) of a stopped aggregator's
    state dir, rebuilt from its checkpoint and the rounds logged since, as tensor files."""
    p = argparse.ArgumentParser(prog="fedmom_server.py export", description=export.__doc__)
    p.add_argument("export")
    p.add_argument("--state-dir", required=True, help="the aggregator's --state-dir (the server stopped)")
    p.add_argument("out", help="where theta_global goes (an F32 .safetensors file; tensorio.py export-hf "
                               "turns it into a Hugging Face checkpoint)")
    p.add_argument("--momentum", help="also write the momentum buffer here")
    p.add_argument("--residual", help="also write what the last update rounded away here (--down-wire)")
    _offline_args(p)
    a = p.parse_args(argv)
    outer = _offline("export", outer_state.load_outer, a)
    for which, path in (("theta", a.out), ("momentum", a.momentum), ("residual", a.residual)):
        if path is None:
            continue
        if getattr(outer, which) is None:
            raise SystemExit(f"export: the state of round {outer.round} keeps no {which}")
        outer.write(which, path, fsync=True)
        print(f"{which} of round {outer.round} -> {path}")
    print(f"theta digest {outer.digest}")
    return 0


def checkpoint(argv):
    """fedmom_server.py checkpoint: make the current round of a stopped aggregator's state dir its
    checkpoint (theta, momentum and residual written whole; the logged rounds' deltas removed),
    so a restart replays nothing and the directory is one round's files (a backup, a move)."""
    p = argparse.ArgumentParser(prog="fedmom_server.py checkpoint", description=checkpoint.__doc__)
    p.add_argument("checkpoint")
    p.add_argument("--state-dir", required=True, help="the aggregator's --state-dir (the server stopped)")
    _offline_args(p)
    a = p.parse_args(argv)
    rnd = _offline("checkpoint", lambda sd, threads, store: outer_state.checkpoint_offline(sd, threads,
                                                                                              store=store), a)
    print(f"{a.state_dir}: round {rnd} is the checkpoint; nothing is left to replay")
    return 0


def plan(argv):
    """fedmom_server.py plan: what a run needs (outer_state.plan): RAM at the budget, the disk,
    and the central seconds of a round in memory, at the budget and with nothing in memory."""
    p = argparse.ArgumentParser(prog="fedmom_server.py plan", description=plan.__doc__)
    p.add_argument("plan")
    size = p.add_mutually_exclusive_group(required=True)
    size.add_argument("--params", type=float, help="parameters of the model (8e9); its largest tensor is taken as "
                                                   "the embedding of the Qwen3 flavor nearest in size")
    size.add_argument("--init", help="the model's --init file (its header gives every tensor's shape)")
    p.add_argument("--sites", type=int, default=2, help="sites sending a delta each round (default 2)")
    p.add_argument("--wire", choices=wire.FORMATS, default="int4", help="the sites' delta format (default int4)")
    p.add_argument("--down-wire", choices=wire.FORMATS, default="int4", help="as the server's (default int4 here)")
    p.add_argument("--memory-gb", type=float, default=None, help="the budget (default: all in memory)")
    p.add_argument("--merge-procs", type=int, default=16, help="merge workers (default 16)")
    p.add_argument("--cores", type=int, default=16, help="the central VM's cores (default 16)")
    p.add_argument("--outer-momentum", type=float, default=ServerConfig.outer_momentum,
                   help=f"as the server's (default {ServerConfig.outer_momentum}; 0 keeps no momentum)")
    p.add_argument("--checkpoint-rounds", type=int, default=fedmom_state.CHECKPOINT_ROUNDS,
                   help=f"as the server's (default {fedmom_state.CHECKPOINT_ROUNDS})")
    p.add_argument("--keep-rounds", type=int, default=fedmom_state.KEEP_ROUNDS,
                   help=f"as the server's (default {fedmom_state.KEEP_ROUNDS})")
    p.add_argument("--rates", help="a bench/scale_round.py --json file: its measured rates (default: "
                                   f"{outer_state.RATES['source']})")
    nvme = f"{outer_state.NVME['read_bps'] / 1e9:g},{outer_state.NVME['write_bps'] / 1e9:g}"
    p.add_argument("--disk-gbs", default=nvme,
                   help=f"READ,WRITE GB/s of the --outer-dir disk (default: a local NVMe's, {nvme})")
    p.add_argument("--link-gbs", type=float, default=None,
                   help="GB/s of a site's link down, for the exchange (default: the rates', loopback TLS)")
    a = p.parse_args(argv)
    codec = lambda fmt: None if fmt == "f32" else wire.Codec(fmt).validate()
    if a.init:
        shapes, how = outer_state.init_shapes(a.init), f"--init {a.init}"
    else:
        shapes, how = outer_state.shapes_of(int(a.params)), "--params: the largest tensor a Qwen3 embedding"
    try:
        read, write = (float(x) * 1e9 for x in a.disk_gbs.split(","))
    except ValueError:
        raise SystemExit(f"plan: --disk-gbs {a.disk_gbs}: give READ,WRITE in GB/s, e.g. 3,2")
    rates = outer_state.rates_from(a.rates)
    if a.link_gbs is not None:
        if a.link_gbs <= 0:
            raise SystemExit(f"plan: --link-gbs {a.link_gbs}: give GB/s (> 0), e.g. 1.2")
        rates = {**rates, "link_bps": a.link_gbs * 1e9, "exchange_source": rates["exchange_source"] + ", --link-gbs"}
    for line in outer_state.plan(shapes, how, a.sites, codec(a.wire), codec(a.down_wire), a.memory_gb,
                                  a.merge_procs, a.cores, a.outer_momentum, a.checkpoint_rounds, a.keep_rounds,
                                  rates, {"read_bps": read, "write_bps": write}):
        print(line)
    return 0


def main(argv):
    if argv[:1] == ["plan"]:
        return plan(argv)
    if argv[:1] == ["export"]:
        return export(argv)
    if argv[:1] == ["checkpoint"]:
        return checkpoint(argv)
    if argv[:1] == ["status"]:
        p = httpd.base_parser(__doc__)
        p.add_argument("status")
        p.add_argument("--url", default=f"http://127.0.0.1:{DEFAULT_PORT}",
                       help=f"aggregator URL (default http://127.0.0.1:{DEFAULT_PORT}; https://... under TLS)")
        httpc.add_client_args(p)
        p.add_argument("--last", type=int, default=10, help="how many recent merges to print (default 10)")
        a = p.parse_args(argv)
        try:
            sys.exit(print_status(a.url, httpc.load_token(a.token_file), a.last, a.ca_file))
        except (httpc.CallError, OSError, http.client.HTTPException, ValueError, httpc.TLSConfigError) as e:
            raise SystemExit(f"status: {a.url}: {e}")
    a = _server_parser().parse_args(argv)
    if a.darl_heartbeat_s is not None:
        raise SystemExit("fedmom_server: --darl-heartbeat-s is gone: the leases of accepted deltas are in DARL "
                         "custody, which never expires; drop the flag (--darl-retry-s paces re-sends to DARL)")
    cfg = ServerConfig(a.state_dir, a.init, a.outer_lr, a.outer_momentum, a.round_deadline_s,
                       a.member_timeout_s, a.blob_url, a.darl, a.darl_retry_s, ca_file=a.ca_file,
                       clip_factor=a.clip_factor, accept_config_change=a.accept_config_change,
                       down_wire=a.down_wire, down_wire_block=a.down_wire_block,
                       keep_rounds=a.keep_rounds, checkpoint_rounds=a.checkpoint_rounds,
                       threads=a.threads, merge_procs=a.merge_procs, phase_s=a.phase_s, quorum=a.quorum,
                       grace_frac=a.grace_frac, memory_gb=a.memory_gb, outer_dir=a.outer_dir).validate()
    serve(cfg, a)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
