"""Responses compaction: a summarising generation whose answer is one opaque item.

Codex (provider treated as OpenAI) compacts a long conversation by sending its history
with a trailing ``{"type": "compaction_trigger"}`` item (or, older versions, ``POST
/v1/responses/compact``) and expects exactly one ``{"type": "compaction",
"encrypted_content": ...}`` output item, which it replays instead of the history in later
requests. Here the upstream writes the summary (the caller's instructions first, then the
history, then :data:`SUMMARY_PROMPT`); the item carries it in a signed gateway envelope,
and a replayed item becomes :func:`summary_message` for the upstream.

Pure: no I/O (a replayed item this gateway did not seal is a named 400). The envelope format (protocols/envelope.py) is shared with reasoning items.
"""

from __future__ import annotations

import secrets
import time
from typing import Any

from gateway.errors import invalid_request
from gateway.protocols.envelope import open_envelope, seal_envelope

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


def seal_summary(summary: str) -> str:
    return seal_envelope(_FIELD, summary)


def open_summary(value: object) -> str | None:
    """The summary of a compaction envelope of this gateway, else None.

    An envelope with a bad signature (sealed before a restart: the key is per process)
    still yields its text with ``lenient``: the summary is the client's own context,
    not a secret, and losing it would end the session."""
    return open_envelope(_FIELD, value, lenient=True)


def summary_message(summary: str) -> dict[str, Any]:
    """What the upstream reads in place of the compacted history."""
    return {"role": "user", "content": _SUMMARY_INTRO + summary}


def replayed_summary(item: dict[str, Any], param: str) -> dict[str, Any]:
    """A replayed compaction item as the upstream reads it, or a 400 when this gateway did
    not seal it."""
    summary = open_summary(item.get("encrypted_content"))
    if summary is None:
        raise invalid_request(
            "this compaction item was not produced by this gateway (its encrypted_content"
            " is not a gateway envelope); send the conversation items instead",
            param=f"{param}.encrypted_content",
            code="invalid_compaction_item",
        )
    return summary_message(summary)


def compaction_item(summary: str, item_id: str | None = None) -> dict[str, Any]:
    """The one output item of a compaction turn."""
    return {
        "id": item_id or "cmp_" + secrets.token_hex(16),
        "type": "compaction",
        "encrypted_content": seal_summary(summary),
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
