"""Bounds on TCP connections, below ASGI: a header timeout and a cap per peer address.

uvicorn times out idle keep-alive connections, but not a connection that has not finished
sending a request's headers: 1,500 sockets sending one header line every 5 s stayed open
indefinitely. This module adds, as a subclass of uvicorn's own HTTP protocol class (passed
as ``http=``; the parser, flow control and WebSocket upgrade stay uvicorn's):

- **Header timeout** (``--header-timeout``): from the moment a connection is made, and again
  from the end of each answer, the next request's headers must be complete within the
  timeout, else the connection is closed (silently, as uvicorn closes idle keep-alives).
  A request whose headers arrived is never cut by it, however long its answer streams.
- **Connections per peer address** (``--max-connections-per-ip``): the TCP connections open
  at once from one address, HTTP and upgraded WebSockets alike, loopback included (the peer
  address of the socket: a proxy in front shares one). Past it a new connection is
  answered ``503`` with an OpenAI-shaped error body and closed before it is read.
- **A stalled reader holds the gateway back**: each client socket has a fixed send buffer
  (:data:`CLIENT_SEND_BUFFER`), so the server's send waits instead of the kernel taking MiBs.
- **A stop signal** (:meth:`ConnectionGuard.shutdown`): an idle connection is still read for
  :data:`SHUTDOWN_LISTEN_SECONDS`; a request already on its way is answered, not reset (one
  whose first bytes came, headers not yet whole, gets the header timeout from those bytes).
  A connection made after it (taken from the listen backlog, ``listeners.py``) is treated so
  from the start.
- **Lingering close** (:class:`LingeringClose`): an answer sent before the request's body
  was read is followed by a half-close and a bounded drain, so the client reads its 401 or
  413 instead of a connection reset.

:class:`ConnectionLimits` is the pure state (counts per address); the protocol class is the
thin shell. ``serve`` uses :data:`PROCESS_PROTOCOL` (by import string, so ``--workers``
processes load it too, each configuring its own limits from its settings).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from typing import Any, ClassVar

import orjson
import structlog

log = structlog.get_logger("gateway.connections")

#: The kernel send buffer of each client connection (bytes; Linux doubles it). Fixed, not
#: autotuned (up to 4 MiB): what a client that stops reading has not taken waits there, and a
#: realtime answer keeps what it has relayed, so this bounds both per stalled reader. 256 KiB
#: still moves ~5 MB/s at 100 ms RTT, far above any token stream.
CLIENT_SEND_BUFFER = 256 * 1024

#: On a stop signal, how long an idle connection is still read for a request already on its
#: way (sent just before the signal, not yet parsed): answered, then closed, not reset.
SHUTDOWN_LISTEN_SECONDS = 1.0

#: Seconds between two warnings about refused or timed-out connections (never one line each).
WARN_EVERY = 60.0


class ConnectionLimits:
    """Open connections per peer address, and what was refused or timed out."""

    def __init__(self, header_timeout: float = 10.0, max_per_ip: int = 256) -> None:
        self.header_timeout = header_timeout
        self.max_per_ip = max_per_ip
        self.open: dict[str, int] = {}  # no zero entries
        self.refused = 0
        self.timed_out = 0
        self._warned_at = 0.0
        self.stopping = False  # the server is stopping: a connection made now gets one request

    def configure(self, header_timeout: float, max_per_ip: int) -> None:
        self.header_timeout = header_timeout
        self.max_per_ip = max_per_ip

    def admit(self, address: str) -> bool:
        """Count one more connection from ``address``, or refuse it (not counted) at the cap."""
        if self.open.get(address, 0) >= self.max_per_ip:
            self.refused += 1
            self._warn()
            return False
        self.open[address] = self.open.get(address, 0) + 1
        return True

    def release(self, address: str) -> None:
        left = self.open.get(address, 1) - 1
        if left > 0:
            self.open[address] = left
        else:
            self.open.pop(address, None)

    def timed_out_one(self) -> None:
        self.timed_out += 1
        self._warn()

    def _warn(self) -> None:
        now = time.monotonic()
        if now - self._warned_at >= WARN_EVERY:
            self._warned_at = now
            log.warning("connections_bounded", refused_per_ip=self.refused, header_timeouts=self.timed_out,
                        max_per_ip=self.max_per_ip, header_timeout=self.header_timeout)


def _too_many_connections(limit: int) -> bytes:
    body = orjson.dumps({"error": {
        "message": f"too many connections from your address (limit {limit}): close some and retry",
        "type": "server_error", "param": None, "code": "too_many_connections",
    }})
    head = (f"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nretry-after: 5\r\nconnection: close\r\n\r\n").encode()
    return head + body


#: After an answer sent before its request body was read (401, 413, 503), the most seconds
#: and bytes the connection still reads and discards before it closes (nginx's
#: ``lingering_close``; its ``lingering_time`` is 30 s, a gateway's clients stop sooner).
LINGER_SECONDS = 5.0
LINGER_BYTES = 64 * 1024 * 1024


class LingeringTransport:
    """The transport the HTTP protocol and its request cycles hold: ``close()`` asks the
    protocol whether to linger first; everything else is the real transport's."""

    def __init__(self, raw: asyncio.Transport, protocol: LingeringClose) -> None:
        self._raw = raw
        self._protocol = protocol

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)

    def close(self) -> None:
        if not self._protocol.linger():
            self._raw.close()

    def is_closing(self) -> bool:
        return self._protocol.lingering or self._raw.is_closing()


