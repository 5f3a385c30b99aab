"""The reservation decision of a key with limits (pure: no I/O). The store's transaction
reads the key's counts and hands them here; what comes back is either a :class:`Grant`
(the output cap the request may spend, the tokens it holds, what the key has left) or a
:class:`Refusal` that says which limit refuses, what to send instead when a smaller
request would fit, and ``Retry-After`` only when waiting can help.

Budgets tell the truth: a request that named no output cap is granted what remains
(``min(cap, remaining)``, then sent upstream as its cap), instead of being refused for a
default cap it never asked for; a request whose own cap does not fit is refused with the
largest ``max_tokens`` that would.

A money budget (``budget_cost``) prices the same reservation at the model's :class:`Rates`
(nano-units per token, rounded up: the hold is never below what the tokens can cost) and
holds it against what the period has cost; it lowers a flexible cap the same way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gateway.keys.model import KeyLimits
from gateway.keys.periods import period_days, seconds_to_period_end

#: The window of rpm and tpm, in seconds.
WINDOW = 60.0


#: Money is counted in nano-units of the price table's currency (integers in the store).
NANOS = 10**9


@dataclass(frozen=True, slots=True)
class Rates:
    """A model's price in nano-units per token (``price`` is per million tokens)."""

    input: int
    output: int

    @classmethod
    def of(cls, input_per_million: float, output_per_million: float) -> Rates:
        return cls(math.ceil(input_per_million * NANOS / 1_000_000), math.ceil(output_per_million * NANOS / 1_000_000))


@dataclass(frozen=True, slots=True)
class Ask:
    """What one request asks to hold: its input bound, the output cap of one answer, how
    many answers may spend it (tool-repair regenerations, ``n``), and whether the client
    named the cap (``flexible`` False) or the gateway may send a smaller one."""

    input_tokens: int = 0
    cap: int = 0
    answers: int = 1
    flexible: bool = False
    generates: bool = True  # False: count_tokens, a warm-up frame: only rpm applies
    rates: Rates | None = None  # the model's price, for a key with a money budget

    @property
    def tokens(self) -> int:
        return self.input_tokens + self.cap * self.answers

    def cost(self, cap: int) -> int:
        """Nano-units held with this output cap (0 without rates)."""
        if self.rates is None:
            return 0
        return self.input_tokens * self.rates.input + cap * self.answers * self.rates.output


@dataclass(frozen=True, slots=True)
class Counts:
    """The key's state as the transaction read it (before this request)."""

    now: float
    window_requests: int = 0
    window_tokens: int = 0
    oldest: float | None = None  # the oldest request still in the window
    open_requests: int = 0
    day_tokens: int = 0  # settled plus held today
    period_tokens: int = 0  # settled plus held in the current budget_period
    period_cost: int = 0  # nano-units settled plus held in the current budget_period


@dataclass(frozen=True, slots=True)
class Quota:
    """What the key has left, for the ``x-ratelimit-*`` headers (LiteLLM's names): requests
    against ``rpm``; tokens against the tightest of ``tpm``, ``daily_tokens`` and ``budget_tokens``."""

    limit_requests: int | None = None
    remaining_requests: int = 0
    reset_requests: int = 0
    limit_tokens: int | None = None
    remaining_tokens: int = 0
    reset_tokens: int = 0

    def headers(self) -> dict[str, str]:
        out: dict[str, str] = {}
        if self.limit_requests is not None:
            out |= {"x-ratelimit-limit-requests": str(self.limit_requests),
                    "x-ratelimit-remaining-requests": str(max(0, self.remaining_requests)),
                    "x-ratelimit-reset-requests": f"{self.reset_requests}s"}
        if self.limit_tokens is not None:
            out |= {"x-ratelimit-limit-tokens": str(self.limit_tokens),
                    "x-ratelimit-remaining-tokens": str(max(0, self.remaining_tokens)),
                    "x-ratelimit-reset-tokens": f"{self.reset_tokens}s"}
        return out


