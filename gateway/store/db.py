"""The SQLite database: opening it safely and applying versioned migrations.

Each migration is ``(version, sql)``; a database records the highest version applied in
``PRAGMA user_version`` and applies the rest in order, in one transaction each. Modules
that own tables add their migrations to :data:`MIGRATIONS` (never edit an old one).
Access goes through :class:`Database`, whose blocking calls run in a worker thread so the
event loop never waits on disk.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

MIGRATIONS: list[tuple[int, str]] = [
    (
        1,
        """
        CREATE TABLE audit (
            request_id TEXT PRIMARY KEY,
            started_at REAL NOT NULL,
            ended_at REAL NOT NULL,
            protocol TEXT NOT NULL,
            mode TEXT NOT NULL,
            streamed INTEGER NOT NULL,
            model TEXT NOT NULL,
            outcome TEXT NOT NULL,
            error_code TEXT,
            http_status INTEGER NOT NULL,
            record TEXT NOT NULL
        );
        CREATE INDEX audit_started ON audit (started_at);
        """,
    ),
    (
        2,
        """
        CREATE TABLE responses (
            id TEXT PRIMARY KEY,
            created_at REAL NOT NULL,
            body TEXT NOT NULL
        );
        """,
    ),
    (
        3,
        """
        CREATE TABLE credential_state (
            credential_id TEXT PRIMARY KEY,
            state TEXT NOT NULL,
            updated_at REAL NOT NULL
        );
        CREATE TABLE credentials (
            credential_id TEXT PRIMARY KEY,
            upstream TEXT NOT NULL,
            base_url TEXT NOT NULL,
            api_key TEXT,
            created_at REAL NOT NULL
        );
        """,
    ),
    (
        4,
        """
        CREATE TABLE saved_settings (
            key TEXT PRIMARY KEY,
            value TEXT NOT NULL
        );
        CREATE TABLE settings_revision (
            id INTEGER PRIMARY KEY CHECK (id = 1),
            revision INTEGER NOT NULL
        );
        INSERT INTO settings_revision (id, revision) VALUES (1, 0);
        CREATE TABLE settings_history (
            revision INTEGER PRIMARY KEY,
            at REAL NOT NULL,
            actor TEXT NOT NULL,
            changes TEXT NOT NULL
        );
        """,
    ),
]


class Database:
    """One SQLite connection used from a single worker thread at a time."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists():
            fd = os.open(path, os.O_CREAT | os.O_WRONLY, 0o600)
            os.close(fd)
        os.chmod(path, 0o600)
        self._conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA synchronous=NORMAL")
        self._conn.execute("PRAGMA busy_timeout=5000")
        self._lock = threading.Lock()
        self.migrate(MIGRATIONS)

    @property
    def version(self) -> int:
        return int(self._conn.execute("PRAGMA user_version").fetchone()[0])

    def migrate(self, migrations: Sequence[tuple[int, str]]) -> None:
        with self._lock:
            for version, sql in sorted(migrations):
                if version <= self.version:
                    continue
                self._conn.execute("BEGIN IMMEDIATE")
                try:
                    for statement in filter(None, (s.strip() for s in sql.split(";"))):
                        self._conn.execute(statement)
                    self._conn.execute(f"PRAGMA user_version = {int(version)}")
                    self._conn.execute("COMMIT")
                except BaseException:
                    self._conn.execute("ROLLBACK")
                    raise

    def run(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """Run ``fn(connection)`` under the lock (blocking; call from a worker thread)."""
        with self._lock:
            return fn(self._conn)

    async def arun(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        return await asyncio.to_thread(self.run, fn)

    def execute(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        return self.run(lambda c: c.execute(sql, params).fetchall())

    async def aexecute(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        return await asyncio.to_thread(self.execute, sql, params)

    def close(self) -> None:
        with self._lock:
            self._conn.close()
