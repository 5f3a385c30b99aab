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
new rows go straight to the journal (the store is known bad, and order is kept), and a
background task replays the journal every ``retry_interval`` seconds. Replay is an upsert
keyed by the row's id (the audit ``request_id``, the response ``id``), so a replay cut
short and retried still leaves exactly one row per id; the journal is cleared only after
the whole of it is in the store.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import orjson
import structlog

from gateway.store.db import Store

log = structlog.get_logger("gateway.spill")

#: Journal files ``spill-<n>.jsonl``: each process (``--workers``) claims the first one no
#: other process holds (an exclusive ``flock``), so a restarted worker replays its own.
SPILL_PATTERN = "spill-{}.jsonl"
MAX_JOURNALS = 256
#: Rows per transaction when replaying the journal into the store.
REPLAY_BATCH = 500
#: Seconds a store write may take before its rows are spilled instead (a stalled
#: PostgreSQL). The write may still land later: the replay's upsert makes that harmless.
STORE_WRITE_TIMEOUT = 5.0
#: During an outage every write spills: one WARNING line per this many seconds (with what
#: was spilled since the last one), not one per write -- at a few hundred requests a second
#: the log would otherwise flood the very disk that may be the one filling up.
SPILL_LOG_INTERVAL = 10.0
_ZEROS = bytes(1 << 20)


def no_report(*_: Any) -> None:
    """The default of a writer's ``on_*`` count callbacks (a metric's ``inc`` when wired):
    nothing to report to, so every count site can call its callback unconditionally."""


class SpillFull(OSError):
    """The journal is at its bound: the row cannot be kept anywhere."""


