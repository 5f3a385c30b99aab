"""Whether the store takes writes, and the way back into it for what was spilled.

:class:`StoreRecovery` is the replaying side of the :class:`~gateway.store.spill.DurableWriter`:
a failed store write marks the store bad (:meth:`StoreRecovery.failed`, logged once per
outage); the journal is replayed into the store at start-up (what a previous run spilled),
every ``retry_interval`` seconds while anything is spilled or the store is known bad, and
once more, bounded, at shutdown. The first batch the store takes, or a probe write when
nothing is spilled, ends the outage. One replay's work is
:class:`~gateway.store.replay.JournalReplay`; it runs on the store's write threads.

Its own module so that :mod:`gateway.store.spill` holds only the way rows reach the store
(store first, journal second): that module imports this one, never the reverse.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import structlog

from gateway.store.db import Store
from gateway.store.journal import SpillJournal
from gateway.store.journal_writes import JournalWrites
from gateway.store.replay import JournalReplay, Statement, probe_write
from gateway.store.store_calls import BoundedWrites
from gateway.tasks import stop_tasks

log = structlog.get_logger("gateway.spill")


class StoreRecovery:
    """The store's state (writable, the error, since when) and the replays that restore it.
    ``on_replayed`` receives (kind, count) for metrics; ``on_cleared`` runs once the whole
    journal is in the store (under the journal's lock)."""

    def __init__(
        self,
        db: Store,
        journal: SpillJournal | None,
        statements: dict[str, Statement],
        journal_writes: JournalWrites,
        writes: BoundedWrites,
        *,
        retry_interval: float,
        close_bound: float,
        on_replayed: Callable[[str, int], None],
        on_cleared: Callable[[], None],
    ) -> None:
        self.db = db
        self.journal = journal
        self.journal_writes = journal_writes
        self.writes = writes
        self.retry_interval = retry_interval
        self.close_bound = close_bound  # the last replay at shutdown (what stays is replayed next start)
        self.on_replayed = on_replayed
        self.writable = True
        self.error: str | None = None
        self.failing_since: float | None = None
        self.replayed = 0
        self._task: asyncio.Task[None] | None = None
        self._replay = (JournalReplay(db, journal, statements, journal_writes.index, self._batch_stored, on_cleared)
                        if journal is not None else None)

    @property
    def pending(self) -> bool:
        """Something waits in the journal, or the store is known bad: a replay is due."""
        return bool(self.journal_writes.entries) or not self.writable

    def failed(self, exc: BaseException) -> None:
        """A store write or replay failed: the store is bad until a replay succeeds."""
        if self.writable:
            log.error("store_write_failed", error=f"{type(exc).__name__}: {exc}",
                      spill=str(self.journal.path) if self.journal is not None else None)
            self.failing_since = time.time()
        self.writable = False
        self.error = type(exc).__name__

    async def start(self) -> None:
        """Replay what a previous run spilled, then keep retrying in the background."""
        await self.journal_writes.in_thread(self.journal_writes.index.rebuild)
        await self.recover()
        self._task = asyncio.create_task(self._loop(), name="spill-recovery")

    async def stop(self) -> None:
        """Stop retrying; one last replay attempt (what stays spilled is replayed next start)."""
        await stop_tasks(self._task)
        self._task = None
        if self.pending:
            try:  # bounded: a stalled store must not hold the exit (the journal stays for next time)
                async with asyncio.timeout(self.close_bound):
                    await self.recover()
            except TimeoutError:
                log.warning("spill_kept_for_next_start", spill_entries=self.journal_writes.entries)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.retry_interval)
            if self.journal is not None and not self.journal.reserved:
                await self.journal_writes.in_thread(self.journal.retry_reserve)
            if self.pending:
                await self.recover()

    async def recover(self) -> bool:
        """Replay the journal into the store; True when the store took everything."""
        was_writable = self.writable
        try:
            replayed = await asyncio.shield(self.writes.in_thread(self._run_replay, not was_writable))
        except (*self.db.errors, OSError) as exc:
            self.failed(exc)
            return False
        if not was_writable:
            log.info("store_recovered", replayed=sum(replayed.values()),
                     outage_s=round(time.time() - (self.failing_since or time.time()), 1))
        self.writable, self.error, self.failing_since = True, None, None
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
        self.writable = True  # new rows may go to the store again while the rest replays
