"""Gauges that mirror the state an operator asks about rather than events: how many
credentials of each upstream are usable, cooling down or disabled, how many replicas are
live, and this replica's share of ``max_concurrent``. Set at each scrape
(``Observability.exposition``) from what the app hands over; nothing here does I/O.

:func:`credential_states` is pure (credentials in, counts out), so tests feed it directly.
"""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Gauge

from gateway.upstream.credential import Credential

STATES = ("usable", "cooling", "disabled")


def credential_states(credentials: Iterable[Credential], now: float) -> dict[tuple[str, str], int]:
    """(upstream, state) -> credentials: ``disabled`` (by an admin or an upstream 401/403),
    ``cooling`` (a cooldown for any model still running), else ``usable``; every state of
    every upstream present, at zero when none."""
    tally: Tally[tuple[str, str]] = Tally()
    upstreams = set()
    for credential in list(credentials):
        upstreams.add(credential.upstream.name)
        if credential.disabled:
            state = "disabled"
        elif any(until > now for until in list(credential.cooldowns.values())):
            state = "cooling"
        else:
            state = "usable"
        tally[(credential.upstream.name, state)] += 1
    return {(upstream, state): tally[(upstream, state)] for upstream in sorted(upstreams) for state in STATES}


@dataclass
class StateSources:
    """Where the gauges read from, at scrape time (set by the app once it has them)."""

    credentials: Callable[[], Iterable[Credential]]
    live_replicas: Callable[[], int]
    share: Callable[[], int]


class StateGauges:
    """The state gauges of one app's registry (``--workers``: the largest of the workers'
    values for counts, their sum for the capacity share)."""

    def __init__(self, registry: CollectorRegistry, prefix: str) -> None:
        self.credentials = Gauge(
            prefix + "credentials", "Upstream credentials by state (usable, cooling, disabled)",
            ["upstream", "state"], registry=registry, multiprocess_mode="livemax",
        )
        self.replicas_live = Gauge(
            prefix + "replicas_live", "Replicas sharing this store that the last heartbeat saw alive (1 alone)",
            registry=registry, multiprocess_mode="livemax",
        )
        self.max_concurrent_share = Gauge(
            prefix + "max_concurrent_share", "This replica's share of the global max_concurrent",
            registry=registry, multiprocess_mode="livesum",
        )
        self.sources: StateSources | None = None

    def update(self, now: float) -> None:
        sources = self.sources
        if sources is None:
            return
        try:
            counts = credential_states(sources.credentials(), now)
        except RuntimeError:  # the pool changed while this thread read it: keep the last values
            counts = {}
        for (upstream, state), n in counts.items():
            self.credentials.labels(upstream, state).set(n)
        self.replicas_live.set(sources.live_replicas())
        self.max_concurrent_share.set(sources.share())


__all__: list[Any] = ["STATES", "StateGauges", "StateSources", "credential_states"]
