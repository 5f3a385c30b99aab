"""The HTTP endpoints of the /v1 API, apart from the protocol rooms they use.

A generation route hands its room and request to the
:class:`~gateway.generation.service.GenerationService`; the other /v1 endpoints (stored responses,
count_tokens) are small handlers over a room's translation or storage.
"""

from __future__ import annotations

import secrets
from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.errors import GatewayError
from gateway.generation.admission import skip_small_body
from gateway.generation.body_parsing import count_tokens
from gateway.generation.service import GenerationService
from gateway.keys.identity import client_identity
from gateway.keys.limiter import KeyRefusal
from gateway.keys.registry import managed_key
from gateway.protocols.base import ProtocolRoom
from gateway.protocols.messages.room import error_json as anthropic_error
from gateway.protocols.openai_shapes import error_json as openai_error
from gateway.protocols.responses.room import ResponseStorage

Endpoint = Callable[[Request], Awaitable[Response]]


def generation_endpoint(service: GenerationService, room: ProtocolRoom) -> Endpoint:
    """``POST /v1/chat/completions | /v1/responses | /v1/messages``."""

    async def endpoint(request: Request) -> Response:
        return await service.handle(room, request)  # type: ignore[return-value]

    return endpoint


def retrieve_response_endpoint(store: ResponseStorage) -> Endpoint:
    """``GET /v1/responses/{response_id}``: a stored response of the asking client key, or
    an OpenAI 404 (the same for another key's: existence does not leak)."""

    async def retrieve(request: Request) -> Response:
        response_id = request.path_params["response_id"]
        try:
            record = await store.load(response_id, client_identity(request, request.app.state.live.current.api_key))
        except GatewayError as err:  # the store cannot be read now: 503 store_unavailable
            headers = {"retry-after": str(err.retry_after)} if err.retry_after is not None else None
            return JSONResponse(openai_error(err), status_code=err.status, headers=headers)
        if record is None or not isinstance(record.get("response"), dict):
            err = GatewayError(
                "not_found", "response_not_found", f"No response found with id '{response_id}'.", param="response_id"
            )
            return JSONResponse(openai_error(err), status_code=404)
        return JSONResponse(record["response"])

    return retrieve


async def count_tokens_endpoint(request: Request) -> Response:
    """``POST /v1/messages/count_tokens``: the translated request's o200k_base count.

    Same validation and translation as ``/v1/messages`` (``max_tokens`` optional, as in
    Anthropic's API); nothing is sent upstream. A managed key's ``rpm`` counts it before
    its body is read (the count is real work), and its model globs apply.
    """
    key = managed_key(request)
    limiter = request.app.state.relay.limiter
    headers: dict[str, str] = {}
    try:
        if key is not None and limiter is not None:
            headers = await limiter.admit_side(key, None, "count_" + secrets.token_hex(12))
        model, tokens = await count_tokens(await request.body())  # off the loop when large
        if key is not None:
            key.check_model(model)
    except GatewayError as err:
        if isinstance(err, KeyRefusal):
            headers.update(err.headers)
            await skip_small_body(request)  # refused before its body was read: keep the connection
        if err.retry_after is not None:
            headers["retry-after"] = str(err.retry_after)
        return JSONResponse(anthropic_error(err), status_code=err.status, headers=headers)
    return JSONResponse({"input_tokens": tokens}, headers=headers)
