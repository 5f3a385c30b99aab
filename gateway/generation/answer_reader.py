"""The reading half of a generation run: one upstream answer at a time into the client's frames.

A small pump task moves the items of :meth:`UpstreamAttempts.stream
<gateway.upstream.attempts.UpstreamAttempts.stream>` into a bounded queue (read no
further than a key's output cap); the reader waits on the queue, and one timer per
request queues a tick after a quiet keepalive interval. Whatever is queued meanwhile is
handed to the answer state in one go and written once, the room's opening frames before
anything else, keepalives included. A cancel (client gone, :meth:`AnswerReader.abort`)
goes through the pump's anyio scope, which closes the upstream response.

Apart from :class:`~gateway.generation.run.GenerationRun` (the loop over answers:
regenerations, the release of the terminal, the compatible replay), which reads one
answer at a time through :meth:`AnswerReader._read` and frames through :meth:`AnswerReader._commit`
and :meth:`AnswerReader._encode_all`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import anyio

from gateway.errors import GatewayError
from gateway.generation.keepalive import KeepaliveTimer
from gateway.generation.policy import StreamPolicy
from gateway.generation.record import RequestRecord
from gateway.protocols.base import ParsedRequest, StreamEncoder
from gateway.protocols.tokens import count_text, tokenizer_ready
from gateway.stream.answer import CompatibleAnswer, RealtimeAnswer
from gateway.stream.events import KEEPALIVE, BlockDelta, Event
from gateway.stream.output_cap import OutputCap
from gateway.upstream.attempts import UpstreamAttempts
from gateway.upstream.client import ANSWERED, DONE, UpstreamItem

_TICK = object()  # the keepalive timer fired


@dataclass(frozen=True, slots=True)
class _Ended:
    """The pump stopped: the answer ended (``error`` None) or failed."""

    error: BaseException | None = None


_QueueItem = UpstreamItem | _Ended | object


async def _pump(items: AsyncIterator[UpstreamItem], queue: asyncio.Queue[_QueueItem], scope: anyio.CancelScope) -> None:
    """Move one upstream answer's items into the queue. Cancelled (client gone, abort),
    it closes the upstream at once, even while waiting on a full queue.

    It is cancelled through ``scope`` (anyio), never ``Task.cancel()``: httpcore shields
    the release of a connection with an anyio scope, which a native cancel goes through.
    A cancel landing there (an upstream error event is handled while its body's last
    bytes are read) left the connection checked out of the pool for good: one fd per
    mid-stream error, until the pool was full and every request hung (issue #31)."""
    with scope:
        try:
            async with contextlib.aclosing(items):  # type: ignore[type-var]
                async for item in items:
                    await queue.put(item)
        except Exception as exc:  # GatewayError or a bug of ours; the loop reports both
            await queue.put(_Ended(exc))
        else:
            await queue.put(_Ended())


async def _within_cap(items: AsyncIterator[UpstreamItem], cap: OutputCap) -> AsyncIterator[UpstreamItem]:
    """One upstream answer read no further than the gateway's output cap: past it, the
    answer ends as ``length`` and the upstream is closed (an engine that ignores the cap
    it was sent cannot make the key pay for more)."""
    async with contextlib.aclosing(items):  # type: ignore[type-var]
        async for item in items:
            if not isinstance(item, dict):
                yield item
                continue
            if cap.will_count:
                await tokenizer_ready()
            yield cap.feed(item)
            if cap.reached:
                yield cap.finish_chunk()
                yield DONE
                return


class AnswerReader:
    """Reads a run's upstream answers into frames, one answer per :meth:`_read`, and ends
    a read early on :meth:`abort`. The base of :class:`~gateway.generation.run.GenerationRun`,
    which sets the request's parts read here."""

    parsed: ParsedRequest
    policy: StreamPolicy
    record: RequestRecord
    attempts: UpstreamAttempts
    encoder: StreamEncoder
    answer: RealtimeAnswer | CompatibleAnswer
    committed: bool  # the opening frames went out: errors are in-stream now
    terminated: bool  # the terminal frame was released: nothing follows

    def __init__(self) -> None:
        self._aborted: GatewayError | None = None
        self._queue: asyncio.Queue[_QueueItem] = asyncio.Queue(maxsize=64)
        self._pump_task: asyncio.Task[None] | None = None
        self._pump_scope = anyio.CancelScope()
        self._keepalive: KeepaliveTimer | None = None

    def abort(self, error: GatewayError) -> None:
        """End this generation early with ``error`` (closes the upstream; the client gets
        the error as an HTTP status or, once committed, as the in-stream error event)."""
        if self._aborted is not None or self.terminated:
            return
        self._aborted = error
        self._pump_scope.cancel()
        while not self._queue.empty():
            self._queue.get_nowait()
        self._queue.put_nowait(_Ended(error))

    # -- one upstream answer ----------------------------------------------------------------

    async def _read(self, body: dict[str, Any], keepalives: bool) -> AsyncIterator[bytes]:
        """One upstream answer: what the client may see meanwhile (opening frames,
        keepalives, realtime events), written once per batch of queued items."""
        if self._aborted is not None:
            raise self._aborted
        queue = self._queue = asyncio.Queue(maxsize=64)
        self._pump_scope = anyio.CancelScope()
        items = self.attempts.stream(body)
        if self.parsed.output_cap is not None:
            items = _within_cap(items, OutputCap(self.parsed.output_cap, count_text))
        self._pump_task = asyncio.create_task(_pump(items, queue, self._pump_scope))
        if keepalives:
            self._keepalive = KeepaliveTimer(self.policy.keepalive_interval, self._queue_tick)
        handle = self.answer.handle
        try:
            while True:
                item = await queue.get()
                out: list[bytes] = []
                ended: _Ended | None = None
                try:
                    while True:
                        if isinstance(item, _Ended):
                            ended = item
                            break
                        if item is _TICK:
                            if self.record.first_keepalive_ms is None:  # the trace's keepalive wait
                                self.record.first_keepalive_ms = round((time.time() - self.record.started_at) * 1000, 2)
                            self.record.keepalives += 1
                            out.append(self._commit() + self.encoder.encode(KEEPALIVE))  # opening first
                        elif item is ANSWERED:
                            if keepalives and not self.committed:
                                out.append(self._commit())
                        else:
                            events = handle(item)  # type: ignore[arg-type]
                            if events:
                                out.append(self._encode_all(events))
                        if queue.empty():
                            break
                        item = queue.get_nowait()
                except GatewayError:
                    if out:  # what was already released goes out before the error
                        yield b"".join(out)
                    raise
                if self._keepalive is not None:
                    self._keepalive.activity()
                if out:
                    yield b"".join(out)
                if ended is not None:
                    if ended.error is not None:
                        raise ended.error
                    return
        finally:
            self.record.output_bytes = self.answer.retained_bytes
            await self._stop_reading()

    async def _stop_reading(self) -> None:
        if self._keepalive is not None:
            self._keepalive.cancel()
            self._keepalive = None
        task = self._pump_task
        if task is not None and not task.done():
            self._pump_scope.cancel()  # not task.cancel(): see _pump
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def _queue_tick(self) -> None:
        """The keepalive timer fired: a tick for the loop (one is enough while items wait)."""
        if self._queue.empty():
            self._queue.put_nowait(_TICK)

    # -- framing ----------------------------------------------------------------------------

    def _commit(self) -> bytes:
        """The protocol's opening frames, the first time anything is sent; else nothing."""
        if self.committed:
            return b""
        self.committed = True
        return self.encoder.start()

    def _encode_all(self, events: list[Event]) -> bytes:
        if self.record.ttft_ms is None:
            self._note_first_content(events)
        encode = self.encoder.encode
        return b"".join([encode(e) for e in events])

    def _note_first_content(self, events: list[Event]) -> None:
        """``ttft_ms``: when the first text, reasoning or tool-argument delta is written."""
        for event in events:
            if isinstance(event, BlockDelta) and event.text:
                self.record.ttft_ms = round((time.time() - self.record.started_at) * 1000, 2)
                return
