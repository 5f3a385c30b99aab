"""``EngineHold``: while the engines are paused for a weight update, new generation calls
wait here instead of in the engines' queues (or failing), then go on once resumed.

A call asks just before it would send to an engine (``UpstreamAttempts``, once it knows
which upstream it would use): an upstream without an engine API is never held. The wait
is bounded by ``--engine-pause-max``; past it the call fails with ``engine_paused`` (the
protocol's error, one audit record, as any other failure). The hold is per process.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable

from gateway.errors import ErrorCode, GatewayError


def engine_paused(bound: float) -> GatewayError:
    """A call that waited for paused engines longer than ``bound`` seconds."""
    return GatewayError(
        "overloaded", ErrorCode.ENGINE_PAUSED,
        f"the inference engines stayed paused for a weight update longer than {bound:g} s"
        " (--engine-pause-max)", retry_after=1,
    )


class EngineHold:
    """Closed while the fleet is paused; counts the calls waiting, per upstream name."""

    def __init__(self, on_held: Callable[[int], None] | None = None) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self.held: Counter[str] = Counter()
        self._on_held = on_held or (lambda count: None)

    @property
    def closed(self) -> bool:
        return not self._open.is_set()

    @property
    def held_total(self) -> int:
        return sum(self.held.values())

    def close(self) -> None:
        """From now on, calls to engines wait (those already sent are the engines' concern)."""
        self._open.clear()

    def open(self) -> int:
        """Release every held call; how many were waiting."""
        waiting = self.held_total
        self._open.set()
        return waiting

    def holds(self, engine_api: str | None) -> bool:
        """Whether a call to an upstream with this engine API must wait now."""
        return engine_api is not None and self.closed

    async def wait(self, upstream: str, bound: float) -> None:
        """Wait until opened, at most ``bound`` seconds (then ``engine_paused``)."""
        self.held[upstream] += 1
        self._on_held(self.held_total)
        try:
            async with asyncio.timeout(bound):
                await self._open.wait()
        except TimeoutError:
            raise engine_paused(bound) from None
        finally:
            self.held[upstream] -= 1
            if not self.held[upstream]:
                del self.held[upstream]
            self._on_held(self.held_total)
