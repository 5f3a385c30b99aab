"""The PostgreSQL backend (psycopg 3 + psycopg_pool), for several gateway replicas.

Same schema and migrations as SQLite (:data:`gateway.store.db.MIGRATIONS`, types mapped
by :func:`gateway.store.db.ddl`); the applied version lives in ``schema_version`` and
migrations run under a session advisory lock (per schema), so replicas starting together
apply each migration exactly once. Calls are blocking (psycopg's sync API over a thread
pool-safe :class:`~psycopg_pool.ConnectionPool`), run from worker threads like SQLite's.

SQL written for SQLite runs here through :func:`to_postgres`: ``?`` placeholders become
``%s`` (and a literal ``%`` is escaped), and ``CASE WHEN json_extract(...)`` becomes the
``json_truthy`` function (PostgreSQL wants a boolean there); ``json_extract`` and
``json_array_length`` exist as SQL functions (migration 6).
"""

from __future__ import annotations

import functools
import re
import zlib
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import psycopg
from psycopg_pool import ConnectionPool

from gateway.store.migrations import MIGRATIONS, Migration, ddl
from gateway.store.threads import STORE_THREADS, StoreThreads

T = TypeVar("T")

#: Connections per process: one per store thread (gateway/store/threads.py) without
#: holding many idle server slots.
POOL_MIN, POOL_MAX = 1, STORE_THREADS
#: Seconds a call waits for a free pooled connection before it fails
#: (``psycopg_pool.PoolTimeout``, a ``psycopg.OperationalError``: every caller's store
#: error). Short: with a hung server every connection is held by a query that does not
#: return, and a caller behind them must not wait the pool's old 30 s (issue #40).
CONNECTION_WAIT = 3.0
_WHEN_JSON = re.compile(r"\bWHEN\s+json_extract\s*\(", re.IGNORECASE)


def _truth_tests(sql: str) -> str:
    """``WHEN json_extract(...) THEN`` (a bare truth test) -> ``WHEN json_truthy(...) THEN``."""
    out, pos = [], 0
    for match in _WHEN_JSON.finditer(sql):
        depth, end = 1, match.end()
        while end < len(sql) and depth:
            depth += {"(": 1, ")": -1}.get(sql[end], 0)
            end += 1
        if sql[end:].lstrip()[:4].upper() == "THEN":
            out += [sql[pos:match.start()], "WHEN json_truthy(", sql[match.end():end]]
            pos = end
    return "".join(out) + sql[pos:]


@functools.lru_cache(maxsize=512)
def to_postgres(sql: str) -> str:
    """SQLite-flavoured SQL with ``?`` placeholders -> psycopg's ``%s`` style."""
    sql = _truth_tests(sql)
    out: list[str] = []
    quoted = False
    for ch in sql:
        if ch == "'":
            quoted = not quoted
        if ch == "%":
            out.append("%%")
        elif ch == "?" and not quoted:
            out.append("%s")
        else:
            out.append(ch)
    return "".join(out)


class PgConnection:
    """A psycopg connection that speaks the SQLite-style interface callers use."""

    __slots__ = ("raw",)

    def __init__(self, raw: psycopg.Connection[Any]) -> None:
        self.raw = raw

    def execute(self, sql: str, params: Sequence[Any] = ()) -> psycopg.Cursor[Any]:
        return self.raw.execute(to_postgres(sql), tuple(params))  # type: ignore[arg-type]

    def executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> psycopg.Cursor[Any]:
        cursor = self.raw.cursor()
        cursor.executemany(to_postgres(sql), [tuple(r) for r in rows])  # type: ignore[arg-type]
        return cursor


