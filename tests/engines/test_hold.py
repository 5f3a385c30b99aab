"""EngineHold, the fleet's engine list and its wait for an engine to accept again, fed
directly (no server; the engine on httpx.MockTransport)."""

from __future__ import annotations

import asyncio
import dataclasses

import httpx
import pytest

from gateway.engines.control import EngineControl, engine_root
from gateway.engines.fleet import EngineFleet, fleet_of
from gateway.engines.hold import EngineHold
from gateway.errors import GatewayError
from gateway.generation.policy import StreamPolicy
from gateway.settings import Settings
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


def _fleet(answers: list[bool]) -> tuple[EngineFleet, Credential, list[str]]:
    """A fleet over one vLLM credential whose /is_paused answers ``answers`` in turn
    (then false); the paths asked, in order."""
    asked: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        asked.append(request.url.path)
        if request.url.path == "/weight_info":
            return httpx.Response(200, json={"weight_version": "v7"})
        return httpx.Response(200, json={"is_paused": answers.pop(0) if answers else False})

    credential = Credential(Upstream("v", "http://engine:8000/v1", engine_api="vllm"), "sk-1")
    control = EngineControl(httpx.AsyncClient(transport=httpx.MockTransport(handler)))
    return EngineFleet(lambda: UpstreamPool([credential]), control, EngineHold()), credential, asked


async def test_calls_waiting_for_an_engine_share_one_is_paused_poller() -> None:
    fleet, credential, asked = _fleet([True, True, True])
    policy = dataclasses.replace(StreamPolicy.snapshot(Settings()), engine_pause_max=5.0)
    async with asyncio.timeout(5):
        versions = await asyncio.gather(*(fleet.accepting(credential, policy) for _ in range(5)))
    # one poller: three "paused", then "not paused", then the version the continuations will run on
    assert asked == ["/is_paused"] * 4 + ["/weight_info"] and versions == ["v7"] * 5


async def test_an_engine_that_stays_paused_is_engine_paused_after_the_bound() -> None:
    fleet, credential, asked = _fleet([True] * 1000)
    policy = dataclasses.replace(StreamPolicy.snapshot(Settings()), engine_pause_max=0.2)
    with pytest.raises(GatewayError) as caught:
        async with asyncio.timeout(5):
            await fleet.accepting(credential, policy)
    assert caught.value.code == "engine_paused" and len(asked) >= 2
    await fleet.aclose()
    plain = Credential(Upstream("p", "http://plain:8000/v1"), None)  # no engine API: asked at once
    async with asyncio.timeout(5):
        await fleet.accepting(plain, policy)


async def test_an_engine_silent_at_start_up_is_asked_its_version_again_until_it_answers(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine still loading its weights fails the start-up read: the fleet asks again with
    backoff (not once and never again), so calls before the trainer's first resume still get
    a weight version; once known, it stops asking, and ``aclose`` ends a reader still trying."""
    monkeypatch.setattr("gateway.engines.fleet.VERSION_RETRY_FIRST", 0.01)
    asked: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        asked.append(request.url.host)
        if request.url.host == "loading" and len([h for h in asked if h == "loading"]) <= 3:
            return httpx.Response(503, json={"error": "loading weights"})
        return httpx.Response(200, json={"weight_version": f"{request.url.host}-v1"})

    def credential(host: str) -> Credential:
        return Credential(Upstream(host, f"http://{host}:8000/v1", engine_api="vllm"), "sk-1")

    control = EngineControl(httpx.AsyncClient(transport=httpx.MockTransport(handler)))
    fleet = EngineFleet(lambda: UpstreamPool([credential("ready"), credential("loading")]), control, EngineHold())
    await fleet.learn_versions()
    assert fleet.versions == {"ready": "ready-v1"}  # the start-up read: one answered, one did not
    async with asyncio.timeout(5):
        while "loading" not in fleet.versions:
            await asyncio.sleep(0.01)
    assert fleet.versions == {"ready": "ready-v1", "loading": "loading-v1"}
    await asyncio.sleep(0.1)
    assert asked.count("ready") == 1 and asked.count("loading") == 4  # no read once known
    assert fleet.track(credential("loading")).versions == [{"version": "loading-v1", "from_token": 0}]

    never = EngineFleet(lambda: UpstreamPool([credential("down")]), EngineControl(httpx.AsyncClient(
        transport=httpx.MockTransport(lambda request: httpx.Response(503)))), EngineHold())
    await never.learn_versions()
    [asker] = never._askers
    await never.aclose()
    assert asker.cancelled() and never.versions == {}
