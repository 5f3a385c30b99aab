"""Store faults, fed directly (no server): the replay never holds the journal while the
store blocks, spilled responses are found by id (also after a reopen), store reads on the
request path are bounded, the recording gate, waiting for PostgreSQL, and the worker
supervisor's pure parts."""

from __future__ import annotations

import asyncio
import io
import sqlite3
import threading
from pathlib import Path
from typing import Any

import orjson
import pytest

from gateway.errors import GatewayError
from gateway.generation.recording_gate import RecordingGate
from gateway.http.workers import backoff, forget_worker
from gateway.store.audit import AUDIT_UPSERT
from gateway.store.db import Database
from gateway.store.responses import RESPONSE_UPSERT, ResponseStore
from gateway.store.spill import DurableWriter, SpillJournal, StoreUnavailable
from gateway.store.wait import DatabaseUnreachable, wait_for_database
from tests.store.test_spill import FlakyStore, audit_ids, row

STATEMENTS = {"audit": AUDIT_UPSERT, "response": RESPONSE_UPSERT}


def response_row(response_id: str, text: str) -> tuple[Any, ...]:
    return (response_id, 1.0, orjson.dumps({"response": {"id": response_id, "text": text}}).decode())


class Flaky(FlakyStore):
    """FlakyStore with reads (the request path reads stored responses)."""

    def run(self, fn: Any) -> Any:
        if self.failing:
            raise sqlite3.OperationalError("disk I/O error")
        return self.inner.run(fn)


