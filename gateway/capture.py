"""Model-call capture for training harnesses: one JSON line per generation request.

Records go through a bounded queue to a writer thread (off the hot path), which appends
them to ``capture-<seq>.jsonl`` in the capture directory, flushes and ``fsync``s once per
batch (so a crash loses at most the batch being written, never an acknowledged one), and
starts a new file past ``max_bytes``. Records hold the translated upstream body, the
assembled answer and the engine's token data; never a header, and every configured secret
is masked on the way to disk (:mod:`gateway.redact`).
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import structlog

log = structlog.get_logger("gateway.capture")

from gateway.redact import SECRETS

_STOP = object()
BATCH_SECONDS = 0.05


class CaptureWriter:
    """Appends capture records durably; ``close()`` drains everything queued."""

    def __init__(self, directory: Path, max_bytes: int = 256 * 1024 * 1024, queue_size: int = 10_000) -> None:
        self.directory = directory
        self.max_bytes = max_bytes
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=queue_size)
        self.dropped = 0
        self.written = 0
        self.lost = 0  # a write failed (disk full, read-only): logged at ERROR
        self._broken = False
        self._seq = max([_seq_of(p) for p in directory.glob("capture-*.jsonl")] or [0])
        self._file = self._open()
        self._thread = threading.Thread(target=self._run, name="capture-writer", daemon=True)
        self._thread.start()

    def _open(self) -> Any:
        path = self.directory / f"capture-{self._seq:06d}.jsonl"
        if path.exists() and path.stat().st_size >= self.max_bytes:
            self._seq += 1
            path = self.directory / f"capture-{self._seq:06d}.jsonl"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        return os.fdopen(fd, "ab")

    def submit(self, record: dict[str, Any]) -> None:
        """Called on the event loop: never blocks, never does I/O."""
        try:
            self._queue.put_nowait(record)
        except queue.Full:
            self.dropped += 1

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            batch = [item]
            try:
                while len(batch) < 500:
                    batch.append(self._queue.get(timeout=BATCH_SECONDS if item is not _STOP else 0))
            except queue.Empty:
                pass
            stop = any(b is _STOP for b in batch)
            records = [b for b in batch if b is not _STOP]
            try:
                self._write(records)
            except OSError as exc:  # disk full, read-only: count and say so, keep the thread alive
                self._broken = True  # a torn line may be on disk: continue in a new file
                self.lost += len(records)
                log.error("capture_write_failed", records=len(records), error=f"{type(exc).__name__}: {exc}")
            if stop:
                return

    def _write(self, records: list[dict[str, Any]]) -> None:
        if not records:
            return
        if self._broken:
            with contextlib.suppress(OSError):
                self._file.close()
            self._seq += 1
            self._file = self._open()
            self._broken = False
        for record in records:
            self._file.write(SECRETS.mask_bytes(orjson.dumps(record)) + b"\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        self.written += len(records)
        if self._file.tell() >= self.max_bytes:
            self._file.close()
            self._seq += 1
            self._file = self._open()

    def close(self) -> None:
        self._queue.put(_STOP)
        self._thread.join(30)
        with contextlib.suppress(OSError):
            self._file.close()


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
