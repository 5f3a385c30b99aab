"""The upstream pool: which credential serves a request, and what each failure teaches.

Upstreams (base URL, extra headers, model allow-list and rename map) hold credentials.
Selection is over credentials that are enabled, not cooling down for the model, under
their in-flight cap and allowed to serve the model (healthy ones first); which of them
serves a call is the router's choice (:mod:`gateway.upstream.routing`: cache-aware or
round-robin, both keeping a named session on its credential). Failures before the
first client byte are reported back here and marked on the credential by
:mod:`gateway.upstream.failure_lessons` (401/403 disables it, 429 cools it down, 5xx and
connect errors put it last for a few seconds, a hung engine for a minute). An engine's own
``max_in_flight`` is counted by :class:`~gateway.upstream.engine_slots.EngineSlots`
(``pool.slots``). State
changes are persisted through a :class:`~gateway.upstream.pool_state.CredentialStateSync`
(``pool.state``) so they survive a restart; in a running gateway through a background
writer (``pool.state.writer``), so the request path never waits on the store.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import structlog

from gateway.errors import GatewayError
from gateway.store.credentials import AddedCredential
from gateway.upstream.credential import Credential, Upstream
from gateway.upstream.engine_slots import EngineSlots
from gateway.upstream.failure_lessons import learn_from_failure
from gateway.upstream.pool_state import CredentialStateStore, CredentialStateSync
from gateway.upstream.routing import RoundRobinRouter, Router, engines_of
from gateway.upstream.urls import check_upstream_url

log = structlog.get_logger("gateway.pool")

#: Seconds a credential added on this replica is safe from a shared-state poll that read the
#: store before its row was written (replicas poll every few seconds).
ADDED_GRACE = 30.0


def _sendable(url: str) -> bool:
    """A stored URL another replica added that this one could send (never a 500 later)."""
    try:
        check_upstream_url(url, None)
    except ValueError:
        log.warning("shared_credential_skipped", reason="its base URL cannot be sent")
        return False
    return True


@dataclass(slots=True)
class Lease:
    """A credential held for one upstream attempt; released exactly once."""

    credential: Credential
    pool: UpstreamPool
    routing: str = "round_robin"  # why the router chose it (gateway.upstream.routing.REASONS)
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.credential.in_flight -= 1
            if self.pool.on_lease is not None:
                self.pool.on_lease(self.credential, -1)
            self.pool.slots.released()


class UpstreamPool:
    """Credential selection and health, shared by every request of one process."""

    def __init__(
        self,
        credentials: Iterable[Credential],
        store: CredentialStateStore | None = None,
        max_in_flight_per_credential: int = 0,
        clock: Callable[[], float] = time.time,
        router: Router | None = None,
    ) -> None:
        self.credentials = list(credentials)
        self.max_in_flight = max_in_flight_per_credential
        self.clock = clock
        #: which usable credential serves a call (gateway.upstream.routing; --routing)
        self.router: Router = router or RoundRobinRouter(clock)
        self._spread = itertools.count()  # the keys of one engine take turns on a tie
        self._deleted: set[str] = set()  # ids deleted through this process's admin API
        #: stored admin-added ids left out because a configured credential holds their key
        self.superseded: list[str] = []
        self.on_change: Callable[[], None] | None = None  # called when a credential is added
        #: called with (credential, +1 | -1) as a lease is taken and released (the in-flight gauge)
        self.on_lease: Callable[[Credential, int], None] | None = None
        #: the learned state's way to and from the store (its ``writer``: the background one)
        self.state = CredentialStateSync(store, clock)
        self.state.restore(self.credentials)
        #: each engine's ``max_in_flight`` slots (a call waits for one in gateway/upstream/attempts.py)
        self.slots = EngineSlots(self.credentials)

    def waits_for_slot(self, model: str, exclude: set[str] = frozenset()) -> float | None:  # type: ignore[assignment]
        """When nothing is usable for ``model`` only because engines with ``max_in_flight``
        are full: how long a request may wait for a slot, else None."""
        allowed = [c for c in self.credentials if c.upstream.allows(model)]
        return self.slots.wait_bound(self._ready(allowed, model, self.clock(), exclude))

    def _ready(self, allowed: list[Credential], model: str, now: float, exclude: set[str]) -> list[Credential]:
        """The credentials that may take a call for ``model`` now, their engines' slots aside."""
        return [c for c in allowed if not c.disabled and not c.cooling_until(model, now) and c.id not in exclude
                and (not self.max_in_flight or c.in_flight < self.max_in_flight)]

    def twin_of(self, credential: Credential) -> Credential | None:
        """The credential already in the pool with this one's key and base URL (one
        credential per key, whatever its source), else None."""
        return next((c for c in self.credentials if c.identity == credential.identity), None)

    def apply_shared(
        self,
        states: dict[str, tuple[int, dict[str, Any]]],
        added: Sequence[Sequence[Any]] | None = None,
    ) -> None:
        """Adopt stored state newer than what this pool last wrote or read: ``states``
        maps credential id -> (version, state); ``added`` lists admin-added credentials
        (:class:`~gateway.store.credentials.AddedCredential` rows), added here when unknown
        and their key is not already in the pool. Runs on the event loop."""
        known = {c.id for c in self.credentials}
        rows = [AddedCredential(*row) for row in added or ()]
        for row in rows:
            if row.credential_id not in known and _sendable(row.base_url):
                upstream = next((c.upstream for c in self.credentials if c.upstream.name == row.upstream
                                 and c.upstream.base_url == row.base_url), None) or Upstream(row.upstream, row.base_url)
                if row.credential_id in self._deleted:
                    continue  # deleted here; this poll read the store before the delete
                credential = Credential(upstream, row.api_key, id=row.credential_id, added_by_admin=True,
                                        added_at=self.clock(), label=row.label)
                if self.twin_of(credential) is not None:
                    continue  # its key is here already (configured on this replica)
                self.credentials.append(credential)
                known.add(row.credential_id)
                self._changed()
        if added is not None:  # deleted on another replica: its row is gone
            stored = {row.credential_id for row in rows}
            now = self.clock()
            self.credentials[:] = [
                c for c in self.credentials
                if not c.added_by_admin or c.id in stored or now - (c.added_at or 0.0) < ADDED_GRACE
            ]
        self.state.adopt(self.credentials, states)

    def add(self, credential: Credential) -> None:
        self.credentials.append(credential)
        self._deleted.discard(credential.id)
        self.state.persist(credential)
        self._changed()

    def remove(self, credential_id: str) -> Credential:
        """Take an admin-added credential out (KeyError: unknown; ValueError: configured by
        flag or file, so it would come back at the next start). Leases held stay valid; its
        key stays masked (gateway.redact) for the life of the process."""
        credential = self.get(credential_id)
        if not credential.added_by_admin:
            raise ValueError(credential_id)
        self.credentials[:] = [c for c in self.credentials if c.id != credential_id]
        self._deleted.add(credential_id)
        if not any(engine_of(c) == engine_of(credential) for c in self.credentials):
            self.router.forget(engine_of(credential))  # its engine left the pool
        return credential

    def replace_configured(self, fresh: list[Credential]) -> tuple[list[str], list[str], list[str]]:
        """A reloaded ``--config``: ``fresh`` (the configured credentials it names) replaces
        the configured ones. A credential kept (same id) keeps its object and learned state,
        with the new upstream settings and label; new ones join (their stored state adopted
        by the caller); gone ones leave (leases held stay valid: an answer in flight ends
        normally); an admin-added credential whose key is now configured leaves too.
        Returns (added, removed, superseded) ids. Runs on the event loop."""
        self.credentials[:], added, removed, superseded = reconfigured(self.credentials, fresh)
        self._changed()
        return added, removed, superseded

    def _changed(self) -> None:
        """The set of credentials changed (their keys feed gateway.redact)."""
        if self.on_change is not None:
            self.on_change()

    def get(self, credential_id: str) -> Credential:
        for credential in self.credentials:
            if credential.id == credential_id:
                return credential
        raise KeyError(credential_id)

    # -- choosing ----------------------------------------------------------------------

    def acquire(self, model: str, exclude: set[str] = frozenset(), session: str | None = None,  # type: ignore[assignment]
                prefix: Sequence[int] = ()) -> Lease:
        """The usable credential the router picks for ``model`` (``prefix``: the body's
        gateway.upstream.routing.prefix_chain), or the error the client should see."""
        now = self.clock()
        allowed = [c for c in self.credentials if c.upstream.allows(model)]
        if not allowed:
            raise GatewayError("not_found", "model_not_available", f"no upstream serves model {model!r}")
        usable = [c for c in self._ready(allowed, model, now, exclude) if not self.slots.full(c)]
        if not usable:
            raise nothing_usable(allowed, model, now, exclude)
        # passed over for a model its upstream said it lacks, unless nothing else is left
        # (then the upstream is asked again: it may have loaded the model since)
        usable = [c for c in usable if not c.unavailable_for(model, now)] or usable
        healthy = [c for c in usable if c.penalty_until <= now] or usable
        if self.router.uses_prefix:  # cache-aware: the router picks an engine (its prefix cache), the engine a key
            engines = engines_of(healthy, engine_of)
            route = self.router.route(engines, session, prefix, failover=bool(exclude))
            reason, chosen = route.reason, route.replica.pick(next(self._spread))
        else:  # round-robin over the credentials, as before routing
            plain = self.router.route(healthy, session, prefix, failover=bool(exclude))
            reason, chosen = plain.reason, plain.replica
        chosen.in_flight += 1
        if self.on_lease is not None:
            self.on_lease(chosen, 1)
        return Lease(chosen, self, reason)

    # -- learning ----------------------------------------------------------------------

    def report_failure(self, credential: Credential, model: str, error: GatewayError) -> bool:
        """Learn from a failure before the first client byte (gateway.upstream.failure_lessons);
        True if another credential may be tried (failover), False when the error is the
        client's to see as is."""
        lesson = learn_from_failure(credential, model, error, self.clock())
        if lesson.persist:
            self.state.persist(credential)
        return lesson.failover

    # -- admin -------------------------------------------------------------------------

    def enable(self, credential_id: str) -> Credential:
        credential = self.get(credential_id)
        credential.disabled, credential.disabled_reason, credential.disabled_by = False, None, None
        credential.disabled_at, credential.next_probe_at, credential.probe_failures = None, None, 0
        self.state.persist(credential)
        return credential

    def disable(self, credential_id: str, reason: str = "disabled by admin") -> Credential:
        credential = self.get(credential_id)
        credential.disabled, credential.disabled_reason, credential.disabled_by = True, reason, "admin"
        credential.disabled_at = self.clock()
        self.state.persist(credential)
        return credential

    # -- probing (gateway.upstream.prober) -----------------------------------------------

    def reset_cooldowns(self, credential_id: str) -> Credential:
        credential = self.get(credential_id)
        credential.cooldowns.clear()
        self.state.persist(credential)
        return credential

    @property
    def in_flight(self) -> int:
        return sum(c.in_flight for c in self.credentials)


