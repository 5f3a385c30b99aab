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
    TokenLogprobs,
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


class _LegacyFunction(BaseModel):
    """A legacy ``functions[]`` entry (the deprecated predecessor of ``tools``)."""

    model_config = ConfigDict(extra="allow")
    name: Name
    description: StrictStr | None = None
    parameters: ObjectSchema | None = None


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
    functions: list[_LegacyFunction] | None = None  # legacy; answered as message.function_call
    function_call: StrictStr | dict[str, Any] | None = None
    modalities: list[StrictStr] | None = None
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


def _legacy_rules(body: _ChatBody) -> ToolRules:
    """``functions`` + ``function_call``: one call at most, answered in the legacy shape."""
    declared = frozenset(f.name for f in body.functions or ())
    choice: str = "auto"
    if isinstance(body.function_call, str):
        if body.function_call not in ("auto", "none"):
            raise invalid_request("function_call must be 'auto', 'none' or {\"name\": ...}", param="function_call")
        choice = body.function_call
    elif isinstance(body.function_call, dict):
        name = body.function_call.get("name")
        if not isinstance(name, str) or name not in declared:
            raise invalid_request("function_call.name must name a declared function", param="function_call")
        choice = name
    return ToolRules(declared=declared, choice=choice, parallel=False)


def _legacy_to_tools(upstream: dict[str, Any]) -> None:
    """Legacy ``functions``/``function_call`` -> ``tools``/``tool_choice`` in the upstream
    body (servers such as vLLM know only tools); the answer goes back in the legacy shape."""
    upstream["tools"] = [{"type": "function", "function": f} for f in upstream.pop("functions")]
    choice = upstream.pop("function_call", None)
    if isinstance(choice, dict):
        upstream["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    elif isinstance(choice, str):
        upstream["tool_choice"] = choice


def _tool_rules(body: _ChatBody) -> ToolRules:
    if body.functions and not body.tools:
        return _legacy_rules(body)
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
    logprobs: bool = False  # the client asked for logprobs: relay the upstream's
    legacy_functions: bool = False  # the client sent ``functions``: answer ``function_call``


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
        if "audio" in (parsed.modalities or ()) or raw.get("audio") is not None:
            raise invalid_request(
                "audio output is not supported by this gateway (its answers carry text only)",
                param="modalities" if "audio" in (parsed.modalities or ()) else "audio",
                code="audio_not_supported",
            )
        if parsed.functions and parsed.tools:
            raise invalid_request("send either tools or the legacy functions, not both", param="functions")
        upstream = {k: v for k, v in raw.items() if k not in ("stream", "stream_options", "n")}
        if parsed.functions and not parsed.tools:
            _legacy_to_tools(upstream)
        include_usage = bool(parsed.stream_options and parsed.stream_options.include_usage)
        facts = ChatFacts(
            include_usage=include_usage,
            logprobs=parsed.logprobs is True,
            legacy_functions=bool(parsed.functions) and not parsed.tools,
        )
        return ParsedRequest(
            tenant=tenant,
            protocol=self.name,
            model=parsed.model,
            stream=parsed.stream,
            upstream_body=upstream,
            rules=_tool_rules(parsed),
            facts=facts,
        )

    def new_response_id(self) -> str:
        return "chatcmpl-" + secrets.token_hex(12)

    async def resolve(self, request: ParsedRequest) -> ParsedRequest:
        return request

    async def completed(self, request: ParsedRequest, response_id: str, completion: Completion, encoder: object) -> None:
        return None

    def encoder(self, request: ParsedRequest, response_id: str) -> ChatEncoder:
        facts: ChatFacts = request.facts
        return ChatEncoder(response_id, request.model, facts.include_usage, facts.logprobs, facts.legacy_functions)

    def json_body(self, request: ParsedRequest, response_id: str, completion: Completion) -> dict:
        facts: ChatFacts = request.facts
        message = assistant_message(completion)
        finish: str = completion.finish_reason
        if facts.legacy_functions and completion.tool_calls:
            call = completion.tool_calls[0]  # the rules allow one
            del message["tool_calls"]
            message["function_call"] = {"name": call.name, "arguments": call.arguments}
            finish = "function_call"
        logprobs = None
        if facts.logprobs and completion.token_data is not None and completion.token_data.logprobs:
            logprobs = {"content": [token_logprob(e) for e in completion.token_data.logprobs], "refusal": None}
        body: dict[str, Any] = {
            "id": response_id,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": request.model,
            "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": logprobs}],
        }
        body["usage"] = usage_json(completion.usage or Usage())
        return body

    def error_body(self, error: GatewayError) -> dict:
        return error_json(error)


