"""Anthropic Messages: the room (parse, stream encoder, JSON answer, errors); the
count_tokens endpoint is in gateway/routes/generation.py.

Wire contracts the anthropic SDK's stream accumulator enforces (see
docs/protocols/messages.md): every frame has an ``event:`` line (frames without one are
dropped silently); ``message_start`` comes first; ``content_block_start`` *appends*, so
block indexes are exactly 0, 1, 2... in order of start, and a block is closed before the
next opens (``sequential_blocks``); tool input streams as ``input_json_delta``;
``message_delta`` carries ``stop_reason`` and ``usage``; ``message_stop`` comes last; the
keepalive is the native ``ping``; a mid-stream failure is ``event: error`` and ends the
stream (no ``message_stop`` after it).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gateway.errors import GatewayError
from gateway.protocols.base import ParsedRequest, dumps, sse
from gateway.protocols.envelope import ANONYMOUS_TENANT, Tenant
from gateway.protocols.messages.translate import translate
from gateway.protocols.tokens import count_chat_tokens, count_text, quick_token_estimate
from gateway.stream.accumulator import parse_arguments
from gateway.stream.events import (
    BlockDelta,
    BlockStart,
    BlockStop,
    Completion,
    Error,
    Event,
    Finish,
    Keepalive,
    Usage,
)

ERROR_TYPES = {
    "invalid_request": "invalid_request_error",
    "authentication": "authentication_error",
    "permission": "permission_error",
    "not_found": "not_found_error",
    "too_large": "request_too_large",
    "rate_limit": "rate_limit_error",
    "upstream": "api_error",
    "timeout": "api_error",
    "overloaded": "overloaded_error",
    "internal": "api_error",
}

STOP_REASONS = {
    "stop": "end_turn",
    "length": "max_tokens",
    "tool_calls": "tool_use",
    "content_filter": "refusal",
}

#: Anthropic's thinking blocks carry a signature; this gateway does not sign (the
#: upstream's reasoning is replayed as plain ``reasoning_content``), so it is empty.
SIGNATURE = ""

PING = sse(b'{"type":"ping"}', "ping")
_BLOCK_SHAPES: dict[str, tuple[str, str]] = {  # kind -> (delta type, delta field)
    "reasoning": ("thinking_delta", "thinking"),
    "text": ("text_delta", "text"),
    "refusal": ("text_delta", "text"),  # Messages has no refusal block: text, stop_reason "refusal"
    "tool": ("input_json_delta", "partial_json"),
}


def error_json(error: GatewayError) -> dict[str, Any]:
    """The Anthropic error shape (HTTP body and ``event: error`` data alike). The shape has
    no code field, so the gateway's error code leads the message (``tool_call_invalid: ...``)."""
    return {
        "type": "error",
        "error": {"type": ERROR_TYPES.get(error.kind, "api_error"), "message": f"{error.code}: {error.message}"},
    }


def usage_json(usage: Usage | None, estimate_in: Callable[[], int], estimate_out: Callable[[], int]) -> dict[str, Any]:
    """Anthropic usage from the answer's numbers (the generation estimated them when the
    upstream gave none: the rule every room shares); o200k counts here only for an
    answer that reached the encoder without any.

    Anthropic's ``input_tokens`` excludes cache reads, which it reports separately.
    """
    if usage is None:
        return {"input_tokens": estimate_in(), "output_tokens": estimate_out()}
    out: dict[str, Any] = {
        "input_tokens": max(0, usage.prompt_tokens - usage.cached_tokens),
        "output_tokens": usage.completion_tokens,
    }
    if usage.cached_tokens:
        out["cache_read_input_tokens"] = usage.cached_tokens
    written = usage.prompt_details.get("cache_write_tokens", 0)
    if written:  # OpenAI-style upstreams that report cache writes (prompt_tokens_details)
        out["cache_creation_input_tokens"] = written
        out["input_tokens"] = max(0, out["input_tokens"] - written)
    if usage.reasoning_tokens:
        out["output_tokens_details"] = {
            "thinking_tokens": min(usage.reasoning_tokens, usage.completion_tokens)
        }
    return out


def stop_fields(
    finish_reason: str, stop_sequence: str | None, declared: tuple[str, ...], refused: bool = False
) -> dict[str, Any]:
    """``stop_reason`` + ``stop_sequence``: ``stop_sequence`` when the upstream named one of
    the client's ``stop_sequences`` as the match (vLLM ``stop_reason``, SGLang ``matched_stop``);
    ``refusal`` when the model refused (an upstream ``refusal``)."""
    if refused and finish_reason == "stop":
        return {"stop_reason": "refusal", "stop_sequence": None}
    if finish_reason == "stop" and stop_sequence is not None and stop_sequence in declared:
        return {"stop_reason": "stop_sequence", "stop_sequence": stop_sequence}
    return {"stop_reason": STOP_REASONS[finish_reason], "stop_sequence": None}


@dataclass(frozen=True, slots=True)
class MessagesFacts:
    """What the Messages encoder and JSON answer need beyond the upstream body.

    ``message_start`` gets a quick estimate (tokenizing a 70 KB Claude Code request on
    the event loop for every call is not worth it: ``message_delta`` carries the
    upstream's real count); the o200k count runs only when the upstream gives none.
    """

    input_estimate: int = 0
    dropped_tools: tuple[str, ...] = ()  # server tools the gateway cannot run, left out
    stop_sequences: tuple[str, ...] = ()  # the client's, to name the one that matched


