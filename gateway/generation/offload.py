"""Work too heavy for the shared event loop, run in bounded worker threads.

Every client shares one event loop, so nothing that can take more than about a
millisecond runs on it: parsing and translating a large request body, counting its
tokens, validating tool-call arguments against a client's schema. Each kind of work gets
an :class:`Offload`: a few threads, a bound on the jobs waiting for them (past it the
caller refuses at once: nothing queues without limit) and a bound on the wait.

What runs here is bounded by itself too (the schema validator's deadline, the body's item
limits), so a timed-out wait never leaves a thread running for long.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from gateway.errors import ErrorCode, GatewayError
from gateway.stream.answer import CompatibleAnswer, RealtimeAnswer
from gateway.stream.events import Event
from gateway.stream.repair import REPAIR_SECONDS

T = TypeVar("T")


class OffloadFull(Exception):
    """More jobs are waiting than the bound allows."""


class Offload:
    """``workers`` threads, at most ``max_pending`` jobs admitted (running or waiting)."""

    def __init__(self, name: str, workers: int, max_pending: int) -> None:
        self.name = name
        self.max_pending = max_pending
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix=f"codebuddy2api-{name}")
        self._lock = threading.Lock()
        self.pending = 0

    async def run(self, fn: Callable[..., T], *args: Any, timeout: float) -> T:
        """``fn(*args)`` in a worker thread; raises :class:`OffloadFull` when the bound is
        reached, ``TimeoutError`` after ``timeout`` seconds, else what ``fn`` raises."""
        with self._lock:
            if self.pending >= self.max_pending:
                raise OffloadFull(self.name)
            self.pending += 1
        try:
            future = self._executor.submit(fn, *args)
        except BaseException:
            self._release()
            raise
        future.add_done_callback(lambda _: self._release())
        async with asyncio.timeout(timeout):  # not wait_for: on 3.11 it can swallow a cancel
            return await asyncio.wrap_future(future)

    def _release(self) -> None:
        with self._lock:
            self.pending -= 1


#: Parsing, translating and counting large request bodies (routes, relay).
BODIES = Offload("bodies", workers=2, max_pending=64)
#: Schema validation of repaired tool-call arguments (generation loop).
SCHEMAS = Offload("schemas", workers=2, max_pending=64)


#: The bound on waiting for an answer's schema validations (they stop themselves at
#: ``REPAIR_SECONDS``; this only guards against a starved pool).
REPAIR_WAIT = REPAIR_SECONDS + 10


async def finish_answer(answer: RealtimeAnswer | CompatibleAnswer) -> Iterable[Event]:
    """``answer.finish()``; in a worker thread when it may validate tool-call arguments
    against a client schema. With no worker free the local repair is skipped (regenerate or
    fail, as when it cannot be done), never waited for without bound."""
    repair = answer.repair if isinstance(answer, CompatibleAnswer) else None
    if repair is None or answer.acc is None or not repair.may_validate(answer.acc):
        return answer.finish()
    try:
        return await SCHEMAS.run(answer.finish, timeout=REPAIR_WAIT)
    except OffloadFull:
        repair.allow_local = False
        return answer.finish()
    except TimeoutError:
        raise GatewayError(
            "upstream", ErrorCode.TOOL_CALL_INVALID, "the tool call's arguments could not be checked in time"
        ) from None
