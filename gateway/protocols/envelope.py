"""The gateway's envelopes: text it hands a client to send back later, authenticated and
encrypted for that client alone (reasoning items' and compaction items'
``encrypted_content``, Gemini thought signatures carried in call ids).

An envelope is AES-256-GCM (``cryptography``) under one key of the store's keyring
(gateway/store/envelope_keys.py: shared by replicas, rotatable), with the field it carries
(``r`` reasoning, ``c`` compaction, ``gts:<call id>`` a thought signature) and the client
identity (gateway/keys/identity.py) as associated data: altered, truncated, forged or sealed for
another client key, it does not open, and a client can neither read it nor move it to
another field or call. The blob is ``version (1) | key number (4) | nonce (12) |
ciphertext + tag (16)``; as ``encrypted_content`` it is ``cb2a2.`` + base64url, in a call
id unpadded base64url (ids stay within ``[A-Za-z0-9_-]``).

Pure: the codec is plain functions over a :class:`Keyring` snapshot; :class:`Tenant` binds
one request's identity to where the current keyring comes from.
"""

from __future__ import annotations

import base64
import binascii
import os
import struct
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from gateway.errors import GatewayError, invalid_request
from gateway.keys.identity import ANONYMOUS

#: ``encrypted_content`` of the envelopes this gateway seals.
PREFIX = "cb2a2."
#: The unencrypted, per-process HMAC envelopes of earlier versions: never opened again.
LEGACY_PREFIX = "cb2a1."

_VERSION = 2
_HEADER = struct.Struct(">BI")  # version, key number
_NONCE = 12
_TAG = 16
_MIN_BLOB = _HEADER.size + _NONCE + _TAG


@dataclass(frozen=True, slots=True)
class EnvelopeKey:
    """One key of the keyring: ``number`` names it in every envelope it sealed; it seals
    from ``active_from`` (Unix seconds) on, until a newer key is active."""

    number: int
    secret: bytes
    active_from: float = 0.0
    created_at: float = 0.0


class Keyring:
    """An immutable snapshot of the keys: the newest active one seals, any of them opens."""

    def __init__(self, keys: Iterable[EnvelopeKey]) -> None:
        self.keys = tuple(sorted(keys, key=lambda k: k.number))
        self._aead = {k.number: AESGCM(k.secret) for k in self.keys}

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled as its keys (the AEAD objects are rebuilt): a body parsed in a worker
        process (gateway/generation/body_parsing.py) opens its envelopes there."""
        return (Keyring, (self.keys,))

    @classmethod
    def generate(cls) -> Keyring:
        """A keyring of one fresh key (unit tests and apps without a store)."""
        return cls([EnvelopeKey(1, AESGCM.generate_key(256))])

    def sealing_key(self, now: float) -> EnvelopeKey:
        active = [k for k in self.keys if k.active_from <= now]
        if not self.keys:
            raise EnvelopeInvalid("no envelope key is loaded")
        return active[-1] if active else self.keys[0]

    def aead(self, number: int) -> AESGCM | None:
        return self._aead.get(number)


class EnvelopeInvalid(Exception):
    """An envelope that does not open; the message says why, in terms safe to show."""


def _aad(header: bytes, field: str, owner: str) -> bytes:
    return b"%s|%s|%s" % (header, field.encode(), owner.encode())


def seal(keyring: Keyring, field: str, owner: str, plaintext: bytes, now: float | None = None) -> bytes:
    """The sealed blob of ``plaintext`` for ``owner``'s ``field``."""
    key = keyring.sealing_key(time.time() if now is None else now)
    header = _HEADER.pack(_VERSION, key.number)
    nonce = os.urandom(_NONCE)
    aead = keyring.aead(key.number)
    assert aead is not None
    return header + nonce + aead.encrypt(nonce, plaintext, _aad(header, field, owner))


