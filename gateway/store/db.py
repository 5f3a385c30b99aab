"""The database: SQLite (default, one file in the data dir) or PostgreSQL (many replicas).

Migrations are written once, in SQLite's dialect, as ``(version, sql)`` in
:data:`MIGRATIONS` (never edit an old one; append). :func:`ddl` is the one place that maps
types for PostgreSQL (``REAL`` -> ``DOUBLE PRECISION``, ``INTEGER`` -> ``BIGINT``); a
migration that only one backend needs is a ``{"sqlite": ..., "postgres": ...}`` dict.
SQLite records the applied version in ``PRAGMA user_version``; PostgreSQL in a
``schema_version`` table, under an advisory lock (see :mod:`gateway.store.postgres`).

Callers use one interface on both backends, :class:`Store`: ``run(fn)`` / ``run_tx(fn)``
hand ``fn`` a connection whose ``execute(sql, params)`` takes ``?`` placeholders and
returns a cursor (``fetchone``/``fetchall``/``rowcount``); ``execute``/``aexecute`` are
shortcuts. Every call blocks, so the ``a*`` variants run it in a worker thread: the event
loop never waits on disk or network.
"""

from __future__ import annotations

import asyncio
import os
import re
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

T = TypeVar("T")

#: The SQLite file's name inside the data dir.
SQLITE_FILENAME = "codebuddy2api.sqlite3"

Migration = tuple[int, "str | dict[str, str]"]

MIGRATIONS: list[Migration] = [
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
    (
        5,
        # credential_state.version: replicas apply a polled row only when it is newer than
        # what they last wrote or read. replicas: the heartbeat table behind capacity shares.
        """
        ALTER TABLE credential_state ADD COLUMN version INTEGER NOT NULL DEFAULT 0;
        CREATE TABLE replicas (
            replica_id TEXT PRIMARY KEY,
            started_at REAL NOT NULL,
            heartbeat_at REAL NOT NULL,
            in_flight INTEGER NOT NULL,
            info TEXT NOT NULL
        );
        """,
    ),
    (
        6,
        {
            "sqlite": "",
            # SQLite's JSON functions as used by callers' queries (paths '$.a.b' only), so the
            # same SQL runs on both; see gateway.store.postgres.to_postgres for WHEN json_extract.
            "postgres": """
            CREATE OR REPLACE FUNCTION json_extract(doc text, path text) RETURNS jsonb
            LANGUAGE sql IMMUTABLE AS $fn$
                SELECT NULLIF(doc::jsonb #> string_to_array(substr(path, 3), '.'), 'null'::jsonb)
            $fn$;
            CREATE OR REPLACE FUNCTION json_array_length(doc text, path text) RETURNS bigint
            LANGUAGE sql IMMUTABLE AS $fn$
                SELECT CASE WHEN v IS NULL THEN NULL WHEN jsonb_typeof(v) = 'array'
                            THEN jsonb_array_length(v) ELSE 0 END
                FROM (SELECT doc::jsonb #> string_to_array(substr(path, 3), '.') AS v) AS s
            $fn$;
            CREATE OR REPLACE FUNCTION json_truthy(doc text, path text) RETURNS boolean
            LANGUAGE sql IMMUTABLE AS $fn$
                SELECT CASE jsonb_typeof(v) WHEN 'boolean' THEN v::text::boolean
                            WHEN 'number' THEN v::text::numeric <> 0 ELSE false END
                FROM (SELECT doc::jsonb #> string_to_array(substr(path, 3), '.') AS v) AS s
            $fn$;
            """,
        },
    ),
    (
        7,
        # audit.transport (http | websocket), filterable: generated from the record, so the
        # row the writer upserts (and the spill journal holds) keeps its shape and old rows
        # are backfilled by the migration itself; a record from before the field = NULL.
        # PostgreSQL: a stored column (its ALTER rewrites the table once); jsonb refuses a
        # \u0000 escape, so such a record is read by pattern instead of failing its insert.
        {
            "sqlite": """
            ALTER TABLE audit ADD COLUMN transport TEXT GENERATED ALWAYS AS
                (CASE WHEN json_valid(record) THEN json_extract(record, '$.transport') END) VIRTUAL;
            CREATE INDEX audit_transport ON audit (transport, started_at);
            """,
            "postgres": """
            CREATE OR REPLACE FUNCTION audit_transport(doc text) RETURNS text
            LANGUAGE plpgsql IMMUTABLE AS $fn$
            BEGIN
                RETURN doc::jsonb ->> 'transport';
            EXCEPTION WHEN others THEN
                RETURN substring(doc from '"transport"[[:space:]]*:[[:space:]]*"(http|websocket)"');
            END
            $fn$;
            ALTER TABLE audit ADD COLUMN transport TEXT GENERATED ALWAYS AS (audit_transport(record)) STORED;
            CREATE INDEX audit_transport ON audit (transport, started_at);
            """,
        },
    ),
    (
        8,
        # responses.owner: the client identity (gateway/tenancy.py) that created the row;
        # NULL for rows from before (readable only while no client key is configured).
        # envelope_keys: the keyring of gateway/protocols/envelope.py, shared by replicas.
        """
        ALTER TABLE responses ADD COLUMN owner TEXT;
        CREATE TABLE envelope_keys (
            key_number INTEGER PRIMARY KEY,
            secret TEXT NOT NULL,
            created_at REAL NOT NULL,
            active_from REAL NOT NULL
        );
        """,
    ),
    (
        9,
        # rollouts (gateway/rollout/store.py): one row per model call of a rollout (the
        # call record as JSON), and marks on a rollout (frozen, incomplete: why).
        """
        CREATE TABLE rollout_calls (
            call_id TEXT PRIMARY KEY,
            rollout_id TEXT NOT NULL,
            started_at REAL NOT NULL,
            ended_at REAL NOT NULL,
            record TEXT NOT NULL
        );
        CREATE INDEX rollout_calls_rollout ON rollout_calls (rollout_id, started_at);
        CREATE INDEX rollout_calls_ended ON rollout_calls (ended_at);
        CREATE TABLE rollout_marks (
            mark_id TEXT PRIMARY KEY,
            rollout_id TEXT NOT NULL,
            kind TEXT NOT NULL,
            at REAL NOT NULL,
            reason TEXT NOT NULL
        );
        CREATE INDEX rollout_marks_rollout ON rollout_marks (rollout_id, kind);
        """,
    ),
    (
        10,
        # managed client keys (gateway/keys/store.py): the keys (hashed), usage per key and
        # UTC day (open reservations included), and the counted requests of the last minutes.
        """        CREATE TABLE client_keys (
            key_id TEXT PRIMARY KEY,
            name TEXT NOT NULL,
            prefix TEXT NOT NULL,
            secret_hash TEXT NOT NULL UNIQUE,
            limits TEXT NOT NULL,
            metadata TEXT NOT NULL,
            created_at REAL NOT NULL,
            updated_at REAL NOT NULL,
            revoked_at REAL
        );
        CREATE TABLE client_key_usage (
            key_id TEXT NOT NULL,
            day TEXT NOT NULL,
            requests INTEGER NOT NULL,
            tokens INTEGER NOT NULL,
            PRIMARY KEY (key_id, day)
        );
        CREATE TABLE client_key_requests (
            request_id TEXT PRIMARY KEY,
            key_id TEXT NOT NULL,
            at REAL NOT NULL,
            day TEXT NOT NULL,
            reserved INTEGER NOT NULL,
            used INTEGER NOT NULL,
            open INTEGER NOT NULL
        );
        CREATE INDEX client_key_requests_key ON client_key_requests (key_id, at);
        """,
    ),
]

