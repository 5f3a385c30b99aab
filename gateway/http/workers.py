"""``serve --workers N``: the parent process that keeps N workers running.

uvicorn's own supervisor stops the whole gateway (exit status 0) the first time a
replacement fails its start-up, e.g. a worker SIGKILLed while the SQLite file was
write-locked, whose replacement then failed its start-up write. :class:`WorkerSupervisor`
keeps uvicorn's supervisor and changes what a death leads to:

- a worker that fails to start is started again after a backoff (1 s, doubling up to
  30 s) instead of stopping the parent; after ``--worker-restart-attempts`` failures in a
  row of one worker the parent gives up, stops the others and the CLI exits 1 with one
  line (systemd's ``Restart=on-failure`` then takes over);
- a worker that served and died is replaced at once (as before);
- every dead worker's live gauges leave the prometheus multiprocess directory
  (``multiprocess.mark_process_dead`` and its other ``gauge_*_<pid>.db`` files), so
  in-flight, store-writable and the other gauges stay true; its counters stay (a total
  never goes backwards);
- when the whole gateway stops, the shared listening socket takes no new connection
  (``listeners.refuse_new_connections``) and the parent closes its own copy; each worker,
  which has kept accepting since its own signal until it sees that (at most
  ``listeners.WORKER_GRACE``), takes what is still queued before it closes its copy
  (gateway/http/listeners.py), and the last close leaves nothing queued to reset. uvicorn's
  parent kept its copy open until every worker had exited, so a client connecting during
  the drain (up to ``--shutdown-timeout``) was queued there, never served, then reset.
"""

from __future__ import annotations

import glob
import logging
import os
import time
from socket import socket

from prometheus_client import multiprocess
from uvicorn.config import STARTUP_FAILURE, Config
from uvicorn.supervisors.multiprocess import Multiprocess, Process

from gateway.http.listeners import refuse_new_connections

logger = logging.getLogger("uvicorn.error")

FIRST_BACKOFF, MAX_BACKOFF = 1.0, 30.0


def backoff(failures: int) -> float:
    """Seconds before the next start after ``failures`` failed starts in a row."""
    return min(MAX_BACKOFF, FIRST_BACKOFF * 2 ** max(0, failures - 1))


def forget_worker(pid: int | None, directory: str | None = None) -> list[str]:
    """Remove a dead worker's gauge files from the multiprocess directory (names removed)."""
    path = directory or os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if pid is None or not path:
        return []
    multiprocess.mark_process_dead(pid, path)  # type: ignore[no-untyped-call]
    removed = []
    for name in glob.glob(os.path.join(path, f"gauge_*_{pid}.db")):
        try:
            os.remove(name)
            removed.append(name)
        except FileNotFoundError:
            continue
    return removed


class WorkerSupervisor(Multiprocess):
    """uvicorn's Multiprocess with retried, bounded replacements (see the module docstring)."""

    def __init__(self, config: Config, sockets: list[socket], restart_attempts: int) -> None:
        super().__init__(config, sockets)
        self.restart_attempts = restart_attempts
        self.failures: dict[int, int] = {}  # worker slot -> failed starts in a row
        self.retry_at: dict[int, float] = {}  # worker slot -> when its next start is due
        self.gave_up: str | None = None  # the one line the CLI prints before exit 1

    def _start(self, idx: int) -> None:
        process = Process(self.config, self.sockets)
        process.start()
        self.processes[idx] = process

    def keep_subprocess_alive(self) -> None:
        if self.should_exit.is_set():
            return
        now = time.monotonic()
        for idx, process in enumerate(self.processes):
            if idx in self.retry_at:
                if now >= self.retry_at[idx] and not self.should_exit.is_set():
                    del self.retry_at[idx]
                    self._start(idx)
                continue
            started = process._healthcheck(self.config.timeout_worker_healthcheck) if process.process.is_alive() else None
            if started is True:
                self.failures.pop(idx, None)  # it serves: its next death starts a fresh count
                continue
            if started is False:  # alive, still starting
                continue
            process.kill()  # dead, or hung: gone either way
            process.join()
            forget_worker(process.pid)
            if self.should_exit.is_set():
                return
            if process.exitcode == STARTUP_FAILURE or idx in self.failures:
                failures = self.failures[idx] = self.failures.get(idx, 0) + 1
                if failures > self.restart_attempts:
                    self.gave_up = (f"worker {idx + 1} of {len(self.processes)} failed to start {failures} time(s) in a row"
                                    f" (last exit status {process.exitcode}); giving up")
                    logger.error(self.gave_up)
                    self.should_exit.set()
                    return
                pause = backoff(failures)
                logger.error(f"Child process [{process.pid}] failed to start (exit status {process.exitcode});"
                             f" starting it again in {pause:g} s (attempt {failures} of {self.restart_attempts})")
                self.retry_at[idx] = now + pause
                continue
            logger.info(f"Child process [{process.pid}] died (exit status {process.exitcode}); replacing it")
            self.failures[idx] = 0  # its replacement's start-up failures are counted from here
            self._start(idx)

    def terminate_all(self) -> None:
        """The whole gateway stops (see the module docstring): no new connection, the workers
        told, the parent's copy of the listening socket closed (it starts no worker now)."""
        for sock in self.sockets:
            refuse_new_connections(sock)
        super().terminate_all()
        for sock in self.sockets:
            sock.close()

    def join_all(self) -> None:
        super().join_all()
        for process in self.processes:
            forget_worker(process.pid)
