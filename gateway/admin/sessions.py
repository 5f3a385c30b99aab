"""The admin session epoch: what makes logout revoke every session cookie, on every worker
and replica.

A session cookie is signed over its expiry and the epoch current when it was issued; it is
valid only while that epoch is still current. ``POST /admin/logout`` draws a new random
epoch and saves it in the store (the saved-settings table, key :data:`EPOCH_KEY`, through
the same revisioned writer as the admin API), so every process that shares the store sees
it with its next settings revision poll: within ~100 ms on SQLite, ~250 ms on PostgreSQL
(:mod:`gateway.store.saved_settings`); the process that logged out, at once. A random value rather than a counter, so that no
later state of the store can bring an old epoch back.
"""

from __future__ import annotations

import asyncio
import secrets
from typing import Any

EPOCH_KEY = "admin_session_epoch"
#: How many times a logout retries a write that raced another settings write.
WRITE_ATTEMPTS = 5


class SessionEpoch:
    """The current epoch, read from the saved layer when its revision moves."""

    def __init__(self, saved: Any) -> None:  # gateway.store.saved_settings.SavedSettings, or None
        self.saved = saved
        self._revision = -1
        self._epoch = ""

    def current(self) -> str:
        """The epoch now (reads the store only when the settings revision changed)."""
        if self.saved is None:
            return self._epoch
        revision = self.saved.revision()
        if revision != self._revision:
            revision, values = self.saved.load()
            self._revision, self._epoch = revision, str(values.get(EPOCH_KEY) or "")
        return self._epoch

    async def revoke(self, actor: str) -> str:
        """A new epoch (every cookie issued before is invalid from now on), saved off the
        event loop."""
        epoch = secrets.token_hex(8)
        if self.saved is None:
            self._epoch = epoch
            return epoch
        await asyncio.to_thread(self._write, epoch, actor)
        self._revision = -1  # read back on the next check
        return epoch

    def _write(self, epoch: str, actor: str) -> None:
        from gateway.store.saved_settings import StaleRevision

        for attempt in range(WRITE_ATTEMPTS):
            try:
                self.saved.write(self.saved.load()[0], {EPOCH_KEY: epoch}, [], actor)
                return
            except StaleRevision:
                if attempt == WRITE_ATTEMPTS - 1:
                    raise
