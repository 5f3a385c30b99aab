"""Store calls bounded in time, on threads of their own.

:class:`BoundedWrites`: a write waits only while the store makes progress (see
:meth:`BoundedWrites.run`); past that the caller spills its rows, and the write, still
running in its thread, may land later (the replay's upsert makes that harmless).

:class:`BoundedReads`, for the request path (``previous_response_id``, rollout read-backs):
a read runs on threads of its own (never queued behind writes stuck on a slow store) and on
a connection of its own where the store has one per thread (SQLite: WAL readers do not wait
for a writer holding the file's lock). It waits at most ``timeout`` and at most
:data:`STORE_READERS` run at once; past either it fails with :class:`StoreUnavailable`, which
the caller answers as 503 ``store_unavailable``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from gateway.store.db import Store

T = TypeVar("T")

#: Seconds a store write may take before its rows are spilled instead (a stalled
#: PostgreSQL, a write-locked SQLite file). Short: the end of a Responses answer waits on it.
STORE_WRITE_TIMEOUT = 0.5
#: ... and the most a write may wait behind others while the store does make progress.
STORE_WRITE_MAX = 5.0
#: Seconds a store read on the request path may take before it is answered 503.
STORE_READ_TIMEOUT = 2.0
#: Store reads in flight at once (their own threads); past it a read fails at once.
STORE_READERS = 4


class StoreUnavailable(Exception):
    """A store read on the request path failed or did not answer in time."""


class BoundedWrites:
    """Writes (and replays) of one store on two threads of their own: a store stuck in every
    thread of asyncio's shared executor must not hold them up, nor they the reads."""

    def __init__(self, db: Store, timeout: float = STORE_WRITE_TIMEOUT, most: float = STORE_WRITE_MAX) -> None:
        self.db = db
        self.timeout = timeout
        self.most = most  # the longest a write may wait in all (behind others), progress or not
        self._threads = ThreadPoolExecutor(2, thread_name_prefix="store-write")
        self.last_progress = time.monotonic()  # when a store write last completed

    async def in_thread(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on a write thread, unbounded (the replay: its caller bounds it)."""
        return await asyncio.get_running_loop().run_in_executor(self._threads, functools.partial(fn, *args))

    async def run(self, fn: Callable[[Any], T]) -> T:
        """``fn(connection)`` in one transaction. TimeoutError once no write has completed for
        ``timeout`` (a stall), or after ``most`` (:data:`STORE_WRITE_MAX`) in all (a queue that never
        drains); the store's own errors as they come. Never cancels the write: a cancelled
        caller (shutdown) must not lose a batch half-way to disk."""
        write = asyncio.ensure_future(self.in_thread(self._timed_tx, fn))
        start = time.monotonic()
        while True:
            done, _ = await asyncio.wait({write}, timeout=self.timeout)
            if done:
                return write.result()
            now = time.monotonic()
            if now - self.last_progress >= self.timeout or now - start >= self.most:
                write.add_done_callback(consume_outcome)
                waited = self.timeout if now - self.last_progress >= self.timeout else self.most
                raise TimeoutError(f"no store write completed in {waited} s")

    def _timed_tx(self, fn: Callable[[Any], T]) -> T:
        result = self.db.run_tx(fn)
        self.last_progress = time.monotonic()  # the store answers: queued writes may wait on
        return result

    def close(self) -> None:
        self._threads.shutdown(wait=False)


class BoundedReads:
    """Reads of one store, each bounded in time and in number (see the module docstring)."""

    def __init__(self, db: Store, timeout: float = STORE_READ_TIMEOUT) -> None:
        self.db = db
        self.timeout = timeout
        self._threads = ThreadPoolExecutor(STORE_READERS, thread_name_prefix="store-read")
        self._in_flight = 0
        self._reader: Any = None
        self._reader_lock = threading.Lock()

    async def read(self, fn: Callable[[Any], T]) -> T:
        """``fn(connection)`` in a reader thread, else :class:`StoreUnavailable`."""
        if self._in_flight >= STORE_READERS:
            raise StoreUnavailable("every store reader is waiting on the store")
        self._in_flight += 1
        call = asyncio.ensure_future(asyncio.get_running_loop().run_in_executor(self._threads, self._read, fn))

        def done(future: asyncio.Future[Any]) -> None:
            self._in_flight -= 1
            consume_outcome(future)

        call.add_done_callback(done)
        try:
            async with asyncio.timeout(self.timeout):
                return await asyncio.shield(call)
        except self.db.errors as exc:
            raise StoreUnavailable(f"{type(exc).__name__}: {exc}") from None
        except TimeoutError:
            raise StoreUnavailable(f"the store did not answer in {self.timeout} s") from None

    def _read(self, fn: Callable[[Any], T]) -> T:
        with self._reader_lock:
            if self._reader is None:
                self._reader = self.db if self.db.shared or not hasattr(self.db, "open_own") else self.db.open_own()
        return self._reader.run(fn)

    def close(self) -> None:
        """Stop the threads (a read stuck on the store is left to finish) and the own connection."""
        self._threads.shutdown(wait=False)
        if self._reader is not None and self._reader is not self.db:
            with contextlib.suppress(Exception):
                self._reader.close()


def consume_outcome(future: asyncio.Future[Any]) -> None:
    """A store call nobody waits for any more finished after all: retrieve its outcome, so
    asyncio logs no "exception was never retrieved"."""
    if not future.cancelled():
        future.exception()
