"""Settlements that never leak a reservation nor lose usage (issue #40), on both backends,
without HTTP: leases reclaimed by the key's next reservation, renewed leases kept, a
settlement journaled while the store is out and replayed once it is back (idempotent:
a replay cut short and retried counts every request once)."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import orjson
import pytest

from gateway.generation.record import RequestRecord
from gateway.keys import limiter as limiter_module
from gateway.keys import store
from gateway.keys.limiter import KeyLimiter
from gateway.store.db import Store, open_database
from gateway.store.spill import DurableWriter, SpillJournal
from tests.conftest import ServerLoop, Simulator, start_gateway, wait_for
from tests.keys.test_keys import create_key, listed, oai
from tests.keys.test_keys_store import make_key
from tests.observability.test_audit import audit_rows


@pytest.fixture(params=["sqlite", "postgres"])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    if request.param == "sqlite":
        database = open_database(None, tmp_path)
    else:
        database = open_database(request.getfixturevalue("postgres_schema"), tmp_path)
    yield database
    database.close()


class FlakyStore:
    """A real store whose transactions fail while ``failing`` is set (the server is down)."""

    def __init__(self, inner: Store) -> None:
        self.inner = inner
        self.failing = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def run_tx(self, fn: Any, write: bool = True) -> Any:
        if self.failing:
            raise self.inner.errors[0]("the store is out")
        return self.inner.run_tx(fn, write)


def state(db: Store, request_id: str) -> tuple[int, int, int, int]:
    """(open, reclaimed, reserved, used) of a request's row."""
    [row] = db.execute("SELECT open, reclaimed, reserved, used FROM client_key_requests WHERE request_id = ?",
                       (request_id,))
    return int(row[0]), int(row[1]), int(row[2]), int(row[3])


def record(request_id: str, key_id: str, total: int) -> RequestRecord:
    return RequestRecord(request_id, "chat", time.time(), outcome="success", key_id=key_id,
                         usage={"prompt_tokens": total - 2, "completion_tokens": 2, "total_tokens": total})


