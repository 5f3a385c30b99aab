"""``GET /admin/api/status``: what the gateway is doing now (the WebUI dashboard's live
numbers): in-flight requests, upstream credential health, the settings revision and stream
mode in force, tool-repair / budget-overflow counts from the audit store, whether /v1
needs a client key (``client_auth``), and this replica's id, capacity share and the live
replicas (``replica``)."""

from __future__ import annotations

import time
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from gateway.banner import client_auth
from gateway.rollout.facts import capture_facts
from gateway.routes import readiness
from gateway.store.replicas import standalone_status

MAX_WINDOW = 90 * 86400.0


def _window(request: Request) -> float | None:
    raw = request.query_params.get("window") or "3600"
    try:
        value = float(raw)
    except ValueError:
        return None
    return value if 1.0 <= value <= MAX_WINDOW else None


async def status(request: Request) -> Response:
    window = _window(request)
    if window is None:
        body = {"error": {"type": "invalid_request_error", "code": "invalid_parameter", "param": "window",
                          "message": f"window must be seconds between 1 and {MAX_WINDOW:g}"}}
        return JSONResponse(body, status_code=400)
    app = request.app
    live = app.state.live
    relay = app.state.relay
    current = live.current
    since = time.time() - window

    def counts(conn: Any) -> tuple[Any, ...]:  # SQL that runs on SQLite and PostgreSQL
        return conn.execute(
            "SELECT COUNT(*), COALESCE(SUM(json_array_length(record, '$.repairs')), 0),"
            " COALESCE(SUM(CASE WHEN json_array_length(record, '$.repairs') > 0 THEN 1 ELSE 0 END), 0),"
            " COALESCE(SUM(CASE WHEN json_extract(record, '$.budget_exceeded') THEN 1 ELSE 0 END), 0)"
            " FROM audit WHERE started_at >= ?",
            (since,),
        ).fetchone()

    requests, repairs, repaired_requests, overflows = await app.state.db.arun(counts)
    now = time.time()
    credentials = [c.public(now) for c in relay.pool.credentials]
    return JSONResponse({
        "time": now,
        "window": window,
        "in_flight": relay.in_flight,
        "in_flight_by_protocol": relay.in_flight_by("protocol"),
        "in_flight_by_mode": relay.in_flight_by("mode"),
        "max_concurrent": current.max_concurrent,  # over all replicas; this one's part: replica.max_concurrent_share
        "stream_mode": current.stream_mode.value,
        "revision": live.revision,
        "requests": int(requests),
        "tool_repairs": int(repairs),
        "requests_with_repairs": int(repaired_requests),
        "budget_overflows": int(overflows),
        "audit_queue_depth": app.state.observability.audit.depth,
        "credentials": credentials,
        "credentials_usable": sum(1 for c in credentials if not c["disabled"] and not c["cooldowns"]),
        "store": app.state.observability.durable.status(),  # writable? what waits in the spill journal
        "not_ready": readiness.reasons(app.state),
        # whether /v1 needs a key (any managed key ever created: yes, loopback included)
        "client_auth": client_auth(current, relay.keys.keys() if relay.keys is not None else ()).public(),
        "replica": _replica(app, current.max_concurrent, relay.in_flight),
        "capture": capture_facts(current, [c.upstream for c in relay.pool.credentials]),  # rollout capture: on?
    })


def _replica(app: Any, max_concurrent: int, in_flight: int) -> dict[str, Any]:
    """This replica's id and capacity share, and the live replicas (from memory: the last heartbeat)."""
    replication = getattr(app.state, "replication", None)
    if replication is None:
        return standalone_status(app.state.live.current.replica_id, max_concurrent, in_flight)
    return replication.status(max_concurrent)  # type: ignore[no-any-return]


def status_routes() -> list[BaseRoute]:
    return [Route("/status", status, methods=["GET"])]
