"""status_page.py - the whole central VM on one HTML page: coverage, rounds, sites, disk, alarms.

Runs on: the central VM, imported by fedmom_server.py, which serves the page at GET /
(public unless --private-page) and GET /?saved=1 (the copy to keep: no auto-refresh,
stamped with the time it was captured; `make demo` saves that one). Python standard
library + httpc.py's client call; never imports torch. No JavaScript: the plots are
inline SVG, and every figure a plot shows is in a table too, so a text browser (lynx,
w3m) reads the same numbers.

Where each figure comes from:
    coverage         DARL's GET /status: committed / leased / free / quarantined blocks;
                     the ETA divides the blocks not yet committed by the live sites'
                     measured commit rate (DARL's blocks_per_s per cluster, summed)
    rounds           the aggregator's status and its WHOLE rounds.jsonl, read
                     incrementally (a page costs the new lines only); plots decimate
                     to their width, keeping each bucket's minimum and maximum
    per site         merged deltas' metrics (fedmom_round.METRIC_KEYS): tokens/s, MFU,
                     peak memory, loss, held-out loss when a site reports one; its last
                     phase (steps, what ended it, step time), compute utilisation (its
                     own util, inner_s over round periods: the page's note defines them)
                     and waited_s; membership spans from the aggregator's join/leave/drop events
    loud             excluded deltas, DARL commits refused, members dropped, blocks
                     lost with expired leases, quarantined blocks, DARL invariant
                     errors, unreachable peers; then, in amber, a site that waited in
                     over a fifth of its rounds, and on what (site_waits)
    disk             the aggregator's state dir (and the free space on its file
                     system); the blob store's used bytes and quota (GET /blobs)
The page shows round numbers, cluster ids and metrics only: no token, no file path.

Layout: each plot is an SVG with a viewBox and width 100%, in a CSS grid that puts
two side by side on a wide window and one per row on a narrow one, so the width
follows the window with no script. Axes carry ticks and units; legends sit in a row
above the plot area, never on the data or the tick labels.

render(view) is a pure function of plain dicts (tests call it directly); Page.view()
does the reading.
"""
import collections
import html
import http.client
import json
import math
import os
import shutil
import threading
import time

import darl_table
import httpc

REFRESH_S = 10            # the live page reloads itself (a <meta> refresh, no script)
PEER_TIMEOUT_S = 2.0      # DARL / blob store calls per page: a dead peer costs the page 2 s, not 30
PLOT_W, PLOT_H = 640, 300
PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf")
ESC = html.escape
BAD = ' class="bad"'


# ---------------------------------------------------------------- reading (the only I/O)

class RoundsTail:
    """rounds.jsonl read from where the last call stopped; compact rows for the whole run.
    A torn last line (a crash mid-append) waits for its newline; a file that shrank was
    replaced, and is read again from the start."""

    def __init__(self, path):
        self.path, self.offset, self.rows, self.lock = path, 0, [], threading.Lock()

    def read(self):
        with self.lock:
            try:
                size = os.path.getsize(self.path)
            except FileNotFoundError:
                return list(self.rows)
            if size < self.offset:
                self.offset, self.rows = 0, []
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read(size - self.offset)
            end = data.rfind(b"\n") + 1
            self.offset += end
            for line in data[:end].splitlines():
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                self.rows.append(compact(rec, self.rows[-1]["cum_tokens"] if self.rows else 0))
            return list(self.rows)


SITE_KEYS = ("loss", "tokens_per_s", "mfu", "peak_mem_gib", "inner_s", "heldout_loss", "heldout_round",
             "incarnation", "steps", "step_s", "ended_by", "util", "arrived_s", "waited_s",
             "exchange_round", "held_lag_s", "exchange_wait_s")


def compact(rec, cum_before):
    """What the page needs of one round record (any version; a field it lacks is None);
    cum_tokens = tokens merged so far. A site with two deltas in a round (a new incarnation:
    "name@incarnation") is one site: the later one's figures where it has them, the tokens of both."""
    sites = {}
    for key, c in (rec.get("clusters") or {}).items():
        s = sites.setdefault(key.split("@")[0], {"tokens": 0})
        s["tokens"] += c.get("tokens") or 0
        for k in SITE_KEYS:
            if c.get(k) is not None:
                s[k] = c[k]
    return {"round": rec.get("round"), "time": rec.get("time"), "tokens": rec.get("tokens") or 0,
            "cum_tokens": cum_before + (rec.get("tokens") or 0), "loss": rec.get("loss"),
            "drift_mean": rec.get("drift_mean"), "drift_max": rec.get("drift_max"),
            "wall_s": rec.get("wall_s"), "merge_s": rec.get("merge_s"), "period_s": rec.get("period_s"),
            "reason": rec.get("reason"), "sites": sites, "exchange": rec.get("exchange"),
            "excluded": [{"cluster": d.get("cluster"), "why": d.get("why")} for d in rec.get("excluded") or ()],
            "dropped": [{"cluster": d.get("cluster"), "why": d.get("why")} for d in rec.get("dropped") or ()]}


def dir_bytes(path):
    total = 0
    for base, _, files in os.walk(path):
        for fn in files:
            try:
                total += os.lstat(os.path.join(base, fn)).st_size
            except FileNotFoundError:       # replaced under us (a merge): counted on the next page
                pass
    return total


def _peer(url, path, token, ca_file=None):
    """(reply, None) or (None, one-line reason)."""
    try:
        return httpc.call(url, "GET", path, token=token, timeout=PEER_TIMEOUT_S, ca_file=ca_file), None
    except (httpc.CallError, httpc.TLSConfigError) as e:
        return None, str(e)
    except (OSError, http.client.HTTPException, ValueError) as e:
        return None, f"unreachable ({type(e).__name__}: {e})"


