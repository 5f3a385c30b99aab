"""Graceful shutdown with a deadline.

On SIGTERM (or SIGINT) uvicorn stops accepting connections and waits for the open ones;
:class:`GracefulShutdown` adds the deadline: open requests may finish for
``--shutdown-timeout`` seconds, then every generation still running is ended with the
named error ``server_shutting_down`` (the room's in-stream error event once a stream is
committed, else a 503 with the room's error body) and its upstream is closed, so every
request still gets exactly one audit record. The app's lifespan then flushes the audit
and capture writers. uvicorn's own ``timeout_graceful_shutdown`` is set a few seconds
past the deadline as the last resort for a client that does not read its error event.

A Responses WebSocket drains the same way (:class:`DrainingWebSockets`, the ``ws``
protocol ``serve`` runs): uvicorn would close every open one at once with 1012, cutting
the turn in flight; instead the connection's application is told (its :class:`DrainHook`),
finishes the turn (or has it cut at the deadline), answers any frame that asks for a new
one with the wrapped ``server_shutting_down`` error, then closes with 1012 (service
restart: reconnect).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import structlog

from gateway.errors import ErrorCode, GatewayError
from gateway.tasks import stop_tasks

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
        await stop_tasks(self._task)


#: The scope key of an accepted WebSocket's :class:`DrainHook`.
DRAIN_HOOK = "gateway.drain"


class DrainHook:
    """Where the application serving one WebSocket leaves what to do on a stop signal
    (``drain``: finish what is in flight, then close); None: uvicorn's close at once."""

    def __init__(self) -> None:
        self.drain: Callable[[], None] | None = None


def _draining_websockets() -> type[asyncio.Protocol]:
    from uvicorn.protocols.websockets.auto import AutoWebSocketsProtocol

    base: Any = AutoWebSocketsProtocol

    class DrainingWebSockets(base):  # type: ignore[misc]
        """uvicorn's WebSocket protocol, but a stop signal is handed to the application when
        it took the drain hook (the Responses WebSocket), instead of a 1012 close at once."""

        async def run_asgi(self) -> None:
            self.drain_hook = self.scope[DRAIN_HOOK] = DrainHook()  # type: ignore[typeddict-unknown-key]
            await super().run_asgi()

        def shutdown(self) -> None:
            hook: DrainHook | None = getattr(self, "drain_hook", None)
            if hook is None or hook.drain is None or getattr(self, "close_sent", False) or self.transport.is_closing():
                super().shutdown()
                return
            hook.drain()

    return DrainingWebSockets


#: The ``ws`` protocol ``serve`` runs (by import string: ``--workers`` processes load it too).
DrainingWebSockets = _draining_websockets()
DRAINING_WEBSOCKETS = "gateway.http.shutdown:DrainingWebSockets"
