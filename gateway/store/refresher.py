"""A background reload of what a replica keeps in memory from the shared store (the managed
client keys every second, the envelope keyring every 30 s): the request path reads memory
only; each reload is bounded; a failing store keeps what was loaded, logged once per run of
failures (a warning) and once when it answers again."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import structlog

from gateway.tasks import stop_tasks

log = structlog.get_logger("gateway.store")


class Refresher:
    """Calls ``reload`` every ``every`` seconds, each call bounded by ``bound`` seconds."""

    def __init__(self, name: str, reload: Callable[[], Awaitable[None]], every: float, bound: float) -> None:
        self.name = name
        self.reload = reload
        self.every = every
        self.bound = bound
        self.failing = False
        self.failed_reloads = 0  # in all
        self.failure_runs = 0  # runs of consecutive failures (one warning each)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=self.name)

    async def aclose(self) -> None:
        await stop_tasks(self._task)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.every)
            await self.once()

    async def once(self) -> None:
        """One bounded reload; never raises (the store is down: keep what we have)."""
        try:
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for swallows a cancel that
            # lands as the reload finishes, and aclose() then waited for ever (1 close in 6)
            async with asyncio.timeout(self.bound):
                await self.reload()
        except Exception as exc:
            self.failed_reloads += 1
            if not self.failing:
                self.failure_runs += 1
                log.warning("store_refresh_failed", what=self.name, error=f"{type(exc).__name__}: {exc}")
            self.failing = True
            return
        if self.failing:
            log.info("store_refresh_recovered", what=self.name)
        self.failing = False
