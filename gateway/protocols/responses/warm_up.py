"""A Responses WebSocket's warm-up frame (``response.create`` with ``generate: false``).

Codex opens a connection with one: it is checked as a generating frame would be (the client
key, the parse with ``previous_response_id`` resolved, a managed key's model globs and
``rpm``), then answered ``response.created`` + ``response.completed`` with no output, and
its input remembered for the turn that continues from it. Nothing goes upstream and no
audit record is written: it is no generation request.

Its own module so that the connection (:mod:`gateway.protocols.responses.websocket`) holds
only its turns: that module imports from this one, never the reverse. What a refusal does
to the connection (the wrapped error, then the close) stays the connection's decision.
"""

from __future__ import annotations

import secrets
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.websockets import WebSocket

from gateway.generation.body_parsing import parse_request
from gateway.generation.service import GenerationService
from gateway.keys.identity import check_client_key
from gateway.keys.registry import managed_key
from gateway.protocols.base import ParsedRequest
from gateway.protocols.responses.room import ResponsesFacts, ResponsesRoom
from gateway.protocols.responses.websocket_frames import sse_data
from gateway.stream.events import Finish, Usage


async def admit_warm_up(
    relay: GenerationService, room: ResponsesRoom, websocket: WebSocket, body: bytes,
) -> tuple[ParsedRequest[ResponsesFacts], str]:
    """The warm-up's request and its owner (the client identity), checked as a generating
    frame's would be; a :class:`~gateway.errors.GatewayError` for the client otherwise."""
    check_client_key(websocket, relay.live.current.api_key, relay.keys)
    tenant = relay.tenant(websocket)
    parsed = await room.resolve(await parse_request(room, body, {}, tenant))
    key = managed_key(websocket)
    if key is not None and relay.limiter is not None:
        await relay.limiter.admit_side(key, parsed.model, "warm_" + secrets.token_hex(12))
    return parsed, tenant.identity


async def answer_warm_up(
    room: ResponsesRoom, parsed: ParsedRequest[ResponsesFacts], owner: str,
    send: Callable[[bytes], Awaitable[None]],
) -> None:
    """Created + completed with no output (each event through ``send``), then the input
    remembered under the new response id (never stored: ``store`` false)."""
    response_id = room.new_response_id()
    encoder = room.encoder(parsed, response_id)
    frames = bytearray(encoder.start() + encoder.encode(Finish("stop", Usage())))
    for data in sse_data(frames):
        await send(data)
    final = encoder.final or {}
    await room.keep(response_id, warm_up_record(parsed, final), False, owner)


def warm_up_record(parsed: ParsedRequest[ResponsesFacts], final: dict[str, Any]) -> dict[str, Any]:
    """The conversation a warm-up leaves: its input as history, no output."""
    return {"response": final, "history": list(parsed.facts.history), "output": []}
