"""Stored Responses (``store: true``): the final Response object plus the chat messages
needed to continue the conversation with ``previous_response_id``.

One row per response in the ``responses`` table (migration 2); ``body`` is JSON:
``{"response": <Response object>, "history": [chat messages before this turn's output],
"output": [the assistant chat message(s) this response produced]}``. Shared by every
replica on PostgreSQL, so a follow-up turn may land on any of them.
"""

from __future__ import annotations

import time
from typing import Any

import orjson

from gateway.store.db import Store, upsert

_SAVE = upsert("responses", ("id", "created_at", "body"), "id")


class ResponseStore:
    """Reads and writes stored responses through the shared store."""

    def __init__(self, db: Store) -> None:
        self.db = db

    async def save(self, response_id: str, record: dict[str, Any]) -> None:
        await self.db.aexecute(_SAVE, (response_id, time.time(), orjson.dumps(record).decode()))

    async def load(self, response_id: str) -> dict[str, Any] | None:
        rows = await self.db.aexecute("SELECT body FROM responses WHERE id = ?", (response_id,))
        if not rows:
            return None
        value = orjson.loads(rows[0][0])
        return value if isinstance(value, dict) else None
