"""The ledger's web view: JSON endpoints over snapshots of every ledger context, and one page.

Read-only by construction: every ledger is opened with `read_only=True` (an SQLite store in ML
Metadata's READONLY mode, after Python's read-only SQLite checked it), and the app has only GET
routes. It reads the store from one background thread, which keeps a snapshot per context and
re-reads a context only when its newest execution (`BlockLedger.latest_change`) moved, and then
only what changed (`BlockLedger.changes`): the new grants and denials (append-only), the outcomes
recorded since, and the blocks they touched. Requests are
answered from the snapshots (paged tables, charts aggregated on the server), so a page over
10,000 blocks and 100,000 grants costs what one page of rows costs, not what the store holds.

Access: on a loopback address without a token the app answers only requests whose Host is a
loopback name (a web page cannot reach it by DNS rebinding); anywhere else it needs the token,
given as `Authorization: Bearer TOKEN`, or once as `/?token=TOKEN`, which sets an HttpOnly cookie.
The page builds its DOM with textContent only, and the Content-Security-Policy allows no inline
script: a name such as `<script>alert(1)</script>` is shown as text.
"""
from __future__ import annotations

import collections
import dataclasses
import datetime as dt
import hmac
import importlib.resources
import ipaddress
import json
import logging
import math
import socket
import threading
import time
from typing import Optional

import numpy as np
import uvicorn
from fastapi import FastAPI, HTTPException, Query, Request
from fastapi.responses import FileResponse, JSONResponse, RedirectResponse

from sage_tfx.sage_access.views import (block_row, describe_event, history, ledger_table,
                                        plot_bars)
from sage_tfx.sage_access.errors import BadRequest
from sage_tfx.sage_access.ledger import BlockLedger
from sage_tfx.sage_access.lineage import grant_outcome, ledger_contexts
from sage_tfx.sage_access.store import connect_read_only

log = logging.getLogger("sage_tfx.ledger_web")

REFRESH_SECONDS = 1.0
MAX_PAGE_ROWS = 500
TIMELINE_BUCKETS = 120
# The spent-budget chart draws at most this many lines (pipelines or front doors) besides the
# whole ledger's; the rest share one line.
MAX_TIMELINE_SERIES = 8
# The outcomes a history entry can have (lineage.grant_outcome's, and a denial's).
OUTCOMES = ("released", "failed", "interrupted", "incomplete", "unrecorded", "denied")
# How many execution ids back a refresh re-reads (see read_snapshot).
RECHECK_IDS = 256
TOKEN_COOKIE = "sage_tfx_ledger_token"
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
STATIC = importlib.resources.files("sage_tfx.sage_access.web") / "static"
# plotly.js's basic partial bundle (bar and scatter traces: all the page draws), 1.2 MB against the
# full bundle's 4.8 MB, pinned in web/package-lock.json and installed there by `make` (npm ci).
PLOTLY_PACKAGE = importlib.resources.files("sage_tfx.sage_access.web") / "node_modules" \
    / "plotly.js-basic-dist-min"
# No inline script and nothing from another origin; plotly sets inline styles on its SVG.
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; connect-src 'self'; "
                               "style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
                               "font-src 'self'; base-uri 'none'; form-action 'none'; "
                               "frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY"}


def chart_library() -> tuple[str, object]:
    """The address the page loads plotly.js from (versioned, so browsers may cache it for good)
    and the file served there; a clear error when `make` has not installed it."""
    try:
        version = json.loads((PLOTLY_PACKAGE / "package.json").read_text())["version"]
    except FileNotFoundError:
        raise RuntimeError(f"the ledger page's chart library is not installed ({PLOTLY_PACKAGE}): "
                           "run `make web` (npm ci in sage_access/web)") from None
    return f"/static/plotly-basic-{version}.min.js", PLOTLY_PACKAGE / "plotly-basic.min.js"


