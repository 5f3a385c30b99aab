"""``POST /admin/api/rollouts/{id}/abort`` (docs/capture.md "Abort"): freeze the rollout,
then end its calls running in this gateway with ``rollout_aborted``; their records say
``cancelled``. Oversampled GRPO groups are discarded this way at a step boundary.

The engine's own abort (vLLM ``POST /abort_requests`` with the requests' ids) is not sent
yet: closing the upstream stream is what ends the generation on an engine that notices a
closed connection (vLLM and llama-server do)."""

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
from gateway.rollout.recorder import aborted_error

#: Seconds between looks at whether the aborted calls have ended.
POLL_SECONDS = 0.01


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
    for _ in range(2):  # a call past its frozen check but not yet running when we looked: a second pass
        runs = _running(request, rollout_id)
        for run in runs:
            run.abort(error)
        aborted += runs
        await _ended(request, runs)
    await _settle(recorder)
    snap = await _snapshot(request, rollout_id)
    return JSONResponse({**(snap or {"rollout_id": rollout_id}),
                         "aborted": sorted({run.record.request_id for run in aborted})})


def rollout_abort_routes() -> list[BaseRoute]:
    return [Route("/rollouts/{rollout_id}/abort", abort, methods=["POST"])]