class Page:
    """The page of one aggregator: its rounds log, state dir, and the DARL and blob store it uses."""

    def __init__(self, rounds_path, state_dir, darl_url=None, blob_url=None, token=None, ca_file=None, blob_token=None):
        self.rounds, self.state_dir = RoundsTail(rounds_path), state_dir
        self.darl_url, self.blob_url, self.token, self.ca_file = darl_url, blob_url, token, ca_file
        self.blob_token = blob_token or token     # the aggregator's own token at the blob store, if it has one

    def view(self, status, alarms=(), saved=False, now=None):
        """`alarms`: the aggregator's own loud lines (fedmom_server.alarm_lines: violation
        counters, fencing, DARL's silence), shown first."""
        v = {"status": status, "alarms": list(alarms), "rows": self.rounds.read(),
             "now": time.time() if now is None else now, "saved": saved, "darl": None, "darl_error": None, "blob": None, "blob_error": None,
             "disk": {"state_bytes": dir_bytes(self.state_dir),
                      "state_free_bytes": shutil.disk_usage(self.state_dir).free}}
        if self.darl_url:
            v["darl"], v["darl_error"] = _peer(self.darl_url, "/status", self.token, self.ca_file)
        if self.blob_url:
            listing, v["blob_error"] = _peer(self.blob_url, "/blobs", self.blob_token, self.ca_file)
            if listing is not None:
                v["blob"] = {"used_bytes": listing.get("used_bytes"), "quota_bytes": listing.get("quota_bytes"),
                             "blobs": len(listing.get("blobs", ())), "uploads": len(listing.get("uploads", ()))}
        return v

    def html(self, status, alarms=(), saved=False):
        return render(self.view(status, alarms, saved))


# ---------------------------------------------------------------- numbers as text

def fmt(v, spec=".4g", none="-"):
    return none if v is None else format(v, spec)


def si(v, unit=""):
    """1234567 -> '1.23M' (tokens, tokens/s, bytes use this)."""
    if v is None:
        return "-"
    for div, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(v) >= div:
            return f"{v / div:.3g}{suffix}{unit}"
    return f"{v:.3g}{unit}"


def nbytes(v):
    if v is None:
        return "-"
    for div, suffix in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if v >= div:
            return f"{v / div:.2f} {suffix}"
    return f"{v} B"


def duration(s):
    if s is None or not math.isfinite(s):
        return "unknown"
    s = int(round(s))
    if s < 90:
        return f"{s} s"
    if s < 5400:
        return f"{s // 60} min {s % 60:02d} s"
    if s < 172800:
        return f"{s // 3600} h {s % 3600 // 60:02d} min"
    return f"{s // 86400} d {s % 86400 // 3600} h"


def utc(t, spec="%Y-%m-%d %H:%M:%S UTC"):
    return time.strftime(spec, time.gmtime(t))


# ---------------------------------------------------------------- what the numbers say

def coverage(darl, now):
    """Blocks by state, percent committed and the ETA at the live sites' measured rate."""
    if not darl or "num_blocks" not in darl:
        return None
    n = darl["num_blocks"] or 0
    rates = [c["blocks_per_s"] for c in darl.get("clusters", ()) if c.get("live") and c.get("blocks_per_s")]
    rate = sum(rates) if rates else None
    left = n - darl.get("committed", 0)
    eta = 0.0 if left <= 0 else (left / rate if rate else None)
    return {"num_blocks": n, **{k: darl.get(k, 0) for k in ("committed", "leased", "free", "quarantined")},
            "pct": 100.0 * darl.get("committed", 0) / n if n else 0.0, "rate": rate, "eta_s": eta,
            "eta_at": None if eta is None else now + eta, "done": bool(darl.get("done")),
            "complete": bool(darl.get("complete"))}


def period(r):
    """A round's period: the seconds from the round before's close to its own (period_s); the
    first round after a start has none, and counts from its opening to its merge's end."""
    if r.get("period_s"):
        return r["period_s"]
    return r["wall_s"] + (r.get("merge_s") or 0.0) if r.get("wall_s") else None


LAST_PHASE = ("steps", "step_s", "ended_by", "waited_s")    # as its latest merged delta says, or None


def site_table(rows, status, darl):
    """One dict per site: the last merged delta's figures, run totals, membership, DARL books.
    util_last: the utilisation the site reported with its latest merged delta (of its cycle
    before), else that delta's inner_s over its round's period; util_run: its inner_s summed
    over the `util_rounds` rounds that merged a delta of it with inner_s, over their periods."""
    sites = {}
    new = lambda: {"deltas": 0, "tokens": 0, "inner_s": 0.0, "period_s": 0.0, "util_rounds": 0, "peak_mem_gib": None}
    for r in rows:
        for name, s in r["sites"].items():
            t = sites.setdefault(name, new())
            t["deltas"] += 1
            t["tokens"] += s.get("tokens", 0)
            for k in ("loss", "tokens_per_s", "mfu", "heldout_loss", "heldout_round", "incarnation"):
                if s.get(k) is not None:
                    t[k] = s[k]
            if s.get("peak_mem_gib") is not None:
                t["peak_mem_gib"] = max(t["peak_mem_gib"] or 0.0, s["peak_mem_gib"])
            t.update({k: s.get(k) for k in LAST_PHASE})
            t["util_last"] = s.get("util")
            if s.get("inner_s") is not None and period(r):
                t["inner_s"] += s["inner_s"]
                t["period_s"] += period(r)
                t["util_rounds"] += 1
                if t["util_last"] is None:
                    t["util_last"] = min(1.0, s["inner_s"] / period(r))
            t["last_round"] = r["round"]
    for m in status.get("members", ()):
        t = sites.setdefault(m["cluster"], new())
        t.update(member=True, heard_s_ago=m["heard_s_ago"], incarnation=m["incarnation"], sent=m["sent"])
    for c in (darl or {}).get("clusters", ()):
        t = sites.setdefault(c["cluster"], new())
        t.update(darl_committed=c.get("committed"), darl_leased=c.get("leased"), darl_lost=c.get("lost"),
                 blocks_per_s=c.get("blocks_per_s"), darl_live=c.get("live"))
    for name, t in sites.items():
        t["util_run"] = min(1.0, t["inner_s"] / t["period_s"]) if t["period_s"] else None
        t["waits"] = site_waits(rows, name)
    return dict(sorted(sites.items()))


