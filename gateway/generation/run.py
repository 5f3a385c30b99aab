"""One generation's I/O loop: read upstream items, tick keepalives, write frames.

The pieces it drives do no I/O of their own decisions:

- :class:`~gateway.upstream.attempts.UpstreamAttempts` streams one upstream answer with
  failover; a small pump task moves its items into a queue (the reading of one answer is
  :class:`~gateway.generation.answer_reader.AnswerReader`'s, this run's base).
- the answer state (:mod:`gateway.stream.answer`, one per mode) turns items into
  canonical events and decides regenerations (through the repair policy);
- the room's encoder turns events into frames.

The loop waits on the queue. One timer per request queues a tick after a quiet keepalive
interval, which becomes the room's native keepalive. Whatever is queued while the client
is being written to is handled in one go and written once. Opening frames
(``encoder.start()``) always go before anything else, keepalives included. A client
disconnect cancels the loop, which cancels the pump, which closes the upstream response.
:meth:`GenerationRun.abort` ends a running generation early with a named error (e.g.
graceful shutdown): the upstream is closed and the client gets that error.

The run never writes the request's outcome: it exposes :attr:`completion` and
:attr:`error`, and :mod:`gateway.generation.outcome` decides.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from typing import Any, Protocol

import orjson

from gateway.errors import GatewayError
from gateway.generation.answer_reader import AnswerReader
from gateway.generation.offload import finish_answer
from gateway.generation.outcome import internal_error
from gateway.generation.policy import StreamPolicy
from gateway.generation.record import RequestRecord
from gateway.protocols.base import ParsedRequest, ProtocolRoom, StreamEncoder
from gateway.protocols.tokens import tokenizer_ready, usage_estimator
from gateway.redact import SECRETS
from gateway.settings import StreamMode
from gateway.stream.answer import CompatibleAnswer, RealtimeAnswer
from gateway.stream.events import Completion, Error, Event
from gateway.stream.masking import DeltaMasker
from gateway.stream.repair import RepairPolicy
from gateway.stream.signatures import restore_thought_signatures
from gateway.upstream.attempts import UpstreamAttempts
from gateway.upstream.config import with_engine_extras

#: A compatible answer's replay goes to the client in writes of about this many bytes, each
#: awaited: the server's send waits while its write buffer is over its high-water mark, so a
#: client that does not read holds back the rest instead of the whole encoded answer sitting
#: in the transport's buffer (an 8 MiB answer was ~9 MiB of frames in one write).
REPLAY_WRITE_BYTES = 64 * 1024


class Run(Protocol):
    """What the generation service, its stream response and shutdown need of a run: a
    :class:`GenerationRun`, or a relayed route's ``RelayedCall`` (gateway/generation/passthrough.py)."""

    room: Any
    record: RequestRecord
    attempts: UpstreamAttempts
    error: GatewayError | None
    committed: bool  # the opening frames went out: an error now goes in-stream
    terminated: bool  # the terminal frame was released: the answer is whole, nothing follows
    rollout_id: str | None
    rollout_group: str | None

    def stream(self) -> AsyncIterator[bytes | GatewayError]: ...

    def released(self) -> None: ...

    def abort(self, error: GatewayError) -> None: ...


