"""Saved settings (admin API / WebUI) with revisions, in the SQLite store.

Every write names the revision it read (optimistic concurrency): a stale revision is
refused with the current one; a good write replaces the values, bumps the revision and
appends a history row (who, when, old -> new, secret values redacted), all in one
transaction. Readers poll the revision (one indexed read on their own connection), so
every process, every worker, applies a new revision to its next request.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

import orjson

from gateway.store.db import Database

#: Settings whose values are secrets: stored, never shown, redacted in history.
SECRET_SETTINGS = frozenset({"api_key", "upstream_api_key", "admin_token"})


class StaleRevision(Exception):
    def __init__(self, current: int) -> None:
        super().__init__(f"the settings changed meanwhile; current revision is {current}")
        self.current = current


def redact(name: str, value: Any) -> Any:
    if name in SECRET_SETTINGS and value not in (None, [], ""):
        return "[redacted]"
    return value


class SavedSettings:
    """The saved layer of settings. Its own connection: reads never wait for the audit
    writer, and a write is one IMMEDIATE transaction."""

    def __init__(self, db: Database) -> None:
        self.path: Path = db.path
        self._conn = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._conn.execute("PRAGMA busy_timeout=5000")
        self._lock = threading.Lock()

    def revision(self) -> int:
        with self._lock:
            row = self._conn.execute("SELECT revision FROM settings_revision WHERE id = 1").fetchone()
        return int(row[0]) if row else 0

    def load(self) -> tuple[int, dict[str, Any]]:
        with self._lock:
            self._conn.execute("BEGIN")
            try:
                row = self._conn.execute("SELECT revision FROM settings_revision WHERE id = 1").fetchone()
                values = {k: orjson.loads(v) for k, v in self._conn.execute("SELECT key, value FROM saved_settings")}
            finally:
                self._conn.execute("COMMIT")
        return (int(row[0]) if row else 0), values

    def write(self, expected_revision: int, changes: dict[str, Any], unset: list[str], actor: str) -> int:
        """Apply ``changes`` (and remove ``unset`` keys) if the revision is still
        ``expected_revision``; returns the new revision."""
        with self._lock:
            conn = self._conn
            conn.execute("BEGIN IMMEDIATE")
            try:
                row = conn.execute("SELECT revision FROM settings_revision WHERE id = 1").fetchone()
                current = int(row[0]) if row else 0
                if current != expected_revision:
                    raise StaleRevision(current)
                old = {k: orjson.loads(v) for k, v in conn.execute("SELECT key, value FROM saved_settings")}
                for key, value in changes.items():
                    conn.execute(
                        "INSERT INTO saved_settings (key, value) VALUES (?, ?) "
                        "ON CONFLICT(key) DO UPDATE SET value = excluded.value",
                        (key, orjson.dumps(value).decode()),
                    )
                for key in unset:
                    conn.execute("DELETE FROM saved_settings WHERE key = ?", (key,))
                new = current + 1
                conn.execute(
                    "INSERT INTO settings_revision (id, revision) VALUES (1, ?) "
                    "ON CONFLICT(id) DO UPDATE SET revision = excluded.revision",
                    (new,),
                )
                history = {
                    key: {"old": redact(key, old.get(key)), "new": redact(key, changes.get(key))}
                    for key in [*changes, *unset]
                }
                conn.execute(
                    "INSERT INTO settings_history (revision, at, actor, changes) VALUES (?, ?, ?, ?)",
                    (new, time.time(), actor, orjson.dumps(history).decode()),
                )
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise
        return new

    def history(self, limit: int = 50) -> list[dict[str, Any]]:
        with self._lock:
            rows = self._conn.execute(
                "SELECT revision, at, actor, changes FROM settings_history ORDER BY revision DESC LIMIT ?", (limit,)
            ).fetchall()
        return [{"revision": r, "at": at, "actor": actor, "changes": orjson.loads(c)} for r, at, actor, c in rows]

    def integrity_check(self) -> str:
        with self._lock:
            return str(self._conn.execute("PRAGMA integrity_check").fetchone()[0])

    def close(self) -> None:
        with self._lock:
            self._conn.close()