_PG_TYPES = ((re.compile(r"\bREAL\b"), "DOUBLE PRECISION"), (re.compile(r"\bINTEGER\b"), "BIGINT"))


def ddl(migration: str | dict[str, str], dialect: str) -> str:
    """A migration's SQL for ``dialect`` ("sqlite" or "postgres")."""
    if isinstance(migration, dict):
        return migration.get(dialect, "")
    if dialect == "postgres":
        for pattern, replacement in _PG_TYPES:
            migration = pattern.sub(replacement, migration)
    return migration


def upsert(table: str, columns: Sequence[str], key: str) -> str:
    """``INSERT ... ON CONFLICT (key) DO UPDATE`` with ``?`` placeholders (both backends)."""
    updates = ", ".join(f"{c} = excluded.{c}" for c in columns if c != key)
    return (
        f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({', '.join('?' for _ in columns)}) "
        f"ON CONFLICT ({key}) DO UPDATE SET {updates}"
    )


class Cursor(Protocol):
    rowcount: int

    def fetchone(self) -> Any: ...

    def fetchall(self) -> list[Any]: ...


class Connection(Protocol):
    """What ``run``/``run_tx`` hand to ``fn``: ``?`` placeholders on both backends."""

    def execute(self, sql: str, params: Sequence[Any] = ...) -> Cursor: ...

    def executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> Any: ...


class Store(Protocol):
    """The interface every backend offers (SQLite :class:`Database`, PostgreSQL
    :class:`gateway.store.postgres.PostgresDatabase`)."""

    dialect: str
    #: True when several processes on several machines may share it (PostgreSQL).
    shared: bool
    errors: tuple[type[BaseException], ...]
    #: SQL expression for the database server's clock, in Unix seconds (a float).
    now_sql: str

    @property
    def version(self) -> int: ...

    def run(self, fn: Callable[[Any], T]) -> T: ...

    def run_tx(self, fn: Callable[[Any], T], write: bool = True) -> T: ...

    async def arun(self, fn: Callable[[Any], T]) -> T: ...

    def execute(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]: ...

    async def aexecute(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]: ...

    def open_own(self) -> Store: ...

    def integrity_check(self) -> str: ...

    def close(self) -> None: ...


