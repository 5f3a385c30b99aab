"""One generation: the upstream producer task and the mode-specific consumer.

The upstream is read by a producer task into a small queue (failing over to another
credential while the upstream has not answered); the consumer waits on the queue with the
keepalive interval as its timeout, so a silent upstream turns into native keepalive
events. A client disconnect cancels the consumer, which cancels the producer, which closes
the upstream response. Compatible mode collects, validates and repairs; realtime hands
pieces to the scheduler as they come. Both feed the room's encoder.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import orjson

from gateway.errors import GatewayError
from gateway.policy import StreamPolicy
from gateway.protocols.base import ParsedRequest, ProtocolRoom, StreamEncoder
from gateway.record import RequestRecord
from gateway.settings import StreamMode
from gateway.stream.accumulator import ChatSSEAccumulator
from gateway.stream.compatible import replay
from gateway.stream.events import KEEPALIVE, Completion, Error, Event
from gateway.stream.realtime import RealtimeScheduler
from gateway.stream.repair import REPAIRABLE_CODES, regeneration_body, repair_slots_locally, tool_schemas
from gateway.upstream.client import ANSWERED, DONE, UpstreamItem
from gateway.upstream.config import with_engine_extras

if TYPE_CHECKING:
    from gateway.relay import Relay


class _End:
    """The producer finished reading the upstream."""


_END = _End()
_TIMEOUT = object()


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
        self._timer: asyncio.TimerHandle | None = None
        self._loop = asyncio.get_running_loop()
        self._last_activity = 0.0

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
            for _ in range(1 + self.policy.failover_max):
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
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._producer is not None and not self._producer.done():
            self._producer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._producer

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
        what the client may see meanwhile: opening frames, keepalives, realtime events.

        Whatever the producer queued while the client was being written to is handled in
        one go and written once (one ``send`` instead of one per upstream frame)."""
        acc = self.acc = ChatSSEAccumulator(self.policy.max_collect_bytes, self.parsed.rules)
        acc.retained_bytes = self._retained
        self._start_upstream(body)
        if keepalives:
            self._start_keepalive_timer()
        queue = self._queue
        try:
            while True:
                item = await queue.get()
                out: list[bytes] = []
                try:
                    while True:
                        if item is _TIMEOUT:
                            self.record.keepalives += 1
                            out.append(self._commit(self.encoder.encode(KEEPALIVE)))
                        elif isinstance(item, GatewayError):
                            raise item
                        elif item is ANSWERED:
                            if keepalives and not self.committed:
                                out.append(self._commit())
                        elif item is _END:
                            break
                        elif item is DONE:
                            acc.feed_done()
                        else:
                            pieces = acc.feed(item)  # type: ignore[arg-type]
                            if scheduler is not None and pieces:
                                events = scheduler.push(pieces)
                                if events:
                                    out.append(self._encode_all(events))
                        if queue.empty():
                            break
                        item = queue.get_nowait()
                except GatewayError:
                    if out:  # what was already released goes out before the error
                        yield b"".join(out)
                    raise
                self._last_activity = self._loop.time()
                if out:
                    yield b"".join(out)
                if item is _END:
                    return
        finally:
            self._retained = acc.retained_bytes
            self.record.output_bytes = acc.retained_bytes
            await self._stop_upstream()

    def _start_keepalive_timer(self) -> None:
        """One timer per request (not one per item): when nothing has arrived for a
        keepalive interval, a keepalive marker is queued for the consumer."""
        self._loop = asyncio.get_running_loop()
        self._last_activity = self._loop.time()
        self._timer = self._loop.call_later(self.policy.keepalive_interval, self._keepalive_due)

    def _keepalive_due(self) -> None:
        interval = self.policy.keepalive_interval
        quiet = self._loop.time() - self._last_activity
        if quiet >= interval * 0.999:
            if self._queue.empty():
                self._queue.put_nowait(_TIMEOUT)
            self._last_activity = self._loop.time()
            quiet = 0.0
        self._timer = self._loop.call_later(interval - quiet, self._keepalive_due)

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