class LingeringClose:
    """Mixin for a uvicorn HTTP protocol class: close after an early answer the way web
    servers do (lingering close).

    A request refused before its body was read (a missing key, a body over
    ``--max-body-bytes``) is answered and closed while the client is still sending. Closed
    at once, the kernel answers the client's next bytes with a reset, and a reset can
    destroy the answer in the client's receive buffer: the client sees ``ECONNRESET``
    instead of its 401 or 413. So the connection half-closes (FIN after the answer), reads
    and discards what still comes for at most :data:`LINGER_SECONDS` and
    :data:`LINGER_BYTES`, and closes when the client closes or a bound is reached."""

    transport: Any
    loop: asyncio.AbstractEventLoop
    cycle: Any

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)  # type: ignore[misc]
        self.lingering = False
        self._raw_transport = transport
        self._linger_left = LINGER_BYTES
        self._linger_timer: asyncio.TimerHandle | None = None
        self.transport = LingeringTransport(transport, self)

    def linger(self) -> bool:
        """Called for ``close()``: True when the close became a lingering one."""
        raw = self._raw_transport
        if self.lingering:
            return True
        unread = (self.cycle is not None and self.cycle.response_complete and self.cycle.more_body
                  and raw.get_protocol() is self and not raw.is_closing() and raw.can_write_eof())
        if not unread:
            return False
        self.lingering = True
        raw.write_eof()  # the answer, then FIN
        raw.resume_reading()
        self._linger_timer = self.loop.call_later(LINGER_SECONDS, raw.close)
        return True

    def data_received(self, data: bytes) -> None:
        if not self.lingering:
            super().data_received(data)  # type: ignore[misc]
            return
        self._linger_left -= len(data)
        if self._linger_left <= 0:
            self._raw_transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if getattr(self, "_linger_timer", None) is not None:
            self._linger_timer.cancel()  # type: ignore[union-attr]
            self._linger_timer = None
        super().connection_lost(exc)  # type: ignore[misc]


