"""Rollout identity: ``/rollouts/{rollout_id}/v1/...`` paths and the rollout header.

:class:`RolloutPaths` is one ASGI layer in front of everything: a path under
``/rollouts/{id}/v1`` is answered by the ordinary ``/v1`` route, with the id kept in the
scope (:data:`SCOPE_KEY`), so every generation route, its WebSocket, ``count_tokens``,
``/v1/models`` and stored responses work under a rollout base URL without a second route
table. The id never reaches the upstream: it lives only in the scope and the records.
"""

from __future__ import annotations

import re
from typing import Any

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.errors import GatewayError

SCOPE_KEY = "codebuddy2api.rollout_id"
PREFIX = "/rollouts/"
VALID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def invalid_rollout(value: str) -> GatewayError:
    shown = value[:40] + ("..." if len(value) > 40 else "")
    return GatewayError(
        "invalid_request", "invalid_rollout_id",
        f"rollout id {shown!r} is invalid: 1-128 characters of A-Z a-z 0-9 . _ : -", param="rollout_id",
    )


def check_rollout_id(value: str) -> str:
    """``value`` when it is a valid rollout id, else the 400 to answer."""
    if not VALID.fullmatch(value):
        raise invalid_rollout(value)
    return value


#: The request header that puts a rollout call's rollout in a group (GRPO: one prompt's rollouts).
GROUP_HEADER = "x-rollout-group"


def rollout_group_of(headers: Any) -> str | None:
    """The group a rollout call names (:data:`GROUP_HEADER`), checked like a rollout id."""
    value = headers.get(GROUP_HEADER)
    if value is None:
        return None
    if not VALID.fullmatch(value):
        raise GatewayError("invalid_request", "invalid_rollout_group",
                           f"{GROUP_HEADER} must be 1-128 characters of A-Z a-z 0-9 . _ : -", param=GROUP_HEADER)
    return str(value)


def rollout_of(scope: Scope, headers: Any, header_name: str) -> str | None:
    """The request's rollout: its ``/rollouts/{id}`` path, else the rollout header (both
    checked; an invalid one is a GatewayError)."""
    from_path = scope.get(SCOPE_KEY)
    if from_path:
        return str(from_path)
    value = headers.get(header_name) if header_name else None
    return check_rollout_id(value) if value is not None else None


def _error_body(path: str, err: GatewayError) -> dict[str, Any]:
    from gateway.protocols.messages.room import error_json as anthropic_error
    from gateway.protocols.openai_shapes import error_json as openai_error

    return anthropic_error(err) if path.startswith("/v1/messages") else openai_error(err)


class RolloutPaths:
    """Rewrites ``/rollouts/{id}/v1/...`` to ``/v1/...`` with the id in the scope; an
    invalid id is a 400 in the route's shape (a WebSocket upgrade: refused with it)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope.get("path", "")
        if scope["type"] not in ("http", "websocket") or not path.startswith(PREFIX):
            return await self.app(scope, receive, send)
        rollout, slash, rest = path[len(PREFIX):].partition("/")
        rest = "/" + rest if slash else ""
        if rest != "/v1" and not rest.startswith("/v1/"):
            return await self.app(scope, receive, send)  # not a rollout API path: the usual 404
        if not VALID.fullmatch(rollout):
            body = _error_body(rest, invalid_rollout(rollout))
            if scope["type"] == "http":
                return await JSONResponse(body, status_code=400)(scope, receive, send)
            return await _refuse_websocket(scope, send, body)
        raw = rest.encode()
        scope = {**scope, "path": rest, "raw_path": raw, SCOPE_KEY: rollout}
        await self.app(scope, receive, send)


async def _refuse_websocket(scope: Scope, send: Send, body: dict[str, Any]) -> None:
    """Before accept: an HTTP 400 where the server allows it, else a plain refusal."""
    import orjson

    if "websocket.http.response" in scope.get("extensions", {}):
        payload = orjson.dumps(body)
        await send({"type": "websocket.http.response.start", "status": 400,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]})
        await send({"type": "websocket.http.response.body", "body": payload})
        return
    await send({"type": "websocket.close", "code": 1008})
