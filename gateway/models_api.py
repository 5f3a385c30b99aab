"""The ``/v1`` routes that are not generations: client-key protection for them, and
``GET /v1/models``.

Generation routes check the client key inside the relay (so a refused request still gets
its audit record); ``count_tokens``, stored responses and the model list are wrapped here
with the same constant-time check and the room's own error shape. Both look at the headers
only, before a byte of the body is read (``gateway/body_limit.py`` bounds what is read after).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.errors import GatewayError
from gateway.relay import check_client_key

Endpoint = Callable[[Request], Awaitable[Response]]

#: How long ``/v1/models`` waits for an upstream's own list.
MODELS_TIMEOUT = 5.0


def keyed(endpoint: Endpoint, error_body: Callable[[GatewayError], dict[str, Any]]) -> Endpoint:
    """``endpoint`` behind the client keys (when any are configured)."""

    async def guarded(request: Request) -> Response:
        try:
            check_client_key(request, request.app.state.live.current.api_key)
        except GatewayError as err:
            return JSONResponse(error_body(err), status_code=err.status)
        return await endpoint(request)

    return guarded


async def list_models(request: Request) -> Response:
    """The models clients may ask for: each upstream's allow-list and renamed names where
    configured, else what the upstream lists itself (first usable credential of each)."""
    pool = request.app.state.relay.pool
    names: dict[str, str] = {}
    asked: set[str] = set()
    async with httpx.AsyncClient(timeout=MODELS_TIMEOUT) as client:
        for credential in pool.credentials:
            upstream = credential.upstream
            if upstream.models is not None or upstream.model_map:
                for name in [*(upstream.models or ()), *upstream.model_map]:
                    names.setdefault(name, upstream.name)
                continue
            if credential.disabled or upstream.base_url in asked:
                continue
            asked.add(upstream.base_url)
            headers = {"authorization": f"Bearer {credential.api_key}"} if credential.api_key else {}
            try:
                response = await client.get(upstream.base_url.rstrip("/") + "/models", headers=headers)
                data = orjson.loads(response.content).get("data") if response.status_code == 200 else None
            except (httpx.HTTPError, orjson.JSONDecodeError, AttributeError):
                data = None
            for item in data or []:
                if isinstance(item, dict) and isinstance(item.get("id"), str):
                    names.setdefault(item["id"], upstream.name)
    models = [{"id": name, "object": "model", "created": 0, "owned_by": owner} for name, owner in sorted(names.items())]
    return JSONResponse({"object": "list", "data": models})
