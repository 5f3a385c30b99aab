"""The gateway's one error type, in protocol-neutral terms.

Each protocol room renders a :class:`GatewayError` in its own shape (an OpenAI
``{"error": {...}}`` body, an Anthropic ``{"type": "error", ...}`` body, or the
matching in-stream error event). ``kind`` says what went wrong for the client; ``code``
names the precise reason and is stable for clients and dashboards to match on.
"""

from __future__ import annotations

from typing import Literal

ErrorKind = Literal[
    "invalid_request",  # 400: the client's request is wrong; nothing was sent upstream
    "authentication",  # 401
    "permission",  # 403
    "not_found",  # 404
    "rate_limit",  # 429 (Retry-After carried)
    "upstream",  # 502: the upstream failed or answered something unusable
    "timeout",  # 504: the upstream did not answer in time
    "overloaded",  # 503: no capacity here or upstream
    "internal",  # 500: a bug of ours
]

STATUS_BY_KIND: dict[ErrorKind, int] = {
    "invalid_request": 400,
    "authentication": 401,
    "permission": 403,
    "not_found": 404,
    "rate_limit": 429,
    "upstream": 502,
    "timeout": 504,
    "overloaded": 503,
    "internal": 500,
}


class GatewayError(Exception):
    """A failure with everything a protocol needs to report it."""

    def __init__(
        self,
        kind: ErrorKind,
        code: str,
        message: str,
        *,
        param: str | None = None,
        status: int | None = None,
        retry_after: int | None = None,
        upstream_status: int | None = None,
    ) -> None:
        super().__init__(message)
        self.kind: ErrorKind = kind
        self.code = code
        self.message = message
        self.param = param
        self.status = status if status is not None else STATUS_BY_KIND[kind]
        self.retry_after = retry_after
        self.upstream_status = upstream_status  # the upstream's HTTP status, when it gave one

    def __repr__(self) -> str:
        return f"GatewayError({self.kind!r}, {self.code!r}, {self.message!r})"


def invalid_request(message: str, param: str | None = None, code: str = "invalid_request") -> GatewayError:
    return GatewayError("invalid_request", code, message, param=param)