class ConnectionGuard:
    """Mixin for a uvicorn HTTP protocol class (``HttpToolsProtocol``, ``H11Protocol``).

    Both create ``self.cycle`` when a request's headers are complete and call
    ``on_response_complete`` after each answer; that is all the timer relies on."""

    limits: ClassVar[ConnectionLimits]
    transport: asyncio.Transport
    loop: asyncio.AbstractEventLoop
    cycle: Any

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)  # type: ignore[misc]
        peer = transport.get_extra_info("peername")
        self._address = str(peer[0]) if peer else ""
        self._counted = self.limits.admit(self._address)
        self._header_timer: asyncio.TimerHandle | None = None
        self._stopping = False  # a stop signal came: no request after the one being answered
        self._begun_at: float | None = None  # loop time of a next request's first bytes
        if not self._counted:
            transport.write(_too_many_connections(self.limits.max_per_ip))
            transport.close()
            return
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, CLIENT_SEND_BUFFER)
        if self.limits.stopping:  # taken from the listen backlog at the stop (gateway/http/listeners.py)
            self.shutdown()
        else:
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._release()
        super().connection_lost(exc)  # type: ignore[misc]

    def data_received(self, data: bytes) -> None:
        if self._begun_at is None and data and not self._answering() and not getattr(self, "lingering", False):
            self._begun_at = self.loop.time()  # a request is on its way (headers not yet whole)
        super().data_received(data)  # type: ignore[misc]

    def on_headers_complete(self) -> None:  # httptools' parser callback (h11's protocol has none)
        super().on_headers_complete()  # type: ignore[misc]
        if self._stopping and self.cycle is not None:
            self.cycle.keep_alive = False  # the last request here: its answer says "connection: close"

    def on_response_complete(self) -> None:
        super().on_response_complete()  # type: ignore[misc]
        self._begun_at = None
        if self._stopping:
            self._close_if_idle()  # answered during the drain: nothing more on this connection
        elif not self.transport.is_closing() and not self._answering():
            self._arm()  # the next request's headers, from now (a pipelined one already has them)

    def shutdown(self) -> None:
        """A stop signal. uvicorn closes an idle connection at once, and so resets a request
        the client sent just before (still in the socket buffer, or its headers half parsed):
        no answer and no audit record. Instead it is read for :data:`SHUTDOWN_LISTEN_SECONDS`
        more; a request that arrives is answered (``connection: close``), then the connection
        closes. A request whose first bytes came but whose headers are not whole then (a slow
        or busy client) gets the header timeout from those first bytes, as it would have
        without the signal (bounded still by ``--shutdown-timeout``)."""
        if self._stopping:
            return  # already listening its last second (a connection made after the stop)
        if self.transport.is_closing() or self._answering():
            super().shutdown()  # type: ignore[misc]
            return
        self._stopping = True
        self._disarm()
        self._header_timer = self.loop.call_later(SHUTDOWN_LISTEN_SECONDS, self._listened_last)

    def _listened_last(self) -> None:
        """The stop's listening second is over: close, unless a request is on its way."""
        self._header_timer = None
        if self._begun_at is not None and not self._answering():
            left = self._begun_at + self.limits.header_timeout - self.loop.time()
            if left > 0:
                self._header_timer = self.loop.call_later(left, self._close_if_idle)
                return
        self._close_if_idle()

    def _close_if_idle(self) -> None:
        if not self.transport.is_closing() and not self._answering():
            self.transport.close()

    def handle_websocket_upgrade(self, *args: Any) -> None:
        """The transport goes to the WebSocket protocol, which gets our ``connection_lost``
        duty: the count is released when the socket really closes."""
        self._disarm()
        super().handle_websocket_upgrade(*args)  # type: ignore[misc]
        protocol = self.transport.get_protocol()
        if protocol is self:
            return
        lost = protocol.connection_lost

        def connection_lost(exc: Exception | None) -> None:
            try:
                lost(exc)
            finally:
                self._release()

        protocol.connection_lost = connection_lost  # type: ignore[method-assign]

    def _answering(self) -> bool:
        """A request whose headers arrived is being answered (never cut by the timer)."""
        return self.cycle is not None and not self.cycle.response_complete

    def _release(self) -> None:
        if self._counted:
            self._counted = False
            self.limits.release(self._address)

    def _arm(self) -> None:
        self._disarm()
        self._waiting_for = self.cycle
        self._header_timer = self.loop.call_later(self.limits.header_timeout, self._header_timeout)

    def _disarm(self) -> None:
        timer = getattr(self, "_header_timer", None)
        if timer is not None:
            timer.cancel()
            self._header_timer = None

    def _header_timeout(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or self.transport.get_protocol() is not self:
            return
        if self.cycle is not self._waiting_for or self._answering():
            return  # a request's headers arrived meanwhile
        self.limits.timed_out_one()
        self.transport.close()


def protocol_class(limits: ConnectionLimits) -> type[asyncio.Protocol]:
    """A guarded subclass of uvicorn's HTTP protocol (httptools when installed, else h11),
    sharing ``limits`` among its connections."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as Base
    except ImportError:  # pragma: no cover - httptools is a dependency of uvicorn[standard]
        from uvicorn.protocols.http.h11_impl import H11Protocol as Base  # type: ignore[assignment]
    return type("Guarded" + Base.__name__, (ConnectionGuard, LingeringClose, Base), {"limits": limits})


#: This process's limits (configured from its settings by :func:`configure_process`) ...
PROCESS_LIMITS = ConnectionLimits()
#: ... and the protocol class ``serve`` names by import string (workers import it too).
GuardedProtocol = protocol_class(PROCESS_LIMITS)
PROCESS_PROTOCOL = "gateway.http.connections:GuardedProtocol"


class RefusedUpgradeFilter(logging.Filter):
    """Drops uvicorn's "ASGI callable returned without completing handshake." error: its
    WebSocket protocol logs it after every upgrade the app refused with a
    ``websocket.http.response`` (401, 403, 503 here), which is a complete answer, not a bug;
    kept, every hostile socket would cost an ERROR line (the gateway logs its own warning)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != "ASGI callable returned without completing handshake."


def configure_process(settings: Any) -> None:
    """Apply ``--header-timeout`` and ``--max-connections-per-ip`` to this process's server."""
    PROCESS_LIMITS.configure(settings.header_timeout, settings.max_connections_per_ip)
    error_log = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, RefusedUpgradeFilter) for f in error_log.filters):
        error_log.addFilter(RefusedUpgradeFilter())


def server_options(settings: Any) -> dict[str, Any]:
    """uvicorn options for the guarded protocol (this process configured first)."""
    configure_process(settings)
    return {"http": PROCESS_PROTOCOL}
