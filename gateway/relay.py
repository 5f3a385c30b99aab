"""The one place that wires a generation request, and the only request-path code doing I/O.

parse (protocol room) -> policy snapshot -> upstream producer task -> accumulator ->
realtime scheduler | compatible collect-and-replay -> encoder -> ASGI send -> record.

The upstream is read by a producer task into a small queue; the consumer waits on the
queue with the keepalive interval as its timeout, so a silent upstream turns into native
keepalive events, and a client disconnect cancels the consumer, which cancels the
producer, which closes the upstream response.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from gateway.errors import GatewayError
from gateway.policy import StreamPolicy
from gateway.protocols.base import ParsedRequest, ProtocolRoom, StreamEncoder
from gateway.settings import LiveSettings, StreamMode
from gateway.stream.accumulator import ChatSSEAccumulator
from gateway.stream.compatible import replay
from gateway.stream.events import KEEPALIVE, Completion, Error, Event
from gateway.stream.realtime import RealtimeScheduler
from gateway.stream.repair import REPAIRABLE_CODES, regeneration_body, repair_slots_locally, tool_schemas
from gateway.capture import CaptureWriter
from gateway.upstream.client import ANSWERED, DONE, UpstreamClient, UpstreamItem
from gateway.upstream.config import with_engine_extras
from gateway.upstream.pool import UpstreamPool, fingerprint

SSE_HEADERS = {
    "content-type": "text/event-stream; charset=utf-8",
    "cache-control": "no-cache",
    "x-accel-buffering": "no",
}


class _End:
    """The producer finished reading the upstream."""


_END = _End()
_TIMEOUT = object()


@dataclass(slots=True)
class RequestRecord:
    """What one generation request did; handed to the record sink exactly once."""

    request_id: str
    protocol: str
    started_at: float
    mode: str = ""
    streamed: bool = False
    model: str = ""  # as the client asked
    upstream_model: str = ""  # as sent upstream
    outcome: str = "error"  # success | error | cancelled | invalid | refused
    error_code: str | None = None
    http_status: int = 200
    finish_reason: str | None = None
    ttfb_ms: float | None = None  # first byte sent to the client
    duration_ms: float = 0.0
    ended_at: float = 0.0
    output_bytes: int = 0
    tool_calls: int = 0
    keepalives: int = 0
    budget_exceeded: bool = False
    client_key_fingerprint: str | None = None
    usage: dict[str, int] = field(default_factory=dict)
    upstream_attempts: list[dict[str, Any]] = field(default_factory=list)  # fingerprint, status, ms
    repairs: list[dict[str, Any]] = field(default_factory=list)  # kind, outcome, usage
    bodies: dict[str, Any] | None = None  # only with --audit-bodies


class RequestObserver(Protocol):
    """Told when a generation request starts and, exactly once, when it ends."""

    def on_start(self, record: RequestRecord) -> None: ...

    def on_finish(self, record: RequestRecord) -> None: ...


class Relay:
    """Serves generation requests for every protocol room."""

    def __init__(self, live: LiveSettings, upstream: UpstreamClient, observer: RequestObserver) -> None:
        self.live = live
        self.upstream = upstream
        self.observer = observer
        self.pool: UpstreamPool = UpstreamPool([])  # replaced at start-up (app lifespan)
        self.capture: CaptureWriter | None = None  # set at start-up with --capture-dir
        self._capacity_holders: set[str] = set()

    @property
    def in_flight(self) -> int:
        """Generation requests holding a capacity slot right now."""
        return len(self._capacity_holders)

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
        if self.in_flight >= settings.max_concurrent:
            record.outcome = "refused"
            err = GatewayError(
                "overloaded", "capacity_exceeded",
                f"the gateway is at its limit of {settings.max_concurrent} concurrent requests", retry_after=1,
            )
            return self._error_response(room, err, record, headers)
        self._capacity_holders.add(record.request_id)
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
        self._capacity_holders.discard(record.request_id)
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


class GenerationRun:
    """One generation: the upstream producer and the mode-specific consumer."""

    def __init__(
        self,
        relay: Relay,
        room: ProtocolRoom,
        parsed: ParsedRequest,
        policy: StreamPolicy,
        record: RequestRecord,
        session: str | None = None,
    ) -> None:
        self.relay = relay
        self.session = session
        self.room = room
        self.parsed = parsed
        self.policy = policy
        self.record = record
        self.response_id = room.new_response_id()
        self.encoder: StreamEncoder = room.encoder(parsed, self.response_id)
        self.committed = False
        self.completion: Completion | None = None
        self.rollout_id: str | None = None
        self.upstream_body = with_engine_extras(parsed.upstream_body, policy.engine_extras)
        self.attempt_bodies: list[dict[str, Any]] = []  # every body sent upstream (capture)
        self._retained = 0  # output bytes over every attempt (the budget spans them all)
        self._queue: asyncio.Queue[UpstreamItem | _End | GatewayError] = asyncio.Queue(maxsize=64)
        self._producer: asyncio.Task[None] | None = None

    # -- the upstream leg --------------------------------------------------------------

    async def _produce(self, body: dict[str, Any]) -> None:
        """Read one upstream answer into the queue, failing over to another credential
        while the upstream has not yet answered 200 (so no content reached the client)."""
        put = self._queue.put
        pool = self.relay.pool
        model = str(body.get("model", ""))
        tried: set[str] = set()
        last_error: GatewayError | None = None
        try:
            for attempt_no in range(1 + self.policy.failover_max):
                try:
                    lease = pool.acquire(model, tried, self.session)
                except GatewayError as err:
                    # after a failed attempt, the client hears what the upstream said, unless
                    # every credential now cools down: then when to come back
                    await put(last_error if last_error is not None and err.kind != "rate_limit" else err)
                    return
                credential = lease.credential
                tried.add(credential.id)
                upstream_body = dict(body, model=credential.upstream.upstream_model(model))
                self.record.upstream_model = upstream_body["model"]
                attempt: dict[str, Any] = {
                    "credential": credential.fingerprint, "upstream": credential.upstream.name, "status": None,
                }
                self.record.upstream_attempts.append(attempt)
                started = time.monotonic()
                answered = False
                try:
                    async for item in self.relay.upstream.stream_chat(credential, upstream_body, self.policy):
                        if item is ANSWERED:
                            answered = True
                            attempt["status"] = 200
                        await put(item)
                    await put(_END)
                    return
                except GatewayError as err:
                    attempt["status"] = err.upstream_status
                    attempt["error"] = err.code
                    retry = not answered and pool.report_failure(credential, model, err)
                    if not retry:
                        await put(err)
                        return
                    last_error = err
                finally:
                    lease.release()
                    attempt["duration_ms"] = round((time.monotonic() - started) * 1000, 1)
            await put(self._after_failover(model, tried, last_error))
        except Exception as exc:  # a bug of ours: report it, never hang the consumer
            await put(GatewayError("internal", "internal_error", f"internal error: {type(exc).__name__}"))

    def _after_failover(self, model: str, tried: set[str], last_error: GatewayError | None) -> GatewayError:
        """Failover is used up: when every credential now cools down, say when to retry."""
        assert last_error is not None
        try:
            self.relay.pool.acquire(model, tried).release()
        except GatewayError as err:
            if err.kind == "rate_limit":
                return err
        return last_error

    def _start_upstream(self, body: dict[str, Any]) -> None:
        self.attempt_bodies.append(body)
        self._queue = asyncio.Queue(maxsize=64)
        self._producer = asyncio.create_task(self._produce(body))

    async def _stop_upstream(self) -> None:
        if self._producer is not None and not self._producer.done():
            self._producer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._producer

    async def _next(self, keepalives: bool) -> UpstreamItem | _End | GatewayError | object:
        if not self._queue.empty():
            return self._queue.get_nowait()
        if not keepalives:
            return await self._queue.get()
        try:
            # asyncio.timeout, not wait_for: 3.11's wait_for can swallow a cancellation
            # (client disconnect) that lands just as an item arrives
            async with asyncio.timeout(self.policy.keepalive_interval):
                return await self._queue.get()
        except TimeoutError:
            return _TIMEOUT

    # -- reading one upstream answer ---------------------------------------------------

    def _commit(self, out: bytes = b"") -> bytes:
        """Prefix the protocol's opening frames the first time anything is sent."""
        if self.committed:
            return out
        self.committed = True
        return self.encoder.start() + out

    async def _read_answer(
        self, body: dict[str, Any], scheduler: RealtimeScheduler | None, keepalives: bool
    ) -> AsyncIterator[bytes]:
        """Run one upstream request into a fresh accumulator (``self.acc``), yielding
        what the client may see meanwhile: opening frames, keepalives, realtime events."""
        acc = self.acc = ChatSSEAccumulator(self.policy.max_collect_bytes, self.parsed.rules)
        acc.retained_bytes = self._retained
        self._start_upstream(body)
        try:
            while True:
                item = await self._next(keepalives)
                if item is _TIMEOUT:
                    self.record.keepalives += 1
                    yield self._commit(self.encoder.encode(KEEPALIVE))
                elif isinstance(item, GatewayError):
                    raise item
                elif item is ANSWERED:
                    if keepalives and not self.committed:
                        yield self._commit()
                elif item is _END:
                    return
                elif item is DONE:
                    acc.feed_done()
                else:
                    pieces = acc.feed(item)  # type: ignore[arg-type]
                    if scheduler is not None and pieces:
                        events = scheduler.push(pieces)
                        if events:
                            yield self._encode_all(events)
        finally:
            self._retained = acc.retained_bytes
            self.record.output_bytes = acc.retained_bytes
            await self._stop_upstream()

    async def _answer_with_repair(self, keepalives: bool) -> AsyncIterator[bytes]:
        """Compatible mode: collect, validate, repair locally, regenerate within the bound.

        Sets ``self.completion``; yields only opening frames and keepalives. Once repair is
        involved, every attempt is recorded (kind, outcome, reason, usage) for the audit.
        """
        body = self.upstream_body
        attempt = 0
        while True:
            async for out in self._read_answer(body, None, keepalives):
                yield out
            kind = "original" if attempt == 0 else "regenerate"
            usage = self._usage_dict(self.acc)
            try:
                self.completion = self.acc.seal()
                if attempt:
                    self.record.repairs.append({"kind": kind, "attempt": attempt, "outcome": "valid", "usage": usage})
                return
            except GatewayError as err:
                if err.code not in REPAIRABLE_CODES:
                    raise
                error = err
            if error.code == "tool_call_invalid" and repair_slots_locally(self.acc.slots, tool_schemas(body)):
                with contextlib.suppress(GatewayError):
                    self.completion = self.acc.seal()
                    self.record.repairs.append(
                        {"kind": "local", "attempt": attempt, "outcome": "repaired", "reason": error.message, "usage": usage}
                    )
                    return
            self.record.repairs.append(
                {"kind": kind, "attempt": attempt, "outcome": "invalid", "reason": error.message, "usage": usage}
            )
            if attempt >= self.policy.tool_repair_attempts:
                raise GatewayError(
                    error.kind, error.code,
                    f"{error.message} (still invalid after {attempt} regeneration attempt(s))",
                )
            attempt += 1
            body = regeneration_body(self.upstream_body, error)

    @staticmethod
    def _usage_dict(acc: ChatSSEAccumulator) -> dict[str, int]:
        u = acc.usage
        return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens} if u else {}

    # -- consumers ---------------------------------------------------------------------

    async def collect(self) -> Completion:
        """The JSON path: the whole validated (and if need be repaired) answer."""
        async for _ in self._answer_with_repair(keepalives=False):
            pass
        assert self.completion is not None
        return self.completion

    def capture_record(self) -> dict[str, Any]:
        """The model-call record for training harnesses (``--capture-dir``)."""
        record = self.record
        completion = self.completion
        acc = getattr(self, "acc", None)
        answer: dict[str, Any] | None = None
        if completion is not None:
            answer = {
                "text": completion.text,
                "reasoning": completion.reasoning,
                "tool_calls": [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in completion.tool_calls],
                "finish_reason": completion.finish_reason,
                "usage": record.usage,
            }
        elif acc is not None:  # failed: what the upstream had said so far
            answer = {"text": acc.text, "reasoning": acc.reasoning, "finish_reason": acc.finish_reason, "partial": True}
        token_data = completion.token_data if completion is not None else (acc.token_data if acc else None)
        return {
            "rollout_id": self.rollout_id,
            "request_id": record.request_id,
            "started_at": record.started_at,
            "ended_at": record.ended_at,
            "protocol": record.protocol,
            "mode": record.mode,
            "model": record.model,
            "upstream_model": record.upstream_model,
            "outcome": record.outcome,
            "error_code": record.error_code,
            "upstream_request": self.attempt_bodies[-1] if self.attempt_bodies else self.upstream_body,
            "upstream_attempts": len(self.attempt_bodies),
            "answer": answer,
            "token_data": token_data.as_dict() if token_data else None,
            "repairs": record.repairs,
        }

    def note_completion(self, completion: Completion) -> None:
        if self.record.bodies is not None:
            self.record.bodies["response"] = orjson.dumps({
                "reasoning": completion.reasoning, "text": completion.text,
                "tool_calls": [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in completion.tool_calls],
            }).decode()
        self.record.finish_reason = completion.finish_reason
        self.record.tool_calls = len(completion.tool_calls)
        if completion.usage:
            u = completion.usage
            self.record.usage = {
                "prompt_tokens": u.prompt_tokens,
                "completion_tokens": u.completion_tokens,
                "reasoning_tokens": u.reasoning_tokens,
                "cached_tokens": u.cached_tokens,
            }

    async def stream(self) -> AsyncIterator[bytes | GatewayError]:
        """The client's stream: a GatewayError first means 'not committed, answer with a
        status'; otherwise bytes, the first of which commit a 200."""
        try:
            if self.policy.mode is StreamMode.REALTIME:
                scheduler = RealtimeScheduler(self.room.sequential_blocks)
                async for out in self._read_answer(self.upstream_body, scheduler, keepalives=True):
                    yield out
                completion = self.completion = self.acc.seal()
                events = scheduler.finish(self.acc.sealed_slots, completion.finish_reason, completion.usage)
            else:
                async for out in self._answer_with_repair(keepalives=True):
                    yield out
                assert self.completion is not None
                completion = self.completion
                events = replay(completion)
            self.note_completion(completion)
            self.record.outcome = "success"
            yield self._commit(self._encode_all(events))
            await self.room.completed(self.parsed, self.response_id, completion, self.encoder)
        except GatewayError as err:
            self.record.outcome = "error"
            self.record.error_code = err.code
            if self.committed:
                yield self.encoder.encode(Error(err))
            else:
                self.record.http_status = err.status
                yield err

    def _encode_all(self, events: list[Event]) -> bytes:
        encode = self.encoder.encode
        return b"".join([encode(e) for e in events])


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
