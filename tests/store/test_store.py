"""The store on both backends: every test runs on SQLite and on PostgreSQL (a fresh schema
on the server from .ci/postgres.sh; skipped without one, failed under CI).

Audit write/read/aggregate/export/retention, saved settings revisions/stale/history (two
handles = two processes), credential state versions and pool adoption, stored responses,
replica heartbeats and capacity shares, migrations idempotent and concurrent, and the
SQLite-flavoured SQL other modules send (``?``, ``json_extract``) on PostgreSQL.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from gateway.errors import GatewayError
from gateway.generation.record import RequestRecord
from gateway.store import audit_queries
from gateway.store.audit import AuditWriter
from gateway.store.credentials import CredentialState
from gateway.store.db import Database, Store, open_database
from gateway.store.migrations import MIGRATIONS, ddl
from gateway.store.postgres import to_postgres
from gateway.store.replicas import Replication, share
from gateway.store.responses import ResponseStore
from gateway.store.saved_settings import SavedSettings, StaleRevision
from gateway.upstream.credential import Credential, Upstream
from gateway.upstream.pool import UpstreamPool
from tests.conftest import wait_for

LATEST = max(v for v, _ in MIGRATIONS)


@pytest.fixture(params=["sqlite", "postgres"])
def opener(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callable[[], Store]]:
    """Opens (and migrates) a handle on one fresh store; call it twice for two processes."""
    url = request.getfixturevalue("postgres_schema") if request.param == "postgres" else None
    opened: list[Store] = []

    def open_one() -> Store:
        db = open_database(url, tmp_path)
        opened.append(db)
        return db

    yield open_one
    for db in opened:
        db.close()



def record(request_id: str, **fields: Any) -> RequestRecord:
    return RequestRecord(request_id=request_id, protocol=fields.pop("protocol", "chat"),
                         started_at=fields.pop("started_at", time.time()), mode=fields.pop("mode", "compatible"),
                         model="echo", outcome=fields.pop("outcome", "success"), **fields)


# -- migrations ------------------------------------------------------------------------------

def test_migrations_are_idempotent_and_safe_to_run_concurrently(opener: Callable[[], Store]) -> None:
    with ThreadPoolExecutor(4) as pool:  # four replicas starting at once on an empty store
        handles = list(pool.map(lambda _: opener(), range(4)))
    assert {db.version for db in handles} == {LATEST}
    db = handles[0]
    db.execute("INSERT INTO responses (id, created_at, body) VALUES (?, ?, ?)", ("resp_1", 1.0, "{}"))
    again = opener()  # a restart: nothing re-applied, nothing lost
    assert again.version == LATEST
    assert again.execute("SELECT id FROM responses") == [("resp_1",)]
    if db.dialect == "postgres":
        assert db.execute("SELECT id, version FROM schema_version") == [(1, LATEST)]
        types = dict(db.execute(
            "SELECT column_name, data_type FROM information_schema.columns WHERE table_name = 'audit'"
            " AND table_schema = current_schema()"))
        assert types["started_at"] == "double precision" and types["http_status"] == "bigint"
    assert again.integrity_check() == "ok"


def test_migrations_are_written_once_and_mapped_per_dialect() -> None:
    assert "DOUBLE PRECISION" in ddl(MIGRATIONS[0][1], "postgres") and "REAL" not in ddl(MIGRATIONS[0][1], "postgres")
    assert ddl(MIGRATIONS[0][1], "sqlite") == MIGRATIONS[0][1]
    assert ddl({"sqlite": "", "postgres": "X"}, "sqlite") == ""
    assert to_postgres("SELECT a FROM t WHERE b = ? AND c LIKE '50%?' AND d = ?") == (
        "SELECT a FROM t WHERE b = %s AND c LIKE '50%%?' AND d = %s")
    assert to_postgres("SUM(CASE WHEN json_extract(record, '$.x') THEN 1 ELSE 0 END)") == (
        "SUM(CASE WHEN json_truthy(record, '$.x') THEN 1 ELSE 0 END)")


def test_sqlite_flavoured_json_queries_run_on_both(opener: Callable[[], Store]) -> None:
    """The admin status/timeseries queries use SQLite's JSON functions; same answers on both."""
    db = opener()
    rows = [("r1", {"ttfb_ms": 12.5, "repairs": [], "budget_exceeded": False}),
            ("r2", {"ttfb_ms": None, "repairs": [{"kind": "json"}, {"kind": "name"}], "budget_exceeded": True}),
            ("r3", {"ttfb_ms": 7, "repairs": [{"kind": "json"}], "budget_exceeded": False})]
    for rid, rec in rows:
        db.execute("INSERT INTO audit (request_id, started_at, ended_at, protocol, mode, streamed, model, outcome,"
                   " error_code, http_status, record) VALUES (?, ?, 0, 'chat', 'compatible', 1, 'm', 'success',"
                   " NULL, 200, ?)", (rid, 100.0, json.dumps(rec)))
    counts = db.run(lambda conn: conn.execute(
        "SELECT COUNT(*), COALESCE(SUM(json_array_length(record, '$.repairs')), 0),"
        " COALESCE(SUM(CASE WHEN json_extract(record, '$.repairs') != '[]' THEN 1 ELSE 0 END), 0),"
        " COALESCE(SUM(CASE WHEN json_extract(record, '$.budget_exceeded') THEN 1 ELSE 0 END), 0)"
        " FROM audit WHERE started_at >= ?", (50.0,)).fetchone())
    assert [int(v) for v in counts] == [3, 3, 2, 1]
    ttfb = dict(db.execute("SELECT request_id, json_extract(record, '$.ttfb_ms') FROM audit"))
    assert {k: (None if v is None else float(v)) for k, v in ttfb.items()} == {"r1": 12.5, "r2": None, "r3": 7.0}


