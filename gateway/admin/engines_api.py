"""Admin JSON routes for weight sync (docs/weight-sync.md): ``GET /admin/api/engines``,
``POST /admin/api/engines/pause`` and ``POST /admin/api/engines/resume``, over the
``EngineFleet`` (gateway/engines/fleet.py)."""

from __future__ import annotations

import math

import structlog
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from gateway.admin.common import BAD_BODY, NotAnObject, admin_error, json_object
from gateway.engines.fleet import PAUSE_MODES, EngineFleet

log = structlog.get_logger("gateway.engines")

#: Seconds ``pause`` and ``resume`` wait for the engines unless the body says (at most
#: --engine-pause-max).
DEFAULT_TIMEOUT = 60.0


def _fleet(request: Request) -> EngineFleet:
    return request.app.state.engines  # type: ignore[no-any-return]


def _actor(request: Request) -> str:
    return str(request.scope.get("state", {}).get("admin_actor") or "admin")


def _timeout(payload: dict[str, object], most: float) -> float | None:
    raw = payload.get("timeout", min(DEFAULT_TIMEOUT, most))
    if isinstance(raw, bool) or not isinstance(raw, int | float) or not math.isfinite(raw) or not 0 < raw <= most:
        return None
    return float(raw)


async def _body(request: Request) -> dict[str, object] | Response:
    try:
        payload = await json_object(request)
    except NotAnObject:
        return admin_error(400, *BAD_BODY)
    if not _fleet(request).engines():
        return admin_error(409, "no_engines", "no upstream is configured with an engine API"
                           " (engine_api = \"vllm\" in --config, or --engine-api vllm)")
    return payload


async def list_engines(request: Request) -> Response:
    """Each engine's url, paused, weight version (asked now), calls in flight and held."""
    fleet = _fleet(request)
    return JSONResponse({"holding": fleet.hold.closed, "held": fleet.hold.held_total,
                         "engines": await fleet.status()})


async def pause(request: Request) -> Response:
    """Hold new calls, pause every engine; 200 once each reports paused, else 504."""
    payload = await _body(request)
    if isinstance(payload, Response):
        return payload
    mode = payload.get("mode", "keep")
    if mode not in PAUSE_MODES:
        return admin_error(400, "invalid_value", f"mode must be one of {', '.join(PAUSE_MODES)}", "mode")
    most = request.app.state.live.current.engine_pause_max
    timeout = _timeout(payload, most)
    if timeout is None:
        return admin_error(400, "invalid_value", f"timeout must be seconds above 0, at most {most:g}"
                           " (--engine-pause-max)", "timeout")
    fleet = _fleet(request)
    failed = await fleet.pause(str(mode), timeout)
    engines = [e.name for e in fleet.engines()]
    log.info("engines_paused", mode=mode, engines=engines, failed=failed, actor=_actor(request))
    if failed:
        return admin_error(504, "engines_not_paused", "engines that did not report paused: " + ", ".join(failed),
                           engines=failed, holding=True)
    return JSONResponse({"mode": mode, "engines": engines, "holding": True})


async def resume(request: Request) -> Response:
    """Set the weight version (optional), resume every engine, then release held calls."""
    payload = await _body(request)
    if isinstance(payload, Response):
        return payload
    version = payload.get("weight_version")
    if version is not None and (not isinstance(version, str) or not version or not version.isprintable()):
        return admin_error(400, "invalid_value", "weight_version must be a non-empty printable string", "weight_version")
    timeout = _timeout(payload, request.app.state.live.current.engine_pause_max)
    if timeout is None:
        return admin_error(400, "invalid_value", "timeout must be seconds above 0, at most --engine-pause-max", "timeout")
    fleet = _fleet(request)
    failed, released = await fleet.resume(version, timeout)
    engines = [e.name for e in fleet.engines()]
    log.info("engines_resumed", weight_version=version, engines=engines, failed=failed, released=released,
             actor=_actor(request))
    if failed:
        return admin_error(502, "engines_not_resumed", "engines that did not resume: " + ", ".join(failed),
                           engines=failed, released=released)
    return JSONResponse({"weight_version": version, "engines": engines, "released": released})


def engine_routes() -> list[BaseRoute]:
    return [
        Route("/engines", list_engines, methods=["GET"]),
        Route("/engines/pause", pause, methods=["POST"]),
        Route("/engines/resume", resume, methods=["POST"]),
    ]
