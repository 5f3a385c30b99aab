"""Admin route over model-call capture: one rollout's records, in order, as JSONL."""

from __future__ import annotations

import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from gateway.capture import export_rollout


async def export(request: Request) -> Response:
    rollout = request.query_params.get("rollout")
    directory = request.app.state.live.current.capture_dir
    if not rollout:
        return JSONResponse({"error": {"type": "invalid_request_error", "code": "missing_parameter",
                                       "param": "rollout", "message": "rollout is required"}}, status_code=400)
    if directory is None:
        return JSONResponse({"error": {"type": "invalid_request_error", "code": "capture_disabled",
                                       "param": None, "message": "capture is off (no --capture-dir)"}}, status_code=404)
    body = b"".join(orjson.dumps(r) + b"\n" for r in export_rollout(directory, rollout))
    return Response(body, media_type="application/x-ndjson")


def capture_routes() -> list[BaseRoute]:
    return [Route("/capture/export", export, methods=["GET"])]
