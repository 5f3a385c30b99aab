"""OpenAI Responses over a WebSocket (``GET /v1/responses`` upgraded), as Codex speaks it.

The client sends ``{"type": "response.create", ...}`` text frames (a Responses request
body plus ``type``; ``generate: false`` asks only to prewarm); each is answered with the
usual Responses events, one JSON event per text frame. Later requests usually carry only
the new input plus ``previous_response_id``, so every connection keeps the conversations
of its own responses (and falls back to the response store).

Nothing here is a second protocol stack: each generating ``response.create`` goes through
``GenerationService.handle`` (client key from the upgrade request's headers, parse, policy snapshot,
capacity, audit record, metrics) with the Responses room and its encoder; this module only
turns the SSE frames it writes into text frames. Keepalives are the encoder's repeated
``response.in_progress`` (plus uvicorn's WebSocket pings). Failures: a request error is
the wrapped error event Codex reads (``{"type": "error", "status", "error"}``), a
mid-stream failure is the encoder's ``error`` + ``response.failed``; the connection is
then closed cleanly (1000).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict
from typing import Any

import orjson
import structlog
from starlette.requests import Request
from starlette.websockets import WebSocket, WebSocketDisconnect

from gateway.errors import GatewayError, invalid_request
from gateway.protocols.base import ParsedRequest, load_json_object
from gateway.protocols.openai_shapes import error_json
from gateway.protocols.responses import ResponsesFacts, ResponsesRoom
from gateway.stream.events import Finish, Usage

from gateway.relay import GenerationService, check_client_key

log = structlog.get_logger("gateway.responses_ws")

#: Conversations one connection remembers (oldest dropped first).
CONNECTION_MEMORY = 64

#: Client frames that need no answer.
_IGNORED_TYPES = frozenset({"response.processed"})


class ConnectionRoom(ResponsesRoom):
    """The Responses room for one WebSocket connection: the same parse, encoder and
    store, plus the connection's own conversations for ``previous_response_id``
    (Codex sends ``store: false`` and continues from the previous response anyway)."""

    def __init__(self, base: ResponsesRoom) -> None:
        super().__init__(base.store)
        self.conversations: OrderedDict[str, dict[str, Any]] = OrderedDict()

    async def load_conversation(self, response_id: str) -> dict[str, Any] | None:
        record = self.conversations.get(response_id)
        return record if record is not None else await super().load_conversation(response_id)

    async def keep(self, response_id: str, record: dict[str, Any], store: bool | None) -> None:
        self.conversations[response_id] = record
        while len(self.conversations) > CONNECTION_MEMORY:
            self.conversations.popitem(last=False)
        await super().keep(response_id, record, store)


def wrapped_error(err: GatewayError) -> dict[str, Any]:
    """A request error as Codex's WebSocket client reads it (status = the HTTP one)."""
    return {"type": "error", "status": err.status, **error_json(err)}


def sse_data(buffer: bytearray) -> list[bytes]:
    """Complete SSE frames' ``data`` payloads taken from ``buffer`` (the rest stays)."""
    out: list[bytes] = []
    while True:
        end = buffer.find(b"\n\n")
        if end < 0:
            return out
        frame = bytes(buffer[:end])
        del buffer[: end + 2]
        for line in frame.split(b"\n"):
            if line.startswith(b"data: "):
                out.append(line[6:])