class GenerationRun(AnswerReader):
    """One generation request's answer, as frames (stream) or a Completion (JSON); each
    upstream answer is read by its base, :class:`~gateway.generation.answer_reader.AnswerReader`."""

    def __init__(
        self,
        room: ProtocolRoom,
        parsed: ParsedRequest,
        policy: StreamPolicy,
        record: RequestRecord,
        attempts: UpstreamAttempts,
    ) -> None:
        self.room = room
        self.parsed = parsed
        self.policy = policy
        self.record = record
        self.attempts = attempts
        self.response_id = room.new_response_id()
        self.encoder: StreamEncoder = room.encoder(parsed, self.response_id)
        self.upstream_body = restore_thought_signatures(
            with_engine_extras(parsed.upstream_body, policy.engine_extras), parsed.tenant.open_signature
        )
        self.answer: RealtimeAnswer | CompatibleAnswer = answer_state(room, parsed, policy, self.upstream_body)
        self.committed = False  # the opening frames went out: errors are in-stream now
        self.terminated = False  # the terminal frame (finish or error) was released: nothing follows
        self.completion: Completion | None = None
        self.error: GatewayError | None = None
        self.rollout_id: str | None = None
        self.rollout_group: str | None = None  # the x-rollout-group header of a rollout call
        #: awaited once the answer is whole, before its terminal (or JSON body) is released:
        #: the rollout call record's commit (gateway/rollout/recorder.py)
        self.before_release: Callable[[GenerationRun], Awaitable[None]] | None = None
        #: called once the terminal (or JSON body) was handed to the client's transport:
        #: the rollout call record's ``delivered`` confirmation
        self.after_release: Callable[[GenerationRun], None] | None = None
        super().__init__()

    # -- the two ways to consume a run ------------------------------------------------------

    async def collect(self) -> Completion:
        """The JSON path: the whole validated (and if need be repaired) answer."""
        async for _ in self._frames(streaming=False):
            pass
        assert self.completion is not None
        return self.completion

    async def stream(self) -> AsyncIterator[bytes | GatewayError]:
        """The client's stream: a GatewayError first means 'not committed, answer with a
        status'; otherwise bytes, the first of which commit a 200."""
        try:
            async for out in self._frames(streaming=True):
                yield out
        except GatewayError as err:
            self.error = err
        except Exception as exc:  # a bug of ours: the protocol's error, never a silent close
            self.error = internal_error(exc, self.record.request_id, "stream")
        if self.error is not None and not self.terminated:
            if self.committed:
                self.terminated = True
                yield self.encoder.encode(Error(self.error))
            else:
                yield self.error

    def released(self) -> None:
        """The terminal (or the JSON body) was handed to the client's transport."""
        hook, self.after_release = self.after_release, None  # once
        if hook is not None:
            hook(self)

    # -- the loop ---------------------------------------------------------------------------

    async def _frames(self, streaming: bool) -> AsyncIterator[bytes]:
        """Every upstream answer the answer state asks for, as frames; then (streaming)
        the final frames. The JSON path gets no keepalives and encodes nothing."""
        answer = self.answer
        body = answer.begin()
        events: Iterable[Event] = []
        repair = answer.repair
        while body is not None:
            began, logged = time.time(), len(repair.log) if repair is not None else 0
            try:
                async for out in self._read(body, keepalives=streaming):
                    yield out
                if answer.acc is not None and answer.acc.usage is None:
                    await tokenizer_ready()  # the usage is estimated: never load the tables on the loop
                events = await finish_answer(answer)  # off the loop when it validates a schema
            finally:
                if repair is not None:
                    repair.time_since(logged, began, time.time())
            body = answer.begin()
        self.completion = answer.completion
        if self.before_release is not None:
            await self.before_release(self)
        if streaming:
            pending = bytearray(self._commit())
            last: list[Event] = []  # the terminal goes out below, after the answer is stored
            for event in events:  # a compatible replay (lazy): written a bounded piece at a time
                if last:
                    pending += self._encode_all(last)
                last = [event]
                if len(pending) >= REPLAY_WRITE_BYTES:
                    yield bytes(pending)  # resumed once the server took it (its send waits on a full buffer)
                    pending.clear()
                    if self._aborted is not None:
                        raise self._aborted
            out = bytes(pending) + self._encode_all(last)
            # kept before the terminal goes out: a client that reads it and at once continues
            # (previous_response_id) or hangs up finds the answer stored, never half-done
            assert self.completion is not None
            await self.room.completed(self.parsed, self.response_id, self.completion, self.encoder)
            self.terminated = True
            yield out


