"""OpenAI Responses request -> upstream Chat Completions body.

Pure translation with named 400s (no I/O): ``instructions`` and the ``input`` items
(input_items.py) become chat messages, the tools and ``tool_choice`` are translated by
tools.py (function and namespace tools become chat function tools, hosted tools the
upstream cannot run are dropped), and the sampling/format keys are renamed. Every key's
decision is listed in docs/protocols/responses.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    StrictBool,
    StrictStr,
    ValidationError,
)

from gateway.errors import invalid_request
from gateway.protocols.base import validation_error
from gateway.protocols.envelope import ANONYMOUS_TENANT, Tenant
from gateway.protocols.fields import (
    MAX_NAME_CHARS,
    Count,
    Name,
    OutputTokens,
    Probability,
    Temperature,
    check_schema,
)
from gateway.protocols.responses.compaction import SUMMARY_PROMPT
from gateway.protocols.responses.input_items import input_messages
from gateway.protocols.responses.tools import ToolMap, upstream_tool_choice, upstream_tools
from gateway.stream.accumulator import ToolRules

#: The ``include`` value that asks for the output text's token logprobs.
LOGPROBS_INCLUDE = "message.output_text.logprobs"


class _ResponsesBody(BaseModel):
    """The keys the gateway must understand; the rest is accepted and ignored."""

    model_config = ConfigDict(extra="allow")
    model: Name
    input: StrictStr | list[Any] | None = None
    instructions: StrictStr | None = None
    stream: StrictBool = False
    store: StrictBool | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: StrictStr | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    max_output_tokens: OutputTokens | None = None
    temperature: Temperature | None = None
    top_p: Probability | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    include: list[StrictStr] | None = None
    top_logprobs: Count | None = None
    previous_response_id: StrictStr | None = None
    metadata: dict[str, StrictStr] | None = None
    user: StrictStr | None = None


#: Keys that would change the answer's meaning and that the gateway cannot honour.
_REFUSED_KEYS = {
    "prompt": "stored prompt templates live on OpenAI's servers; send the text as input",
    "conversation": "no Conversations API here; use previous_response_id or send the items",
}

_UNION_FIELDS = frozenset({"input", "tool_choice", "temperature", "top_p"})


@dataclass(slots=True)
class Translation:
    """What :func:`translate` produces for the room."""

    body: _ResponsesBody
    raw: dict[str, Any]
    upstream: dict[str, Any]
    instructions_count: int  # leading system messages that come from ``instructions``
    input_messages: list[dict[str, Any]]
    rules: ToolRules
    tool_map: ToolMap
    dropped_tools: list[str]
    include_reasoning_envelope: bool
    compaction: bool = False  # a compaction turn: answer with one compaction item
    include_logprobs: bool = False  # include: message.output_text.logprobs


def parse_body(raw: dict[str, Any]) -> _ResponsesBody:
    try:
        body = _ResponsesBody.model_validate(raw)
    except ValidationError as exc:
        err = validation_error(exc)
        # base.validation_error keeps pydantic's union-member tag in the path
        # ("input.str"); name the field itself for union-typed keys.
        if err.param and err.param.split(".")[0] in _UNION_FIELDS:
            err.param = err.param.split(".")[0]
        raise err from None
    for key, why in _REFUSED_KEYS.items():
        if raw.get(key) is not None:
            raise invalid_request(
                f"{key!r} is not supported by this gateway: {why}",
                param=key,
                code=f"{key}_not_supported",
            )
    if raw.get("background") is True:
        raise invalid_request(
            "background responses are not supported by this gateway: stream the response, or wait for it",
            param="background",
            code="background_not_supported",
        )
    if body.input is None and body.previous_response_id is None:
        raise invalid_request(
            "missing required parameter: 'input'", param="input", code="missing_required_parameter"
        )
    return body


def translate(raw: dict[str, Any], compaction: bool = False, tenant: Tenant = ANONYMOUS_TENANT) -> Translation:
    """``compaction``: a compaction turn whatever the input says (``/v1/responses/compact``);
    otherwise a trailing ``compaction_trigger`` input item makes one. ``tenant``: whose
    envelopes (reasoning, compaction items) the input may carry."""
    body = parse_body(raw)
    tool_map = ToolMap()
    tools, dropped = upstream_tools(body.tools or [], tool_map)
    rules, choice = upstream_tool_choice(body.tool_choice, body.parallel_tool_calls, tool_map, dropped)
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    builder = input_messages(body.input, tool_map, tenant)
    messages = builder.messages
    compaction = compaction or builder.compaction_trigger
    if compaction:
        upstream = _summary_upstream(body, system + messages)
        rules = ToolRules(choice="none")
    else:
        upstream = _answer_upstream(body, system + messages, tools, choice)
    return Translation(
        body=body,
        raw=raw,
        upstream=upstream,
        instructions_count=len(system),
        input_messages=messages,
        rules=rules,
        tool_map=tool_map,
        dropped_tools=dropped,
        include_reasoning_envelope=not compaction and "reasoning.encrypted_content" in (body.include or []),
        compaction=compaction,
        include_logprobs=not compaction and LOGPROBS_INCLUDE in (body.include or []),
    )


def _length_and_temperature(body: _ResponsesBody) -> dict[str, Any]:
    """``max_output_tokens`` -> ``max_tokens`` and ``temperature``: the sampling keys both
    the answer and the compaction summary keep."""
    keys: dict[str, Any] = {}
    if body.max_output_tokens is not None:
        keys["max_tokens"] = body.max_output_tokens
    if body.temperature is not None:
        keys["temperature"] = body.temperature
    return keys


def _answer_upstream(
    body: _ResponsesBody, messages: list[dict[str, Any]], tools: list[dict[str, Any]], choice: Any
) -> dict[str, Any]:
    """The upstream body of an ordinary turn: tools, sampling, format and effort renamed."""
    upstream: dict[str, Any] = {"model": body.model, "messages": messages}
    if tools:
        upstream["tools"] = tools
        if choice is not None:
            upstream["tool_choice"] = choice
        if body.parallel_tool_calls is not None:
            upstream["parallel_tool_calls"] = body.parallel_tool_calls
    upstream.update(_length_and_temperature(body))
    for key in ("top_p", "user"):
        value = getattr(body, key)
        if value is not None:
            upstream[key] = value
    response_format = _response_format(body.text)
    if response_format is not None:
        upstream["response_format"] = response_format
    if LOGPROBS_INCLUDE in (body.include or []):
        upstream["logprobs"] = True
        if body.top_logprobs is not None:
            upstream["top_logprobs"] = body.top_logprobs
    verbosity = (body.text or {}).get("verbosity")
    if verbosity is not None:
        if verbosity not in ("low", "medium", "high"):
            raise invalid_request(
                "text.verbosity must be 'low', 'medium' or 'high'", param="text.verbosity", code="invalid_value"
            )
        if verbosity != "medium":  # medium is every API's default: left out, upstreams without it still answer
            upstream["verbosity"] = verbosity
    effort = (body.reasoning or {}).get("effort")
    if effort is not None:
        if not isinstance(effort, str):
            raise invalid_request(
                "reasoning.effort must be a string", param="reasoning.effort", code="invalid_type"
            )
        upstream["reasoning_effort"] = effort
    return upstream


def _summary_upstream(body: _ResponsesBody, messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The summarising generation: instructions, history, then the summary request; no
    tools (the answer is text), no response format."""
    return {
        "model": body.model,
        "messages": messages + [{"role": "user", "content": SUMMARY_PROMPT}],
        **_length_and_temperature(body),
    }


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise invalid_request("text.format must be an object", param="text.format")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        name, schema = fmt.get("name"), fmt.get("schema")
        if not isinstance(name, str) or not name or len(name) > MAX_NAME_CHARS:
            raise invalid_request(
                f"text.format.name (1 to {MAX_NAME_CHARS} characters) is required for json_schema",
                param="text.format.name",
            )
        if not isinstance(schema, dict):
            raise invalid_request(
                "text.format.schema must be an object", param="text.format.schema"
            )
        check_schema(schema, "text.format.schema")
        spec: dict[str, Any] = {"name": name, "schema": schema}
        if isinstance(fmt.get("strict"), bool):
            spec["strict"] = fmt["strict"]
        if isinstance(fmt.get("description"), str):
            spec["description"] = fmt["description"]
        return {"type": "json_schema", "json_schema": spec}
    raise invalid_request(f"unsupported text.format type {kind!r}", param="text.format.type")