def open_sealed(keyring: Keyring, field: str, owner: str, blob: bytes) -> bytes:
    """The plaintext of a blob :func:`seal` made for ``owner``'s ``field``; raises
    :class:`EnvelopeInvalid` otherwise."""
    if len(blob) < _MIN_BLOB:
        raise EnvelopeInvalid("it is truncated")
    version, number = _HEADER.unpack_from(blob)
    if version != _VERSION:
        raise EnvelopeInvalid(f"unknown envelope version {version}")
    aead = keyring.aead(number)
    if aead is None:
        raise EnvelopeInvalid(f"it was sealed with key {number}, which this gateway does not hold (retired or foreign)")
    header, nonce, sealed = blob[: _HEADER.size], blob[_HEADER.size : _HEADER.size + _NONCE], blob[_HEADER.size + _NONCE :]
    try:
        return aead.decrypt(nonce, sealed, _aad(header, field, owner))
    except InvalidTag:
        raise EnvelopeInvalid(
            "its authentication tag does not match (altered, truncated, or sealed for another client key)"
        ) from None


def _b64decode(text: str) -> bytes:
    try:
        return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError):
        raise EnvelopeInvalid("it is not base64url") from None


def _unpadded(blob: bytes) -> str:
    return base64.urlsafe_b64encode(blob).decode().rstrip("=")


def _signature_plaintext(signature: str) -> bytes:
    """A thought signature as bytes: decoded when it is canonical base64 (Gemini's are), so
    the id grows by the envelope's 33 bytes only, not by a third."""
    try:
        raw = base64.b64decode(signature, validate=True)
    except (binascii.Error, ValueError):
        raw = None
    if raw is not None and base64.b64encode(raw).decode() == signature:
        return b"\x01" + raw
    return b"\x00" + signature.encode()


def _signature_text(plaintext: bytes) -> str:
    if plaintext[:1] == b"\x01":
        return base64.b64encode(plaintext[1:]).decode()
    return plaintext[1:].decode()


def invalid_encrypted_content(param: str | None, why: str) -> GatewayError:
    return invalid_request(
        f"this encrypted_content cannot be opened: {why}; send the conversation items instead",
        param=param,
        code="invalid_encrypted_content",
    )


class FixedKeys:
    """One keyring snapshot as a ``Tenant.keys`` callable that pickles (for a worker process)."""

    def __init__(self, keyring: Keyring) -> None:
        self.keyring = keyring

    def __call__(self) -> Keyring:
        return self.keyring


@dataclass(frozen=True, slots=True)
class Tenant:
    """One request's client identity and the keyring its envelopes use (``keys()``: the
    current snapshot, refreshed in the background by the store's ``EnvelopeKeys``)."""

    identity: str
    keys: Callable[[], Keyring]

    def seal(self, field: str, text: str) -> str:
        """``encrypted_content`` carrying ``text``."""
        return PREFIX + _unpadded(seal(self.keys(), field, self.identity, text.encode()))

    def open(self, field: str, value: object, param: str | None = None, legacy: bool = False) -> str | None:
        """The text of a gateway envelope; None when ``value`` is not one (absent, or
        another provider's; with ``legacy``, also an unencrypted ``cb2a1.`` one); a named
        400 when it is one this client cannot open."""
        if not isinstance(value, str):
            return None
        if value.startswith(LEGACY_PREFIX):
            if legacy:
                return None
            raise invalid_encrypted_content(param, "it was sealed by an earlier gateway version without encryption")
        if not value.startswith(PREFIX):
            return None
        try:
            return open_sealed(self.keys(), field, self.identity, _b64decode(value[len(PREFIX) :])).decode()
        except UnicodeDecodeError:
            raise invalid_encrypted_content(param, "its content is not text") from None
        except EnvelopeInvalid as exc:
            raise invalid_encrypted_content(param, str(exc)) from None

    def seal_signature(self, call_id: str, signature: str) -> str:
        """The id-safe token carrying a thought signature of call ``call_id``."""
        return _unpadded(seal(self.keys(), "gts:" + call_id, self.identity, _signature_plaintext(signature)))

    def open_signature(self, call_id: str, token: str) -> str | None:
        """The thought signature a token carries, or None when it does not open for this
        client and call (forged, altered, another client's, or from before envelopes)."""
        try:
            return _signature_text(open_sealed(self.keys(), "gts:" + call_id, self.identity, _b64decode(token)))
        except (EnvelopeInvalid, UnicodeDecodeError):
            return None


#: The keyring of pure uses (unit tests, a room called without a request's tenant): one
#: key per process.
PROCESS_KEYRING = Keyring.generate()

#: The tenant of a request parsed without one (unit tests).
ANONYMOUS_TENANT = Tenant(ANONYMOUS, lambda: PROCESS_KEYRING)