@dataclass(frozen=True, slots=True)
class Grant:
    """Admitted: ``cap`` is the output cap to send upstream, ``tokens`` what is held."""

    cap: int
    tokens: int
    quota: Quota
    cost: int = 0  # nano-units held (a money budget)


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a reservation was refused; ``retry_after`` None when waiting cannot help (the
    request as sent is larger than the limit itself)."""

    code: str  # rate_limited | budget_exceeded | concurrency_limited
    message: str
    retry_after: int | None
    quota: Quota | None = None
    #: the moment (wall clock) before which this refusal holds whatever else happens: a full
    #: ``rpm`` window until its oldest request leaves it (gateway/keys/full_windows.py)
    holds_until: float | None = None


def seconds_to_midnight(at: float) -> int:
    return max(1, math.ceil(86400 - at % 86400))


def _window_wait(counts: Counts) -> int:
    """Seconds until the oldest request leaves the window (a full window when none is in it)."""
    if counts.oldest is None:
        return int(WINDOW)
    return max(1, math.ceil(counts.oldest + WINDOW - counts.now))


@dataclass(frozen=True, slots=True)
class _TokenLimit:
    name: str  # tpm | daily_tokens | budget_tokens
    limit: int
    room: int  # what it holds now
    wait: int  # seconds until it holds more
    period: str = "day"  # budget_tokens' period
    since: str = ""  # its first day

    @property
    def code(self) -> str:
        return "rate_limited" if self.name == "tpm" else "budget_exceeded"

    def describe(self) -> str:
        if self.name == "tpm":
            return f"this API key is limited to {self.limit} tokens per minute"
        if self.name == "budget_tokens":
            return f"this API key's budget of {self.limit} tokens per {self.period} (since {self.since})"
        return f"this API key's daily budget of {self.limit} tokens"


def _token_limits(limits: KeyLimits, counts: Counts) -> list[_TokenLimit]:
    found = []
    if limits.tpm is not None:
        found.append(_TokenLimit("tpm", limits.tpm, limits.tpm - counts.window_tokens, _window_wait(counts)))
    if limits.daily_tokens is not None:
        found.append(_TokenLimit("daily_tokens", limits.daily_tokens, limits.daily_tokens - counts.day_tokens,
                                 seconds_to_midnight(counts.now)))
    if limits.budget_tokens is not None:
        found.append(_TokenLimit("budget_tokens", limits.budget_tokens, limits.budget_tokens - counts.period_tokens,
                                 seconds_to_period_end(counts.now, limits.budget_period), limits.budget_period,
                                 period_days(counts.now, limits.budget_period)[0]))
    return found


def quota(limits: KeyLimits, counts: Counts, taken: int = 0, requests: int = 0) -> Quota:
    """What is left once ``requests`` more requests and ``taken`` more tokens are held."""
    out = Quota()
    if limits.rpm is not None:
        oldest = counts.oldest if counts.oldest is not None else (counts.now if requests else None)
        wait = max(1, math.ceil(oldest + WINDOW - counts.now)) if oldest is not None else 0
        out = Quota(limits.rpm, limits.rpm - counts.window_requests - requests, wait)
    tokens = _token_limits(limits, counts)
    if tokens:
        tight = min(tokens, key=lambda t: t.room)
        out = Quota(out.limit_requests, out.remaining_requests, out.reset_requests,
                    tight.limit, tight.room - taken, tight.wait)
    return out


def decide(limits: KeyLimits, counts: Counts, ask: Ask) -> Grant | Refusal:
    """Admit ``ask`` against the key's limits (rpm, max_concurrent, then its tokens; a
    request that generates nothing: rpm only)."""
    if limits.rpm is not None and counts.window_requests + 1 > limits.rpm:
        return Refusal("rate_limited", f"this API key is limited to {limits.rpm} requests per minute",
                       _window_wait(counts), quota(limits, counts),
                       counts.oldest + WINDOW if counts.oldest is not None else None)
    if not ask.generates:
        return Grant(0, 0, quota(limits, counts, 0, 1))
    if limits.max_concurrent is not None and counts.open_requests + 1 > limits.max_concurrent:
        return Refusal("concurrency_limited",
                       f"this API key is limited to {limits.max_concurrent} concurrent requests", 1,
                       quota(limits, counts))
    tokens = _token_limits(limits, counts)
    room = min((t.room for t in tokens), default=None)
    cap = ask.cap
    if room is not None and ask.tokens > room:
        fits = (room - ask.input_tokens) // ask.answers  # the largest cap that would fit now
        if ask.flexible and fits >= 1:
            cap = fits
        else:
            return _refusal(tokens, counts, ask, fits, limits)
    money = _money_room(limits, counts)
    if money is not None and ask.cost(cap) > money:
        fits = _money_fits(ask, money)
        if ask.flexible and fits >= 1:
            cap = fits
        else:
            return _money_refusal(limits, counts, ask, fits)
    held = ask.input_tokens + cap * ask.answers
    return Grant(cap, held, quota(limits, counts, held, 1), ask.cost(cap))


def _money_room(limits: KeyLimits, counts: Counts) -> int | None:
    """Nano-units the money budget holds now (None: no money budget)."""
    if limits.budget_cost is None:
        return None
    return round(limits.budget_cost * NANOS) - counts.period_cost


def _money_fits(ask: Ask, room: int) -> int:
    """The largest output cap whose cost fits ``room``."""
    rates = ask.rates or Rates(0, 0)
    left = room - ask.input_tokens * rates.input
    if rates.output == 0:
        return ask.cap if left >= 0 else 0
    return left // (ask.answers * rates.output)


def money(nanos: int) -> str:
    """Nano-units as the price table's currency (up to 6 decimals, no trailing zeros)."""
    return f"{nanos / NANOS:.6f}".rstrip("0").rstrip(".")


