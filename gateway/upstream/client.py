"""The upstream leg: one pooled httpx client, SSE read on bytes (:mod:`gateway.upstream.sse`).

The upstream is always asked for ``stream: true`` with ``include_usage``. Its failures
are translated here, at the boundary, into :class:`~gateway.errors.GatewayError` with the
most specific kind (so a 429 keeps its Retry-After, a 400 stays the client's fault), and
their text passes :data:`gateway.redact.SECRETS` (an upstream may echo our key).
"""

from __future__ import annotations

import email.utils
import re
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import httpx
import orjson

from gateway.errors import GatewayError
from gateway.policy import StreamPolicy
from gateway.redact import SECRETS
from gateway.stream.answer import DONE, Done
from gateway.upstream.bounds import AttemptBounds
from gateway.upstream.pool import Credential
from gateway.upstream.sse import SSEDataParser

__all__ = ["ANSWERED", "DONE", "Answered", "Done", "Send", "UpstreamClient", "UpstreamItem"]


class Answered:
    """The upstream answered 200 with its headers (the client's status may be committed)."""


ANSWERED = Answered()

UpstreamItem = dict[str, Any] | Done | Answered

#: One attempt's request: (credential, body, policy, extra headers) -> its items.
Send = Callable[[Credential, dict[str, Any], StreamPolicy, "dict[str, str] | None"], AsyncIterator[UpstreamItem]]


