"""Admin routes over rollouts (docs/capture.md): list, one rollout's calls, its
trajectory, freeze, delete. Reading, ordering and the chain run in a worker thread."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from gateway.admin.audit_api import BadParam, _bad, _number, _time
from gateway.admin.common import admin_error
from gateway.rollout import owners
from gateway.rollout import store as rollout_store
from gateway.rollout.ids import VALID
from gateway.rollout.labels import BadLabel, check_group, load_labels
from gateway.rollout.recorder import RolloutRecorder

#: Seconds an admin write (freeze, delete) may wait on the store.
WRITE_TIMEOUT = 10.0


def _recorder(request: Request) -> RolloutRecorder:
    return request.app.state.relay.rollouts  # type: ignore[no-any-return]


def _rollout_id(request: Request) -> str | None:
    value = request.path_params["rollout_id"]
    return value if VALID.fullmatch(value) else None


def _invalid() -> JSONResponse:
    return admin_error(400, "invalid_rollout_id", "rollout ids are 1-128 of A-Z a-z 0-9 . _ : -", "rollout_id")


def _missing(rollout_id: str) -> JSONResponse:
    return admin_error(404, "rollout_not_found", f"no rollout {rollout_id!r}")


async def list_rollouts(request: Request) -> Response:
    try:
        since = _time(request, "since")
        limit = _number(request, "limit", 1000, 1, 10_000)
        group = request.query_params.get("group")
        if group is not None:
            check_group(group, "group")
    except BadParam as err:
        return _bad(err)
    except BadLabel as err:
        return _bad(BadParam(err.param, str(err)))
    db = _recorder(request).db
    def read(conn: Any) -> list[dict[str, Any]]:
        found = rollout_store.list_rollouts(conn, since, limit, group)
        held = owners.owners(conn)
        return [{**r, **owners.shown(held.get(r["rollout_id"]))} for r in found]

    return JSONResponse({"rollouts": await db.arun(read)})


async def _snapshot(request: Request, rollout_id: str) -> dict[str, Any] | None:
    read = await _recorder(request).read(rollout_id)
    if read is None:
        return None
    records, marks = read
    labels = await _recorder(request).db.arun(lambda conn: load_labels(conn, rollout_id))
    snap = await asyncio.to_thread(rollout_store.snapshot, records, marks, rollout_id)
    owner = await _recorder(request).db.arun(lambda conn: owners.owner_of(conn, rollout_id))
    return {**snap, **labels, **owners.shown(owner)}


async def get_rollout(request: Request) -> Response:
    rollout_id = _rollout_id(request)
    if rollout_id is None:
        return _invalid()
    snap = await _snapshot(request, rollout_id)
    return _missing(rollout_id) if snap is None else JSONResponse(snap)


async def get_trajectory(request: Request) -> Response:
    rollout_id = _rollout_id(request)
    if rollout_id is None:
        return _invalid()
    undelivered = request.query_params.get("undelivered") or "include"
    if undelivered not in ("include", "exclude"):
        return _bad(BadParam("undelivered", "undelivered must be include or exclude"))
    read = await _recorder(request).read(rollout_id)
    if read is None:
        return _missing(rollout_id)
    return JSONResponse(await asyncio.to_thread(
        rollout_store.trajectory, read[0], rollout_id, read[1], undelivered == "exclude"))


async def freeze(request: Request) -> Response:
    """Later calls for the rollout get 409 ``rollout_frozen``; answers the final snapshot."""
    rollout_id = _rollout_id(request)
    if rollout_id is None:
        return _invalid()
    recorder = _recorder(request)
    if await recorder.read(rollout_id) is None:
        return _missing(rollout_id)
    failed = await write_frozen(request, rollout_id)
    if failed is not None:
        return failed
    await _settle(recorder)
    snap = await _snapshot(request, rollout_id)
    return JSONResponse(snap)


async def write_frozen(request: Request, rollout_id: str) -> JSONResponse | None:
    """The ``frozen`` mark in the store (None), or the 503 to answer."""
    recorder = _recorder(request)
    row = rollout_store.mark_row(rollout_id, "frozen", time.time(), "frozen by " + str(
        request.scope.get("state", {}).get("admin_actor") or "admin"), "")
    try:
        async with asyncio.timeout(WRITE_TIMEOUT):
            await recorder.db.acall(recorder.db.run_tx, lambda conn: _upsert_mark(conn, row))
    except (TimeoutError, *recorder.db.errors):
        return admin_error(503, "store_unavailable", "the store did not take the freeze; try again")
    return None


def _upsert_mark(conn: Any, row: tuple[Any, ...]) -> None:
    conn.execute(rollout_store.MARK_UPSERT, row)


async def _settle(recorder: RolloutRecorder) -> None:
    """Calls that ended before the freeze: their background records first (bounded)."""
    if recorder._tasks:
        await asyncio.wait(set(recorder._tasks), timeout=WRITE_TIMEOUT)


async def delete(request: Request) -> Response:
    rollout_id = _rollout_id(request)
    if rollout_id is None:
        return _invalid()
    recorder = _recorder(request)
    read = await recorder.read(rollout_id)
    if read is None:
        return _missing(rollout_id)
    if not any(kind == "frozen" for kind, _, _ in read[1]):
        return admin_error(409, "rollout_not_frozen", "freeze the rollout before deleting it")

    now = time.time()

    def remove(conn: Any) -> None:
        rollout_store.delete_rollout(conn, rollout_id)
        owners.mark_deleted(conn, rollout_id, now)  # the id stays taken for a grace period

    try:
        async with asyncio.timeout(WRITE_TIMEOUT):
            await recorder.db.acall(recorder.db.run_tx, remove)
    except (TimeoutError, *recorder.db.errors):
        return admin_error(503, "store_unavailable", "the store did not take the delete; try again")
    recorder.forget(rollout_id)
    return Response(status_code=204)


def rollout_routes() -> list[BaseRoute]:
    return [
        Route("/rollouts", list_rollouts, methods=["GET"]),
        Route("/rollouts/{rollout_id}", get_rollout, methods=["GET"]),
        Route("/rollouts/{rollout_id}", delete, methods=["DELETE"]),
        Route("/rollouts/{rollout_id}/trajectory", get_trajectory, methods=["GET"]),
        Route("/rollouts/{rollout_id}/freeze", freeze, methods=["POST"]),
    ]
