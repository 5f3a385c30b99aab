"""Rows into the spill journal, on a thread of the journal's own.

:class:`JournalWrites` is the journal's side of the :class:`~gateway.store.spill.DurableWriter`:
it appends rows (``fsync``'d before they count as spilled) and says which were spilled and
which lost, keeps spilled responses findable by id (:class:`~gateway.store.replay.SpillIndex`),
and logs an outage's spills once per :data:`SPILL_LOG_INTERVAL`, not once per write. All of
it runs on one thread of its own: a store stuck in every thread of asyncio's shared executor
must never hold up a spill.

Its own module so that :mod:`gateway.store.spill` holds only the way rows reach the store
(store first, journal second) and the way back (the replay): that module imports this one,
never the reverse; what is counted goes back through the ``on_spilled``/``on_lost`` callbacks.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import orjson
import structlog

from gateway.store.journal import SpillJournal
from gateway.store.replay import SpillIndex

log = structlog.get_logger("gateway.spill")
T = TypeVar("T")

#: During an outage every write spills: one WARNING line per this many seconds (with what
#: was spilled since the last one), not one per write -- at a few hundred requests a second
#: the log would otherwise flood the very disk that may be the one filling up.
SPILL_LOG_INTERVAL = 10.0


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


class JournalWrites:
    """Appends to one journal (None: every row is lost) on its own thread. ``on_spilled``
    and ``on_lost`` get (kind, count) on that thread, right after each append."""

    def __init__(
        self,
        journal: SpillJournal | None,
        indexed: frozenset[str],
        on_spilled: Callable[[str, int], None],
        on_lost: Callable[[str, int], None],
        clock: Callable[[], float],
    ) -> None:
        self.journal = journal
        self.on_spilled = on_spilled
        self.on_lost = on_lost
        self.index = SpillIndex(journal, indexed)
        self._tally = SpillTally(SPILL_LOG_INTERVAL, clock)
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="spill-journal")

    @property
    def entries(self) -> int:
        return self.journal.entries if self.journal is not None else 0

    async def in_thread(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the journal's thread."""
        return await asyncio.get_running_loop().run_in_executor(self._thread, functools.partial(fn, *args))

    async def spill(self, kind: str, rows: Sequence[Sequence[Any]]) -> str:
        """Append ``rows``: "spilled" or "lost"; shielded (a cancelled caller does not stop
        an append half-way, and it is counted either way)."""
        return await asyncio.shield(self.in_thread(self._append, kind, rows))

    def _append(self, kind: str, rows: Sequence[Sequence[Any]]) -> str:
        count = len(rows)
        lines = [orjson.dumps({"kind": kind, "row": list(r)}, default=str) for r in rows]
        try:
            if self.journal is None:
                raise OSError("no spill journal configured")
            start = self.journal.append(lines)
        except OSError as exc:
            self.on_lost(kind, count)
            log.error("store_records_lost", kind=kind, rows=count, error=f"{type(exc).__name__}: {exc}")
            return "lost"
        self.index.add(kind, rows, lines, start)
        self.on_spilled(kind, count)
        due = self._tally.add(kind, count)
        if due is not None:
            log.warning("store_records_spilled", rows=sum(due.values()), by_kind=due,
                        spill_entries=self.entries, next_line_in_s=SPILL_LOG_INTERVAL)
        return "spilled"

    async def spilled_row(self, kind: str, row_id: str) -> list[Any] | None:
        """The row ``row_id`` of ``kind`` while it is in the journal (None: not spilled)."""
        if (kind, row_id) not in self.index:  # the common case: a dict look-up, no thread
            return None
        return await self.in_thread(self.index.read, kind, row_id)

    def close(self) -> None:
        self._thread.shutdown(wait=False)
