"""A gateway-held weight sync, end to end (docs/weight-sync.md): the admin API pauses the
simulator's vLLM dev RL API mid-run while the official SDKs (strict) stream through the
gateway; no client sees anything but whole answers, and no call reaches the engine while
it is paused. An engine that stays paused past --engine-pause-max: engine_paused, one
audit record per call."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import anthropic
import httpx
import openai
import pytest
from websockets.exceptions import ConnectionClosedOK

from gateway.simulator.server import TEXT, create_simulator_app
from tests.conftest import Gateway, ServerLoop, Simulator, start_gateway, wait_for
from tests.protocols.test_responses_ws import exchange, open_ws

#: 52 two-character chunks, 20 ms apart: the calls are mid-answer when the pause comes.
SLOW = "text;chunk=2;delay=0.02"
USER = [{"role": "user", "content": "hi"}]


def engine_gateway(server_loop: ServerLoop, tmp_path_factory: pytest.TempPathFactory,
                   **overrides: Any) -> tuple[Gateway, Simulator]:
    """A simulator of its own (its pause must not reach other tests) behind a gateway that
    knows it as a vLLM engine (--engine-api vllm)."""
    simulator = Simulator(server_loop.serve(create_simulator_app()))
    gateway = start_gateway(server_loop, simulator, tmp_path_factory, engine_api="vllm", **overrides)
    # the gateway asks the engine its weight version at start-up, bounded to 2 s: on a loaded
    # machine that read can run out, and a call admitted meanwhile starts with no version.
    # A status read learns it too: the tests start once the gateway knows it.
    wait_for(lambda: all(e["weight_version"] for e in engines(gateway)["engines"]), timeout=30)
    return gateway, simulator


def engine_state(simulator: Simulator) -> dict[str, Any]:
    return httpx.get(simulator.url + "/_sim/engine").json()  # type: ignore[no-any-return]


def chat_call(gateway: Gateway) -> tuple[str, str | None]:
    client = openai.OpenAI(base_url=gateway.base_url, api_key="x", max_retries=0, timeout=30,
                           _strict_response_validation=True)
    with client.chat.completions.stream(model=SLOW, messages=USER) as stream:  # type: ignore[arg-type]
        final = stream.get_final_completion()
    return final.choices[0].message.content or "", final.choices[0].finish_reason


def messages_call(gateway: Gateway) -> tuple[str, str | None]:
    client = anthropic.Anthropic(base_url=gateway.url, api_key="x", max_retries=0, timeout=30,
                                 _strict_response_validation=True)
    with client.messages.stream(model=SLOW, max_tokens=256, messages=USER) as stream:  # type: ignore[arg-type]
        final = stream.get_final_message()
    text = "".join(block.text for block in final.content if block.type == "text")
    return text, final.stop_reason


def responses_call(gateway: Gateway) -> tuple[str, str | None]:
    client = openai.OpenAI(base_url=gateway.base_url, api_key="x", max_retries=0, timeout=30,
                           _strict_response_validation=True)
    with client.responses.stream(model=SLOW, input="hi") as stream:
        final = stream.get_final_response()
    return final.output_text, final.status


#: What each protocol's finished answer says (finish_reason, stop_reason, status).
FINISHED = {chat_call: "stop", messages_call: "end_turn", responses_call: "completed"}


def metric(gateway: Gateway, line_start: str) -> float:
    text = httpx.get(gateway.url + "/metrics").text
    return float(next(line for line in text.splitlines() if line.startswith(line_start)).rsplit(" ", 1)[1])


def engines(gateway: Gateway) -> dict[str, Any]:
    return httpx.get(gateway.url + "/admin/api/engines", headers=gateway.admin).json()  # type: ignore[no-any-return]


def answered_listing(gateway: Gateway, held: int) -> dict[str, Any]:
    """The engines listing once ``held`` calls wait and every engine answered its status read
    (that read has its own 2 s bound, which a loaded machine can outlast: then its ``error``
    says so, and the next read is asked)."""
    found: dict[str, Any] = {}

    def answered() -> bool:
        found.update(engines(gateway))
        return found["held"] == held and all(e["error"] is None for e in found["engines"])

    wait_for(answered, timeout=30)
    return found


@pytest.mark.parametrize("mode", ["compatible", "realtime"])
def test_a_held_pause_mid_run_is_invisible_to_clients(
    server_loop: ServerLoop, tmp_path_factory: pytest.TempPathFactory, mode: str
) -> None:
    gateway, simulator = engine_gateway(server_loop, tmp_path_factory, stream_mode=mode)
    calls: list[Callable[[Gateway], tuple[str, str | None]]] = [chat_call, messages_call, responses_call] * 2
    with ThreadPoolExecutor(12) as pool:
        before: list[Future[tuple[str, str | None]]] = [pool.submit(call, gateway) for call in calls]
        wait_for(lambda: engine_state(simulator)["in_flight"] == 6, timeout=15)
        paused = httpx.post(gateway.url + "/admin/api/engines/pause", json={}, headers=gateway.admin, timeout=30)
        assert paused.status_code == 200, paused.text
        assert paused.json() == {"mode": "keep", "engines": ["upstream"], "holding": True}
        sent = len(simulator.requests())
        assert sent == 6 and engine_state(simulator)["paused_mode"] == "keep"
        held = [pool.submit(call, gateway) for call in calls]
        listing = answered_listing(gateway, held=6)
        assert listing["holding"] is True
        assert listing["engines"] == [{"name": "upstream", "url": simulator.url, "paused": True,
                                       "weight_version": "default", "in_flight": 6, "held": 6, "error": None}]
        assert metric(gateway, "codebuddy2api_engine_held_calls ") == 6
        assert metric(gateway, 'codebuddy2api_engine_paused{upstream="upstream"}') == 1
        time.sleep(0.3)  # a held call that slipped through would reach the engine meanwhile
        assert len(simulator.requests()) == sent, "a call reached the engine while it was paused"
        assert not any(f.done() for f in before + held)
        resumed = httpx.post(gateway.url + "/admin/api/engines/resume", json={"weight_version": "v2"},
                             headers=gateway.admin, timeout=30)
        assert resumed.status_code == 200, resumed.text
        assert resumed.json() == {"weight_version": "v2", "engines": ["upstream"], "released": 6}
        answers = [f.result(timeout=60) for f in before + held]
    for (text, finish), call in zip(answers, calls * 2, strict=True):
        assert (text, finish) == (TEXT, FINISHED[call])
    assert len(simulator.requests()) == 12
    assert engine_state(simulator) | {"pauses": 0} == {
        "paused_mode": None, "in_flight": 0, "pauses": 0, "aborted": 0, "weight_version": "v2",
        "abort_requested": [], "said": []}
    assert answered_listing(gateway, held=0)["engines"][0] | {"in_flight": 0} == {
        "name": "upstream", "url": simulator.url, "paused": False, "weight_version": "v2", "in_flight": 0,
        "held": 0, "error": None}
    assert metric(gateway, "codebuddy2api_engine_held_calls ") == 0
    assert metric(gateway, 'codebuddy2api_engine_paused{upstream="upstream"}') == 0


def audit(gateway: Gateway) -> list[dict[str, Any]]:
    return httpx.get(gateway.url + "/admin/api/audit", params={"limit": 100}, headers=gateway.admin).json()["data"]  # type: ignore[no-any-return]


def test_an_engine_paused_past_the_bound_is_engine_paused_with_one_record_each(
    server_loop: ServerLoop, tmp_path_factory: pytest.TempPathFactory
) -> None:
    # the pause's own wait for the engine is bounded by --engine-pause-max too: 1 s was
    # outlasted at load 14 (a 504); 3 s, and each held call waits that long
    gateway, simulator = engine_gateway(server_loop, tmp_path_factory, engine_pause_max=3.0, keepalive_interval=0.3)
    paused = httpx.post(gateway.url + "/admin/api/engines/pause", json={"mode": "abort"}, headers=gateway.admin,
                        timeout=30)
    assert paused.status_code == 200 and paused.json()["mode"] == "abort"
    chat = openai.OpenAI(base_url=gateway.base_url, api_key="x", max_retries=0, timeout=30, _strict_response_validation=True)
    with pytest.raises(openai.APIStatusError) as refused:
        chat.chat.completions.create(model="text", messages=USER)  # type: ignore[arg-type]
    assert refused.value.status_code == 503 and refused.value.response.headers["retry-after"] == "1"
    error = refused.value.response.json()["error"]
    assert error["code"] == "engine_paused" and error["type"] == "server_error" and "--engine-pause-max" in error["message"]
    messages = anthropic.Anthropic(base_url=gateway.url, api_key="x", max_retries=0, timeout=30,
                                   _strict_response_validation=True)
    with pytest.raises(anthropic.APIStatusError) as streamed:  # committed by a keepalive: the in-stream error
        with messages.messages.stream(model="text", max_tokens=64, messages=USER) as stream:  # type: ignore[arg-type]
            stream.get_final_message()
    assert "engine_paused" in str(streamed.value)
    assert simulator.requests() == [], "a held call reached the paused engine"
    wait_for(lambda: len(audit(gateway)) == 2, timeout=10)
    time.sleep(0.2)
    rows = audit(gateway)
    assert len(rows) == 2 and {r["error_code"] for r in rows} == {"engine_paused"}
    assert {r["outcome"] for r in rows} == {"error"} and sorted(r["protocol"] for r in rows) == ["chat", "messages"]
    assert engines(gateway)["held"] == 0 and engines(gateway)["holding"] is True
    resumed = httpx.post(gateway.url + "/admin/api/engines/resume", json={}, headers=gateway.admin)
    assert resumed.json() == {"weight_version": None, "engines": ["upstream"], "released": 0}
    answer = chat.chat.completions.create(model="text", messages=USER)  # type: ignore[arg-type]
    assert answer.choices[0].message.content == TEXT


def test_pause_answers_504_naming_an_engine_that_does_not_pause(
    server_loop: ServerLoop, tmp_path_factory: pytest.TempPathFactory, tmp_path: Any
) -> None:
    """A second upstream with no dev RL API (its /pause is a 404): named in the 504; the
    engine that did pause stays paused and the hold stays closed until resume."""
    good = Simulator(server_loop.serve(create_simulator_app()))
    config = tmp_path / "fleet.toml"
    config.write_text(f'[[upstreams]]\nname = "good"\nbase_url = "{good.url}/v1"\nengine_api = "vllm"\n'
                      f'[[upstreams]]\nname = "mute"\nbase_url = "{good.url}/nothing/v1"\nengine_api = "vllm"\n'
                      f'[[upstreams]]\nname = "plain"\nbase_url = "{good.url}/v1"\n')
    gateway = start_gateway(server_loop, good, tmp_path_factory, upstream_url=[], config=config)
    paused = httpx.post(gateway.url + "/admin/api/engines/pause", json={"timeout": 2}, headers=gateway.admin)
    assert paused.status_code == 504
    error = paused.json()["error"]
    assert error["code"] == "engines_not_paused" and list(error["engines"]) == ["mute"]
    assert "HTTP 404" in error["engines"]["mute"] and "mute" in error["message"] and error["holding"] is True
    listing = engines(gateway)
    assert [(e["name"], e["paused"]) for e in listing["engines"]] == [("good", True), ("mute", None)]
    assert listing["holding"] is True and "HTTP 404" in listing["engines"][1]["error"]
    resumed = httpx.post(gateway.url + "/admin/api/engines/resume", json={}, headers=gateway.admin)
    assert resumed.status_code == 502 and list(resumed.json()["error"]["engines"]) == ["mute"]
    assert engine_state(good)["paused_mode"] is None and engines(gateway)["holding"] is False


def test_engine_admin_input_is_checked(server_loop: ServerLoop, simulator: Simulator,
                                       tmp_path_factory: pytest.TempPathFactory) -> None:
    plain = start_gateway(server_loop, simulator, tmp_path_factory)
    none = httpx.post(plain.url + "/admin/api/engines/pause", json={}, headers=plain.admin)
    assert none.status_code == 409 and none.json()["error"]["code"] == "no_engines"
    assert engines(plain) == {"holding": False, "held": 0, "engines": []}
    gateway, sim = engine_gateway(server_loop, tmp_path_factory, engine_pause_max=5.0)
    for body, param in (({"mode": "later"}, "mode"), ({"timeout": 0}, "timeout"), ({"timeout": 6}, "timeout"),
                        ({"timeout": "1"}, "timeout")):
        refused = httpx.post(gateway.url + "/admin/api/engines/pause", json=body, headers=gateway.admin)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param, body
    refused = httpx.post(gateway.url + "/admin/api/engines/resume", json={"weight_version": ""}, headers=gateway.admin)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "weight_version"
    unauthenticated = httpx.post(gateway.url + "/admin/api/engines/pause", json={})
    assert unauthenticated.status_code == 401
    assert engine_state(sim)["pauses"] == 0 and engines(gateway)["holding"] is False


def test_responses_calls_held_past_the_bound_are_engine_paused_with_one_record_each(
    server_loop: ServerLoop, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The Responses side of the bound: HTTP JSON (503 before anything is committed), an
    SSE stream committed by keepalives and a WebSocket turn (both the in-stream ``error``
    event, then ``response.failed``): each ``engine_paused``, one audit record each, and
    nothing reached the paused engine."""
    gateway, simulator = engine_gateway(server_loop, tmp_path_factory, engine_pause_max=1.0, keepalive_interval=0.3)
    paused = httpx.post(gateway.url + "/admin/api/engines/pause", json={"mode": "abort"}, headers=gateway.admin)
    assert paused.status_code == 200 and paused.json()["mode"] == "abort"
    client = openai.OpenAI(base_url=gateway.base_url, api_key="x", max_retries=0, timeout=30,
                           _strict_response_validation=True)
    with pytest.raises(openai.APIStatusError) as refused:
        client.responses.create(model="text", input="hi")
    assert refused.value.status_code == 503 and refused.value.response.headers["retry-after"] == "1"
    error = refused.value.response.json()["error"]
    assert error["code"] == "engine_paused" and error["type"] == "server_error" and "--engine-pause-max" in error["message"]
    assert set(error) == {"message", "type", "param", "code"}
    events: list[Any] = []
    with client.responses.stream(model="text", input="hi") as stream:  # committed by keepalives
        events.extend(stream)
    assert {e.type for e in events[:-2]} <= {"response.created", "response.in_progress"}
    assert events[-2].type == "error" and events[-2].code == "engine_paused"  # type: ignore[union-attr]
    assert events[-1].type == "response.failed" and events[-1].response.status == "failed"  # type: ignore[union-attr]
    assert "engine_paused" in events[-1].response.error.message  # type: ignore[union-attr]
    turn = {"type": "response.create", "model": "text", "input": "hi"}
    ws = open_ws(gateway)
    frames = exchange(ws, turn)  # the turn began (response.created): the in-stream error, as over SSE
    assert [f["type"] for f in frames[-2:]] == ["error", "response.failed"], frames
    assert frames[-2]["code"] == "engine_paused" and "--engine-pause-max" in frames[-2]["message"]
    with ws, pytest.raises(ConnectionClosedOK):  # a turn that failed ends its connection (websocket.py)
        ws.recv(timeout=20)
    assert simulator.requests() == [], "a held call reached the paused engine"
    wait_for(lambda: len(audit(gateway)) == 3, timeout=10)
    time.sleep(0.2)
    rows = audit(gateway)
    assert len(rows) == 3 and {r["error_code"] for r in rows} == {"engine_paused"}
    assert {r["outcome"] for r in rows} == {"error"} and {r["protocol"] for r in rows} == {"responses"}
    assert engines(gateway)["held"] == 0
    httpx.post(gateway.url + "/admin/api/engines/resume", json={}, headers=gateway.admin)
    assert client.responses.create(model="text", input="hi").output_text == TEXT
