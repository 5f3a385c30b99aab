"""The reservations of gateway/keys/store.py on both backends, without HTTP: atomic under
threads (the limits hold exactly), settled to the real usage, refused with the limit that
refuses and when to try again."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.keys import store
from gateway.keys.model import KeyLimits, ManagedKey, hash_secret, new_key_id, new_secret
from gateway.store.db import Store, open_database


@pytest.fixture(params=["sqlite", "postgres"])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    if request.param == "sqlite":
        database = open_database(None, tmp_path)
    else:
        database = open_database(request.getfixturevalue("postgres_schema"), tmp_path)
    yield database
    database.close()


def make_key(db: Store, **limits: Any) -> ManagedKey:
    secret = new_secret()
    key = ManagedKey(new_key_id(), "k-" + secret[-6:], secret[:12], hash_secret(secret), KeyLimits(**limits), time.time())
    store.insert(db, key)
    return key


def test_fifty_threads_reserving_at_once_get_exactly_what_the_budget_holds(db: Store) -> None:
    key = make_key(db, daily_tokens=1000)
    results: list[Any] = []
    barrier = threading.Barrier(50)

    def one(i: int) -> None:
        barrier.wait()
        results.append(store.reserve(db, key, f"req_{i}", 133))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(50)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    admitted = [r for r in results if r is None]
    assert len(results) == 50 and len(admitted) == 1000 // 133  # 7: never 8
    assert {r.code for r in results if r is not None} == {"budget_exceeded"}
    assert store.usage_today(db)[key.key_id] == {"requests_today": 7, "tokens_today": 0}  # all still held


def test_settling_frees_what_was_not_used_and_counts_what_was(db: Store) -> None:
    key = make_key(db, daily_tokens=300, max_concurrent=2)
    assert store.reserve(db, key, "a", 200) is None
    refused = store.reserve(db, key, "b", 200)
    assert refused is not None and refused.code == "budget_exceeded" and 1 <= refused.retry_after <= 86400
    assert store.settle(db, "a", 40) is True and store.settle(db, "a", 40) is False  # once
    assert store.reserve(db, key, "b", 200) is None and store.reserve(db, key, "c", 50) is None
    third = store.reserve(db, key, "d", 1)
    assert third is not None and third.code == "concurrency_limited" and third.retry_after == 1
    store.settle(db, "b", 10)
    store.settle(db, "c", 5)
    assert store.usage_today(db)[key.key_id] == {"requests_today": 3, "tokens_today": 55}


def test_rpm_counts_a_sliding_minute_and_says_when_a_place_frees(db: Store) -> None:
    key = make_key(db, rpm=3)
    for i in range(3):
        assert store.reserve(db, key, f"r{i}", 0) is None
        store.settle(db, f"r{i}", 0)
    refused = store.reserve(db, key, "r3", 0)
    assert refused is not None and refused.code == "rate_limited" and 59 <= refused.retry_after <= 60
    other = make_key(db, rpm=3)  # per key
    assert store.reserve(db, other, "o1", 0) is None


def test_revoking_marks_the_row_and_keeps_it(db: Store) -> None:
    key = make_key(db, rpm=1)
    assert store.revoke(db, key.key_id) is True and store.revoke(db, "key_missing") is False
    [loaded] = store.load_all(db)
    assert loaded.key_id == key.key_id and loaded.revoked_at is not None and loaded.limits == key.limits
    assert loaded.refusal(time.time()) is not None


# -- budget periods (issue #38) -------------------------------------------------------------


def _past_day(db: Store, key: ManagedKey, day: str, tokens: int) -> None:
    """Usage of an earlier day of the period, as settled requests leave it."""
    db.run(lambda c: c.execute("INSERT INTO client_key_usage (key_id, day, requests, tokens) VALUES (?, ?, 1, ?)",
                               (key.key_id, day, tokens)))


@pytest.mark.parametrize("period", ["week", "month"])
def test_a_weekly_or_monthly_budget_counts_the_earlier_days_of_its_period(db: Store, period: str) -> None:
    from gateway.keys.periods import period_days, seconds_to_period_end

    now = time.time()
    first, last = period_days(now, period)
    today = time.strftime("%Y-%m-%d", time.gmtime(now))
    key = make_key(db, budget_tokens=1000, budget_period=period)
    if first < today:  # an earlier day of this period already spent 700 (not today's row)
        _past_day(db, key, first, 700)
    _past_day(db, key, "2000-01-01", 10**9)  # long before the period: never counted
    spent = 700 if first < today else 0
    assert store.reserve(db, key, "fits", 1000 - spent) is None
    refused = store.reserve(db, key, "over", 1)
    assert refused is not None and refused.code == "budget_exceeded"
    assert f"per {period}" in refused.message and f"since {first}" in refused.message
    assert refused.retry_after == pytest.approx(seconds_to_period_end(now, period), abs=5)
    assert store.settle(db, "fits", 0) is True  # nothing used: the period's budget is free again
    assert store.reserve(db, key, "after", 1000 - spent) is None


def test_a_day_budget_period_is_todays_usage_alone(db: Store) -> None:
    key = make_key(db, budget_tokens=100)  # budget_period defaults to day
    _past_day(db, key, "2000-01-01", 10**6)
    assert store.reserve(db, key, "a", 100) is None
    assert store.reserve(db, key, "b", 1) is not None
    loaded = next(k for k in store.load_all(db) if k.key_id == key.key_id)
    assert (loaded.limits.budget_tokens, loaded.limits.budget_period) == (100, "day")
