"""Who a request is: the one function that turns a request's credentials into a client
identity, the owner that stored state and envelopes are bound to.

The identity is stable and not secret (it may go to the store, the audit and logs): with
client keys configured, ``client:`` + the first 16 hex digits of the SHA-256 of the key
the request presented; with none configured, every request is :data:`ANONYMOUS`. Managed
per-user keys (gateway/keys/) are ``key:`` + their key id (a key's secret is never part
of it, so state outlives nothing but the key itself).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

from starlette.requests import HTTPConnection

from gateway.keys.registry import SCOPE_KEY as MANAGED_SCOPE_KEY

#: The identity of every request when no client key is configured.
ANONYMOUS = "anonymous"


def presented_key(request: HTTPConnection) -> str:
    """The client key a request presents: ``x-api-key``, else ``Authorization: Bearer``."""
    presented = request.headers.get("x-api-key") or ""
    auth = request.headers.get("authorization") or ""
    if not presented and auth[:7].lower() == "bearer ":
        presented = auth[7:].strip()
    return presented


def identity_of_key(key: str) -> str:
    return "client:" + hashlib.sha256(key.encode()).hexdigest()[:16]


def client_identity(request: HTTPConnection, keys: Sequence[Any]) -> str:
    """The identity of a request whose key was already checked (``relay.check_client_key``):
    :data:`ANONYMOUS` when no client key is configured."""
    managed = request.scope.get(MANAGED_SCOPE_KEY)
    if managed is not None:
        return "key:" + managed.key_id
    if not keys:
        return ANONYMOUS
    return identity_of_key(presented_key(request))