def is_loopback(host: str) -> bool:
    """Whether `host` (a name or address to bind) is only reachable from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """What the pages show of one ledger context, as read at `read_at` (ms since the epoch)."""
    mark: int  # BlockLedger.latest_change when read
    table: dict  # cli.ledger_table: the ledger's settings and every block, in arrival order
    grants: list  # grant_records, oldest first
    denials: list  # denial_records, oldest first
    history: list  # views.history: the grants and denials, oldest first
    outcomes: dict  # {outcome: how many history entries have it}
    bars: list  # cli.plot_bars of the blocks: at most 60 bars
    timeline: dict
    reservations: list
    read_at: int

    @property
    def last_grant(self) -> int:
        return self.grants[-1]["execution_id"] if self.grants else 0

    @property
    def last_denial(self) -> int:
        return self.denials[-1]["execution_id"] if self.denials else 0

    def summary(self) -> dict:
        blocks = self.table["blocks"]
        retired = sum(row["retired"] for row in blocks)
        return {"context": self.table["context"], "accounting": self.table["accounting"],
                "min_request_epsilon": self.table["min_request_epsilon"],
                "version": self.mark, "read_at_ms": self.read_at, "blocks": len(blocks),
                "live_blocks": len(blocks) - retired, "retired_blocks": retired,
                "grants": len(self.grants), "denials": len(self.denials),
                "outcomes": self.outcomes,
                "waiting_pipelines": self.table["waiting_pipelines"],
                "guarantee": self.table.get("guarantee")}


def timeline(grants: list[dict], accounting: str, buckets: int = TIMELINE_BUCKETS) -> dict:
    """Spent budget over time, in at most `buckets` equal intervals (`end_ms`: when each ends):
    per pipeline (or front door, for grants that name no pipeline), the epsilon its grants
    charged to the block they charged most (`series`), and over all grants, the epsilon spent
    on the ledger's most-charged block (`all`): what one record there has lost, adding up the
    grants' epsilons as basic composition does. One unit (epsilon), zero before the first
    grant. Failed and interrupted grants count (their budget is spent); grants that charged an
    RDP curve without an epsilon add nothing and are counted in `without_epsilon`. `axis` and
    `note` say in words what is shown (under rdp accounting, an upper bound)."""
    unpriced = sum(grant["epsilon"] is None for grant in grants)
    priced = sorted((grant for grant in grants if grant["epsilon"] is not None),
                    key=lambda grant: grant["time_ms"])  # MySQL may commit ids out of time order
    words = _timeline_words(accounting, unpriced)
    if not priced:
        return dict(words, bucket_ms=0, start_ms=None, end_ms=[], series=[], all=[],
                    without_epsilon=unpriced)
    first, last = priced[0]["time_ms"], priced[-1]["time_ms"]
    width = max(1000, math.ceil((last - first + 1) / buckets))
    count = (last - first) // width + 1
    # One charge per (grant, block), in time order: its line, block, epsilon and bucket.
    names, lines = np.unique([grant["pipeline"] or (
        f"{grant['front_door']} (no pipeline)" if grant["front_door"] else "(no pipeline)")
        for grant in priced], return_inverse=True)
    per_grant = [len(grant["blocks"]) for grant in priced]
    lines = np.repeat(lines, per_grant)
    block = np.unique([block for grant in priced for block in grant["blocks"]],
                      return_inverse=True)[1]
    epsilon = np.repeat([grant["epsilon"] for grant in priced], per_grant)
    bucket = np.repeat((np.array([grant["time_ms"] for grant in priced]) - first) // width,
                       per_grant)
    peaks = _running_peaks(lines, block, epsilon)
    finals = np.zeros(len(names))
    np.maximum.at(finals, lines, peaks)
    # Largest first; ties by name (rounded: the running sums carry float error of ~1e-15).
    order = sorted(range(len(names)), key=lambda line: (-round(finals[line], 9), names[line]))
    ranked = [str(names[line]) for line in order]
    position = np.empty(len(names), dtype=int)  # each line's row, largest first
    position[order] = np.minimum(np.arange(len(names)), MAX_TIMELINE_SERIES - 1)
    if len(ranked) > MAX_TIMELINE_SERIES:  # the largest lines, and one for all the others
        ranked[MAX_TIMELINE_SERIES - 1:] = [
            f"{len(ranked) - MAX_TIMELINE_SERIES + 1} other pipelines"]
        peaks = _running_peaks(position[lines], block, epsilon)
    values = np.zeros((len(ranked) + 1, count))  # the last row: all grants
    np.maximum.at(values, (position[lines], bucket), peaks)
    np.maximum.at(values[-1], bucket, _running_peaks(np.zeros_like(lines), block, epsilon))
    values = np.maximum.accumulate(values, axis=1)  # carried through quiet intervals
    return dict(words, bucket_ms=width, start_ms=first,
                end_ms=[first + (index + 1) * width for index in range(count)],
                series=[{"name": name, "values": values[index].tolist()}
                        for index, name in enumerate(ranked)],
                all=values[-1].tolist(), without_epsilon=unpriced)


def _running_peaks(lines: np.ndarray, blocks: np.ndarray, epsilons: np.ndarray) -> np.ndarray:
    """For charges (line, block, epsilon) in time order: after each, the most its line has
    charged any one block so far (a running maximum, per line, of running sums per block)."""
    # Running sums per (line, block): one cumulative sum over the charges grouped by pair,
    # minus the sum before each group.
    pairs = lines * (blocks.max() + 1) + blocks
    order = np.argsort(pairs, kind="stable")
    sums = np.cumsum(epsilons[order])
    starts = np.flatnonzero(np.r_[True, pairs[order][1:] != pairs[order][:-1]])
    before = (sums - epsilons[order])[starts]
    spent = np.empty_like(sums)
    spent[order] = sums - np.repeat(before, np.diff(np.r_[starts, len(sums)]))
    # Running maximum per line: lift each line above the one before (spent >= 0), so that one
    # maximum.accumulate over the lines in order carries nothing from one line into the next.
    order = np.argsort(lines, kind="stable")
    lift = lines[order] * (spent.max() + 1.0)
    peaks = np.empty_like(spent)
    peaks[order] = np.maximum.accumulate(spent[order] + lift) - lift
    return peaks


def _timeline_words(accounting: str, unpriced: int) -> dict:
    """The chart's axis title and note: what its numbers are, in words."""
    if accounting == "rdp":
        axis = "ε the grants were calibrated to, added up on the most-charged block"
        note = ("RDP accounting: each line adds up the ε its grants were calibrated to on the "
                "block they charged most, an upper bound; each block's Rényi filter guarantees "
                "at most its ε ceiling (see the blocks), which the lines may pass.")
    else:
        axis = "ε spent on the most-charged block"
        note = ("ε spent over time: per pipeline (or front door), on the block its grants "
                "charged most; 'all grants': the ledger's most-charged block, the ε one record "
                "there has lost (basic composition adds up the grants' ε).")
    note += " Failed and interrupted grants count: their budget is spent."
    if unpriced:
        note += (f" {unpriced} grant(s) charged an RDP curve without an ε and are not in the "
                 "lines.")
    return {"axis": axis, "note": note}