def reconfigured(
    current: list[Credential], fresh: list[Credential]
) -> tuple[list[Credential], list[str], list[str], list[str]]:
    """:meth:`UpstreamPool.replace_configured`'s new credential list, and the (added,
    removed, superseded) ids; a kept credential takes its fresh upstream settings and label."""
    old = {c.id: c for c in current if not c.added_by_admin}
    kept: list[Credential] = []
    added: list[str] = []
    for credential in fresh:
        same = old.get(credential.id)
        if same is not None:
            same.upstream, same.label = credential.upstream, credential.label
            kept.append(same)
        else:
            kept.append(credential)
            added.append(credential.id)
    ids = {c.id for c in kept}
    removed = [cid for cid in old if cid not in ids]
    identities = {c.identity for c in kept}
    admin = [c for c in current if c.added_by_admin]
    superseded = [c.id for c in admin if c.identity in identities]
    return kept + [c for c in admin if c.id not in superseded], added, removed, superseded


def engine_of(credential: Credential) -> str:
    """The engine a credential reaches (what routing keeps warm): its upstream's base URL."""
    return credential.upstream.base_url


def nothing_usable(allowed: list[Credential], model: str, now: float, exclude: set[str]) -> GatewayError:
    """Why no credential allowed for ``model`` is usable now, as the error the client sees."""
    enabled = [c for c in allowed if not c.disabled]
    if not enabled:
        return GatewayError("overloaded", "no_upstream_available", "every upstream credential is disabled")
    cooling = [c.cooling_until(model, now) for c in enabled]
    if all(cooling):
        # the whole seconds left, rounded up: a client told to come back then finds the
        # cooldown over (a later request is told less: the clock moved, the end did not)
        wait = max(1, math.ceil(min(cooling) - now))
        return GatewayError(
            "rate_limit", "upstream_rate_limited",
            f"every upstream credential is cooling down; retry in {wait} s", retry_after=wait,
        )
    if all(c.id in exclude or u for c, u in zip(enabled, cooling)):
        return GatewayError("upstream", "failover_exhausted", "every usable upstream credential was tried")
    return GatewayError("overloaded", "upstream_capacity", "every upstream credential is busy", retry_after=1)
