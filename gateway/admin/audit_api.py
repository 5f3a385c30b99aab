"""Admin JSON routes over the audit store: list, one record, aggregates, JSONL export.

Times (``since``/``until``) are Unix seconds or ISO 8601; filters match exactly, the
same ones for the list and the export; an unknown query parameter is a 400.
"""

from __future__ import annotations

import math
import time
from datetime import datetime
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import BaseRoute, Route

from gateway.store import audit_queries
from gateway.store.db import Database

MAX_LIMIT = 1000
MAX_WINDOW = 90 * 86400.0


class BadParam(ValueError):
    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def _bad(err: BadParam) -> JSONResponse:
    body = {"error": {"type": "invalid_request_error", "code": "invalid_parameter",
                      "param": err.param, "message": str(err)}}
    return JSONResponse(body, status_code=400)


def _time(request: Request, name: str) -> float | None:
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return None
    try:
        return float(raw)
    except ValueError:
        pass
    try:
        return datetime.fromisoformat(raw.replace("Z", "+00:00")).timestamp()
    except ValueError:
        raise BadParam(name, f"{name} must be Unix seconds or an ISO 8601 time, got {raw!r}") from None


def _number(request: Request, name: str, default: float, low: float, high: float, integer: bool = True) -> Any:
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw) if integer else float(raw)
    except ValueError:
        raise BadParam(name, f"{name} must be a number, got {raw!r}") from None
    if not low <= value <= high:
        raise BadParam(name, f"{name} must be between {low:g} and {high:g}")
    return value


def _db(request: Request) -> Database:
    return request.app.state.db  # type: ignore[no-any-return]


#: What the list and the export filter on: the columns, any attempt's upstream name and the
#: managed client key (both read in the record), and the time range.
FILTERS = (*audit_queries.FILTER_COLUMNS, "upstream", "key_id")
#: The list's paging, on top of the filters.
PAGING = ("limit", "offset")


def _selection(request: Request, extra: tuple[str, ...] = ()) -> tuple[float | None, float | None, dict[str, str | None]]:
    """``since``, ``until`` and the exact-match filters, one parser for the list and the
    export; an unknown parameter is refused (a misspelt filter must not select everything)."""
    allowed = ("since", "until", *FILTERS, *extra)
    unknown = sorted(set(request.query_params) - set(allowed))
    if unknown:
        raise BadParam(unknown[0], f"unknown parameter {unknown[0]!r} (allowed: {', '.join(allowed)})")
    filters = {name: request.query_params.get(name) or None for name in FILTERS}
    return _time(request, "since"), _time(request, "until"), filters


async def list_audit(request: Request) -> Response:
    try:
        since, until, filters = _selection(request, PAGING)
        limit = _number(request, "limit", 100, 1, MAX_LIMIT)
        offset = _number(request, "offset", 0, 0, 10**9)
    except BadParam as err:
        return _bad(err)
    rows, total = await audit_queries.query(_db(request), since=since, until=until, limit=limit, offset=offset, **filters)
    return JSONResponse({
        "object": "list", "data": rows, "total": total, "limit": limit, "offset": offset,
        "has_more": offset + len(rows) < total,
    })


async def get_audit(request: Request) -> Response:
    request_id = request.path_params["request_id"]
    row = await audit_queries.get(_db(request), request_id)
    if row is None:
        body = {"error": {"type": "not_found_error", "code": "audit_not_found",
                          "message": f"no audit record {request_id!r}"}}
        return JSONResponse(body, status_code=404)
    return JSONResponse(row)


async def aggregate_audit(request: Request) -> Response:
    try:
        window = _number(request, "window", 3600.0, 1.0, MAX_WINDOW, integer=False)
    except BadParam as err:
        return _bad(err)
    return JSONResponse(await audit_queries.aggregate(_db(request), window))


MAX_BUCKETS = 1440
#: The charts' per-model and per-error-code series: the biggest ones, the rest as "other".
TOP_SERIES = 8


class _Cell:
    """One time bucket of one group: counts and the latencies to take percentiles of."""

    __slots__ = ("requests", "errors", "ttfb", "ttft", "duration", "busy")

    def __init__(self) -> None:
        self.busy = 0.0  # request-seconds spent inside this bucket (-> mean requests in flight)
        self.requests = 0
        self.errors = 0
        self.ttfb: list[float] = []
        self.ttft: list[float] = []
        self.duration: list[float] = []


