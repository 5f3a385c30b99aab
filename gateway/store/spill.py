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
:mod:`gateway.store.replay`, the bounded store calls in :mod:`gateway.store.store_calls`,
the appends to the journal (on its thread) in :mod:`gateway.store.journal_writes`, the
store's state and the replays in the background in :mod:`gateway.store.store_recovery`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from gateway.store.db import Store
from gateway.store.journal import MAX_JOURNALS, SPILL_PATTERN, SpillFull, SpillJournal
from gateway.store.journal_writes import SPILL_LOG_INTERVAL, JournalWrites
from gateway.store.replay import Statement, apply_rows
from gateway.store.store_calls import (
    STORE_READ_TIMEOUT,
    STORE_WRITE_MAX,
    STORE_WRITE_TIMEOUT,
    BoundedReads,
    BoundedWrites,
    StoreUnavailable,
)
from gateway.store.store_recovery import StoreRecovery

__all__ = ["MAX_JOURNALS", "SPILL_LOG_INTERVAL", "SPILL_PATTERN", "DurableWriter", "SpillFull", "SpillJournal",
           "StoreUnavailable"]

T = TypeVar("T")


def no_report(*_: Any) -> None:
    """The default of a writer's ``on_*`` count callbacks (a metric's ``inc`` when wired):
    nothing to report to, so every count site can call its callback unconditionally."""


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
        self.journal = journal
        self.statements = statements
        self.write_timeout = write_timeout
        self.on_spilled = on_spilled or no_report
        self.on_lost = on_lost or no_report
        #: the last journal append failed (disk full past the reservation): nothing keeps rows
        self.journal_failing = False
        self.spilled = 0
        self.lost = 0
        # threads of their own: the journal's (gateway/store/journal_writes.py), the store's
        self.journal_writes = JournalWrites(journal, indexed, self._spilled, self._lost, clock)
        self.writes = BoundedWrites(db, write_timeout, write_max)
        self.reads = BoundedReads(db, read_timeout)
        self.recovery = StoreRecovery(db, journal, statements, self.journal_writes, self.writes,
                                      retry_interval=retry_interval, close_bound=max(write_timeout, 2.0),
                                      on_replayed=on_replayed or no_report, on_cleared=self._cleared)

    # the store's state lives in the recovery (it ends an outage); read (and in tests set) here
    @property
    def store_writable(self) -> bool:
        return self.recovery.writable

    @store_writable.setter
    def store_writable(self, writable: bool) -> None:
        self.recovery.writable = writable

    @property
    def store_error(self) -> str | None:
        return self.recovery.error

    @store_error.setter
    def store_error(self, error: str | None) -> None:
        self.recovery.error = error

    @property
    def failing_since(self) -> float | None:
        return self.recovery.failing_since

    @property
    def replayed(self) -> int:
        return self.recovery.replayed

    @property
    def spill_entries(self) -> int:
        return self.journal_writes.entries

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

    async def offload(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` (CPU work on the way to the journal, e.g. building rows) on the
        journal's thread: never queued behind store calls stuck in the shared executor."""
        return await asyncio.shield(self.journal_writes.in_thread(fn))

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
                self.recovery.failed(exc)
        return await self.spill(kind, rows)

    async def spill(self, kind: str, rows: Sequence[Sequence[Any]]) -> str:
        """Straight to the journal (no store in the way): "spilled" or "lost". For rows
        that must not wait on a slow store (the audit queue's overflow); replayed like
        every spill, so they reach the store in the end."""
        if not rows:
            return "spilled"
        return await self.journal_writes.spill(kind, rows)

    def _spilled(self, kind: str, count: int) -> None:
        """The journal took ``count`` rows (on its thread)."""
        self.journal_failing = False
        self.spilled += count
        self.on_spilled(kind, count)

    def _lost(self, kind: str, count: int) -> None:
        """The journal could not take ``count`` rows (on its thread): nothing keeps them."""
        self.journal_failing = True
        self.lost += count
        self.on_lost(kind, count)

    async def spilled_row(self, kind: str, row_id: str) -> list[Any] | None:
        """The row ``row_id`` of ``kind`` while it is in the journal (None: not spilled)."""
        return await self.journal_writes.spilled_row(kind, row_id)

    # -- replaying (gateway/store/store_recovery.py) ------------------------------------------

    async def start(self) -> None:
        """Replay what a previous run spilled, then keep retrying in the background."""
        await self.recovery.start()

    async def recover(self) -> bool:
        """Replay the journal into the store; True when the store took everything."""
        return await self.recovery.recover()

    async def aclose(self) -> None:
        """Stop retrying after one last replay attempt; then the threads."""
        await self.recovery.stop()
        self.journal_writes.close()
        self.writes.close()
        self.reads.close()

    def _cleared(self) -> None:
        self.journal_failing = False
