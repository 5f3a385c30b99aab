"""What is left of each managed key's budgets, as the gauge
``codebuddy2api_key_budget_left{key, budget}`` (``budget``: ``daily_tokens``,
``budget_tokens``, ``budget_cost``; tokens, or money in the currency of the ``--config``
prices). Read from the store (settled plus held, as the limiter counts them) after each
settlement of a key, when the keys change (a create, a change, a revocation, on any
replica: the registry's reload), and at least every :data:`FULL_EVERY` seconds (a new day
or period starts full). One series per active key with that budget: a revoked key, or a
budget removed, drops its series, so the labels stay bounded by the keys an admin created
(like the other key metrics).

:func:`left_of` is pure (a key and its counts in, the values out).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from typing import Any

import structlog

from gateway.keys import store
from gateway.keys.model import ManagedKey
from gateway.keys.quota import NANOS, Counts
from gateway.store.db import Store
from gateway.tasks import stop_tasks

log = structlog.get_logger("gateway.keys")

BUDGETS = ("daily_tokens", "budget_tokens", "budget_cost")
#: Seconds between two full reads (a new day or period leaves the last values stale).
FULL_EVERY = 60.0
#: Seconds one read may take.
READ_TIMEOUT = 10.0


def left_of(key: ManagedKey, counts: Counts) -> dict[str, float]:
    """Each budget the key has -> what is left (never below 0)."""
    limits = key.limits
    out: dict[str, float] = {}
    if limits.daily_tokens is not None:
        out["daily_tokens"] = max(0, limits.daily_tokens - counts.day_tokens)
    if limits.budget_tokens is not None:
        out["budget_tokens"] = max(0, limits.budget_tokens - counts.period_tokens)
    if limits.budget_cost is not None:
        out["budget_cost"] = max(0.0, (round(limits.budget_cost * NANOS) - counts.period_cost) / NANOS)
    return out


def _budgeted(keys: Iterable[ManagedKey]) -> list[ManagedKey]:
    return [k for k in keys if k.revoked_at is None and left_of(k, Counts(0.0))]


class BudgetLeft:
    """Keeps the gauge of one app; reads run on the store's threads, one at a time."""

    def __init__(self, gauge: Any, db: Store) -> None:
        self.gauge = gauge
        self.db = db
        self._keys: dict[str, ManagedKey] = {}
        self._shown: set[tuple[str, str]] = set()
        self._due: set[str] = set()
        self._snapshot: object = None
        self._last_full = 0.0
        self._task: asyncio.Task[None] | None = None

    def reloaded(self, keys: list[ManagedKey]) -> None:
        """The registry's keys (each load): read them all when they changed or the last full
        read is old."""
        snapshot = tuple((k.key_id, k.name, k.limits, k.revoked_at) for k in keys)
        budgeted = _budgeted(keys)
        self._keys = {k.key_id: k for k in budgeted}
        if snapshot != self._snapshot or time.monotonic() - self._last_full >= FULL_EVERY:
            self._snapshot = snapshot
            self._last_full = time.monotonic()
            self._due.update(self._keys)
            self._drop_gone()
            self._kick()

    def settled(self, key_id: str) -> None:
        """A settlement of the key was recorded: read its budgets again."""
        if key_id in self._keys:
            self._due.add(key_id)
            self._kick()

    def _drop_gone(self) -> None:
        wanted = {(k.name, budget) for k in self._keys.values() for budget in left_of(k, Counts(0.0))}
        for labels in self._shown - wanted:
            try:
                self.gauge.remove(*labels)
            except KeyError:
                pass
        self._shown &= wanted

    def _kick(self) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # start-up, before the loop: read now (blocking is fine there)
            self._publish(self._read())
            return
        if self._task is None or self._task.done():
            self._task = loop.create_task(self._run())

    def _take_due(self) -> list[ManagedKey]:
        due = [self._keys[k] for k in self._due if k in self._keys]
        self._due.clear()
        return due

    async def _run(self) -> None:
        while due := self._take_due():  # settlements during a read make one more read
            try:
                async with asyncio.timeout(READ_TIMEOUT):
                    self._publish(await self.db.acall(self._read, due))
            except Exception as exc:  # the store is out: the last values stay; the next event retries
                log.warning("key_budget_left_failed", error=f"{type(exc).__name__}: {exc}")
                return

    def _read(self, due: list[ManagedKey] | None = None) -> list[tuple[ManagedKey, Counts]]:
        """Blocking: the counts of ``due`` (default: every key due now)."""
        due = self._take_due() if due is None else due
        if not due:
            return []
        _, counts = store.budget_counts(self.db, due)
        return [(key, counts[key.key_id]) for key in due]

    def _publish(self, read: list[tuple[ManagedKey, Counts]]) -> None:
        for key, counts in read:
            if key.key_id not in self._keys:
                continue  # revoked meanwhile
            for budget, value in left_of(key, counts).items():
                self.gauge.labels(key.name, budget).set(value)
                self._shown.add((key.name, budget))

    async def aclose(self) -> None:
        await stop_tasks(self._task)