WAIT_FRAC = 0.1         # a round counts as a wait for a site whose delta waited over this share of its period
WAIT_ALARM_FRAC = 0.2   # a site that waited in more than this share of its rounds is a line at the top


def site_waits(rows, name):
    """How `name` waited in the rounds that merged its delta and record waited_s (from its
    delta's arrival to the round's close): {"rounds": how many such rounds, "waits":
    [(waited_s, on what) for each of them where it waited over WAIT_FRAC of the period]}."""
    n, waits = 0, []
    for r in rows:
        s = r["sites"].get(name)
        if s is None or s.get("waited_s") is None or not period(r):
            continue
        n += 1
        if s["waited_s"] > WAIT_FRAC * period(r):
            waits.append((s["waited_s"], waited_on(r, name)))
    return {"rounds": n, "waits": waits}


def waited_on(r, name):
    """What a round kept `name` waiting for: the quorum's grace or the deadline when the round
    closed without someone (its reason says so), else the delta that arrived last."""
    reason = r.get("reason") or ""
    if reason.startswith("quorum"):
        return "the quorum grace"
    if reason.startswith("deadline"):
        return "the deadline"
    last = max(((s["arrived_s"], n) for n, s in r["sites"].items() if s.get("arrived_s") is not None), default=None)
    if last is None or last[1] == name:      # its own delta came last: no site kept the round open
        return "the aggregator after its own delta (custody at DARL, a merge retried)"
    return f"{last[1]}'s delta"


def wait_lines(sites):
    """A line per site that waited in more than WAIT_ALARM_FRAC of its rounds, and on what, mostly."""
    out = []
    for name, t in sites.items():
        n, waits = t["waits"]["rounds"], t["waits"]["waits"]
        if waits and len(waits) > WAIT_ALARM_FRAC * n:
            on = collections.Counter(w for _, w in waits).most_common(1)[0][0]
            out.append(f"{name} waited in {len(waits)} of {n} rounds ({100 * len(waits) / n:.0f}%), "
                       f"{_secs(sum(s for s, _ in waits) / len(waits))} on average, mostly on {on}")
    return out


def alarms(view, cov):
    """(loud lines, quiet lines): everything that lost or refused work, and what is fine."""
    st, rows, darl = view["status"], view["rows"], view["darl"] or {}
    loud = list(view.get("alarms", ()))
    darl_violated = darl_table.violations_line(darl.get("violations"))
    if darl_violated:
        loud.append("DARL: " + darl_violated)
    excl = [(r["round"], d) for r in rows for d in r["excluded"]] + [(st["round"] + 1, d)
                                                                   for d in st.get("excluded", ())]
    if excl:
        loud.append(f"{len(excl)} delta(s) EXCLUDED from merges (their blocks are trained again): "
                    + "; ".join(f"round {r}: {d['cluster']}: {d['why']}" for r, d in excl[-5:]))
    dropped = [(r["round"], d) for r in rows for d in r["dropped"]]
    if dropped:
        loud.append(f"{len(dropped)} member(s) dropped while a round was open: "
                    + "; ".join(f"round {r}: {d['cluster']}: {d['why']}" for r, d in dropped[-5:]))
    lost = sum(c.get("lost") or 0 for c in darl.get("clusters", ()))
    if lost:
        loud.append(f"{lost} block(s) LOST at DARL (their leases expired before a commit; the blocks went back "
                    "to the pool and were trained again)")
    if cov and cov["quarantined"]:
        loud.append(f"{cov['quarantined']} block(s) QUARANTINED at DARL")
    if darl.get("invariant_error"):
        loud.append(f"DARL INVARIANT VIOLATED: {darl['invariant_error']}")
    for who in ("darl", "blob"):
        if view.get(f"{who}_error"):
            loud.append(f"{'DARL' if who == 'darl' else 'blob store'} status unavailable: {view[who + '_error']}")
    quiet = [] if loud else ["no delta excluded, no DARL commit refused, no block lost, nothing quarantined"]
    return loud, quiet


# ---------------------------------------------------------------- plots (inline SVG)

