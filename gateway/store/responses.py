"""Stored Responses (``store: true``): the final Response object plus the chat messages
needed to continue the conversation with ``previous_response_id``.

One row per response in the ``responses`` table (migration 2); ``body`` is JSON:
``{"response": <Response object>, "history": [chat messages before this turn's output],
"output": [the assistant chat message(s) this response produced]}``. Shared by every
replica on PostgreSQL, so a follow-up turn may land on any of them.

Each row records its ``owner`` (migration 8), the client identity that created it
(gateway/keys/identity.py); :meth:`ResponseStore.load` answers only its owner, so another client
key cannot tell the id exists. Rows from before migration 8 have no owner: they are read
as that version read them, by every request a static ``--api-key`` admits (then any valid
key read any stored response) and by :data:`~gateway.keys.identity.ANONYMOUS` (no client
key configured); never by a managed key (``key:``), which did not exist then. So an
upgrade with static keys keeps ``previous_response_id`` working (issue #40).
"""

from __future__ import annotations

import time
from typing import Any

import orjson
import structlog

from gateway.errors import GatewayError
from gateway.keys.identity import ANONYMOUS, is_static_key_identity
from gateway.store.db import Store, upsert
from gateway.store.spill import DurableWriter, StoreUnavailable

log = structlog.get_logger("gateway.responses")

#: The stored-response upsert, keyed by response id (a replayed spill never duplicates it):
#: spill journals from before migration 8 hold rows of this shape (no owner).
RESPONSE_UPSERT = upsert("responses", ("id", "created_at", "body"), "id")
#: The upsert of rows with their owner (the spill kind ``owned_response``).
OWNED_RESPONSE_UPSERT = _SAVE = upsert("responses", ("id", "created_at", "body", "owner"), "id")
#: Spill kind -> statement, for the DurableWriter.
RESPONSE_STATEMENTS = {"response": RESPONSE_UPSERT, "owned_response": OWNED_RESPONSE_UPSERT}
#: Spill kind -> the metrics' ``kind`` label (both are stored responses).
SPILL_KINDS = {"owned_response": "response"}

_LOAD = "SELECT body, owner FROM responses WHERE id = ?"


def readable_by(owner: str | None, identity: str) -> bool:
    """A row is its owner's; a row without one (from before migration 8, when stored
    responses were not bound to a key) is read as then: without client keys, or with any
    static one."""
    if owner is not None:
        return owner == identity
    return identity == ANONYMOUS or is_static_key_identity(identity)


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

    async def save(self, response_id: str, record: dict[str, Any], owner: str = ANONYMOUS) -> None:
        row = (response_id, time.time(), orjson.dumps(record).decode(), owner)
        if self.durable is None:
            await self.db.aexecute(_SAVE, row)
            return
        outcome = await self.durable.write("owned_response", [row])
        if outcome == "lost":
            raise ResponseNotSaved(f"response {response_id} could not be stored")

    async def load(self, response_id: str, owner: str = ANONYMOUS) -> dict[str, Any] | None:
        """The record of ``response_id`` when ``owner`` may read it, else None (unknown
        and not yours answer alike)."""
        if self.durable is None:
            rows = await self.db.aexecute(_LOAD, (response_id,))
        else:
            rows = await self._spilled(response_id)
            if rows is None:
                try:
                    rows = await self.durable.read(lambda conn: conn.execute(_LOAD, (response_id,)).fetchall())
                except StoreUnavailable as exc:
                    log.warning("response_read_failed", response_id=response_id, error=str(exc))
                    raise store_unavailable() from None
        if not rows or not readable_by(rows[0][1], owner):
            return None
        value = orjson.loads(rows[0][0])
        return value if isinstance(value, dict) else None

    async def _spilled(self, response_id: str) -> list[tuple[Any, str | None]] | None:
        """(body, owner) of a response waiting in the spill journal (a row from a journal
        written before owners existed has none), or None."""
        assert self.durable is not None
        owned = await self.durable.spilled_row("owned_response", response_id)
        if owned is not None:
            return [(owned[2], owned[3])]
        legacy = await self.durable.spilled_row("response", response_id)
        return [(legacy[2], None)] if legacy is not None else None


def store_unavailable() -> GatewayError:
    """The retryable 503 of a stored response that cannot be read now (the route's shape;
    what went wrong is logged, not sent: a database error may name internal hosts)."""
    return GatewayError(
        "overloaded", "store_unavailable", "stored responses cannot be read right now; retry shortly", retry_after=1,
    )
