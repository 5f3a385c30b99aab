"""Credential health (disabled, cooldowns) and admin-added credentials, in SQLite.

Writes are tiny and rare (a failure or an admin action), so they are done synchronously;
the file is mode 0600 and keys never leave it through any API.
"""

from __future__ import annotations

import time
from typing import Any

import orjson

from gateway.store.db import Database


class SqliteCredentialState:
    """Persists :class:`~gateway.upstream.pool.Credential` state across restarts."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def load(self) -> dict[str, dict[str, Any]]:
        rows = self.db.execute("SELECT credential_id, state FROM credential_state")
        return {cid: orjson.loads(state) for cid, state in rows}

    def save(self, credential_id: str, state: dict[str, Any]) -> None:
        self.db.execute(
            "INSERT INTO credential_state (credential_id, state, updated_at) VALUES (?, ?, ?) "
            "ON CONFLICT(credential_id) DO UPDATE SET state = excluded.state, updated_at = excluded.updated_at",
            (credential_id, orjson.dumps(state).decode(), time.time()),
        )

    def added_credentials(self) -> list[tuple[str, str, str, str | None]]:
        """(id, upstream name, base_url, api_key) of credentials added through the admin API."""
        return [tuple(r) for r in self.db.execute(  # type: ignore[misc]
            "SELECT credential_id, upstream, base_url, api_key FROM credentials ORDER BY created_at"
        )]

    def add_credential(self, credential_id: str, upstream: str, base_url: str, api_key: str | None) -> None:
        self.db.execute(
            "INSERT OR REPLACE INTO credentials (credential_id, upstream, base_url, api_key, created_at) VALUES (?, ?, ?, ?, ?)",
            (credential_id, upstream, base_url, api_key, time.time()),
        )
