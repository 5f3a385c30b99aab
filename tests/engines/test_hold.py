"""EngineHold and the fleet's engine list, fed directly (no server)."""

from __future__ import annotations

import asyncio

import pytest

from gateway.engines.control import engine_root
from gateway.engines.fleet import fleet_of
from gateway.engines.hold import EngineHold
from gateway.errors import GatewayError
from gateway.upstream.credential import Credential, Upstream
from gateway.upstream.pool import UpstreamPool


async def test_a_closed_hold_keeps_calls_until_opened_and_counts_them() -> None:
    counts: list[int] = []
    hold = EngineHold(on_held=counts.append)
    assert not hold.holds("vllm") and not hold.closed
    hold.close()
    assert hold.holds("vllm") and not hold.holds(None)  # an upstream without an engine API is never held
    waiting = [asyncio.create_task(hold.wait(name, 5)) for name in ("a", "a", "b")]
    async with asyncio.timeout(5):
        while hold.held_total < 3:
            await asyncio.sleep(0)
    assert hold.held == {"a": 2, "b": 1} and not any(t.done() for t in waiting)
    assert hold.open() == 3
    async with asyncio.timeout(5):
        await asyncio.gather(*waiting)
    assert hold.held == {} and counts == [1, 2, 3, 2, 1, 0]


async def test_a_wait_past_its_bound_is_engine_paused_and_no_longer_counted() -> None:
    hold = EngineHold()
    hold.close()
    with pytest.raises(GatewayError) as caught:
        await hold.wait("a", 0.05)
    err = caught.value
    assert (err.kind, err.code, err.status, err.retry_after) == ("overloaded", "engine_paused", 503, 1)
    assert "--engine-pause-max" in err.message and hold.held_total == 0 and hold.closed


async def test_a_cancelled_wait_is_no_longer_counted() -> None:
    hold = EngineHold()
    hold.close()
    task = asyncio.create_task(hold.wait("a", 5))
    async with asyncio.timeout(5):
        while not hold.held_total:
            await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert hold.held == {}


def test_the_fleet_is_the_upstreams_with_an_engine_api_once_each_with_a_key() -> None:
    vllm = Upstream("v", "http://u:p@h:8000/v1/", headers={"x-team": "rl"}, engine_api="vllm")
    plain = Upstream("plain", "http://h:9000/v1")
    pool = UpstreamPool([Credential(vllm, None), Credential(vllm, "sk-1"), Credential(vllm, "sk-2"), Credential(plain, "k")])
    [engine] = fleet_of(pool)
    assert (engine.name, engine.root, engine.url) == ("v", "http://u:p@h:8000", "http://h:8000")
    assert engine.headers == {"x-team": "rl", "authorization": "Bearer sk-1"}
    assert "sk-1" not in repr(engine)
    assert engine_root("http://h/v1") == "http://h" and engine_root("http://h/api") == "http://h/api"
