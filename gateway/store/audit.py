"""The audit store's write side: one row per generation request, written off the hot path.

:meth:`AuditWriter.submit` runs on the event loop and only appends a snapshot of the
record to a bounded in-memory queue; a background task batch-inserts the queue in one
transaction per batch through a :class:`~gateway.store.spill.DurableWriter` (in a worker
thread), on SQLite or PostgreSQL alike: when the store cannot write, the batch goes to the
spill journal and is replayed later, and only a batch that not even the journal takes is
lost. A full queue (a store slower than the traffic) is no reason to lose a record either:
what does not fit goes to a second queue of the same bound that a second task spills
straight to the journal (fsync'd, no store in the way), replayed like any spill; only past
both bounds, or with no journal, is a record dropped (counted, logged). Shutdown drains
both queues completely before the database closes. Rows older than the retention period
are deleted at start-up and hourly by :class:`AuditRetention` (on a shared store every
replica purges; the deletes are idempotent). Reading the rows back (list, one record,
summaries, export) is :mod:`gateway.store.audit_queries`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import orjson
import structlog

from gateway.redact import SECRETS
from gateway.store.db import Store, upsert
from gateway.store.spill import DurableWriter, no_report
from gateway.tasks import stop_tasks

if TYPE_CHECKING:
    from gateway.generation.record import RequestRecord

log = structlog.get_logger("gateway.audit")

RETENTION_INTERVAL = 3600.0
#: The audit row upsert, keyed by request id (a replayed spill never duplicates a row).
AUDIT_UPSERT = _INSERT = upsert(
    "audit",
    ("request_id", "started_at", "ended_at", "protocol", "mode", "streamed", "model", "outcome", "error_code",
     "http_status", "record"),
    "request_id",
)


def snapshot(record: RequestRecord) -> dict[str, Any]:
    """A detached copy of the record (cheap: one level of containers copied)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(record):  # type: ignore[arg-type]
        value = getattr(record, f.name)
        if isinstance(value, dict):
            value = dict(value)
        elif isinstance(value, list):
            value = [dict(v) if isinstance(v, dict) else v for v in value]
        out[f.name] = value
    return out


def cap_bodies(bodies: Any, max_bytes: int) -> dict[str, Any] | None:
    """Bodies as text, each cut to ``max_bytes`` UTF-8 bytes (``<name>_truncated`` says so)."""
    if not isinstance(bodies, dict):
        return None
    out: dict[str, Any] = {}
    for name, body in bodies.items():
        if body is None:
            continue
        if isinstance(body, bytes | bytearray):
            raw = bytes(body)
        elif isinstance(body, str):
            raw = body.encode("utf-8", "replace")
        else:
            raw = orjson.dumps(body, default=str)
        if len(raw) > max_bytes:
            out[name] = raw[:max_bytes].decode("utf-8", "ignore")
            out[name + "_truncated"] = len(raw)
        else:
            out[name] = raw.decode("utf-8", "replace")
    return out


def _row(record: dict[str, Any]) -> tuple[Any, ...]:
    return (
        record["request_id"],
        float(record.get("started_at") or 0.0),
        float(record.get("ended_at") or 0.0),
        str(record.get("protocol") or ""),
        str(record.get("mode") or ""),
        1 if record.get("streamed") else 0,
        SECRETS.mask(str(record.get("model") or "")),
        str(record.get("outcome") or ""),
        record.get("error_code"),
        int(record.get("http_status") or 0),
        SECRETS.mask(orjson.dumps(record, default=str).decode()),  # error messages, attempts, bodies
    )


