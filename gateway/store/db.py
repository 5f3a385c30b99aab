"""The database: SQLite (default, one file in the data dir) or PostgreSQL (many replicas).

The migrations live in :mod:`gateway.store.migrations`.
SQLite records the applied version in ``PRAGMA user_version``; PostgreSQL in a
``schema_version`` table, under an advisory lock (see :mod:`gateway.store.postgres`).

Callers use one interface on both backends, :class:`Store`: ``run(fn)`` / ``run_tx(fn)``
hand ``fn`` a connection whose ``execute(sql, params)`` takes ``?`` placeholders and
returns a cursor (``fetchone``/``fetchall``/``rowcount``); ``execute``/``aexecute`` are
shortcuts. Every call blocks, so the ``a*`` variants run it in a worker thread: the event
loop never waits on disk or network. Those threads are the store's own
(:class:`~gateway.store.threads.StoreThreads`), never asyncio's shared executor: a store
that hangs holds them, not every other worker-thread job of the process; ``acall(fn,
*args)`` runs any blocking store function there (``asyncio.to_thread``'s place).
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

from gateway.store.migrations import MIGRATIONS, Migration, ddl
from gateway.store.threads import StoreThreads

T = TypeVar("T")

#: The SQLite file's name inside the data dir.
SQLITE_FILENAME = "codebuddy2api.sqlite3"

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

    async def acall(self, fn: Callable[..., T], *args: Any) -> T: ...

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
        self.threads = StoreThreads("sqlite-store")
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
        return await self.threads.call(self.run, fn)

    async def acall(self, fn: Callable[..., T], *args: Any) -> T:
        return await self.threads.call(fn, *args)

    def execute(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        return self.run(lambda c: c.execute(sql, params).fetchall())

    async def aexecute(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        return await self.threads.call(self.execute, sql, params)

    def open_own(self) -> Database:
        """A second handle on the same file with its own connection (no migrations)."""
        return Database(self.path, migrate=False)

    def integrity_check(self) -> str:
        return str(self.run(lambda c: c.execute("PRAGMA integrity_check").fetchone()[0]))

    def close(self) -> None:
        self.threads.close()
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


class StoreMissing(LookupError):
    """There is no store where the settings point (a read-only tool must not create one)."""


def open_existing_database(database_url: Any, data_dir: Path) -> Store:
    """The configured store as it is: never created, never migrated (offline readers such
    as ``capture export``). A SQLite file that does not exist is :class:`StoreMissing`."""
    url = database_url.get_secret_value() if hasattr(database_url, "get_secret_value") else database_url
    if not url or url.startswith("sqlite:///"):
        path = Path(url[len("sqlite:///"):]) if url else Path(data_dir) / SQLITE_FILENAME
        if not path.is_file():
            raise StoreMissing(f"no store at {path} (give --data-dir or --database-url)")
    return open_database(url, data_dir, migrate=False)