def reservations(table: dict) -> list[dict]:
    """Per pipeline holding reservations or waiting: the live blocks reserving for it and the
    budget they hold (in the ledger's unit), waiting pipelines first in their waiting order."""
    held: dict[str, dict] = {name: {"pipeline": name, "waiting": True, "blocks": 0,
                                    "reserved": 0.0, "delta_reserved": 0.0}
                             for name in table["waiting_pipelines"]}
    for row in table["blocks"]:
        if row["retired"]:
            continue
        budget = row["budget"]
        for name, value in budget["reserved"].items():
            entry = held.setdefault(name, {"pipeline": name, "waiting": False, "blocks": 0,
                                           "reserved": 0.0, "delta_reserved": 0.0})
            if value > 0:
                entry["blocks"] += 1
                entry["reserved"] += value
                entry["delta_reserved"] += budget.get("delta_reserved", {}).get(name, 0.0)
    return list(held.values())


def read_snapshot(ledger: BlockLedger, previous: Optional[Snapshot]) -> Snapshot:
    """A snapshot of `ledger`, reading only what changed since `previous`: the grants and
    denials recorded since (both append-only), the outcomes recorded since (on new or older
    grants), and the blocks those changes touched (all of them after a pipeline finished).
    Changes are re-read from RECHECK_IDS executions back, because an MLMD server with
    concurrent writers (MySQL) may commit a smaller id after a larger one."""
    mark = ledger.latest_change()
    if previous is None:
        grants, denials = ledger.grant_records(), ledger.denial_records()
        table = ledger_table(ledger)
    else:
        changes = ledger.changes(after=max(0, previous.mark - RECHECK_IDS))
        mark = max([mark] + [change["execution_id"] for change in changes])
        grants = _extended(previous.grants, ledger.grant_records(
            after=max(0, previous.last_grant - RECHECK_IDS)))
        grants = _with_outcomes(ledger, grants, {
            change["grant_id"] for change in changes if change["kind"] == "release_outcome"})
        denials = previous.denials
        if any(change["kind"] == "denial" for change in changes):
            denials = _extended(denials, ledger.denial_records(
                after=max(0, previous.last_denial - RECHECK_IDS)))
        try:
            table = _updated_table(ledger, previous.table, changes)
        except BadRequest:  # a block no longer under the id a change names (an edited store)
            table = ledger_table(ledger)
    entries = history(grants, denials)
    return Snapshot(mark=mark, table=table, grants=grants, denials=denials, history=entries,
                    outcomes=dict(collections.Counter(entry["outcome"] for entry in entries)),
                    bars=plot_bars(table["blocks"]),
                    timeline=timeline(grants, table["accounting"]),
                    reservations=reservations(table), read_at=int(time.time() * 1000))


