"""The keepalive timer of one generation: one timer per request (not one per item) that,
after a quiet keepalive interval, queues a tick for the run's loop, which the room then
encodes as its native keepalive. Apart from :class:`~gateway.generation.run.GenerationRun`
so the loop reads as reading and writing, and the timing rule sits in one place."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class KeepaliveTimer:
    """Calls ``tick`` after ``interval`` seconds without :meth:`activity`, then again after
    each further quiet interval, until :meth:`cancel`."""

    def __init__(self, interval: float, tick: Callable[[], None]) -> None:
        self.interval = interval
        self.tick = tick
        self._loop = asyncio.get_running_loop()
        self._last_activity = self._loop.time()
        self._timer: asyncio.TimerHandle | None = self._loop.call_later(interval, self._due)

    def activity(self) -> None:
        """Something was written: the quiet interval starts again."""
        self._last_activity = self._loop.time()

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _due(self) -> None:
        quiet = self._loop.time() - self._last_activity
        if quiet >= self.interval * 0.999:
            self.tick()
            self._last_activity = self._loop.time()
            quiet = 0.0
        self._timer = self._loop.call_later(self.interval - quiet, self._due)
