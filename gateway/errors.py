"""The gateway's one error type, in protocol-neutral terms.

Each protocol room renders a :class:`GatewayError` in its own shape (an OpenAI
``{"error": {...}}`` body, an Anthropic ``{"type": "error", ...}`` body, or the
matching in-stream error event). ``kind`` says what went wrong for the client; ``code``
names the precise reason and is stable for clients and dashboards to match on.

kind -> HTTP status -> codes (an :class:`ErrorCode`, str-valued so the JSON is unchanged):

=================  ======  ==========================================================
kind               status  codes
=================  ======  ==========================================================
invalid_request    400     invalid_json, invalid_request, invalid_type, invalid_value,
                           missing_required_parameter, n_not_supported,
                           unsupported_tool_choice, unsupported_tool_type,
                           duplicate_tool_name, previous_response_not_found,
                           upstream_rejected (the upstream's 400/413/422),
                           too_many_queued_frames (a WebSocket client past the bound),
                           invalid_tool_schema (unsafe to evaluate: stream/schema_guard.py),
                           too_many_messages, too_many_input_items, too_many_tools,
                           too_many_stop_sequences, too_many_content_parts,
                           too_many_tool_calls, too_many_values (fields.py item limits);
                   405     method_not_allowed (a known route, another method)
authentication     401     invalid_api_key (also a revoked or expired managed key)
permission         403     cross_origin, forbidden_host (a web page's request on /v1:
                           gateway/http/cross_site.py), model_not_allowed (outside the
                           managed key's model globs: gateway/keys/), rollout_forbidden
                           (a rollout id of another client key: gateway/rollout/owners.py)
                   409     rollout_frozen; 410 rollout_deleted (a rollout id an admin deleted
                           less than 24 h ago)
not_found          404     upstream_not_found, response_not_found, model_not_found,
                           not_found (no such route)
too_large          413     request_too_large (the body is over --max-body-bytes)
rate_limit         429     upstream_rate_limited, no_upstream_available (all cool down),
                           rate_limited (a managed key's rpm / tpm), budget_exceeded
                           (its daily_tokens), concurrency_limited (its max_concurrent)
upstream           502     upstream_error, upstream_unreachable, upstream_disconnected,
                           upstream_bad_frame, upstream_auth_failed, upstream_incomplete,
                           tool_call_invalid, tool_identity_changed, empty_response,
                           response_too_large, failover_exhausted, model_not_available
timeout            504     upstream_timeout, upstream_idle_timeout, upstream_attempt_timeout,
                           upstream_empty_events (gateway/upstream/bounds.py)
overloaded         503     capacity_exceeded, upstream_unavailable, upstream_capacity,
                           upstream_pool_exhausted (no pool connection in time),
                           server_shutting_down, too_many_request_bytes
                           (--max-body-bytes-in-flight), parser_busy (body_work's
                           workers full), too_many_websockets (a WebSocket
                           upgrade past --ws-max-connections: no request, no record),
                           store_unavailable (a stored response cannot be read now),
                           recording_unavailable (no record could be kept: refused),
                           key_store_unavailable (a managed key with limits could
                           not reserve in time: refused, fail closed),
                           engine_paused (held in the gateway while the engines were
                           paused for a weight update, past --engine-pause-max)
internal           500     internal_error
(no status)        499     client_disconnected (audit only: the client went away)
=================  ======  ==========================================================
"""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

ErrorKind = Literal[
    "invalid_request",  # 400: the client's request is wrong; nothing was sent upstream
    "authentication",  # 401
    "permission",  # 403
    "not_found",  # 404
    "too_large",  # 413: the request body is over --max-body-bytes
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
    "too_large": 413,
    "rate_limit": 429,
    "upstream": 502,
    "timeout": 504,
    "overloaded": 503,
    "internal": 500,
}


class ErrorCode(StrEnum):
    """Codes compared across modules (the table above lists every code by kind)."""

    INVALID_REQUEST = "invalid_request"
    INVALID_JSON = "invalid_json"
    INVALID_API_KEY = "invalid_api_key"
    CAPACITY_EXCEEDED = "capacity_exceeded"
    UPSTREAM_UNREACHABLE = "upstream_unreachable"
    UPSTREAM_TIMEOUT = "upstream_timeout"
    TOOL_CALL_INVALID = "tool_call_invalid"
    TOOL_IDENTITY_CHANGED = "tool_identity_changed"
    RESPONSE_TOO_LARGE = "response_too_large"
    REQUEST_TOO_LARGE = "request_too_large"
    UPSTREAM_INCOMPLETE = "upstream_incomplete"
    EMPTY_RESPONSE = "empty_response"
    SERVER_SHUTTING_DOWN = "server_shutting_down"
    INTERNAL_ERROR = "internal_error"
    CLIENT_DISCONNECTED = "client_disconnected"
    ENGINE_PAUSED = "engine_paused"


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