def _extended(rows: list[dict], fresh: list[dict]) -> list[dict]:
    """`rows` (records oldest first by execution id) with the `fresh` ones it does not hold,
    in execution-id order (`fresh` were read from RECHECK_IDS back, see read_snapshot)."""
    known = {row["execution_id"] for row in rows[-RECHECK_IDS:]}
    extended = rows + [row for row in fresh if row["execution_id"] not in known]
    if any(extended[i]["execution_id"] > extended[i + 1]["execution_id"]
           for i in range(len(rows) - 1, len(extended) - 1)):
        extended.sort(key=lambda row: row["execution_id"])
    return extended


def _with_outcomes(ledger: BlockLedger, grants: list[dict], grant_ids: set) -> list[dict]:
    """`grants` with the outcomes of `grant_ids` read again (a release records its outcome
    after its grant: a grant read while computing was `incomplete`). Recent grants first: an
    outcome is usually recorded soon after its grant."""
    if not grant_ids:
        return grants
    outcomes = ledger.release_outcomes(grant_ids)
    grants, waiting = list(grants), set(grant_ids)
    for index in range(len(grants) - 1, -1, -1):
        grant = grants[index]
        if grant["grant_id"] in waiting:
            steps = outcomes.get(grant["grant_id"], {})
            grants[index] = dict(grant, steps=steps, outcome=grant_outcome(
                grant["split"], steps, grant["front_door"]))
            waiting.discard(grant["grant_id"])
            if not waiting:
                break
    return grants


def _updated_table(ledger: BlockLedger, table: dict, changes: list[dict]) -> dict:
    """`table` (a ledger_table) with the blocks `changes` touched read again."""
    if any(change["blocks"] is None for change in changes):
        return ledger_table(ledger)
    rows = list(table["blocks"])
    where = {row["id"]: index for index, row in enumerate(rows)}
    touched = list(dict.fromkeys(b for change in changes for b in change["blocks"]))
    for block in ledger.blocks(ids=touched):
        if block.block_id in where:
            rows[where[block.block_id]] = block_row(ledger, block)
        else:  # a new block: changes come in arrival order
            rows.append(block_row(ledger, block))
    return dict(table, blocks=rows, waiting_pipelines=ledger.waiting_pipelines())


