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
from gateway.store.spill import DurableWriter

#: The stored-response upsert, keyed by response id (a replayed spill never duplicates it).
RESPONSE_UPSERT = _SAVE = upsert("responses", ("id", "created_at", "body"), "id")


class ResponseNotSaved(Exception):
    """Neither the store nor the spill journal took the response."""


class ResponseStore:
    """Reads and writes stored responses through the shared store.

    With a :class:`~gateway.store.spill.DurableWriter`, a response the store cannot take
    goes to the spill journal and is also kept in memory until the journal is replayed,
    so ``GET /v1/responses/{id}`` and ``previous_response_id`` keep working meanwhile.
    """

    def __init__(self, db: Store, durable: DurableWriter | None = None) -> None:
        self.db = db
        self.durable = durable
        self._spilled: dict[str, dict[str, Any]] = {}

    async def save(self, response_id: str, record: dict[str, Any]) -> None:
        row = (response_id, time.time(), orjson.dumps(record).decode())
        if self.durable is None:
            await self.db.aexecute(_SAVE, row)
            return
        outcome = await self.durable.write("response", [row])
        if outcome == "spilled":
            self._spilled[response_id] = record
        elif outcome == "lost":
            raise ResponseNotSaved(f"response {response_id} could not be stored")

    async def load(self, response_id: str) -> dict[str, Any] | None:
        if self._spilled:
            if self.durable is not None and not self.durable.spill_entries:
                self._spilled.clear()  # replayed: the store has them now
            elif response_id in self._spilled:
                return self._spilled[response_id]
        rows = await self.db.aexecute("SELECT body FROM responses WHERE id = ?", (response_id,))
        if not rows:
            return None
        value = orjson.loads(rows[0][0])
        return value if isinstance(value, dict) else None
