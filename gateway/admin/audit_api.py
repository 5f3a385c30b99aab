"""Admin JSON routes over the audit store: list, one record, aggregates, JSONL export.

Times (``since``/``until``) are Unix seconds or ISO 8601; filters match exactly.
"""

from __future__ import annotations

import math
import time
from datetime import datetime
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import BaseRoute, Route

from gateway.store import audit
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


async def list_audit(request: Request) -> Response:
    try:
        since, until = _time(request, "since"), _time(request, "until")
        limit = _number(request, "limit", 100, 1, MAX_LIMIT)
        offset = _number(request, "offset", 0, 0, 10**9)
    except BadParam as err:
        return _bad(err)
    filters = {c: request.query_params.get(c) or None for c in audit.FILTER_COLUMNS}
    rows, total = await audit.query(_db(request), since=since, until=until, limit=limit, offset=offset, **filters)
    return JSONResponse({
        "object": "list", "data": rows, "total": total, "limit": limit, "offset": offset,
        "has_more": offset + len(rows) < total,
    })


async def get_audit(request: Request) -> Response:
    request_id = request.path_params["request_id"]
    row = await audit.get(_db(request), request_id)
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
    return JSONResponse(await audit.aggregate(_db(request), window))


MAX_BUCKETS = 1440


def _bucketed(rows: list[tuple[Any, ...]], start: float, bucket: float, count: int, column: int) -> dict[str, Any]:
    """Per-bucket requests, errors and p50/p95 TTFB, grouped by protocol (column 1),
    mode (column 2) or not at all (column -1: one group, "all")."""
    cells: dict[str, list[tuple[list[int], list[float]]]] = {}
    if column < 0:
        cells["all"] = [([0, 0], []) for _ in range(count)]
    for started_at, protocol, mode, outcome, ttfb in rows:
        key = "all" if column < 0 else str((protocol, mode)[column - 1])
        slots = cells.setdefault(key, [([0, 0], []) for _ in range(count)])
        counts, ttfbs = slots[min(count - 1, max(0, int((started_at - start) // bucket)))]
        counts[0] += 1
        counts[1] += outcome == "error"
        if ttfb is not None:
            ttfbs.append(float(ttfb))
    out: dict[str, Any] = {}
    for key, slots in sorted(cells.items()):
        ordered = [sorted(t) for _, t in slots]
        everything = sorted(v for t in ordered for v in t)
        requests, errors = sum(c[0] for c, _ in slots), sum(c[1] for c, _ in slots)
        out[key] = {
            "requests": [c[0] for c, _ in slots],
            "errors": [c[1] for c, _ in slots],
            "ttfb_ms_p50": [audit.percentile(t, 50) for t in ordered],
            "ttfb_ms_p95": [audit.percentile(t, 95) for t in ordered],
            "summary": {  # the whole window
                "requests": requests,
                "errors": errors,
                "error_rate": errors / requests if requests else 0.0,
                "ttfb_ms_p50": audit.percentile(everything, 50),
                "ttfb_ms_p95": audit.percentile(everything, 95),
            },
        }
    return out


async def timeseries_audit(request: Request) -> Response:
    """Counts, errors and TTFB percentiles per time bucket, overall, by protocol and by mode
    (the WebUI dashboard's charts). Buckets are aligned to multiples of ``bucket`` seconds."""
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
            "SELECT started_at, protocol, mode, outcome, json_extract(record, '$.ttfb_ms')"
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
    })


async def export_audit(request: Request) -> Response:
    try:
        since, until = _time(request, "since"), _time(request, "until")
    except BadParam as err:
        return _bad(err)
    return StreamingResponse(
        audit.export(_db(request), since, until),
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
