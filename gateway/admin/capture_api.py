"""Admin route over model-call capture: one rollout's records, in order, as JSONL.

The store is where every capture mode (``--capture-dir``, ``--capture-tokens``, token-in)
records a rollout's calls, so it is the default source; ``source=files`` reads the JSONL
capture files of ``--capture-dir`` instead. Reading and serialising run in a worker thread.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from gateway.admin.common import admin_error
from gateway.rollout import store as rollout_store
from gateway.rollout.capture_files import export_rollout
from gateway.rollout.ids import VALID


def _jsonl(records: list[dict[str, Any]]) -> bytes:
    return b"".join(orjson.dumps(r) + b"\n" for r in records)


async def export(request: Request) -> Response:
    rollout = request.query_params.get("rollout")
    source = request.query_params.get("source") or "store"
    if not rollout:
        return admin_error(400, "missing_parameter", "rollout is required", "rollout")
    if not VALID.fullmatch(rollout):
        return admin_error(400, "invalid_rollout_id", "rollout ids are 1-128 of A-Z a-z 0-9 . _ : -", "rollout")
    if source not in ("store", "files"):
        return admin_error(400, "invalid_parameter", "source is store or files", "source")
    if source == "files":
        directory = request.app.state.live.current.capture_dir
        if directory is None:
            return admin_error(404, "capture_disabled", "capture files are off (no --capture-dir)", "source")
        body = await asyncio.to_thread(lambda: _jsonl(export_rollout(directory, rollout)))
    else:
        read = await request.app.state.relay.rollouts.read(rollout)
        records, marks = read if read is not None else ([], [])
        body = await asyncio.to_thread(lambda: _jsonl(rollout_store.with_order(records, marks)))
    if not body:
        return admin_error(404, "rollout_not_found", f"no records of rollout {rollout!r} ({source})")
    return Response(body, media_type="application/x-ndjson")


def capture_routes() -> list[BaseRoute]:
    return [Route("/capture/export", export, methods=["GET"])]