class PostgresDatabase:
    """PostgreSQL through a connection pool (autocommit; ``run_tx`` opens a transaction)."""

    dialect = "postgres"
    shared = True
    errors: tuple[type[BaseException], ...] = (psycopg.Error,)
    now_sql = "extract(epoch from clock_timestamp())::float8"

    def __init__(self, url: str, migrate: bool = True, min_size: int = POOL_MIN, max_size: int = POOL_MAX,
                 connection_wait: float = CONNECTION_WAIT) -> None:
        self.url = url
        self.path = None  # no file: callers that print a location use .url
        self.threads = StoreThreads("pg-store", max_size)
        self._pool = ConnectionPool(
            url, min_size=min_size, max_size=max_size, kwargs={"autocommit": True},
            open=False, name="codebuddy2api", timeout=connection_wait,
        )
        self._pool.open(wait=True, timeout=30.0)
        if migrate:
            try:
                self.migrate(MIGRATIONS)
            except BaseException:
                self._pool.close()
                raise

    # -- migrations --------------------------------------------------------------------

    def _current_version(self, conn: psycopg.Connection[Any]) -> int:
        row = conn.execute("SELECT to_regclass('schema_version') IS NOT NULL").fetchone()
        if not row or not row[0]:
            return 0
        row = conn.execute("SELECT version FROM schema_version WHERE id = 1").fetchone()
        return int(row[0]) if row else 0

    @property
    def version(self) -> int:
        with self._pool.connection() as conn:
            return self._current_version(conn)

    def migrate(self, migrations: Sequence[Migration]) -> None:
        """Apply what is missing, one transaction per migration, under an advisory lock
        keyed by the schema (two replicas starting together: one migrates, one waits)."""
        with self._pool.connection() as conn:
            schema = conn.execute("SELECT current_schema()").fetchone()[0]  # type: ignore[index]
            if schema is None:
                raise RuntimeError("the database URL's search_path names no existing schema")
            key = zlib.crc32(f"codebuddy2api-migrations:{schema}".encode())
            conn.execute("SELECT pg_advisory_lock(%s)", (key,))
            try:
                conn.execute(
                    "CREATE TABLE IF NOT EXISTS schema_version ("
                    "id INTEGER PRIMARY KEY CHECK (id = 1), version BIGINT NOT NULL)"
                )
                conn.execute("INSERT INTO schema_version (id, version) VALUES (1, 0) ON CONFLICT (id) DO NOTHING")
                current = self._current_version(conn)
                for version, sql in sorted(migrations, key=lambda m: m[0]):
                    if version <= current:
                        continue
                    with conn.transaction():
                        statements = ddl(sql, "postgres").strip()
                        if statements:
                            conn.execute(statements)  # no parameters: several statements allowed
                        conn.execute("UPDATE schema_version SET version = %s WHERE id = 1", (version,))
                    current = version
            finally:
                conn.execute("SELECT pg_advisory_unlock(%s)", (key,))

    # -- calls -------------------------------------------------------------------------

    def run(self, fn: Callable[[Any], T]) -> T:
        """``fn(connection)`` on a pooled connection, autocommit (blocking)."""
        with self._pool.connection() as conn:
            return fn(PgConnection(conn))

    def run_tx(self, fn: Callable[[Any], T], write: bool = True) -> T:
        """``fn(connection)`` in one transaction; reads get one snapshot (REPEATABLE READ)."""
        with self._pool.connection() as conn, conn.transaction():
            if not write:
                conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
            return fn(PgConnection(conn))

    async def arun(self, fn: Callable[[Any], T]) -> T:
        return await self.threads.call(self.run, fn)

    async def acall(self, fn: Callable[..., T], *args: Any) -> T:
        return await self.threads.call(fn, *args)

    def execute(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        def call(conn: PgConnection) -> list[tuple[Any, ...]]:
            cursor = conn.execute(sql, params)
            return cursor.fetchall() if cursor.description is not None else []

        return self.run(call)

    async def aexecute(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        return await self.threads.call(self.execute, sql, params)

    def open_own(self) -> PostgresDatabase:
        """A separate one-connection handle (saved settings poll on it, never queueing
        behind audit batches on the shared pool)."""
        return PostgresDatabase(self.url, migrate=False, min_size=1, max_size=1)

    def integrity_check(self) -> str:
        """PostgreSQL checks its own pages; this confirms the server answers."""
        return "ok" if self.execute("SELECT 1") == [(1,)] else "no answer"

    def close(self) -> None:
        self.threads.close()
        self._pool.close()