class AuditRetention:
    """Deletes audit rows older than the retention period, at start-up and then hourly.
    Its own task, apart from the writer: a purge never holds up a batch, and the period
    is read afresh each time (it is a live setting; 0 keeps rows forever)."""

    def __init__(self, db: Store, retention_days: Callable[[], float], interval: float = RETENTION_INTERVAL) -> None:
        self.db = db
        self.retention_days = retention_days
        self.interval = interval
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Purge now, then every ``interval`` seconds until :meth:`aclose`."""
        await self.purge()
        self._task = asyncio.create_task(self._loop(), name="audit-retention")

    async def aclose(self) -> None:
        await stop_tasks(self._task)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            await self.purge()

    async def purge(self) -> int:
        """Delete rows older than the retention period; returns how many went."""
        days = self.retention_days()
        if days <= 0:
            return 0
        cutoff = time.time() - days * 86400

        def delete(conn: Any) -> int:
            return int(conn.execute("DELETE FROM audit WHERE started_at < ?", (cutoff,)).rowcount)

        try:
            deleted = await self.db.arun(delete)
        except self.db.errors as exc:
            log.warning("audit_retention_failed", error=type(exc).__name__)
            return 0
        if deleted:
            log.info("audit_retention", deleted=deleted, older_than_days=days)
        return deleted


class AuditOverflow:
    """The overflow way: records that found the audit queue full, held in a second queue
    of the same bound and handed, a batch at a time, to ``spill`` (straight to the spill
    journal, no store in the way) by their own task, so a store slower than the traffic
    neither loses them nor holds up the main queue."""

    def __init__(self, max_queue: int, batch_size: int, spill: Callable[[list[dict[str, Any]]], Awaitable[None]]) -> None:
        self.max_queue = max_queue
        self.batch_size = batch_size
        self._spill = spill
        self._queue: collections.deque[dict[str, Any]] = collections.deque()
        self.taken = 0  # records that took this way (spilled, or lost if the journal refused)
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._closing = False

    def __len__(self) -> int:
        return len(self._queue)

    @property
    def full(self) -> bool:
        return len(self._queue) >= self.max_queue

    def push(self, snap: dict[str, Any]) -> None:
        """Take one record (never blocks; the caller checked :attr:`full`)."""
        self._queue.append(snap)
        self.taken += 1
        if self._wake is not None:
            self._wake.set()

    def start(self) -> None:
        self._wake = asyncio.Event()
        if self._queue:
            self._wake.set()
        self._task = asyncio.create_task(self._run(), name="audit-overflow")

    async def aclose(self) -> None:
        """Spill everything held, then stop the task."""
        self._closing = True
        if self._task is not None:
            assert self._wake is not None
            self._wake.set()
            await self._task

    async def drain(self) -> None:
        while self._queue:
            count = min(len(self._queue), self.batch_size)
            await self._spill([self._queue.popleft() for _ in range(count)])

    async def _run(self) -> None:
        assert self._wake is not None
        while True:
            await self._wake.wait()
            self._wake.clear()
            await self.drain()
            if self._closing:
                return


class AuditWriter:
    """Bounded queue + background batch writer for audit rows (``overflow``: where a full
    queue sends records; ``retention``: the purge of old rows; both started and stopped
    with it)."""

    def __init__(
        self,
        db: Store,
        *,
        retention_days: Callable[[], float] = lambda: 30.0,
        store_bodies: Callable[[], bool] = lambda: False,
        body_max_bytes: Callable[[], int] = lambda: 64 * 1024,
        max_queue: int = 10_000,
        flush_interval: float = 0.05,
        batch_size: int = 200,
        on_drop: Callable[[int], None] | None = None,
        on_write_error: Callable[[int], None] | None = None,
        durable: DurableWriter | None = None,
    ) -> None:
        self.db = db
        #: store, else spill journal (none here: a failed batch is lost and counted)
        self.durable = durable if durable is not None else DurableWriter(db, None, {"audit": _INSERT})
        self.retention = AuditRetention(db, retention_days)
        self.store_bodies = store_bodies
        self.body_max_bytes = body_max_bytes
        self.max_queue = max_queue
        self.flush_interval = flush_interval
        self.batch_size = batch_size
        self.on_drop = on_drop or no_report
        self.on_write_error = on_write_error or no_report
        self.dropped = 0
        self.written = 0  # stored or spilled (replayed later)
        self.write_errors = 0  # lost: neither the store nor the spill journal took them
        self._pending: collections.deque[dict[str, Any]] = collections.deque()
        #: records past ``max_queue``: spilled straight to the journal by their own task
        self.overflow = AuditOverflow(max_queue, batch_size, self._spill_batch)
        self._wake: asyncio.Event | None = None
        self._closed_event: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self._closed = False
        self._in_flight = 0

    @property
    def depth(self) -> int:
        """Records accepted but not yet written (including a batch being written)."""
        return len(self._pending) + self._in_flight + len(self.overflow)

    # -- the hot path ------------------------------------------------------------------

    def submit(self, record: RequestRecord) -> None:
        """Queue a finished record. Never blocks, never does I/O. A full queue sends it
        the overflow way (to the journal); drops (and counts) only past that bound too."""
        if self._closed:
            self._drop("closed")
            return
        if len(self._pending) < self.max_queue:
            self._pending.append(self._snapshot(record))
            if self._wake is not None:
                self._wake.set()
        elif self.durable.journal is not None and not self.overflow.full:
            if not len(self.overflow):
                log.warning("audit_queue_full", queued=len(self._pending), to="spill journal")
            self.overflow.push(self._snapshot(record))
        else:
            self._drop("queue full")

    def _snapshot(self, record: RequestRecord) -> dict[str, Any]:
        snap = snapshot(record)
        if not self.store_bodies():
            snap["bodies"] = None
        return snap

    def _drop(self, why: str) -> None:
        if not self.dropped:
            log.error("audit_records_dropped", why=why, queued=len(self._pending), overflow=len(self.overflow))
        self.dropped += 1
        self.on_drop(1)

    # -- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        """Purge expired rows, then start the writer and the hourly retention task."""
        self._wake = asyncio.Event()
        self._closed_event = asyncio.Event()
        if self._pending:
            self._wake.set()
        await self.retention.start()
        self._task = asyncio.create_task(self._run(), name="audit-writer")
        self.overflow.start()

    async def aclose(self) -> None:
        """Write everything still queued, then stop. Call before the database closes."""
        self._closing = True
        if self._closed_event is not None:
            self._closed_event.set()
        await self.retention.aclose()
        await self.overflow.aclose()
        if self._task is not None:
            assert self._wake is not None
            self._wake.set()
            await self._task
        # never started, or submitted while the tasks wound down: written here, and no
        # await between the last check and closing, so nothing is stranded
        while len(self.overflow) or self._pending:
            await self.overflow.drain()
            await self._write_all()
        self._closed = True

    # -- the writer --------------------------------------------------------------------

    async def _run(self) -> None:
        assert self._wake is not None
        while True:
            await self._wake.wait()
            if not self._pending:
                self._wake.clear()
                if self._closing:
                    return
                continue
            if len(self._pending) < self.batch_size and not self._closing:
                # let a batch build up; a shutdown cuts the wait short
                assert self._closed_event is not None
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.flush_interval):
                        await self._closed_event.wait()
            await self._write_batch()

    async def _write_all(self) -> None:
        while self._pending:
            await self._write_batch()

    async def _spill_batch(self, batch: list[dict[str, Any]]) -> None:
        """One batch of the overflow way, to the journal."""
        self._count(await self._persist(batch, self.durable.spill), len(batch))

    async def _write_batch(self) -> None:
        count = min(len(self._pending), self.batch_size)
        batch = [self._pending.popleft() for _ in range(count)]
        self._in_flight = count
        try:
            outcome = await self._persist(batch, self.durable.write)
        finally:
            self._in_flight = 0
        self._count(outcome, count)

    async def _persist(
        self, batch: list[dict[str, Any]], persist: Callable[[str, list[tuple[Any, ...]]], Awaitable[str]]
    ) -> str:
        """Rows built in a worker thread (bodies capped, secrets masked), then persisted."""
        max_bytes = self.body_max_bytes()

        def rows() -> list[tuple[Any, ...]]:
            out = []
            for record in batch:
                if record.get("bodies") is not None:  # kept by submit() only with audit_bodies
                    record["bodies"] = cap_bodies(record["bodies"], max_bytes)
                out.append(_row(record))
            return out

        try:
            return await persist("audit", await self.durable.offload(rows))  # not the shared executor
        except (ValueError, TypeError) as exc:  # a record that cannot be serialized
            log.error("audit_write_failed", rows=len(batch), error=type(exc).__name__)
            return "lost"

    def _count(self, outcome: str, count: int) -> None:
        if outcome == "lost":
            self.write_errors += count
            self.on_write_error(count)
        else:
            self.written += count
