"""The pure halves of a key's budget (issue #36): the reservation decision
(gateway/keys/quota.py) and the output cap in every engine's length field
(gateway/keys/output_cap.py). End to end through the SDKs: test_key_budgets.py."""

from __future__ import annotations

from gateway.keys.model import KeyLimits
from gateway.keys.output_cap import answers_of, capped, requested_cap
from gateway.keys.quota import Ask, Counts, Grant, Refusal, decide, quota

NOON = 1_800_000_000.0 - 1_800_000_000.0 % 86400 + 43200  # 12:00 UTC: 43,200 s to midnight


def test_a_request_that_names_no_cap_is_granted_what_remains() -> None:
    limits = KeyLimits(daily_tokens=200)
    granted = decide(limits, Counts(NOON), Ask(input_tokens=30, cap=4096, flexible=True))
    assert isinstance(granted, Grant) and (granted.cap, granted.tokens) == (170, 200)
    assert granted.quota.headers() == {"x-ratelimit-limit-tokens": "200", "x-ratelimit-remaining-tokens": "0",
                                       "x-ratelimit-reset-tokens": "43200s"}
    # with a cap that fits, it is the cap asked for
    small = decide(limits, Counts(NOON, day_tokens=50), Ask(input_tokens=30, cap=100, flexible=True))
    assert isinstance(small, Grant) and (small.cap, small.tokens) == (100, 130)


def test_a_named_cap_that_does_not_fit_is_refused_naming_the_cap_that_would() -> None:
    limits = KeyLimits(daily_tokens=200)
    refused = decide(limits, Counts(NOON, day_tokens=100), Ask(input_tokens=30, cap=150))
    assert isinstance(refused, Refusal) and refused.code == "budget_exceeded"
    assert "send max_tokens <= 70" in refused.message
    assert refused.retry_after == 43200  # the same request fits tomorrow: waiting helps
    never = decide(limits, Counts(NOON), Ask(input_tokens=30, cap=30000))
    assert isinstance(never, Refusal) and never.retry_after is None  # larger than the budget itself
    assert "send max_tokens <= 170" in never.message and "waiting will not help" in never.message


def test_retry_after_only_when_waiting_helps_and_tpm_names_itself() -> None:
    limits = KeyLimits(tpm=300, daily_tokens=10_000)
    busy = Counts(NOON, window_requests=2, window_tokens=250, oldest=NOON - 45, day_tokens=250)
    refused = decide(limits, busy, Ask(input_tokens=20, cap=100))
    assert isinstance(refused, Refusal) and refused.code == "rate_limited" and refused.retry_after == 15
    assert "300 tokens per minute" in refused.message and "send max_tokens <= 30" in refused.message
    too_big = decide(limits, busy, Ask(input_tokens=20, cap=400))  # 420 > tpm: never in one minute
    assert isinstance(too_big, Refusal) and too_big.retry_after is None
    # a flexible request whose input alone is over the limit: nothing to lower, nothing to wait for
    alone = decide(KeyLimits(daily_tokens=100), Counts(NOON), Ask(input_tokens=150, cap=4096, flexible=True))
    assert isinstance(alone, Refusal) and alone.retry_after is None and "input alone" in alone.message
    # a flexible request in a spent day: waiting for midnight helps
    spent = decide(KeyLimits(daily_tokens=100), Counts(NOON, day_tokens=95), Ask(input_tokens=10, cap=50, flexible=True))
    assert isinstance(spent, Refusal) and spent.retry_after == 43200


def test_rpm_and_concurrency_come_first_and_every_answer_has_its_headers() -> None:
    limits = KeyLimits(rpm=5, max_concurrent=1, daily_tokens=1000)
    first = decide(limits, Counts(NOON), Ask(input_tokens=10, cap=90))
    assert isinstance(first, Grant)
    assert first.quota.headers() == {
        "x-ratelimit-limit-requests": "5", "x-ratelimit-remaining-requests": "4", "x-ratelimit-reset-requests": "60s",
        "x-ratelimit-limit-tokens": "1000", "x-ratelimit-remaining-tokens": "900", "x-ratelimit-reset-tokens": "43200s",
    }
    full = Counts(NOON, window_requests=5, oldest=NOON - 20, open_requests=0)
    rpm = decide(limits, full, Ask(input_tokens=10, cap=90))
    assert isinstance(rpm, Refusal) and rpm.code == "rate_limited" and rpm.retry_after == 40
    assert rpm.quota is not None and rpm.quota.headers()["x-ratelimit-remaining-requests"] == "0"
    assert rpm.quota.headers()["x-ratelimit-reset-requests"] == "40s"
    busy = decide(limits, Counts(NOON, window_requests=1, oldest=NOON - 1, open_requests=1), Ask(10, 90))
    assert isinstance(busy, Refusal) and busy.code == "concurrency_limited" and busy.retry_after == 1
    assert quota(KeyLimits(max_concurrent=3), Counts(NOON)).headers() == {}  # no rate, no budget: nothing to show


def test_the_cap_is_the_smallest_length_named_in_any_engines_field() -> None:
    assert requested_cap({"max_tokens": 5, "n_predict": 30000}) == 5
    assert requested_cap({"n_predict": 300}) == 300
    assert requested_cap({"max_new_tokens": 40, "max_completion_tokens": 90}) == 40
    assert requested_cap({"n_predict": -1}) is None and requested_cap({"max_tokens": True}) is None
    assert requested_cap({"min_tokens": 50}) is None


def test_the_granted_cap_goes_into_every_length_field_and_floors_are_clamped() -> None:
    llama = capped({"max_tokens": 5, "n_predict": 30000, "min_tokens": 30000, "ignore_eos": True}, 5)
    assert llama == {"max_tokens": 5, "n_predict": 5, "min_tokens": 5, "ignore_eos": True}
    assert capped({"messages": []}, 170) == {"messages": [], "max_tokens": 170}
    assert capped({"max_completion_tokens": 900}, 100) == {"max_completion_tokens": 100}  # no second OpenAI field
    assert capped({"cache_prompt": True}, 64) == {"cache_prompt": True, "max_tokens": 64, "n_predict": 64}
    assert capped({"max_new_tokens": 10**6, "min_new_tokens": 3, "min_tokens": "many"}, 64) == {
        "max_new_tokens": 64, "min_new_tokens": 3, "max_tokens": 64}
    assert answers_of({"n": 4, "best_of": 6}, "completions") == 6 and answers_of({"n": 4}, "chat") == 1
