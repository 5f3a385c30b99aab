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
import structlog

from gateway.errors import GatewayError
from gateway.store.db import Store, upsert
from gateway.store.spill import DurableWriter, StoreUnavailable

log = structlog.get_logger("gateway.responses")

#: The stored-response upsert, keyed by response id (a replayed spill never duplicates it).
RESPONSE_UPSERT = _SAVE = upsert("responses", ("id", "created_at", "body"), "id")


class ResponseNotSaved(Exception):
    """Neither the store nor the spill journal took the response."""


class ResponseStore:
    """Reads and writes stored responses through the shared store.

    With a :class:`~gateway.store.spill.DurableWriter`, a response the store cannot take
    goes to the spill journal, where it is found by id until the journal is replayed
    (also after a restart), so ``GET /v1/responses/{id}`` and ``previous_response_id``
    keep working meanwhile; a store read that fails or does not answer in time is a
    retryable 503 ``store_unavailable``, never a wait or a 500.
    """

    def __init__(self, db: Store, durable: DurableWriter | None = None) -> None:
        self.db = db
        self.durable = durable

    async def save(self, response_id: str, record: dict[str, Any]) -> None:
        row = (response_id, time.time(), orjson.dumps(record).decode())
        if self.durable is None:
            await self.db.aexecute(_SAVE, row)
            return
        outcome = await self.durable.write("response", [row])
        if outcome == "lost":
            raise ResponseNotSaved(f"response {response_id} could not be stored")

    async def load(self, response_id: str) -> dict[str, Any] | None:
        if self.durable is None:
            rows = await self.db.aexecute("SELECT body FROM responses WHERE id = ?", (response_id,))
        else:
            spilled = await self.durable.spilled_row("response", response_id)
            if spilled is not None:
                rows = [(spilled[2],)]
            else:
                try:
                    rows = await self.durable.read(
                        lambda conn: conn.execute("SELECT body FROM responses WHERE id = ?", (response_id,)).fetchall()
                    )
                except StoreUnavailable as exc:
                    log.warning("response_read_failed", response_id=response_id, error=str(exc))
                    raise store_unavailable() from None
        if not rows:
            return None
        value = orjson.loads(rows[0][0])
        return value if isinstance(value, dict) else None


def store_unavailable() -> GatewayError:
    """The retryable 503 of a stored response that cannot be read now (the route's shape;
    what went wrong is logged, not sent: a database error may name internal hosts)."""
    return GatewayError(
        "overloaded", "store_unavailable", "stored responses cannot be read right now; retry shortly", retry_after=1,
    )
