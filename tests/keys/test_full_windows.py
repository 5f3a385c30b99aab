"""Keys past their rpm, remembered (gateway/keys/full_windows.py), fed directly."""

from __future__ import annotations

from gateway.keys.full_windows import MAX_KEYS, FullWindows
from gateway.keys.model import KeyLimits, ManagedKey
from gateway.keys.quota import Ask, Counts, Quota, Refusal, decide


def key(key_id: str = "k1", rpm: int = 1) -> ManagedKey:
    return ManagedKey(key_id=key_id, name=key_id, prefix="sk-cb2a-", secret_hash="h" + key_id, limits=KeyLimits(rpm=rpm),
                      created_at=0.0)


def test_a_full_rpm_window_says_until_when_it_holds() -> None:
    refusal = decide(KeyLimits(rpm=2), Counts(now=1000.0, window_requests=2, oldest=970.0), Ask())
    assert isinstance(refusal, Refusal) and refusal.code == "rate_limited"
    assert refusal.holds_until == 1030.0 and refusal.retry_after == 30
    budget = decide(KeyLimits(daily_tokens=10), Counts(now=1000.0, day_tokens=10), Ask(cap=5))
    assert isinstance(budget, Refusal) and budget.holds_until is None  # a settlement may free it early
    busy = decide(KeyLimits(max_concurrent=1), Counts(now=1000.0, open_requests=1), Ask())
    assert isinstance(busy, Refusal) and busy.holds_until is None  # an answer ending frees it


def test_the_refusal_is_answered_from_memory_until_then_counting_down() -> None:
    windows, k = FullWindows(), key()
    quota = Quota(limit_requests=1, remaining_requests=0, reset_requests=30)
    windows.note(k, Refusal("rate_limited", "limited to 1 requests per minute", 30, quota, holds_until=1030.0))
    later = windows.refusal(k, 1020.5)
    assert later is not None and later.retry_after == 10 and later.message == "limited to 1 requests per minute"
    assert later.quota is not None and later.quota.headers()["x-ratelimit-reset-requests"] == "10s"
    assert later.quota.headers()["x-ratelimit-remaining-requests"] == "0"
    assert windows.refusal(k, 1030.0) is None  # the oldest request left the window: the store decides again
    assert windows.refusal(k, 1020.0) is None  # and it was forgotten


def test_other_refusals_and_changed_limits_are_not_remembered() -> None:
    windows, k = FullWindows(), key()
    windows.note(k, Refusal("budget_exceeded", "daily budget", 3600))
    assert windows.refusal(k, 0.0) is None
    windows.note(k, Refusal("rate_limited", "rpm", 30, holds_until=100.0))
    assert windows.refusal(key(rpm=5), 50.0) is None  # its limits changed (PATCH): ask the store
    assert windows.refusal(k, 50.0) is None  # forgotten with it


def test_memory_is_bounded() -> None:
    windows = FullWindows()
    for i in range(MAX_KEYS + 5):
        windows.note(key(f"k{i}"), Refusal("rate_limited", "rpm", 30, holds_until=100.0))
    assert windows.refusal(key("k0"), 1.0) is None  # the oldest went first
    assert windows.refusal(key(f"k{MAX_KEYS + 4}"), 1.0) is not None
