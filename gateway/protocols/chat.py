"""OpenAI Chat Completions: request parsing, the stream encoder, JSON answers, errors.

Wire contracts the openai SDK's stream accumulator enforces (see docs/protocols.md):
every ``delta.tool_calls[]`` item carries ``index`` (dense from 0); a call's first
fragment carries ``id``, ``type`` and ``function.name`` exactly once (the SDK
concatenates them); the usage chunk (``choices: []``) comes last before ``[DONE]`` and
only when the client asked for it; a mid-stream error is a frame with a top-level
``error``; keepalives are SSE comment lines (``event: ping`` would crash the parser).
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError

from gateway.errors import GatewayError, invalid_request
from gateway.protocols.base import ParsedRequest, dumps, load_json_object, sse, validation_error
from gateway.protocols.openai_shapes import assistant_message, error_json, usage_json
from gateway.stream.accumulator import ToolRules
from gateway.stream.events import (
    BlockDelta,
    BlockStart,
    Completion,
    Error,
    Event,
    Finish,
    Keepalive,
    Usage,
)

DONE = b"data: [DONE]\n\n"
KEEPALIVE = b": keepalive\n\n"


class _Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[dict[str, Any]] | None = None


class _FunctionDef(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: StrictStr = Field(min_length=1)


class _Tool(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["function"]
    function: _FunctionDef


class _StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: StrictBool = False


class _ChatBody(BaseModel):
    """Only what the gateway must understand; everything else passes through."""

    model_config = ConfigDict(extra="allow")
    model: StrictStr = Field(min_length=1)
    messages: list[_Message] = Field(min_length=1)
    stream: StrictBool = False
    stream_options: _StreamOptions | None = None
    n: StrictInt | None = Field(None, ge=1)
    tools: list[_Tool] | None = None
    tool_choice: StrictStr | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None


def _tool_rules(body: _ChatBody) -> ToolRules:
    declared = frozenset(t.function.name for t in body.tools or ())
    choice: str = "auto"
    if isinstance(body.tool_choice, str):
        if body.tool_choice not in ("auto", "none", "required"):
            raise invalid_request(
                "tool_choice must be 'auto', 'none', 'required' or a function object",
                param="tool_choice",
            )
        choice = body.tool_choice
    elif isinstance(body.tool_choice, dict):
        name = (body.tool_choice.get("function") or {}).get("name")
        if not isinstance(name, str) or not name:
            raise invalid_request("tool_choice.function.name is required", param="tool_choice")
        if declared and name not in declared:
            raise invalid_request(f"tool_choice names undeclared tool {name!r}", param="tool_choice")
        choice = name
    return ToolRules(declared=declared, choice=choice, parallel=body.parallel_tool_calls is not False)


@dataclass(frozen=True, slots=True)
class ChatFacts:
    """What the Chat encoder needs beyond the upstream body."""

    include_usage: bool = False  # stream_options.include_usage: a usage chunk before [DONE]


class ChatRoom:
    """The ``/v1/chat/completions`` protocol room."""

    name = "chat"
    sequential_blocks = False

    def parse(self, body: bytes, query: dict[str, str]) -> ParsedRequest[ChatFacts]:
        raw = load_json_object(body)
        try:
            parsed = _ChatBody.model_validate(raw)
        except ValidationError as exc:
            raise validation_error(exc) from None
        if parsed.n is not None and parsed.n > 1:
            raise invalid_request(
                "n > 1 is not supported by this gateway; send n separate requests",
                param="n",
                code="n_not_supported",
            )
        upstream = {k: v for k, v in raw.items() if k not in ("stream", "stream_options", "n")}
        include_usage = bool(parsed.stream_options and parsed.stream_options.include_usage)
        return ParsedRequest(
            protocol=self.name,
            model=parsed.model,
            stream=parsed.stream,
            upstream_body=upstream,
            rules=_tool_rules(parsed),
            facts=ChatFacts(include_usage=include_usage),
        )

    def new_response_id(self) -> str:
        return "chatcmpl-" + secrets.token_hex(12)

    async def resolve(self, request: ParsedRequest) -> ParsedRequest:
        return request

    async def completed(self, request: ParsedRequest, response_id: str, completion: Completion, encoder: object) -> None:
        return None

    def encoder(self, request: ParsedRequest, response_id: str) -> ChatEncoder:
        return ChatEncoder(response_id, request.model, request.facts.include_usage)

    def json_body(self, request: ParsedRequest, response_id: str, completion: Completion) -> dict:
        message = assistant_message(completion)
        body: dict[str, Any] = {
            "id": response_id,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": request.model,
            "choices": [
                {"index": 0, "message": message, "finish_reason": completion.finish_reason, "logprobs": None}
            ],
        }
        body["usage"] = usage_json(completion.usage or Usage())
        return body

    def error_body(self, error: GatewayError) -> dict:
        return error_json(error)


class ChatEncoder:
    """Canonical events -> ``chat.completion.chunk`` frames; one id for the stream."""

    def __init__(self, response_id: str, model: str, include_usage: bool) -> None:
        self.include_usage = include_usage
        self._tool_ordinal: dict[int, int] = {}  # block index -> tool_calls[].index
        self._prefix = (
            b'{"id":' + dumps(response_id) + b',"object":"chat.completion.chunk","created":'
            + str(int(time.time())).encode() + b',"model":' + dumps(model)
        )

    def _chunk(self, delta: dict[str, Any], finish_reason: str | None = None) -> bytes:
        choice = dumps({"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None})
        return b"data: " + self._prefix + b',"choices":[' + choice + b"]}\n\n"

    def start(self) -> bytes:
        return self._chunk({"role": "assistant", "content": ""})

    def encode(self, event: Event) -> bytes:
        if isinstance(event, BlockDelta):
            if event.kind == "text":
                return self._chunk({"content": event.text})
            if event.kind == "reasoning":
                return self._chunk({"reasoning_content": event.text})
            ordinal = self._tool_ordinal[event.index]
            return self._chunk({"tool_calls": [{"index": ordinal, "function": {"arguments": event.text}}]})
        if isinstance(event, BlockStart):
            if event.kind != "tool":
                return b""
            ordinal = self._tool_ordinal[event.index] = len(self._tool_ordinal)
            call = {
                "index": ordinal,
                "id": event.call_id,
                "type": "function",
                "function": {"name": event.name, "arguments": ""},
            }
            return self._chunk({"tool_calls": [call]})
        if isinstance(event, Finish):
            out = self._chunk({}, event.finish_reason)
            if self.include_usage:
                usage = dumps(usage_json(event.usage or Usage()))
                out += b"data: " + self._prefix + b',"choices":[],"usage":' + usage + b"}\n\n"
            return out + DONE
        if isinstance(event, Keepalive):
            return KEEPALIVE
        if isinstance(event, Error):
            return sse(dumps(error_json(event.error))) + DONE
        return b""  # BlockStop: Chat has no block end
