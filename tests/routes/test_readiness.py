"""Readiness reasons from the app's state, fed directly (each condition on its own), and
what each does to ``/readyz``: degraded (200, still served) or unready (503)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from gateway.routes.readiness import reasons, status
from gateway.upstream.credential import ANY_MODEL, Credential, Upstream
from gateway.upstream.pool import UpstreamPool


def state(**overrides: Any) -> SimpleNamespace:
    credential = Credential(Upstream("u", "http://127.0.0.1:1/v1"), "sk-x")
    durable = SimpleNamespace(store_writable=True, store_error=None, failing_since=None, spill_entries=0,
                              journal=None, unrecordable=lambda: None)
    audit = SimpleNamespace(depth=0, max_queue=10_000)
    values: dict[str, Any] = dict(
        ready=True, shutting_down=False,
        observability=SimpleNamespace(durable=durable, audit=audit),
        relay=SimpleNamespace(pool=UpstreamPool([credential], clock=lambda: 1000.0)),
    )
    values.update(overrides)
    return SimpleNamespace(**values)


def codes(s: SimpleNamespace) -> list[str]:
    return [r["code"] for r in reasons(s)]


def impacts(s: SimpleNamespace) -> dict[str, str]:
    return {r["code"]: r["impact"] for r in reasons(s)}


def test_each_condition_is_its_own_reason() -> None:
    assert codes(state()) == []
    assert codes(state(ready=False)) == ["starting"]
    assert codes(state(shutting_down=True)) == ["shutting_down"]
    s = state()
    s.observability.durable.store_writable, s.observability.durable.store_error = False, "OperationalError"
    s.observability.durable.spill_entries = 3
    assert codes(s) == ["store_unwritable", "spill_in_use"]
    assert "OperationalError" in reasons(s)[0]["message"] and reasons(s)[1]["spill_entries"] == 3
    s = state()
    s.observability.audit.depth = 7_999
    assert codes(s) == []
    s.observability.audit.depth = 8_000
    assert codes(s) == ["audit_queue_near_bound"]
    s = state()
    (credential,) = s.relay.pool.credentials
    credential.cooldowns[ANY_MODEL] = 1010.0  # cooling for every model
    assert codes(s) == ["no_usable_credential"]
    credential.cooldowns.clear()
    credential.disabled = True
    assert codes(s) == ["no_usable_credential"]


def test_an_exhausted_upstream_pool_is_a_reason_until_connections_free() -> None:
    import time

    from gateway.upstream.client import UpstreamClient
    from gateway.upstream.connections import POOL_EXHAUSTED_HOLD

    client = UpstreamClient(max_connections=2)
    s = state()
    s.relay.upstream = client
    assert codes(s) == []
    client.open_responses = 2  # every connection holds an open upstream response
    assert codes(s) == ["upstream_pool_exhausted"]
    assert "2 of 2" in reasons(s)[0]["message"]
    client.open_responses = 1
    assert codes(s) == []
    client._pool_timeout_at = time.monotonic()  # a request just waited for one in vain
    assert codes(s) == ["upstream_pool_exhausted"]
    client._pool_timeout_at = time.monotonic() - POOL_EXHAUSTED_HOLD - 0.1
    assert codes(s) == []


def test_event_loop_lag_over_the_bound_is_a_reason_for_the_hold_then_clears() -> None:
    from gateway.observability.loop_lag import HOLD, LoopLagMonitor

    now = [100.0]
    monitor = LoopLagMonitor(bound=0.5, clock=lambda: now[0])
    s = state(loop_lag=monitor)
    monitor.note(0.4, tasks=3)
    assert codes(s) == [] and monitor.tasks == 3
    monitor.note(1.25)
    now[0] += 1.0
    monitor.note(0.01)  # back to normal, but the lagging sample is recent
    (reason,) = reasons(s)
    assert reason["code"] == "event_loop_lag" and "1.250 s late" in reason["message"]
    assert reason["lag_seconds"] == 0.01
    now[0] += HOLD
    assert codes(s) == [] and monitor.worst == 1.25


def test_a_store_outage_is_degraded_and_only_what_cannot_be_served_is_red() -> None:
    """A store shared by every replica that fails must not take them all out of rotation
    while they still answer (issue #40): degraded, 200. Red only for what cannot be served."""
    assert status(reasons(state())) == ("ready", 200)
    s = state()
    s.observability.durable.store_writable, s.observability.durable.spill_entries = False, 40
    s.observability.audit.depth = 9_000
    assert impacts(s) == {"store_unwritable": "degraded", "spill_in_use": "degraded", "audit_queue_near_bound": "degraded"}
    assert status(reasons(s)) == ("degraded", 200)
    s.observability.durable.unrecordable = lambda: "the store cannot write and the spill journal is full"
    assert impacts(s)["recording_unavailable"] == "unready"  # requests are refused now
    assert status(reasons(s)) == ("not_ready", 503)
    s.live = SimpleNamespace(current=SimpleNamespace(serve_unrecorded=True))  # ... unless served unrecorded
    assert impacts(s)["recording_unavailable"] == "degraded" and status(reasons(s)) == ("degraded", 200)
    s = state()
    s.observability.durable.journal = SimpleNamespace(reserved=False, max_bytes=1 << 20, reserve_error="No space left")
    assert impacts(s) == {"spill_not_reserved": "unready"}
    for unready in (state(ready=False), state(shutting_down=True)):
        assert status(reasons(unready)) == ("not_ready", 503)
    s = state()
    s.observability.durable.store_writable = False
    (credential,) = s.relay.pool.credentials
    credential.disabled = True  # nothing can be served: red, whatever else is degraded
    assert impacts(s) == {"store_unwritable": "degraded", "no_usable_credential": "unready"}
    assert status(reasons(s)) == ("not_ready", 503)
