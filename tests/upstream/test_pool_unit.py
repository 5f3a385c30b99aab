"""UpstreamPool fed directly with a fake clock: selection, cooldowns, penalties, disabling,
stickiness (no server; the end-to-end pool tests are in test_pool.py)."""

from __future__ import annotations

import pytest

from gateway.errors import GatewayError
from gateway.upstream.failure_lessons import (
    DEFAULT_RATE_LIMIT_COOLDOWN,
    HUNG_PENALTY,
    SERVER_ERROR_PENALTY,
)
from gateway.upstream.pool import Credential, Upstream, UpstreamPool
from gateway.upstream.pool_state import CredentialStateSync


def pool(*keys: str, models: frozenset[str] | None = None) -> tuple[UpstreamPool, list[float]]:
    now = [1000.0]
    upstream = Upstream("u", "http://u.test/v1", models=models)
    return UpstreamPool([Credential(upstream, k) for k in keys], clock=lambda: now[0]), now


def upstream_error(status: int, retry_after: int | None = None, code: str = "upstream_error") -> GatewayError:
    return GatewayError("upstream", code, "x", retry_after=retry_after, upstream_status=status)


def pick(p: UpstreamPool, model: str = "m", **kwargs: object) -> str:
    lease = p.acquire(model, **kwargs)  # type: ignore[arg-type]
    lease.release()
    return lease.credential.api_key or ""


def test_round_robin_and_leases() -> None:
    p, _ = pool("a", "b")
    assert [pick(p) for _ in range(4)] == ["a", "b", "a", "b"]
    lease = p.acquire("m")
    assert p.in_flight == 1
    lease.release()
    lease.release()  # released exactly once
    assert p.in_flight == 0


def test_429_cools_the_model_down_until_retry_after() -> None:
    p, now = pool("a", "b")
    a = p.credentials[0]
    assert p.report_failure(a, "m", upstream_error(429, retry_after=20)) is True
    assert {pick(p) for _ in range(4)} == {"b"} and pick(p, "other") in {"a", "b"}
    now[0] += 21
    assert {pick(p) for _ in range(4)} == {"a", "b"}


def test_429_without_retry_after_uses_the_default_and_all_cooling_says_when() -> None:
    p, now = pool("a")
    p.report_failure(p.credentials[0], "m", upstream_error(429))
    with pytest.raises(GatewayError) as caught:
        p.acquire("m")
    assert caught.value.kind == "rate_limit" and caught.value.retry_after == int(DEFAULT_RATE_LIMIT_COOLDOWN)
    now[0] += DEFAULT_RATE_LIMIT_COOLDOWN + 1
    assert pick(p) == "a"


def test_retry_after_is_the_cooldown_left_rounded_up() -> None:
    p, now = pool("a")
    p.report_failure(p.credentials[0], "m", upstream_error(429, retry_after=11))
    told = []
    for elapsed in (0.0, 0.3, 0.9996, 1.0, 1.2, 10.0, 10.9999):
        now[0] = 1000.0 + elapsed
        with pytest.raises(GatewayError) as caught:
            p.acquire("m")
        told.append(caught.value.retry_after)
    assert told == [11, 11, 11, 10, 10, 1, 1]
    now[0] = 1011.0
    assert pick(p) == "a"


def test_a_5xx_is_a_penalty_not_a_refusal() -> None:
    p, now = pool("a", "b")
    p.report_failure(p.credentials[0], "m", upstream_error(500))
    assert {pick(p) for _ in range(4)} == {"b"}
    p.credentials[1].disabled = True
    assert pick(p) == "a"  # penalised, yet still used when nothing healthier is left
    p.credentials[1].disabled = False
    now[0] += SERVER_ERROR_PENALTY + 0.1
    assert {pick(p) for _ in range(4)} == {"a", "b"}


def test_401_disables_and_a_client_error_teaches_nothing() -> None:
    p, _ = pool("a", "b")
    assert p.report_failure(p.credentials[0], "m", upstream_error(401)) is True
    assert p.credentials[0].disabled and {pick(p) for _ in range(3)} == {"b"}
    assert p.report_failure(p.credentials[1], "m", upstream_error(400, code="upstream_rejected")) is False
    p.credentials[1].disabled = True
    with pytest.raises(GatewayError) as caught:
        p.acquire("m")
    assert caught.value.code == "no_upstream_available"


def test_unknown_model_and_exhausted_failover() -> None:
    p, _ = pool("a", models=frozenset({"m"}))
    with pytest.raises(GatewayError) as caught:
        p.acquire("other")
    assert caught.value.code == "model_not_available"
    with pytest.raises(GatewayError) as caught:
        p.acquire("m", exclude={p.credentials[0].id})
    assert caught.value.code == "failover_exhausted"


