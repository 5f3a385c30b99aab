"""Gemini thought signatures, carried inside the client-visible tool call id.

Gemini's OpenAI-compatible endpoint puts ``extra_content.google.thought_signature`` on
tool calls and rejects a replayed call without it. Clients of the three protocols have no
field for it, but every one of them sends a call's id back verbatim (Chat
``tool_calls[].id`` / ``tool_call_id``, Messages ``tool_use.id`` / ``tool_use_id``,
Responses ``call_id``). So the gateway appends the signature to the id it shows the
client, and on the next turn :func:`restore_thought_signatures` splits it off again: the
upstream sees its own id and gets the signature back beside the call. Nothing is kept
per call (works with ``store: false``); the keys are the store's, so ids open on every
replica and after restarts.

The suffix is ``__gts_`` + a token that carries the signature sealed for the client and
the call (``Tenant.seal_signature``: AES-GCM, protocols/envelope.py), unpadded base64url,
so the id stays within ``[A-Za-z0-9_-]`` (the pattern Anthropic's API requires of
tool_use ids). A suffix that does not open for this client and call (forged, altered,
another client key's, or from before envelopes) is stripped: the upstream gets the plain
id and no signature, so no client text ever reaches ``thought_signature``.

Pure: the sealing and opening are handed in as functions (the request's tenant's).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

MARKER = "__gts_"

#: (upstream call id, signature) -> the id-safe token that carries it
Seal = Callable[[str, str], str]
#: (upstream call id, token) -> the signature, or None when the token does not open
Open = Callable[[str, str], "str | None"]


def client_call_id(call_id: str, signature: str | None, seal: Seal | None) -> str:
    """The id the client sees: the upstream's, plus the sealed signature when there is one
    (and a ``seal``: without one, the signature is not carried)."""
    if not signature or seal is None:
        return call_id
    return f"{call_id}{MARKER}{seal(call_id, signature)}"


def split_call_id(client_id: str) -> tuple[str, str | None]:
    """(upstream id, token or None) of an id the gateway showed a client (the first
    marker: the upstream's id comes first, the token is random base64url)."""
    base, sep, token = client_id.partition(MARKER)
    if not sep or not base or not token:
        return client_id, None
    return base, token


def restore_thought_signatures(body: dict[str, Any], open_signature: Open) -> dict[str, Any]:
    """The upstream Chat body with every signature-carrying id split back: assistant
    ``tool_calls[]`` get their id and, when the token opens, their
    ``extra_content.google.thought_signature``; tool results their plain ``tool_call_id``.
    Returns ``body`` itself when nothing changes."""
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
            message["tool_calls"] = [_restore_call(c, open_signature) for c in calls]
        restored.append(message)
    return {**body, "messages": restored}


def _restore_call(call: Any, open_signature: Open) -> Any:
    if not isinstance(call, dict) or not isinstance(call.get("id"), str):
        return call
    call_id, token = split_call_id(call["id"])
    if token is None:
        return call
    signature = open_signature(call_id, token)
    if signature is None:  # not ours for this client and call: stripped, never forwarded
        return {**call, "id": call_id}
    extra = dict(call.get("extra_content") or {})
    extra["google"] = {**(extra.get("google") or {}), "thought_signature": signature}
    return {**call, "id": call_id, "extra_content": extra}