# -- audit -----------------------------------------------------------------------------------

async def test_audit_write_read_aggregate_export_and_retention(opener: Callable[[], Store]) -> None:
    db = opener()
    writer = AuditWriter(db, flush_interval=0.01, store_bodies=lambda: True, body_max_bytes=lambda: 8)
    await writer.start()
    now = time.time()
    for i in range(30):
        writer.submit(record(f"req_{i:02d}", started_at=now - 100 + i, ttfb_ms=float(i), duration_ms=10.0 * i,
                             protocol="messages" if i % 3 == 0 else "chat",
                             outcome="error" if i % 5 == 0 else "success", bodies={"request": "x" * 20}))
    writer.submit(record("req_old", started_at=now - 40 * 86400))
    await writer.aclose()
    assert writer.written == 31 and writer.write_errors == 0

    rows, total = await audit_queries.query(db, limit=5, offset=0)
    assert total == 31 and [r["request_id"] for r in rows] == [f"req_{i:02d}" for i in (29, 28, 27, 26, 25)]
    assert rows[0]["bodies"] == {"request": "x" * 8, "request_truncated": 20}
    errors, error_total = await audit_queries.query(db, outcome="error", protocol="chat", since=now - 200)
    assert error_total == len(errors) == 4  # i in 5, 10, 20, 25 (0 and 15 are messages)
    assert (await audit_queries.get(db, "req_07"))["ttfb_ms"] == 7.0 and await audit_queries.get(db, "nope") is None

    summary = await audit_queries.aggregate(db, window=3600, now=now + 1)
    assert summary["requests"] == 30 and summary["by_outcome"] == {"error": 6, "success": 24}
    chat = next(s for s in summary["by_protocol_mode"] if s["protocol"] == "chat")
    assert chat["requests"] == 20 and chat["ttfb_ms_p50"] == 14.0 and chat["ttfb_ms_p95"] == 28.0

    lines = [json.loads(line) for chunk in [c async for c in audit_queries.export(db, page=7)] for line in chunk.splitlines()]
    assert [line["request_id"] for line in lines] == ["req_old", *[f"req_{i:02d}" for i in range(30)]]
    assert await AuditWriter(db, retention_days=lambda: 30).retention.purge() == 1
    assert (await audit_queries.query(db))[1] == 30


