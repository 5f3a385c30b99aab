"""Budget periods (gateway/keys/periods.py, pure): the UTC day, ISO week and calendar month
a moment falls in, and how long until the next one begins."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from gateway.keys.model import InvalidField, KeyLimits, limits_from
from gateway.keys.periods import period_days, seconds_to_period_end


def at(text: str) -> float:
    return datetime.fromisoformat(text).replace(tzinfo=UTC).timestamp()


def test_periods_hold_their_days() -> None:
    wednesday = at("2026-12-30T13:00:00")
    assert period_days(wednesday, "day") == ("2026-12-30", "2026-12-30")
    assert period_days(wednesday, "week") == ("2026-12-28", "2027-01-03")  # Monday to Sunday, across the year
    assert period_days(wednesday, "month") == ("2026-12-01", "2026-12-31")
    assert period_days(at("2028-02-10T00:00:00"), "month") == ("2028-02-01", "2028-02-29")  # a leap year


def test_the_wait_is_until_the_next_period_begins() -> None:
    moment = at("2026-12-30T23:59:30")
    assert seconds_to_period_end(moment, "day") == 30
    assert seconds_to_period_end(moment, "week") == 30 + 4 * 86400  # next Monday 2027-01-04
    assert seconds_to_period_end(moment, "month") == 30 + 86400  # 2027-01-01
    assert seconds_to_period_end(at("2027-01-01T00:00:00"), "day") == 86400


def test_limits_take_a_budget_and_its_period() -> None:
    limits = limits_from({"budget_tokens": 5_000_000, "budget_period": "month"})
    assert (limits.budget_tokens, limits.budget_period, limits.counted, limits.token_limited) == (5_000_000, "month", True, True)
    assert limits_from({"rpm": 5}, limits).budget_period == "month"  # a change keeps what it does not name
    assert KeyLimits().budget_period == "day"
    with pytest.raises(InvalidField) as caught:
        limits_from({"budget_period": "year"})
    assert caught.value.param == "budget_period"
