"""The upstream connection pool: one httpx client, the requests built for it, and the
count of what holds its connections.

:class:`UpstreamConnections` is the base of :class:`~gateway.upstream.client.UpstreamClient`:
it sends a request and waits, bounded, for its head; the client reads the body. Its
counters (responses open, pool-wait timeouts) live on the same object the readiness
check (``/readyz``) and the metrics sampler read.
"""

from __future__ import annotations

import socket
import time
from typing import Any

import anyio
import httpx
import orjson

from gateway.errors import GatewayError
from gateway.generation.policy import StreamPolicy
from gateway.upstream.credential import Credential
from gateway.upstream.failures import pool_exhausted

#: How long an idle upstream connection is kept for reuse (seconds): below the 5 s keep-alive
#: timeout of uvicorn (vLLM, SGLang, the simulator) and cpp-httplib (llama.cpp's server). At
#: httpx's default of 5 s the gateway reused connections the upstream was closing that moment.
KEEPALIVE_EXPIRY = 4.0

#: How a request on a pooled connection the upstream closed fails, before any answer byte.
_CLOSED_UNANSWERED = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)


#: The kernel receive buffer of each upstream connection (bytes; Linux doubles it for its
#: bookkeeping). Fixed, not autotuned: with a client that stops reading, the upstream read
#: pauses and this is all the kernel holds for it on our side (autotuned on loopback, it grew
#: to tens of MiB: the upstream ran that far ahead). 512 KiB still moves 5 MB/s at 100 ms RTT,
#: far above any token stream.
UPSTREAM_RECEIVE_BUFFER = 512 * 1024

#: After a pool-wait timeout, the pool counts as exhausted this long (readiness).
POOL_EXHAUSTED_HOLD = 5.0


class UpstreamConnections:
    """The pooled httpx client and its bookkeeping: each response the caller has not
    closed yet holds a connection (:attr:`open_responses`), and a request that waited for
    one in vain marks the pool exhausted for a while (:meth:`pool_exhausted`).

    The wait for a response head is an anyio scope, not ``asyncio.timeout``: httpcore
    releases a connection inside an anyio shield, which a native cancel goes through,
    leaving the connection checked out."""

    def __init__(
        self, max_connections: int = 1000, max_keepalive: int = 32, http: httpx.AsyncClient | None = None
    ) -> None:
        """``http``: an injected client (tests pass one on ``httpx.MockTransport``); by
        default a pooled one. Either way this object owns it and closes it."""
        self.max_connections = max_connections
        #: upstream responses open now (each holds a pool connection until closed)
        self.open_responses = 0
        self.pool_timeouts = 0  # requests refused for want of a pool connection, since start
        self._pool_timeout_at = float("-inf")  # monotonic time of the last one
        # a modest idle pool: httpcore scans every idle connection on each request, so a
        # large one costs more than the handshakes it saves (docs/performance.md)
        limits = httpx.Limits(
            max_connections=max_connections, max_keepalive_connections=max_keepalive, keepalive_expiry=KEEPALIVE_EXPIRY,
        )
        self._http = http or httpx.AsyncClient(
            transport=httpx.AsyncHTTPTransport(
                limits=limits, socket_options=[(socket.SOL_SOCKET, socket.SO_RCVBUF, UPSTREAM_RECEIVE_BUFFER)],
            ),
            limits=limits,  # the proxy transports' (an environment proxy)
            timeout=httpx.Timeout(120.0),
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    def pool_exhausted(self) -> bool:
        """Every pool connection is in use, or a request waited for one in vain in the
        last few seconds (``/readyz`` is red meanwhile)."""
        recent = time.monotonic() - self._pool_timeout_at < POOL_EXHAUSTED_HOLD
        return recent or self.open_responses >= self.max_connections

    def _build(
        self, credential: Credential, path: str, payload: dict[str, Any], policy: StreamPolicy,
        extra_headers: dict[str, str] | None, accept: str, root: bool = False,
    ) -> httpx.Request:
        """The POST of one attempt: the upstream's headers, the credential's key
        (``root``: ``path`` below the server root, the base URL without its ``/v1``)."""
        upstream = credential.upstream
        # content-type: servers that parse by it (FastAPI: llama-cpp-python) refuse a body
        # without it as "not a valid dictionary"
        headers = {**upstream.headers, **(extra_headers or {}), "content-type": "application/json", "accept": accept}
        if credential.api_key:
            headers["authorization"] = f"Bearer {credential.api_key}"
        timeout = httpx.Timeout(policy.idle_timeout, connect=policy.connect_timeout, pool=policy.pool_timeout)
        base = _server_root(upstream.base_url) if root else upstream.base_url.rstrip("/")
        return self._http.build_request(
            "POST", base + path, content=orjson.dumps(payload), headers=headers, timeout=timeout,
        )

    async def _answer_of(self, request: httpx.Request, policy: StreamPolicy, within: float) -> httpx.Response:
        """The upstream's response head within ``within`` seconds (an anyio scope: see the
        class), counted in :attr:`open_responses` until the caller closes it.

        The head may take all of ``within`` (the first-byte timeout), not the smaller
        ``--idle-timeout`` that is httpx's read timeout: that one is lifted to ``within``
        while the head is awaited, and back in place for the body's reads (httpcore reads
        the request's timeouts when the body's first read begins)."""
        timeouts = request.extensions.get("timeout")
        if isinstance(timeouts, dict) and timeouts.get("read") is not None:
            request.extensions["timeout"] = {**timeouts, "read": max(timeouts["read"], within)}
        try:
            with anyio.fail_after(within):
                response = await self._send(request)
        except httpx.PoolTimeout:
            self.pool_timeouts += 1
            self._pool_timeout_at = time.monotonic()
            raise pool_exhausted(policy.pool_timeout) from None
        except (TimeoutError, httpx.TimeoutException):
            raise GatewayError("timeout", "upstream_timeout", "the upstream did not answer in time") from None
        except httpx.HTTPError as exc:
            raise GatewayError("upstream", "upstream_unreachable", f"cannot reach the upstream: {type(exc).__name__}") from None
        finally:
            if timeouts is not None:
                request.extensions["timeout"] = timeouts  # each body read: --idle-timeout again
        self.open_responses += 1
        return response

    async def _send(self, request: httpx.Request) -> httpx.Response:
        """Send, and once more when the connection closed before any byte of an answer: a
        pooled keep-alive connection whose server timed it out just as the request went
        out (the server closes it unread, so nothing was generated). The dead connection
        has left the pool, so the second try opens or picks another; it fails as usual."""
        try:
            return await self._http.send(request, stream=True)
        except _CLOSED_UNANSWERED:
            return await self._http.send(request, stream=True)


def _server_root(base_url: str) -> str:
    """``http://host:port/v1`` -> ``http://host:port`` (an engine's own endpoints)."""
    return base_url.rstrip("/").removesuffix("/v1")