def answer_state(room: ProtocolRoom, parsed: ParsedRequest, policy: StreamPolicy,
                 upstream_body: dict[str, Any]) -> RealtimeAnswer | CompatibleAnswer:
    """The pure answer state a request's mode asks for, with the request's rules on it."""
    answer: RealtimeAnswer | CompatibleAnswer
    if parsed.stream and policy.mode is StreamMode.REALTIME:
        answer = RealtimeAnswer(policy.max_collect_bytes, parsed.rules, upstream_body, room.sequential_blocks)
    else:
        repair = RepairPolicy(upstream_body, policy.tool_repair_attempts)
        answer = CompatibleAnswer(policy.max_collect_bytes, parsed.rules, upstream_body, repair)
    answer.reasoning_tags = policy.reasoning_tags_for(parsed.model)
    answer.estimate_usage = usage_estimator  # the one rule when the upstream reports none
    answer.seal_signature = parsed.tenant.seal_signature
    answer.masker = DeltaMasker(SECRETS)  # a secret split across deltas is masked too
    return answer


def note_run(record: RequestRecord, run: GenerationRun) -> None:
    """Copy what the run learned into the record (before it is reported)."""
    record.upstream_attempts = run.attempts.log
    if run.attempts.upstream_model is not None:
        record.upstream_model = run.attempts.upstream_model
    if run.answer.repair is not None:
        record.repairs = run.answer.repair.log
    completion = run.completion
    if completion is None or run.error is not None:
        return
    if record.bodies is not None:
        record.bodies["response"] = orjson.dumps({
            "reasoning": completion.reasoning, "text": completion.text,
            "tool_calls": [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in completion.tool_calls],
        }).decode()
    record.finish_reason = completion.finish_reason
    record.tool_calls = len(completion.tool_calls)
    if completion.usage:
        u = completion.usage
        record.usage = {
            "prompt_tokens": u.prompt_tokens,
            "completion_tokens": u.completion_tokens,
            "reasoning_tokens": u.reasoning_tokens,
            "cached_tokens": u.cached_tokens,
        }
        if u.estimated:
            record.usage["estimated"] = True


def capture_record(run: GenerationRun) -> dict[str, Any]:
    """The model-call record for training harnesses (``--capture-dir``)."""
    record = run.record
    completion = run.completion if run.error is None else None
    acc = run.answer.acc
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
    bodies = run.answer.bodies
    return {
        "rollout_id": run.rollout_id,
        "request_id": record.request_id,
        "started_at": record.started_at,
        "ended_at": record.ended_at,
        "protocol": record.protocol,
        "mode": record.mode,
        "model": record.model,
        "upstream_model": record.upstream_model,
        "outcome": record.outcome,
        "error_code": record.error_code,
        "upstream_request": bodies[-1] if bodies else run.upstream_body,
        "upstream_attempts": len(bodies),
        "answer": answer,
        "token_data": token_data.as_dict() if token_data else None,
        "repairs": record.repairs,
    }


class RunningGenerations:
    """The generations running now, by request id: capacity counts them, and the app can
    end them all early with a named error (graceful shutdown)."""

    def __init__(self) -> None:
        self._runs: dict[str, Run] = {}
        self._by_key: dict[str, int] = {}  # managed key id -> its runs here (no zero entries)

    def add(self, run: Run) -> None:
        self._runs[run.record.request_id] = run
        if run.record.key_id:
            self._by_key[run.record.key_id] = self._by_key.get(run.record.key_id, 0) + 1

    def discard(self, request_id: str) -> None:
        run = self._runs.pop(request_id, None)
        key_id = run.record.key_id if run is not None else None
        if key_id:
            left = self._by_key.get(key_id, 1) - 1
            if left > 0:
                self._by_key[key_id] = left
            else:
                self._by_key.pop(key_id, None)

    def of_key(self, key_id: str) -> int:
        """Generations of one managed key running here now (its fair share is counted on it)."""
        return self._by_key.get(key_id, 0)

    def __len__(self) -> int:
        return len(self._runs)

    def __iter__(self) -> Iterator[Run]:
        return iter(list(self._runs.values()))

    def abort_all(self, error: GatewayError) -> int:
        """End every running generation with ``error``; returns how many were told."""
        runs = list(self._runs.values())
        for run in runs:
            run.abort(error)
        return len(runs)