def token_logprob(entry: dict[str, Any]) -> dict[str, Any]:
    """An upstream ``logprobs.content`` entry in the shape the SDK's type requires
    (``bytes`` and ``top_logprobs`` present; vLLM and llama.cpp may leave them out)."""
    out = {"token": str(entry.get("token", "")), "logprob": entry.get("logprob", 0.0), "bytes": entry.get("bytes")}
    out["top_logprobs"] = [
        {"token": str(t.get("token", "")), "logprob": t.get("logprob", 0.0), "bytes": t.get("bytes")}
        for t in entry.get("top_logprobs") or () if isinstance(t, dict)
    ]
    return out


class ChatEncoder:
    """Canonical events -> ``chat.completion.chunk`` frames; one id for the stream.

    ``legacy_functions``: the client declared ``functions``; its one call is sent as
    ``delta.function_call`` and the answer ends ``function_call``."""

    def __init__(
        self, response_id: str, model: str, include_usage: bool, logprobs: bool = False, legacy_functions: bool = False
    ) -> None:
        self.include_usage = include_usage
        self.logprobs = logprobs
        self.legacy_functions = legacy_functions
        self._tool_ordinal: dict[int, int] = {}  # block index -> tool_calls[].index
        self._prefix = (
            b'{"id":' + dumps(response_id) + b',"object":"chat.completion.chunk","created":'
            + str(int(time.time())).encode() + b',"model":' + dumps(model)
        )

    def _chunk(self, delta: dict[str, Any], finish_reason: str | None = None, logprobs: Any = None) -> bytes:
        choice = dumps({"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": logprobs})
        return b"data: " + self._prefix + b',"choices":[' + choice + b"]}\n\n"

    def start(self) -> bytes:
        return self._chunk({"role": "assistant", "content": ""})

    def encode(self, event: Event) -> bytes:
        if isinstance(event, BlockDelta):
            if event.kind == "text":
                return self._chunk({"content": event.text})
            if event.kind == "reasoning":
                return self._chunk({"reasoning_content": event.text})
            if event.kind == "refusal":
                return self._chunk({"refusal": event.text})
            if self.legacy_functions:
                return self._chunk({"function_call": {"arguments": event.text}})
            ordinal = self._tool_ordinal[event.index]
            return self._chunk({"tool_calls": [{"index": ordinal, "function": {"arguments": event.text}}]})
        if isinstance(event, BlockStart):
            if event.kind != "tool":
                return b""
            if self.legacy_functions:
                return self._chunk({"function_call": {"name": event.name, "arguments": ""}})
            ordinal = self._tool_ordinal[event.index] = len(self._tool_ordinal)
            call = {
                "index": ordinal,
                "id": event.call_id,
                "type": "function",
                "function": {"name": event.name, "arguments": ""},
            }
            return self._chunk({"tool_calls": [call]})
        if isinstance(event, TokenLogprobs):
            if not self.logprobs or not event.entries:
                return b""
            return self._chunk({}, logprobs={"content": [token_logprob(e) for e in event.entries], "refusal": None})
        if isinstance(event, Finish):
            finish = "function_call" if self.legacy_functions and event.finish_reason == "tool_calls" else event.finish_reason
            out = self._chunk({}, finish)
            if self.include_usage:
                usage = dumps(usage_json(event.usage or Usage()))
                out += b"data: " + self._prefix + b',"choices":[],"usage":' + usage + b"}\n\n"
            return out + DONE
        if isinstance(event, Keepalive):
            return KEEPALIVE
        if isinstance(event, Error):
            return sse(dumps(error_json(event.error))) + DONE
        return b""  # BlockStop: Chat has no block end
