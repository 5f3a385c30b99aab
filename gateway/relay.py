"""The one place that wires a generation request: client key, parse, policy snapshot,
capacity, then a :class:`~gateway.generation.GenerationRun` answered as JSON or as a
stream, and the record reported exactly once. The only request-path code doing I/O, with
``generation.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import secrets
import time
from typing import TYPE_CHECKING, Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from gateway.capture import CaptureWriter
from gateway.errors import GatewayError
from gateway.generation import GenerationRun
from gateway.policy import StreamPolicy
from gateway.protocols.base import ProtocolRoom
from gateway.record import RequestObserver, RequestRecord
from gateway.settings import LiveSettings
from gateway.upstream.client import UpstreamClient
from gateway.upstream.pool import UpstreamPool, fingerprint

if TYPE_CHECKING:
    from gateway.store.replicas import CapacityPolicy

SSE_HEADERS = {
    "content-type": "text/event-stream; charset=utf-8",
    "cache-control": "no-cache",
    "x-accel-buffering": "no",
}


class Relay:
    """Serves generation requests for every protocol room."""

    def __init__(self, live: LiveSettings, upstream: UpstreamClient, observer: RequestObserver) -> None:
        self.live = live
        self.upstream = upstream
        self.observer = observer
        self.pool: UpstreamPool = UpstreamPool([])  # replaced at start-up (app lifespan)
        self.capture: CaptureWriter | None = None  # set at start-up with --capture-dir
        #: With replicas on a shared store: this replica's share of max_concurrent
        #: (gateway.store.replicas.SharedCapacity); None = the whole cap is local.
        self.capacity: CapacityPolicy | None = None
        self._capacity_holders: dict[str, tuple[str, str]] = {}  # request id -> (protocol, mode)

    @property
    def in_flight(self) -> int:
        """Generation requests holding a capacity slot right now."""
        return len(self._capacity_holders)

    def in_flight_by(self, dimension: str) -> dict[str, int]:
        """Requests holding a slot now, counted by ``protocol`` or by ``mode``."""
        position = 0 if dimension == "protocol" else 1
        counts: dict[str, int] = {}
        for holder in self._capacity_holders.values():
            counts[holder[position]] = counts.get(holder[position], 0) + 1
        return counts

    async def handle(self, room: ProtocolRoom, request: Request) -> Response | GenerationResponse:
        record = RequestRecord(
            request_id="req_" + secrets.token_hex(12), protocol=room.name, started_at=time.time()
        )
        settings = self.live.current
        policy = StreamPolicy.snapshot(settings)
        record.mode = policy.mode.value
        self.observer.on_start(record)
        headers = {"x-request-id": record.request_id, "x-codebuddy2api-stream-mode": policy.mode.value}
        try:
            body = await request.body()
        except ClientDisconnect:
            record.outcome, record.error_code, record.http_status = "cancelled", "client_disconnected", 499
            self._finish(record)
            return Response(status_code=499)
        if settings.audit_bodies:
            record.bodies = {"request": body.decode("utf-8", "replace")}
        try:
            record.client_key_fingerprint = check_client_key(request, settings.api_key)
            parsed = room.parse(body, dict(request.query_params))
            record.model = parsed.model
            record.upstream_model = str(parsed.upstream_body.get("model", parsed.model))
            record.streamed = parsed.stream
            await room.resolve(parsed)
        except GatewayError as err:
            record.outcome = "refused" if err.kind == "authentication" else "invalid"
            return self._error_response(room, err, record, headers)
        limit = settings.max_concurrent if self.capacity is None else self.capacity.limit(settings.max_concurrent)
        if self.in_flight >= limit:
            record.outcome = "refused"
            err = GatewayError(
                "overloaded", "capacity_exceeded",
                f"the gateway is at its limit of {limit} concurrent requests", retry_after=1,
            )
            return self._error_response(room, err, record, headers)
        self._capacity_holders[record.request_id] = (record.protocol, record.mode)
        session = request.headers.get(settings.session_header) if settings.session_header else None
        run = GenerationRun(self, room, parsed, policy, record, session)
        run.rollout_id = request.headers.get(settings.rollout_header)
        if parsed.stream:
            return GenerationResponse(run, headers, self)
        try:
            completion = await run.collect()
            await room.completed(parsed, run.response_id, completion, None)
        except GatewayError as err:
            return self._error_response(room, err, record, headers, run)
        except asyncio.CancelledError:
            record.outcome = "cancelled"
            record.error_code = "client_disconnected"
            self._finish(record, run)
            raise
        run.note_completion(completion)
        record.outcome = "success"
        self._finish(record, run)
        return JSONResponse(room.json_body(parsed, run.response_id, completion), headers=headers)

    def _error_response(
        self,
        room: ProtocolRoom,
        err: GatewayError,
        record: RequestRecord,
        headers: dict[str, str],
        run: GenerationRun | None = None,
    ) -> Response:
        if record.outcome not in ("invalid", "refused"):
            record.outcome = "error"
        record.error_code = err.code
        record.http_status = err.status
        self._finish(record, run)
        return error_response(room, err, headers)

    def _finish(self, record: RequestRecord, run: GenerationRun | None = None) -> None:
        """The single exit of every generation request: frees its slot, reports it once."""
        self._capacity_holders.pop(record.request_id, None)
        record.ended_at = time.time()
        record.duration_ms = (record.ended_at - record.started_at) * 1000
        if record.error_code == "response_too_large":
            record.budget_exceeded = True
        self.observer.on_finish(record)
        if self.capture is not None and run is not None:
            self.capture.submit(run.capture_record())


def check_client_key(request: Request, keys: list[Any]) -> str | None:
    """With client keys configured, the request must present one (``Authorization:
    Bearer`` or ``x-api-key``), compared in constant time. Returns its fingerprint."""
    if not keys:
        return None
    presented = request.headers.get("x-api-key") or ""
    auth = request.headers.get("authorization") or ""
    if not presented and auth[:7].lower() == "bearer ":
        presented = auth[7:].strip()
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(presented.encode(), key.get_secret_value().encode())
    if not presented or not matched:
        raise GatewayError("authentication", "invalid_api_key", "a valid API key is required (Authorization: Bearer or x-api-key)")
    return fingerprint(presented)


def error_response(room: ProtocolRoom, err: GatewayError, headers: dict[str, str] | None = None) -> Response:
    """A protocol-shaped error with its real HTTP status (and Retry-After when known)."""
    out = dict(headers or {})
    if err.retry_after is not None:
        out["retry-after"] = str(err.retry_after)
    return JSONResponse(room.error_body(err), status_code=err.status, headers=out)


class GenerationResponse:
    """ASGI response for a streamed generation.

    Holds the status line until the run's first output: a GatewayError then becomes a
    real HTTP error; bytes commit a 200 SSE stream. Races the stream against client
    disconnect (as Starlette's StreamingResponse does) and records the request once.
    """

    def __init__(self, run: GenerationRun, headers: dict[str, str], relay: Relay) -> None:
        self.run = run
        self.headers = headers
        self.relay = relay

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        record = self.run.record
        sender = asyncio.create_task(self._send_stream(send))
        listener = asyncio.create_task(_wait_for_disconnect(receive))
        self._complete = False
        try:
            await asyncio.wait({sender, listener}, return_when=asyncio.FIRST_COMPLETED)
            if not sender.done():
                sender.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sender
        except asyncio.CancelledError:
            sender.cancel()
            raise
        finally:
            listener.cancel()
            if not self._complete:  # decided after the sender stopped: nothing overwrites it
                record.outcome = "cancelled"
                record.error_code = "client_disconnected"
            self.relay._finish(record, self.run)

    async def _send_stream(self, send: Send) -> None:
        record = self.run.record
        started = False
        async with contextlib.aclosing(self.run.stream()) as outputs:
            async for out in outputs:
                if isinstance(out, GatewayError):
                    await error_response(self.run.room, out, self.headers)(
                        {"type": "http"}, _no_receive, send
                    )
                    self._complete = True
                    return
                if not started:
                    started = True
                    record.ttfb_ms = round((time.time() - record.started_at) * 1000, 2)
                    raw_headers = [(k.encode(), v.encode()) for k, v in (SSE_HEADERS | self.headers).items()]
                    await send({"type": "http.response.start", "status": 200, "headers": raw_headers})
                if out:
                    await send({"type": "http.response.body", "body": out, "more_body": True})
        if started:
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        self._complete = True


async def _no_receive() -> dict[str, Any]:
    return {"type": "http.request", "body": b"", "more_body": False}


async def _wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
