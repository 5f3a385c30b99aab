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

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
    model_validator,
)

from gateway.errors import GatewayError, invalid_request
from gateway.protocols.base import ParsedRequest, dumps, load_json_object, sse, validation_error
from gateway.protocols.envelope import ANONYMOUS_TENANT, Tenant
from gateway.protocols.fields import (
    MAX_OUTPUT_TOKENS,
    Count,
    Int64,
    Name,
    ObjectSchema,
    OutputTokens,
    Penalty,
    PositiveFactor,
    Probability,
    Schema,
    StopSequences,
    Temperature,
    TokenBias,
    TokenId,
    TopK,
)
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


class _Part(BaseModel):
    """A content part; text parts must carry text, other kinds pass as sent."""

    model_config = ConfigDict(extra="allow")
    type: StrictStr
    text: StrictStr | None = None

    @model_validator(mode="after")
    def _text_part(self) -> _Part:
        if self.type == "text" and self.text is None:
            raise ValueError("a text part needs a string 'text'")
        return self


class _CallFunction(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: Name
    arguments: StrictStr


class _ToolCall(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: StrictStr
    type: Literal["function"] = "function"
    function: _CallFunction


class _Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: StrictStr | list[_Part] | None = None
    name: StrictStr | None = None
    tool_call_id: StrictStr | None = None
    tool_calls: list[_ToolCall] | None = None
    reasoning_content: StrictStr | None = None


class _FunctionDef(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: Name
    description: StrictStr | None = None
    parameters: ObjectSchema | None = None
    strict: StrictBool | None = None


class _Tool(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["function"]
    function: _FunctionDef


class _StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: StrictBool = False


class _JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: Name
    schema_: Schema | None = Field(None, alias="schema")
    strict: StrictBool | None = None
    description: StrictStr | None = None


class _ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: _JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> _ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type 'json_schema' needs a json_schema object")
        return self


class _ChatBody(BaseModel):
    """What the gateway understands or forwards, typed and bounded (docs/protocols/chat.md);
    any other key passes through to the upstream within the value limits."""

    model_config = ConfigDict(extra="allow")
    model: Name
    messages: list[_Message] = Field(min_length=1)
    stream: StrictBool = False
    stream_options: _StreamOptions | None = None
    n: StrictInt | None = Field(None, ge=1, le=MAX_OUTPUT_TOKENS)
    tools: list[_Tool] | None = None
    tool_choice: StrictStr | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    # sampling and limits (OpenAI's ranges)
    max_tokens: OutputTokens | None = None
    max_completion_tokens: OutputTokens | None = None
    temperature: Temperature | None = None
    top_p: Probability | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    stop: StopSequences | None = None
    seed: Int64 | None = None
    logprobs: StrictBool | None = None
    top_logprobs: Count | None = None
    logit_bias: dict[str, TokenBias] | None = None
    response_format: _ResponseFormat | None = None
    user: StrictStr | None = None
    metadata: dict[str, StrictStr] | None = None
    reasoning_effort: StrictStr | None = None
    # vLLM / SGLang sampling extras (their types; forwarded as sent)
    top_k: TopK | None = None
    min_p: Probability | None = None
    repetition_penalty: PositiveFactor | None = None
    min_tokens: Count | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: StrictBool | None = None
    skip_special_tokens: StrictBool | None = None
    include_stop_str_in_output: StrictBool | None = None
    chat_template_kwargs: dict[str, Any] | None = None


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
        function = body.tool_choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
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

    def parse(self, body: bytes, query: dict[str, str], tenant: Tenant = ANONYMOUS_TENANT) -> ParsedRequest[ChatFacts]:
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
            tenant=tenant,
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