class SpillJournal:
    """A bounded, preallocated, append-only JSONL journal (thread-safe; blocking I/O)."""

    def __init__(self, directory: Path, max_bytes: int) -> None:
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.max_bytes = max_bytes
        self.lock = threading.RLock()
        self.path, self._fd = self._claim(directory)
        self.reserved = self._reserve()
        self._end = self._find_end()
        self.entries = self._count()

    @staticmethod
    def _claim(directory: Path) -> tuple[Path, int]:
        for n in range(MAX_JOURNALS):
            path = directory / SPILL_PATTERN.format(n)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            os.chmod(path, 0o600)
            return path, fd
        raise OSError(f"every spill journal in {directory} is held by another process")

    def _reserve(self) -> bool:
        """Claim the journal's whole bound on disk now (False: the disk had no room)."""
        if os.fstat(self._fd).st_size >= self.max_bytes:
            return True
        try:
            os.posix_fallocate(self._fd, 0, self.max_bytes)
            return True
        except OSError as exc:
            log.warning("spill_not_reserved", path=str(self.path), bytes=self.max_bytes, error=os.strerror(exc.errno or 0))
            return False

    def _find_end(self) -> int:
        """Offset after the last complete line; a torn tail (crash mid-write) is zeroed."""
        chunks: list[bytes] = []
        offset = 0
        while True:
            chunk = os.pread(self._fd, 1 << 20, offset)
            nul = chunk.find(b"\0")
            chunks.append(chunk if nul < 0 else chunk[:nul])
            offset += len(chunks[-1])
            if nul >= 0 or not chunk:
                break
        data = b"".join(chunks)
        end = data.rfind(b"\n") + 1
        if end < offset:
            os.pwrite(self._fd, bytes(offset - end), end)
            os.fsync(self._fd)
        self._initial_entries = data.count(b"\n", 0, end)
        return end

    def _count(self) -> int:
        return self._initial_entries

    @property
    def used_bytes(self) -> int:
        return self._end

    def append(self, lines: Sequence[bytes]) -> None:
        """Append one batch and fsync it. Raises :class:`SpillFull` past the bound, or
        the OSError of a failed write (the batch then counts as not spilled)."""
        data = b"".join(line + b"\n" for line in lines)
        with self.lock:
            if self._end + len(data) > self.max_bytes:
                raise SpillFull(f"spill journal full ({self._end} of {self.max_bytes} bytes used)")
            written = os.pwrite(self._fd, data, self._end)
            if written != len(data):
                os.pwrite(self._fd, bytes(written), self._end)  # undo a short write
                raise OSError(f"short write to the spill journal ({written} of {len(data)} bytes)")
            os.fsync(self._fd)
            self._end += len(data)
            self.entries += len(lines)

    def read(self) -> bytes:
        """The journal's complete lines, as written."""
        with self.lock:
            return os.pread(self._fd, self._end, 0) if self._end else b""

    def clear(self) -> None:
        """Zero what was written (the reserved space stays claimed) and start over."""
        with self.lock:
            offset = 0
            while offset < self._end:
                n = min(len(_ZEROS), self._end - offset)
                os.pwrite(self._fd, _ZEROS[:n], offset)
                offset += n
            os.fsync(self._fd)
            self._end = 0
            self.entries = 0

    def close(self) -> None:
        """Close the file (skipped while a replay stalled on the store holds it: the
        process is exiting, and the journal on disk is complete either way)."""
        if self.lock.acquire(timeout=1.0):
            try:
                os.close(self._fd)
            finally:
                self.lock.release()


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
    tuple of that statement's parameters (JSON-serializable). ``on_spilled``/``on_lost``/
    ``on_replayed`` receive (kind, count) for metrics.
    """

    def __init__(
        self,
        db: Store,
        journal: SpillJournal | None,
        statements: dict[str, str],
        *,
        retry_interval: float = 1.0,
        write_timeout: float = STORE_WRITE_TIMEOUT,
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
        self.spilled = 0
        self.lost = 0
        self.replayed = 0
        self._task: asyncio.Task[None] | None = None

    @property
    def spill_entries(self) -> int:
        return self.journal.entries if self.journal is not None else 0

    def status(self) -> dict[str, Any]:
        """For readiness and the status API: is the store writable, what is spilled."""
        return {
            "store_writable": self.store_writable,
            "store_error": self.store_error,
            "failing_since": self.failing_since,
            "spill_entries": self.spill_entries,
            "spill_bytes": self.journal.used_bytes if self.journal is not None else 0,
            "spill_max_bytes": self.journal.max_bytes if self.journal is not None else 0,
            "spill_path": str(self.journal.path) if self.journal is not None else None,
            "spilled": self.spilled,
            "replayed": self.replayed,
            "lost": self.lost,
        }

    # -- writing ---------------------------------------------------------------------------

    async def write(self, kind: str, rows: Sequence[Sequence[Any]]) -> str:
        """Persist ``rows``: "stored", "spilled" or "lost" (the last logged at ERROR)."""
        if not rows:
            return "stored"
        if (self.store_writable or self.journal is None) and not self.spill_entries:
            sql = self.statements[kind]

            def insert(conn: Any) -> None:  # returns nothing: no cursor outlives the store's lock
                conn.executemany(sql, rows)

            write = asyncio.ensure_future(asyncio.to_thread(self.db.run_tx, insert))
            try:
                # shielded: a cancelled caller (shutdown) must not lose a batch half-way to disk
                await asyncio.wait_for(asyncio.shield(write), self.write_timeout)
                return "stored"
            except self.db.errors as exc:
                self._store_failed(exc)
            except TimeoutError:  # still running in its thread; spilled too, replay upserts
                write.add_done_callback(_consume)
                self._store_failed(TimeoutError(f"no answer in {self.write_timeout} s"))
        return await self.spill(kind, rows)

    async def spill(self, kind: str, rows: Sequence[Sequence[Any]]) -> str:
        """Straight to the journal (no store in the way): "spilled" or "lost". For rows
        that must not wait on a slow store (the audit queue's overflow); replayed like
        every spill, so they reach the store in the end."""
        if not rows:
            return "spilled"
        return await asyncio.shield(asyncio.to_thread(self._spill, kind, rows))

    def _store_failed(self, exc: BaseException) -> None:
        if self.store_writable:
            log.error("store_write_failed", error=f"{type(exc).__name__}: {exc}",
                      spill=str(self.journal.path) if self.journal is not None else None)
            self.failing_since = time.time()
        self.store_writable = False
        self.store_error = type(exc).__name__

    def _spill(self, kind: str, rows: Sequence[Sequence[Any]]) -> str:
        count = len(rows)
        try:
            if self.journal is None:
                raise OSError("no spill journal configured")
            self.journal.append([orjson.dumps({"kind": kind, "row": list(r)}, default=str) for r in rows])
        except OSError as exc:
            self.lost += count
            self.on_lost(kind, count)
            log.error("store_records_lost", kind=kind, rows=count, error=f"{type(exc).__name__}: {exc}")
            return "lost"
        self.spilled += count
        self.on_spilled(kind, count)
        due = self._spill_tally.add(kind, count)
        if due is not None:
            log.warning("store_records_spilled", rows=sum(due.values()), by_kind=due,
                        spill_entries=self.spill_entries, next_line_in_s=SPILL_LOG_INTERVAL)
        return "spilled"

    # -- replaying -------------------------------------------------------------------------

    async def start(self) -> None:
        """Replay what a previous run spilled, then keep retrying in the background."""
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
                await asyncio.wait_for(self.recover(), self.write_timeout)
            except TimeoutError:
                log.warning("spill_kept_for_next_start", spill_entries=self.spill_entries)

    async def _recovery_loop(self) -> None:
        while True:
            await asyncio.sleep(self.retry_interval)
            if self.spill_entries or not self.store_writable:
                await self.recover()

    async def recover(self) -> bool:
        """Replay the journal into the store; True when the store took everything."""
        try:
            replayed = await asyncio.shield(asyncio.to_thread(self._replay))
        except (*self.db.errors, OSError) as exc:
            self._store_failed(exc)
            return False
        if not self.store_writable:
            log.info("store_recovered", replayed=sum(replayed.values()),
                     outage_s=round(time.time() - (self.failing_since or time.time()), 1))
        self.store_writable, self.store_error, self.failing_since = True, None, None
        for kind, count in replayed.items():
            self.replayed += count
            self.on_replayed(kind, count)
        return True

    def _replay(self) -> dict[str, int]:
        """Blocking: every journal row into the store (in order, in batches), then clear.
        With nothing spilled, one cheap write proves the store takes writes again."""
        counts: dict[str, int] = {}
        if self.journal is None or not self.journal.entries:
            if not self.store_writable:
                self.db.run_tx(_probe)
            return counts
        with self.journal.lock:  # appends wait (in their worker threads) until cleared
            batch: list[tuple[str, list[Any]]] = []
            for line in self.journal.read().splitlines():
                entry = orjson.loads(line)
                if entry.get("kind") not in self.statements:
                    log.error("spill_entry_unknown", kind=entry.get("kind"))
                    continue
                batch.append((entry["kind"], entry["row"]))
                if len(batch) >= REPLAY_BATCH:
                    self._apply(batch, counts)
                    batch = []
            self._apply(batch, counts)
            self.journal.clear()
        return counts

    def _apply(self, batch: list[tuple[str, list[Any]]], counts: dict[str, int]) -> None:
        if not batch:
            return

        def run(conn: Any) -> None:
            for kind, row in batch:
                conn.execute(self.statements[kind], row)

        self.db.run_tx(run)
        for kind, _ in batch:
            counts[kind] = counts.get(kind, 0) + 1


def _consume(future: asyncio.Future[Any]) -> None:
    """A timed-out store write finished after all: retrieve its outcome (no warning)."""
    if not future.cancelled():
        future.exception()


def _probe(conn: Any) -> None:
    """A real write (a row inserted and deleted in one transaction: the commit still has
    pages to write), to learn whether the store takes writes again."""
    conn.execute(
        "INSERT INTO audit (request_id, started_at, ended_at, protocol, mode, streamed, model, outcome,"
        " http_status, record) VALUES (?, 0, 0, '', '', 0, '', '', 0, ?)",
        (PROBE_ID, "x" * 4096),
    )
    conn.execute("DELETE FROM audit WHERE request_id = ?", (PROBE_ID,))


PROBE_ID = "__codebuddy2api_write_probe__"
