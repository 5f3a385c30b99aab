"""Saved settings (admin API / WebUI) with revisions, in the store.

Every write names the revision it read (optimistic concurrency): a stale revision is
refused with the current one; a good write replaces the values, bumps the revision and
appends a history row (who, when, old -> new, secret values redacted), all in one
transaction. The revision bump is a conditional ``UPDATE ... WHERE revision = expected``,
which serializes writers on both backends (SQLite: the IMMEDIATE transaction; PostgreSQL:
the row lock, re-checked after the wait).

Readers poll the revision on their own connection, so every process, every replica,
applies a new revision to its next request. SQLite: one indexed read per request (local,
microseconds). PostgreSQL: a background thread reads it every :data:`REVISION_MAX_AGE`
seconds and requests read the cached number, so no request waits on the network and a
change made on another replica is in force there at most ~250 ms (+ one query) later.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import orjson

from gateway.store.db import Store, upsert

#: Settings whose values are secrets: stored, never shown, redacted in history.
SECRET_SETTINGS = frozenset({"api_key", "upstream_api_key", "admin_token", "database_url"})
#: How stale a shared store's revision may be when a request reads it (seconds).
REVISION_MAX_AGE = 0.25

_SET = upsert("saved_settings", ("key", "value"), "key")


class StaleRevision(Exception):
    def __init__(self, current: int) -> None:
        super().__init__(f"the settings changed meanwhile; current revision is {current}")
        self.current = current


def redact(name: str, value: Any) -> Any:
    if name in SECRET_SETTINGS and value not in (None, [], ""):
        return "[redacted]"
    return value


def _revision(conn: Any) -> int:
    row = conn.execute("SELECT revision FROM settings_revision WHERE id = 1").fetchone()
    return int(row[0]) if row else 0


class SavedSettings:
    """The saved layer of settings. Its own connection: reads never wait for the audit
    writer, and a write is one transaction."""

    def __init__(self, db: Store, max_age: float | None = None) -> None:
        self.path: Path | None = getattr(db, "path", None)
        self._db = db.open_own()
        self.max_age = (REVISION_MAX_AGE if db.shared else 0.0) if max_age is None else max_age
        self._lock = threading.Lock()
        self._known = 0
        self._poller: Any = None
        if self.max_age > 0:
            from gateway.store.replicas import Poller

            self._known = self._db.run(_revision)
            self._poller = Poller("settings-revision", self.max_age, self._poll).start()

    def _poll(self) -> None:
        # max(): a poll that started before this process's own write must not step back
        self._known = max(self._known, self._db.run(_revision))

    def revision(self) -> int:
        """The store's revision: read now (SQLite) or at most ``max_age`` old (shared)."""
        if self._poller is not None:
            return self._known
        return self._db.run(_revision)

    def load(self) -> tuple[int, dict[str, Any]]:
        def read(conn: Any) -> tuple[int, dict[str, Any]]:
            values = {k: orjson.loads(v) for k, v in conn.execute("SELECT key, value FROM saved_settings").fetchall()}
            return _revision(conn), values

        revision, values = self._db.run_tx(read, write=False)
        if self._poller is not None and revision > self._known:
            self._known = revision
        return revision, values

    def write(self, expected_revision: int, changes: dict[str, Any], unset: list[str], actor: str) -> int:
        """Apply ``changes`` (and remove ``unset`` keys) if the revision is still
        ``expected_revision``; returns the new revision."""

        def apply(conn: Any) -> int:
            bumped = conn.execute(
                "UPDATE settings_revision SET revision = revision + 1 WHERE id = 1 AND revision = ?",
                (expected_revision,),
            )
            if bumped.rowcount != 1:
                raise StaleRevision(_revision(conn))
            new = expected_revision + 1
            old = {k: orjson.loads(v) for k, v in conn.execute("SELECT key, value FROM saved_settings").fetchall()}
            for key, value in changes.items():
                conn.execute(_SET, (key, orjson.dumps(value).decode()))
            for key in unset:
                conn.execute("DELETE FROM saved_settings WHERE key = ?", (key,))
            history = {
                key: {"old": redact(key, old.get(key)), "new": redact(key, changes.get(key))}
                for key in [*changes, *unset]
            }
            conn.execute(
                "INSERT INTO settings_history (revision, at, actor, changes) VALUES (?, ?, ?, ?)",
                (new, time.time(), actor, orjson.dumps(history).decode()),
            )
            return new

        with self._lock:
            new = self._db.run_tx(apply)
        if self._poller is not None and new > self._known:
            self._known = new
        return new

    def history(self, limit: int = 50) -> list[dict[str, Any]]:
        rows = self._db.execute(
            "SELECT revision, at, actor, changes FROM settings_history ORDER BY revision DESC LIMIT ?", (limit,)
        )
        return [{"revision": r, "at": at, "actor": actor, "changes": orjson.loads(c)} for r, at, actor, c in rows]

    def integrity_check(self) -> str:
        return self._db.integrity_check()

    def close(self) -> None:
        if self._poller is not None:
            self._poller.stop()
        self._db.close()
