"""The spill journal and the durable writer, fed directly (no server): bounded, fsync'd,
reserved up front, torn tails dropped, one journal per process, replay exactly once;
the credential state writer coalesces and retries; probe backoff."""

from __future__ import annotations

import asyncio
import logging
import sqlite3
from pathlib import Path
from typing import Any

import orjson
import pytest

from gateway.store.audit import AUDIT_UPSERT
from gateway.store.credentials import CredentialState, CredentialStateWriter
from gateway.store.db import Database
from gateway.store.spill import SPILL_LOG_INTERVAL, DurableWriter, SpillFull, SpillJournal
from gateway.upstream.prober import backoff


def row(request_id: str) -> tuple[Any, ...]:
    record = orjson.dumps({"request_id": request_id, "outcome": "success"}).decode()
    return (request_id, 1.0, 2.0, "chat", "compatible", 1, "m", "success", None, 200, record)


def audit_ids(db: Database) -> list[str]:
    return [r[0] for r in db.execute("SELECT request_id FROM audit ORDER BY request_id")]


def test_the_journal_reserves_its_bound_appends_lines_and_refuses_past_it(tmp_path: Path) -> None:
    journal = SpillJournal(tmp_path, 4096)
    assert journal.reserved and (tmp_path / "spill-0.jsonl").stat().st_size == 4096
    assert (tmp_path / "spill-0.jsonl").stat().st_mode & 0o777 == 0o600
    journal.append([b'{"a":1}', b'{"b":2}'])
    assert journal.entries == 2 and journal.read() == b'{"a":1}\n{"b":2}\n'
    with pytest.raises(SpillFull):
        journal.append([b"x" * 5000])
    assert journal.entries == 2  # a refused batch leaves nothing behind
    journal.clear()
    assert journal.entries == 0 and journal.read() == b""
    assert (tmp_path / "spill-0.jsonl").read_bytes() == bytes(4096)  # zeroed, still reserved
    journal.close()


def test_a_reopened_journal_keeps_its_entries_and_drops_a_torn_tail(tmp_path: Path) -> None:
    journal = SpillJournal(tmp_path, 4096)
    journal.append([b'{"a":1}', b'{"b":2}'])
    journal.close()
    with (tmp_path / "spill-0.jsonl").open("r+b") as f:  # a crash half-way through a line
        f.seek(len(b'{"a":1}\n{"b":2}\n'))
        f.write(b'{"c":')
    again = SpillJournal(tmp_path, 4096)
    assert again.entries == 2 and again.read() == b'{"a":1}\n{"b":2}\n'
    again.append([b'{"d":4}'])
    assert again.read().splitlines() == [b'{"a":1}', b'{"b":2}', b'{"d":4}']
    again.close()


def test_each_process_claims_its_own_journal(tmp_path: Path) -> None:
    first = SpillJournal(tmp_path, 4096)
    second = SpillJournal(tmp_path, 4096)  # flock is per open file: the same process counts as another
    assert (first.path.name, second.path.name) == ("spill-0.jsonl", "spill-1.jsonl")
    first.close()
    third = SpillJournal(tmp_path, 4096)
    assert third.path.name == "spill-0.jsonl"
    second.close()
    third.close()


class FlakyStore:
    """A SQLite store whose writes fail while ``failing`` is set (disk full, read-only)."""

    def __init__(self, path: Path) -> None:
        self.inner = Database(path)
        self.failing = False
        self.dialect, self.shared, self.errors = "sqlite", False, (sqlite3.Error,)

    def run_tx(self, fn: Any, write: bool = True) -> Any:
        if self.failing:
            raise sqlite3.OperationalError("database or disk is full")
        return self.inner.run_tx(fn, write)


