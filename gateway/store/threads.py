"""The store's own worker threads: every blocking store call made from async code runs
here, never in asyncio's shared default executor.

A hung or stopped PostgreSQL (or a write-locked SQLite file) holds each thread that calls
it until the store answers. In the shared executor (min(32, cpus + 4) threads: 6 on two
cores) a handful of such calls was enough to stall everything else that runs in a worker
thread: rollout calls and Responses WebSocket turns waited 19-31 s behind them (issue #40).
Here they can hold at most :data:`STORE_THREADS` threads; a caller on the request path
bounds its own wait (``asyncio.timeout``), and a call still queued when its caller gives up
is dropped before it starts.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")

#: Threads per store handle (PostgreSQL: its pool's connections, gateway/store/postgres.py).
STORE_THREADS = 8


class StoreThreads:
    """A lazily started, bounded thread pool for one store handle's blocking calls."""

    def __init__(self, name: str, size: int = STORE_THREADS) -> None:
        self.name = name
        self.size = size
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.size, thread_name_prefix=self.name)
            return self._pool

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on one of these threads (cancelling the wait drops a call not yet started)."""
        return await asyncio.get_running_loop().run_in_executor(self._executor(), functools.partial(fn, *args))

    def close(self) -> None:
        """Stop taking calls; threads stuck on the store are not waited for (exiting)."""
        with self._lock:
            if self._pool is not None:
                self._pool.shutdown(wait=False, cancel_futures=True)
                self._pool = None
