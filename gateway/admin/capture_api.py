"""Admin route over model-call capture: one rollout's records, in order, as JSONL."""

from __future__ import annotations

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from gateway.admin.common import admin_error
from gateway.rollout.capture_files import export_rollout


async def export(request: Request) -> Response:
    rollout = request.query_params.get("rollout")
    directory = request.app.state.live.current.capture_dir
    if not rollout:
        return admin_error(400, "missing_parameter", "rollout is required", "rollout")
    if directory is None:
        return admin_error(404, "capture_disabled", "capture is off (no --capture-dir)")
    body = b"".join(orjson.dumps(r) + b"\n" for r in export_rollout(directory, rollout))
    return Response(body, media_type="application/x-ndjson")


def capture_routes() -> list[BaseRoute]:
    return [Route("/capture/export", export, methods=["GET"])]
