"""Admin routes for a trainer's labels on a rollout (docs/capture.md "Rewards and groups"):
``POST /admin/api/rollouts/{id}/reward`` and ``POST /admin/api/rollouts/{id}/group``.
Both are upserts (idempotent by rollout and call), written in a worker thread, bounded."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from gateway.admin.common import BAD_BODY, NotAnObject, admin_error, json_object
from gateway.admin.rollouts_api import WRITE_TIMEOUT, _invalid, _missing, _recorder, _rollout_id
from gateway.rollout.labels import (
    GROUP_UPSERT,
    REWARD_UPSERT,
    BadLabel,
    Reward,
    check_group,
    group_row,
)


async def _body(request: Request) -> dict[str, Any] | JSONResponse:
    try:
        return await json_object(request)
    except NotAnObject:
        return admin_error(400, *BAD_BODY)


async def _upsert(request: Request, sql: str, row: tuple[Any, ...]) -> JSONResponse | None:
    """The row written (None), or the 503 to answer."""
    db = _recorder(request).db

    def write(conn: Any) -> None:
        conn.execute(sql, row)

    try:
        async with asyncio.timeout(WRITE_TIMEOUT):
            await asyncio.to_thread(db.run_tx, write)
    except (TimeoutError, *db.errors):
        return admin_error(503, "store_unavailable", "the store did not take the write; try again")
    return None


async def _labelled(request: Request, label: Callable[[str, dict[str, Any], list[dict[str, Any]]], Any]) -> Response:
    """The shared steps: a valid rollout id, a JSON object body, a rollout that exists."""
    rollout_id = _rollout_id(request)
    if rollout_id is None:
        return _invalid()
    body = await _body(request)
    if isinstance(body, JSONResponse):
        return body
    read = await _recorder(request).read(rollout_id)
    if read is None:
        return _missing(rollout_id)
    try:
        return await label(rollout_id, body, read[0])  # type: ignore[no-any-return]
    except BadLabel as err:
        return admin_error(400, "invalid_parameter", str(err), err.param)


async def reward(request: Request) -> Response:
    """``{"reward": number, "details": object?, "call_id": string?}``: the rollout's reward,
    or one call's; posting it again replaces it (one per rollout, one per call)."""

    async def label(rollout_id: str, body: dict[str, Any], calls: list[dict[str, Any]]) -> Response:
        parsed = Reward.parse(body)
        if parsed.call_id is not None and parsed.call_id not in {c.get("call_id") for c in calls}:
            return admin_error(404, "call_not_found", f"rollout {rollout_id!r} has no call {parsed.call_id!r}", "call_id")
        at = time.time()
        failed = await _upsert(request, REWARD_UPSERT, parsed.row(rollout_id, at))
        return failed or JSONResponse({"rollout_id": rollout_id, "call_id": parsed.call_id, "reward": parsed.reward,
                                       "details": parsed.details, "at": at})

    return await _labelled(request, label)


async def group(request: Request) -> Response:
    """``{"group_id": string}``: the rollout's group (the latest given wins)."""

    async def label(rollout_id: str, body: dict[str, Any], calls: list[dict[str, Any]]) -> Response:
        group_id = check_group(body.get("group_id"))
        failed = await _upsert(request, GROUP_UPSERT, group_row(rollout_id, group_id, time.time()))
        return failed or JSONResponse({"rollout_id": rollout_id, "group_id": group_id})

    return await _labelled(request, label)


def rollout_label_routes() -> list[BaseRoute]:
    return [
        Route("/rollouts/{rollout_id}/reward", reward, methods=["POST"]),
        Route("/rollouts/{rollout_id}/group", group, methods=["POST"]),
    ]
