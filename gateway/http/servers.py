"""Running ASGI apps under uvicorn inside an existing event loop (embedded simulator, tests)."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import signal
import socket
import threading
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import structlog
import uvicorn
from starlette.types import ASGIApp


class EmbeddedServer(uvicorn.Server):
    """A uvicorn server that leaves signal handling to whoever owns the process."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    def install_signal_handlers(self) -> None:  # uvicorn < 0.29
        pass


class _QuietEmbeddedLifecycle(logging.Filter):
    """Drop an embedded server's own uvicorn start/stop lines (below WARNING): they would
    repeat the main server's "Started server process" and "Uvicorn running on" lines."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or "component" not in structlog.contextvars.get_contextvars()


def _quiet_embedded_lifecycle() -> None:
    error_logger = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, _QuietEmbeddedLifecycle) for f in error_logger.filters):
        error_logger.addFilter(_QuietEmbeddedLifecycle())


def bind_loopback(port: int = 0, host: str = "127.0.0.1") -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


async def start_embedded(
    app: ASGIApp, sock: socket.socket, label: str | None = None, **config: object
) -> tuple[EmbeddedServer, asyncio.Task[None]]:
    """Serve ``app`` on an already-bound socket; returns once it accepts connections.

    ``label`` tags every log line the server writes (``component=simulator``) and drops
    its start/stop lines, so an embedded server's uvicorn lines never pass for the
    gateway's own."""
    # log_config/log_level None and access_log on: uvicorn then leaves the process's
    # logging alone (access_log=False would detach "uvicorn.access" process-wide)
    settings: dict[str, object] = {"log_config": None, "log_level": None, "access_log": True, "lifespan": "on"}
    server = EmbeddedServer(uvicorn.Config(app, **(settings | config)))  # type: ignore[arg-type]
    context = contextvars.copy_context()
    if label:
        context.run(structlog.contextvars.bind_contextvars, component=label)
        _quiet_embedded_lifecycle()
    task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]), context=context)
    while not server.started:
        if task.done():
            task.result()  # re-raise a start-up failure
            raise RuntimeError("embedded server stopped before it started")
        await asyncio.sleep(0.005)
    return server, task


async def stop_embedded(server: EmbeddedServer, task: asyncio.Task[None]) -> None:
    server.should_exit = True
    with contextlib.suppress(asyncio.CancelledError):
        await task


def on_server_exit(callback: Callable[[], None]) -> bool:
    """Call ``callback`` on the event loop as soon as the uvicorn server running this
    process is told to exit (SIGTERM/SIGINT), before it waits on open connections.

    uvicorn installs its handlers with ``signal.signal`` for the length of ``serve()``
    (one process or each ``--workers`` worker); this wraps them. Returns False (nothing
    installed) when no uvicorn server owns the signals, e.g. an embedded test server."""
    loop = asyncio.get_running_loop()
    installed = False
    for sig in (signal.SIGINT, signal.SIGTERM):
        previous = signal.getsignal(sig)
        server = _server_of(previous)
        if server is None:
            continue

        def handler(signum: int, frame: Any, previous: Any = previous) -> None:
            loop.call_soon_threadsafe(callback)
            previous(signum, frame)

        handler.uvicorn_server = server  # type: ignore[attr-defined]
        signal.signal(sig, handler)
        installed = True
    return installed


def _server_of(handler: Any) -> uvicorn.Server | None:
    """The uvicorn server whose signal handler ``handler`` is (or wraps)."""
    server = getattr(handler, "__self__", None) or getattr(handler, "uvicorn_server", None)
    return server if isinstance(server, uvicorn.Server) else None


def before_listeners_close(hook: Callable[[uvicorn.Server], Awaitable[None]]) -> bool:
    """Await ``hook(server)`` when the uvicorn server running this process begins its
    shutdown, before it closes its listening sockets (the first thing its ``shutdown`` does,
    with no wait in between): what the kernel queued there is still there. The hook bounds
    its own wait (it holds up the whole shutdown). Found, as
    :func:`on_server_exit` finds it, through the signal handlers it installed for ``serve()``;
    False (nothing installed) when none owns them, e.g. an embedded test server."""
    server = _server_of(signal.getsignal(signal.SIGTERM))
    if server is None:
        return False
    shutdown = server.shutdown

    async def shutdown_after_hook(sockets: list[socket.socket] | None = None) -> None:
        try:
            await hook(server)
        except Exception:  # never in the way of the shutdown itself
            structlog.get_logger("gateway.shutdown").exception("before_listeners_close_failed")
        await shutdown(sockets=sockets)

    server.shutdown = shutdown_after_hook  # type: ignore[method-assign]
    return True


def on_hangup(callback: Callable[[], None]) -> Callable[[], None] | None:
    """Call ``callback`` on the event loop at each SIGHUP (the reload of ``--config``);
    returns the function that removes the handler, or None where this process's main
    thread does not run this loop (an embedded test server) or the platform has no SIGHUP.
    uvicorn leaves SIGHUP alone in a single process (its ``--workers`` supervisor answers
    it in the parent by replacing the workers)."""
    hup = getattr(signal, "SIGHUP", None)
    if hup is None or threading.current_thread() is not threading.main_thread():
        return None
    loop = asyncio.get_running_loop()
    try:
        loop.add_signal_handler(hup, callback)
    except (ValueError, RuntimeError, NotImplementedError):
        return None
    return lambda: loop.remove_signal_handler(hup)