def _input_counter(request: ParsedRequest[MessagesFacts]) -> Callable[[], int]:
    """The o200k count of the translated request, computed only if called."""
    return lambda: count_chat_tokens(request.upstream_body)


class MessagesRoom:
    """The ``/v1/messages`` protocol room."""

    name = "messages"
    sequential_blocks = True

    def parse(self, body: bytes, query: dict[str, str], tenant: Tenant = ANONYMOUS_TENANT) -> ParsedRequest[MessagesFacts]:
        # ``?beta=true`` (Claude Code, SDK beta client) changes nothing here.
        t = translate(body)
        return ParsedRequest(
            tenant=tenant,
            protocol=self.name,
            model=t.model,
            stream=t.stream,
            upstream_body=t.body,
            rules=t.rules,
            facts=MessagesFacts(
                input_estimate=quick_token_estimate(t.body),
                dropped_tools=tuple(t.dropped_tools),
                stop_sequences=tuple(t.body.get("stop") or ()),
            ),
        )

    def new_response_id(self) -> str:
        return "msg_" + secrets.token_hex(12)

    async def resolve(self, request: ParsedRequest) -> ParsedRequest:
        return request

    async def completed(
        self, request: ParsedRequest, response_id: str, completion: Completion, encoder: object
    ) -> None:
        return None

    def encoder(self, request: ParsedRequest, response_id: str) -> MessagesEncoder:
        facts: MessagesFacts = request.facts
        return MessagesEncoder(
            response_id, request.model, facts.input_estimate, _input_counter(request), facts.stop_sequences
        )

    def json_body(self, request: ParsedRequest, response_id: str, completion: Completion) -> dict:
        content: list[dict[str, Any]] = []
        for run in completion.runs():  # thinking and text blocks in the upstream's order
            if run.kind == "reasoning":
                content.append({"type": "thinking", "thinking": run.text, "signature": SIGNATURE})
            else:  # text, or a refusal (said as text; stop_reason "refusal")
                content.append({"type": "text", "text": run.text})
        for call in completion.tool_calls:
            content.append(
                {
                    "type": "tool_use",
                    "id": call.id,
                    "name": call.name,
                    "input": parse_arguments(call.arguments) or {},
                }
            )
        def estimate_out() -> int:
            texts = [completion.reasoning, completion.text, *(c.arguments for c in completion.tool_calls)]
            return sum(map(count_text, texts))

        return {
            "id": response_id,
            "type": "message",
            "role": "assistant",
            "model": request.model,
            "content": content,
            **stop_fields(
                completion.finish_reason, completion.stop_sequence, request.facts.stop_sequences, bool(completion.refusal)
            ),
            "usage": usage_json(
                completion.usage, _input_counter(request), estimate_out
            ),
        }

    def error_body(self, error: GatewayError) -> dict:
        return error_json(error)


class MessagesEncoder:
    """Canonical events -> Messages SSE frames; one id; nothing after a terminal frame."""

    def __init__(
        self,
        response_id: str,
        model: str,
        input_estimate: int,
        input_tokens: Callable[[], int],
        stop_sequences: tuple[str, ...] = (),
    ) -> None:
        self.response_id = response_id
        self.stop_sequences = stop_sequences
        self.model = model
        self.input_estimate = input_estimate
        self.input_tokens = input_tokens
        self._outputs: list[str] = []  # block contents, counted only if the upstream gives no usage
        self._refused = False  # a refusal block was sent: stop_reason "refusal"
        self._ended = False

    def start(self) -> bytes:
        message = {
            "id": self.response_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": self.input_estimate, "output_tokens": 0},
        }
        return sse(dumps({"type": "message_start", "message": message}), "message_start")

    def encode(self, event: Event) -> bytes:
        if self._ended:
            return b""
        if isinstance(event, BlockDelta):
            delta_type, key = _BLOCK_SHAPES[event.kind]
            if not event.text:
                return b""
            data = {
                "type": "content_block_delta",
                "index": event.index,
                "delta": {"type": delta_type, key: event.text},
            }
            return sse(dumps(data), "content_block_delta")
        if isinstance(event, BlockStart):
            block: dict[str, Any]
            if event.kind == "reasoning":
                block = {"type": "thinking", "thinking": "", "signature": SIGNATURE}
            elif event.kind in ("text", "refusal"):
                self._refused = self._refused or event.kind == "refusal"
                block = {"type": "text", "text": ""}
            else:
                block = {"type": "tool_use", "id": event.call_id, "name": event.name, "input": {}}
            data = {"type": "content_block_start", "index": event.index, "content_block": block}
            return sse(dumps(data), "content_block_start")
        if isinstance(event, BlockStop):
            self._outputs.append(event.content)
            return sse(
                dumps({"type": "content_block_stop", "index": event.index}), "content_block_stop"
            )
        if isinstance(event, Finish):
            delta = {
                "type": "message_delta",
                "delta": stop_fields(event.finish_reason, event.stop_sequence, self.stop_sequences, self._refused),
                "usage": usage_json(event.usage, self.input_tokens, lambda: sum(map(count_text, self._outputs))),
            }
            self._ended = True  # only once the frames exist: a failure above still gets its error event
            return sse(dumps(delta), "message_delta") + sse(
                b'{"type":"message_stop"}', "message_stop"
            )
        if isinstance(event, Keepalive):
            return PING
        if isinstance(event, Error):
            self._ended = True
            return sse(dumps(error_json(event.error)), "error")
        return b""
