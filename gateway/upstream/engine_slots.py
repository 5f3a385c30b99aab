"""An engine's own concurrency (``max_in_flight`` in its ``[[upstreams]]`` table, issue #40).

Apart from the pool's choice of a credential because it is a different count: an engine
(one upstream table) runs at most ``max_in_flight`` requests over all of its keys, and a
call that finds every usable engine full waits in the gateway for a release (up to the
longest ``queue_timeout`` among them, :meth:`UpstreamAttempts._slot
<gateway.upstream.attempts.UpstreamAttempts._slot>`) rather than in the engine's queue,
where its first-byte timer would run.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from gateway.upstream.credential import Credential


class EngineSlots:
    """The engines' ``max_in_flight`` slots over the pool's credentials, and the event a
    waiting call wakes on when any lease is released."""

    def __init__(self, credentials: Sequence[Credential]) -> None:
        #: the pool's own list (changed in place by the pool): the in-flight counts live on it
        self.credentials = credentials
        #: set when a lease is released (a new one each time): what a waiting call waits on
        self._freed: asyncio.Event | None = None

    def full(self, credential: Credential) -> bool:
        """Its upstream runs its ``max_in_flight`` requests already (over all its keys)."""
        cap = credential.upstream.max_in_flight
        return bool(cap) and sum(c.in_flight for c in self.credentials if c.upstream is credential.upstream) >= cap

    def wait_bound(self, ready: Sequence[Credential]) -> float | None:
        """When every credential in ``ready`` (usable for a model but for their engines'
        slots) is on a full engine: how long a call may wait for a slot (the longest
        ``queue_timeout`` among them), else None."""
        full = [c for c in ready if self.full(c)]
        if not ready or len(full) < len(ready):
            return None
        return max(c.upstream.queue_timeout for c in full)

    def released(self) -> None:
        """A lease was released: wake every call waiting for a slot."""
        if self._freed is not None:
            self._freed.set()
            self._freed = None

    def freed(self) -> asyncio.Event:
        """An event set at the next release of any lease."""
        if self._freed is None:
            self._freed = asyncio.Event()
        return self._freed
