"""Readiness, apart from liveness: may this replica take traffic *now*?

``/healthz`` answers whether the process is alive (an orchestrator restarts it when not);
``/readyz`` whether a load balancer should send it requests.

Each reason says its ``impact``. ``unready`` (503): this replica cannot serve what it is
sent: starting or shutting down, no record can be kept (requests are refused with
``recording_unavailable``, unless ``--serve-unrecorded``), no upstream credential is
usable, every upstream pool connection is in use (or a request just waited for one in
vain), the event loop lags past ``--ready-max-loop-lag``. ``degraded`` (200, ``"status":
"degraded"`` with the reasons): it still serves generation requests, and only what needs
the store is affected: the store cannot write, rows wait in the spill journal, the audit
queue is near its bound. A store outage is the same on every replica that shares it: red
for it would take every replica out of the load balancer at once while they can still
answer (issue #40).
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.observability.loop_lag import HOLD as LAG_HOLD
from gateway.upstream.connections import POOL_EXHAUSTED_HOLD
from gateway.upstream.credential import ANY_MODEL

#: The audit queue counts as near its bound from this fraction of it.
QUEUE_NEAR_BOUND = 0.8


UNREADY, DEGRADED = "unready", "degraded"


def reasons(state: Any) -> list[dict[str, Any]]:
    """Why the app (``app.state``) is not fully ready, each with its ``impact``; empty when
    it is."""
    out: list[dict[str, Any]] = []
    if getattr(state, "shutting_down", False):
        out.append({"code": "shutting_down", "impact": UNREADY, "message": "the gateway is shutting down"})
    elif not getattr(state, "ready", False):
        out.append({"code": "starting", "impact": UNREADY, "message": "the gateway is starting"})
        return out
    obs = state.observability
    durable = obs.durable
    if not durable.store_writable:
        out.append({"code": "store_unwritable", "impact": DEGRADED,
                    "message": f"the store cannot write ({durable.store_error}); records go to the spill journal",
                    "since": durable.failing_since})
    if durable.spill_entries:
        out.append({"code": "spill_in_use", "impact": DEGRADED,
                    "message": f"{durable.spill_entries} row(s) wait in the spill journal",
                    "spill_entries": durable.spill_entries})
    live = getattr(state, "live", None)
    # requests are refused while no record can be kept, unless the operator chose to serve them
    unrecorded = DEGRADED if live is not None and live.current.serve_unrecorded else UNREADY
    journal = durable.journal
    if journal is not None and not journal.reserved:
        out.append({"code": "spill_not_reserved", "impact": unrecorded,
                    "message": f"the spill journal could not reserve its {journal.max_bytes} bytes"
                               f" ({journal.reserve_error or 'no space'})"})
    elif (why := durable.unrecordable()) is not None:
        out.append({"code": "recording_unavailable", "impact": unrecorded, "message": why})
    audit = obs.audit
    if audit.depth >= audit.max_queue * QUEUE_NEAR_BOUND:
        out.append({"code": "audit_queue_near_bound", "impact": DEGRADED,
                    "message": f"the audit queue holds {audit.depth} of {audit.max_queue} records"
                               " (past it, records go to the spill journal)"})
    pool = state.relay.pool
    now = pool.clock()
    usable = [c for c in pool.credentials if not c.disabled and not c.cooling_until(ANY_MODEL, now)]
    if not usable:
        out.append({"code": "no_usable_credential", "impact": UNREADY,
                    "message": f"none of the {len(pool.credentials)} upstream credential(s) is usable now"})
    upstream = getattr(state.relay, "upstream", None)
    if upstream is not None and upstream.pool_exhausted():
        out.append({"code": "upstream_pool_exhausted", "impact": UNREADY,
                    "message": f"{upstream.open_responses} of {upstream.max_connections} upstream connections in use,"
                               f" or a request found none free in the last {POOL_EXHAUSTED_HOLD:g} s"})
    loop_lag = getattr(state, "loop_lag", None)
    if loop_lag is not None and loop_lag.lagging():
        out.append({"code": "event_loop_lag", "impact": UNREADY,
                    "message": f"the event loop ran up to {loop_lag.worst_recent():.3f} s late"
                               f" (bound {loop_lag.bound:g} s) in the last {LAG_HOLD:g} s",
                    "lag_seconds": round(loop_lag.lag, 4)})
    return out


def status(found: list[dict[str, Any]]) -> tuple[str, int]:
    """``/readyz``'s status and HTTP status for these reasons."""
    if any(r["impact"] == UNREADY for r in found):
        return "not_ready", 503
    return ("degraded", 200) if found else ("ready", 200)


async def readyz(request: Request) -> Response:
    """``GET /readyz``: 200 ``{"status": "ready"}``; 200 ``"degraded"`` with the reasons
    while only what needs the store is affected; else 503 ``"not_ready"`` with them all."""
    found = reasons(request.app.state)
    name, code = status(found)
    return JSONResponse({"status": name, "reasons": found} if found else {"status": name}, status_code=code)