def test_stickiness_keeps_a_session_while_it_is_healthy() -> None:
    p, _ = pool("a", "b", "c")
    first = pick(p, session="s1")
    assert [pick(p, session="s1") for _ in range(3)] == [first] * 3
    p.report_failure(next(c for c in p.credentials if c.api_key == first), "m", upstream_error(500))
    moved = pick(p, session="s1")
    assert moved != first and pick(p, session="s1") == moved


# -- CredentialStateSync alone (gateway/upstream/pool_state.py) -----------------------------


class VersionedStore:
    """A store that numbers its rows (as the SQL one does) and can be made to fail."""

    def __init__(self, rows: dict[str, tuple[int, dict]] | None = None) -> None:
        self.rows = dict(rows or {})
        self.failing = False

    def load(self) -> dict[str, dict]:
        return {k: state for k, (_, state) in self.rows.items()}

    def load_versions(self) -> dict[str, tuple[int, dict]]:
        return dict(self.rows)

    def save(self, credential_id: str, state: dict) -> int:
        if self.failing:
            raise OSError("disk gone")
        version = self.rows.get(credential_id, (0, {}))[0] + 1
        self.rows[credential_id] = (version, state)
        return version


class FakeWriter:
    def __init__(self) -> None:
        self.busy: set[str] = set()
        self.submitted: list[tuple[str, dict]] = []

    def submit(self, credential_id: str, state: dict) -> None:
        self.submitted.append((credential_id, state))


def test_state_sync_adopts_only_rows_newer_than_its_own_write() -> None:
    credential = Credential(Upstream("u", "http://u.test/v1"), "sk-a")
    store = VersionedStore()
    sync = CredentialStateSync(store, clock=lambda: 1000.0)
    credential.disabled, credential.disabled_reason, credential.disabled_by = True, "by admin", "admin"
    sync.persist(credential)  # written now (no writer): version 1, remembered
    stale = {credential.id: (1, {"disabled": False})}
    sync.adopt([credential], stale)
    assert credential.disabled  # our own write is not undone by the same version read back
    sync.adopt([credential], {credential.id: (2, {"disabled": False, "cooldowns": {"m": 1060}})})
    assert not credential.disabled and credential.cooldowns == {"m": 1060.0}


def test_state_sync_skips_a_credential_whose_newer_change_is_still_queued() -> None:
    credential = Credential(Upstream("u", "http://u.test/v1"), "sk-a")
    sync = CredentialStateSync(VersionedStore(), clock=lambda: 1000.0)
    sync.writer = writer = FakeWriter()
    credential.cooldowns = {"m": 1030.0, "old": 900.0}
    sync.persist(credential)
    assert writer.submitted == [(credential.id, {
        "disabled": False, "disabled_reason": None, "disabled_by": None, "disabled_at": None,
        "cooldowns": {"m": 1030.0},  # an expired cooldown is not persisted; the key never is
    })]
    writer.busy.add(credential.id)
    sync.adopt([credential], {credential.id: (7, {"disabled": True, "disabled_reason": "x"})})
    assert not credential.disabled
    writer.busy.clear()
    sync.adopt([credential], {credential.id: (7, {"disabled": True, "disabled_reason": "upstream answered 401"})})
    assert credential.disabled and credential.disabled_by == "upstream"  # inferred from an old row's reason


def test_state_sync_restores_from_a_plain_store_and_survives_a_failing_save() -> None:
    credential = Credential(Upstream("u", "http://u.test/v1"), "sk-a")

    class PlainStore:
        def load(self) -> dict[str, dict]:
            return {credential.id: {"disabled": True, "disabled_reason": "retired"}}

        def save(self, credential_id: str, state: dict) -> None:
            raise OSError("read-only")

    sync = CredentialStateSync(PlainStore(), clock=lambda: 1000.0)
    sync.restore([credential])
    assert credential.disabled and credential.disabled_by == "admin"
    credential.disabled = False
    sync.persist(credential)  # the store refuses: logged, and memory still holds the change
    assert not credential.disabled


def test_a_head_that_never_came_puts_the_credential_last_for_a_minute_not_five_seconds() -> None:
    """A hung engine (no response head within --first-byte-timeout) costs each request it
    takes that whole timeout before failover: it is tried last for HUNG_PENALTY (issue #40).
    An upstream 504 (it did answer) stays a 5xx penalty."""
    p, now = pool("a", "b")
    hung = GatewayError("timeout", "upstream_timeout", "the upstream did not answer in time")
    assert p.report_failure(p.credentials[0], "m", hung) is True  # failover to another
    now[0] += SERVER_ERROR_PENALTY + 0.1
    assert {pick(p) for _ in range(4)} == {"b"}  # past a 5xx's penalty, still last
    p.credentials[1].disabled = True
    assert pick(p) == "a"  # still used when nothing healthier is left
    p.credentials[1].disabled = False
    now[0] += HUNG_PENALTY
    assert {pick(p) for _ in range(4)} == {"a", "b"}
    p.report_failure(p.credentials[0], "m", upstream_error(504, code="upstream_timeout"))
    assert p.credentials[0].penalty_until == now[0] + SERVER_ERROR_PENALTY
