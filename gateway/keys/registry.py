"""The managed keys in memory: the request path authenticates against this snapshot and
never waits on the store. A background task reloads it every :data:`REFRESH_SECONDS`,
so a key revoked (or changed) through any replica is in force on every other one within
two seconds; the replica that made the change applies it at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import structlog
from starlette.requests import HTTPConnection

from gateway.keys import store
from gateway.keys.model import KEY_PREFIX, ManagedKey, hash_secret
from gateway.store.db import Store
from gateway.store.refresher import Refresher

log = structlog.get_logger("gateway.keys")

REFRESH_SECONDS = 1.0
#: Where a request's managed key rides, once authenticated (``managed_key(request)``).
SCOPE_KEY = "codebuddy2api.managed_key"
#: Where a revoked or expired key rides once refused: its audit record still names it.
REFUSED_SCOPE_KEY = "codebuddy2api.refused_key"


def managed_key(request: HTTPConnection) -> ManagedKey | None:
    """The managed key a request was authenticated with (None: a static key, or none)."""
    return request.scope.get(SCOPE_KEY)


def named_key(request: HTTPConnection) -> ManagedKey | None:
    """The managed key a request presented, authenticated or refused (for its record)."""
    return request.scope.get(SCOPE_KEY) or request.scope.get(REFUSED_SCOPE_KEY)


class KeyRegistry:
    """Every managed key of one store, by the hash of its secret (revoked ones included:
    their requests get the 401 that says so)."""

    def __init__(self, db: Store, refresh_seconds: float = REFRESH_SECONDS) -> None:
        self.db = db
        self.refresh_seconds = refresh_seconds
        self._by_hash: dict[str, ManagedKey] = {}
        self._by_id: dict[str, ManagedKey] = {}
        self._refresher = Refresher("client-keys", self.refresh, refresh_seconds, 5 * refresh_seconds)
        #: told the managed key names after each load (metrics label values)
        self.on_load: Callable[[list[ManagedKey]], None] | None = None

    @property
    def exists(self) -> bool:
        """Whether any key was ever created: then every /v1 request needs a key (revoking
        the last key must not open the gateway)."""
        return bool(self._by_id)

    def keys(self) -> list[ManagedKey]:
        return list(self._by_id.values())

    def get(self, key_id: str) -> ManagedKey | None:
        return self._by_id.get(key_id)

    def lookup(self, presented: str) -> ManagedKey | None:
        """The key whose secret was presented (by its SHA-256: nothing secret is compared
        byte by byte), else None."""
        if not presented.startswith(KEY_PREFIX):
            return None
        return self._by_hash.get(hash_secret(presented))

    def authenticate(self, request: HTTPConnection, presented: str, now: float | None = None) -> ManagedKey | None:
        """The managed key presented (raising its 401 if revoked or expired), put in the
        request's scope; None when the secret is no managed key's."""
        key = self.lookup(presented)
        if key is None:
            return None
        refused = key.refusal(time.time() if now is None else now)
        if refused is not None:
            request.scope[REFUSED_SCOPE_KEY] = key
            raise refused
        request.scope[SCOPE_KEY] = key
        return key

    def put(self, key: ManagedKey) -> None:
        """Apply a change made on this replica now (others see it at their next load)."""
        old = self._by_id.get(key.key_id)
        by_hash = dict(self._by_hash)
        if old is not None:
            by_hash.pop(old.secret_hash, None)
        by_hash[key.secret_hash] = key
        self._by_hash = by_hash
        self._by_id = {**self._by_id, key.key_id: key}
        self._loaded()

    def replace(self, keys: list[ManagedKey]) -> None:
        self._by_hash = {k.secret_hash: k for k in keys}
        self._by_id = {k.key_id: k for k in keys}
        self._loaded()

    def _loaded(self) -> None:
        if self.on_load is not None:
            self.on_load(self.keys())

    def load(self) -> None:
        """Blocking: at start-up, before the app serves."""
        self.replace(store.load_all(self.db))

    async def refresh(self) -> None:
        self.replace(await self.db.acall(store.load_all, self.db))

    async def start(self) -> None:
        await self._refresher.start()

    async def aclose(self) -> None:
        await self._refresher.aclose()
