"""Responses ``input`` items -> chat messages, and the reasoning envelope they replay.

Split from translate.py, which builds the rest of the upstream body: this is the one
walk over the input items (messages, function calls and their outputs, reasoning,
replayed client-executed tool calls and outputs, compaction items, the compaction
trigger), merging tool calls into assistant turns and turning each shape into what the
upstream reads. The reasoning envelope's two halves live here together: the encoder
seals reasoning text into output items, and a replayed reasoning item is opened here.

Pure, with named 400s (no I/O).
"""

from __future__ import annotations

from typing import Any

from gateway.errors import invalid_request
from gateway.protocols.envelope import Tenant
from gateway.protocols.responses import client_tool_calls
from gateway.protocols.responses.compaction import COMPACTION_ITEMS, replayed_summary
from gateway.protocols.responses.tools import ToolMap


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


class MessageBuilder:
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
        call_id = client_tool_calls.replayed_call_id(item, param)
        name, arguments = client_tool_calls.replayed_arguments(item, kind, param)
        namespace = item.get("namespace") if isinstance(item.get("namespace"), str) else None
        self._tool_call(call_id, self.tool_map.upstream_name(name, namespace), arguments)

    def client_tool_output(self, item: dict[str, Any], param: str) -> None:
        call_id = client_tool_calls.output_call_id(item)
        if call_id is None:
            raise invalid_request(f"{item.get('type')} needs a call_id", param=f"{param}.call_id")
        output = client_tool_calls.output_text(item)
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


def input_messages(value: str | list[Any] | None, tool_map: ToolMap, tenant: Tenant) -> MessageBuilder:
    builder = MessageBuilder(tool_map, tenant)
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
        elif kind in client_tool_calls.REPLAYED_CALLS:
            builder.client_tool_call(item, client_tool_calls.REPLAYED_CALLS[kind], param)
        elif kind in client_tool_calls.CALL_OUTPUTS:
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