async def test_audit_filters_by_transport_and_the_migration_backfills_it(
    request: pytest.FixtureRequest, opener: Callable[[], Store], tmp_path: Path
) -> None:
    """``transport`` is a column generated from the record (migration 7): rows written
    before it get theirs from their record, a record from before the field has none (NULL,
    matched by no filter), and the writer's upsert never names it."""
    url = request.getfixturevalue("postgres_schema") if "postgres" in request.node.callspec.id else None
    old = open_database(url, tmp_path, migrate=False)
    try:
        old.migrate([m for m in MIGRATIONS if m[0] < 7])  # a store of the previous release
        assert old.version == 6
        for rid, rec in [("old_ws", {"request_id": "old_ws", "transport": "websocket"}),
                         ("old_http", {"request_id": "old_http", "transport": "http"}),
                         ("older", {"request_id": "older"}),  # before records named their transport
                         ("nul_ws", {"request_id": "nul_ws", "transport": "websocket", "text": "a\x00b"})]:  # JSON: "a\\u0000b"
            old.execute("INSERT INTO audit (request_id, started_at, ended_at, protocol, mode, streamed, model, outcome,"
                        " error_code, http_status, record) VALUES (?, ?, ?, 'responses', 'compatible', 1, 'm',"
                        " 'success', NULL, 200, ?)", (rid, time.time(), time.time(), json.dumps(rec)))
    finally:
        old.close()
    db = opener()  # the new release migrates it
    assert db.version == LATEST
    assert dict(db.execute("SELECT request_id, transport FROM audit")) == {
        "old_ws": "websocket", "old_http": "http", "older": None, "nul_ws": "websocket"}
    writer = AuditWriter(db, flush_interval=0.01)
    await writer.start()
    writer.submit(record("new_ws", protocol="responses", transport="websocket"))
    writer.submit(record("new_http", protocol="responses"))  # http: the record's default
    writer.submit(record("new_ws", protocol="responses", transport="websocket", outcome="error"))  # the upsert again
    await writer.aclose()
    assert writer.written == 3 and writer.write_errors == 0

    async def ids(**filters: str) -> list[str]:
        rows, total = await audit_queries.query(db, **filters)
        assert total == len(rows)
        return sorted(r["request_id"] for r in rows)

    assert await ids(transport="websocket") == ["new_ws", "nul_ws", "old_ws"]
    assert await ids(transport="http") == ["new_http", "old_http"]
    assert await ids(transport="websocket", outcome="error") == ["new_ws"]
    assert await ids(transport="carrier-pigeon") == []
    assert len(await ids()) == 6


async def test_audit_from_two_processes_lands_in_one_table(opener: Callable[[], Store]) -> None:
    from gateway.store.audit import _INSERT
    from gateway.store.spill import DurableWriter

    a, b = opener(), opener()
    # no spill journal here: a write taking past the 0.5 s stall bound (a loaded machine's
    # PostgreSQL) would count its batch lost; this test is about two writers, not stalls
    writers = [AuditWriter(db, flush_interval=0.005, batch_size=7,
                           durable=DurableWriter(db, None, {"audit": _INSERT}, write_timeout=30.0, write_max=60.0))
               for db in (a, b)]
    for w in writers:
        await w.start()
    for i in range(50):
        writers[i % 2].submit(record(f"req_{i}"))
    for w in writers:
        await w.aclose()
    ids = [r[0] for r in a.execute("SELECT request_id FROM audit")]
    assert sorted(ids) == sorted(f"req_{i}" for i in range(50))  # exactly one row each


