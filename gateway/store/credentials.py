"""Credential health (disabled, cooldowns) and admin-added credentials, in the store.

Writes are tiny and rare (a failure or an admin action); from a running gateway they go
through :class:`CredentialStateWriter`, one background task that writes the latest state
of each credential in a worker thread, so no request waits on a slow or stopped store
(the pool's memory is the truth meanwhile). On SQLite the file is mode 0600, and keys never leave the store through any API. Each
state row carries a version bumped by every write: replicas polling the table apply a row
only when it is newer than the one they last wrote or read, so an old poll result never
undoes a newer local change.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import orjson
import structlog

from gateway.store.db import Store, upsert
from gateway.tasks import stop_tasks

log = structlog.get_logger("gateway.credentials")

_ADD = upsert("credentials", ("credential_id", "upstream", "base_url", "api_key", "created_at", "label"), "credential_id")


class AddedCredential(NamedTuple):
    """A credential added through the admin API, as the store keeps it."""

    credential_id: str
    upstream: str
    base_url: str
    api_key: str | None
    label: str | None = None  # the operator's name for it (migration 11; older rows: None)


class CredentialState:
    """Persists :class:`~gateway.upstream.pool.Credential` state across restarts and replicas."""

    def __init__(self, db: Store) -> None:
        self.db = db

    def load(self) -> dict[str, dict[str, Any]]:
        return {cid: state for cid, (_, state) in self.load_versions().items()}

    def load_versions(self) -> dict[str, tuple[int, dict[str, Any]]]:
        """credential id -> (version, state) for every stored row."""
        rows = self.db.execute("SELECT credential_id, version, state FROM credential_state")
        return {cid: (int(version), orjson.loads(state)) for cid, version, state in rows}

    def save(self, credential_id: str, state: dict[str, Any]) -> int:
        """Replace the credential's state; returns the row's new version."""
        rows = self.db.execute(
            "INSERT INTO credential_state (credential_id, state, updated_at, version) VALUES (?, ?, ?, 1) "
            "ON CONFLICT (credential_id) DO UPDATE SET state = excluded.state, "
            "updated_at = excluded.updated_at, version = credential_state.version + 1 RETURNING version",
            (credential_id, orjson.dumps(state).decode(), time.time()),
        )
        return int(rows[0][0])

    def added_credentials(self) -> list[AddedCredential]:
        """The credentials added through the admin API, oldest first."""
        return [AddedCredential(*r) for r in self.db.execute(
            "SELECT credential_id, upstream, base_url, api_key, label FROM credentials ORDER BY created_at"
        )]

    def add_credential(self, credential_id: str, upstream: str, base_url: str, api_key: str | None,
                       label: str | None = None) -> None:
        self.db.execute(_ADD, (credential_id, upstream, base_url, api_key, time.time(), label))

    def forget_added(self, credential_id: str) -> None:
        """Drop an admin-added row the configuration now holds too (its learned state stays:
        the configured credential may carry the same id)."""
        self.db.execute("DELETE FROM credentials WHERE credential_id = ?", (credential_id,))

    def delete_credential(self, credential_id: str) -> None:
        """Forget an admin-added credential (its key) and its learned state."""
        self.db.execute("DELETE FROM credentials WHERE credential_id = ?", (credential_id,))
        self.db.execute("DELETE FROM credential_state WHERE credential_id = ?", (credential_id,))


class CredentialStateWriter:
    """Credential state saves off the request path: ``submit`` (on the event loop, no I/O)
    keeps the latest state per credential; one task writes them in a worker thread and
    reports each stored version through ``on_saved``. A failed write is retried after
    ``retry_interval`` (unless a newer state for that credential arrived meanwhile)."""

    def __init__(
        self, state: CredentialState, on_saved: Callable[[str, int], None] = lambda cid, v: None,
        retry_interval: float = 1.0,
    ) -> None:
        self.state = state
        self.on_saved = on_saved
        self.retry_interval = retry_interval
        self._pending: dict[str, dict[str, Any]] = {}
        #: credential ids with a write queued or running (replica polls must not undo them)
        self.busy: set[str] = set()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.failures = 0
        self.written = 0

    @property
    def depth(self) -> int:
        return len(self._pending)

    def submit(self, credential_id: str, state: dict[str, Any]) -> None:
        self._pending[credential_id] = state
        self.busy.add(credential_id)
        self._wake.set()

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="credential-state-writer")

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            if not await self.flush():
                await asyncio.sleep(self.retry_interval)
                self._wake.set()

    async def flush(self) -> bool:
        """Write everything pending; False when a write failed (it stays pending)."""
        ok = True
        while self._pending:
            credential_id, state = next(iter(self._pending.items()))
            del self._pending[credential_id]
            try:
                version = await self.state.db.acall(self.state.save, credential_id, state)
            except self.state.db.errors as exc:
                self._pending.setdefault(credential_id, state)  # a newer state wins
                if ok and not self.failures:
                    log.warning("credential_state_not_saved", credential=credential_id, error=type(exc).__name__)
                self.failures += 1
                return False
            self.written += 1
            self.failures = 0
            if credential_id not in self._pending:
                self.busy.discard(credential_id)
            self.on_saved(credential_id, version)
        return ok

    async def aclose(self, timeout: float = 5.0) -> None:
        """Stop the task and write what is still pending (bounded by ``timeout``)."""
        await stop_tasks(self._task)
        if self._pending:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self.flush()
        if self._pending:
            log.warning("credential_state_unsaved_at_exit", credentials=len(self._pending))


#: The name this class had when SQLite was the only backend.
SqliteCredentialState = CredentialState
