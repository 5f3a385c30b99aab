"""How late the event loop runs: a small task that sleeps and measures its oversleep.

Everything of a worker shares one loop, so anything that blocks it (a synchronous store
read, a big body parsed inline) delays every request at once while ``/healthz`` still
answers when it gets its turn. The monitor sleeps :data:`INTERVAL` seconds at a time; how
much later than asked it wakes is the loop's lag. The last sample is the
``event_loop_lag_seconds`` gauge; ``/readyz`` is red while a sample over
``--ready-max-loop-lag`` is less than :data:`HOLD` seconds old, so one slow scrape of a
probe still sees it. The sample also counts the loop's asyncio tasks (the
``asyncio_tasks`` gauge: a leak of tasks shows as steady growth in the soak).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from gateway.tasks import stop_tasks

#: Seconds between samples.
INTERVAL = 0.25
#: Seconds a lagging sample keeps readiness red.
HOLD = 5.0


class LoopLagMonitor:
    """Samples the running loop's lag; ``lagging()`` says whether readiness should be red."""

    def __init__(
        self, bound: float, on_sample: Callable[[float, int], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.bound = bound
        self.lag = 0.0  # the last sample (seconds)
        self.worst = 0.0  # the largest sample since start
        self.tasks = 0  # asyncio tasks on the loop at the last sample
        self._over_at = float("-inf")  # when a sample last crossed the bound
        self._over_lag = 0.0
        self._on_sample = on_sample
        self._clock = clock
        self._task: asyncio.Task[None] | None = None

    def note(self, lag: float, tasks: int = 0) -> None:
        """Record one sample (the task calls it; tests may too)."""
        self.lag, self.tasks = lag, tasks
        self.worst = max(self.worst, lag)
        if lag > self.bound:
            now = self._clock()
            self._over_lag = max(self._over_lag, lag) if self.lagging() else lag
            self._over_at = now
        if self._on_sample is not None:
            self._on_sample(lag, tasks)

    def lagging(self) -> bool:
        """A sample crossed the bound less than :data:`HOLD` seconds ago."""
        return self._clock() - self._over_at < HOLD

    def worst_recent(self) -> float:
        """The largest sample over the bound in the current red spell."""
        return self._over_lag if self.lagging() else 0.0

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="loop-lag")

    async def stop(self) -> None:
        await stop_tasks(self._task)
        self._task = None

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            asked = loop.time()
            await asyncio.sleep(INTERVAL)
            self.note(max(0.0, loop.time() - asked - INTERVAL), len(asyncio.all_tasks(loop)))


def publish_samples(metrics: Any, upstream: Any) -> Callable[[float, int], None]:
    """The gauges each sample sets: the lag, the tasks, and the upstream connections in
    use with the pool waits that timed out (read off the client, which keeps no metrics)."""
    counted = 0

    def sample(lag: float, tasks: int) -> None:
        nonlocal counted
        metrics.event_loop_lag.set(lag)
        metrics.asyncio_tasks.set(tasks)
        metrics.upstream_connections.set(upstream.open_responses)
        if upstream.pool_timeouts > counted:
            metrics.upstream_pool_timeouts.inc(upstream.pool_timeouts - counted)
            counted = upstream.pool_timeouts

    return sample
