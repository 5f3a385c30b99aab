"""Upstream pool: failover before the first byte, cooldowns that persist, capacity,
cancellation, stickiness. Several simulator instances act as separate upstreams."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from gateway.app import create_app
from gateway.settings import Settings
from gateway.simulator.reply import TEXT
from gateway.simulator.server import create_simulator_app
from gateway.upstream.credential import fingerprint
from tests.conftest import Gateway, ServerLoop, Simulator, wait_for
from tests.drivers import DRIVERS

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def upstreams(server_loop: ServerLoop) -> list[Simulator]:
    return [Simulator(server_loop.serve(create_simulator_app())) for _ in range(3)]


@pytest.fixture(autouse=True)
def _healthy(upstreams: list[Simulator]) -> None:
    for sim in upstreams:
        httpx.delete(sim.url + "/_sim/fault")
        sim.clear()


def fault(sim: Simulator, model: str) -> None:
    httpx.post(sim.url + "/_sim/fault", json={"model": model}).raise_for_status()


def chat_calls(sim: Simulator) -> list[dict[str, Any]]:
    return [r for r in sim.requests() if r["path"].endswith("/chat/completions")]


def gateway_on(server_loop: ServerLoop, data_dir: Path, urls: list[str], **overrides: Any) -> Gateway:
    overrides.setdefault("spill_max_bytes", 1 << 20)  # the journal's bound is reserved on disk
    overrides.setdefault("keepalive_interval", 0.5)
    settings = Settings(upstream_url=urls, data_dir=data_dir, **overrides)
    app = create_app(settings, {name: "default" for name in Settings.model_fields})  # type: ignore[arg-type]
    return Gateway(server_loop.serve(app), app)


def stream_text(gateway: Gateway, model: str = "text;chunk=5", key: str = "k") -> str:
    client = openai.OpenAI(base_url=gateway.base_url, api_key=key, _strict_response_validation=True, max_retries=0)
    with client.chat.completions.stream(model=model, messages=MESSAGES) as stream:
        return stream.get_final_completion().choices[0].message.content or ""


@pytest.mark.parametrize("failure", ["server_error", "rate_limited;retry_after=30", "connect_refused"])
def test_failover_to_a_healthy_upstream(server_loop: ServerLoop, upstreams: list[Simulator], tmp_path: Path, failure: str) -> None:
    bad, good = upstreams[0], upstreams[1]
    bad_url = "http://127.0.0.1:9/v1" if failure == "connect_refused" else bad.url + "/v1"
    if failure != "connect_refused":
        fault(bad, failure)
    gateway = gateway_on(server_loop, tmp_path, [bad_url, good.url + "/v1"])
    for _ in range(4):  # whichever the round-robin picks first, the client sees one clean stream
        assert stream_text(gateway).startswith("Hello from the codebuddy2api simulator.")
    assert len(chat_calls(good)) == 4
    if failure != "connect_refused":
        # the bad one was tried at most once more after its first failure taught the pool
        assert 1 <= len(chat_calls(bad)) <= 2


def test_no_failover_once_bytes_were_sent(server_loop: ServerLoop, upstreams: list[Simulator], tmp_path: Path) -> None:
    a, b = upstreams[0], upstreams[1]
    gateway = gateway_on(server_loop, tmp_path, [a.url + "/v1", b.url + "/v1"], stream_mode="realtime")
    outcome = DRIVERS["chat"](gateway.url, "drop;chunk=3")
    assert not outcome.ok and "upstream_disconnected" in outcome.error
    assert len(chat_calls(a)) + len(chat_calls(b)) == 1


def test_no_failover_on_client_errors_or_content_filter(server_loop: ServerLoop, upstreams: list[Simulator], tmp_path: Path) -> None:
    a, b = upstreams[0], upstreams[1]
    gateway = gateway_on(server_loop, tmp_path, [a.url + "/v1", b.url + "/v1"])
    response = httpx.post(gateway.base_url + "/chat/completions", json={"model": "http_error;status=400", "messages": MESSAGES})
    assert response.status_code == 400 and response.json()["error"]["code"] == "upstream_rejected"
    outcome = DRIVERS["chat"](gateway.url, "content_filter")
    assert outcome.ok and outcome.finish == "content_filter"
    assert len(chat_calls(a)) + len(chat_calls(b)) == 2


def test_every_credential_cooling_gives_the_soonest_retry_after(server_loop: ServerLoop, upstreams: list[Simulator], tmp_path: Path) -> None:
    a, b = upstreams[0], upstreams[1]
    fault(a, "rate_limited;retry_after=40")
    fault(b, "rate_limited;retry_after=9")
    # a keepalive due before both 429s are in would commit the stream's 200 (the error then
    # comes in-stream, by design): on a busy machine two attempts took past 0.5 s once
    gateway = gateway_on(server_loop, tmp_path, [a.url + "/v1", b.url + "/v1"], keepalive_interval=10)
    first = httpx.post(gateway.base_url + "/chat/completions", json={"model": "m", "messages": MESSAGES, "stream": True})
    assert first.status_code == 429
    assert 8 <= int(first.headers["retry-after"]) <= 9
    assert first.json()["error"]["type"] == "rate_limit_error"
    assert len(chat_calls(a)) == 1 and len(chat_calls(b)) == 1
    again = httpx.post(gateway.base_url + "/chat/completions", json={"model": "m", "messages": MESSAGES})
    assert again.status_code == 429 and 1 <= int(again.headers["retry-after"]) <= 9
    assert len(chat_calls(a)) == 1 and len(chat_calls(b)) == 1  # refused without asking upstream
    # cooldowns are per model: another model is still served
    httpx.delete(b.url + "/_sim/fault")
    assert stream_text(gateway, "text")


def test_cooldowns_and_disabled_state_survive_a_restart(server_loop: ServerLoop, upstreams: list[Simulator], tmp_path: Path) -> None:
    a, b = upstreams[0], upstreams[1]
    fault(a, "rate_limited;retry_after=120")
    fault(b, "unauthorized")
    first = gateway_on(server_loop, tmp_path, [a.url + "/v1", b.url + "/v1"], upstream_api_key="sk-up-1")
    response = httpx.post(first.base_url + "/chat/completions", json={"model": "m", "messages": MESSAGES})
    assert response.status_code == 429
    listed = httpx.get(first.url + "/admin/api/credentials", headers=first.admin).json()["credentials"]
    assert {c["upstream"]: (c["disabled"], bool(c["cooldowns"])) for c in listed} == {
        "upstream0": (False, True), "upstream1": (True, False)}
    assert "sk-up-1" not in str(listed) and listed[0]["fingerprint"] == fingerprint("sk-up-1")
    httpx.delete(a.url + "/_sim/fault")
    httpx.delete(b.url + "/_sim/fault")
    for sim in upstreams:
        sim.clear()
    second = gateway_on(server_loop, tmp_path, [a.url + "/v1", b.url + "/v1"], upstream_api_key="sk-up-1")
    refused = httpx.post(second.base_url + "/chat/completions", json={"model": "m", "messages": MESSAGES})
    assert refused.status_code == 429 and int(refused.headers["retry-after"]) > 100
    assert chat_calls(a) == [] and chat_calls(b) == []
    ids = {c["upstream"]: c["id"] for c in httpx.get(second.url + "/admin/api/credentials", headers=second.admin).json()["credentials"]}
    enabled = httpx.post(second.url + f"/admin/api/credentials/{ids['upstream1']}/enable", json={}, headers=second.admin).json()
    assert enabled["disabled"] is False
    assert stream_text(second, "m")  # served by the re-enabled credential; model m still cools on upstream0
    assert len(chat_calls(b)) == 1 and chat_calls(b)[0]["key_fingerprint"] == fingerprint("sk-up-1")
    httpx.post(second.url + f"/admin/api/credentials/{ids['upstream0']}/reset", json={}, headers=second.admin)
    assert all(not c["cooldowns"] for c in httpx.get(second.url + "/admin/api/credentials", headers=second.admin).json()["credentials"])


def test_all_disabled_is_503(server_loop: ServerLoop, upstreams: list[Simulator], tmp_path: Path) -> None:
    fault(upstreams[2], "unauthorized")
    gateway = gateway_on(server_loop, tmp_path, [upstreams[2].url + "/v1"])
    first = httpx.post(gateway.base_url + "/chat/completions", json={"model": "m", "messages": MESSAGES})
    assert first.status_code == 502 and first.json()["error"]["code"] == "upstream_auth_failed"
    second = httpx.post(gateway.base_url + "/messages", json={"model": "m", "max_tokens": 5, "messages": MESSAGES})
    assert second.status_code == 503
    assert second.json() == {"type": "error", "error": {"type": "overloaded_error", "message": second.json()["error"]["message"]}}


def test_capacity_refusal_and_release_under_100_concurrent(server_loop: ServerLoop, upstreams: list[Simulator], tmp_path: Path) -> None:
    gateway = gateway_on(server_loop, tmp_path, [upstreams[0].url + "/v1"], max_concurrent=10)

    async def burst() -> list[int]:
        async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=200)) as client:
            async def one(i: int) -> int:
                body = {"model": "text;chunk=4;delay=0.02", "messages": MESSAGES, "stream": i % 2 == 0}
                response = await client.post(gateway.base_url + "/chat/completions", json=body)
                if response.status_code == 503:
                    assert response.headers["retry-after"] == "1"
                    assert response.json()["error"]["code"] == "capacity_exceeded"
                return response.status_code

            return await asyncio.gather(*[one(i) for i in range(100)])

    statuses = asyncio.run(burst())
    assert set(statuses) == {200, 503}
    assert 10 <= statuses.count(200) < 100
    # a slot is freed when its request's one report runs, just after the client has the
    # last byte: on a busy machine a few are still on their way (a leak would never clear)
    wait_for(lambda: gateway.app.state.relay.in_flight == 0 and gateway.app.state.relay.pool.in_flight == 0,
             timeout=30)
    assert stream_text(gateway)  # capacity is back


def test_client_disconnect_closes_the_upstream_promptly(server_loop: ServerLoop, upstreams: list[Simulator], tmp_path: Path) -> None:
    sim = upstreams[0]
    gateway = gateway_on(server_loop, tmp_path, [sim.url + "/v1"], stream_mode="realtime")
    before = sim.stats()["cancelled"]
    with httpx.stream("POST", gateway.base_url + "/chat/completions", timeout=10,
                      json={"model": "large;size=200000;chunk=100;delay=0.01", "messages": MESSAGES, "stream": True}) as response:
        for _ in zip(range(5), response.iter_lines()):
            pass
        closed_at = time.monotonic()
    # the upstream stream runs 20 s in all (2000 chunks 10 ms apart): cancelled within a
    # few seconds of the client's close it was the disconnect, not the stream's end, that
    # closed it (the bounds catch a relay that reads on; a busy machine is merely slower, #39)
    wait_for(lambda: sim.stats()["cancelled"] > before, timeout=30)
    stats = sim.stats()
    assert stats["cancelled"] == before + 1 and stats["open_streams"] == 0
    assert stats["last_cancel_at"] - closed_at < 5
    wait_for(lambda: gateway.app.state.relay.in_flight == 0, timeout=30)
    assert gateway.app.state.relay.in_flight == 0 and gateway.app.state.relay.pool.in_flight == 0


def test_session_stickiness_keeps_a_conversation_on_one_credential(server_loop: ServerLoop, upstreams: list[Simulator], tmp_path: Path) -> None:
    a, b = upstreams[0], upstreams[1]
    gateway = gateway_on(server_loop, tmp_path, [a.url + "/v1", b.url + "/v1"], session_header="x-session-id",
                         routing="round-robin")
    body = {"model": "text", "messages": MESSAGES}
    for conversation in ("conv-1", "conv-2"):
        for sim in upstreams:
            sim.clear()
        for _ in range(4):
            assert httpx.post(gateway.base_url + "/chat/completions", json=body, headers={"x-session-id": conversation}).status_code == 200
        assert sorted([len(chat_calls(a)), len(chat_calls(b))]) == [0, 4]
    for sim in upstreams:
        sim.clear()
    for _ in range(4):  # without a session: round-robin
        httpx.post(gateway.base_url + "/chat/completions", json=body)
    assert len(chat_calls(a)) == 2 and len(chat_calls(b)) == 2


def test_status_counts_in_flight_by_protocol_and_mode(server_loop: ServerLoop, upstreams: list[Simulator], tmp_path: Path) -> None:
    gateway = gateway_on(server_loop, tmp_path, [upstreams[0].url + "/v1"], stream_mode="realtime")
    with httpx.stream("POST", gateway.base_url + "/messages", timeout=10,
                      json={"model": "text;chunk=2;delay=0.05", "max_tokens": 50, "messages": MESSAGES, "stream": True}) as response:
        lines = response.iter_lines()  # keep a reference: a collected iterator closes the response
        assert next(lines) == "event: message_start"
        status = httpx.get(gateway.url + "/admin/api/status", headers=gateway.admin).json()
        assert status["in_flight"] == 1
        assert status["in_flight_by_protocol"] == {"messages": 1} and status["in_flight_by_mode"] == {"realtime": 1}
    wait_for(lambda: gateway.app.state.relay.in_flight == 0, timeout=30)
    status = httpx.get(gateway.url + "/admin/api/status", headers=gateway.admin).json()
    assert status["in_flight"] == 0 and status["in_flight_by_mode"] == {}


def test_a_credential_an_upstream_401_disabled_heals_by_itself(server_loop: ServerLoop, upstreams: list[Simulator], tmp_path: Path) -> None:
    """The only credential 401s (its key was revoked for a moment): it is probed with
    backoff (GET /models with that key) and re-enabled when it works, no admin needed."""
    # its own simulator: the module's shared ones are probed by earlier tests' gateways, whose
    # probes would consume this fault's count
    sim = Simulator(server_loop.serve(create_simulator_app()))
    httpx.post(sim.url + "/_sim/fault", json={"model": "unauthorized", "count": 3}).raise_for_status()
    gateway = gateway_on(server_loop, tmp_path, [sim.url + "/v1"], upstream_api_key="sk-only",
                         credential_probe_interval=0.2)
    first = httpx.post(gateway.base_url + "/chat/completions", json={"model": "m", "messages": MESSAGES})
    assert first.status_code == 502 and first.json()["error"]["code"] == "upstream_auth_failed"
    second = httpx.post(gateway.base_url + "/chat/completions", json={"model": "m", "messages": MESSAGES})
    assert second.status_code == 503 and second.json()["error"]["code"] == "no_upstream_available"
    (out,) = httpx.get(gateway.url + "/admin/api/credentials", headers=gateway.admin).json()["credentials"]
    assert out["disabled"] and out["disabled_by"] == "upstream" and out["disabled_reason"] == "upstream answered 401"
    assert out["disabled_at"] is not None and out["disabled_at"] <= time.time()
    ready = httpx.get(gateway.url + "/readyz")
    # the reason this test is about (others, such as event_loop_lag on a busy machine, may join it)
    assert ready.status_code == 503 and "no_usable_credential" in [r["code"] for r in ready.json()["reasons"]]

    def credential() -> dict[str, Any]:
        return httpx.get(gateway.url + "/admin/api/credentials", headers=gateway.admin).json()["credentials"][0]

    wait_for(lambda: credential()["probe_failures"] >= 1, timeout=60)  # a hang bound, not a speed
    failing = credential()
    assert failing["disabled"] and failing["last_probe_result"] == "HTTP 401"
    assert failing["next_probe_at"] > failing["last_probe_at"]  # backoff: the next one is scheduled
    wait_for(lambda: not credential()["disabled"], timeout=60)
    healed = credential()
    assert healed["last_probe_result"] == "HTTP 200" and healed["disabled_by"] is None
    assert stream_text(gateway, "text") == TEXT
    # two failing probes, then the one that healed it, all with that key
    probes = [r for r in sim.requests() if r["path"].endswith("/models")]
    assert len(probes) == 3 and {p["key_fingerprint"] for p in probes} == {fingerprint("sk-only")}
    assert "no_usable_credential" not in [r["code"] for r in httpx.get(gateway.url + "/readyz").json().get("reasons", [])]
    # what an admin disabled stays out: never probed
    sim.clear()
    httpx.post(gateway.url + f"/admin/api/credentials/{healed['id']}/disable", json={},
               headers=gateway.admin).raise_for_status()
    time.sleep(1.0)
    assert credential()["disabled"] and credential()["disabled_by"] == "admin"
    assert [r for r in sim.requests() if r["path"].endswith("/models")] == []
