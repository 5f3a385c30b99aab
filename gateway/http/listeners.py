"""What the kernel had already accepted when the gateway stops: answered, not reset.

uvicorn's shutdown closes its listening sockets first thing. A connection the kernel had
completed and queued there (the listen backlog: the event loop was busy, or the process had
not run since the signal) is then reset by the kernel, its request already sent: no answer
and no audit record. :func:`take_and_serve_queued` runs just before that close (``servers.
before_listeners_close``): new handshakes are stopped first (:func:`refuse_new_connections`,
one process only), then every connection still queued is accepted (``accept()`` until
``EAGAIN``) and handed to the server's own HTTP protocol, which serves its one request as
any connection made after a stop signal (``connections.ConnectionGuard``: read for
``SHUTDOWN_LISTEN_SECONDS``, answered, closed).

With ``--workers`` the listening socket is one socket shared by every process: a worker
must not stop handshakes (its siblings may serve on, e.g. during a SIGHUP restart), so
the parent does it when the whole gateway stops (``workers.WorkerSupervisor.terminate_all``)
and closes its own copy. A worker's stop may come first (systemd signals every process of
the unit at once, and the parent looks at its signals every 0.5 s): closed then, its copy
would leave the parent's to queue what no process serves, reset at the parent's close. So a
worker keeps accepting (one request per connection) until the socket drops new handshakes
(:func:`refusing_new_connections`: the parent is stopping) or :data:`WORKER_GRACE` has
passed (a worker stopped alone), then takes what is queued before it closes its copy.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import structlog

from gateway.http.connections import ConnectionGuard

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


def refusing_new_connections(sock: socket.socket) -> bool:
    """Whether the listening ``sock`` drops new handshakes (:func:`refuse_new_connections`
    ran on it, in any process sharing it)."""
    if not sys.platform.startswith("linux"):
        return False
    try:  # the kernel takes the length as a count of instructions; ours has one
        return bool(sock.getsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, FILTER_READ_BYTES))
    except OSError:
        return False


#: The buffer :func:`refusing_new_connections` reads a filter into (room for 64 instructions).
FILTER_READ_BYTES = 64 * 8

#: The most seconds a ``--workers`` worker keeps accepting after its stop signal, waiting for
#: the parent to stop new handshakes (the parent reacts within ~0.5 s when it stops too).
WORKER_GRACE = 3.0

#: Seconds between two looks at a shared listening socket, or at a handed-over connection.
POLL = 0.05


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


@contextlib.contextmanager
def _listeners(server: Any) -> Iterator[list[socket.socket]]:
    """The uvicorn ``server``'s listening sockets still open, as second references to each
    (closed on the way out, before uvicorn's close: the last reference is uvicorn's)."""
    duplicates = []
    try:
        for listener in getattr(server, "servers", []):
            for sock in listener.sockets or ():
                with contextlib.suppress(OSError, ValueError):
                    duplicates.append(socket.socket(fileno=os.dup(sock.fileno())))
        yield duplicates
    finally:
        for sock in duplicates:
            sock.close()


def take_queued(server: Any, refuse_new: bool) -> list[socket.socket]:
    """Accept what is queued on the uvicorn ``server``'s listening sockets (after stopping
    new handshakes when ``refuse_new``); the listeners themselves stay for uvicorn to close."""
    taken: list[socket.socket] = []
    with _listeners(server) as listeners:
        for listener in listeners:
            if refuse_new:
                refuse_new_connections(listener)
            listener.setblocking(False)  # already so (the loop's), stated: accept() must never wait
            taken += accept_queued(listener)
    return taken


async def until_the_parent_stops(server: Any, grace: float = WORKER_GRACE) -> bool:
    """In a ``--workers`` worker: wait (the loop accepting meanwhile) until the shared
    listening socket drops new handshakes, at most ``grace`` s; True when it does."""
    deadline = time.monotonic() + grace
    while True:
        with _listeners(server) as listeners:
            if not listeners or any(refusing_new_connections(sock) for sock in listeners):
                return True
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(POLL)


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
        await asyncio.sleep(POLL)


async def take_and_serve_queued(server: Any) -> None:
    """The hook run before uvicorn closes its listeners (see the module docstring): a
    single process stops new handshakes itself; a ``--workers`` worker waits for the parent
    to (bounded by :data:`WORKER_GRACE`). Every connection made from now on is one made
    after the stop signal (``ConnectionLimits.stopping``): one request, then closed; the
    open ones are told now, as uvicorn tells them after its close (a worker's wait would
    leave them serving as before meanwhile)."""
    limits = getattr(server.config.http_protocol_class, "limits", None)
    if limits is not None:
        limits.stopping = True
    for connection in list(server.server_state.connections):  # uvicorn's next step, before the wait
        if isinstance(connection, ConnectionGuard):
            connection.shutdown()  # idempotent: uvicorn calls it again after its close
    alone = server.config.workers <= 1
    if not alone and not await until_the_parent_stops(server):
        log.info("listener_left_to_siblings", waited_s=WORKER_GRACE)  # a worker stopped alone
    serve_taken(server, take_queued(server, refuse_new=alone))
