"""Readiness, apart from liveness: may this replica take traffic *now*?

``/healthz`` answers whether the process is alive (an orchestrator restarts it when not);
``/readyz`` whether a load balancer should send it requests. It is 503 with every reason
while the store cannot write, rows wait in the spill journal, the journal's space is not
reserved or no record can be kept, the audit queue is near its bound, no upstream
credential is usable, every upstream pool connection is in use (or a request just waited
for one in vain), the event loop lags past ``--ready-max-loop-lag``, or the gateway is
starting or shutting down.
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


def reasons(state: Any) -> list[dict[str, Any]]:
    """Why the app (``app.state``) is not ready; empty when it is."""
    out: list[dict[str, Any]] = []
    if getattr(state, "shutting_down", False):
        out.append({"code": "shutting_down", "message": "the gateway is shutting down"})
    elif not getattr(state, "ready", False):
        out.append({"code": "starting", "message": "the gateway is starting"})
        return out
    obs = state.observability
    durable = obs.durable
    if not durable.store_writable:
        out.append({"code": "store_unwritable", "message": f"the store cannot write ({durable.store_error})",
                    "since": durable.failing_since})
    if durable.spill_entries:
        out.append({"code": "spill_in_use", "message": f"{durable.spill_entries} row(s) wait in the spill journal",
                    "spill_entries": durable.spill_entries})
    journal = durable.journal
    if journal is not None and not journal.reserved:
        out.append({"code": "spill_not_reserved",
                    "message": f"the spill journal could not reserve its {journal.max_bytes} bytes"
                               f" ({journal.reserve_error or 'no space'})"})
    elif (why := durable.unrecordable()) is not None:
        out.append({"code": "recording_unavailable", "message": why})
    audit = obs.audit
    if audit.depth >= audit.max_queue * QUEUE_NEAR_BOUND:
        out.append({"code": "audit_queue_near_bound",
                    "message": f"the audit queue holds {audit.depth} of {audit.max_queue} records"})
    pool = state.relay.pool
    now = pool.clock()
    usable = [c for c in pool.credentials if not c.disabled and not c.cooling_until(ANY_MODEL, now)]
    if not usable:
        out.append({"code": "no_usable_credential",
                    "message": f"none of the {len(pool.credentials)} upstream credential(s) is usable now"})
    upstream = getattr(state.relay, "upstream", None)
    if upstream is not None and upstream.pool_exhausted():
        out.append({"code": "upstream_pool_exhausted",
                    "message": f"{upstream.open_responses} of {upstream.max_connections} upstream connections in use,"
                               f" or a request found none free in the last {POOL_EXHAUSTED_HOLD:g} s"})
    loop_lag = getattr(state, "loop_lag", None)
    if loop_lag is not None and loop_lag.lagging():
        out.append({"code": "event_loop_lag",
                    "message": f"the event loop ran up to {loop_lag.worst_recent():.3f} s late"
                               f" (bound {loop_lag.bound:g} s) in the last {LAG_HOLD:g} s",
                    "lag_seconds": round(loop_lag.lag, 4)})
    return out


async def readyz(request: Request) -> Response:
    """``GET /readyz``: 200 ``{"status": "ready"}``, else 503 with the reasons."""
    found = reasons(request.app.state)
    if not found:
        return JSONResponse({"status": "ready"})
    return JSONResponse({"status": "not_ready", "reasons": found}, status_code=503)
