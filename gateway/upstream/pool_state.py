"""CredentialStateSync: the pool's learned credential state, kept in step with the store.

What the pool learns (disabled, why and by whom, cooldowns) lives on each
:class:`~gateway.upstream.credential.Credential` in memory, which is the truth on the request
path. This class is the pool's one way to and from the store: it restores that state at
start-up, hands each change to the background writer (or writes it itself when there is
none), and adopts what other replicas stored, going by the row versions it has last
written or read so a stale row never undoes a newer change of ours.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol

import structlog

if TYPE_CHECKING:
    from gateway.upstream.credential import Credential

log = structlog.get_logger("gateway.pool")


class StateWriter(Protocol):
    """Where the pool hands state to persist (see CredentialStateWriter)."""

    busy: set[str]

    def submit(self, credential_id: str, state: dict[str, Any]) -> None: ...


class CredentialStateStore(Protocol):
    def load(self) -> dict[str, dict[str, Any]]: ...

    def save(self, credential_id: str, state: dict[str, Any]) -> int | None:
        """Persist; may return the stored row's version (see :meth:`CredentialStateSync.adopt`)."""


def apply_state(credential: Credential, state: dict[str, Any]) -> None:
    """Set a credential's learned state from a stored row (a change of disabled resets
    its probe schedule)."""
    was_disabled = credential.disabled
    credential.disabled = bool(state.get("disabled"))
    credential.disabled_reason = state.get("disabled_reason")
    credential.disabled_by = state.get("disabled_by") or (
        ("upstream" if "upstream answered" in str(credential.disabled_reason) else "admin")
        if credential.disabled else None
    )
    credential.disabled_at = state.get("disabled_at")
    credential.cooldowns = {k: float(v) for k, v in (state.get("cooldowns") or {}).items()}
    if credential.disabled != was_disabled:
        credential.next_probe_at, credential.probe_failures = None, 0


class CredentialStateSync:
    """The store side of one pool: ``store`` may be None (nothing persisted); ``writer``
    is set by the running gateway (gateway.store.credentials.CredentialStateWriter)."""

    def __init__(self, store: CredentialStateStore | None, clock: Callable[[], float]) -> None:
        self.store = store
        self.clock = clock
        self.writer: StateWriter | None = None
        self._versions: dict[str, int] = {}  # credential id -> stored version last seen

    def restore(self, credentials: list[Credential]) -> None:
        """Start-up: adopt the stored state of every known credential."""
        if self.store is None:
            return
        load_versions = getattr(self.store, "load_versions", None)
        if load_versions is not None:
            self.adopt(credentials, load_versions())
            return
        saved = self.store.load()
        for credential in credentials:
            state = saved.get(credential.id)
            if state:
                apply_state(credential, state)

    def adopt(self, credentials: Iterable[Credential], states: dict[str, tuple[int, dict[str, Any]]]) -> None:
        """Adopt stored state newer than what this pool last wrote or read: ``states``
        maps credential id -> (version, state)."""
        busy = self.writer.busy if self.writer is not None else frozenset()
        for credential in credentials:
            entry = states.get(credential.id)
            if entry is None or entry[0] <= self._versions.get(credential.id, -1):
                continue
            if credential.id in busy:  # our own newer change is on its way to the store
                continue
            self._versions[credential.id] = entry[0]
            apply_state(credential, entry[1])

    def state_of(self, credential: Credential) -> dict[str, Any]:
        """What is persisted for a credential (never its key)."""
        now = self.clock()
        return {
            "disabled": credential.disabled,
            "disabled_reason": credential.disabled_reason,
            "disabled_by": credential.disabled_by,
            "disabled_at": credential.disabled_at,
            "cooldowns": {m: u for m, u in credential.cooldowns.items() if u > now},
        }

    def persist(self, credential: Credential) -> None:
        """Save the credential's state: handed to the background writer when there is one
        (memory is the truth meanwhile), else written now (offline tools, unit tests)."""
        if self.writer is not None:
            self.writer.submit(credential.id, self.state_of(credential))
            return
        if self.store is not None:
            try:
                version = self.store.save(credential.id, self.state_of(credential))
            except Exception as exc:  # a store outage: what was learned still holds here
                log.warning("credential_state_not_saved", credential=credential.id, error=type(exc).__name__)
                return
            if isinstance(version, int):
                self.saved(credential.id, version)

    def saved(self, credential_id: str, version: int) -> None:
        """The store holds our write of ``credential_id`` as ``version``."""
        self._versions[credential_id] = max(version, self._versions.get(credential_id, -1))
