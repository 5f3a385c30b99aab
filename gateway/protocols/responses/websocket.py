"""OpenAI Responses over a WebSocket (``GET /v1/responses`` upgraded), as Codex speaks it.

The client sends ``{"type": "response.create", ...}`` text frames (a Responses request
body plus ``type``; ``generate: false`` asks only to prewarm: warm_up.py); each is answered with the
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

Bounds (a hostile client must not grow memory): a frame over ``--max-body-bytes`` is the
wrapped 413 ``request_too_large`` and close 1009; while one request is answered at most
:data:`MAX_QUEUED_FRAMES` frames (and ``--max-body-bytes`` bytes in all) may wait, past
that the wrapped 400 ``too_many_queued_frames``, the answer in flight is cut, and close
1008; the socket is not read past either. A connection with nothing in flight and no
frame that asked for something for ``--ws-idle-timeout`` seconds is closed (1000): ignored
frames (``response.processed``) do not extend it. What a connection remembers between turns
(:class:`ConnectionMemory`) is packed and bounded by its real size. Codex sends one ``response.create``
and waits for its terminal event (then at most a ``response.processed``), so it never
comes near the queue bound; it reconnects after any close.

Connections themselves are bounded too (:class:`ConnectionSlots`): the client key is checked
on the upgrade request first (without it: a 401 with the OpenAI error body, before accept and
before a slot is taken); past ``--ws-max-connections`` open in this process, or
``--ws-max-connections-per-ip`` from one address, an upgrade is refused before it is accepted,
with an HTTP 503 and the OpenAI error body ``too_many_websockets`` (ASGI's
``websocket.http.response`` extension; without it: accepted, then closed 1013); a
connection older than ``--ws-max-lifetime`` is closed 1001 once nothing is in flight (an
answer is never cut by it).

On SIGTERM (gateway/http/shutdown.py) a connection drains as an HTTP stream does: the turn in
flight runs to its end (or is cut at ``--shutdown-timeout`` with the in-stream
``server_shutting_down`` error), a frame that asks for a new turn meanwhile is answered with
the wrapped 503 ``server_shutting_down`` (audited, outcome ``refused``), then the connection
closes with 1012 (service restart: reconnect); an idle one closes with 1012 at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import zlib
from collections import OrderedDict
from typing import Any

import orjson
import structlog
from starlette.requests import Request
from starlette.websockets import WebSocket, WebSocketDisconnect

from gateway.errors import GatewayError
from gateway.generation.body_parsing import off_loop
from gateway.generation.response import error_response
from gateway.generation.service import GenerationService
from gateway.http.shutdown import DRAIN_HOOK, shutting_down_error
from gateway.keys.identity import check_client_key
from gateway.keys.limiter import key_share_cap
from gateway.keys.registry import managed_key
from gateway.protocols.responses.room import ResponsesRoom
from gateway.protocols.responses.warm_up import admit_warm_up, answer_warm_up
from gateway.protocols.responses.websocket_frames import (
    CLOSE_GOING_AWAY,
    CLOSE_NORMAL,
    CLOSE_SERVICE_RESTART,
    CLOSE_TRY_AGAIN_LATER,
    MAX_QUEUED_FRAMES,
    TRIM_AFTER_BYTES,
    Frame,
    Inbox,
    Refusal,
    read_frame,
    release_freed_memory,
    sse_data,
    wrapped_error,
)
from gateway.protocols.responses.websocket_slots import ConnectionSlots, too_many_websockets
from gateway.tasks import stop_tasks

log = structlog.get_logger("gateway.responses_ws")

#: Conversations one connection remembers (oldest dropped first), at most ``--max-body-bytes``
#: of them as packed (compressed JSON) bytes ...
CONNECTION_MEMORY = 64
#: ... and one whose JSON is over this many ``--max-body-bytes`` is not remembered at all
#: (a later turn could not have sent it over HTTP either).
CONNECTION_MEMORY_BODIES = 2

async def refuse_upgrade(websocket: WebSocket, room: ResponsesRoom, err: GatewayError) -> None:
    """Refuse the upgrade before accepting it: the HTTP status and the room's error body
    (ASGI ``websocket.http.response``, which uvicorn offers); a server without it gets an
    accepted connection closed at once with 1013 (try again later) and the message."""
    if "websocket.http.response" in websocket.scope.get("extensions", {}):
        await websocket.send_denial_response(error_response(room, err))
        return
    await websocket.accept()
    await websocket.close(CLOSE_TRY_AGAIN_LATER, err.message[:120])  # a close reason holds 123 bytes


class ConnectionMemory:
    """The conversations one connection remembers, each as compressed JSON, bounded by the
    bytes they really take (and by :data:`CONNECTION_MEMORY` entries): oldest dropped first;
    the newest is kept whatever its size (it is the one a client continues from).

    Pure state: :meth:`put` takes the packed bytes, :meth:`get` hands them back. As parsed
    objects a conversation costs ~20 times its JSON (one 28.6 MiB frame of 1 M tiny items
    was 625 MiB); packed, a repetitive one costs far less than its JSON."""

    def __init__(self, max_bytes: int, max_count: int = 64) -> None:
        self.max_bytes = max_bytes
        self.max_count = max_count
        self.blobs: OrderedDict[str, bytes] = OrderedDict()
        self.bytes = 0

    def put(self, response_id: str, blob: bytes) -> None:
        old = self.blobs.pop(response_id, None)
        if old is not None:
            self.bytes -= len(old)
        self.blobs[response_id] = blob
        self.bytes += len(blob)
        while len(self.blobs) > 1 and (len(self.blobs) > self.max_count or self.bytes > self.max_bytes):
            _, dropped = self.blobs.popitem(last=False)
            self.bytes -= len(dropped)

    def get(self, response_id: str) -> bytes | None:
        return self.blobs.get(response_id)


def pack(record: dict[str, Any], max_json_bytes: int) -> bytes | None:
    """A record as compressed JSON (zlib releases the GIL: run it in a thread); None when
    its JSON is over ``max_json_bytes`` (then it is not remembered)."""
    raw = orjson.dumps(record)
    if len(raw) > max_json_bytes:
        return None
    return zlib.compress(raw, 1)


def unpack(blob: bytes, max_json_bytes: int) -> dict[str, Any]:
    """The record :func:`pack` made (never inflated past ``max_json_bytes``)."""
    inflater = zlib.decompressobj()
    raw = inflater.decompress(blob, max_json_bytes + 1)
    if len(raw) > max_json_bytes or inflater.unconsumed_tail:
        raise ValueError("a remembered conversation inflates past its bound")
    value: dict[str, Any] = orjson.loads(raw)
    return value


class ConnectionRoom(ResponsesRoom):
    """The Responses room for one WebSocket connection: the same parse, encoder and
    store, plus the connection's own conversations for ``previous_response_id``
    (Codex sends ``store: false`` and continues from the previous response anyway)."""

    def __init__(self, base: ResponsesRoom, max_bytes: int, max_json_bytes: int | None = None) -> None:
        super().__init__(base.store)
        self.memory = ConnectionMemory(max_bytes, CONNECTION_MEMORY)
        self.max_json_bytes = max_json_bytes if max_json_bytes is not None else CONNECTION_MEMORY_BODIES * max_bytes

    async def load_conversation(self, response_id: str, owner: str) -> dict[str, Any] | None:
        blob = self.memory.get(response_id)  # this connection's (one client key)
        if blob is None:
            return await super().load_conversation(response_id, owner)
        return await asyncio.to_thread(unpack, blob, self.max_json_bytes)

    async def keep(self, response_id: str, record: dict[str, Any], store: bool | None, owner: str) -> None:
        blob = await asyncio.to_thread(pack, record, self.max_json_bytes)
        if blob is None:
            log.warning("responses_ws_conversation_not_kept", response_id=response_id, limit=self.max_json_bytes)
        else:
            self.memory.put(response_id, blob)
        await super().keep(response_id, record, store, owner)


class ResponsesConnection:
    """One WebSocket connection: reads frames, answers each ``response.create`` in turn."""

    def __init__(self, relay: GenerationService, room: ResponsesRoom, websocket: WebSocket) -> None:
        settings = relay.live.current
        self.relay = relay
        self.room = ConnectionRoom(room, settings.max_body_bytes)
        self.websocket = websocket
        self.inbox = Inbox(MAX_QUEUED_FRAMES, settings.max_body_bytes)
        self.idle_timeout = settings.ws_idle_timeout
        now = asyncio.get_running_loop().time()
        self.closes_at = now + settings.ws_max_lifetime
        self.active_at = now  # the end of the last frame that asked for something (not an ignored one)
        self.arrived = asyncio.Event()  # set when the reader queued a frame or stopped
        self.disconnected = asyncio.Event()  # the client is gone
        self.refused: Refusal | None = None  # set once by the reader; it then stops reading
        self.draining = False  # a stop signal came: finish the turn in flight, then close 1012
        self.turn: Any = None  # the run of the turn in flight (cut if the drain outlasts its bound)
        self.drain_bound = settings.shutdown_timeout + 1.0  # past the deadline's own cut: a last resort

    def drain(self) -> None:
        """The stop signal (from the server's WebSocket protocol): no new turn; the one in
        flight finishes (cut if it outlasts the drain's bound), then the close with 1012."""
        if not self.draining:
            self.draining = True
            self.arrived.set()
            asyncio.get_running_loop().call_later(
                self.drain_bound, lambda: self.turn is not None and self.turn.abort(shutting_down_error()))

    @property
    def stopped(self) -> bool:
        """No answer is to go out any more: the client left or broke the bounds."""
        return self.disconnected.is_set() or self.refused is not None

    async def run(self) -> None:
        await self.websocket.accept()
        reader = asyncio.create_task(self._read())
        try:
            while True:
                frame = await self._next()
                if frame is None:
                    break
                keep_open = await self._handle(*frame)
                if frame[1] >= TRIM_AFTER_BYTES:  # its parsed objects are gone: give their pages back
                    await asyncio.to_thread(release_freed_memory)
                frame = None  # not held while waiting for the next one (a frame may be 32 MiB)
                if keep_open is not None:  # an ignored frame does not extend --ws-idle-timeout
                    self.active_at = asyncio.get_running_loop().time()
                if self.stopped:
                    break
                if keep_open is False:
                    await self._close(CLOSE_SERVICE_RESTART if self.draining else CLOSE_NORMAL,
                                      "server shutting down: reconnect" if self.draining else "")
                    return
            if self.draining and not self.stopped:
                log.info("responses_ws_drained")
                await self._close(CLOSE_SERVICE_RESTART, "server shutting down: reconnect")
                return
            if self.refused is not None:
                await self._send_error(self.relay.refuse_unread(self.room, self.refused.error, "websocket", self.websocket))
                await self._close(self.refused.close_code)
        finally:
            await stop_tasks(reader)  # a cancel of this connection's task is not swallowed here

    async def _next(self) -> tuple[dict[str, Any], int] | None:
        """The next queued frame and its size; None once the connection is to end (client gone, a bound
        broken, ``--ws-idle-timeout`` with nothing asked, or past ``--ws-max-lifetime`` with nothing in
        flight: closed here). Past its lifetime a connection answers nothing more: frames still
        waiting then were never read as requests (Codex has none: it waits for each answer)."""
        loop = asyncio.get_running_loop()
        while True:
            if self.stopped:
                return None
            if self.draining:  # what already waits is still answered (with the shutdown error)
                return self.inbox.take()
            left = self.closes_at - loop.time()
            if left <= 0:
                log.info("responses_ws_lifetime_closed", waiting_frames=len(self.inbox.frames))
                await self._close(CLOSE_GOING_AWAY, "max lifetime reached: reconnect")
                return None
            frame = self.inbox.take()
            if frame is not None:
                return frame
            idle_left = self.active_at + self.idle_timeout - loop.time()
            if idle_left <= 0:
                log.info("responses_ws_idle_closed", idle_timeout=self.idle_timeout)
                await self._close(CLOSE_NORMAL, "idle timeout")
                return None
            self.arrived.clear()
            with contextlib.suppress(TimeoutError):  # either deadline: checked above
                async with asyncio.timeout(min(idle_left, left)):  # not wait_for: it can swallow a cancel (3.11)
                    await self.arrived.wait()

    async def _read(self) -> None:
        """The only reader of the socket: frames queue up (bounded) while a response streams."""
        try:
            while True:
                message = await self.websocket.receive()
                if message["type"] == "websocket.disconnect":
                    self.disconnected.set()
                    return
                if message["type"] != "websocket.receive":
                    continue
                refusal = self.inbox.offer(message)
                del message  # the inbox holds it now; this frame must not keep it while waiting
                if refusal is not None:
                    log.warning("responses_ws_refused", code=refusal.error.code, close_code=refusal.close_code)
                    self.refused = refusal
                    return
                self.arrived.set()
        finally:
            self.arrived.set()

    async def _close(self, code: int, reason: str = "") -> None:
        with contextlib.suppress(Exception):
            await self.websocket.close(code=code, reason=reason or None)

    async def _send(self, data: bytes | str) -> None:
        text = data.decode() if isinstance(data, bytes) else data
        if not self.stopped:
            await self.websocket.send_text(text)

    async def _send_error(self, err: GatewayError) -> None:
        """The wrapped error event (also after a refusal: the last frame before the close)."""
        if self.disconnected.is_set():
            return
        with contextlib.suppress(Exception):
            await self.websocket.send_text(orjson.dumps(wrapped_error(err)).decode())

    # -- one client frame --------------------------------------------------------------

    async def _handle(self, message: dict[str, Any], size: int) -> bool | None:
        """Answer one frame; False: the connection is to be closed; None: an ignored frame."""
        raw = message.get("text")
        if raw is None:
            raw = message.get("bytes") or b""
        try:  # a large frame is read off the loop (body_work), as a large HTTP body is
            frame = await off_loop(read_frame, raw, "reading other large frames")
        except GatewayError as err:  # audited (and the key checked first) like the same body over HTTP
            await self._send_error(self.relay.refuse_unread(self.room, err, "websocket", self.websocket))
            return False
        if frame is None:
            return None
        if self.draining:  # no new turn once the gateway stops: the client reconnects elsewhere
            await self._send_error(self.relay.refuse_unread(
                self.room, shutting_down_error(), "websocket", self.websocket, invalid=False))
            return True
        if frame.prewarm:  # generate: false (warm_up.py): nothing upstream, no audit record
            try:
                parsed, owner = await admit_warm_up(self.relay, self.room, self.websocket, frame.body)
            except GatewayError as err:
                await self._send_error(err)
                return False
            await answer_warm_up(self.room, parsed, owner, self._send)
            return True
        return await self._generate(frame)

    async def _generate(self, frame: Frame) -> bool:
        body = frame.body
        scope = {**self.websocket.scope, "type": "http", "method": "POST"}

        async def receive_body() -> dict[str, Any]:
            return {"type": "http.request", "body": body, "more_body": False}

        response = await self.relay.handle(self.room, Request(scope, receive_body), transport="websocket")
        self.turn = getattr(response, "run", None)
        sink = _EventSink(self)

        async def receive_disconnect() -> dict[str, Any]:
            while not self.stopped:  # a refusal cuts the answer in flight as a disconnect does
                self.arrived.clear()
                await self.arrived.wait()
            return {"type": "http.disconnect"}

        try:
            await response(scope, receive_disconnect, sink.send)
        except (WebSocketDisconnect, RuntimeError, OSError):
            log.info("responses_ws_client_gone")
            return False
        finally:
            self.turn = None
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


def websocket_endpoint(relay: GenerationService, room: ResponsesRoom, slots: ConnectionSlots):  # type: ignore[no-untyped-def]
    async def endpoint(websocket: WebSocket) -> None:
        """The client key, then a slot, both before the upgrade is accepted: a socket that
        brings no key never holds a slot (a refusal is no generation request: no audit record)."""
        settings = relay.live.current
        try:
            check_client_key(websocket, settings.api_key, relay.keys)
        except GatewayError as err:
            log.warning("responses_ws_upgrade_refused", code=err.code)
            await refuse_upgrade(websocket, room, err)
            return
        client = websocket.client.host if websocket.client else ""
        limit, per_client = settings.ws_max_connections, settings.ws_max_connections_per_ip
        managed = managed_key(websocket)
        key = managed.key_id if managed is not None else ""
        per_key = key_share_cap(limit, settings.key_share) if key else 0
        if not slots.take(limit, client, per_client, key, per_key):
            log.warning("responses_ws_upgrade_refused", code="too_many_websockets", open=slots.open, limit=limit)
            whole = slots.open >= limit
            by_address = not whole and slots.by_client.get(client, 0) >= per_client
            shown = limit if whole else per_client if by_address else per_key
            await refuse_upgrade(websocket, room, too_many_websockets(shown, per_client=by_address,
                                                                      per_key=not whole and not by_address))
            return
        connection = ResponsesConnection(relay, room, websocket)
        hook = websocket.scope.get(DRAIN_HOOK)  # serve's WebSocket protocol: drained on SIGTERM
        if hook is not None:
            hook.drain = connection.drain
        try:
            await connection.run()
        finally:
            slots.give_back(client, key)

    return endpoint
