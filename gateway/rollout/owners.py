"""Rollouts belong to the client key that made them (migration 11's ``rollout_owners``).

A rollout id is claimed by the client identity (gateway/keys/identity.py: ``key:<id>`` for
a managed key) of its first recorded call; a call of another identity with the same id is
refused (403 ``rollout_forbidden``) before anything is recorded, read or sent upstream, so
it can neither write into the rollout nor be continued from its sampled tokens. An id an
admin deleted stays taken for :data:`DELETED_GRACE` (410 ``rollout_deleted``): a late call
of the old run cannot silently start a new rollout under it.

The functions here block (callers run them in a worker thread); :func:`claim` is one
transaction and two replicas claiming one id at once agree on the first insert.
:class:`OwnerClaims` is their async shell on the request path, bounded, with a memory of
the owners this process saw claimed for a store that does not answer.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from typing import Any

import structlog

from gateway.errors import GatewayError
from gateway.store.db import Store

log = structlog.get_logger("gateway.rollout")

#: Rollout owners remembered per process (the claim's fallback in a store outage).
KNOWN_OWNERS = 100_000
#: Seconds the ownership claim may take (then memory, else 503: fail closed).
CLAIM_TIMEOUT = 2.0

#: Seconds a deleted rollout id stays taken.
DELETED_GRACE = 86400.0

_SELECT = "SELECT owner, deleted_at FROM rollout_owners WHERE rollout_id = ?"


def forbidden(rollout_id: str) -> GatewayError:
    return GatewayError("permission", "rollout_forbidden",
                        f"rollout {rollout_id!r} belongs to another client key", param="rollout_id")


def deleted(rollout_id: str) -> GatewayError:
    return GatewayError("invalid_request", "rollout_deleted",
                        f"rollout {rollout_id!r} was deleted; its id is not taken again for "
                        f"{int(DELETED_GRACE // 3600)} hours: use a new one", param="rollout_id", status=410)


def claim(db: Store, rollout_id: str, owner: str, now: float) -> GatewayError | None:
    """The id for ``owner`` (claimed when new, or deleted longer than the grace ago), else
    the refusal."""

    def run(conn: Any) -> GatewayError | None:
        row = conn.execute(_SELECT, (rollout_id,)).fetchone()
        if row is None:
            conn.execute("INSERT INTO rollout_owners (rollout_id, owner, created_at) VALUES (?, ?, ?)"
                         " ON CONFLICT (rollout_id) DO NOTHING", (rollout_id, owner, now))
            row = conn.execute(_SELECT, (rollout_id,)).fetchone()
        holder, deleted_at = row
        if deleted_at is not None:
            if now - float(deleted_at) < DELETED_GRACE:
                return deleted(rollout_id)
            conn.execute("UPDATE rollout_owners SET owner = ?, created_at = ?, deleted_at = NULL WHERE rollout_id = ?",
                         (owner, now, rollout_id))
            return None
        return None if holder == owner else forbidden(rollout_id)

    return db.run_tx(run)


def mark_deleted(conn: Any, rollout_id: str, now: float) -> None:
    """In the admin delete's transaction: the id stays taken for the grace period."""
    conn.execute(
        "INSERT INTO rollout_owners (rollout_id, owner, created_at, deleted_at) VALUES (?, '', ?, ?)"
        " ON CONFLICT (rollout_id) DO UPDATE SET deleted_at = excluded.deleted_at", (rollout_id, now, now))


def owner_of(conn: Any, rollout_id: str) -> str | None:
    row = conn.execute(_SELECT, (rollout_id,)).fetchone()
    return None if row is None else str(row[0])


def owners(conn: Any) -> dict[str, str]:
    """Every live rollout's owner (the admin listing)."""
    rows = conn.execute("SELECT rollout_id, owner FROM rollout_owners WHERE deleted_at IS NULL").fetchall()
    return {str(r): str(o) for r, o in rows}


def shown(owner: str | None) -> dict[str, Any]:
    """The owner as the admin read-back shows it: the identity, and the managed key's id."""
    key_id = owner[4:] if owner and owner.startswith("key:") else None
    return {"owner": owner, "owner_key_id": key_id}


class OwnerClaims:
    """The claim of each rollout call, bounded by :data:`CLAIM_TIMEOUT`. A store that cannot
    answer in time: a rollout this process saw claimed goes on for its owner (an owner never
    changes, so memory is enough: rollout calls keep flowing through a store outage),
    another key's call is still a 403, anything else a 503, never a call written into a
    rollout nobody checked."""

    def __init__(self, db: Store) -> None:
        self.db = db
        #: rollout -> its owner, as claimed through this process (bounded, least recently
        #: claimed go first)
        self._known: OrderedDict[str, str] = OrderedDict()

    async def claim(self, rollout_id: str, owner: str) -> None:
        """The rollout id for this client identity, or its refusal (403 another key's, 410
        deleted lately, 503 the store cannot say)."""
        try:
            async with asyncio.timeout(CLAIM_TIMEOUT):
                refusal = await self.db.acall(claim, self.db, rollout_id, owner, time.time())
        except (TimeoutError, *self.db.errors) as exc:
            known = self._known.get(rollout_id)
            log.warning("rollout_claim_failed", rollout=rollout_id, error=type(exc).__name__,
                        from_memory=known is not None)
            if known == owner:  # claimed through this process: an owner never changes
                return
            if known is not None:
                raise forbidden(rollout_id) from None
            raise GatewayError("overloaded", "store_unavailable",
                               "the store cannot say whose rollout this is now; try again", retry_after=1) from None
        if refusal is not None:
            raise refusal
        self._known[rollout_id] = owner
        self._known.move_to_end(rollout_id)
        if len(self._known) > KNOWN_OWNERS:
            self._known.popitem(last=False)

    def forget(self, rollout_id: str) -> None:
        """The rollout was deleted: its id is the store's to refuse (410) now."""
        self._known.pop(rollout_id, None)