def nice_ticks(lo, hi, n=5):
    """About n round numbers (1, 2, 2.5 or 5 x 10^k apart) covering [lo, hi]."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return [0.0]
    if hi <= lo:
        lo, hi = lo - (abs(lo) or 1) * 0.5, hi + (abs(hi) or 1) * 0.5
    raw = (hi - lo) / max(1, n)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.floor(lo / step + 1e-9) * step
    out = [round(first, 12)]
    while out[-1] < hi - step * 1e-9:
        out.append(round(first + len(out) * step, 12))
    return out if len(out) > 1 else [out[0], round(out[0] + step, 12)]


TIME_STEPS = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400,
              172800, 604800)


def time_ticks(lo, hi, n=5):
    raw = (hi - lo) / max(1, n) or 1
    step = next((s for s in TIME_STEPS if s >= raw), TIME_STEPS[-1])
    first = math.floor(lo / step) * step
    out = [first + k * step for k in range(int(math.ceil((hi - first) / step - 1e-9)) + 1)]
    return out if len(out) > 1 else [first, first + step]     # two at least, hi == lo included


def time_label(t, span):
    return utc(t, "%H:%M:%S" if span < 600 else ("%H:%M" if span < 2 * 86400 else "%m-%d %H:%M"))


def decimate(points, buckets):
    """At most ~2*buckets points: per bucket of x, the lowest and the highest y in x order
    (a spike survives; the line's shape at the plot's resolution is unchanged)."""
    pts = [p for p in points if p[1] is not None and math.isfinite(p[1])]
    if len(pts) <= 2 * buckets:
        return pts
    x0, x1 = pts[0][0], pts[-1][0]
    width = (x1 - x0) / buckets or 1
    out, cur, key = [], [], None
    for p in pts:
        k = min(buckets - 1, int((p[0] - x0) / width))
        if k != key and cur:
            out.extend(_ends(cur))
            cur = []
        key = k
        cur.append(p)
    out.extend(_ends(cur))
    return out


def _ends(bucket):
    lo, hi = min(bucket, key=lambda p: p[1]), max(bucket, key=lambda p: p[1])
    return [lo] if lo is hi else sorted((lo, hi), key=lambda p: p[0])


def _legend(series, x, y, width):
    out, cx, cy = ['<g class="legend">'], x, y
    for s in series:
        w = 30 + 7 * len(s["label"])
        if cx + w > width and cx > x:
            cx, cy = x, cy + 16
        mark = (f'<circle cx="{cx + 9}" cy="{cy - 4}" r="3.5" fill="{s["color"]}"/>' if s.get("dots")
                else f'<line x1="{cx}" y1="{cy - 4}" x2="{cx + 18}" y2="{cy - 4}" stroke="{s["color"]}" '
                     f'stroke-width="2.5"/>')
        out.append(f'{mark}<text x="{cx + 23}" y="{cy}" font-size="12">{ESC(s["label"])}</text>')
        cx += w
    out.append("</g>")
    return "".join(out), cy - y


def line_plot(title, series, xlabel, ylabel, xfmt=None, time_x=False, width=PLOT_W, height=PLOT_H):
    """An SVG plot: `series` = [{"label", "color", "points": [(x, y)], "dots"?}]; axes with
    ticks, tick labels and unit-bearing labels; the legend in a row above the plot area."""
    series = [dict(s, points=decimate(sorted(s["points"]), (width - 90) // 2)) for s in series]
    series = [s for s in series if s["points"]]
    desc = f"{title}: " + ("; ".join(f"{s['label']} {len(s['points'])} points" for s in series) or "no data yet")
    head = (f'<svg class="plot" viewBox="0 0 {width} {height}" width="100%" role="img" '
            f'xmlns="http://www.w3.org/2000/svg" preserveAspectRatio="xMidYMid meet"><title>{ESC(desc)}</title>'
            f'<text x="8" y="16" font-size="14" font-weight="bold">{ESC(title)}</text>')
    if not series:
        return head + f'<text x="8" y="50" font-size="13">no data yet</text></svg>'
    legend, extra = _legend(series, 64, 34, width - 10)
    left, right, top, bottom = 64, width - 14, 44 + extra, height - 44
    xs = [p[0] for s in series for p in s["points"]]
    ys = [p[1] for s in series for p in s["points"]]
    xt = time_ticks(min(xs), max(xs)) if time_x else nice_ticks(min(xs), max(xs), 6)
    yt = nice_ticks(min(ys), max(ys), 5)
    x0, x1, y0, y1 = min(xt[0], min(xs)), max(xt[-1], max(xs)), yt[0], yt[-1]
    xt = [t for t in xt if x0 <= t <= x1]
    X = lambda v: left + (v - x0) * (right - left) / ((x1 - x0) or 1)
    Y = lambda v: bottom - (v - y0) * (bottom - top) / ((y1 - y0) or 1)
    xfmt = xfmt or (lambda v: time_label(v, x1 - x0) if time_x else f"{v:g}")
    yfmt = lambda v: si(v) if abs(v) >= 1e4 else f"{v:.4g}"
    out = [head, legend, f'<rect x="{left}" y="{top}" width="{right - left}" height="{bottom - top}" '
                         f'fill="none" stroke="#999"/>']
    out.append('<g class="axis x">')
    for t in xt:
        out.append(f'<line class="grid" x1="{X(t):.1f}" y1="{top}" x2="{X(t):.1f}" y2="{bottom}" stroke="#eee"/>'
                   f'<line class="tick" x1="{X(t):.1f}" y1="{bottom}" x2="{X(t):.1f}" y2="{bottom + 5}" '
                   f'stroke="#333"/><text class="tick-label" x="{X(t):.1f}" y="{bottom + 18}" font-size="12" '
                   f'text-anchor="{_anchor(X(t), width)}">{ESC(xfmt(t))}</text>')
    out.append(f'<text class="axis-label" x="{(left + right) / 2:.0f}" y="{height - 8}" font-size="13" '
               f'text-anchor="middle">{ESC(xlabel)}</text></g><g class="axis y">')
    for t in yt:
        out.append(f'<line class="grid" x1="{left}" y1="{Y(t):.1f}" x2="{right}" y2="{Y(t):.1f}" stroke="#eee"/>'
                   f'<line class="tick" x1="{left - 5}" y1="{Y(t):.1f}" x2="{left}" y2="{Y(t):.1f}" '
                   f'stroke="#333"/><text class="tick-label" x="{left - 8}" y="{Y(t) + 4:.1f}" font-size="12" '
                   f'text-anchor="end">{ESC(yfmt(t))}</text>')
    out.append(f'<text class="axis-label" x="14" y="{(top + bottom) / 2:.0f}" font-size="13" text-anchor="middle" '
               f'transform="rotate(-90 14 {(top + bottom) / 2:.0f})">{ESC(ylabel)}</text></g>')
    for s in series:
        pts = [(X(x), Y(y)) for x, y in s["points"]]
        if s.get("dots") or len(pts) == 1:
            out.append(f'<g class="series" fill="{s["color"]}">' + "".join(
                f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3"/>' for x, y in pts) + "</g>")
        else:
            out.append(f'<polyline class="series" fill="none" stroke="{s["color"]}" stroke-width="2" points="'
                       + " ".join(f"{x:.1f},{y:.1f}" for x, y in pts) + '"/>')
    out.append("</svg>")
    return "".join(out)


def _anchor(x, width):
    """A tick label near the right edge ends at its tick, so it is not cut off."""
    return "end" if x > width - 40 else "middle"


def membership_spans(events, now):
    """{cluster: [(start, end)]} of live membership from join/leave/drop events."""
    spans, open_ = {}, {}
    for e in events:
        c = e.get("cluster")
        if e.get("event") == "join":
            open_.setdefault(c, e["t"])
        elif e.get("event") in ("leave", "drop") and c in open_:
            spans.setdefault(c, []).append((open_.pop(c), e["t"]))
    for c, t in open_.items():
        spans.setdefault(c, []).append((t, now))
    return spans


def membership_plot(events, rows, now, width=PLOT_W):
    """One lane per site against wall time: a bar while it was a member, a dot per merged delta."""
    spans = membership_spans(events, now)
    merged = {}
    for r in rows:
        for name in r["sites"]:
            if r.get("time"):
                merged.setdefault(name, []).append(r["time"])
    names = sorted(set(spans) | set(merged))
    title = "Site membership over time"
    if not names:
        return (f'<svg class="plot" viewBox="0 0 {width} 60" width="100%" xmlns="http://www.w3.org/2000/svg">'
                f'<title>{title}: no site yet</title><text x="8" y="16" font-size="14" font-weight="bold">{title}'
                '</text><text x="8" y="44" font-size="13">no site has joined yet</text></svg>')
    lane, left, right, top = 24, 110, width - 14, 50
    bottom = top + lane * len(names)
    height = bottom + 46
    ts = [a for s in spans.values() for a, _ in s] + [t for v in merged.values() for t in v] + [now]
    ticks = time_ticks(min(ts), max(now, max(ts)))
    t0, t1 = ticks[0], ticks[-1]    # the axis spans whole ticks, as line_plot's: a run of a few seconds
    #                                 could otherwise hold one tick or none between its ends
    X = lambda v: left + (v - t0) * (right - left) / ((t1 - t0) or 1)
    out = [f'<svg class="plot" viewBox="0 0 {width} {height}" width="100%" role="img" '
           f'xmlns="http://www.w3.org/2000/svg"><title>{title}: {len(names)} site(s)</title>'
           f'<text x="8" y="16" font-size="14" font-weight="bold">{title}</text>'
           f'<g class="legend"><rect x="{left}" y="27" width="18" height="9" fill="#7bc28f"/>'
           f'<text x="{left + 23}" y="36" font-size="12">member</text>'
           f'<circle cx="{left + 100}" cy="32" r="3.5" fill="#1f4e79"/>'
           f'<text x="{left + 108}" y="36" font-size="12">delta merged</text></g>'
           f'<rect x="{left}" y="{top}" width="{right - left}" height="{bottom - top}" fill="none" stroke="#999"/>']
    out.append('<g class="axis x">')
    for t in ticks:
        out.append(f'<line class="grid" x1="{X(t):.1f}" y1="{top}" x2="{X(t):.1f}" y2="{bottom}" stroke="#eee"/>'
                   f'<line class="tick" x1="{X(t):.1f}" y1="{bottom}" x2="{X(t):.1f}" y2="{bottom + 5}" '
                   f'stroke="#333"/><text class="tick-label" x="{X(t):.1f}" y="{bottom + 18}" font-size="12" '
                   f'text-anchor="{_anchor(X(t), width)}">{ESC(time_label(t, t1 - t0))}</text>')
    out.append(f'<text class="axis-label" x="{(left + right) / 2:.0f}" y="{height - 8}" font-size="13" '
               f'text-anchor="middle">wall time (UTC)</text></g><g class="axis y">')
    for i, name in enumerate(names):
        y = top + i * lane
        out.append(f'<text class="tick-label" x="{left - 8}" y="{y + 16}" font-size="12" text-anchor="end">'
                   f'{ESC(name)}</text>')
        for a, b in spans.get(name, ()):
            out.append(f'<rect x="{X(a):.1f}" y="{y + 5}" width="{max(1.5, X(b) - X(a)):.1f}" height="{lane - 10}" '
                       'fill="#7bc28f"/>')
        out.append("".join(f'<circle cx="{X(t):.1f}" cy="{y + lane / 2:.1f}" r="3" fill="#1f4e79"/>'
                           for t in _thin(merged.get(name, ()), right - left)))
    out.append("</g></svg>")
    return "".join(out)


def _thin(times, pixels):
    """At most one dot per 3 pixels' worth of time (the lane shows where, not how many)."""
    if len(times) <= pixels // 3:
        return list(times)
    step = len(times) / (pixels // 3)
    return [times[int(i * step)] for i in range(pixels // 3)]


# ---------------------------------------------------------------- the page

def plots(view):
    rows, st = view["rows"], view["status"]
    names = sorted({n for r in rows for n in r["sites"]})
    color = {n: PALETTE[(i + 2) % len(PALETTE)] for i, n in enumerate(names)}
    cum = {0: 0, **{r["round"]: r["cum_tokens"] for r in rows}}
    loss = [{"label": "train loss (token-weighted)", "color": PALETTE[0],
             "points": [(r["cum_tokens"], r["loss"]) for r in rows]}]
    loss += [{"label": f"held-out, {n}", "color": color[n], "dots": True,
              "points": sorted({(cum.get(s.get("heldout_round"), r["cum_tokens"]), s["heldout_loss"])
                                for r in rows for m, s in r["sites"].items()
                                if m == n and s.get("heldout_loss") is not None})} for n in names]
    tps = [{"label": n, "color": color[n], "points": [(r["time"], r["sites"][n]["tokens_per_s"]) for r in rows
                                                      if n in r["sites"] and r["sites"][n].get("tokens_per_s")]}
           for n in names]
    drift = [{"label": "mean", "color": PALETTE[0], "points": [(r["round"], r["drift_mean"]) for r in rows]},
             {"label": "max", "color": PALETTE[1], "points": [(r["round"], r["drift_max"]) for r in rows]}]
    return [line_plot("Loss against tokens", loss, "tokens merged into the global model", "loss (nats)", si),
            line_plot("Throughput per site", tps, "wall time (UTC)", "tokens/s", time_x=True),
            line_plot("Drift of each round's deltas", drift, "round", "|delta| / |theta|", lambda v: f"{v:g}"),
            membership_plot(st.get("events", ()), rows, view["now"])]


def _coverage_html(cov, darl_error):
    if cov is None:
        return f"<p>DARL: {ESC(darl_error or 'not configured (--darl)')}</p>"
    n = cov["num_blocks"] or 1
    parts = [("committed", "#2a7"), ("leased", "#f0b429"), ("quarantined", "#d62728"), ("free", "#ddd")]
    bar = "".join(f'<span class="seg" style="width:{100.0 * cov[k] / n:.3f}%;background:{c}" title="{k}"></span>'
                  for k, c in parts if cov[k])
    if cov["complete"]:
        eta = "every block committed: the corpus is covered"
    elif cov["eta_s"] is None:
        eta = "ETA unknown (no live site has committed yet)"
    else:
        eta = (f"ETA {duration(cov['eta_s'])} (about {utc(cov['eta_at'], '%Y-%m-%d %H:%M UTC')}) at "
               f"{cov['rate']:.3g} blocks/s, the live sites' measured commit rate")
    rows = "".join(f"<tr><td>{k}</td><td>{cov[k]:,}</td><td>{100.0 * cov[k] / n:.1f} %</td></tr>"
                   for k, _ in parts)
    return (f'<div class="bar" role="progressbar" aria-valuenow="{cov["pct"]:.1f}">{bar}</div>'
            f'<p class="big"><b>{cov["pct"]:.1f} %</b> of {cov["num_blocks"]:,} blocks committed; {ESC(eta)}</p>'
            f'<table><tr><th>blocks</th><th>count</th><th>share</th></tr>{rows}</table>')


def _sites_html(sites):
    if not sites:
        return "<p>no site yet</p>"
    head = ("<tr><th>site</th><th>member</th><th>deltas merged</th><th>tokens merged</th><th>tokens/s</th>"
            "<th>MFU</th><th>peak memory</th><th>train loss</th>"
            "<th>held-out loss</th><th>DARL blocks committed</th><th>blocks/s</th><th>blocks lost</th></tr>")
    body = []
    for name, t in sites.items():
        member = (f"yes ({t['heard_s_ago']:.0f} s ago, {'sent' if t.get('sent') else 'training'})"
                  if t.get("member") else "no")
        held = (f"{t['heldout_loss']:.4f} (theta of round {_round(t.get('heldout_round'))})"
                if t.get("heldout_loss") is not None else "-")
        body.append(f"<tr><td>{ESC(name)}</td><td>{member}</td><td>{t['deltas']}</td><td>{si(t['tokens'])}</td>"
                    f"<td>{si(t.get('tokens_per_s'))}</td>"
                    f"<td>{fmt(t.get('mfu'), '.1%', 'n/a (CPU)')}</td>"
                    f"<td>{fmt(t.get('peak_mem_gib'), '.2f')} GiB</td>"
                    f"<td>{fmt(t.get('loss'), '.4f')}</td><td>{held}</td>"
                    f"<td>{fmt(t.get('darl_committed'), ',')}</td><td>{fmt(t.get('blocks_per_s'), '.3g')}</td>"
                    f"<td{BAD if t.get('darl_lost') else ''}>{fmt(t.get('darl_lost'), 'd')}</td></tr>")
    return f"<table>{head}{''.join(body)}</table>"


def _auth_html(auth, now):
    """Per credential (--credentials): whose, its state, what it did last and when, what was
    refused (a key names it; the secret is never in the status)."""
    if not auth:
        return ""
    refused = {r["key"]: r for r in auth["refused"]}
    rows = []
    for c in auth["credentials"]:
        act, r = c.get("last_act") or {}, refused.pop(c["key"], None)
        rows.append(f"<tr><td>{ESC(c['name'])}</td><td>{ESC(c['key'])}</td><td>{ESC(c['role'])}</td>"
                    f"<td>{ESC(', '.join(c['clusters'] or ()) or '-')}</td>"
                    f"<td{BAD if c['state'] in ('revoked', 'ended') else ''}>{ESC(c['state'])}</td>"
                    f"<td>{ESC(_ago(act, now))}</td><td{BAD if r else ''}>{_refused(r)}</td></tr>")
    for r in refused.values():        # a bearer none of ours, the shared token refused as a site
        rows.append(f"<tr><td>{ESC(r['name'])}</td><td>{ESC(r['key'])}</td><td>-</td><td>-</td><td>-</td><td>-</td>"
                    f"<td{BAD}>{_refused(r)}</td></tr>")
    head = ("<tr><th>credential of</th><th>key</th><th>role</th><th>may act as</th><th>state</th>"
            "<th>last acted</th><th>refused</th></tr>")
    shared = "acts as any site" if auth["shared_acts_as_site"] else "no longer acts as a site"
    return (f"<h2>Credentials</h2><p class=\"note\">The shared token {shared}. Each server keeps its own "
            f"counts since it started; this is the aggregator's.</p><div class=\"scroll\"><table>{head}"
            f"{''.join(rows)}</table></div>")


def _ago(act, now):
    if not act:
        return "-"
    return f"{now - act['at']:.0f} s ago: {act['route']}" + (f" as {act['as']}" if act.get("as") else "")


def _refused(r):
    if not r:
        return "0"
    return ESC(f"{r['count']} ({r['last_5min']} in 5 min); last: {r['route']}: {r['why']}")


UTIL_HEAD = (("utilisation, last round", "inner training time / the site's whole previous cycle, as it reported "
                                         "(else its inner training time / the round's period)"),
             ("utilisation, whole run", "inner training time summed / round periods summed, over the rounds "
                                        "that merged its delta"),
             ("last phase: steps (ended by)", "inner steps of its latest merged delta's phase, and what ended it"),
             ("last step time", "seconds per inner step, as the site measured them in that phase"),
             ("waited, last round", "from its delta's arrival to the close of its latest merged round"),
             ("rounds waited", "rounds where it waited over a tenth of the round's period, of those with a "
                               "wait recorded"))


def _compute_html(sites):
    """Each site's compute utilisation and waits; the figures defined in a note under the table."""
    if not sites:
        return ""
    head = "<tr><th>site</th>" + "".join(f'<th title="{ESC(tip)}">{h}</th>' for h, tip in UTIL_HEAD) + "</tr>"
    body = []
    for name, t in sites.items():
        run = f"{fmt(t['util_run'], '.0%')} ({t['util_rounds']} rounds)" if t["util_run"] is not None else "-"
        steps = "-" if t.get("steps") is None else f"{t['steps']:.0f} ({ESC(t.get('ended_by') or '-')})"
        n, waits = t["waits"]["rounds"], len(t["waits"]["waits"])
        body.append(f"<tr><td>{ESC(name)}</td><td>{fmt(t.get('util_last'), '.0%')}</td><td>{run}</td>"
                    f"<td>{steps}</td><td>{_secs(t.get('step_s'), '.3g')}</td><td>{_secs(t.get('waited_s'))}</td>"
                    f"<td{BAD if waits > WAIT_ALARM_FRAC * n else ''}>{f'{waits} of {n}' if n else '-'}</td></tr>")
    note = ("<p class=\"note\">Utilisation, last round: the share of its cycle before (phase, round trip, wait) "
            "a site spent in inner training steps, as it reported with its latest merged delta; a site that "
            "reports none: that delta's inner training time over its round's period. Whole run: inner "
            "training time summed over the rounds that merged a delta of it (counted in brackets), over those "
            "rounds' periods summed. A round's period runs from the close of the round before to its own; the "
            "first round after the aggregator starts counts from its opening to its merge's end. Waited: from "
            f"its delta's arrival to the round's close; a round counts as waited in over {WAIT_FRAC:.0%} of its "
            "period. A figure an older site or aggregator did not record is shown as -.</p>")
    return f"<div class=\"scroll\"><table>{head}{''.join(body)}</table></div>{note}"


def _rounds_html(rows, last=20):
    if not rows:
        return "<p>no merged round yet</p>"
    head = ("<tr><th>round</th><th>merged at (UTC)</th><th>tokens</th><th>tokens so far</th><th>loss</th>"
            "<th>drift mean / max</th><th>wall</th><th>why it closed</th><th>sites</th><th>excluded / dropped</th></tr>")
    body = []
    for r in reversed(rows[-last:]):
        bad = "; ".join(f"{d['cluster']}: {d['why']}" for d in r["excluded"] + r["dropped"])
        body.append(f"<tr{BAD if bad else ''}><td>{r['round']}</td>"
                    f"<td>{utc(r['time'], '%H:%M:%S') if r.get('time') else '-'}</td>"
                    f"<td>{r['tokens']:,}</td><td>{r['cum_tokens']:,}</td><td>{fmt(r['loss'], '.4f')}</td>"
                    f"<td>{fmt(r['drift_mean'], '.4f')} / {fmt(r['drift_max'], '.4f')}</td>"
                    f"<td>{fmt(r.get('wall_s'), '.0f')} s</td><td>{ESC(str(r.get('reason') or '-'))}</td>"
                    f"<td>{ESC(', '.join(sorted(r['sites'])))}</td><td>{ESC(bad)}</td></tr>")
    more = f"<p>{len(rows) - last} earlier round(s) are in the plots and in rounds.jsonl.</p>" if len(rows) > last else ""
    return f"<table>{head}{''.join(body)}</table>{more}"


EXCHANGE_STAGES = (("accepted_s", "accepted"), ("closed_s", "round closed"), ("merge_start_s", "merge began"),
                   ("offered_s", "first update bytes offered"), ("merged_s", "merged"), ("durable_s", "durable"))


def _exchange_html(rows):
    """The last round's exchange on one time line (fedmom_round.exchange), and when each site
    held that round's theta (reported with its next delta): which stage is the slowest."""
    have = [r for r in rows if r.get("exchange")]
    told = [r for r in have if any(x["round"] == r["round"] + 1 for x in rows)]   # its sites have reported
    last = (told or have or [None])[-1]
    if last is None:
        return ""
    ex, steps = last["exchange"], []
    for key, what in EXCHANGE_STAGES:
        if ex.get(key) is not None:
            steps.append(f"{what} +{ex[key]:.2f} s")
    held = [f"{n} +{ex['durable_s'] + s['held_lag_s']:.2f} s (its wait {fmt(s.get('exchange_wait_s'), '.1f')} s)"
            for r in rows if r["round"] == last["round"] + 1 for n, s in sorted(r["sites"].items())
            if s.get("exchange_round") == last["round"] and s.get("held_lag_s") is not None
            and ex.get("durable_s") is not None]
    line = (f"Exchange of round {last['round']}, from the last delta's last byte: {'; '.join(steps)}"
            f"{'; held by ' + ', '.join(held) if held else ' (the sites report when they held it with their next delta)'}.")
    return f"<p>{ESC(line)}</p>"


def _disk_html(view):
    d, b = view["disk"], view["blob"]
    out = [f"<tr><td>aggregator state</td><td>{nbytes(d['state_bytes'])}</td>"
           f"<td>{nbytes(d['state_free_bytes'])} free on its file system</td></tr>"]
    if b:
        quota = f"quota {nbytes(b['quota_bytes'])}" if b.get("quota_bytes") else "no quota"
        out.append(f"<tr><td>blob store</td><td>{nbytes(b['used_bytes'])}</td><td>{quota}; {b['blobs']} blob(s), "
                   f"{b['uploads']} upload(s) unfinished</td></tr>")
    elif view.get("blob_error"):
        out.append(f"<tr><td>blob store</td><td>-</td><td>{ESC(view['blob_error'])}</td></tr>")
    return ("<table><tr><th>what</th><th>used</th><th></th></tr>" + "".join(out) + "</table>"
            + _kept_html(view["status"].get("retention")))


def _kept_html(ret):
    """What the aggregator keeps and why: its state dir files, and its blobs in the store
    (fedmom_state.blob_plan; ids and round numbers only, no path)."""
    if not ret:
        return ""
    rows = [("state dir", f["file"], f["bytes"], f["why"]) for f in ret.get("state", ())]
    b = ret.get("blobs")
    if b:
        rows += [("blob store", k["blob"], k["bytes"], k["why"]) for k in b.get("kept", ())]
    body = "".join(f"<tr><td>{ESC(w)}</td><td>{ESC(n.rsplit('/', 1)[-1])}</td><td>{nbytes(x)}</td><td>{ESC(y)}</td></tr>"
                   for w, n, x, y in rows)
    note = ""
    if b:
        swept = "not swept yet" if b.get("swept_round") is None else f"as of the sweep at round {b['swept_round']}"
        note = (f"<p>Blob retention: --keep-rounds {b.get('keep_rounds')} ({swept}); {b.get('deleted', 0)} blob(s) "
                "deleted by this process.</p>")
    return ("<table><tr><th>kept in</th><th>file</th><th>size</th><th>why</th></tr>" + body + "</table>" + note)


CSS = """body{font-family:sans-serif;margin:1em;max-width:110em;color:#111}
h1{font-size:1.4em;margin:.2em 0} h2{font-size:1.15em;margin:1.2em 0 .4em}
table{border-collapse:collapse;margin:.3em 0} td,th{padding:2px 8px;text-align:left;vertical-align:top}
tr:nth-child(even){background:#f4f4f4} .scroll{overflow-x:auto} .scroll td{white-space:nowrap}
.plots{display:grid;grid-template-columns:repeat(auto-fill,minmax(min(100%,32em),1fr));gap:1em}
.plots figure{margin:0;border:1px solid #ddd;padding:.3em}
.bar{display:flex;height:1.4em;border:1px solid #888;background:#ddd;max-width:60em}
.bar .seg{display:block;height:100%} .big{font-size:1.1em}
.alarm{border:3px solid #c00;background:#fee;color:#900;padding:.5em 1em;font-weight:bold}
.warn{border:3px solid #c60;background:#fff3e0;color:#7a3c00;padding:.5em 1em;font-weight:bold}
.ok{border:1px solid #2a7;background:#efe;padding:.3em 1em} .bad{color:#b00;font-weight:bold}
.note{color:#444;font-size:.9em;max-width:60em}
.stamp{color:#555}"""


def render(view):
    """The whole page, from Page.view()'s dict (or a test's)."""
    st, rows, now = view["status"], view["rows"], view["now"]
    cov = coverage(view["darl"], now)
    loud, quiet = alarms(view, cov)
    sites = site_table(rows, st, view["darl"])
    waits = wait_lines(sites)
    if view["saved"]:
        stamp = f"Saved copy, captured {utc(now)}; it does not refresh."
        refresh = ""
    else:
        stamp = f"Live page, rendered {utc(now)}; it reloads every {REFRESH_S} s."
        refresh = f'<meta http-equiv="refresh" content="{REFRESH_S}">'
    held = [(_round(s.get("heldout_round", r["round"])), n, s["heldout_loss"]) for r in rows
            for n, s in r["sites"].items() if s.get("heldout_loss") is not None]
    summary = (f"round {st['round']}{' (merging)' if st.get('merging') else ''}; {len(rows)} merged round(s) "
               f"in the log, {si(rows[-1]['cum_tokens']) if rows else 0} tokens merged; "
               f"{len(st.get('members', ()))} live member(s); deltas waiting: "
               f"{ESC(', '.join(st.get('pending', ())) or 'none')}; DARL commits owed: {st.get('pending_commits', 0)}")
    cfg = st.get("config", {})
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">{refresh}
<link rel="icon" href="data:,"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>pww round {st['round']}{f" - {cov['pct']:.0f} % covered" if cov else ''}</title><style>{CSS}</style></head>
<body>
<h1>pww central VM: round {st['round']}</h1>
<p class="stamp">{ESC(stamp)}</p>
{''.join(f'<p class="alarm">{ESC(x)}</p>' for x in loud)}{''.join(f'<p class="warn">{ESC(x)}</p>' for x in waits)}
{''.join(f'<p class="ok">{ESC(x)}</p>' for x in quiet)}
<p>{summary}</p>
<p>{st.get('parameters', 0):,} parameters in {st.get('tensors', 0)} tensors; outer lr {cfg.get('outer_lr')},
momentum {cfg.get('outer_momentum')}; held-out loss: {_heldout_text(held)}</p>
<h2>Coverage of the corpus (DARL)</h2>
{_coverage_html(cov, view.get('darl_error'))}
<h2>Plots</h2>
<div class="plots">{''.join(f'<figure>{_spaced(p)}</figure>' for p in plots(view))}</div>
<h2>Sites</h2>
<div class="scroll">{_sites_html(sites)}</div>
{_compute_html(sites)}
{_auth_html(st.get('auth'), now)}
<h2>Last merged rounds</h2>
{_exchange_html(rows)}
<div class="scroll">{_rounds_html(rows)}</div>
<h2>Disk</h2>
{_disk_html(view)}
</body></html>
"""


def _secs(v, spec=None):
    """Seconds as text: 2.1 s, 0.012 s (a wait on loopback is milliseconds), 0.117 s with spec .3g."""
    if v is None:
        return "-"
    return f"{v:{spec or ('.1f' if v >= 0.95 else '.2g')}} s"


def _round(v):
    return "?" if v is None else f"{v:.0f}"


def _spaced(svg):
    """A space after each SVG text: a text browser (w3m, lynx) prints the labels of a plot
    as words ("0 1M 2M tokens"), not "01M2Mtokens"; SVG drops trailing spaces when drawing."""
    return svg.replace("</text>", " </text>")


def _heldout_text(held):
    if not held:
        return "not reported yet (a site sends it with its first delta, then every --eval-every phases)"
    (r0, n0, l0), (r1, n1, l1) = held[0], held[-1]
    return f"first {l0:.4f} ({ESC(n0)}, theta of round {r0}), last {l1:.4f} ({ESC(n1)}, theta of round {r1})"