def _bucketed(rows: list[tuple[Any, ...]], start: float, bucket: float, count: int, column: int) -> dict[str, Any]:
    """Per-bucket requests, errors, p50/p95 TTFB, TTFT and duration, and the mean number
    of requests in flight (each request's time spread over the buckets it spans), grouped
    by protocol (column 1), mode (column 2) or not at all (column -1: one group, "all")."""
    cells: dict[str, list[_Cell]] = {}
    if column < 0:
        cells["all"] = [_Cell() for _ in range(count)]
    for row in rows:
        started_at, protocol, mode, outcome, ttfb, ttft, duration = row[:7]
        key = "all" if column < 0 else str((protocol, mode)[column - 1])
        slots = cells.setdefault(key, [_Cell() for _ in range(count)])
        first = min(count - 1, max(0, int((started_at - start) // bucket)))
        cell = slots[first]
        if duration is not None:  # spread the request's time over the buckets it spans
            ends = started_at + float(duration) / 1000
            for i in range(first, count):
                low, high = start + i * bucket, start + (i + 1) * bucket
                if low >= ends:
                    break
                slots[i].busy += max(0.0, min(ends, high) - max(started_at, low))
        cell.requests += 1
        cell.errors += outcome == "error"
        for values, value in ((cell.ttfb, ttfb), (cell.ttft, ttft), (cell.duration, duration)):
            if value is not None:
                values.append(float(value))
    out: dict[str, Any] = {}
    for key, slots in sorted(cells.items()):
        requests, errors = sum(c.requests for c in slots), sum(c.errors for c in slots)
        group: dict[str, Any] = {
            "requests": [c.requests for c in slots], "errors": [c.errors for c in slots],
            "in_flight_mean": [c.busy / bucket for c in slots],
        }
        summary: dict[str, Any] = {
            "requests": requests, "errors": errors, "error_rate": errors / requests if requests else 0.0,
        }
        for name in ("ttfb", "ttft", "duration"):
            ordered = [sorted(getattr(c, name)) for c in slots]
            everything = sorted(v for t in ordered for v in t)
            for q in (50, 95):
                group[f"{name}_ms_p{q}"] = [audit_queries.percentile(t, q) for t in ordered]
                summary[f"{name}_ms_p{q}"] = audit_queries.percentile(everything, q)
        group["summary"] = summary  # the whole window
        out[key] = group
    return out


def _top(totals: dict[str, float]) -> set[str]:
    return {k for k, _ in sorted(totals.items(), key=lambda kv: (-kv[1], kv[0]))[:TOP_SERIES]}


def _by_model(rows: list[tuple[Any, ...]], start: float, bucket: float, count: int) -> dict[str, Any]:
    """Output tokens per second of each model (the biggest TOP_SERIES; the rest "other")."""
    totals: dict[str, float] = {}
    for row in rows:
        if row[9]:
            totals[str(row[8])] = totals.get(str(row[8]), 0) + float(row[9])
    top = _top(totals)
    series: dict[str, list[float]] = {}
    for row in rows:
        if not row[9]:
            continue
        key = str(row[8]) if str(row[8]) in top else "other"
        slots = series.setdefault(key, [0.0] * count)
        slots[min(count - 1, max(0, int((row[0] - start) // bucket)))] += float(row[9])
    return {
        model: {"output_tokens": slots, "tokens_per_second": [t / bucket for t in slots],
                "total_output_tokens": sum(slots)}
        for model, slots in sorted(series.items())
    }


def _by_error_code(rows: list[tuple[Any, ...]], start: float, bucket: float, count: int) -> dict[str, Any]:
    """Requests per bucket for each error code (the biggest TOP_SERIES; the rest "other")."""
    totals: dict[str, float] = {}
    for row in rows:
        if row[7]:
            totals[str(row[7])] = totals.get(str(row[7]), 0) + 1
    top = _top(totals)
    series: dict[str, list[int]] = {}
    for row in rows:
        if row[7]:
            key = str(row[7]) if str(row[7]) in top else "other"
            slots = series.setdefault(key, [0] * count)
            slots[min(count - 1, max(0, int((row[0] - start) // bucket)))] += 1
    return {code: {"requests": slots, "total": sum(slots)} for code, slots in sorted(series.items())}


def _by_upstream(rows: list[tuple[Any, ...]], start: float, bucket: float, count: int) -> dict[str, Any]:
    """Upstream attempts per bucket for each upstream, and those that failed (every attempt
    counts, failed-over ones included: that is the upstream's own health)."""
    series: dict[str, dict[str, list[int]]] = {}
    for row in rows:
        attempts = row[10]
        if isinstance(attempts, (str, bytes)):
            attempts = orjson.loads(attempts)
        for attempt in attempts or ():
            name = str(attempt.get("upstream") or "?")
            at = float(attempt.get("started_at") or row[0])
            slot = min(count - 1, max(0, int((at - start) // bucket)))
            entry = series.setdefault(name, {"requests": [0] * count, "errors": [0] * count})
            entry["requests"][slot] += 1
            entry["errors"][slot] += bool(attempt.get("error"))
    return {
        name: entry | {"total": sum(entry["requests"]), "total_errors": sum(entry["errors"])}
        for name, entry in sorted(series.items())
    }


async def timeseries_audit(request: Request) -> Response:
    """Counts, errors, TTFB/TTFT/duration percentiles per time bucket, overall, by protocol
    and by mode, plus output tokens/s by model and errors by code (the WebUI dashboard's
    charts). Buckets are aligned to multiples of ``bucket`` seconds."""
    try:
        window = _number(request, "window", 3600.0, 1.0, MAX_WINDOW, integer=False)
        bucket = _number(request, "bucket", 60.0, 1.0, MAX_WINDOW, integer=False)
    except BadParam as err:
        return _bad(err)
    count = math.ceil(window / bucket)
    if count > MAX_BUCKETS:
        return _bad(BadParam("bucket", f"window / bucket must be at most {MAX_BUCKETS} buckets"))
    end = math.floor(time.time() / bucket) * bucket + bucket
    start = end - count * bucket

    def run(conn: Any) -> list[tuple[Any, ...]]:  # SQL that runs on SQLite and PostgreSQL
        return conn.execute(
            "SELECT started_at, protocol, mode, outcome, json_extract(record, '$.ttfb_ms'),"
            " json_extract(record, '$.ttft_ms'), json_extract(record, '$.duration_ms'), error_code, model,"
            " json_extract(record, '$.usage.completion_tokens'), json_extract(record, '$.upstream_attempts')"
            " FROM audit WHERE started_at >= ? AND started_at < ?",
            (start, end),
        ).fetchall()

    rows = await _db(request).arun(run)
    return JSONResponse({
        "window": count * bucket,
        "bucket": bucket,
        "since": start,
        "until": end,
        "times": [start + i * bucket for i in range(count)],
        "total": _bucketed(rows, start, bucket, count, -1)["all"],
        "by_protocol": _bucketed(rows, start, bucket, count, 1),
        "by_mode": _bucketed(rows, start, bucket, count, 2),
        "by_model": _by_model(rows, start, bucket, count),
        "by_error_code": _by_error_code(rows, start, bucket, count),
        "by_upstream": _by_upstream(rows, start, bucket, count),
    })


async def export_audit(request: Request) -> Response:
    """Every record the list would select (same filters), as JSON lines, oldest first."""
    try:
        since, until, filters = _selection(request)
    except BadParam as err:
        return _bad(err)
    return StreamingResponse(
        audit_queries.export(_db(request), since, until, **filters),
        media_type="application/x-ndjson",
        headers={"content-disposition": 'attachment; filename="audit.jsonl"'},
    )


def audit_routes() -> list[BaseRoute]:
    # fixed paths before the {request_id} catch-all
    return [
        Route("/audit", list_audit, methods=["GET"]),
        Route("/audit/aggregate", aggregate_audit, methods=["GET"]),
        Route("/audit/timeseries", timeseries_audit, methods=["GET"]),
        Route("/audit/export", export_audit, methods=["GET"]),
        Route("/audit/{request_id}", get_audit, methods=["GET"]),
    ]
