"""Budget periods of a managed key (pure): the UTC day, the ISO week (from Monday) or the
calendar month a moment falls in, as the first and last ``YYYY-MM-DD`` day of the period
(``client_key_usage`` rows are per day, so a period's usage is the sum of its days' rows),
and the seconds until the next period begins (the ``Retry-After`` of a refusal)."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta

PERIODS = ("day", "week", "month")


def _start(at: float, period: str) -> datetime:
    moment = datetime.fromtimestamp(at, UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    if period == "week":
        return moment - timedelta(days=moment.weekday())
    if period == "month":
        return moment.replace(day=1)
    return moment


def _next(start: datetime, period: str) -> datetime:
    if period == "week":
        return start + timedelta(days=7)
    if period == "month":
        return (start.replace(day=28) + timedelta(days=4)).replace(day=1)
    return start + timedelta(days=1)


def period_days(at: float, period: str) -> tuple[str, str]:
    """The first and the last day (``YYYY-MM-DD``, inclusive) of the period holding ``at``."""
    start = _start(at, period)
    last = _next(start, period) - timedelta(days=1)
    return start.strftime("%Y-%m-%d"), last.strftime("%Y-%m-%d")


def seconds_to_period_end(at: float, period: str) -> int:
    """Whole seconds until the next period begins (at least 1)."""
    return max(1, math.ceil(_next(_start(at, period), period).timestamp() - at))