async def test_the_durable_writer_spills_while_the_store_fails_and_replays_once(tmp_path: Path) -> None:
    store = FlakyStore(tmp_path / "db.sqlite3")
    events: list[tuple[str, str, int]] = []
    durable = DurableWriter(
        store, SpillJournal(tmp_path / "spill", 1 << 20), {"audit": AUDIT_UPSERT},  # type: ignore[arg-type]
        on_spilled=lambda k, n: events.append(("spilled", k, n)),
        on_replayed=lambda k, n: events.append(("replayed", k, n)),
    )
    assert await durable.write("audit", [row("r1")]) == "stored"
    store.failing = True
    assert await durable.write("audit", [row("r2"), row("r3")]) == "spilled"
    assert not durable.store_writable and durable.spill_entries == 2
    assert await durable.recover() is False  # still failing: nothing replayed, nothing lost
    store.failing = False
    assert await durable.write("audit", [row("r4")]) == "spilled"  # order kept: the journal first
    assert await durable.recover() is True
    assert audit_ids(store.inner) == ["r1", "r2", "r3", "r4"]
    assert durable.spill_entries == 0 and durable.store_writable and durable.lost == 0
    # a replay retried after a crash half-way (rows already in the store) still leaves one row each
    durable.journal.append([orjson.dumps({"kind": "audit", "row": list(row("r2"))})])  # type: ignore[union-attr]
    assert await durable.recover() is True and audit_ids(store.inner) == ["r1", "r2", "r3", "r4"]
    assert events == [("spilled", "audit", 2), ("spilled", "audit", 1), ("replayed", "audit", 3), ("replayed", "audit", 1)]