class BlockingStore(Flaky):
    """Writes block until ``release`` is set (a write-locked file), then go through."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.release = threading.Event()
        self.entered = threading.Event()

    def run_tx(self, fn: Any, write: bool = True) -> Any:
        self.entered.set()
        self.release.wait(20)
        return super().run_tx(fn, write)

    def run(self, fn: Any) -> Any:
        self.release.wait(20)
        return self.inner.run(fn)


async def test_a_replay_stuck_on_the_store_never_holds_up_a_spill(tmp_path: Path) -> None:
    store = BlockingStore(tmp_path / "db.sqlite3")
    store.failing = True
    durable = DurableWriter(store, SpillJournal(tmp_path / "spill", 1 << 20), STATEMENTS,  # type: ignore[arg-type]
                            write_timeout=0.1)
    store.release.set()
    assert await durable.write("audit", [row("r1")]) == "spilled"  # failing: spilled
    store.failing, store.release = False, threading.Event()
    store.entered.clear()
    replay = asyncio.ensure_future(durable.recover())  # stuck in the store with the journal read
    await asyncio.to_thread(store.entered.wait, 5)
    # the replay stays stuck until released below: a spill that waited on it would never end
    async with asyncio.timeout(10):
        assert await durable.write("audit", [row("r2")]) == "spilled"  # store known bad: the journal
        assert await durable.spill("audit", [row("r3")]) == "spilled"
    assert durable.spill_entries == 3 and not replay.done()
    store.release.set()
    assert await replay is True
    if durable.spill_entries:  # r2/r3 came after the replay's read: the next one takes them
        assert await durable.recover() is True
    assert audit_ids(store.inner) == ["r1", "r2", "r3"] and durable.spill_entries == 0


async def test_spilled_responses_are_found_by_id_also_after_a_reopen(tmp_path: Path) -> None:
    store = Flaky(tmp_path / "db.sqlite3")
    store.failing = True
    durable = DurableWriter(store, SpillJournal(tmp_path / "spill", 1 << 20), STATEMENTS)  # type: ignore[arg-type]
    assert await durable.write("response", [response_row("resp_a", "alpha"), response_row("resp_b", "beta")]) == "spilled"
    assert await durable.write("audit", [row("r1")]) == "spilled"
    found = await durable.spilled_row("response", "resp_b")
    assert found is not None and orjson.loads(found[2])["response"]["text"] == "beta"
    assert await durable.spilled_row("response", "resp_x") is None
    assert await durable.spilled_row("audit", "r1") is None  # only the indexed kinds
    durable.journal.close()  # type: ignore[union-attr]
    # a restart (the store still down): the journal left behind is indexed again
    again = DurableWriter(store, SpillJournal(tmp_path / "spill", 1 << 20), STATEMENTS)  # type: ignore[arg-type]
    await again.start()
    responses = ResponseStore(store, again)  # type: ignore[arg-type]
    loaded = await responses.load("resp_a")
    assert loaded == {"response": {"id": "resp_a", "text": "alpha"}}
    store.failing = False
    assert await again.recover() is True and again.spill_entries == 0
    assert await again.spilled_row("response", "resp_a") is None  # cleared: the store has it now
    assert await responses.load("resp_a") == {"response": {"id": "resp_a", "text": "alpha"}}
    await again.aclose()


async def test_a_store_read_that_fails_or_stalls_is_store_unavailable(tmp_path: Path) -> None:
    store = BlockingStore(tmp_path / "db.sqlite3")
    durable = DurableWriter(store, SpillJournal(tmp_path / "spill", 1 << 20), STATEMENTS,  # type: ignore[arg-type]
                            read_timeout=0.2)
    responses = ResponseStore(store, durable)  # type: ignore[arg-type]
    # the store stays stalled until released below: a read that waited on it would never end
    async with asyncio.timeout(10):
        with pytest.raises(GatewayError) as stalled:
            await responses.load("resp_a")
    assert (stalled.value.status, stalled.value.code, stalled.value.retry_after) == (503, "store_unavailable", 1)
    store.release.set()

    def broken(conn: Any) -> Any:
        raise sqlite3.OperationalError("locking protocol")

    with pytest.raises(StoreUnavailable, match="locking protocol"):
        await durable.read(broken)
    assert await responses.load("resp_a") is None  # the store answers again: unknown id


def test_the_recording_gate_refuses_or_serves_and_counts() -> None:
    counted: list[str] = []
    why: list[str | None] = [None]
    serve = [False]
    gate = RecordingGate(lambda: why[0], lambda: serve[0], counted.append)
    gate()  # recordable: nothing happens
    why[0] = "the spill journal could not reserve its bytes"
    with pytest.raises(GatewayError) as refused:
        gate()
    assert (refused.value.status, refused.value.code, refused.value.retry_after) == (503, "recording_unavailable", 5)
    serve[0] = True
    gate()  # --serve-unrecorded: served, counted
    assert counted == ["refused", "served"]


async def test_an_unreserved_journal_makes_the_writer_unrecordable_until_it_reserves(tmp_path: Path) -> None:
    journal = SpillJournal(tmp_path / "spill", 1 << 16)
    durable = DurableWriter(Database(tmp_path / "db.sqlite3"), journal, STATEMENTS)
    assert durable.unrecordable() is None
    journal.reserved, journal.reserve_error = False, "No space left on device"
    assert "could not reserve" in (durable.unrecordable() or "")
    assert journal.retry_reserve() is True and durable.unrecordable() is None  # space is back
    durable.store_writable, durable.journal_failing = False, True
    assert "spill journal is full" in (durable.unrecordable() or "")


def test_waiting_for_the_database_says_each_attempt_then_gives_up_in_one_line() -> None:
    now = [0.0]
    slept: list[float] = []

    def refuse(url: str, timeout: float) -> None:
        raise OSError('connection to server at "127.0.0.1", port 9 failed: Connection refused\n\tIs the server running?')

    def sleep(s: float) -> None:
        slept.append(s)
        now[0] += s

    out = io.StringIO()
    with pytest.raises(DatabaseUnreachable) as gave_up:
        wait_for_database("postgresql://u:hunter2-secret@127.0.0.1:9/db", 10.0, out, refuse, sleep, lambda: now[0])
    lines = out.getvalue().splitlines()
    assert slept == [1.0, 2.0, 4.0, 3.0]  # doubling, the last one cut to the bound
    assert lines[0].startswith("codebuddy2api: waiting for database 127.0.0.1:9/db (attempt 1, next in 1 s)")
    assert len(lines) == 4 and "hunter2" not in out.getvalue() + str(gave_up.value)
    assert "\n" not in str(gave_up.value) and "unreachable after 10 s (5 attempt(s))" in str(gave_up.value)
    calls = [0]

    def second_time(url: str, timeout: float) -> None:
        calls[0] += 1
        if calls[0] == 1:
            raise OSError("refused")

    out = io.StringIO()
    assert wait_for_database("postgresql://h/db", 10.0, out, second_time, sleep, lambda: now[0]) == 2
    assert out.getvalue().splitlines()[-1] == "codebuddy2api: database h:5432/db is up (attempt 2)"


def test_a_dead_workers_gauges_go_and_its_counters_stay(tmp_path: Path) -> None:
    names = ["gauge_livesum_41.db", "gauge_livemin_41.db", "gauge_all_41.db", "counter_41.db", "histogram_41.db",
             "gauge_livesum_42.db"]
    for name in names:
        (tmp_path / name).write_bytes(b"x")
    forget_worker(41, str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["counter_41.db", "gauge_livesum_42.db", "histogram_41.db"]
    assert [backoff(n) for n in range(1, 8)] == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
