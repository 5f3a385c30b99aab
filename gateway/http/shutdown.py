"""Graceful shutdown with a deadline.

On SIGTERM (or SIGINT) uvicorn stops accepting connections and waits for the open ones;
:class:`GracefulShutdown` adds the deadline: open requests may finish for
``--shutdown-timeout`` seconds, then every generation still running is ended with the
named error ``server_shutting_down`` (the room's in-stream error event once a stream is
committed, else a 503 with the room's error body) and its upstream is closed, so every
request still gets exactly one audit record. The app's lifespan then flushes the audit
and capture writers. uvicorn's own ``timeout_graceful_shutdown`` is set a few seconds
past the deadline as the last resort for a client that does not read its error event.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

import structlog

from gateway.errors import ErrorCode, GatewayError

log = structlog.get_logger("gateway.shutdown")


def shutting_down_error() -> GatewayError:
    return GatewayError(
        "overloaded", ErrorCode.SERVER_SHUTTING_DOWN, "the gateway is shutting down; retry the request", retry_after=1
    )


class GracefulShutdown:
    """The deadline after a stop signal: wait for open generations, then end the rest."""

    def __init__(
        self,
        timeout: float,
        abort_all: Callable[[GatewayError], int],
        in_flight: Callable[[], int],
        on_cut: Callable[[int], None] | None = None,
    ) -> None:
        self.timeout = timeout
        self.abort_all = abort_all
        self.in_flight = in_flight
        self.on_cut = on_cut
        self.started_at: float | None = None
        self.cut = 0
        self._task: asyncio.Task[None] | None = None

    @property
    def begun(self) -> bool:
        return self.started_at is not None

    def begin(self) -> None:
        """Start the deadline (idempotent; call on the event loop)."""
        if self.started_at is not None:
            return
        self.started_at = time.monotonic()
        log.info("shutdown_started", in_flight=self.in_flight(), deadline_s=self.timeout)
        self._task = asyncio.get_running_loop().create_task(self._deadline(), name="shutdown-deadline")

    async def _deadline(self) -> None:
        deadline = time.monotonic() + self.timeout
        while self.in_flight() and time.monotonic() < deadline:
            await asyncio.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
        if not self.in_flight():
            log.info("shutdown_drained", waited_s=round(time.monotonic() - (self.started_at or 0), 2))
            return
        self.cut = self.abort_all(shutting_down_error())
        if self.on_cut is not None:
            self.on_cut(self.cut)
        log.warning("shutdown_deadline", cut=self.cut, timeout_s=self.timeout)

    async def aclose(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