class ResponsesConnection:
    """One WebSocket connection: reads frames, answers each ``response.create`` in turn."""

    def __init__(self, relay: GenerationService, room: ResponsesRoom, websocket: WebSocket) -> None:
        self.relay = relay
        self.room = ConnectionRoom(room)
        self.websocket = websocket
        self.inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.disconnected = asyncio.Event()

    async def run(self) -> None:
        await self.websocket.accept()
        reader = asyncio.create_task(self._read())
        try:
            while True:
                message = await self.inbox.get()
                if message["type"] == "websocket.disconnect":
                    return
                if not await self._handle(message):
                    await self._close()
                    return
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader

    async def _read(self) -> None:
        """The only reader of the socket: frames queue up while a response streams."""
        while True:
            message = await self.websocket.receive()
            if message["type"] == "websocket.disconnect":
                self.disconnected.set()
                await self.inbox.put(message)
                return
            await self.inbox.put(message)

    async def _close(self) -> None:
        with contextlib.suppress(Exception):
            await self.websocket.close(code=1000)

    async def _send(self, data: bytes | str) -> None:
        text = data.decode() if isinstance(data, bytes) else data
        if not self.disconnected.is_set():
            await self.websocket.send_text(text)

    async def _send_error(self, err: GatewayError) -> None:
        with contextlib.suppress(Exception):
            await self._send(orjson.dumps(wrapped_error(err)))

    # -- one client frame --------------------------------------------------------------

    async def _handle(self, message: dict[str, Any]) -> bool:
        """Answer one frame; False: the connection is to be closed."""
        try:
            request = self._request(message)
        except GatewayError as err:
            await self._send_error(err)
            return False
        if request is None:
            return True
        if request.get("generate") is False:
            return await self._prewarm(request)
        return await self._generate(request)

    @staticmethod
    def _request(message: dict[str, Any]) -> dict[str, Any] | None:
        raw = message.get("text")
        if raw is None:
            raw = message.get("bytes") or b""
        value = load_json_object(raw, what="the frame")
        kind = value.get("type")
        if kind in _IGNORED_TYPES:
            return None
        if kind != "response.create":
            raise invalid_request(
                f"unsupported frame type {kind!r} (expected 'response.create')",
                param="type",
                code="unsupported_event_type",
            )
        return value

    @staticmethod
    def _body(request: dict[str, Any]) -> bytes:
        body = {k: v for k, v in request.items() if k not in ("type", "generate")}
        body["stream"] = True  # a WebSocket answer is always the event stream
        return orjson.dumps(body)

    async def _prewarm(self, request: dict[str, Any]) -> bool:
        """``generate: false``: validate, remember the input, answer created + completed
        with no output; nothing goes upstream and no audit record is written."""
        try:
            check_client_key(self.websocket, self.relay.live.current.api_key)  # type: ignore[arg-type]
            parsed = await self.room.resolve(self.room.parse(self._body(request), {}))
        except GatewayError as err:
            await self._send_error(err)
            return False
        response_id = self.room.new_response_id()
        encoder = self.room.encoder(parsed, response_id)
        frames = bytearray(encoder.start() + encoder.encode(Finish("stop", Usage())))
        for data in sse_data(frames):
            await self._send(data)
        final = encoder.final or {}
        await self.room.keep(response_id, self._prewarm_record(parsed, final), store=False)
        return True

    @staticmethod
    def _prewarm_record(parsed: ParsedRequest[ResponsesFacts], final: dict[str, Any]) -> dict[str, Any]:
        return {"response": final, "history": list(parsed.facts.history), "output": []}

    async def _generate(self, request: dict[str, Any]) -> bool:
        body = self._body(request)
        scope = {**self.websocket.scope, "type": "http", "method": "POST"}

        async def receive_body() -> dict[str, Any]:
            return {"type": "http.request", "body": body, "more_body": False}

        response = await self.relay.handle(self.room, Request(scope, receive_body))
        sink = _EventSink(self)

        async def receive_disconnect() -> dict[str, Any]:
            await self.disconnected.wait()
            return {"type": "http.disconnect"}

        try:
            await response(scope, receive_disconnect, sink.send)
        except (WebSocketDisconnect, RuntimeError, OSError):
            log.info("responses_ws_client_gone")
            return False
        if sink.error is not None:
            with contextlib.suppress(Exception):
                await self._send(orjson.dumps(sink.error))
            return False
        run = getattr(response, "run", None)
        return run is not None and run.record.outcome == "success"


class _EventSink:
    """The ASGI ``send`` of one answer: SSE frames -> text frames; an error status with
    its JSON body -> the wrapped error event."""

    def __init__(self, connection: ResponsesConnection) -> None:
        self.connection = connection
        self.status = 200
        self.buffer = bytearray()
        self.error: dict[str, Any] | None = None

    async def send(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            return
        if message["type"] != "http.response.body":
            return
        self.buffer += message.get("body", b"")
        if self.status != 200:
            if not message.get("more_body", False):
                self.error = self._error_of(bytes(self.buffer))
            return
        for data in sse_data(self.buffer):
            await self.connection._send(data)

    def _error_of(self, body: bytes) -> dict[str, Any]:
        """The wrapped error event of an error answer (the room's OpenAI error body)."""
        try:
            error = orjson.loads(body)["error"]
        except (orjson.JSONDecodeError, KeyError, TypeError):
            error = {"message": f"HTTP {self.status}", "type": "api_error", "param": None, "code": None}
        return {"type": "error", "status": self.status, "error": error}


def websocket_endpoint(relay: GenerationService, room: ResponsesRoom):  # type: ignore[no-untyped-def]
    async def endpoint(websocket: WebSocket) -> None:
        await ResponsesConnection(relay, room, websocket).run()

    return endpoint
