"""The listen backlog at a stop (gateway/http/listeners.py): new handshakes dropped, what the
kernel queued accepted and served, on real loopback sockets and an embedded uvicorn server.
The whole process under SIGTERM: tests/http/test_shutdown_drain.py (fault suite)."""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Iterator

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from gateway.http.connections import ConnectionLimits, protocol_class
from gateway.http.listeners import (
    accept_queued,
    refuse_new_connections,
    refusing_new_connections,
    take_and_serve_queued,
    until_the_parent_stops,
)
from gateway.http.servers import bind_loopback, start_embedded, stop_embedded
from tests.conftest import ServerLoop

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a Linux socket filter")


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    sock = bind_loopback()
    sock.listen(16)
    yield sock
    sock.close()


def connect(sock: socket.socket, timeout: float = 10) -> socket.socket:
    return socket.create_connection(sock.getsockname(), timeout=timeout)


@linux_only
def test_a_refusing_listener_completes_no_new_handshake_and_keeps_what_it_queued(listener: socket.socket) -> None:
    queued = [connect(listener) for _ in range(3)]
    for i, client in enumerate(queued):
        client.sendall(b"request %d" % i)
    assert not refusing_new_connections(listener)
    assert refuse_new_connections(listener)
    with socket.socket(fileno=os.dup(listener.fileno())) as shared:  # as another process holds it
        assert refusing_new_connections(shared)
    with pytest.raises(TimeoutError):  # its SYN dropped: no connection to lose
        connect(listener, timeout=0.5)
    listener.setblocking(False)
    taken = accept_queued(listener)
    assert len(taken) == 3 and accept_queued(listener) == []  # EAGAIN: the queue is empty
    for conn in taken:
        conn.setblocking(True)
        got = conn.recv(100)
        conn.sendall(b"answer to " + got)
    assert sorted(client.recv(100) for client in queued) == [b"answer to request %d" % i for i in range(3)]
    for s in (*queued, *taken):
        s.close()


def test_accept_queued_stops_at_its_limit(listener: socket.socket) -> None:
    clients = [connect(listener) for _ in range(3)]
    listener.setblocking(False)
    first = accept_queued(listener, limit=2)
    rest = accept_queued(listener)
    assert (len(first), len(rest)) == (2, 1)
    for s in (*clients, *first, *rest):
        s.close()


async def hello(request: Request) -> PlainTextResponse:
    return PlainTextResponse("hello " + request.url.path.strip("/"))


def read_to_close(sock: socket.socket) -> bytes:
    sock.settimeout(30)
    got = b""
    while piece := sock.recv(65536):
        got += piece
    return got


def test_the_backlog_taken_at_a_stop_is_served_one_request_each_then_closed(server_loop: ServerLoop) -> None:
    """On the server's loop, and so with nothing accepted meanwhile: 5 clients connect and send
    a request, then the stop's hook runs and the listener closes as uvicorn closes it. Each
    client gets its answer, marked ``connection: close``, and then the close; a client after
    that is refused."""
    limits = ConnectionLimits(max_per_ip=1 << 20)
    sock = bind_loopback()
    address = sock.getsockname()
    server, task = server_loop.run(start_embedded(Starlette(routes=[Route("/{name}", hello)]), sock,
                                                  http=protocol_class(limits)))

    async def queue_then_stop() -> list[socket.socket]:
        clients = [socket.create_connection(address, timeout=10) for _ in range(5)]
        for i, client in enumerate(clients):
            client.sendall(f"GET /client{i} HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n".encode())
        await take_and_serve_queued(server)  # one process: no wait
        for listening in server.servers:  # what uvicorn's shutdown does first
            listening.close()
        return clients

    clients = server_loop.run(queue_then_stop())
    try:
        answers = [read_to_close(client) for client in clients]
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(address, timeout=10)
    finally:
        server_loop.run(stop_embedded(server, task))
        for client in clients:
            client.close()
    assert limits.stopping
    for i, answer in enumerate(answers):
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200") and b"\r\nconnection: close" in head, answer
        assert body == f"hello client{i}".encode()


@linux_only
def test_a_worker_waits_for_the_parent_to_stop_new_handshakes_within_its_grace(server_loop: ServerLoop) -> None:
    """A ``--workers`` worker's stop keeps its listener until the shared socket drops new
    handshakes (the parent stopping too), or its grace is over (a worker stopped alone)."""
    sock = bind_loopback()
    server, task = server_loop.run(start_embedded(Starlette(routes=[Route("/{name}", hello)]), sock))
    try:
        assert server_loop.run(until_the_parent_stops(server, grace=0.2)) is False
        with socket.socket(fileno=os.dup(sock.fileno())) as parent_copy:
            refuse_new_connections(parent_copy)
        assert server_loop.run(until_the_parent_stops(server, grace=30)) is True
    finally:
        server_loop.run(stop_embedded(server, task))