def parse_retry_after(value: str | None) -> int | None:
    """Seconds from a Retry-After header (delta-seconds or an HTTP date)."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return int(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0, int(when.timestamp() - time.time() + 0.999))


_TITLE = re.compile(rb"<title[^>]*>(.*?)</title>", re.IGNORECASE | re.DOTALL)
_TAGS = re.compile(rb"<(script|style)[^>]*>.*?</\1>|<[^>]+>", re.IGNORECASE | re.DOTALL)


def _upstream_message(body: bytes) -> str:
    """What the upstream said, in one short line: the ``error.message`` of a JSON error
    (or its string ``error``), the title or text of an HTML page, else the start of the
    body. Callers pass it through :data:`SECRETS` (the one redaction point)."""
    message: str | None = None
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        data = None
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            message = error["message"]
        elif isinstance(error, str):
            message = error
        elif isinstance(data.get("message"), str):
            message = data["message"]
    if message is None and body.lstrip()[:1] == b"<":
        title = _TITLE.search(body)
        raw = title.group(1) if title else _TAGS.sub(b" ", body)
        message = "an HTML page: " + " ".join(raw.decode("utf-8", "replace").split())[:200]
    if message is None:
        message = " ".join(body[:200].decode("utf-8", "replace").split())
    return message[:500]


def status_error(status: int, body: bytes, retry_after: int | None) -> GatewayError:
    """An upstream HTTP error status as the error the client should see."""
    detail = SECRETS.mask(_upstream_message(body))
    error = _status_error(status, detail, retry_after)
    error.upstream_status = status
    error.upstream_detail = detail  # type: ignore[attr-defined]  # the pool reads a 401/403's reason
    return error


def _status_error(status: int, detail: str, retry_after: int | None) -> GatewayError:
    if status == 429:
        return GatewayError(
            "rate_limit", "upstream_rate_limited", f"the upstream is rate limiting: {detail}",
            retry_after=retry_after if retry_after is not None else 1,
        )
    if status in (400, 413, 422):
        return GatewayError("invalid_request", "upstream_rejected", f"the upstream rejected the request: {detail}")
    if status == 404:
        return GatewayError("not_found", "upstream_not_found", f"the upstream does not know this: {detail}")
    if status in (401, 403):
        return GatewayError("upstream", "upstream_auth_failed", f"the upstream refused the gateway's credential ({status})")
    if status == 503:
        return GatewayError("overloaded", "upstream_unavailable", f"the upstream is unavailable: {detail}", retry_after=retry_after)
    if status in (408, 504):
        return GatewayError("timeout", "upstream_timeout", f"the upstream timed out ({status})")
    return GatewayError("upstream", "upstream_error", f"the upstream failed with HTTP {status}: {detail}")


#: How long an idle upstream connection is kept for reuse (seconds): below the 5 s keep-alive
#: timeout of uvicorn (vLLM, SGLang, the simulator) and cpp-httplib (llama.cpp's server). At
#: httpx's default of 5 s the gateway reused connections the upstream was closing that moment.
KEEPALIVE_EXPIRY = 4.0

#: How a request on a pooled connection the upstream closed fails, before any answer byte.
_CLOSED_UNANSWERED = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)


#: After a pool-wait timeout, the pool counts as exhausted this long (readiness).
POOL_EXHAUSTED_HOLD = 5.0


class UpstreamClient:
    """Sends chat requests upstream and yields their parsed SSE chunks.

    Every response is closed on every path (the ``finally`` of :meth:`_request`), and
    every wait is bounded: for a pool connection (``pool_timeout``), the headers
    (``first_byte_timeout``), each data-bearing event and the whole attempt
    (:class:`~gateway.upstream.bounds.AttemptBounds`). The waits that cancel are anyio
    scopes, not ``asyncio.timeout``: httpcore releases a connection inside an anyio
    shield, which a native cancel goes through, leaving the connection checked out."""

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
        self._http = http or httpx.AsyncClient(
            limits=httpx.Limits(
                max_connections=max_connections, max_keepalive_connections=max_keepalive,
                keepalive_expiry=KEEPALIVE_EXPIRY,
            ),
            timeout=httpx.Timeout(120.0),
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    def pool_exhausted(self) -> bool:
        """Every pool connection is in use, or a request waited for one in vain in the
        last few seconds (``/readyz`` is red meanwhile)."""
        recent = time.monotonic() - self._pool_timeout_at < POOL_EXHAUSTED_HOLD
        return recent or self.open_responses >= self.max_connections

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
                answer = await _within(bounds, _json_answer(response))
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
        class), counted in :attr:`open_responses` until the caller closes it."""
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
        self.open_responses += 1
        return response

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

    async def _send(self, request: httpx.Request) -> httpx.Response:
        """Send, and once more when the connection closed before any byte of an answer: a
        pooled keep-alive connection whose server timed it out just as the request went
        out (the server closes it unread, so nothing was generated). The dead connection
        has left the pool, so the second try opens or picks another; it fails as usual."""
        try:
            return await self._http.send(request, stream=True)
        except _CLOSED_UNANSWERED:
            return await self._http.send(request, stream=True)

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
            if not buffered and not _is_event_stream(response):
                # a 200 that is no stream: an error body, an HTML page, nothing, or a
                # JSON answer from a server that ignored stream: true
                answer = _answer_not_streamed(await _within(bounds, _read_capped(response)))
                yield ANSWERED
                for chunk in completion_as_chunks(answer):
                    yield chunk
                yield DONE
                return
            yield ANSWERED
            if buffered:
                for chunk in completion_as_chunks(await _within(bounds, _json_answer(response))):
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


def _server_root(base_url: str) -> str:
    """``http://host:port/v1`` -> ``http://host:port`` (an engine's own endpoints)."""
    return base_url.rstrip("/").removesuffix("/v1")


def read_failed(exc: httpx.HTTPError) -> GatewayError:
    """An answer's body that stopped coming (a read timeout) or broke off, after its head."""
    if isinstance(exc, httpx.TimeoutException):
        return GatewayError("timeout", "upstream_idle_timeout", "the upstream went silent mid-answer")
    return GatewayError("upstream", "upstream_disconnected", f"the upstream connection broke: {type(exc).__name__}")


def pool_exhausted(waited: float) -> GatewayError:
    """No upstream connection came free in time: local, retryable, no credential's fault."""
    return GatewayError(
        "overloaded", "upstream_pool_exhausted",
        f"every upstream connection is in use (waited {waited:g} s); retry shortly", retry_after=1,
    )


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


