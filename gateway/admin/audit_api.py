"""Admin JSON routes over the audit store: list, one record, aggregates, JSONL export.

Times (``since``/``until``) are Unix seconds or ISO 8601; filters match exactly.
"""

from __future__ import annotations

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
        Route("/audit/export", export_audit, methods=["GET"]),
        Route("/audit/{request_id}", get_audit, methods=["GET"]),
    ]
