"""The envelope keyring kept in the store (table ``envelope_keys``, migration 8), so every
replica on one store seals and opens the same envelopes, across restarts.

Loaded once at start-up (before the app serves; the first replica creates key 1, and
replicas racing to create it agree on the one row that won), then refreshed by a
background task every :data:`REFRESH_SECONDS`: a request only ever reads the in-memory
snapshot (``keys()``), never the store. :meth:`EnvelopeKeys.rotate` adds the next key,
active :data:`ACTIVATION_DELAY` seconds later by default, so every replica has loaded it
before any replica seals with it; older keys keep opening their envelopes until
:data:`RETIRED_KEY_SECONDS` after their successor became active, then they are deleted.
"""

from __future__ import annotations

import secrets
import time
from typing import Any

import structlog

from gateway.protocols.envelope import EnvelopeKey, Keyring
from gateway.store.db import Store
from gateway.store.refresher import Refresher

log = structlog.get_logger("gateway.envelope_keys")

REFRESH_SECONDS = 30.0
#: A rotated key seals only after this delay: two refreshes, so every replica knows it.
ACTIVATION_DELAY = 2 * REFRESH_SECONDS
#: How long a superseded key still opens envelopes (Codex sessions are resumed for weeks).
RETIRED_KEY_SECONDS = 30 * 86400.0

_INSERT = "INSERT INTO envelope_keys (key_number, secret, created_at, active_from) VALUES (?, ?, ?, ?) ON CONFLICT (key_number) DO NOTHING"
_SELECT = "SELECT key_number, secret, created_at, active_from FROM envelope_keys ORDER BY key_number"


def _keys(rows: list[Any]) -> list[EnvelopeKey]:
    return [EnvelopeKey(int(n), bytes.fromhex(s), float(a), float(c)) for n, s, c, a in rows]


def _retired(keys: list[EnvelopeKey], now: float) -> list[int]:
    """Keys whose successor has been active for longer than the retention."""
    active = [k for k in keys if k.active_from <= now - RETIRED_KEY_SECONDS]
    newest_old = active[-1].number if active else None
    return [k.number for k in keys if newest_old is not None and k.number < newest_old]


class EnvelopeKeys:
    """The keyring of one store; ``keys()`` is the current snapshot (no I/O)."""

    def __init__(self, db: Store) -> None:
        self.db = db
        self.current = Keyring([])
        self._refresher = Refresher("envelope-keys", self.refresh, REFRESH_SECONDS, REFRESH_SECONDS)

    def __call__(self) -> Keyring:
        return self.current

    def load(self) -> Keyring:
        """Blocking: at start-up, before serving (key 1 created on an empty store, retired
        keys deleted)."""

        def run(conn: Any) -> list[Any]:
            now = time.time()
            conn.execute(_INSERT, (1, secrets.token_hex(32), now, 0.0))
            keys = _keys(conn.execute(_SELECT).fetchall())
            for number in _retired(keys, now):
                conn.execute("DELETE FROM envelope_keys WHERE key_number = ?", (number,))
            return conn.execute(_SELECT).fetchall()

        self.current = Keyring(_keys(self.db.run_tx(run)))
        return self.current

    async def refresh(self) -> Keyring:
        """Adopt what other replicas added (off the loop, in the store's worker thread)."""
        rows = await self.db.aexecute(_SELECT)
        if rows:
            self.current = Keyring(_keys(rows))
        return self.current

    async def rotate(self, activate_in: float = ACTIVATION_DELAY) -> EnvelopeKey:
        """Add the next key, sealing from ``activate_in`` seconds on; returns it."""

        def run(conn: Any) -> list[Any]:
            now = time.time()
            newest = conn.execute("SELECT MAX(key_number) FROM envelope_keys").fetchone()[0] or 0
            conn.execute(_INSERT, (int(newest) + 1, secrets.token_hex(32), now, now + activate_in))
            return conn.execute(_SELECT).fetchall()

        rows = await self.db.acall(self.db.run_tx, run)
        self.current = Keyring(_keys(rows))
        log.warning("envelope_key_rotated", key_number=self.current.keys[-1].number, active_in_s=activate_in)
        return self.current.keys[-1]

    def status(self) -> list[dict[str, Any]]:
        """The keys as the admin API shows them (numbers and times, never the secrets)."""
        now = time.time()
        sealing = self.current.sealing_key(now).number if self.current.keys else None
        return [
            {"key_number": k.number, "created_at": k.created_at, "active_from": k.active_from, "sealing": k.number == sealing}
            for k in self.current.keys
        ]

    async def start(self) -> None:
        await self._refresher.start()

    async def aclose(self) -> None:
        await self._refresher.aclose()
