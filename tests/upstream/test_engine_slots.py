"""An engine's own concurrency (``max_in_flight`` in its ``[[upstreams]]`` table, issue
#40): past it, requests wait in the gateway, before their first-byte timer starts, rather
than in the engine's queue (where a llama-server with ``--parallel N`` made the 64th
stream wait out most of the first-byte limit); a wait past ``queue_timeout`` is the
retryable 503. Against the simulator on loopback."""

from __future__ import annotations

import asyncio
import secrets
import threading
from typing import Any

import httpx
import openai
import pytest

from gateway.simulator.reply import TEXT
from gateway.upstream.credential import Credential, Upstream
from gateway.upstream.engine_slots import EngineSlots
from gateway.upstream.pool import UpstreamPool
from tests.conftest import Gateway, ServerLoop, Simulator, start_gateway, wait_for

SLOW = "text;chunk=4;delay=0.05"  # 27 chunks, 50 ms apart: each answer takes >= 1.3 s upstream
STREAM_SECONDS = 1.3


def engine_gateway(server_loop: ServerLoop, simulator: Simulator, tmp_path_factory: pytest.TempPathFactory,
                   table: str, **settings: Any) -> Gateway:
    config = tmp_path_factory.mktemp("engine") / "gateway.toml"
    config.write_text(f'[[upstreams]]\nname = "llama"\nbase_url = "{simulator.url}/v1"\n{table}\n')
    return start_gateway(server_loop, simulator, tmp_path_factory, upstream_url=[], config=config, **settings)


def sdk(gateway: Gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.base_url, api_key="unused", _strict_response_validation=True, max_retries=0,
                         timeout=60)


def arrivals(simulator: Simulator, nonce: str) -> list[float]:
    return sorted(r["at"] for r in simulator.requests()
                  if r["path"].endswith("/chat/completions") and nonce in str(r["body"]))


def test_requests_past_max_in_flight_wait_in_the_gateway_not_on_their_first_byte_timer(
    server_loop: ServerLoop, simulator: Simulator, tmp_path_factory: pytest.TempPathFactory
) -> None:
    # the third stream waits two whole answers in the gateway: longer than its first-byte limit
    gateway = engine_gateway(server_loop, simulator, tmp_path_factory, "max_in_flight = 1", first_byte_timeout=1.0)
    nonce = secrets.token_hex(6)
    texts: dict[int, str] = {}
    errors: list[BaseException] = []

    def stream(n: int) -> None:
        try:
            with sdk(gateway).chat.completions.stream(
                model=SLOW, messages=[{"role": "user", "content": f"{nonce} {n}"}]
            ) as events:
                texts[n] = events.get_final_completion().choices[0].message.content or ""
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=stream, args=(n,)) for n in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == [] and texts == {0: TEXT, 1: TEXT, 2: TEXT}
    at = arrivals(simulator, nonce)
    assert len(at) == 3  # one upstream request each: no failover, no retry
    # one at a time at the engine: each was sent once the one before had ended
    assert all(b - a >= STREAM_SECONDS - 0.3 for a, b in zip(at, at[1:])), at


def test_a_wait_past_queue_timeout_is_the_retryable_503(
    server_loop: ServerLoop, simulator: Simulator, tmp_path_factory: pytest.TempPathFactory
) -> None:
    gateway = engine_gateway(server_loop, simulator, tmp_path_factory, "max_in_flight = 1\nqueue_timeout = 0.3")
    nonce = secrets.token_hex(6)
    # the slot's holder streams for ~11 s (54 chunks 0.2 s apart): the second request must find
    # it still busy however slowly a busy machine sends it (at 0.1 s apart it once had ended)
    long = threading.Thread(target=lambda: sdk(gateway).chat.completions.create(
        model="text;chunk=2;delay=0.2", messages=[{"role": "user", "content": f"{nonce} long"}]))
    long.start()
    try:
        wait_for(lambda: len(arrivals(simulator, nonce)) == 1, timeout=10)
        refused = httpx.post(gateway.base_url + "/chat/completions", timeout=30,
                             json={"model": SLOW, "stream": True, "messages": [{"role": "user", "content": f"{nonce} 2"}]})
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        error = refused.json()["error"]
        assert error["code"] == "upstream_capacity" and "queue_timeout" in error["message"]
        assert set(error) == {"message", "type", "param", "code"}
        assert len(arrivals(simulator, nonce)) == 1  # nothing went upstream for it
    finally:
        long.join(60)


def test_an_engines_slots_count_over_all_its_keys() -> None:
    engine = Upstream("llama", "http://127.0.0.1:9/v1", max_in_flight=2, queue_timeout=7.0)
    other = Upstream("vllm", "http://127.0.0.1:8/v1")
    pool = UpstreamPool([Credential(engine, "k1"), Credential(engine, "k2"), Credential(other, None)])
    a, b = pool.credentials[0], pool.credentials[1]
    a.in_flight = 1
    assert not pool.slots.full(a)
    b.in_flight = 1
    assert pool.slots.full(a) and pool.slots.full(b) and not pool.slots.full(pool.credentials[2])
    assert pool.waits_for_slot("m") is None  # the other engine is free: no wait
    assert pool.acquire("m").credential is pool.credentials[2]
    assert pool.waits_for_slot("m", {pool.credentials[2].id}) == 7.0  # only the full engine is left


def test_engine_slots_wait_only_while_every_ready_credential_is_on_a_full_engine() -> None:
    """EngineSlots fed directly: the wait bound is the longest queue_timeout among the full
    engines, and none while one ready credential's engine has room (or nothing is ready)."""
    short = Upstream("a", "http://127.0.0.1:9/v1", max_in_flight=1, queue_timeout=2.0)
    long = Upstream("b", "http://127.0.0.1:8/v1", max_in_flight=1, queue_timeout=9.0)
    free = Upstream("c", "http://127.0.0.1:7/v1")  # no max_in_flight: never full
    a, b, c = Credential(short, "k1"), Credential(long, "k2"), Credential(free, "k3")
    slots = EngineSlots([a, b, c])
    assert slots.wait_bound([]) is None
    assert slots.wait_bound([a, b]) is None  # both engines have room
    a.in_flight = 1
    assert slots.full(a) and not slots.full(b)
    assert slots.wait_bound([a, b]) is None  # b's engine has room: no wait
    assert slots.wait_bound([a]) == 2.0
    b.in_flight = 1
    assert slots.wait_bound([a, b]) == 9.0  # the longest queue_timeout among the full ones
    c.in_flight = 50
    assert not slots.full(c) and slots.wait_bound([a, b, c]) is None


async def test_engine_slots_wake_every_waiter_once_per_release() -> None:
    """A release sets the event every waiting call holds, and the next wait gets a new one."""
    slots = EngineSlots([])
    first = slots.freed()
    assert slots.freed() is first and not first.is_set()  # waiters share one event
    waiters = [asyncio.create_task(first.wait()) for _ in range(3)]
    await asyncio.sleep(0)
    slots.released()
    async with asyncio.timeout(5):
        assert await asyncio.gather(*waiters) == [True, True, True]
    second = slots.freed()
    assert second is not first and not second.is_set()
    slots.released()
    slots.released()  # with no waiter: nothing to set, no error
    assert second.is_set()
