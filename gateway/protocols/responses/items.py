"""The Response object and its output items as the client reads them: one set of
builders shared by the stream encoder (encoder.py) and the JSON answer (room.py), so a
streamed and a JSON answer to one question read the same."""

from __future__ import annotations

import secrets
import time
from typing import Any

from gateway.errors import GatewayError
from gateway.protocols.envelope import Tenant
from gateway.protocols.responses.client_tool_calls import call_item
from gateway.protocols.responses.input_items import seal_reasoning
from gateway.protocols.responses.tools import ToolMap
from gateway.stream.events import Completion, Usage


def usage_object(usage: Usage | None) -> dict[str, Any]:
    u = usage or Usage()
    return {
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {
            "cached_tokens": u.cached_tokens, "cache_write_tokens": u.prompt_details.get("cache_write_tokens", 0)
        },
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": u.reasoning_tokens},
        "total_tokens": u.total_tokens,
    }


def content_part(text: str, refusal: bool, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A message's one content part: ``output_text``, or ``refusal`` (what ``responses.parse``
    reports instead of parsing)."""
    if refusal:
        return {"type": "refusal", "refusal": text}
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def logprob_object(entry: dict[str, Any]) -> dict[str, Any]:
    """An upstream Chat ``logprobs.content`` entry as a Responses ``Logprob`` (its ``bytes``
    are required: the token's UTF-8 when the upstream left them out)."""

    def one(e: dict[str, Any]) -> dict[str, Any]:
        token = str(e.get("token", ""))
        raw = e.get("bytes")
        return {"token": token, "bytes": raw if isinstance(raw, list) else list(token.encode()), "logprob": e.get("logprob", 0.0)}

    tops = [one(t) for t in entry.get("top_logprobs") or () if isinstance(t, dict)]
    return {**one(entry), "top_logprobs": tops}


def output_logprobs(completion: Completion) -> list[dict[str, Any]]:
    """The answer's logprobs as the JSON answer's output_text shows them."""
    entries = completion.token_data.logprobs if completion.token_data is not None else []
    return [logprob_object(e) for e in entries]


def message_item(
    item_id: str, text: str | None, status: str, refusal: bool = False, logprobs: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    content = [] if text is None else [content_part(text, refusal, logprobs)]
    return {
        "id": item_id,
        "type": "message",
        "status": status,
        "role": "assistant",
        "content": content,
    }


def function_call_item(
    item_id: str, call_id: str, client_name: tuple[str, str | None], arguments: str, status: str
) -> dict[str, Any]:
    name, namespace = client_name
    item: dict[str, Any] = {
        "id": item_id,
        "type": "function_call",
        "status": status,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
    }
    if namespace is not None:
        item["namespace"] = namespace
    return item


def reasoning_item(item_id: str, text: str | None, envelope: Tenant | None) -> dict[str, Any]:
    """``envelope``: the tenant to seal ``encrypted_content`` for (include asked), else None."""
    item: dict[str, Any] = {"id": item_id, "type": "reasoning", "summary": []}
    if text is not None:
        item["summary"] = [{"type": "summary_text", "text": text}]
        if envelope is not None:
            item["encrypted_content"] = seal_reasoning(text, envelope)
    return item


def new_id(prefix: str) -> str:
    """A fresh output id (``resp_``, ``msg_``, ``fc_`` ... plus 32 hex digits)."""
    return prefix + secrets.token_hex(16)


def client_name_of(tool_map: ToolMap, upstream: str | None) -> tuple[str, str | None]:
    return tool_map.client.get(upstream or "", (upstream or "", None))


def tool_call_item(
    tool_map: ToolMap, item_id: str, call_id: str, upstream: str | None, arguments: str, status: str
) -> dict[str, Any]:
    """The output item of one upstream tool call: ``function_call``, or the item of the
    client-executed tool type it was declared as (``custom_tool_call``, ...)."""
    name, namespace = client_name_of(tool_map, upstream)
    kind = tool_map.kinds.get(upstream or "")
    if kind is None:
        return function_call_item(item_id, call_id, (name, namespace), arguments, status)
    return call_item(kind, item_id, call_id, name, namespace, arguments, status)


def response_object(
    echo: dict[str, Any],
    response_id: str,
    created_at: int,
    status: str,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None = None,
    incomplete_reason: str | None = None,
    error: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The Response object; ``echo`` holds the request fields it repeats."""
    body: dict[str, Any] = {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "background": False,
        "error": error,
        "incomplete_details": {"reason": incomplete_reason} if incomplete_reason else None,
        **echo,
        "output": output,
        "usage": usage,
    }
    if status in ("completed", "incomplete", "failed"):
        body["completed_at"] = int(time.time()) if status == "completed" else None
    return body


def terminal_status(finish_reason: str) -> tuple[str, str | None]:
    """The Response status and incomplete reason a finish reason means."""
    if finish_reason == "length":
        return "incomplete", "max_output_tokens"
    if finish_reason == "content_filter":
        return "incomplete", "content_filter"
    return "completed", None


def failed_error(error: GatewayError) -> dict[str, Any]:
    """``response.error``: its ``code`` must be one of the spec's literals."""
    code = "rate_limit_exceeded" if error.kind == "rate_limit" else "server_error"
    return {"code": code, "message": f"{error.message} ({error.code})"}
