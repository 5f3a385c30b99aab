"""Model-call capture for training harnesses: one JSON line per generation request.

Records go through a bounded queue to a writer thread (off the hot path), which appends
them to ``capture-<seq>.jsonl`` in the capture directory, flushes and ``fsync``s once per
batch (so a crash loses at most the batch being written, never an acknowledged one), and
starts a new file past ``max_bytes``. Records hold the translated upstream body, the
assembled answer and the engine's token data; never a header, and every configured secret
is masked on the way to disk (:mod:`gateway.redact`).

A failed write (disk full, read-only) loses nothing at once: the file is cut back to where
the batch began (no half line, no line twice), the batch's lines are held in memory (up to
``hold_max_bytes``) and written again every :data:`RETRY_SECONDS`; a file that cannot be
cut back is left for a new one (its torn last line is skipped by readers). Only what does
not fit the hold, or is still held when the writer closes, is lost: counted, logged at ERROR.
"""

from __future__ import annotations

import collections
import contextlib
import os
import queue
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import orjson
import structlog

from gateway.redact import SECRETS

log = structlog.get_logger("gateway.capture")

_STOP = object()
BATCH_SECONDS = 0.05
#: While lines are held after a failed write, how often the writer tries again.
RETRY_SECONDS = 1.0


def open_append(path: Path) -> BinaryIO:
    """The capture file, created 0600, opened for appending."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    return os.fdopen(fd, "ab", buffering=0)  # unbuffered: nothing left to flush after a failure


class CaptureWriter:
    """Appends capture records durably; ``close()`` drains everything queued.

    ``on_written`` / ``on_dropped`` / ``on_lost`` receive record counts (called from the
    writer thread, or from ``submit`` for drops) for metrics; ``open_file`` is the seam a
    test uses to make the disk fail.
    """

    def __init__(
        self,
        directory: Path,
        max_bytes: int = 256 * 1024 * 1024,
        queue_size: int = 10_000,
        *,
        hold_max_bytes: int = 64 * 1024 * 1024,
        on_written: Callable[[int], None] | None = None,
        on_dropped: Callable[[int], None] | None = None,
        on_lost: Callable[[int], None] | None = None,
        open_file: Callable[[Path], BinaryIO] = open_append,
    ) -> None:
        self.directory = directory
        self.max_bytes = max_bytes
        self.hold_max_bytes = hold_max_bytes
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=queue_size)
        self._on_written, self._on_dropped, self._on_lost = on_written, on_dropped, on_lost
        self._open_file = open_file
        self.dropped = 0  # the queue was full
        self.written = 0
        self.lost = 0  # did not fit the hold after a failed write, or still held at close
        #: lines a failed write left, oldest first, waiting for the next try
        self._held: collections.deque[bytes] = collections.deque()
        self._held_bytes = 0
        self._failing = False  # since the last failed write (logged once per outage)
        self._broken = False  # the current file may end in a torn line: start a new one
        self._seq = max([_seq_of(p) for p in directory.glob("capture-*.jsonl")] or [0])
        self._file: BinaryIO | None = None
        self._thread = threading.Thread(target=self._run, name="capture-writer", daemon=True)
        self._thread.start()

    @property
    def held(self) -> int:
        """Records waiting for the disk to take writes again."""
        return len(self._held)

    def submit(self, record: dict[str, Any]) -> None:
        """Called on the event loop: never blocks, never does I/O."""
        try:
            self._queue.put_nowait(record)
        except queue.Full:
            self.dropped += 1
            if self._on_dropped is not None:
                self._on_dropped(1)

    # -- the writer thread -------------------------------------------------------------

    def _run(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=RETRY_SECONDS if self._held else None)
            except queue.Empty:  # quiet, with lines held: try them again
                self._flush_held([])
                continue
            batch = [item]
            try:
                while len(batch) < 500:
                    batch.append(self._queue.get(timeout=BATCH_SECONDS if item is not _STOP else 0))
            except queue.Empty:
                pass
            stop = any(b is _STOP for b in batch)
            lines = [SECRETS.mask_bytes(orjson.dumps(b, default=str)) + b"\n" for b in batch if b is not _STOP]
            self._flush_held(lines)
            if stop:
                self._lose(len(self._held), "still held at shutdown")
                self._close_file()
                return

    def _flush_held(self, lines: list[bytes]) -> None:
        """Write what is held, then ``lines``; on failure hold them all (within the bound).

        ``held`` changes in one step, after the write's outcome is known (a reader on another
        thread never sees lines counted as held that are about to be lost)."""
        pending = [*self._held, *lines]
        if not pending:
            return
        try:
            self._write(pending)
        except OSError as exc:  # disk full, read-only: keep the lines, try again later
            if not self._failing:
                log.error("capture_write_failed", held=len(pending), error=f"{type(exc).__name__}: {exc}")
            self._failing = True
            kept: collections.deque[bytes] = collections.deque()
            kept_bytes = 0
            for line in reversed(pending):  # the newest lines are kept
                if kept_bytes + len(line) > self.hold_max_bytes:
                    break
                kept.appendleft(line)
                kept_bytes += len(line)
            self._held, self._held_bytes = kept, kept_bytes
            self._lose(len(pending) - len(kept), "the hold is full")
            return
        if self._failing:
            log.info("capture_write_recovered", written=len(pending))
        self._failing = False
        self._held = collections.deque()
        self._held_bytes = 0
        self.written += len(pending)
        if self._on_written is not None:
            self._on_written(len(pending))

    def _lose(self, count: int, why: str) -> None:
        if not count:
            return
        self.lost += count
        if self._on_lost is not None:
            self._on_lost(count)
        log.error("capture_records_lost", records=count, why=why)

    def _write(self, lines: list[bytes]) -> None:
        """Append ``lines`` and fsync; on failure cut the file back to where they began."""
        if self._file is None or self._broken:
            self._close_file()
            if self._broken:
                self._seq += 1
                self._broken = False
            self._file = self._open()
        f = self._file
        began = os.fstat(f.fileno()).st_size
        payload = b"".join(lines)
        try:
            rest = memoryview(payload)
            while rest:
                rest = rest[f.write(rest):]  # an unbuffered write may take part of it
            os.fsync(f.fileno())
        except OSError:
            try:
                os.ftruncate(f.fileno(), began)
            except OSError:
                self._broken = True
            raise
        if began + len(payload) >= self.max_bytes:
            self._close_file()
            self._seq += 1

    def _open(self) -> BinaryIO:
        path = self.directory / f"capture-{self._seq:06d}.jsonl"
        if path.exists() and path.stat().st_size >= self.max_bytes:
            self._seq += 1
            path = self.directory / f"capture-{self._seq:06d}.jsonl"
        return self._open_file(path)

    def _close_file(self) -> None:
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()
            self._file = None

    def close(self) -> None:
        """Drain the queue, try the held lines once more, stop the thread."""
        self._queue.put(_STOP)
        self._thread.join(30)


def _seq_of(path: Path) -> int:
    try:
        return int(path.stem.split("-", 1)[1])
    except (IndexError, ValueError):
        return 0


def read_records(directory: Path) -> Iterator[dict[str, Any]]:
    """Every complete record in the directory, file by file; a torn last line is skipped."""
    for path in sorted(directory.glob("capture-*.jsonl"), key=_seq_of):
        with path.open("rb") as f:
            for line in f:
                if line.endswith(b"\n"):
                    yield orjson.loads(line)


def export_rollout(directory: Path, rollout_id: str) -> list[dict[str, Any]]:
    """A rollout's records in the order its calls started."""
    records = [r for r in read_records(directory) if r.get("rollout_id") == rollout_id]
    return sorted(records, key=lambda r: (r.get("started_at") or 0, r.get("request_id") or ""))
