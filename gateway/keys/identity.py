"""Who a request is: the check of the client key it presents (:func:`check_client_key`), and
the one function that turns its credentials into a client identity, the owner that stored
state and envelopes are bound to.

The identity is stable and not secret (it may go to the store, the audit and logs): with
client keys configured, ``client:`` + the first 16 hex digits of the SHA-256 of the key
the request presented; with none configured, every request is :data:`ANONYMOUS`. Managed
per-user keys (gateway/keys/) are ``key:`` + their key id (a key's secret is never part
of it, so state outlives nothing but the key itself).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence
from typing import Any

from starlette.requests import HTTPConnection

from gateway.errors import GatewayError
from gateway.keys.registry import SCOPE_KEY as MANAGED_SCOPE_KEY
from gateway.keys.registry import KeyRegistry
from gateway.upstream.credential import fingerprint

#: The identity of every request when no client key is configured.
ANONYMOUS = "anonymous"


def presented_key(request: HTTPConnection) -> str:
    """The client key a request presents: ``x-api-key``, else ``Authorization: Bearer``."""
    presented = request.headers.get("x-api-key") or ""
    auth = request.headers.get("authorization") or ""
    if not presented and auth[:7].lower() == "bearer ":
        presented = auth[7:].strip()
    return presented


#: The prefix of a static client key's identity (``--api-key``).
STATIC_KEY_PREFIX = "client:"


def identity_of_key(key: str) -> str:
    return STATIC_KEY_PREFIX + hashlib.sha256(key.encode()).hexdigest()[:16]


def is_static_key_identity(identity: str) -> bool:
    """The identity of a static ``--api-key`` (not a managed key's ``key:``, not anonymous)."""
    return identity.startswith(STATIC_KEY_PREFIX)


def client_identity(request: HTTPConnection, keys: Sequence[Any]) -> str:
    """The identity of a request whose key was already checked (:func:`check_client_key`):
    :data:`ANONYMOUS` when no client key is configured."""
    managed = request.scope.get(MANAGED_SCOPE_KEY)
    if managed is not None:
        return "key:" + managed.key_id
    if not keys:
        return ANONYMOUS
    return identity_of_key(presented_key(request))


def check_client_key(request: HTTPConnection, keys: list[Any], registry: KeyRegistry | None = None) -> str | None:
    """With client keys configured (``--api-key``, or any managed key ever created), the
    request must present one (``Authorization: Bearer`` or ``x-api-key``): a managed key
    is found by its hash in memory (a revoked or expired one: its 401) and rides in the
    scope (``gateway.keys.managed_key``); static keys are compared in constant time.
    Returns the key's fingerprint."""
    managed = registry is not None and registry.exists
    if not keys and not managed:
        return None
    presented = presented_key(request)
    if managed and registry.authenticate(request, presented) is not None:  # type: ignore[union-attr]
        return fingerprint(presented)
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(presented.encode(), key.get_secret_value().encode())
    if not presented or not matched:
        raise GatewayError("authentication", "invalid_api_key", "a valid API key is required (Authorization: Bearer or x-api-key)")
    return fingerprint(presented)
