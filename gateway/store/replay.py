"""The spill journal back into the store, and spilled rows found by id meanwhile.

:class:`JournalReplay` copies every journal line into the store (in order, in batches of
:data:`REPLAY_BATCH`, each an idempotent upsert keyed by the row's id), then clears the
journal, but only once the whole of it is in the store: a replay cut short and retried still
leaves exactly one row per id. The journal's lock is held only to read and to clear it, never
while the store works, so appends go on during a replay stuck on the store.

:class:`SpillIndex` keeps where each spilled row of an indexed kind (stored responses) sits
in the journal, so ``previous_response_id`` finds a response that has not reached the store
yet, also after a restart (the index is rebuilt from the journal a previous run left).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from typing import Any

import orjson
import structlog

from gateway.store.db import Store
from gateway.store.journal import SpillJournal

log = structlog.get_logger("gateway.spill")

#: What applies one kind of row: an upsert's SQL, or a callable (connection, rows).
Statement = str | Callable[[Any, Sequence[Sequence[Any]]], None]

#: Rows per transaction when replaying the journal into the store.
REPLAY_BATCH = 500
#: Passes one replay makes to catch up with rows spilled while it ran.
REPLAY_PASSES = 8
#: The id of the row :func:`probe_write` inserts and deletes.
PROBE_ID = "__codebuddy2api_write_probe__"


def apply_rows(conn: Any, statement: Statement, rows: Sequence[Sequence[Any]]) -> None:
    """One kind's rows in the caller's transaction: its SQL for each, or its callable."""
    if isinstance(statement, str):
        conn.executemany(statement, rows)
    else:
        statement(conn, rows)


def probe_write(conn: Any) -> None:
    """A real write (a row inserted and deleted in one transaction: the commit still has
    pages to write), to learn whether the store takes writes again."""
    conn.execute(
        "INSERT INTO audit (request_id, started_at, ended_at, protocol, mode, streamed, model, outcome,"
        " http_status, record) VALUES (?, 0, 0, '', '', 0, '', '', 0, ?)",
        (PROBE_ID, "x" * 4096),
    )
    conn.execute("DELETE FROM audit WHERE request_id = ?", (PROBE_ID,))


class SpillIndex:
    """(kind, row id) -> (offset, length) of its line in the journal, for ``kinds`` only.
    Written by the journal's thread (appends, rebuild) and cleared under the journal's lock."""

    def __init__(self, journal: SpillJournal | None, kinds: frozenset[str]) -> None:
        self.journal = journal
        self.kinds = kinds
        self._places: dict[tuple[str, str], tuple[int, int]] = {}

    def __contains__(self, key: tuple[str, str]) -> bool:
        return key in self._places

    def add(self, kind: str, rows: Sequence[Sequence[Any]], lines: Sequence[bytes], start: int) -> None:
        """Rows just appended at ``start`` (one line each, newline-separated)."""
        if kind not in self.kinds:
            return
        for row, line in zip(rows, lines, strict=True):
            self._places[(kind, str(row[0]))] = (start, len(line))
            start += len(line) + 1

    def clear(self) -> None:
        self._places.clear()

    def rebuild(self) -> None:
        """Blocking: index the journal a previous run left."""
        if self.journal is None or not self.kinds:
            return
        data, _ = self.journal.read_from(0)
        offset = 0
        for line in data.split(b"\n"):
            if line:
                with contextlib.suppress(orjson.JSONDecodeError, TypeError, AttributeError, IndexError):
                    entry = orjson.loads(line)
                    if entry.get("kind") in self.kinds:
                        self._places[(entry["kind"], str(entry["row"][0]))] = (offset, len(line))
            offset += len(line) + 1

    def read(self, kind: str, row_id: str) -> list[Any] | None:
        """Blocking: the spilled row, or None (not spilled, or cleared meanwhile)."""
        place = self._places.get((kind, row_id))
        if place is None or self.journal is None:
            return None
        line = self.journal.read_at(*place)
        try:
            entry = orjson.loads(line)
        except orjson.JSONDecodeError:  # cleared meanwhile: the store has it now
            return None
        row = entry.get("row") if isinstance(entry, dict) else None
        if entry.get("kind") != kind or not isinstance(row, list) or not row or str(row[0]) != row_id:
            return None
        return row


class JournalReplay:
    """Blocking replays of one journal into one store (see the module docstring).
    ``on_batch_stored`` runs after each batch's commit: the store takes writes again."""

    def __init__(
        self,
        db: Store,
        journal: SpillJournal,
        statements: dict[str, Statement],
        index: SpillIndex,
        on_batch_stored: Callable[[], None],
        on_cleared: Callable[[], None],
    ) -> None:
        self.db = db
        self.journal = journal
        self.statements = statements
        self.index = index
        self.on_batch_stored = on_batch_stored
        self.on_cleared = on_cleared
        self._lock = threading.Lock()
        self._replayed_to = 0  # journal offset this replay has stored (until a clear)

    def run(self, probe: bool) -> dict[str, int]:
        """Every journal row into the store, then clear; rows replayed per kind. With
        nothing spilled and ``probe``, one cheap write proves the store takes writes again."""
        counts: dict[str, int] = {}
        with self._lock:
            if not self.journal.entries:
                if probe:
                    self.db.run_tx(probe_write)
                return counts
            for _ in range(REPLAY_PASSES):
                data, end = self.journal.read_from(self._replayed_to)
                batch: list[tuple[str, list[Any]]] = []
                for line in data.splitlines():
                    entry = orjson.loads(line)
                    if entry.get("kind") not in self.statements:
                        log.error("spill_entry_unknown", kind=entry.get("kind"))
                        continue
                    batch.append((entry["kind"], entry["row"]))
                    if len(batch) >= REPLAY_BATCH:
                        self._apply(batch, counts)
                        batch = []
                self._apply(batch, counts)
                self._replayed_to = end
                if self.journal.clear_if(end, self._cleared):
                    return counts
            return counts  # still catching up: the rest next time (nothing is lost meanwhile)

    def _cleared(self) -> None:
        """Under the journal's lock, as it is cleared: its lines are all in the store."""
        self.index.clear()
        self._replayed_to = 0
        self.on_cleared()

    def _apply(self, batch: list[tuple[str, list[Any]]], counts: dict[str, int]) -> None:
        if not batch:
            return

        def run(conn: Any) -> None:
            for kind, row in batch:
                apply_rows(conn, self.statements[kind], [row])

        self.db.run_tx(run)
        self.on_batch_stored()
        for kind, _ in batch:
            counts[kind] = counts.get(kind, 0) + 1
