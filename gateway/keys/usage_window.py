"""A managed key's usage over any window, from its audit records (every request a key made
leaves one, revoked keys' included): requests, tokens and cost, in total and per UTC day.

Pure: :func:`summarise` takes the rows ``gateway.store.audit_queries.key_usage_rows``
read and the window; the admin route (``GET /admin/api/keys/{id}/usage``) is its thin shell.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any

#: The longest window one call may ask for (seconds).
MAX_WINDOW = 366 * 86400.0
#: The window when none is given: the last 30 days.
DEFAULT_WINDOW = 30 * 86400.0
GROUPINGS = ("day", "total")


def _day(at: float) -> str:
    return datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%d")


def _empty() -> dict[str, Any]:
    return {"requests": 0, "succeeded": 0, "input_tokens": 0, "output_tokens": 0, "cached_tokens": 0,
            "cost": None}


def _add(into: dict[str, Any], outcome: str, prompt: Any, completion: Any, cached: Any, cost: Any) -> None:
    into["requests"] += 1
    into["succeeded"] += outcome == "success"
    into["input_tokens"] += int(prompt or 0)
    into["output_tokens"] += int(completion or 0)
    into["cached_tokens"] += int(cached or 0)
    if cost is not None:  # priced requests add up; unpriced ones leave cost alone (not a zero)
        into["cost"] = round((into["cost"] or 0.0) + float(cost), 9)


def summarise(rows: Iterable[tuple[Any, ...]], since: float, until: float, by: str) -> dict[str, Any]:
    """``rows``: (started_at, outcome, prompt_tokens, completion_tokens, cached_tokens, cost).
    The total, and with ``by="day"`` one entry per UTC day of the window (days without a
    request included, so a chart needs no gap filling)."""
    total = _empty()
    days: dict[str, dict[str, Any]] = {}
    if by == "day":
        start = datetime.fromtimestamp(since, UTC).replace(hour=0, minute=0, second=0, microsecond=0).timestamp()
        while start < until:
            days[_day(start)] = _empty()
            start += 86400
    for started_at, outcome, prompt, completion, cached, cost in rows:
        _add(total, str(outcome), prompt, completion, cached, cost)
        if by == "day":
            _add(days.setdefault(_day(float(started_at)), _empty()), str(outcome), prompt, completion, cached, cost)
    out: dict[str, Any] = {"since": since, "until": until, "by": by, "total": total}
    if by == "day":
        out["days"] = [{"day": day, **values} for day, values in sorted(days.items())]
    return out
