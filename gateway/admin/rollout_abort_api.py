"""``POST /admin/api/rollouts/{id}/abort`` (docs/capture.md "Abort"): freeze the rollout,
then end its calls running in this gateway with ``rollout_aborted``; their records say
``cancelled``. Oversampled GRPO groups are discarded this way at a step boundary.

The engines are told too: a call whose current attempt went to an upstream with an engine
API (``engine_api = "vllm"``) was sent with its own ``X-Request-Id``
(gateway/upstream/attempts.py); those ids go to that engine's ``POST /abort_requests``
(one request per engine, bounded), alongside the gateway closing the upstream streams. An
engine that fails or is late is named in the answer's ``engine_abort``, never a 500."""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from gateway.admin.rollouts_api import (
    WRITE_TIMEOUT,
    _invalid,
    _missing,
    _recorder,
    _rollout_id,
    _settle,
    _snapshot,
    write_frozen,
)
from gateway.engines.control import Engine, EngineControlError
from gateway.engines.fleet import engine_of
from gateway.rollout.recorder import aborted_error

#: Seconds between looks at whether the aborted calls have ended.
POLL_SECONDS = 0.01
#: Seconds one engine's ``/abort_requests`` may take.
ENGINE_ABORT_TIMEOUT = 5.0


def _running(request: Request, rollout_id: str) -> list[Any]:
    return [run for run in request.app.state.relay.running if run.rollout_id == rollout_id]


async def _ended(request: Request, runs: list[Any]) -> None:
    """Until every one of ``runs`` has reported (left the running set), bounded."""
    ids = {run.record.request_id for run in runs}
    try:
        async with asyncio.timeout(WRITE_TIMEOUT):
            while any(run.record.request_id in ids for run in request.app.state.relay.running):
                await asyncio.sleep(POLL_SECONDS)
    except TimeoutError:
        pass  # the snapshot then shows them as they are; the freeze holds


def _engine_requests(runs: list[Any], into: dict[tuple[str, str], tuple[Engine, list[str]]]) -> None:
    """The engine request ids of ``runs`` now (their current attempts at engine-API
    upstreams), added to ``into`` by engine (its name and root)."""
    for run in runs:
        current = getattr(run.attempts, "engine_request", None)
        if current is None:
            continue
        credential, request_id = current
        engine = engine_of(credential)
        ids = into.setdefault((engine.name, engine.root), (engine, []))[1]
        if request_id not in ids:
            ids.append(request_id)


async def _abort_in_engine(request: Request, engine: Engine, request_ids: list[str]) -> dict[str, Any]:
    """One engine's ``/abort_requests``: ``{upstream, ok, error?}``."""
    control = request.app.state.engines.control
    try:
        async with asyncio.timeout(ENGINE_ABORT_TIMEOUT):
            await control.abort_requests(engine, request_ids)
    except TimeoutError:
        return {"upstream": engine.name, "ok": False, "error": f"no answer within {ENGINE_ABORT_TIMEOUT:g} s"}
    except EngineControlError as exc:
        return {"upstream": engine.name, "ok": False, "error": str(exc)}
    return {"upstream": engine.name, "ok": True}


async def abort(request: Request) -> Response:
    rollout_id = _rollout_id(request)
    if rollout_id is None:
        return _invalid()
    recorder = _recorder(request)
    if not _running(request, rollout_id) and await recorder.read(rollout_id) is None:
        return _missing(rollout_id)
    failed = await write_frozen(request, rollout_id)  # first: no new call of it starts from now
    if failed is not None:
        return failed
    error = aborted_error(rollout_id)
    aborted: list[Any] = []
    told: list[asyncio.Task[dict[str, Any]]] = []
    for _ in range(2):  # a call past its frozen check but not yet running when we looked: a second pass
        runs = _running(request, rollout_id)
        engines: dict[tuple[str, str], tuple[Engine, list[str]]] = {}
        _engine_requests(runs, engines)  # before the runs end: their attempts forget them then
        for run in runs:
            run.abort(error)
        told += [asyncio.create_task(_abort_in_engine(request, engine, ids)) for engine, ids in engines.values()]
        aborted += runs
        await _ended(request, runs)
    engine_abort = list(await asyncio.gather(*told))
    await _settle(recorder)
    snap = await _snapshot(request, rollout_id)
    return JSONResponse({**(snap or {"rollout_id": rollout_id}),
                         "aborted": sorted({run.record.request_id for run in aborted}),
                         "engine_abort": engine_abort})


def rollout_abort_routes() -> list[BaseRoute]:
    return [Route("/rollouts/{rollout_id}/abort", abort, methods=["POST"])]