# -- saved settings --------------------------------------------------------------------------

def test_saved_settings_revisions_stale_and_history(opener: Callable[[], Store]) -> None:
    a, b = SavedSettings(opener()), SavedSettings(opener())
    try:
        assert a.load() == (0, {}) and b.revision() == 0
        assert a.write(0, {"stream_mode": "realtime", "api_key": ["ck-1"]}, [], "alice") == 1
        if b.max_age == 0:  # SQLite: read per call, seen at once
            assert b.revision() == 1
        else:  # PostgreSQL: the polled revision is at most max_age (+ one query) old
            wait_for(lambda: b.revision() == 1, timeout=30.0)  # how soon is a speed, not asserted
        assert b.load() == (1, {"stream_mode": "realtime", "api_key": ["ck-1"]})
        with pytest.raises(StaleRevision) as stale:
            b.write(0, {"stream_mode": "compatible"}, [], "bob")
        assert stale.value.current == 1
        assert b.write(1, {"max_collect_bytes": 10}, ["api_key"], "bob") == 2
        history = a.history()
        assert [(h["revision"], h["actor"]) for h in history] == [(2, "bob"), (1, "alice")]
        assert history[1]["changes"]["api_key"] == {"old": None, "new": "[redacted]"}
        assert history[0]["changes"]["api_key"] == {"old": "[redacted]", "new": None}
        assert a.load() == (2, {"stream_mode": "realtime", "max_collect_bytes": 10})
        assert a.integrity_check() == "ok"
    finally:
        a.close()
        b.close()


def test_concurrent_writers_on_one_revision_exactly_one_wins(opener: Callable[[], Store]) -> None:
    handles = [SavedSettings(opener()) for _ in range(4)]
    barrier = threading.Barrier(len(handles))

    def attempt(i: int) -> str:
        barrier.wait()
        try:
            handles[i].write(0, {"tool_repair_attempts": i}, [], f"w{i}")
            return "won"
        except StaleRevision as exc:
            assert exc.current == 1
            return "stale"

    try:
        with ThreadPoolExecutor(len(handles)) as pool:
            results = list(pool.map(attempt, range(len(handles))))
        assert sorted(results) == ["stale", "stale", "stale", "won"]
        revision, values = handles[0].load()
        assert revision == 1 and values["tool_repair_attempts"] == results.index("won")
        assert len(handles[0].history()) == 1
    finally:
        for h in handles:
            h.close()


# -- credential state ------------------------------------------------------------------------

def _pool(db: Store, clock: Callable[[], float] = time.time) -> UpstreamPool:
    upstream = Upstream("up", "http://127.0.0.1:9/v1")
    return UpstreamPool([Credential(upstream, "sk-a"), Credential(upstream, "sk-b")], CredentialState(db), clock=clock)


def test_credential_state_versions_and_sharing_between_pools(opener: Callable[[], Store]) -> None:
    state = CredentialState(opener())
    assert state.save("c1", {"disabled": True}) == 1
    assert state.save("c1", {"disabled": False, "cooldowns": {"m": 5.0}}) == 2
    assert state.load_versions() == {"c1": (2, {"disabled": False, "cooldowns": {"m": 5.0}})}
    assert state.load() == {"c1": {"disabled": False, "cooldowns": {"m": 5.0}}}
    state.add_credential("added@up", "up", "http://127.0.0.1:9/v1", "sk-new")
    state.add_credential("added@up", "up", "http://127.0.0.1:9/v1", "sk-newer")  # upsert, no duplicate
    assert state.added_credentials() == [("added@up", "up", "http://127.0.0.1:9/v1", "sk-newer", None)]
    state.add_credential("added@up", "up", "http://127.0.0.1:9/v1", "sk-newer", "rotated 2026-12")  # migration 11
    assert state.added_credentials()[0].label == "rotated 2026-12"

    db = opener()
    a, b = _pool(db), _pool(opener())
    first = a.credentials[0]
    a.report_failure(first, "m", GatewayError("rate_limit", "upstream_rate_limited", "slow down",
                                              upstream_status=429, retry_after=60))
    stale = CredentialState(db).load_versions()
    b.apply_shared(stale, CredentialState(db).added_credentials())
    twin = b.get(first.id)
    assert twin.cooling_until("m", time.time()) > time.time() + 50
    assert "added@up" in {c.id for c in b.credentials}  # an admin-added credential reaches b too
    b.reset_cooldowns(first.id)  # b's newer write wins over a's older state...
    a.apply_shared(CredentialState(db).load_versions())
    assert not first.cooldowns
    b.apply_shared(stale)  # ...and an old poll result never undoes it
    assert not twin.cooldowns


