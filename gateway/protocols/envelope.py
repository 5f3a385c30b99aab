"""The gateway's opaque, signed carrier for text it hands a client to send back later
(reasoning items' and compaction items' ``encrypted_content``).

``cb2a1.<base64 json>.<hmac>``: not secret (the text is the client's own context), but
signed with a per-process key so the gateway can tell its envelopes from anyone else's.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets

import orjson

PREFIX = "cb2a1."
_KEY = secrets.token_bytes(32)  # per process: envelopes from before a restart do not verify


def _mac(payload: str) -> str:
    return hmac.new(_KEY, payload.encode(), hashlib.sha256).hexdigest()[:32]


def seal_envelope(field: str, text: str) -> str:
    payload = base64.urlsafe_b64encode(orjson.dumps({field: text})).decode()
    return f"{PREFIX}{payload}.{_mac(payload)}"


def open_envelope(field: str, value: object, lenient: bool = False) -> str | None:
    """The ``field`` text of an envelope this process sealed, else None; ``lenient``
    also reads a well-formed gateway envelope whose signature does not verify."""
    if not isinstance(value, str) or not value.startswith(PREFIX):
        return None
    payload, _, mac = value[len(PREFIX) :].rpartition(".")
    if not payload or not (hmac.compare_digest(mac, _mac(payload)) or lenient):
        return None
    try:
        text = orjson.loads(base64.urlsafe_b64decode(payload.encode()))[field]
    except (ValueError, KeyError, TypeError):
        return None
    return text if isinstance(text, str) else None