class LedgerViews:
    """Snapshots of the ledger contexts of one store (all of them, or `only` one), kept fresh by
    `refresh`: a context is re-read when its ledger changed."""

    def __init__(self, store: str, only: Optional[str] = None):
        self.store = store
        self.only = only
        self._mlmd_lock = threading.Lock()  # one ML Metadata call at a time
        self._ledgers: dict[str, BlockLedger] = {}
        self._snapshots: dict[str, Snapshot] = {}
        self.error: Optional[str] = None
        self._contexts = connect_read_only(store)
        if only is not None:
            self._ledgers[only] = BlockLedger(store, only, read_only=True)
        self.refresh()

    def refresh(self) -> None:
        """Read what changed since the last refresh. A store that fails keeps the last snapshots
        and sets `error` (the page shows it) until a refresh succeeds."""
        try:
            with self._mlmd_lock:
                names = [self.only] if self.only else ledger_contexts(self._contexts)
                for name in names:
                    if name not in self._ledgers:
                        self._ledgers[name] = BlockLedger(self.store, name, read_only=True)
                    ledger, previous = self._ledgers[name], self._snapshots.get(name)
                    if previous is None or ledger.latest_change() != previous.mark:
                        self._snapshots[name] = read_snapshot(ledger, previous)
            self.error = None
        except Exception as error:  # the last snapshots stay readable
            self.error = f"{type(error).__name__}: {(str(error).splitlines() or [''])[0]}"
            log.warning("ledger web: reading %s failed: %s", self.store, self.error)

    def contexts(self) -> list[str]:
        return sorted(self._snapshots)

    def snapshot(self, context: str) -> Snapshot:
        found = self._snapshots.get(context)
        if found is None:
            raise HTTPException(404, f"no ledger context {context!r} in this store")
        return found

    def ledger(self, context: str) -> BlockLedger:
        """The read-only ledger this view reads `context` from."""
        self.snapshot(context)
        return self._ledgers[context]

    def grant_run(self, context: str, grant_id: str) -> dict:
        ledger = self.ledger(context)
        try:
            with self._mlmd_lock:
                return ledger.grant_run(grant_id)
        except BadRequest as error:
            raise HTTPException(404, str(error)) from None


class Refresher:
    """Calls `views.refresh()` every `seconds` on a daemon thread until stopped."""

    def __init__(self, views: LedgerViews, seconds: float = REFRESH_SECONDS):
        self._views, self._seconds = views, seconds
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ledger-web-refresh", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self._seconds):
            self._views.refresh()


def _page(rows: list, offset: int, limit: int) -> dict:
    return {"total": len(rows), "offset": offset, "limit": limit,
            "rows": rows[offset:offset + limit]}


def _history_row(entry: dict) -> dict:
    """A grant or denial as the grants endpoint gives it: the record, its time in words
    (`moment`), and for a grant its `steps` as a list, each with its split fraction (exact),
    its recorded DP event in words and what became of it (outcome, reason, artifacts...)."""
    moment = dt.datetime.fromtimestamp(entry["time_ms"] / 1000, tz=dt.timezone.utc).strftime(
        "%Y-%m-%d %H:%M:%S UTC")
    if entry["kind"] == "denial":
        return dict(entry, moment=moment)
    events, outcomes, split = entry["events"] or {}, entry["steps"], entry["split"] or {}
    steps = [dict({"outcome": None, "front_door": None, "reason": None, "guarantee": None,
                   "artifacts": []}, **outcomes.get(step, {}), step=step,
                  fraction=split.get(step),
                  event=describe_event(events[step]) if step in events else None)
             for step in list(split) + [step for step in outcomes if step not in split]]
    return dict(entry, moment=moment, steps=steps)


