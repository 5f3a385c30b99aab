"""What one generation request did, and who is told about it.

The gateway fills one :class:`RequestRecord` per generation request. Its
:class:`RequestObserver` is told when the request starts (``on_start``) and, exactly
once, when it ends (``on_finish``: success, error, cancelled, invalid or refused — written
by :class:`gateway.generation.outcome.RequestOutcome`). Audit, metrics and logs all read the same record.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(slots=True)
class RequestRecord:
    """What one generation request did; handed to the record sink exactly once."""

    request_id: str
    protocol: str
    started_at: float
    transport: str = "http"  # http | websocket (Responses over GET /v1/responses upgraded)
    mode: str = ""
    streamed: bool = False
    model: str = ""  # as the client asked
    upstream_model: str = ""  # as sent upstream
    outcome: str = "error"  # success | error | cancelled | invalid | refused
    error_code: str | None = None
    error_message: str | None = None  # the error's one line, as the client was told (masked in the audit)
    http_status: int = 200
    finish_reason: str | None = None
    ttfb_ms: float | None = None  # first byte sent to the client
    ttft_ms: float | None = None  # first content delta (text, reasoning, tool arguments) written
    first_keepalive_ms: float | None = None  # first keepalive sent while the client waited
    duration_ms: float = 0.0
    ended_at: float = 0.0
    output_bytes: int = 0
    tool_calls: int = 0
    keepalives: int = 0
    budget_exceeded: bool = False
    client_key_fingerprint: str | None = None
    key_id: str | None = None  # the managed client key (gateway/keys/), when one was used
    key_name: str | None = None
    usage: dict[str, int] = field(default_factory=dict)
    cost: float | None = None  # usage priced by the --config model tables (None: no price or no usage)
    upstream_attempts: list[dict[str, Any]] = field(default_factory=list)  # fingerprint, status, ms
    repairs: list[dict[str, Any]] = field(default_factory=list)  # kind, outcome, usage
    bodies: dict[str, Any] | None = None  # only with --audit-bodies
    traceparent: str | None = None  # the client's W3C trace context, when it sent one
    trace_context: str | None = None  # tracing on: this request span's traceparent (its trace id)


class RequestObserver(Protocol):
    """Told when a generation request starts and, exactly once, when it ends."""

    def on_start(self, record: RequestRecord) -> None: ...

    def on_finish(self, record: RequestRecord) -> None: ...
