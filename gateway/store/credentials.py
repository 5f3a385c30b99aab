"""Credential health (disabled, cooldowns) and admin-added credentials, in the store.

Writes are tiny and rare (a failure or an admin action), so they are done synchronously;
on SQLite the file is mode 0600, and keys never leave the store through any API. Each
state row carries a version bumped by every write: replicas polling the table apply a row
only when it is newer than the one they last wrote or read, so an old poll result never
undoes a newer local change.
"""

from __future__ import annotations

import time
from typing import Any

import orjson

from gateway.store.db import Store, upsert

_ADD = upsert("credentials", ("credential_id", "upstream", "base_url", "api_key", "created_at"), "credential_id")


class CredentialState:
    """Persists :class:`~gateway.upstream.pool.Credential` state across restarts and replicas."""

    def __init__(self, db: Store) -> None:
        self.db = db

    def load(self) -> dict[str, dict[str, Any]]:
        return {cid: state for cid, (_, state) in self.load_versions().items()}

    def load_versions(self) -> dict[str, tuple[int, dict[str, Any]]]:
        """credential id -> (version, state) for every stored row."""
        rows = self.db.execute("SELECT credential_id, version, state FROM credential_state")
        return {cid: (int(version), orjson.loads(state)) for cid, version, state in rows}

    def save(self, credential_id: str, state: dict[str, Any]) -> int:
        """Replace the credential's state; returns the row's new version."""
        rows = self.db.execute(
            "INSERT INTO credential_state (credential_id, state, updated_at, version) VALUES (?, ?, ?, 1) "
            "ON CONFLICT (credential_id) DO UPDATE SET state = excluded.state, "
            "updated_at = excluded.updated_at, version = credential_state.version + 1 RETURNING version",
            (credential_id, orjson.dumps(state).decode(), time.time()),
        )
        return int(rows[0][0])

    def added_credentials(self) -> list[tuple[str, str, str, str | None]]:
        """(id, upstream name, base_url, api_key) of credentials added through the admin API."""
        return [tuple(r) for r in self.db.execute(  # type: ignore[misc]
            "SELECT credential_id, upstream, base_url, api_key FROM credentials ORDER BY created_at"
        )]

    def add_credential(self, credential_id: str, upstream: str, base_url: str, api_key: str | None) -> None:
        self.db.execute(_ADD, (credential_id, upstream, base_url, api_key, time.time()))


#: The name this class had when SQLite was the only backend.
SqliteCredentialState = CredentialState
