"""Store calls that hang hold the store's own threads, never asyncio's shared executor, and
a call waits for a pooled PostgreSQL connection only briefly (issue #40; gateway/store/threads.py,
gateway/store/postgres.py). On both backends, without HTTP."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg_pool
import pytest

from gateway.store.db import Store, open_database
from gateway.store.postgres import PostgresDatabase


@pytest.fixture(params=["sqlite", "postgres"])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    if request.param == "sqlite":
        database = open_database(None, tmp_path)
    else:
        database = open_database(request.getfixturevalue("postgres_schema"), tmp_path)
    yield database
    database.close()


async def test_store_calls_that_hang_leave_the_shared_executor_free(db: Store) -> None:
    release = threading.Event()
    shared = min(32, (os.cpu_count() or 1) + 4)  # asyncio's default executor's threads
    hung = [asyncio.ensure_future(db.arun(lambda conn: release.wait(30))) for _ in range(shared + 1)]
    hung.append(asyncio.ensure_future(db.acall(release.wait, 30)))
    try:
        await asyncio.sleep(0.2)
        assert not any(call.done() for call in hung)
        async with asyncio.timeout(10):  # a hang-catcher: the shared executor is not theirs
            assert await asyncio.to_thread(lambda: "free") == "free"
    finally:
        release.set()
    async with asyncio.timeout(30):
        await asyncio.gather(*hung)
    assert await db.aexecute("SELECT 1") == [(1,)]  # every thread came back


def test_a_call_behind_busy_connections_fails_with_a_store_error_instead_of_waiting(postgres_schema: str) -> None:
    db = PostgresDatabase(postgres_schema, min_size=1, max_size=1, connection_wait=0.3)
    held, release = threading.Event(), threading.Event()

    def hold(conn: Any) -> None:
        held.set()
        release.wait(30)

    holder = threading.Thread(target=db.run, args=(hold,))
    holder.start()
    try:
        assert held.wait(10)
        with pytest.raises(psycopg_pool.PoolTimeout) as waited:
            db.execute("SELECT 1")
        assert isinstance(waited.value, db.errors)  # what every caller already handles as the store failing
    finally:
        release.set()
        holder.join(30)
    assert db.execute("SELECT 1") == [(1,)]
    db.close()
