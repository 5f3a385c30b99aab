"""Upstream failures as the :class:`~gateway.errors.GatewayError` the client sees.

Pure (the I/O is :mod:`gateway.upstream.client`'s): an HTTP error status gets the most
specific kind (so a 429 keeps its Retry-After, a 400 stays the client's fault), a 200
body without SSE framing is either a ``chat.completion`` to relay or the error it is,
and a body read that broke off, a pool with no free connection and a 4xx that refuses
streaming each get their own error. The upstream's own text passes
:data:`gateway.redact.SECRETS` here (an upstream may echo our key).
"""

from __future__ import annotations

import email.utils
import re
import time
from typing import Any

import httpx
import orjson

from gateway.errors import GatewayError
from gateway.redact import SECRETS


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


def upstream_message(body: bytes) -> str:
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
    detail = SECRETS.mask(upstream_message(body))
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


def empty_answer() -> GatewayError:
    return GatewayError("upstream", "upstream_empty_response", "the upstream answered 200 with an empty body")


def answer_not_streamed(body: bytes) -> dict[str, Any]:
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
        f"the upstream answered 200 without a stream: {SECRETS.mask(upstream_message(body))}",
    )


def refuses_streaming(error: GatewayError) -> bool:
    """An upstream 4xx that says it cannot stream (for ``--upstream-stream auto``)."""
    return error.upstream_status in (400, 404, 415, 422, 501) and "stream" in error.message.lower()
