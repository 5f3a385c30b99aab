"""learn_from_failure fed directly (the clock passed in): what each failure marks on the
credential, whether another credential may be tried, and whether the stored state changed
(the pool persists only then)."""

from __future__ import annotations

import pytest

from gateway.errors import GatewayError
from gateway.upstream.credential import ANY_MODEL, Credential, Upstream
from gateway.upstream.failure_lessons import (
    DEFAULT_RATE_LIMIT_COOLDOWN,
    HUNG_PENALTY,
    MODEL_UNAVAILABLE_FOR,
    SERVER_ERROR_PENALTY,
    Lesson,
    learn_from_failure,
)

NOW = 1000.0


def credential() -> Credential:
    return Credential(Upstream("u", "http://u.test/v1"), "sk-test")


def error(status: int | None, code: str = "upstream_error", retry_after: int | None = None,
          detail: str | None = None) -> GatewayError:
    err = GatewayError("upstream", code, "x", retry_after=retry_after, upstream_status=status)
    err.upstream_detail = detail  # type: ignore[attr-defined]
    return err


@pytest.mark.parametrize("status", [401, 403])
def test_a_refused_key_is_disabled_and_persisted(status: int) -> None:
    c = credential()
    assert learn_from_failure(c, "m", error(status), NOW) == Lesson(failover=True, persist=True)
    assert c.disabled and c.disabled_by == "upstream" and c.disabled_at == NOW
    assert c.disabled_reason == f"upstream answered {status}"


def test_a_refusal_naming_the_model_passes_it_over_for_that_model_only() -> None:
    c = credential()
    lesson = learn_from_failure(c, "m", error(403, detail="this key has no access to model 'm'"), NOW)
    assert lesson == Lesson(failover=True, persist=False) and not c.disabled
    assert c.unavailable["m"] == (NOW + MODEL_UNAVAILABLE_FOR, "upstream answered 403")
    assert not c.unavailable_for("other", NOW)


def test_rate_limits_cool_down_and_are_persisted() -> None:
    c = credential()
    assert learn_from_failure(c, "m", error(429, retry_after=7), NOW) == Lesson(failover=True, persist=True)
    assert c.cooldowns == {"m": NOW + 7}
    assert learn_from_failure(c, "n", error(429), NOW).persist
    assert c.cooldowns["n"] == NOW + DEFAULT_RATE_LIMIT_COOLDOWN
    assert learn_from_failure(c, "m", error(503, retry_after=4), NOW).persist
    assert c.cooldowns[ANY_MODEL] == NOW + 4


def test_penalties_are_memory_only_and_a_client_error_is_no_failover() -> None:
    c = credential()
    assert learn_from_failure(c, "m", error(502), NOW) == Lesson(failover=True, persist=False)
    assert c.penalty_until == NOW + SERVER_ERROR_PENALTY
    assert learn_from_failure(c, "m", error(None, code="upstream_timeout"), NOW) == Lesson(failover=True)
    assert c.penalty_until == NOW + HUNG_PENALTY  # no head at all: a hung engine
    c = credential()
    assert learn_from_failure(c, "m", error(400, code="upstream_rejected"), NOW) == Lesson(failover=False)
    assert not c.disabled and not c.cooldowns and c.penalty_until == 0
