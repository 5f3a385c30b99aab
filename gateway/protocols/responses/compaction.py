"""Responses compaction: a summarising generation whose answer is one opaque item.

Codex (provider treated as OpenAI) compacts a long conversation by sending its history
with a trailing ``{"type": "compaction_trigger"}`` item (or, older versions, ``POST
/v1/responses/compact``) and expects exactly one ``{"type": "compaction",
"encrypted_content": ...}`` output item, which it replays instead of the history in later
requests. Here the upstream writes the summary (the caller's instructions first, then the
history, then :data:`SUMMARY_PROMPT`); the item carries it in a gateway envelope
(encrypted and authenticated for the client that asked, protocols/envelope.py, shared with
reasoning items), and a replayed item becomes :func:`summary_message` for the upstream.

Pure: no I/O. A replayed item that is no gateway envelope is a named 400
(``invalid_compaction_item``); one that does not open for this client (altered, truncated,
another client key's, from before encryption) is ``invalid_encrypted_content``.
"""

from __future__ import annotations

import secrets
import time
from typing import Any

from gateway.errors import invalid_request
from gateway.protocols.envelope import Tenant

#: Item types Codex uses for a compacted history (``compaction_summary`` is its alias).
COMPACTION_ITEMS = frozenset({"compaction", "compaction_summary"})

#: The envelope field holding a compaction summary (reasoning uses ``r``).
_FIELD = "c"

SUMMARY_PROMPT = (
    "Context checkpoint: the conversation above is about to be replaced by your summary. "
    "Write a handoff summary that lets you continue the work without the history: the "
    "user's goal and constraints, what has been done (files touched, commands run and "
    "their results), decisions made, and what remains to do next. Be concise and "
    "factual; do not call tools; answer with the summary only."
)

_SUMMARY_INTRO = "Summary of the earlier conversation (it was compacted; continue from here):\n\n"


def seal_summary(summary: str, tenant: Tenant) -> str:
    return tenant.seal(_FIELD, summary)


def open_summary(value: object, tenant: Tenant, param: str | None = None) -> str | None:
    """The summary of a compaction envelope sealed for ``tenant``; None when ``value`` is
    no gateway envelope; a named 400 when it is one that does not open."""
    return tenant.open(_FIELD, value, param)


def summary_message(summary: str) -> dict[str, Any]:
    """What the upstream reads in place of the compacted history."""
    return {"role": "user", "content": _SUMMARY_INTRO + summary}


def replayed_summary(item: dict[str, Any], param: str, tenant: Tenant) -> dict[str, Any]:
    """A replayed compaction item as the upstream reads it, or a 400 when this gateway did
    not seal it for this client."""
    summary = open_summary(item.get("encrypted_content"), tenant, f"{param}.encrypted_content")
    if summary is None:
        raise invalid_request(
            "this compaction item was not produced by this gateway (its encrypted_content"
            " is not a gateway envelope); send the conversation items instead",
            param=f"{param}.encrypted_content",
            code="invalid_compaction_item",
        )
    return summary_message(summary)


def compaction_item(summary: str, tenant: Tenant, item_id: str | None = None) -> dict[str, Any]:
    """The one output item of a compaction turn."""
    return {
        "id": item_id or "cmp_" + secrets.token_hex(16),
        "type": "compaction",
        "encrypted_content": seal_summary(summary, tenant),
    }


def compacted_response(response_id: str, item: dict[str, Any], usage: dict[str, Any]) -> dict[str, Any]:
    """The ``POST /v1/responses/compact`` answer (``response.compaction``)."""
    return {
        "id": response_id,
        "object": "response.compaction",
        "created_at": int(time.time()),
        "output": [item],
        "usage": usage,
    }