# -- responses -------------------------------------------------------------------------------

async def test_stored_responses(opener: Callable[[], Store]) -> None:
    a, b = ResponseStore(opener()), ResponseStore(opener())
    await a.save("resp_1", {"response": {"id": "resp_1"}, "history": [], "output": [{"role": "assistant"}]})
    assert (await b.load("resp_1"))["output"] == [{"role": "assistant"}]
    await b.save("resp_1", {"response": {"id": "resp_1", "v": 2}})
    assert await a.load("resp_1") == {"response": {"id": "resp_1", "v": 2}}
    assert await a.load("resp_missing") is None


# -- replicas --------------------------------------------------------------------------------

def test_shares_add_up_to_the_cap() -> None:
    for cap in (1, 5, 6, 7, 64):
        for n in (1, 2, 3, 5):
            ids = [f"r{i}" for i in range(n)]
            assert sum(share(cap, ids, me) for me in ids) == cap
    assert [share(7, ["a", "b", "c"], me) for me in "abc"] == [3, 2, 2]


async def test_heartbeats_membership_and_leaving(opener: Callable[[], Store]) -> None:
    a = Replication(opener(), "replica-a", lambda: 3, ttl=2.0)
    b = Replication(opener(), "replica-b", lambda: 1, ttl=2.0)
    await a.start()
    assert a.capacity.limit(6) == 6  # alone
    await b.start()
    assert b.capacity.live == ["replica-a", "replica-b"]
    a.heartbeat()
    assert a.capacity.limit(6) == 3 and b.capacity.limit(6) == 3 and a.capacity.limit(7) == 4
    rows = {r["replica_id"]: r for r in a.replicas()}
    assert rows["replica-a"]["in_flight"] == 3 and rows["replica-b"]["alive"] and rows["replica-b"]["age"] < 2
    await b.aclose()  # leaving: a takes the whole cap at its next heartbeat
    a.heartbeat()
    assert a.capacity.live == ["replica-a"] and a.capacity.limit(6) == 6
    await a.aclose()
    assert a.replicas() == []


async def test_a_silent_replica_stops_counting_after_the_ttl(opener: Callable[[], Store]) -> None:
    a = Replication(opener(), "replica-a", ttl=0.5)
    ghost = Replication(opener(), "replica-ghost", ttl=0.5)
    ghost.heartbeat()  # then crashes: never beats again, never leaves
    assert a.heartbeat() == ["replica-a", "replica-ghost"]
    for _ in range(8):  # a keeps beating; the ghost's row ages past the TTL
        time.sleep(0.1)
        live = a.heartbeat()
    assert live == ["replica-a"] and a.capacity.limit(6) == 6
    ghost.heartbeat()
    assert a.heartbeat() == ["replica-a", "replica-ghost"]
    time.sleep(0.7)  # an outage: nobody could beat for longer than the TTL
    assert a.heartbeat() == ["replica-a", "replica-ghost"]  # still counted for one round
    assert a.heartbeat() == ["replica-a"]  # it did not come back
    assert isinstance(a.db, Database) == (a.db.dialect == "sqlite")
