"""Saved settings (admin API / WebUI) with revisions, in the store.

Every write names the revision it read (optimistic concurrency): a stale revision is
refused with the current one; a good write replaces the values, bumps the revision and
appends a history row (who, when, old -> new, secret values redacted), all in one
transaction. The revision bump is a conditional ``UPDATE ... WHERE revision = expected``,
which serializes writers on both backends (SQLite: the IMMEDIATE transaction; PostgreSQL:
the row lock, re-checked after the wait).

Readers never read the store on the request path: a background thread polls the
revision on its own connection every :data:`REVISION_MAX_AGE` seconds (SQLite:
:data:`LOCAL_REVISION_MAX_AGE`) and, when it moved, loads the values there too; requests
take that snapshot from memory. So every process, every replica, applies a new revision
within ~250 ms (+ one query), and a store that cannot be read (its file locked, PostgreSQL
gone) costs requests nothing: the last values read stay in force.
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
#: ... and a local (SQLite) one's: other workers and the offline ``settings`` command.
LOCAL_REVISION_MAX_AGE = 0.1

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
        self.max_age = (REVISION_MAX_AGE if db.shared else LOCAL_REVISION_MAX_AGE) if max_age is None else max_age
        self._lock = threading.Lock()
        self._known = 0
        self._latest: tuple[int, dict[str, Any]] | None = None
        self._poller: Any = None
        if self.max_age > 0:
            from gateway.store.replicas import Poller

            self.load()
            self._poller = Poller("settings-revision", self.max_age, self._poll).start()

    def _poll(self) -> None:
        # max(): a poll that started before this process's own write must not step back
        revision = self._db.run(_revision)
        if self._latest is None or revision > self._latest[0]:
            self.load()
        self._known = max(self._known, revision)

    def revision(self) -> int:
        """The store's revision: at most ``max_age`` old (polled), or read now (no poller)."""
        if self._poller is not None:
            return self._known
        return self._db.run(_revision)

    def latest(self) -> tuple[int, dict[str, Any]] | None:
        """The last (revision, values) read (by the poller), from memory (None: no poller)."""
        return self._latest if self._poller is not None else None

    def load(self) -> tuple[int, dict[str, Any]]:
        def read(conn: Any) -> tuple[int, dict[str, Any]]:
            values = {k: orjson.loads(v) for k, v in conn.execute("SELECT key, value FROM saved_settings").fetchall()}
            return _revision(conn), values

        revision, values = self._db.run_tx(read, write=False)
        if revision > self._known:
            self._known = revision
        if self._latest is None or revision >= self._latest[0]:
            self._latest = (revision, values)
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
        if new > self._known:
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
