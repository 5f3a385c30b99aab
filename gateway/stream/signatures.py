"""Gemini thought signatures, carried inside the client-visible tool call id.

Gemini's OpenAI-compatible endpoint puts ``extra_content.google.thought_signature`` on
tool calls and rejects a replayed call without it. Clients of the three protocols have no
field for it, but every one of them sends a call's id back verbatim (Chat
``tool_calls[].id`` / ``tool_call_id``, Messages ``tool_use.id`` / ``tool_use_id``,
Responses ``call_id``). So the gateway appends the signature to the id it shows the
client, and on the next turn :func:`restore_thought_signatures` splits it off again: the
upstream sees its own id and gets the signature back beside the call. Stateless (no
store, works with ``store: false``, across replicas and restarts).

The suffix is ``__gts_`` + the signature in unpadded base64url, so the id stays within
``[A-Za-z0-9_-]`` (the pattern Anthropic's API requires of tool_use ids).
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

MARKER = "__gts_"


def client_call_id(call_id: str, signature: str | None) -> str:
    """The id the client sees: the upstream's id, plus the signature when there is one."""
    if not signature:
        return call_id
    encoded = base64.urlsafe_b64encode(signature.encode()).decode().rstrip("=")
    return f"{call_id}{MARKER}{encoded}"


def split_call_id(client_id: str) -> tuple[str, str | None]:
    """(upstream id, signature or None) of an id the gateway showed a client."""
    base, sep, encoded = client_id.rpartition(MARKER)
    if not sep or not base:
        return client_id, None
    try:
        signature = base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4)).decode()
    except (binascii.Error, UnicodeDecodeError, ValueError):
        return client_id, None
    return base, signature


def restore_thought_signatures(body: dict[str, Any]) -> dict[str, Any]:
    """The upstream Chat body with every signature-carrying id split back: assistant
    ``tool_calls[]`` get their id and ``extra_content.google.thought_signature``; tool
    results their plain ``tool_call_id``. Returns ``body`` itself when nothing changes."""
    messages = body.get("messages")
    if not isinstance(messages, list) or MARKER not in str(messages):
        return body
    restored: list[Any] = []
    for message in messages:
        if not isinstance(message, dict):
            restored.append(message)
            continue
        message = dict(message)
        if isinstance(message.get("tool_call_id"), str):
            message["tool_call_id"] = split_call_id(message["tool_call_id"])[0]
        calls = message.get("tool_calls")
        if isinstance(calls, list):
            message["tool_calls"] = [_restore_call(c) for c in calls]
        restored.append(message)
    return {**body, "messages": restored}


def _restore_call(call: Any) -> Any:
    if not isinstance(call, dict) or not isinstance(call.get("id"), str):
        return call
    call_id, signature = split_call_id(call["id"])
    if signature is None:
        return call
    extra = dict(call.get("extra_content") or {})
    extra["google"] = {**(extra.get("google") or {}), "thought_signature": signature}
    return {**call, "id": call_id, "extra_content": extra}