def _closed_if_cursor(result: T) -> T:
    """A cursor must not leave the lock open: whichever thread drops it last resets its
    statement on the shared connection, and the statement cache hands that same statement
    to the worker running the next write (SQLite: "bad parameter or other API misuse" --
    under load, most audit and response writes failed over to the spill journal)."""
    if isinstance(result, sqlite3.Cursor):
        result.close()
    return result


class Database:
    """SQLite: one connection used from a single worker thread at a time."""

    dialect = "sqlite"
    shared = False
    errors: tuple[type[BaseException], ...] = (sqlite3.Error,)
    now_sql = "((julianday('now') - 2440587.5) * 86400.0)"

    def __init__(self, path: Path, migrate: bool = True) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists():
            fd = os.open(path, os.O_CREAT | os.O_WRONLY, 0o600)
            os.close(fd)
        os.chmod(path, 0o600)
        self._conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._conn.execute("PRAGMA busy_timeout=5000")
        if migrate:
            self._wal()
            self._conn.execute("PRAGMA synchronous=NORMAL")
        self._lock = threading.Lock()
        if migrate:
            self.migrate(MIGRATIONS)

    def _wal(self) -> None:
        """Switch to WAL. Processes creating one file together may find it locked: the
        switch does not wait on busy_timeout, so retry briefly."""
        for attempt in range(100):
            try:
                self._conn.execute("PRAGMA journal_mode=WAL")
                return
            except sqlite3.OperationalError:
                if attempt == 99:
                    raise
                time.sleep(0.02)

    @property
    def version(self) -> int:
        return int(self._conn.execute("PRAGMA user_version").fetchone()[0])

    def migrate(self, migrations: Sequence[Migration]) -> None:
        with self._lock:
            for version, sql in sorted(migrations, key=lambda m: m[0]):
                if version <= self.version:
                    continue
                self._conn.execute("BEGIN IMMEDIATE")
                try:
                    if version <= self.version:  # another process got here first
                        self._conn.execute("ROLLBACK")
                        continue
                    for statement in filter(None, (s.strip() for s in ddl(sql, "sqlite").split(";"))):
                        self._conn.execute(statement)
                    self._conn.execute(f"PRAGMA user_version = {int(version)}")
                    self._conn.execute("COMMIT")
                except BaseException:
                    self._conn.execute("ROLLBACK")
                    raise

    def run(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """Run ``fn(connection)`` under the lock (blocking; call from a worker thread)."""
        with self._lock:
            return _closed_if_cursor(fn(self._conn))

    def run_tx(self, fn: Callable[[sqlite3.Connection], T], write: bool = True) -> T:
        """``fn(connection)`` in one transaction (IMMEDIATE for writes: writers queue up
        on the file lock instead of failing half-way); rolled back if it raises."""
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE" if write else "BEGIN")
            try:
                result = fn(self._conn)
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")
            return _closed_if_cursor(result)

    async def arun(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        return await asyncio.to_thread(self.run, fn)

    def execute(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        return self.run(lambda c: c.execute(sql, params).fetchall())

    async def aexecute(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        return await asyncio.to_thread(self.execute, sql, params)

    def open_own(self) -> Database:
        """A second handle on the same file with its own connection (no migrations)."""
        return Database(self.path, migrate=False)

    def integrity_check(self) -> str:
        return str(self.run(lambda c: c.execute("PRAGMA integrity_check").fetchone()[0]))

    def close(self) -> None:
        with self._lock:
            self._conn.close()


def is_postgres_url(url: str) -> bool:
    return url.startswith(("postgresql://", "postgres://"))


def open_database(database_url: Any, data_dir: Path, migrate: bool = True) -> Store:
    """The configured store: PostgreSQL for a ``postgresql://`` URL, else the SQLite file
    in ``data_dir`` (``sqlite:///path`` names another file). ``database_url`` may be a
    pydantic ``SecretStr``."""
    url = database_url.get_secret_value() if hasattr(database_url, "get_secret_value") else database_url
    if url and is_postgres_url(url):
        from gateway.store.postgres import PostgresDatabase

        return PostgresDatabase(url, migrate=migrate)
    if url and url.startswith("sqlite:///"):
        return Database(Path(url[len("sqlite:///"):]), migrate=migrate)
    if url:
        raise ValueError("database URL must start with postgresql:// or sqlite:///")
    return Database(Path(data_dir) / SQLITE_FILENAME, migrate=migrate)
