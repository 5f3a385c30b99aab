"""The spill journal: one bounded, preallocated, append-only JSONL file per process,
where rows the store cannot take wait (see :mod:`gateway.store.spill` for how it is used).

Its whole bound is reserved up front (``posix_fallocate``), so a disk that fills up after
start-up still has room for it; a reservation that failed is retried (:meth:`retry_reserve`)
and, until it holds, the gateway refuses what it could not record (gateway/generation/recording_gate.py).
Unused space is zero bytes; the end of the journal is the first NUL (JSON never contains
one: orjson escapes it). Every batch is ``fsync``'d before it counts as spilled.
"""

from __future__ import annotations

import fcntl
import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import structlog

log = structlog.get_logger("gateway.spill")

#: Journal files ``spill-<n>.jsonl``: each process (``--workers``) claims the first one no
#: other process holds (an exclusive ``flock``), so a restarted worker replays its own.
SPILL_PATTERN = "spill-{}.jsonl"
MAX_JOURNALS = 256
_ZEROS = bytes(1 << 20)


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

    def _reserve(self, quiet: bool = False) -> bool:
        """Claim the journal's whole bound on disk now (False: the disk had no room)."""
        size = os.fstat(self._fd).st_size
        if size >= self.max_bytes:
            return True
        try:
            os.posix_fallocate(self._fd, 0, self.max_bytes)
            return True
        except OSError as exc:
            # a partial allocation (ext4 keeps what it got) would take the store's last bytes
            os.ftruncate(self._fd, size)
            self.reserve_error = os.strerror(exc.errno or 0)
            if not quiet:
                log.warning("spill_not_reserved", path=str(self.path), bytes=self.max_bytes, error=self.reserve_error)
            return False

    reserve_error: str | None = None

    def retry_reserve(self) -> bool:
        """Try the reservation again (space may have come back); True once it holds."""
        if not self.reserved:
            with self.lock:
                self.reserved = self._reserve(quiet=True)
                if self.reserved:
                    self.reserve_error = None
                    log.info("spill_reserved", path=str(self.path), bytes=self.max_bytes)
        return self.reserved

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

    def append(self, lines: Sequence[bytes]) -> int:
        """Append one batch and fsync it; returns the offset it starts at. Raises
        :class:`SpillFull` past the bound, or the OSError of a failed write (the batch then
        counts as not spilled)."""
        data = b"".join(line + b"\n" for line in lines)
        with self.lock:
            if self._end + len(data) > self.max_bytes:
                raise SpillFull(f"spill journal full ({self._end} of {self.max_bytes} bytes used)")
            written = os.pwrite(self._fd, data, self._end)
            if written != len(data):
                os.pwrite(self._fd, bytes(written), self._end)  # undo a short write
                raise OSError(f"short write to the spill journal ({written} of {len(data)} bytes)")
            os.fsync(self._fd)
            start = self._end
            self._end += len(data)
            self.entries += len(lines)
            return start

    def read(self) -> bytes:
        """The journal's complete lines, as written."""
        return self.read_from(0)[0]

    def read_from(self, offset: int) -> tuple[bytes, int]:
        """The complete lines from ``offset`` on, and the end they reach (a short lock:
        appends wait only for this read, never for what the caller does with it)."""
        with self.lock:
            end = self._end
            return (os.pread(self._fd, end - offset, offset) if end > offset else b""), end

    def read_at(self, offset: int, length: int) -> bytes:
        with self.lock:
            return os.pread(self._fd, length, offset) if offset + length <= self._end else b""

    def clear_if(self, end: int, on_clear: Callable[[], None] | None = None) -> bool:
        """Clear the journal if nothing was appended past ``end`` (what a replay took);
        ``on_clear`` runs under the lock with it (an index of lines dropped with them)."""
        with self.lock:
            if self._end != end:
                return False
            self.clear()
            if on_clear is not None:
                on_clear()
            return True

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