def test_a_reservation_nobody_renews_is_reclaimed_by_the_next_one_once_its_lease_runs_out(
    db: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a 2 s lease: the refusal below must come while the lost one still holds it, even on a
    # busy machine (#39); then a sleep past the lease
    monkeypatch.setattr(store, "LEASE", 2.0)
    key = make_key(db, max_concurrent=1, daily_tokens=1000)
    assert store.reserve(db, key, "lost", 300) is None  # its process dies: nobody settles it
    refused = store.reserve(db, key, "next", 100)
    assert refused is not None and refused.code == "concurrency_limited"
    time.sleep(2.1)
    assert store.reserve(db, key, "next", 100) is None  # the lost one no longer counts as concurrent
    assert state(db, "lost") == (0, 1, 300, 300)  # reclaimed: what it reserved counts as used
    # what a replica of the version before leases counts (mid-way through a rolling upgrade):
    # the reclaimed row is an ended request there too, not a concurrent one
    before = "SELECT COALESCE(SUM(open), 0) FROM client_key_requests WHERE key_id = ? AND at > ?"
    assert db.execute(before, (key.key_id, time.time() - store.STALE_OPEN)) == [(1,)]  # "next" only
    assert store.usage_today(db)[key.key_id] == {"requests_today": 2, "tokens_today": 300}  # "next" is held
    # its settlement arrives late (replayed from a journal): the day's usage is corrected, once
    assert store.settle(db, "lost", 40) is True and store.settle(db, "lost", 40) is False
    assert state(db, "lost") == (0, 0, 300, 40)
    store.settle(db, "next", 60)
    assert store.usage_today(db)[key.key_id] == {"requests_today": 2, "tokens_today": 100}


def test_a_renewed_lease_is_kept_past_its_first_term(db: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(store, "LEASE", 2.0)
    key = make_key(db, max_concurrent=1)
    assert store.reserve(db, key, "long", 0) is None
    deadline = time.monotonic() + 2.5  # past the first lease
    while time.monotonic() < deadline:
        assert store.renew(db, ["long", "unknown"]) == 1
        time.sleep(0.5)
    assert store.renew(db, ["long"]) == 1
    refused = store.reserve(db, key, "other", 0)
    assert refused is not None and refused.code == "concurrency_limited"
    assert state(db, "long")[0] == 1
    store.settle(db, "long", 5)
    assert store.renew(db, ["long"]) == 0  # settled: nothing to renew
    assert store.reserve(db, key, "other", 0) is None


def test_settlement_rows_replayed_twice_count_once(db: Store) -> None:
    limited = make_key(db, daily_tokens=1000)
    free = make_key(db)
    assert store.reserve(db, limited, "r1", 500) is None
    apply = store.statements(db)
    for _ in range(2):  # a replay cut short after its commit, then retried
        db.run_tx(lambda conn: apply[store.SETTLE_KIND](conn, [("r1", 70)]))
        db.run_tx(lambda conn: apply[store.COUNT_KIND](conn, [("f1", free.key_id, 33), ("f2", free.key_id, 7)]))
    usage = store.usage_today(db)
    assert usage[limited.key_id] == {"requests_today": 1, "tokens_today": 70}
    assert usage[free.key_id] == {"requests_today": 2, "tokens_today": 40}


async def test_settlements_while_the_store_is_out_are_journaled_and_replayed_once(db: Store, tmp_path: Path) -> None:
    flaky = FlakyStore(db)
    durable = DurableWriter(flaky, SpillJournal(tmp_path / "spill", 1 << 20), store.statements(flaky))  # type: ignore[arg-type]
    limiter = KeyLimiter(flaky, durable)  # type: ignore[arg-type]
    limited = make_key(db, max_concurrent=2, daily_tokens=10_000)
    free = make_key(db)
    for request_id in ("a", "b"):
        assert store.reserve(db, limited, request_id, 4000) is None
        limiter._open.add(request_id)  # as admit() leaves it
    flaky.failing = True  # the store goes out while both requests end
    limiter.finished(limited, record("a", limited.key_id, 120))
    limiter.finished(limited, record("b", limited.key_id, 80))
    limiter.finished(free, record("c", free.key_id, 55))
    await limiter.aclose()  # the settlements are done: each journaled, none waiting on the store
    assert durable.spill_entries == 3 and durable.lost == 0 and limiter.unsettled == 0
    assert state(db, "a") == (1, 0, 4000, 0) and state(db, "b") == (1, 0, 4000, 0)
    flaky.failing = False
    assert await durable.recover() is True and durable.spill_entries == 0
    assert state(db, "a") == (0, 0, 4000, 120) and state(db, "b") == (0, 0, 4000, 80)
    usage = store.usage_today(db)
    assert usage[limited.key_id] == {"requests_today": 2, "tokens_today": 200}
    assert usage[free.key_id] == {"requests_today": 1, "tokens_today": 55}
    assert store.reserve(db, limited, "d", 4000) is None and store.reserve(db, limited, "e", 4000) is None
    await durable.aclose()


async def test_the_limiter_renews_the_leases_of_its_running_requests_and_only_those(
    db: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(store, "LEASE", 1.0)
    durable = DurableWriter(db, SpillJournal(tmp_path / "spill", 1 << 20), store.statements(db))
    limiter = KeyLimiter(db, durable, renew_every=0.1)
    key = make_key(db, max_concurrent=1)
    assert store.reserve(db, key, "running", 0) is None
    limiter._open.add("running")
    await limiter.start()
    await asyncio.sleep(2.5)  # past two leases: renewed meanwhile
    refused = store.reserve(db, key, "other", 0)
    assert refused is not None and refused.code == "concurrency_limited" and limiter.leases.failed_reloads == 0
    await limiter.aclose()  # its process stops renewing (as if it died)
    await asyncio.sleep(1.1)
    assert store.reserve(db, key, "other", 0) is None and state(db, "running")[:2] == (0, 1)
    await durable.aclose()


class HeldDurable:
    """A real durable writer whose writes wait until ``release`` is set (a store write that
    lags, as on a loaded machine)."""

    def __init__(self, inner: DurableWriter) -> None:
        self.inner = inner
        self.release = asyncio.Event()

    async def write(self, kind: str, rows: list[Any]) -> str:
        await self.release.wait()
        return await self.inner.write(kind, rows)


async def test_a_keys_next_reservation_waits_for_its_last_settlement(
    db: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client that asks again as soon as its answer ends finds that answer settled to
    what it used, not still holding its reservation; a settlement that never comes holds
    the next one only ``SETTLED_WAIT``."""
    inner = DurableWriter(db, SpillJournal(tmp_path / "spill", 1 << 20), store.statements(db))
    held = HeldDurable(inner)
    limiter = KeyLimiter(db, held)  # type: ignore[arg-type]
    key = make_key(db, daily_tokens=1000)
    assert store.reserve(db, key, "first", 900) is None
    limiter._open.add("first")  # as admit() leaves it
    limiter.finished(key, record("first", key.key_id, 50))  # its settlement lags
    waiting = asyncio.ensure_future(limiter._settled(key))
    await asyncio.sleep(0.2)
    assert not waiting.done() and state(db, "first") == (1, 0, 900, 0)  # still holding 900
    held.release.set()
    async with asyncio.timeout(30):
        await waiting
    assert state(db, "first") == (0, 0, 900, 50)
    assert store.reserve(db, key, "second", 900) is None  # 50 + 900 fit the 1,000 now
    # a settlement that never comes: the next reservation goes on after the bound
    monkeypatch.setattr(limiter_module, "SETTLED_WAIT", 0.1)
    held.release.clear()
    limiter._open.add("second")
    limiter.finished(key, record("second", key.key_id, 40))
    async with asyncio.timeout(30):
        await limiter._settled(key)
    assert state(db, "second") == (1, 0, 900, 0)
    held.release.set()
    await limiter.aclose()
    assert state(db, "second") == (0, 0, 900, 40) and not limiter._settling
    await inner.aclose()


def test_a_store_out_during_settlement_through_the_gateway_leaks_nothing_and_loses_no_usage(
    server_loop: ServerLoop, simulator: Simulator, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A max_concurrent=1 key's request ends while the SQLite file is write-locked: its
    settlement goes to the journal, and once the lock is gone it is replayed: the key's
    next request is admitted (not 429 for an hour) and the day's tokens are what was used;
    a key without limits loses no usage either."""
    gw = start_gateway(server_loop, simulator, tmp_path_factory, api_key=["ck-static-settlement-0001"])
    limited = create_key(gw, name="settles", max_concurrent=1, daily_tokens=100_000)
    free = create_key(gw, name="counts")
    db = gw.app.state.db
    durable = gw.app.state.observability.durable
    answers: dict[str, str] = {}

    def slow(secret: str, text: str) -> None:
        with oai(gw, secret).chat.completions.stream(model="echo;ttfb=1.5", messages=[{"role": "user", "content": text}],
                                                     stream_options={"include_usage": True}) as stream:
            answers[text] = stream.get_final_completion().choices[0].message.content or ""

    held = "SELECT COUNT(*) FROM client_key_requests WHERE key_id = ? AND open = 1"
    threads = [threading.Thread(target=slow, args=(limited["key"], "limited")),
               threading.Thread(target=slow, args=(free["key"], "free"))]
    threads[0].start()
    wait_for(lambda: db.execute(held, (limited["id"],)) == [(1,)], timeout=10)  # reserved
    conn = sqlite3.connect(db.path, isolation_level=None, timeout=30)
    conn.execute("BEGIN EXCLUSIVE")  # the store is out from here until ROLLBACK
    try:
        threads[1].start()
        for t in threads:
            t.join(30)
        assert answers == {"limited": "You said: limited", "free": "You said: free"}
        journal = gw.app.state.observability.journal
        wait_for(lambda: {"key_settle", "key_count"} <= {orjson.loads(line)["kind"] for line in journal.read().splitlines()},
                 timeout=15)
    finally:
        conn.execute("ROLLBACK")
        conn.close()
    wait_for(lambda: durable.spill_entries == 0, timeout=15)  # replayed
    rows = {r["key_id"]: r for r in audit_rows(gw, 2)}
    used = {k: rows[k]["usage"]["prompt_tokens"] + rows[k]["usage"]["completion_tokens"] for k in (limited["id"], free["id"])}
    assert all(v > 0 for v in used.values())
    usage = {k: v["usage"] for k, v in listed(gw).items()}
    assert usage[limited["id"]] == {"requests_today": 1, "tokens_today": used[limited["id"]]}
    assert usage[free["id"]] == {"requests_today": 1, "tokens_today": used[free["id"]]}
    assert db.execute(held, (limited["id"],)) == [(0,)]
    again = oai(gw, limited["key"]).chat.completions.create(model="echo", messages=[{"role": "user", "content": "next"}])
    assert again.choices[0].message.content == "You said: next"  # admitted: nothing leaked


def test_a_backward_clock_step_does_not_lock_a_key_and_its_limits_still_hold(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SQLite stamps rows with this machine's clock: after a 1 h step back, the rows stamped
    before it are 'in the future'. They must not fill the rpm window nor hold a lease for
    that hour (issue #40); the limits then count the requests made after the step."""
    db = open_database(None, tmp_path)
    clock = [time.time()]
    monkeypatch.setattr(store, "time", SimpleNamespace(time=lambda: clock[0]))
    key = make_key(db, rpm=2, max_concurrent=1)
    assert store.reserve(db, key, "r1", 0) is None and store.settle(db, "r1", 3)
    assert store.reserve(db, key, "r2", 0) is None  # its replica dies: never settled
    refused = store.reserve(db, key, "r3", 0)
    assert refused is not None and refused.code == "rate_limited"
    clock[0] -= 3600  # NTP steps the clock back an hour
    assert store.reserve(db, key, "r3", 0) is None
    assert state(db, "r2")[:2] == (0, 1)  # its lease, stamped an hour ahead, counts as run out
    assert db.execute("SELECT COUNT(*) FROM client_key_requests WHERE request_id = 'r1'") == [(0,)]  # dropped
    limited = store.reserve(db, key, "r4", 0)
    assert limited is not None and limited.code == "concurrency_limited"  # r3 is held
    store.settle(db, "r3", 1)
    assert store.reserve(db, key, "r4", 0) is None and store.settle(db, "r4", 1)
    over = store.reserve(db, key, "r5", 0)
    assert over is not None and over.code == "rate_limited" and 59 <= over.retry_after <= 60  # r3, r4 in this minute
    db.close()


def test_a_row_of_the_version_before_leases_is_held_an_hour_as_it_was(db: Store) -> None:
    """Mid-way through a rolling upgrade an old replica writes rows without a lease: they are
    held (max_concurrent) until an hour after they began, as that version did, then reclaimed."""
    key = make_key(db, max_concurrent=1)
    now = time.time()
    old = "INSERT INTO client_key_requests (request_id, key_id, at, day, reserved, used, open) VALUES (?, ?, ?, ?, 7, 0, 1)"
    db.execute(old, ("old-running", key.key_id, now - 120, store.day_of(now)))
    refused = store.reserve(db, key, "new", 0)
    assert refused is not None and refused.code == "concurrency_limited"
    db.execute("UPDATE client_key_requests SET at = ? WHERE request_id = 'old-running'", (now - store.STALE_OPEN - 1,))
    assert store.reserve(db, key, "new", 0) is None and state(db, "old-running") == (0, 1, 7, 7)
