"""Rows the store could not write go to a local spill journal, and back into the store
when it recovers: an audit record or a stored response is never silently lost.

:class:`SpillJournal` is one append-only JSONL file (``spill.jsonl``, mode 0600) whose
space is reserved up front (``posix_fallocate`` to its bound), so a disk that fills up
after start-up still has room for the journal: the store fails first, the journal keeps
taking rows. Unused space is zero bytes; the end of the journal is the first NUL (JSON
never contains one: orjson escapes it). Every batch is ``fsync``'d before it counts as
spilled. Past its bound the journal refuses, and only then is a row counted lost.

:class:`DurableWriter` is the one way rows reach the store: ``write(kind, rows)`` tries
the store (in a worker thread) and falls back to the journal; while anything is spilled,
while the store is known bad, new rows go straight to the journal, and a background task
replays the journal every ``retry_interval`` seconds. Replay is an upsert keyed by the
row's id (the audit ``request_id``, the response ``id``), so a replay cut short and
retried still leaves exactly one row per id (order between ids does not matter); the
journal is cleared only after the whole of it is in the store.

Nothing here waits on a slow store while holding what a spill needs: a store write that
has not answered within ``write_timeout`` (0.5 s) spills; journal appends run on their own
thread (never queued behind blocked store calls in asyncio's shared executor), store
writes on theirs. The replay and the index of spilled rows live in
:mod:`gateway.store.replay`, the bounded store calls in :mod:`gateway.store.store_calls`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import orjson
import structlog

from gateway.store.store_calls import (
    STORE_READ_TIMEOUT,
    STORE_WRITE_MAX,
    STORE_WRITE_TIMEOUT,
    BoundedReads,
    BoundedWrites,
    StoreUnavailable,
)
from gateway.store.db import Store
from gateway.store.journal import MAX_JOURNALS, SPILL_PATTERN, SpillFull, SpillJournal
from gateway.store.replay import JournalReplay, SpillIndex, Statement, apply_rows, probe_write

__all__ = ["MAX_JOURNALS", "SPILL_PATTERN", "DurableWriter", "SpillFull", "SpillJournal", "StoreUnavailable"]

log = structlog.get_logger("gateway.spill")
T = TypeVar("T")

#: During an outage every write spills: one WARNING line per this many seconds (with what
#: was spilled since the last one), not one per write -- at a few hundred requests a second
#: the log would otherwise flood the very disk that may be the one filling up.
SPILL_LOG_INTERVAL = 10.0


def no_report(*_: Any) -> None:
    """The default of a writer's ``on_*`` count callbacks (a metric's ``inc`` when wired):
    nothing to report to, so every count site can call its callback unconditionally."""


class SpillTally:
    """Rows spilled per kind since the last log line; says when the next line is due.
    Thread-safe: spills run in worker threads."""

    def __init__(self, interval: float, clock: Callable[[], float]) -> None:
        self.interval = interval
        self.clock = clock
        self._lock = threading.Lock()
        self._since: dict[str, int] = {}
        self._last: float | None = None

    def add(self, kind: str, count: int) -> dict[str, int] | None:
        """Count ``count`` rows; the counts to log now (and reset), or None (not yet due)."""
        with self._lock:
            self._since[kind] = self._since.get(kind, 0) + count
            now = self.clock()
            if self._last is not None and now - self._last < self.interval:
                return None
            self._last, due, self._since = now, self._since, {}
            return due


class DurableWriter:
    """Store first, spill journal second, lost last (see the module docstring).

    ``statements`` maps a row kind ("audit", "response") to its upsert SQL; a row is the
    tuple of that statement's parameters (JSON-serializable), its first value the row's
    id. A statement may instead be a callable ``(connection, rows)`` that applies a batch
    in the transaction it is handed (it must be idempotent per row id, like an upsert).
    ``indexed`` kinds are kept findable by id while spilled (:meth:`spilled_row`).
    ``on_spilled``/``on_lost``/``on_replayed`` receive (kind, count) for metrics.
    """

    def __init__(
        self,
        db: Store,
        journal: SpillJournal | None,
        statements: dict[str, Statement],
        *,
        retry_interval: float = 1.0,
        write_timeout: float = STORE_WRITE_TIMEOUT,
        write_max: float = STORE_WRITE_MAX,
        read_timeout: float = STORE_READ_TIMEOUT,
        indexed: frozenset[str] = frozenset({"response", "owned_response"}),
        on_spilled: Callable[[str, int], None] | None = None,
        on_lost: Callable[[str, int], None] | None = None,
        on_replayed: Callable[[str, int], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.db = db
        self._spill_tally = SpillTally(SPILL_LOG_INTERVAL, clock)
        self.journal = journal
        self.statements = statements
        self.retry_interval = retry_interval
        self.write_timeout = write_timeout
        self.on_spilled = on_spilled or no_report
        self.on_lost = on_lost or no_report
        self.on_replayed = on_replayed or no_report
        self.store_writable = True
        self.store_error: str | None = None
        self.failing_since: float | None = None
        #: the last journal append failed (disk full past the reservation): nothing keeps rows
        self.journal_failing = False
        self.spilled = 0
        self.lost = 0
        self.replayed = 0
        self._task: asyncio.Task[None] | None = None
        # own threads: a store stuck in every thread of asyncio's shared executor must not
        # hold up a spill (the journal's one thread)
        self._journal_thread = ThreadPoolExecutor(1, thread_name_prefix="spill-journal")
        self.writes = BoundedWrites(db, write_timeout, write_max)
        self.reads = BoundedReads(db, read_timeout)
        self.index = SpillIndex(journal, indexed)
        self._replay = (JournalReplay(db, journal, statements, self.index, self._batch_stored, self._cleared)
                        if journal is not None else None)

    @property
    def spill_entries(self) -> int:
        return self.journal.entries if self.journal is not None else 0

    def unrecordable(self) -> str | None:
        """Why a finished request's record could not be kept now, or None when it can.
        An unreserved journal is no safety net (the disk it would need may be gone the
        moment the store fails), so it counts as unrecordable on its own."""
        journal = self.journal
        if journal is None:
            return None if self.store_writable else "the store cannot write and there is no spill journal"
        if not journal.reserved:
            return (f"the spill journal could not reserve its {journal.max_bytes} bytes in {journal.path.parent}"
                    f" ({journal.reserve_error or 'no space'})")
        if not self.store_writable and (self.journal_failing or journal.used_bytes >= journal.max_bytes * 0.98):
            return "the store cannot write and the spill journal is full"
        return None

    def status(self) -> dict[str, Any]:
        """For readiness and the status API: is the store writable, what is spilled."""
        journal = self.journal
        return {
            "store_writable": self.store_writable,
            "store_error": self.store_error,
            "failing_since": self.failing_since,
            "spill_entries": self.spill_entries,
            "spill_bytes": journal.used_bytes if journal is not None else 0,
            "spill_max_bytes": journal.max_bytes if journal is not None else 0,
            "spill_path": str(journal.path) if journal is not None else None,
            "spill_reserved": journal.reserved if journal is not None else False,
            "spill_reserve_error": journal.reserve_error if journal is not None else None,
            "journal_failing": self.journal_failing,
            "unrecordable": self.unrecordable(),
            "spilled": self.spilled,
            "replayed": self.replayed,
            "lost": self.lost,
        }

    async def _in(self, pool: ThreadPoolExecutor, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(pool, functools.partial(fn, *args))

    async def offload(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` (CPU work on the way to the journal, e.g. building rows) on the
        journal's thread: never queued behind store calls stuck in the shared executor."""
        return await asyncio.shield(self._in(self._journal_thread, fn))

    async def read(self, fn: Callable[[Any], T]) -> T:
        """A store read for the request path (:class:`~gateway.store.bounded_reads.BoundedReads`)."""
        return await self.reads.read(fn)

    # -- writing ---------------------------------------------------------------------------

    async def write(self, kind: str, rows: Sequence[Sequence[Any]]) -> str:
        """Persist ``rows``: "stored", "spilled" or "lost" (the last logged at ERROR).
        Never waits on the store past ``write_timeout``."""
        if not rows:
            return "stored"
        if self.store_writable or self.journal is None:
            statement = self.statements[kind]

            def insert(conn: Any) -> None:  # returns nothing: no cursor outlives the store's lock
                apply_rows(conn, statement, rows)

            try:
                await self.writes.run(insert)
                return "stored"
            except (*self.db.errors, TimeoutError) as exc:  # a timed-out write may still land: replay upserts
                self._store_failed(exc)
        return await self.spill(kind, rows)

    async def spill(self, kind: str, rows: Sequence[Sequence[Any]]) -> str:
        """Straight to the journal (no store in the way): "spilled" or "lost". For rows
        that must not wait on a slow store (the audit queue's overflow); replayed like
        every spill, so they reach the store in the end."""
        if not rows:
            return "spilled"
        return await asyncio.shield(self._in(self._journal_thread, self._spill, kind, rows))

    def _store_failed(self, exc: BaseException) -> None:
        if self.store_writable:
            log.error("store_write_failed", error=f"{type(exc).__name__}: {exc}",
                      spill=str(self.journal.path) if self.journal is not None else None)
            self.failing_since = time.time()
        self.store_writable = False
        self.store_error = type(exc).__name__

    def _spill(self, kind: str, rows: Sequence[Sequence[Any]]) -> str:
        count = len(rows)
        lines = [orjson.dumps({"kind": kind, "row": list(r)}, default=str) for r in rows]
        try:
            if self.journal is None:
                raise OSError("no spill journal configured")
            start = self.journal.append(lines)
        except OSError as exc:
            self.journal_failing = True
            self.lost += count
            self.on_lost(kind, count)
            log.error("store_records_lost", kind=kind, rows=count, error=f"{type(exc).__name__}: {exc}")
            return "lost"
        self.journal_failing = False
        self.index.add(kind, rows, lines, start)
        self.spilled += count
        self.on_spilled(kind, count)
        due = self._spill_tally.add(kind, count)
        if due is not None:
            log.warning("store_records_spilled", rows=sum(due.values()), by_kind=due,
                        spill_entries=self.spill_entries, next_line_in_s=SPILL_LOG_INTERVAL)
        return "spilled"

    async def spilled_row(self, kind: str, row_id: str) -> list[Any] | None:
        """The row ``row_id`` of ``kind`` while it is in the journal (None: not spilled)."""
        if (kind, row_id) not in self.index:  # the common case: a dict look-up, no thread
            return None
        return await self._in(self._journal_thread, self.index.read, kind, row_id)

    # -- replaying -------------------------------------------------------------------------

    async def start(self) -> None:
        """Replay what a previous run spilled, then keep retrying in the background."""
        await self._in(self._journal_thread, self.index.rebuild)
        await self.recover()
        self._task = asyncio.create_task(self._recovery_loop(), name="spill-recovery")

    async def aclose(self) -> None:
        """Stop retrying; one last replay attempt (what stays spilled is replayed next start)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self.spill_entries or not self.store_writable:
            try:  # bounded: a stalled store must not hold the exit (the journal stays for next time)
                async with asyncio.timeout(max(self.write_timeout, 2.0)):
                    await self.recover()
            except TimeoutError:
                log.warning("spill_kept_for_next_start", spill_entries=self.spill_entries)
        self._journal_thread.shutdown(wait=False)
        self.writes.close()
        self.reads.close()

    async def _recovery_loop(self) -> None:
        while True:
            await asyncio.sleep(self.retry_interval)
            if self.journal is not None and not self.journal.reserved:
                await self._in(self._journal_thread, self.journal.retry_reserve)
            if self.spill_entries or not self.store_writable:
                await self.recover()

    async def recover(self) -> bool:
        """Replay the journal into the store; True when the store took everything."""
        was_writable = self.store_writable
        try:
            replayed = await asyncio.shield(self.writes.in_thread(self._run_replay, not was_writable))
        except (*self.db.errors, OSError) as exc:
            self._store_failed(exc)
            return False
        if not was_writable:
            log.info("store_recovered", replayed=sum(replayed.values()),
                     outage_s=round(time.time() - (self.failing_since or time.time()), 1))
        self.store_writable, self.store_error, self.failing_since = True, None, None
        for kind, count in replayed.items():
            self.replayed += count
            self.on_replayed(kind, count)
        return True

    def _run_replay(self, probe: bool) -> dict[str, int]:
        if self._replay is not None:
            return self._replay.run(probe)
        if probe:  # no journal: one cheap write proves the store takes writes again
            self.db.run_tx(probe_write)
        return {}

    def _batch_stored(self) -> None:
        self.writes.last_progress = time.monotonic()
        self.store_writable = True  # new rows may go to the store again while the rest replays

    def _cleared(self) -> None:
        self.journal_failing = False
