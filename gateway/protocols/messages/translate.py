"""Anthropic Messages request -> upstream Chat Completions body.

Validates what the gateway must understand (a named ``invalid_request`` otherwise;
nothing goes upstream on bad input) and translates it; keys it cannot honour are either
ignored (documented in docs/protocols/messages.md) or refused by name. The decisions:

- ``system`` (string or text blocks, joined with a blank line) -> the first system
  message; ``{"role": "system"}`` items inside ``messages`` stay system messages in place.
- ``tool_result`` blocks -> ``tool`` messages, in order, before the rest of that user
  turn; ``is_error`` prefixes the content with ``"Error: "``; images inside a tool
  result move to the user message that follows (tool messages carry text only).
- assistant ``thinking`` -> ``reasoning_content``; ``redacted_thinking`` is dropped.
- server tools (any tool with a ``type`` other than ``custom``) are dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import orjson
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
)

from gateway.errors import GatewayError, invalid_request
from gateway.protocols.base import load_json_object, validation_error
from gateway.protocols.fields import (
    MAX_NAME_CHARS,
    MAX_OUTPUT_TOKENS,
    Name,
    OutputTokens,
    Probability,
    check_object_schema,
)
from gateway.stream.accumulator import ToolRules

#: Joins text blocks that become one upstream string (system, a turn's text).
JOIN = "\n\n"
#: Prefix of a tool message made from a ``tool_result`` with ``is_error: true``.
ERROR_PREFIX = "Error: "
#: Effort names the upstream understands (OpenAI ``reasoning_effort``).
EFFORTS = {
    "minimal": "low",
    "low": "low",
    "medium": "medium",
    "high": "high",
    "xhigh": "high",
    "max": "high",
}
#: ``thinking.budget_tokens`` at or below these map to low / medium; above -> high.
BUDGET_LOW = 4096
BUDGET_MEDIUM = 16384


class _Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["user", "assistant", "system"]
    content: Any  # str | list of blocks, checked by hand so errors name the field plainly


class _Body(BaseModel):
    """Only what the gateway must understand; the rest is ignored or checked by hand."""

    model_config = ConfigDict(extra="allow")
    model: Name
    messages: list[_Message] = Field(min_length=1)
    max_tokens: OutputTokens
    stream: StrictBool = False
    stop_sequences: list[StrictStr] | None = None
    temperature: Probability | None = None
    top_p: Probability | None = None
    top_k: Annotated[StrictInt, Field(ge=0, le=MAX_OUTPUT_TOKENS)] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None


class _CountBody(_Body):
    """``count_tokens`` takes the same body without ``max_tokens`` (the SDK omits it)."""

    max_tokens: OutputTokens | None = None  # type: ignore[assignment]


@dataclass(slots=True)
class Translation:
    """The upstream body and the facts the room keeps about the request."""

    model: str
    stream: bool
    body: dict[str, Any]
    rules: ToolRules
    dropped_tools: list[str] = field(default_factory=list)


def _bad(message: str, param: str, code: str = "invalid_request") -> GatewayError:
    """A named 400; the message names the field (Anthropic's error body has no ``param``)."""
    if param not in message:
        message = f"{param}: {message}"
    return invalid_request(message, param=param, code=code)


def _str_field(block: dict[str, Any], key: str, param: str) -> str:
    value = block.get(key)
    if not isinstance(value, str):
        raise _bad(f"{param}.{key} must be a string", f"{param}.{key}", "invalid_type")
    return value


def _block_type(block: Any, param: str) -> str:
    if not isinstance(block, dict):
        raise _bad(f"{param} must be a content block object", param, "invalid_type")
    kind = block.get("type")
    if not isinstance(kind, str):
        raise _bad(f"{param}.type must be a string", f"{param}.type", "invalid_type")
    return kind


def _unsupported(kind: str, param: str) -> GatewayError:
    return _bad(
        f"content block type {kind!r} is not supported by this gateway (its upstream speaks Chat Completions)",
        f"{param}.type",
        "unsupported_content_block",
    )


def _text_blocks(content: Any, param: str) -> str:
    """System content: a string, or text blocks joined (cache_control dropped)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{param} must be a string or a list of text blocks", param, "invalid_type")
    texts = []
    for i, block in enumerate(content):
        kind = _block_type(block, f"{param}.{i}")
        if kind != "text":
            raise _bad(
                f"{param}.{i} must be a text block, not {kind!r}",
                f"{param}.{i}.type",
                "invalid_value",
            )
        texts.append(_str_field(block, "text", f"{param}.{i}"))
    return JOIN.join(texts)


def _image_part(block: dict[str, Any], param: str) -> dict[str, Any]:
    source = block.get("source")
    if not isinstance(source, dict):
        raise _bad(f"{param}.source must be an object", f"{param}.source", "invalid_type")
    kind = source.get("type")
    if kind == "base64":
        media = _str_field(source, "media_type", f"{param}.source")
        data = _str_field(source, "data", f"{param}.source")
        url = f"data:{media};base64,{data}"
    elif kind == "url":
        url = _str_field(source, "url", f"{param}.source")
    else:
        raise _bad(
            f"image source type {kind!r} is not supported (use base64 or url)",
            f"{param}.source.type",
            "unsupported_content_block",
        )
    return {"type": "image_url", "image_url": {"url": url}}


def _user_content(parts: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """Text-only content as one string (widest upstream support), else content parts."""
    if all(p["type"] == "text" for p in parts):
        return JOIN.join(p["text"] for p in parts)
    return parts


def _tool_result(block: dict[str, Any], param: str, images: list[dict[str, Any]]) -> dict[str, Any]:
    call_id = _str_field(block, "tool_use_id", param)
    content = block.get("content", "")
    if content is None:
        content = ""
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        texts = []
        for i, inner in enumerate(content):
            where = f"{param}.content.{i}"
            kind = _block_type(inner, where)
            if kind == "text":
                texts.append(_str_field(inner, "text", where))
            elif kind == "image":
                images.append(_image_part(inner, where))
            else:
                raise _unsupported(kind, where)
        text = JOIN.join(texts)
    else:
        raise _bad(
            f"{param}.content must be a string or a list of blocks",
            f"{param}.content",
            "invalid_type",
        )
    is_error = block.get("is_error", False)
    if not isinstance(is_error, bool):
        raise _bad(f"{param}.is_error must be a boolean", f"{param}.is_error", "invalid_type")
    if is_error:
        text = ERROR_PREFIX + text if text else ERROR_PREFIX.rstrip(": ")
    return {"role": "tool", "tool_call_id": call_id, "content": text}


def _user_turn(content: str | list[Any], param: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    tools: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    images: list[dict[str, Any]] = []  # from tool results: shown to the model after them
    for i, block in enumerate(content):
        where = f"{param}.{i}"
        kind = _block_type(block, where)
        if kind == "text":
            parts.append({"type": "text", "text": _str_field(block, "text", where)})
        elif kind == "image":
            parts.append(_image_part(block, where))
        elif kind == "tool_result":
            tools.append(_tool_result(block, where, images))
        else:
            raise _unsupported(kind, where)
    out = list(tools)
    parts = images + parts
    if parts or not tools:
        out.append({"role": "user", "content": _user_content(parts)})
    return out


def _assistant_turn(content: str | list[Any], param: str) -> dict[str, Any]:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    texts: list[str] = []
    reasoning: list[str] = []
    calls: list[dict[str, Any]] = []
    for i, block in enumerate(content):
        where = f"{param}.{i}"
        kind = _block_type(block, where)
        if kind == "text":
            texts.append(_str_field(block, "text", where))
        elif kind == "thinking":
            reasoning.append(_str_field(block, "thinking", where))
        elif kind == "redacted_thinking":
            continue  # opaque to any upstream but Anthropic's
        elif kind == "tool_use":
            tool_input = block.get("input", {})
            if not isinstance(tool_input, dict):
                raise _bad(f"{where}.input must be an object", f"{where}.input", "invalid_type")
            calls.append(
                {
                    "id": _str_field(block, "id", where),
                    "type": "function",
                    "function": {
                        "name": _str_field(block, "name", where),
                        "arguments": orjson.dumps(tool_input).decode(),
                    },
                }
            )
        else:
            raise _unsupported(kind, where)
    message: dict[str, Any] = {
        "role": "assistant",
        "content": JOIN.join(texts) if texts or not calls else None,
    }
    if reasoning:
        message["reasoning_content"] = JOIN.join(reasoning)
    if calls:
        message["tool_calls"] = calls
    return message


def _messages(body: _Body, raw: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    system = raw.get("system")
    if system is not None:
        text = _text_blocks(system, "system")
        if text:
            out.append({"role": "system", "content": text})
    for i, message in enumerate(body.messages):
        param = f"messages.{i}.content"
        if not isinstance(message.content, (str, list)):
            raise _bad("must be a string or a list of content blocks", param, "invalid_type")
        if message.role == "system":
            out.append({"role": "system", "content": _text_blocks(message.content, param)})
        elif message.role == "user":
            out.extend(_user_turn(message.content, param))
        else:
            out.append(_assistant_turn(message.content, param))
    return out


def _tools(tools: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[str]]:
    """Custom tools -> function tools; server tools (typed) are dropped and named."""
    functions: list[dict[str, Any]] = []
    dropped: list[str] = []
    for i, tool in enumerate(tools):
        param = f"tools.{i}"
        kind = tool.get("type")
        if kind is not None and kind != "custom":
            if not isinstance(kind, str):
                raise _bad(f"{param}.type must be a string", f"{param}.type", "invalid_type")
            dropped.append(str(tool.get("name") or kind))
            continue
        name = _str_field(tool, "name", param)
        if not name or len(name) > MAX_NAME_CHARS:
            raise _bad(
                f"{param}.name must be 1 to {MAX_NAME_CHARS} characters", f"{param}.name", "invalid_value"
            )
        schema = tool.get("input_schema")
        check_object_schema(schema, f"{param}.input_schema")
        function: dict[str, Any] = {"name": name}
        description = tool.get("description")
        if description is not None:
            function["description"] = _str_field(tool, "description", param)
        function["parameters"] = schema
        strict = tool.get("strict")
        if strict is not None:
            if not isinstance(strict, bool):
                raise _bad(f"{param}.strict must be a boolean", f"{param}.strict", "invalid_type")
            function["strict"] = strict
        functions.append({"type": "function", "function": function})
    return functions, dropped


def _tool_choice(choice: dict[str, Any] | None, declared: frozenset[str]) -> tuple[Any, str, bool]:
    """(upstream tool_choice or None, ToolRules.choice, parallel allowed)."""
    if choice is None:
        return None, "auto", True
    disable = choice.get("disable_parallel_tool_use", False)
    if not isinstance(disable, bool):
        raise _bad(
            "tool_choice.disable_parallel_tool_use must be a boolean",
            "tool_choice.disable_parallel_tool_use",
            "invalid_type",
        )
    kind = choice.get("type")
    if kind == "auto":
        return "auto", "auto", not disable
    if kind == "none":
        return "none", "none", not disable
    if kind == "any":
        return "required", "required", not disable
    if kind == "tool":
        name = choice.get("name")
        if not isinstance(name, str) or not name:
            raise _bad(
                "tool_choice.name is required for type 'tool'",
                "tool_choice.name",
                "missing_required_parameter",
            )
        if name not in declared:
            raise _bad(
                f"tool_choice names undeclared tool {name!r}", "tool_choice.name", "invalid_value"
            )
        return {"type": "function", "function": {"name": name}}, name, not disable
    raise _bad(
        "tool_choice.type must be 'auto', 'any', 'tool' or 'none'",
        "tool_choice.type",
        "invalid_value",
    )


def response_format(output_config: dict[str, Any] | None) -> dict[str, Any] | None:
    """``output_config.format`` (the SDK's ``messages.parse``) -> Chat ``response_format``."""
    fmt = (output_config or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        raise _bad("output_config.format.type must be 'json_schema'", "output_config.format.type", "invalid_value")
    schema = fmt.get("schema")
    check_object_schema(schema, "output_config.format.schema")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": schema, "strict": True}}


def reasoning_effort(
    thinking: dict[str, Any] | None, output_config: dict[str, Any] | None
) -> str | None:
    """``thinking`` + ``output_config.effort`` -> ``reasoning_effort`` (None = upstream default)."""
    kind = None
    if thinking is not None:
        kind = thinking.get("type")
        if kind not in ("enabled", "adaptive", "disabled"):
            raise _bad(
                "thinking.type must be 'enabled', 'adaptive' or 'disabled'",
                "thinking.type",
                "invalid_value",
            )
    effort = (output_config or {}).get("effort")
    if effort is not None and not isinstance(effort, str):
        raise _bad("output_config.effort must be a string", "output_config.effort", "invalid_type")
    if kind == "enabled":
        budget = thinking.get("budget_tokens") if thinking else None
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
            raise _bad(
                "thinking.budget_tokens must be a positive integer",
                "thinking.budget_tokens",
                "invalid_type",
            )
    if kind == "disabled":
        return None
    if effort is not None:
        return EFFORTS.get(effort.lower())  # an effort name we do not know: upstream default
    if kind == "enabled":
        assert thinking is not None
        budget = thinking["budget_tokens"]
        return "low" if budget <= BUDGET_LOW else "medium" if budget <= BUDGET_MEDIUM else "high"
    return None


def translate(body: bytes, *, count_only: bool = False) -> Translation:
    """Validate a Messages body and build the upstream Chat Completions body."""
    raw = load_json_object(body)
    try:
        parsed = (_CountBody if count_only else _Body).model_validate(raw)
    except ValidationError as exc:
        raise validation_error(exc) from None
    upstream: dict[str, Any] = {"model": parsed.model, "messages": _messages(parsed, raw)}
    if parsed.max_tokens is not None:
        upstream["max_tokens"] = parsed.max_tokens
    functions, dropped = _tools(parsed.tools or [])
    declared = frozenset(t["function"]["name"] for t in functions)
    choice, rule_choice, parallel = _tool_choice(parsed.tool_choice, declared)
    if functions:
        upstream["tools"] = functions
        if choice is not None:
            upstream["tool_choice"] = choice
        if not parallel:
            upstream["parallel_tool_calls"] = False
    elif rule_choice not in ("auto", "none"):
        if not dropped:
            raise _bad("tool_choice requires tools", "tool_choice", "invalid_value")
        rule_choice = "auto"  # only server tools were declared, and they are dropped
    if parsed.stop_sequences:
        upstream["stop"] = parsed.stop_sequences
    for key in ("temperature", "top_p", "top_k"):
        value = getattr(parsed, key)
        if value is not None:
            upstream[key] = value
    effort = reasoning_effort(parsed.thinking, parsed.output_config)
    if effort is not None:
        upstream["reasoning_effort"] = effort
    fmt = response_format(parsed.output_config)
    if fmt is not None:
        upstream["response_format"] = fmt
    rules = ToolRules(
        declared=declared, choice=rule_choice if functions else "auto", parallel=parallel
    )
    return Translation(parsed.model, parsed.stream, upstream, rules, dropped)
