"""The ``/v1`` routes that are not generations: client-key protection for them, and
``GET /v1/models`` (each model's limits and flags: gateway/routes/model_info.py).

Generation routes check the client key inside the relay (so a refused request still gets
its audit record); ``count_tokens``, stored responses and the model list are wrapped here
with the same constant-time check and the room's own error shape. Both look at the headers
only, before a byte of the body is read (``gateway/http/body_limit.py`` bounds what is read after).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import orjson
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.errors import GatewayError
from gateway.keys.identity import check_client_key
from gateway.keys.registry import managed_key
from gateway.protocols.messages.room import error_json as anthropic_error
from gateway.protocols.openai_shapes import error_json as openai_error
from gateway.routes.codex_catalog import codex_catalog
from gateway.routes.model_info import ModelInfo
from gateway.upstream.config_file import model_entries

Endpoint = Callable[[Request], Awaitable[Response]]

#: How long ``/v1/models`` waits for an upstream's own list.
MODELS_TIMEOUT = 5.0


def keyed(endpoint: Endpoint, error_body: Callable[[GatewayError], dict[str, Any]]) -> Endpoint:
    """``endpoint`` behind the client keys (when any are configured)."""

    async def guarded(request: Request) -> Response:
        try:
            check_client_key(request, request.app.state.live.current.api_key, request.app.state.relay.keys)
        except GatewayError as err:
            return JSONResponse(error_body(err), status_code=err.status)
        return await endpoint(request)

    return guarded


async def model_names(request: Request) -> dict[str, tuple[str, ModelInfo]]:
    """The models clients may ask for (name -> owning upstream and what is known of the
    model): each upstream's allow-list and renamed names where configured, else what the
    upstream lists itself (first usable credential of each), with its limits (vLLM's
    ``max_model_len``); the ``--config`` model tables laid over both."""
    pool = request.app.state.relay.pool
    found: dict[str, tuple[str, ModelInfo]] = {}
    asked: set[str] = set()
    async with httpx.AsyncClient(timeout=MODELS_TIMEOUT) as client:
        for credential in pool.credentials:
            upstream = credential.upstream
            if upstream.models is not None or upstream.model_map:
                for name in [*(upstream.models or ()), *upstream.model_map]:
                    found.setdefault(name, (upstream.name, ModelInfo()))
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
                    found.setdefault(item["id"], (upstream.name, ModelInfo.from_upstream(item)))
    tables = model_entries(request.app.state.live.current.config)
    return {name: (owner, info.configured(name, tables)) for name, (owner, info) in found.items()}


def _anthropic_client(request: Request) -> bool:
    """The Anthropic SDKs (and Claude Code) send ``anthropic-version``; they get the
    Anthropic model-list shape, everyone else the OpenAI one."""
    return "anthropic-version" in request.headers


def _model(name: str, owner: str, info: ModelInfo, anthropic: bool) -> dict[str, Any]:
    if anthropic:
        return {"type": "model", "id": name, "display_name": name, "created_at": "1970-01-01T00:00:00Z",
                "lifecycle": "active", **info.anthropic_fields()}
    return {"id": name, "object": "model", "created": 0, "owned_by": owner, **info.openai_fields()}


async def list_models(request: Request) -> Response:
    """``GET /v1/models`` (a managed key sees only the models its globs allow): the
    Anthropic shape for the Anthropic SDKs, Codex's catalog for Codex (it adds
    ``client_version``: gateway/routes/codex_catalog.py), else the OpenAI list."""
    key = managed_key(request)
    names = sorted((n, o) for n, o in (await model_names(request)).items() if key is None or key.allows(n))
    if "client_version" in request.query_params:
        return JSONResponse(codex_catalog((n, owner, info) for n, (owner, info) in names))
    anthropic = _anthropic_client(request)
    data = [_model(n, owner, info, anthropic) for n, (owner, info) in names]
    if anthropic:
        first, last = (names[0][0], names[-1][0]) if names else (None, None)
        return JSONResponse({"data": data, "has_more": False, "first_id": first, "last_id": last})
    return JSONResponse({"object": "list", "data": data})


async def retrieve_model(request: Request) -> Response:
    """``GET /v1/models/{id}``: one entry of the list, or the protocol's 404."""
    model_id = request.path_params["model_id"]
    entry = (await model_names(request)).get(model_id)
    key = managed_key(request)
    if key is not None and not key.allows(model_id):  # another key's model: as if it did not exist
        entry = None
    anthropic = _anthropic_client(request)
    if entry is None:
        error = GatewayError("not_found", "model_not_found", f"The model '{model_id}' does not exist", status=404)
        return JSONResponse(anthropic_error(error) if anthropic else openai_error(error), status_code=404)
    return JSONResponse(_model(model_id, *entry, anthropic))


# -- unknown routes and methods -----------------------------------------------------------


def _route_error(request: Request, exc: Exception) -> Response:
    """JSON for a route or method the gateway does not serve: the protocol's error shape
    under ``/v1`` (Anthropic's for ``/v1/messages``), plain JSON elsewhere."""
    status = exc.status_code if isinstance(exc, HTTPException) else 500
    headers = dict(exc.headers or {}) if isinstance(exc, HTTPException) else {}
    path = request.url.path
    if status == 405:
        message = f"{request.method} is not allowed on {path}"
        code = "method_not_allowed"
    elif status == 404:
        message = f"no route {request.method} {path}"
        code = "not_found"
    else:
        message = str(exc.detail) if isinstance(exc, HTTPException) else "internal error"
        code = "http_error"
    if path.startswith("/v1/"):
        error = GatewayError("not_found" if status == 404 else "invalid_request", code, message, status=status)
        body = anthropic_error(error) if path.startswith("/v1/messages") else openai_error(error)
    else:
        body = {"error": code, "message": message}
    return JSONResponse(body, status_code=status, headers=headers)


def route_error_handlers() -> dict[Any, Any]:
    """Starlette ``exception_handlers`` for 404 and 405."""
    return {404: _route_error, 405: _route_error}
