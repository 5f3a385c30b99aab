"""What the kernel had already accepted when the gateway stops: answered, not reset.

uvicorn's shutdown closes its listening sockets first thing. A connection the kernel had
completed and queued there (the listen backlog: the event loop was busy, or the process had
not run since the signal) is then reset by the kernel, its request already sent: no answer
and no audit record. :func:`take_queued` runs just before that close (``servers.
before_listeners_close``): new handshakes are stopped first (:func:`refuse_new_connections`,
one process only), then every connection still queued is accepted (``accept()`` until
``EAGAIN``) and handed to the server's own HTTP protocol, which serves its one request as
any connection made after a stop signal (``connections.ConnectionGuard``: read for
``SHUTDOWN_LISTEN_SECONDS``, answered, closed).

With ``--workers`` the listening socket is one socket shared by every process: a worker
must not stop handshakes (its siblings may serve on, e.g. during a SIGHUP restart), so
the parent does it when the whole gateway stops (``workers.WorkerSupervisor.terminate_all``)
and closes its own copy, and each worker takes what is queued before it closes its.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import socket
import sys
from collections.abc import Callable
from typing import Any

import structlog

log = structlog.get_logger("gateway.listeners")

#: Linux's ``SO_ATTACH_FILTER`` (absent from Python's socket module).
SO_ATTACH_FILTER = 26

#: The most connections taken from one listening socket (Linux caps a backlog at 65535).
MAX_TAKEN = 65535


class _SockFilter(ctypes.Structure):
    """``struct sock_filter``: one classic BPF instruction."""

    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    """``struct sock_fprog``: a classic BPF program."""

    _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(_SockFilter))]


def refuse_new_connections(sock: socket.socket) -> bool:
    """Drop every packet that would make a new connection on the listening ``sock`` (a
    one-instruction socket filter, ``ret 0``), so nothing joins its queue any more while it
    is emptied and closed. A client whose SYN is dropped sends it again after ~1 s and finds
    the port closed (connection refused): it never had a connection to lose. Connections
    already queued keep working (a child socket takes its listener's filter when it is
    made). False where this is not Linux or the kernel refused the filter."""
    if not sys.platform.startswith("linux"):
        return False
    drop = _SockFilter(0x06, 0, 0, 0)  # BPF_RET | BPF_K, 0: keep no byte of the packet
    program = _SockFprog(1, ctypes.pointer(drop))
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, bytes(program))  # copied by the kernel
    except OSError as exc:
        log.warning("listener_filter_refused", error=exc.strerror or type(exc).__name__)
        return False
    return True


def accept_queued(sock: socket.socket, limit: int = MAX_TAKEN) -> list[socket.socket]:
    """Every connection queued on the non-blocking listening ``sock``, accepted now."""
    taken: list[socket.socket] = []
    while len(taken) < limit:
        try:
            conn, _ = sock.accept()
        except (BlockingIOError, InterruptedError):
            break
        except ConnectionAbortedError:  # the client gave up while queued
            continue
        except OSError as exc:  # out of descriptors: what is left is lost, as before
            log.warning("listener_backlog_left", error=exc.strerror or type(exc).__name__, taken=len(taken))
            break
        conn.setblocking(False)
        taken.append(conn)
    return taken


def _listening_fds(server: Any) -> list[int]:
    """The descriptors of the uvicorn ``server``'s listening sockets still open."""
    fds = []
    for listener in getattr(server, "servers", []):
        for sock in listener.sockets or ():
            with contextlib.suppress(OSError, ValueError):
                if sock.fileno() >= 0:
                    fds.append(sock.fileno())
    return fds


def take_queued(server: Any, refuse_new: bool) -> list[socket.socket]:
    """Accept what is queued on the uvicorn ``server``'s listening sockets (after stopping
    new handshakes when ``refuse_new``); the listeners themselves stay for uvicorn to close."""
    taken: list[socket.socket] = []
    for fd in _listening_fds(server):
        listener = socket.socket(fileno=os.dup(fd))  # a second reference: closed below, before uvicorn's close
        try:
            if refuse_new:
                refuse_new_connections(listener)
            listener.setblocking(False)  # already so (the loop's), stated: accept() must never wait
            taken += accept_queued(listener)
        finally:
            listener.close()
    return taken


def serve_taken(server: Any, taken: list[socket.socket]) -> None:
    """Hand each taken connection to the uvicorn ``server``'s HTTP protocol, as its own
    listener would have. Each hand-over is one of the server's tasks until its connection
    closes: uvicorn's shutdown waits for its tasks (bounded by its graceful timeout, which
    cancels them) before the app's lifespan ends, and a connection made this late may not
    be among the connections it looked at."""
    if not taken:
        return
    config = server.config
    loop = asyncio.get_running_loop()

    def protocol() -> asyncio.Protocol:
        made: asyncio.Protocol = config.http_protocol_class(
            config=config, server_state=server.server_state, app_state=server.lifespan.state
        )
        return made

    tasks: set[asyncio.Task[None]] = server.server_state.tasks
    for conn in taken:
        task = loop.create_task(_serve_one(loop, protocol, conn, config.ssl, server.server_state.connections))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    log.info("shutdown_backlog_taken", connections=len(taken))


#: Seconds between two looks at whether a handed-over connection has closed (uvicorn's own pace).
CLOSED_POLL = 0.1


async def _serve_one(
    loop: asyncio.AbstractEventLoop, protocol: Callable[[], asyncio.Protocol], conn: socket.socket, ssl: Any,
    connections: set[Any],
) -> None:
    try:
        _, made = await loop.connect_accepted_socket(protocol, conn, ssl=ssl)
    except OSError:  # the client left meanwhile
        conn.close()
        return
    while made in connections:  # until it closes: answered (or cut at the deadline), or idle 1 s
        await asyncio.sleep(CLOSED_POLL)


def take_and_serve_queued(server: Any) -> None:
    """The hook run before uvicorn closes its listeners (see the module docstring): a
    single process stops new handshakes itself, a ``--workers`` worker leaves that to the
    parent. Every connection made from now on is one made after the stop signal
    (``ConnectionLimits.stopping``): one request, then closed."""
    limits = getattr(server.config.http_protocol_class, "limits", None)
    if limits is not None:
        limits.stopping = True
    serve_taken(server, take_queued(server, refuse_new=server.config.workers <= 1))
