"""The thinnest possible pass-through: the yardstick the gateway's overhead is measured against.

The request body goes to the upstream unchanged; the upstream's bytes stream back unchanged.
No parsing, no validation, no audit. Run under uvicorn with the same loop/HTTP settings as
the gateway (asyncio + h11 unless uvloop/httptools are installed, then both get them).
"""

from __future__ import annotations

import argparse

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route


def create_app(upstream: str, fresh_connections: bool = False) -> Starlette:
    """``fresh_connections``: no upstream keep-alive, a new TCP connection per request (to price it)."""
    keepalive = 0 if fresh_connections else 100
    client = httpx.AsyncClient(
        limits=httpx.Limits(max_connections=2000, max_keepalive_connections=keepalive), timeout=120.0
    )

    async def relay(request: Request) -> StreamingResponse:
        req = client.build_request(
            "POST", upstream.rstrip("/") + "/chat/completions", content=await request.body(),
            headers={"content-type": "application/json", "accept": "text/event-stream"},
        )
        resp = await client.send(req, stream=True)
        return StreamingResponse(
            resp.aiter_raw(), status_code=resp.status_code,
            media_type=resp.headers.get("content-type"), background=BackgroundTask(resp.aclose),
        )

    return Starlette(routes=[Route("/v1/chat/completions", relay, methods=["POST"])])


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream-url", required=True)
    parser.add_argument("--fresh-connections", action="store_true")
    args = parser.parse_args()
    uvicorn.run(create_app(args.upstream_url, args.fresh_connections), host="127.0.0.1", port=args.port, log_level="warning")
