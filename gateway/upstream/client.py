"""The upstream leg: requests on the pooled httpx client (:mod:`gateway.upstream.connections`),
SSE read on bytes (:mod:`gateway.upstream.sse`).

The upstream is always asked for ``stream: true`` with ``include_usage``. Its failures
are translated at this boundary (:mod:`gateway.upstream.failures`) into
:class:`~gateway.errors.GatewayError` with the most specific kind (so a 429 keeps its
Retry-After, a 400 stays the client's fault), and their text passes
:data:`gateway.redact.SECRETS` (an upstream may echo our key). An answer that comes as
one JSON body is read and reshaped into chunks by :mod:`gateway.upstream.json_answers`.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import httpx
import orjson

from gateway.errors import GatewayError
from gateway.generation.policy import StreamPolicy
from gateway.redact import SECRETS
from gateway.stream.answer import DONE, Done
from gateway.upstream.bounds import AttemptBounds
from gateway.upstream.connections import UpstreamConnections
from gateway.upstream.credential import Credential
from gateway.upstream.failures import (
    answer_not_streamed,
    empty_answer,
    parse_retry_after,
    read_failed,
    refuses_streaming,
    status_error,
)
from gateway.upstream.json_answers import (
    completion_as_chunks,
    is_event_stream,
    read_capped,
    read_json_answer,
)
from gateway.upstream.sse import SSEDataParser

__all__ = ["ANSWERED", "DONE", "Answered", "Done", "Send", "UpstreamClient", "UpstreamItem"]


class Answered:
    """The upstream answered 200 with its headers (the client's status may be committed)."""


ANSWERED = Answered()

UpstreamItem = dict[str, Any] | Done | Answered

#: One attempt's request: (credential, body, policy, extra headers) -> its items.
Send = Callable[[Credential, dict[str, Any], StreamPolicy, "dict[str, str] | None"], AsyncIterator[UpstreamItem]]


class UpstreamClient(UpstreamConnections):
    """Sends chat requests upstream and yields their parsed SSE chunks (the pool, the
    request heads and their counters are :class:`~gateway.upstream.connections.UpstreamConnections`).

    Every response is closed on every path (the ``finally`` of :meth:`_request`), and
    every wait is bounded: for a pool connection (``pool_timeout``), the headers
    (``first_byte_timeout``), each data-bearing event and the whole attempt
    (:class:`~gateway.upstream.bounds.AttemptBounds`). The waits that cancel are anyio
    scopes, not ``asyncio.timeout``: httpcore releases a connection inside an anyio
    shield, which a native cancel goes through, leaving the connection checked out."""

    async def probe(self, credential: Credential, timeout: float = 10.0) -> tuple[bool, str]:
        """``GET {base_url}/models`` with the credential's key: (works, what happened).
        Cheap on every OpenAI-compatible server, and it needs the key to be accepted."""
        headers = {**credential.upstream.headers, "accept": "application/json"}
        if credential.api_key:
            headers["authorization"] = f"Bearer {credential.api_key}"
        try:
            response = await self._http.get(
                credential.upstream.base_url.rstrip("/") + "/models", headers=headers, timeout=timeout
            )
        except httpx.HTTPError as exc:
            return False, type(exc).__name__
        return 200 <= response.status_code < 300, f"HTTP {response.status_code}"

    def stream_chat(
        self, credential: Credential, body: dict[str, Any], policy: StreamPolicy,
        extra_headers: dict[str, str] | None = None,
    ) -> AsyncIterator[UpstreamItem]:
        """Yield ANSWERED once the upstream says 200, then each chunk, then DONE if sent.

        ``policy.upstream_stream``: ``always`` streams; ``never`` asks for one JSON answer
        and yields it as chunks (the rest of the gateway cannot tell); ``auto`` streams and
        falls back to a JSON answer when the upstream refuses ``stream: true``, or answers
        it with a 200 and nothing in it (llama-cpp-python on a tool choice it cannot
        stream): nothing has reached the client then, so asking again is safe.
        ``extra_headers``: per-attempt headers (the W3C ``traceparent`` with tracing on).
        Raises GatewayError for every failure; the caller closes the generator to cancel.
        """
        if policy.upstream_stream != "auto":  # no fallback to wrap it in: one generator less per chunk
            return self._request(credential, body, policy, policy.upstream_stream == "never", extra_headers)
        return self._stream_or_json(credential, body, policy, extra_headers)

    def stream_path(self, path: str, root: bool = False) -> Send:
        """An attempt's send for a route relayed as the upstream streams it (``/completions``):
        ANSWERED, the chunks as sent, DONE — the same reading as chat, another path
        (``root``: below the server's root, not the ``/v1`` base URL: llama.cpp's ``/completion``)."""

        def send(credential: Credential, body: dict[str, Any], policy: StreamPolicy,
                 extra_headers: dict[str, str] | None = None) -> AsyncIterator[UpstreamItem]:
            return self._request(credential, body, policy, False, extra_headers, path, root)

        return send

    async def post_json(
        self, credential: Credential, path: str, payload: dict[str, Any], policy: StreamPolicy, root: bool = False,
    ) -> Any:
        """One small JSON request to the upstream (an engine's ``/tokenize``), bounded by
        the first-byte and attempt timeouts; its JSON answer, or GatewayError."""
        bounds = AttemptBounds(policy.idle_timeout, policy.attempt_timeout, policy.max_empty_events, time.monotonic())
        request = self._build(credential, path, payload, policy, None, "application/json", root)
        response = await self._answer_of(request, policy, min(policy.first_byte_timeout, policy.attempt_timeout))
        try:
            content = await _within(bounds, response.aread())
            if response.status_code != 200:
                raise status_error(response.status_code, content, None)
            return orjson.loads(content)
        except orjson.JSONDecodeError:
            raise GatewayError("upstream", "upstream_bad_frame", "the upstream answer is not JSON") from None
        except httpx.HTTPError as exc:
            raise read_failed(exc) from None
        finally:
            self.open_responses -= 1
            await response.aclose()

    def json_path(self, path: str) -> Send:
        """An attempt's send for one JSON answer relayed whole (``/embeddings``, a
        ``/completions`` the client did not stream): ANSWERED, then the answer object."""

        async def send(credential: Credential, body: dict[str, Any], policy: StreamPolicy,
                       extra_headers: dict[str, str] | None = None) -> AsyncIterator[UpstreamItem]:
            bounds = AttemptBounds(policy.idle_timeout, policy.attempt_timeout, policy.max_empty_events, time.monotonic())
            request = self._build(credential, path, body, policy, extra_headers, "application/json")
            response = await self._answer_of(request, policy, min(policy.first_byte_timeout, policy.attempt_timeout))
            try:
                if response.status_code != 200:
                    content = await _within(bounds, response.aread())
                    raise status_error(response.status_code, content, parse_retry_after(response.headers.get("retry-after")))
                answer = await _within(bounds, read_json_answer(response))
                if answer.get("error"):
                    raise GatewayError("upstream", "upstream_error", f"the upstream reported an error: {answer['error']}")
                yield ANSWERED
                yield answer
            except httpx.HTTPError as exc:
                raise read_failed(exc) from None
            finally:
                self.open_responses -= 1
                await response.aclose()

        return send

    async def _stream_or_json(
        self, credential: Credential, body: dict[str, Any], policy: StreamPolicy,
        extra_headers: dict[str, str] | None,
    ) -> AsyncIterator[UpstreamItem]:
        """``auto``: the stream, or the JSON answer when the stream is refused or empty."""
        answered = relayed = False
        try:
            async for item in self._request(credential, body, policy, False, extra_headers):
                answered = answered or item is ANSWERED
                relayed = relayed or item is not ANSWERED
                yield item
        except GatewayError as err:
            empty = err.code == "upstream_empty_response" and not relayed
            if not (refuses_streaming(err) or empty):
                raise
            # (a server that failed inside its stream closes that connection: if the pool
            # hands it out again at once, _send tries once more on another)
            async for item in self._request(credential, body, policy, True, extra_headers):
                if not (item is ANSWERED and answered):  # said once per attempt
                    yield item

    async def _request(
        self, credential: Credential, body: dict[str, Any], policy: StreamPolicy, buffered: bool,
        extra_headers: dict[str, str] | None = None, path: str = "/chat/completions", root: bool = False,
    ) -> AsyncIterator[UpstreamItem]:
        if buffered:
            payload = dict(body, stream=False)
        else:
            payload = dict(body, stream=True, stream_options={"include_usage": True})
        accept = "application/json" if buffered else "text/event-stream"
        bounds = AttemptBounds(policy.idle_timeout, policy.attempt_timeout, policy.max_empty_events, time.monotonic())
        request = self._build(credential, path, payload, policy, extra_headers, accept, root)
        response = await self._answer_of(request, policy, min(policy.first_byte_timeout, policy.attempt_timeout))
        bounds.answered(time.monotonic())
        try:
            if response.status_code != 200:
                content = await response.aread()
                raise status_error(
                    response.status_code, content, parse_retry_after(response.headers.get("retry-after"))
                )
            if not buffered and not is_event_stream(response):
                # a 200 that is no stream: an error body, an HTML page, nothing, or a
                # JSON answer from a server that ignored stream: true
                answer = answer_not_streamed(await _within(bounds, read_capped(response)))
                yield ANSWERED
                for chunk in completion_as_chunks(answer):
                    yield chunk
                yield DONE
                return
            yield ANSWERED
            if buffered:
                for chunk in completion_as_chunks(await _within(bounds, read_json_answer(response))):
                    yield chunk
                yield DONE
                return
            reads = response.aiter_bytes()
            parser = SSEDataParser()
            got_data = False
            async for read in reads:
                # the bounds are checked as each read arrives (a clock read, no cancel
                # scope per read: that cost more than the parse); a read that never comes
                # is httpx's read timeout, --idle-timeout, so a bound is late by at most
                # the gap between two reads
                now = time.monotonic()
                if now >= bounds.deadline:
                    raise bounds.expired(now)
                for data in parser.feed(read):
                    if not data:
                        continue
                    got_data = True
                    if data == b"[DONE]":
                        yield DONE
                        await _drain(reads)
                        return
                    chunk = _frame(data)
                    bounds.event(chunk, now)
                    if isinstance(chunk, dict):
                        yield SECRETS.mask_value(chunk) if chunk.get("error") else chunk
            if not got_data:
                raise empty_answer()
        except httpx.HTTPError as exc:
            raise read_failed(exc) from None
        finally:
            self.open_responses -= 1
            await response.aclose()


async def _within(bounds: AttemptBounds, read: Any) -> Any:
    """Await a whole-body read within the attempt's total bound (an anyio scope: see
    :class:`UpstreamClient`)."""
    with anyio.move_on_after(bounds.total_deadline - time.monotonic()):
        return await read
    raise bounds.expired(time.monotonic())  # only reached when the scope cut the read


def _frame(data: bytes) -> Any:
    """One event's JSON. Bytes that are not UTF-8 (a server cutting a character between
    tokens) become U+FFFD, as a text decoder would, instead of failing the answer."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        pass
    try:
        return orjson.loads(data.decode("utf-8", "replace"))
    except orjson.JSONDecodeError:
        raise GatewayError("upstream", "upstream_bad_frame", "the upstream sent a frame that is not JSON") from None


#: After ``[DONE]``, how long to wait for the body's end so the connection can be reused.
DRAIN_SECONDS = 1.0


async def _drain(events: AsyncIterator[Any]) -> None:
    """Read to the end of the body: httpcore only pools a connection whose response was
    read completely (closing early costs a new TCP/TLS connection per request)."""
    try:
        with anyio.move_on_after(DRAIN_SECONDS):  # anyio, not asyncio.timeout: see UpstreamClient
            async for _ in events:
                pass
    except httpx.HTTPError:
        pass