def create_app(views: LedgerViews, token: Optional[str] = None,
               refresh_seconds: Optional[float] = REFRESH_SECONDS) -> FastAPI:
    """The web app over `views`. With `token`, every request must carry it; without, only
    requests addressed to a loopback name are answered (bind it to a loopback address).
    `refresh_seconds=None` leaves refreshing to the caller."""
    refresher = Refresher(views, refresh_seconds) if refresh_seconds else None
    plotly_path, plotly_file = chart_library()

    async def lifespan(_app):
        if refresher:
            refresher.start()
        yield
        if refresher:
            refresher.stop()

    app = FastAPI(title="sage-tfx ledger", version="1", lifespan=lifespan,
                  description="Read-only JSON view of a sage-tfx privacy-budget ledger: every "
                              "route is GET, every number as the ledger recorded it.",
                  docs_url=None, redoc_url=None)  # their pages load assets from a CDN

    @app.middleware("http")
    async def guard(request: Request, call_next):
        if request.method not in ("GET", "HEAD"):
            return JSONResponse({"detail": "read-only: only GET"}, 405,
                                headers={"Allow": "GET, HEAD"})
        if token is None:
            host = (request.headers.get("host") or "").rsplit(":", 1)[0].strip("[]")
            if host not in LOOPBACK_NAMES:
                return JSONResponse({"detail": f"host {host!r} refused: without a token this "
                                               "server answers loopback names only"}, 403)
            response = await call_next(request)
        else:
            given = request.query_params.get("token")
            if given is not None and request.url.path == "/":
                if not hmac.compare_digest(given.encode(), token.encode()):
                    return JSONResponse({"detail": "wrong token"}, 401)
                response = RedirectResponse("/", 303)  # drop the token from the address bar
                response.set_cookie(TOKEN_COOKIE, token, httponly=True, samesite="strict")
            else:
                header = request.headers.get("authorization", "")
                given = header[len("Bearer "):] if header.startswith("Bearer ") \
                    else request.cookies.get(TOKEN_COOKIE, "")
                if not hmac.compare_digest(given.encode(), token.encode()):
                    return JSONResponse({"detail": "a token is required: Authorization: Bearer "
                                                   "TOKEN, or open /?token=TOKEN once"}, 401,
                                        headers={"WWW-Authenticate": "Bearer"})
                response = await call_next(request)
        response.headers.update(SECURITY_HEADERS)
        if request.url.path.startswith("/api/"):
            response.headers["Cache-Control"] = "no-store"
        return response

    @app.get("/", include_in_schema=False)
    def index():
        return FileResponse(STATIC / "index.html", media_type="text/html")

    @app.get("/static/{name}", include_in_schema=False)
    def static(name: str):
        if name == plotly_path.rsplit("/", 1)[1]:
            return FileResponse(plotly_file, media_type="text/javascript",
                                headers={"Cache-Control": "max-age=86400, immutable"})
        if name not in ("ledger.js", "ledger.css"):
            raise HTTPException(404, "no such file")
        return FileResponse(STATIC / name, media_type="text/javascript"
                            if name.endswith(".js") else "text/css")

    @app.get("/api/contexts", summary="The ledger contexts with their counts")
    def contexts() -> dict:
        """Every ledger context in the store (or the one `--context` named) and its summary;
        `error` is set while the store cannot be read (the data is then the last read)."""
        return {"error": views.error, "plotly": plotly_path,
                "contexts": [views.snapshot(name).summary() for name in views.contexts()]}

    @app.get("/api/contexts/{context}", summary="One context's summary and version")
    def summary(context: str) -> dict:
        """Settings and counts of one context. `version` changes whenever the ledger does (a
        grant, a block, a pipeline registered or finished): poll it to know when to re-read."""
        return dict(views.snapshot(context).summary(), error=views.error)

    @app.get("/api/contexts/{context}/blocks", summary="Blocks, paged")
    def blocks(context: str, state: str = Query("all", pattern="^(all|live|retired)$"),
               offset: int = Query(0, ge=0), limit: int = Query(100, ge=1, le=MAX_PAGE_ROWS)
               ) -> dict:
        """Blocks in arrival order: id, epsilon and delta ceilings, spent (`epsilon_spent`,
        `delta_spent` on basic ledgers; `guarantee_*` on both), `budget` (spent, reserved per
        pipeline, free, in its `unit`), charges, state. `total` counts the rows of `state`."""
        rows = views.snapshot(context).table["blocks"]
        if state != "all":
            rows = [row for row in rows if row["retired"] == (state == "retired")]
        return _page(rows, offset, limit)

    @app.get("/api/contexts/{context}/chart", summary="Spent, reserved and free per block")
    def chart(context: str) -> dict:
        """At most 60 bars: one per block, or per group of consecutive blocks (their mean)."""
        snapshot = views.snapshot(context)
        rows = snapshot.table["blocks"]
        return {"unit": rows[0]["budget"]["unit"] if rows else None,
                "blocks_per_bar": max(1, math.ceil(len(rows) / max(1, len(snapshot.bars)))),
                "bars": snapshot.bars}

    @app.get("/api/contexts/{context}/timeline", summary="Spent budget over time")
    def consumption(context: str) -> dict:
        """Epsilon spent over time on one axis from zero, per pipeline (or front door) and over
        all grants, at the end of each time bucket (at most 120): see `axis` and `note`."""
        return views.snapshot(context).timeline

    @app.get("/api/contexts/{context}/grants", summary="Grants and denials, newest first, paged")
    def grants(context: str, offset: int = Query(0, ge=0),
               limit: int = Query(50, ge=1, le=MAX_PAGE_ROWS),
               pipeline: Optional[str] = None,
               outcome: Optional[str] = Query(None, pattern=f"^({'|'.join(OUTCOMES)})$")
               ) -> dict:
        """Every grant and every request denied for lack of budget (`kind` "grant" or
        "denial"), newest first: time, `outcome` (released, failed, interrupted, incomplete:
        no outcome yet or its process was killed, unrecorded: charged outside the release
        protocol; denied), `front_door`, `request` (its whole text), pipeline, epsilon, delta.
        A grant also has its run, blocks, RDP curve if any, and `steps`: the split among DP
        steps, each with its recorded dp-accounting event and what became of it (reason,
        artifacts). A denial has what each block that could not pay had `free`, and `reason`.
        `pipeline` and `outcome` keep the entries that have it."""
        rows = views.snapshot(context).history
        if pipeline is not None:
            rows = [row for row in rows if row["pipeline"] == pipeline]
        if outcome is not None:
            rows = [row for row in rows if row["outcome"] == outcome]
        page = _page(rows[::-1], offset, limit)
        page["rows"] = [_history_row(row) for row in page["rows"]]
        return page

    @app.get("/api/contexts/{context}/grants/{grant_id}/run",
             summary="The run that spent a grant and its artifacts")
    def grant_run(context: str, grant_id: str) -> dict:
        """The pipeline run contexts the grant is attributed to and every artifact they hold
        (model, statistics, examples ...): type, name, uri, state, time. Read from the store."""
        return views.grant_run(context, grant_id)

    @app.get("/api/contexts/{context}/reservations", summary="Waiting pipelines")
    def waiting(context: str) -> dict:
        """Each waiting pipeline (and any other holding reservations): how many live blocks
        reserve budget for it and how much (epsilon or capacity share; delta on basic)."""
        snapshot = views.snapshot(context)
        return {"waiting": snapshot.table["waiting_pipelines"],
                "pipelines": snapshot.reservations}

    return app


class BackgroundServer:
    """The app over `store` on 127.0.0.1 (a free port), served by uvicorn on a daemon thread of
    this process, as `sage-tfx ledger serve` serves it: for tests, benchmarks and notebooks."""

    def __init__(self, store: str, token: Optional[str] = None,
                 refresh_seconds: float = REFRESH_SECONDS, start_seconds: float = 30.0):
        self.views = LedgerViews(store)
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        self._server = uvicorn.Server(uvicorn.Config(
            create_app(self.views, token, refresh_seconds), log_level="warning"))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [listener]},
                                        name="ledger-web-server", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + start_seconds
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"the ledger web server did not start within {start_seconds} s")
            time.sleep(0.02)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
