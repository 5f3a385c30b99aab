"""Who may call ``/v1``, said the same way by the banner and ``/admin/api/status``.

The rule lives in :func:`gateway.keys.identity.check_client_key`: once any managed key was
ever created (revoked ones included), every ``/v1`` request needs a key, on a loopback
bind too. An operator who created one key on the Keys page must not read
``no client key (loopback bind only)``: :class:`ClientAuth` is the pure summary of that
rule, built from the static keys and the managed keys in memory.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from gateway.keys.model import ManagedKey


@dataclass(frozen=True, slots=True)
class ClientAuth:
    """How many keys of each kind there are, and so whether ``/v1`` needs one."""

    static_keys: int
    managed_keys: int
    usable_managed_keys: int
    allow_open: bool

    @classmethod
    def of(cls, static_keys: int, managed: Iterable[ManagedKey], allow_open: bool, now: float) -> ClientAuth:
        managed = list(managed)
        usable = sum(1 for key in managed if key.refusal(now) is None)
        return cls(static_keys, len(managed), usable, allow_open)

    @property
    def key_required(self) -> bool:
        """Whether every /v1 request must present a key (loopback included)."""
        return self.static_keys > 0 or self.managed_keys > 0

    @property
    def locked(self) -> bool:
        """Keys are required, yet none can pass: every /v1 request is a 401."""
        return self.key_required and self.static_keys == 0 and self.usable_managed_keys == 0

    def summary(self) -> str:
        """The banner's ``clients`` line."""
        if self.managed_keys:
            kinds = f"{self.managed_keys} managed key(s) ({self.usable_managed_keys} usable)"
            if self.static_keys:
                kinds = f"{self.static_keys} static + {kinds}"
            if self.locked:
                return (f"{kinds}: every /v1 request needs a key, loopback too, and none is usable"
                        " (revoked or expired): create one on the WebUI Keys page")
            return f"{kinds}: every /v1 request needs a key, loopback too"
        if self.static_keys:
            return f"{self.static_keys} client key(s) required"
        if self.allow_open:
            return "OPEN: no client key, any address (--allow-open)"
        return "no client key (loopback bind only)"

    def public(self) -> dict[str, Any]:
        """The status API's form (counts only: never a key)."""
        return {
            "key_required": self.key_required,
            "locked": self.locked,
            "static_keys": self.static_keys,
            "managed_keys": self.managed_keys,
            "usable_managed_keys": self.usable_managed_keys,
            "allow_open": self.allow_open and not self.key_required,
            "summary": self.summary(),
        }