async def test_a_row_neither_the_store_nor_the_journal_takes_is_lost_loudly(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = FlakyStore(tmp_path / "db.sqlite3")
    store.failing = True
    lost: list[tuple[str, int]] = []
    durable = DurableWriter(store, SpillJournal(tmp_path / "spill", 4096), {"audit": AUDIT_UPSERT},  # type: ignore[arg-type]
                            on_lost=lambda k, n: lost.append((k, n)))
    big = row("r1")[:-1] + ("x" * 5000,)
    with caplog.at_level(logging.ERROR):
        assert await durable.write("audit", [big]) == "lost"
    assert lost == [("audit", 1)] and durable.lost == 1
    assert any("store_records_lost" in r.getMessage() and r.levelno == logging.ERROR for r in caplog.records)


async def test_the_credential_state_writer_coalesces_and_retries(tmp_path: Path) -> None:
    store = FlakyStore(tmp_path / "db.sqlite3")
    saved: list[tuple[str, int]] = []

    class State(CredentialState):
        def save(self, credential_id: str, state: dict[str, Any]) -> int:
            if store.failing:
                raise sqlite3.OperationalError("database is locked")
            return super().save(credential_id, state)

    writer = CredentialStateWriter(State(store.inner), on_saved=lambda c, v: saved.append((c, v)), retry_interval=0.01)
    store.failing = True
    writer.submit("c1", {"disabled": True})
    writer.submit("c1", {"disabled": False, "cooldowns": {"m": 9e9}})  # the newer state wins
    assert writer.busy == {"c1"}
    await writer.start()
    await asyncio.sleep(0.05)
    assert saved == [] and writer.failures >= 1 and writer.busy == {"c1"}
    store.failing = False
    for _ in range(200):
        if saved:
            break
        await asyncio.sleep(0.01)
    assert saved == [("c1", 1)] and writer.busy == set()
    assert CredentialState(store.inner).load() == {"c1": {"disabled": False, "cooldowns": {"m": 9e9}}}
    await writer.aclose()


def test_probe_backoff_doubles_up_to_its_cap() -> None:
    assert [backoff(5.0, n) for n in range(8)] == [5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 300.0, 300.0]


async def test_a_store_write_that_does_not_answer_in_time_is_spilled(tmp_path: Path) -> None:
    """A stalled store (PostgreSQL paused): the rows go to the journal after the write
    timeout; the late write and the replay both land, one row per id."""
    import threading

    store = FlakyStore(tmp_path / "db.sqlite3")
    release = threading.Event()
    inner_run_tx = store.run_tx

    def stalled(fn: Any, write: bool = True) -> Any:
        release.wait(10)
        return inner_run_tx(fn, write)

    store.run_tx = stalled  # type: ignore[method-assign]
    durable = DurableWriter(store, SpillJournal(tmp_path / "spill", 1 << 20), {"audit": AUDIT_UPSERT},  # type: ignore[arg-type]
                            write_timeout=0.1)
    assert await durable.write("audit", [row("r1")]) == "spilled"
    assert durable.store_error == "TimeoutError" and durable.spill_entries == 1
    release.set()
    store.run_tx = inner_run_tx  # type: ignore[method-assign]
    assert await durable.recover() is True
    await asyncio.sleep(0.05)
    assert audit_ids(store.inner) == ["r1"] and durable.spill_entries == 0


async def test_a_healthy_sqlite_store_takes_concurrent_writes_without_spilling(tmp_path: Path) -> None:
    """Writes from many worker threads at once (the audit writer and every Responses
    ``store: true`` share one connection): none may fail. A cursor handed out of the lock
    and dropped by another thread resets its statement while a worker runs the same one
    (SQLite: "bad parameter or other API misuse"), which spilled most writes under load.
    The stall bounds are generous here: this is about errors, not latency (one fsync on a
    busy CI machine once took over the default 0.5 s, and 3,000 writes queued on two threads
    beside the fault suite took over the default 5 s in all: both spill by design)."""
    db = Database(tmp_path / "db.sqlite3")
    durable = DurableWriter(db, SpillJournal(tmp_path / "spill", 1 << 22), {"audit": AUDIT_UPSERT},
                            write_timeout=30.0, write_max=300.0)
    outcomes = await asyncio.gather(*(durable.write("audit", [row(f"r{i:05d}")]) for i in range(3000)))
    assert outcomes.count("stored") == 3000, f"{durable.store_error}: {outcomes.count('spilled')} spilled"
    assert durable.spilled == 0 and durable.store_writable
    assert len(audit_ids(db)) == 3000


def test_the_sqlite_store_never_hands_an_open_cursor_out_of_its_lock(tmp_path: Path) -> None:
    """Whatever ``fn`` returns leaves the lock: a cursor among it is closed first."""
    db = Database(tmp_path / "db.sqlite3")
    cursor = db.run_tx(lambda conn: conn.executemany(AUDIT_UPSERT, [row("r1")]))
    with pytest.raises(sqlite3.ProgrammingError, match="closed cursor"):
        cursor.fetchall()
    cursor = db.run(lambda conn: conn.execute("SELECT request_id FROM audit"))
    with pytest.raises(sqlite3.ProgrammingError, match="closed cursor"):
        cursor.fetchall()
    assert audit_ids(db) == ["r1"]


async def test_an_outage_logs_its_spills_once_per_interval_not_once_per_write(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """At a few hundred requests a second every write spills: one WARNING line per interval,
    with the rows spilled since the last one, so the log does not flood a filling disk."""
    store = FlakyStore(tmp_path / "db.sqlite3")
    store.failing = True
    now = [100.0]
    durable = DurableWriter(store, SpillJournal(tmp_path / "spill", 1 << 20),  # type: ignore[arg-type]
                            {"audit": AUDIT_UPSERT}, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="gateway.spill"):
        for i in range(30):
            assert await durable.write("audit", [row(f"r{i:02d}")]) == "spilled"
        now[0] += SPILL_LOG_INTERVAL
        assert await durable.write("audit", [row("r30"), row("r31")]) == "spilled"
    lines = [r.getMessage() for r in caplog.records if "store_records_spilled" in r.getMessage()]
    assert len(lines) == 2, lines
    assert "'rows': 1," in lines[0] and "'rows': 31," in lines[1]  # the first at once, then 29 + 2
    assert durable.spilled == 32 and durable.spill_entries == 32
