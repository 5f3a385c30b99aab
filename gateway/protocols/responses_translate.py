"""OpenAI Responses request -> upstream Chat Completions body.

Pure translation with named 400s (no I/O): ``instructions``/``input`` items become chat
messages, the tools and ``tool_choice`` are translated by ``responses_tools`` (function
and namespace tools become chat function tools, hosted tools the upstream cannot run are
dropped), and the sampling/format keys are renamed. Every key's decision is listed in
docs/protocols/responses.md.
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
from gateway.protocols import responses_tools as client_tools
from gateway.protocols.responses_tools import ToolMap, upstream_tool_choice, upstream_tools
from gateway.protocols.responses_compaction import COMPACTION_ITEMS, SUMMARY_PROMPT, replayed_summary
from gateway.protocols.fields import (
    MAX_NAME_CHARS,
    Count,
    Name,
    OutputTokens,
    Probability,
    Temperature,
    check_schema,
)
from gateway.stream.accumulator import ToolRules


def seal_reasoning(text: str, tenant: Tenant) -> str:
    """The envelope of reasoning text, for ``tenant`` only (the summary shows the text; the
    envelope is what restores it upstream, so it must be this gateway's, for this client)."""
    return tenant.seal("r", text)


def open_reasoning(value: object, tenant: Tenant, param: str | None = None) -> str | None:
    """The reasoning text of a gateway envelope sealed for ``tenant``; None when ``value``
    is none (absent, another provider's, or an unencrypted one of earlier versions: the
    item's own summary text is used, which the client could send anyway); a named 400
    when it is one that does not open."""
    return tenant.open("r", value, param, legacy=True)


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
    builder = _input_messages(body.input, tool_map, tenant)
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


# -- input items -----------------------------------------------------------------------


def _image_part(part: dict[str, Any], param: str) -> dict[str, Any]:
    if part.get("file_id"):
        raise invalid_request(
            "input_image with file_id is not supported (no Files API here); send image_url",
            f"{param}.file_id",
            "file_id_not_supported",
        )
    url = part.get("image_url")
    if not isinstance(url, str) or not url:
        raise invalid_request("input_image needs an image_url", param=f"{param}.image_url")
    image: dict[str, Any] = {"url": url}
    if isinstance(part.get("detail"), str):
        image["detail"] = part["detail"]
    return {"type": "image_url", "image_url": image}


def _content_parts(content: list[Any], param: str) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        where = f"{param}[{j}]"
        if not isinstance(part, dict):
            raise invalid_request("content parts must be objects", param=where)
        kind = part.get("type")
        if kind in ("input_text", "output_text", "text"):
            text = part.get("text")
            if not isinstance(text, str):
                raise invalid_request(
                    "a text part needs a string 'text'", param=f"{where}.text", code="invalid_type"
                )
            parts.append({"type": "text", "text": text})
        elif kind == "refusal":
            parts.append({"type": "text", "text": str(part.get("refusal") or "")})
        elif kind == "input_image":
            parts.append(_image_part(part, where))
        elif kind == "input_file":
            raise invalid_request(
                "input_file parts are not supported by this gateway",
                where,
                "input_file_not_supported",
            )
        else:
            raise invalid_request(
                f"unsupported content part type {kind!r}",
                f"{where}.type",
                "unsupported_content_part",
            )
    return parts


def _flatten(parts: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """Text-only content becomes one string (parts joined by newlines); images keep a list."""
    if all(p["type"] == "text" for p in parts):
        return "\n".join(p["text"] for p in parts)
    return parts


class _Builder:
    """Accumulates chat messages from input items, merging tool calls into assistant turns."""

    def __init__(self, tool_map: ToolMap, tenant: Tenant) -> None:
        self.tool_map = tool_map
        self.tenant = tenant
        self.messages: list[dict[str, Any]] = []
        self.reasoning: list[str] = []  # waiting for the next assistant message
        self.images: list[dict[str, Any]] = []  # tool-output images, sent after the tool messages
        self.compaction_trigger = False

    def _flush_images(self) -> None:
        if self.images:
            intro = {"type": "text", "text": "Images returned by the tool calls above:"}
            self.messages.append({"role": "user", "content": [intro, *self.images]})
            self.images = []

    def _assistant(self, merge: bool) -> dict[str, Any]:
        last = self.messages[-1] if self.messages else None
        if merge and last is not None and last["role"] == "assistant" and not self.reasoning:
            return last
        message: dict[str, Any] = {"role": "assistant", "content": None}
        if self.reasoning:
            message["reasoning_content"] = "\n".join(self.reasoning)
            self.reasoning = []
        self.messages.append(message)
        return message

    def message(self, item: dict[str, Any], param: str) -> None:
        self._flush_images()
        role = item.get("role")
        if role not in ("user", "assistant", "system", "developer"):
            raise invalid_request(
                "role must be 'user', 'assistant', 'system' or 'developer'",
                param=f"{param}.role",
                code="invalid_value",
            )
        content = item.get("content")
        if isinstance(content, str):
            value: str | list[dict[str, Any]] = content
        elif isinstance(content, list):
            value = _flatten(_content_parts(content, f"{param}.content"))
        else:
            raise invalid_request(
                "content must be a string or a list of parts",
                param=f"{param}.content",
                code="invalid_type",
            )
        if role == "assistant":
            text = value if isinstance(value, str) else "".join(p.get("text", "") for p in value)
            last = self.messages[-1] if self.messages else None
            if (
                last
                and last["role"] == "assistant"
                and "tool_calls" not in last
                and not self.reasoning
            ):
                last["content"] = (last["content"] or "") + text  # one turn split into items
                return
            self._assistant(merge=False)["content"] = text
            return
        self.messages.append({"role": "system" if role == "developer" else role, "content": value})

    def function_call(self, item: dict[str, Any], param: str) -> None:
        self._flush_images()
        call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments", "")
        if not isinstance(call_id, str) or not call_id:
            raise invalid_request("function_call needs a call_id", param=f"{param}.call_id")
        if not isinstance(name, str) or not name:
            raise invalid_request("function_call needs a name", param=f"{param}.name")
        if not isinstance(arguments, str):
            raise invalid_request(
                "function_call arguments must be a string",
                param=f"{param}.arguments",
                code="invalid_type",
            )
        namespace = item.get("namespace") if isinstance(item.get("namespace"), str) else None
        self._tool_call(call_id, self.tool_map.upstream_name(name, namespace), arguments)

    def _tool_call(self, call_id: str, upstream_name: str, arguments: str) -> None:
        message = self._assistant(merge=True)
        message.setdefault("tool_calls", []).append(
            {"id": call_id, "type": "function", "function": {"name": upstream_name, "arguments": arguments}}
        )

    def client_tool_call(self, item: dict[str, Any], kind: str, param: str) -> None:
        """A replayed ``custom_tool_call`` / ``local_shell_call`` / ``shell_call`` /
        ``apply_patch_call``: the function call the upstream made, in its own terms."""
        self._flush_images()
        call_id = client_tools.replayed_call_id(item, param)
        name, arguments = client_tools.replayed_arguments(item, kind, param)
        namespace = item.get("namespace") if isinstance(item.get("namespace"), str) else None
        self._tool_call(call_id, self.tool_map.upstream_name(name, namespace), arguments)

    def client_tool_output(self, item: dict[str, Any], param: str) -> None:
        call_id = client_tools.output_call_id(item)
        if call_id is None:
            raise invalid_request(f"{item.get('type')} needs a call_id", param=f"{param}.call_id")
        output = client_tools.output_text(item)
        if output is None:
            raise invalid_request(
                "output must be a string or a list of parts",
                param=f"{param}.output",
                code="invalid_type",
            )
        self.function_call_output({"call_id": call_id, "output": output}, param)

    def compaction(self, item: dict[str, Any], param: str) -> None:
        """A replayed compaction item: the summary it carries, as the upstream reads it."""
        self._flush_images()
        self.messages.append(replayed_summary(item, param, self.tenant))

    def function_call_output(self, item: dict[str, Any], param: str) -> None:
        call_id, output = item.get("call_id"), item.get("output")
        if not isinstance(call_id, str) or not call_id:
            raise invalid_request("function_call_output needs a call_id", param=f"{param}.call_id")
        if isinstance(output, str):
            text = output
        elif isinstance(output, list):
            parts = _content_parts(output, f"{param}.output")
            text = "\n".join(p["text"] for p in parts if p["type"] == "text")
            self.images.extend(p for p in parts if p["type"] != "text")
        else:
            raise invalid_request(
                "output must be a string or a list of parts",
                param=f"{param}.output",
                code="invalid_type",
            )
        self.messages.append({"role": "tool", "tool_call_id": call_id, "content": text})

    def reasoning_item(self, item: dict[str, Any], param: str) -> None:
        for key in ("summary", "content"):
            parts = item.get(key)
            if parts is not None and not (isinstance(parts, list) and all(isinstance(p, dict) for p in parts)):
                raise invalid_request(
                    f"a reasoning item's {key} must be a list of parts",
                    param=f"{param}.{key}",
                    code="invalid_type",
                )
        text = open_reasoning(item.get("encrypted_content"), self.tenant, f"{param}.encrypted_content")
        if text is None:
            pieces = [p.get("text") for p in (item.get("content") or []) if isinstance(p, dict)]
            if not any(isinstance(p, str) and p for p in pieces):
                pieces = [p.get("text") for p in (item.get("summary") or []) if isinstance(p, dict)]
            text = "\n".join(p for p in pieces if isinstance(p, str) and p)
        if text:
            self.reasoning.append(text)


def _input_messages(value: str | list[Any] | None, tool_map: ToolMap, tenant: Tenant) -> _Builder:
    builder = _Builder(tool_map, tenant)
    if value is None:
        return builder
    if isinstance(value, str):
        builder.messages.append({"role": "user", "content": value})
        return builder
    for i, item in enumerate(value):
        param = f"input[{i}]"
        if not isinstance(item, dict):
            raise invalid_request("input items must be objects", param=param, code="invalid_type")
        kind = item.get("type")
        if kind is None:  # absent or null: a message, as OpenAI reads it
            kind = "message"
        if not isinstance(kind, str):
            raise invalid_request("an input item's type must be a string", param=f"{param}.type", code="invalid_type")
        if kind == "message":
            builder.message(item, param)
        elif kind == "function_call":
            builder.function_call(item, param)
        elif kind == "function_call_output":
            builder.function_call_output(item, param)
        elif kind == "reasoning":
            builder.reasoning_item(item, param)
        elif kind in client_tools.REPLAYED_CALLS:
            builder.client_tool_call(item, client_tools.REPLAYED_CALLS[kind], param)
        elif kind in client_tools.CALL_OUTPUTS:
            builder.client_tool_output(item, param)
        elif kind in COMPACTION_ITEMS:
            builder.compaction(item, param)
        elif kind == "compaction_trigger":
            if i != len(value) - 1:
                raise invalid_request(
                    "a compaction_trigger item must be the last input item",
                    f"{param}.type",
                    "invalid_compaction_trigger",
                )
            builder.compaction_trigger = True
        elif kind == "item_reference":
            raise invalid_request(
                "item_reference is not supported: send the referenced items themselves",
                param,
                "item_reference_not_supported",
            )
        else:
            raise invalid_request(
                f"unsupported input item type {kind!r}", f"{param}.type", "unsupported_input_item"
            )
    builder._flush_images()
    return builder
