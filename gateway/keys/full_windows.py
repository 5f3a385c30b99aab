"""Keys whose ``rpm`` window is full, refused from memory (pure: the clock is passed in).

A key past its ``rpm`` is refused by the store's transaction (gateway/keys/quota.py) with
``Retry-After`` until the oldest request of its window leaves it. Until then nothing can
admit another request of that key, on any replica (other replicas only fill the window
more), so the store need not be asked again: a flooding key's requests were each a
transaction on the store's threads, a body read and a parse before that answer, and the
thread hand-offs alone cost the other keys' requests their latency (issue #36). Here the
refusal is remembered until that moment and answered from memory before the body is read.

Only ``rpm``: a token limit (``tpm``, budgets) or ``max_concurrent`` can free up early (a
settlement lower than the reservation, an answer ending), so those are always asked. A
change of the key's limits (reloaded every second) forgets what was remembered.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from gateway.keys.model import KeyLimits, ManagedKey
from gateway.keys.quota import Refusal

#: Keys remembered at most (a flood of many keys cannot grow it without bound).
MAX_KEYS = 10_000


@dataclass(frozen=True, slots=True)
class _Full:
    limits: KeyLimits
    until: float  # wall clock: the oldest request of the window leaves it
    refusal: Refusal


class FullWindows:
    """The keys whose rpm window the store last found full, until when."""

    def __init__(self) -> None:
        self._full: dict[str, _Full] = {}

    def note(self, key: ManagedKey, refusal: Refusal) -> None:
        """A refusal of the store: kept when it says until when it holds (``rpm``)."""
        if refusal.holds_until is None:
            return
        if len(self._full) >= MAX_KEYS and key.key_id not in self._full:
            self._full.pop(next(iter(self._full)))  # the oldest noted goes first
        self._full[key.key_id] = _Full(key.limits, refusal.holds_until, refusal)

    def frees_in(self, key: ManagedKey, now: float) -> float:
        """Seconds until ``key``'s remembered window frees (0: not remembered)."""
        full = self._full.get(key.key_id)
        return max(0.0, full.until - now) if full is not None else 0.0

    def refusal(self, key: ManagedKey, now: float) -> Refusal | None:
        """The refusal that still holds for ``key`` at ``now`` (``Retry-After`` and the
        ``x-ratelimit-reset-requests`` counted down), else None."""
        full = self._full.get(key.key_id)
        if full is None:
            return None
        if full.limits != key.limits or now >= full.until:
            del self._full[key.key_id]
            return None
        wait = max(1, math.ceil(full.until - now))
        quota = full.refusal.quota
        if quota is not None:
            quota = dataclasses.replace(quota, remaining_requests=0, reset_requests=wait)
        return dataclasses.replace(full.refusal, retry_after=wait, quota=quota)