def _money_refusal(limits: KeyLimits, counts: Counts, ask: Ask, fits: int) -> Refusal:
    """The money budget refuses: it names itself; Retry-After only when the request (at its
    smallest) fits the budget empty."""
    assert limits.budget_cost is not None
    budget = round(limits.budget_cost * NANOS)
    smallest = ask.cost(1 if ask.flexible else ask.cap)
    since = period_days(counts.now, limits.budget_period)[0]
    message = (f"this API key's budget of {money(budget)} per {limits.budget_period} (since {since}, budget_cost) "
               f"cannot hold this request's {money(ask.cost(ask.cap))} (spent or held: {money(counts.period_cost)})")
    if fits >= 1:
        message += f"; send max_tokens <= {fits}"
    retry_after = seconds_to_period_end(counts.now, limits.budget_period) if smallest <= budget else None
    if retry_after is None:
        message += "; waiting will not help"
    return Refusal("budget_exceeded", message, retry_after, quota(limits, counts))


def _refusal(tokens: list[_TokenLimit], counts: Counts, ask: Ask, fits: int, limits: KeyLimits) -> Refusal:
    """The tightest refusing limit names itself; Retry-After only when the request (at its
    smallest: one output token if the gateway may lower its cap) fits that limit empty."""
    smallest = ask.input_tokens + (1 if ask.flexible else ask.cap) * ask.answers
    refusing = [t for t in tokens if smallest > t.room]
    tight = min(refusing, key=lambda t: t.room)
    waits = [t.wait if smallest <= t.limit else None for t in refusing]
    retry_after = None if None in waits else max(w for w in waits if w is not None)
    message = f"{tight.describe()} cannot hold this request's {ask.tokens} tokens (used or held: {tight.limit - tight.room})"
    if fits >= 1:
        message += f"; send max_tokens <= {fits}"
    elif ask.input_tokens + ask.answers > min(t.limit for t in tokens):
        message += f"; its input alone (at most {ask.input_tokens} tokens) is over the limit"
    if retry_after is None:
        message += "; waiting will not help"
    return Refusal(tight.code, message, retry_after, quota(limits, counts))