#: How much of a 200 body that is not a stream is read to find out what it says.
NON_STREAM_MAX_BYTES = 4 * 1024 * 1024


def _is_event_stream(response: httpx.Response) -> bool:
    return response.headers.get("content-type", "").partition(";")[0].strip().lower() == "text/event-stream"


async def _read_capped(response: httpx.Response) -> bytes:
    body = bytearray()
    async for piece in response.aiter_bytes():
        body += piece
        if len(body) > NON_STREAM_MAX_BYTES:
            break
    return bytes(body)


def empty_answer() -> GatewayError:
    return GatewayError("upstream", "upstream_empty_response", "the upstream answered 200 with an empty body")


def _answer_not_streamed(body: bytes) -> dict[str, Any]:
    """A 200 body without SSE framing: a ``chat.completion`` to relay, or the error it is."""
    if not body.strip():
        raise empty_answer()
    try:
        answer = orjson.loads(body)
    except orjson.JSONDecodeError:
        answer = None
    if isinstance(answer, dict) and isinstance(answer.get("choices"), list) and not answer.get("error"):
        return answer
    raise GatewayError(
        "upstream", "upstream_error",
        f"the upstream answered 200 without a stream: {SECRETS.mask(_upstream_message(body))}",
    )


def refuses_streaming(error: GatewayError) -> bool:
    """An upstream 4xx that says it cannot stream (for ``--upstream-stream auto``)."""
    return error.upstream_status in (400, 404, 415, 422, 501) and "stream" in error.message.lower()


async def _json_answer(response: httpx.Response) -> dict[str, Any]:
    try:
        answer = orjson.loads(await response.aread())
    except orjson.JSONDecodeError:
        raise GatewayError("upstream", "upstream_bad_frame", "the upstream answer is not JSON") from None
    if not isinstance(answer, dict):
        raise GatewayError("upstream", "upstream_bad_frame", "the upstream answer is not a JSON object")
    if answer.get("error"):
        return {"error": SECRETS.mask_value(answer["error"])}
    return answer


def completion_as_chunks(answer: dict[str, Any]) -> list[dict[str, Any]]:
    """A non-streaming ``chat.completion`` as the stream chunks it is equivalent to, so the
    accumulator, the modes and the encoders treat a buffered answer like any other."""
    if answer.get("error"):
        return [answer]
    chunks: list[dict[str, Any]] = []
    for choice in answer.get("choices") or ():
        message = choice.get("message") or {}
        delta: dict[str, Any] = {"role": "assistant"}
        for key in ("content", "reasoning_content", "reasoning", "refusal"):
            if message.get(key):
                delta[key] = message[key]
        calls = message.get("tool_calls") or []
        if calls:
            delta["tool_calls"] = [
                {"index": i, "id": c.get("id"), "type": "function",
                 "function": {"name": (c.get("function") or {}).get("name"),
                              "arguments": (c.get("function") or {}).get("arguments") or ""}}
                for i, c in enumerate(calls)
            ]
        elif isinstance(message.get("function_call"), dict):
            # the legacy shape alone (beside tool_calls it is the same call again, and
            # llama-cpp-python may even misspell its name there): the accumulator's rule
            delta["function_call"] = message["function_call"]
        out: dict[str, Any] = {"index": choice.get("index", 0), "delta": delta,
                               "finish_reason": choice.get("finish_reason")}
        for key in ("logprobs", "token_ids"):
            if choice.get(key) is not None:
                out[key] = choice[key]
        chunk: dict[str, Any] = {"choices": [out]}
        if answer.get("prompt_token_ids") is not None:
            chunk["prompt_token_ids"] = answer["prompt_token_ids"]
        chunks.append(chunk)
    if answer.get("usage"):
        chunks.append({"choices": [], "usage": answer["usage"]})
    return chunks
