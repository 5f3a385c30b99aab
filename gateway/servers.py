"""Running ASGI apps under uvicorn inside an existing event loop (embedded simulator, tests)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator

import uvicorn
from starlette.types import ASGIApp


class EmbeddedServer(uvicorn.Server):
    """A uvicorn server that leaves signal handling to whoever owns the process."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    def install_signal_handlers(self) -> None:  # uvicorn < 0.29
        pass


def bind_loopback(port: int = 0, host: str = "127.0.0.1") -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


async def start_embedded(app: ASGIApp, sock: socket.socket, **config: object) -> tuple[EmbeddedServer, asyncio.Task[None]]:
    """Serve ``app`` on an already-bound socket; returns once it accepts connections."""
    # log_config/log_level None and access_log on: uvicorn then leaves the process's
    # logging alone (access_log=False would detach "uvicorn.access" process-wide)
    settings: dict[str, object] = {"log_config": None, "log_level": None, "access_log": True, "lifespan": "on"}
    server = EmbeddedServer(uvicorn.Config(app, **(settings | config)))  # type: ignore[arg-type]
    task = asyncio.create_task(server.serve(sockets=[sock]))
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
