"""How fast the admin token may be guessed: failed attempts (``POST /admin/login``, a wrong
``Authorization: Bearer`` on the admin surface) rate-limited per client address with
exponential backoff, and in total.

Per address: :data:`FREE_FAILURES` failures are free; each further one closes the door
for twice as long as the last (1 s, 2 s, 4 s, ... up to :data:`MAX_BACKOFF`), and while
it is closed every attempt from there is a 429 with ``Retry-After`` before the token is
even compared. An address quiet for :data:`FORGET_AFTER` seconds starts over; a success
clears its record. In total: a bucket of :data:`GLOBAL_BURST` failures refilled at
:data:`GLOBAL_RATE` per second, so many addresses together cannot guess fast either.
Per process (each worker and replica counts its own): the numbers bound the guess rate,
they are no account lockout. Pure, with an injected clock; memory bounded (at most
:data:`MAX_ADDRESSES` addresses, the least recently seen forgotten first).
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

FREE_FAILURES = 5
FIRST_BACKOFF = 1.0
MAX_BACKOFF = 300.0
FORGET_AFTER = 900.0
GLOBAL_BURST = 100.0
GLOBAL_RATE = 10.0
MAX_ADDRESSES = 10_000


@dataclass(slots=True)
class _Address:
    failures: int = 0
    closed_until: float = 0.0
    last: float = 0.0


class AttemptThrottle:
    """Failed admin-token attempts per client address and in total."""

    def __init__(
        self,
        free: int = FREE_FAILURES,
        first_backoff: float = FIRST_BACKOFF,
        max_backoff: float = MAX_BACKOFF,
        burst: float = GLOBAL_BURST,
        rate: float = GLOBAL_RATE,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.free, self.first_backoff, self.max_backoff = free, first_backoff, max_backoff
        self.burst, self.rate, self.clock = burst, rate, clock
        self._addresses: OrderedDict[str, _Address] = OrderedDict()
        self._tokens = burst
        self._refilled = clock()

    def retry_after(self, address: str) -> float:
        """Seconds ``address`` must wait before its next attempt (0: it may try now)."""
        now = self.clock()
        self._refill(now)
        wait = (1.0 - self._tokens) / self.rate if self._tokens < 1.0 else 0.0
        record = self._addresses.get(address)
        if record is not None:
            if now - record.last > FORGET_AFTER:
                del self._addresses[address]
            else:
                wait = max(wait, record.closed_until - now)
        return max(0.0, wait)

    def failed(self, address: str) -> None:
        now = self.clock()
        self._refill(now)
        self._tokens = max(0.0, self._tokens - 1.0)
        record = self._addresses.pop(address, None) or _Address()
        if now - record.last > FORGET_AFTER:
            record = _Address()
        record.failures += 1
        record.last = now
        over = record.failures - self.free
        if over >= 0:
            record.closed_until = now + min(self.max_backoff, self.first_backoff * 2.0 ** min(over, 32))
        self._addresses[address] = record  # most recent last
        while len(self._addresses) > MAX_ADDRESSES:
            self._addresses.popitem(last=False)

    def succeeded(self, address: str) -> None:
        self._addresses.pop(address, None)

    def _refill(self, now: float) -> None:
        self._tokens = min(self.burst, self._tokens + (now - self._refilled) * self.rate)
        self._refilled = now


def retry_after_header(seconds: float) -> str:
    """Whole seconds, rounded up (a client retrying at once would only be refused again)."""
    return str(max(1, math.ceil(seconds)))
