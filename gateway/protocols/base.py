"""What every protocol room provides, and the pieces they share.

A room (``chat``, ``responses``, ``messages``) parses its request into a
:class:`ParsedRequest` (the upstream chat body plus what the encoder and the validator
need), encodes canonical events into its SSE frames, builds its JSON answer, and renders
a :class:`~gateway.errors.GatewayError` in its own error shape.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

import orjson
from pydantic import ValidationError

from gateway.errors import GatewayError, invalid_request
from gateway.protocols.envelope import ANONYMOUS_TENANT, Tenant
from gateway.protocols.fields import check_item_limits, check_value_limits
from gateway.stream.accumulator import ToolRules
from gateway.stream.events import Completion, Event

FactsT = TypeVar("FactsT")


@dataclass(frozen=True, slots=True)
class ParsedRequest(Generic[FactsT]):
    """A validated client request, translated for the upstream. Frozen: a step that
    completes it (``resolve``) returns a new one."""

    protocol: str
    model: str
    stream: bool
    upstream_body: dict[str, Any]  # the Chat Completions body, minus stream settings
    rules: ToolRules = field(default_factory=ToolRules)
    #: the room's own facts for its encoder and JSON answer: a frozen dataclass per room
    #: (``ChatFacts``, ``MessagesFacts``, ``ResponsesFacts``)
    facts: FactsT = None  # type: ignore[assignment]
    #: who asked (its client identity owns stored state) and the keys its envelopes use
    tenant: Tenant = ANONYMOUS_TENANT
    #: the output cap the gateway granted (a managed key with token limits): the answer is
    #: cut there even when the engine ignores the cap it was sent (gateway/stream/output_cap.py)
    output_cap: int | None = None


class StreamEncoder(Protocol):
    """Canonical events -> this protocol's SSE bytes, for one response."""

    def start(self) -> bytes:
        """The frames that open the stream (sent when the status line is committed)."""

    def encode(self, event: Event) -> bytes:
        """One event's frames (possibly none)."""


class ProtocolRoom(Protocol):
    name: str
    #: True when a block must close before the next starts (realtime holds back).
    sequential_blocks: bool

    def parse(self, body: bytes, query: dict[str, str], tenant: Tenant = ANONYMOUS_TENANT) -> ParsedRequest:
        """``tenant``: the client's, whose envelopes (if the room has any) are opened here."""

    async def resolve(self, request: ParsedRequest) -> ParsedRequest:
        """The request completed with stored state (e.g. previous_response_id), as a new
        request (the parsed one is left as it was); may raise."""

    async def completed(
        self, request: ParsedRequest, response_id: str, completion: Completion, encoder: StreamEncoder | None
    ) -> None:
        """Called once after a successful answer, before the client sees its end (streamed:
        before the terminal frame is released), so a next turn always finds it."""

    def encoder(self, request: ParsedRequest, response_id: str) -> StreamEncoder: ...

    def new_response_id(self) -> str: ...

    def json_body(self, request: ParsedRequest, response_id: str, completion: Completion) -> dict: ...

    def error_body(self, error: GatewayError) -> dict: ...


def load_json_object(body: bytes | str, what: str = "the request body",
                     precheck: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """``body`` (``what``: the request body, a WebSocket frame) as a JSON object within the
    value limits (depth, string size, finite numbers: ``fields.check_value_limits``), or a
    named 400 ``invalid_json``. ``precheck`` sees the object before those limits walk it
    (a cheap refusal of what a walk would take long over)."""
    if not body.strip():
        raise invalid_request(f"{what} is empty; expected a JSON object", code="invalid_json")
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise invalid_request(f"{what} is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(value, dict):
        raise invalid_request(f"{what} must be a JSON object", code="invalid_json")
    if precheck is not None:
        precheck(value)
    check_item_limits(value)
    check_value_limits(value)
    return value


_UNION_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "literal"})


def _is_union_tag(segment: object) -> bool:
    """Pydantic puts the tried union member in the error path (``input.str``); clients
    should see the field they sent, not our type names."""
    if not isinstance(segment, str):
        return False
    return segment.lower() in _UNION_TAGS or "[" in segment or segment.startswith(("function-", "lax-", "json-"))


#: Error codes the request models raise by name (``PydanticCustomError(code, ...)``).
NAMED_CODES = frozenset({"invalid_tool_schema"})


def validation_error(exc: ValidationError) -> GatewayError:
    """A pydantic error as a 400 naming the offending field: of a union's failed branches the
    deepest (``messages.0.content.0.text``, not "content should be a string")."""
    err = max(exc.errors(), key=lambda e: sum(not _is_union_tag(p) for p in e["loc"]))
    param = ".".join(str(p) for p in err["loc"] if not _is_union_tag(p)) or None
    if err["type"] == "missing":
        message = f"missing required parameter: {param!r}"
        code = "missing_required_parameter"
    elif err["type"] in NAMED_CODES:  # our own PydanticCustomError: its type is the code
        message = f"invalid value for {param!r}: {err['msg']}"
        code = err["type"]
    else:
        message = f"invalid value for {param!r}: {err['msg']}"
        code = "invalid_type" if err["type"].endswith("_type") else "invalid_value"
    return invalid_request(message, param=param, code=code)


def sse(data: bytes, event: str | None = None) -> bytes:
    """One SSE frame. ``data`` must be a single line (compact JSON is)."""
    if event is None:
        return b"data: " + data + b"\n\n"
    return b"event: " + event.encode() + b"\ndata: " + data + b"\n\n"


def dumps(value: Any) -> bytes:
    return orjson.dumps(value)
