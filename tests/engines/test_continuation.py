"""Transparent continuation after an engine's abort (gateway/engines/continuation.py):
the pure PartialAnswer fed chunk by chunk, and end to end through the strict SDKs: an
engine-side ``/pause?mode=abort`` the gateway was not told about, mid-answer, in both
stream modes, on Chat, Messages and Responses (HTTP and WebSocket): every client gets the
one whole answer."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from gateway.engines.continuation import MAX_CONTINUATIONS, PartialAnswer, continuing
from gateway.engines.hold import engine_paused
from gateway.engines.versions import VersionTrail
from gateway.errors import GatewayError
from gateway.simulator.server import TEXT
from gateway.stream.answer import DONE
from gateway.upstream.client import ANSWERED
from tests.conftest import ServerLoop, wait_for
from tests.engines.test_weight_sync import (
    FINISHED,
    SLOW,
    chat_call,
    engine_gateway,
    engine_state,
    engines,
    messages_call,
    metric,
    responses_call,
)
from tests.protocols.test_responses_ws import exchange, open_ws


def chunk(content: str | None = None, finish: str | None = None, **extra: Any) -> dict[str, Any]:
    delta: dict[str, Any] = {} if content is None else {"content": content}
    delta.update(extra.pop("delta", {}))
    return {"id": "c", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}], **extra}


def test_an_abort_after_text_is_held_back_and_the_next_leg_continues_it() -> None:
    partial = PartialAnswer()
    assert partial.feed(chunk("Hel", delta={"role": "assistant"})) == chunk("Hel", delta={"role": "assistant"})
    assert partial.feed(chunk("lo", finish="abort")) == chunk("lo")  # the text stays, the abort goes
    assert partial.aborted and partial.text == "Hello"
    assert partial.feed({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9}}) is None
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    assert partial.continuation_body(body) == {
        "model": "m", "stream": True, "continue_final_message": True, "add_generation_prompt": False,
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello"}]}
    assert body["messages"] == [{"role": "user", "content": "hi"}]  # the call's own body is untouched
    partial.next_leg()
    # the continuation leg: no second role, no second prompt ids, usage over both legs
    assert partial.feed(chunk(" world", delta={"role": "assistant"}, prompt_token_ids=[1, 2])) == chunk(" world")
    assert partial.feed(chunk(finish="stop")) == chunk(finish="stop")
    last = partial.feed({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12}})
    assert last == {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12}}
    assert not partial.aborted and partial.text == "Hello world"


def test_a_client_prefill_grows_and_an_empty_partial_is_asked_again() -> None:
    partial = PartialAnswer()
    partial.feed(chunk(" sunny", finish="abort"))
    body = {"messages": [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "It is"}]}
    assert partial.continuation_body(body)["messages"][-1] == {"role": "assistant", "content": "It is sunny"}
    empty = PartialAnswer()
    assert empty.feed(chunk(delta={"role": "assistant"}, finish="abort")) is None and empty.aborted
    assert empty.continuation_body(body) is body


@pytest.mark.parametrize(("delta", "why"), [
    ({"tool_calls": [{"index": 1, "id": "c2", "function": {"name": "g", "arguments": "{"}},
                     {"index": 0, "function": {"arguments": " "}}]}, "interleaved_tool_calls"),
    ({"content": "after a call"}, "text_after_tool_call"),
])
def test_a_partial_that_cannot_be_said_again_keeps_its_abort(delta: dict[str, Any], why: str) -> None:
    partial = PartialAnswer()
    partial.feed(chunk(delta={"tool_calls": [{"index": 0, "id": "c1", "function": {"name": "f", "arguments": "{}"}}]}))
    partial.feed(chunk(delta=delta))
    aborted = chunk(finish="abort")
    assert partial.feed(aborted) == aborted and not partial.aborted and partial.blocked == why


def test_continuations_are_bounded() -> None:
    partial = PartialAnswer()
    for _ in range(MAX_CONTINUATIONS):
        partial.feed(chunk("x", finish="abort"))
        assert partial.aborted
        partial.continuation_body({"messages": []})
        partial.next_leg()
    last = chunk("x", finish="abort")
    assert partial.feed(last) == last and not partial.aborted


@pytest.mark.parametrize("mode", ["compatible", "realtime"])
def test_an_engine_side_abort_mid_answer_is_continued_and_clients_see_one_answer(
    server_loop: ServerLoop, tmp_path_factory: pytest.TempPathFactory, mode: str
) -> None:
    gateway, simulator = engine_gateway(server_loop, tmp_path_factory, stream_mode=mode)
    calls = [chat_call, messages_call, responses_call] * 2
    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(call, gateway) for call in calls]
        wait_for(lambda: engine_state(simulator)["in_flight"] == 6, timeout=15)
        time.sleep(0.1)  # a few chunks into each answer
        assert httpx.post(simulator.url + "/pause", params={"mode": "abort"}).json() == {"status": "paused"}
        assert engine_state(simulator)["aborted"] == 6
        time.sleep(0.3)  # the gateway polls /is_paused meanwhile; nothing may reach the engine's queue
        assert len(simulator.requests()) == 6 and not any(f.done() for f in futures)
        assert httpx.post(simulator.url + "/resume").json() == {"status": "resumed"}
        answers = [f.result(timeout=60) for f in futures]
    for (text, finish), call in zip(answers, calls, strict=True):
        assert (text, finish) == (TEXT, FINISHED[call])
    sent = simulator.requests()
    assert len(sent) == 12
    continuations = [r["body"] for r in sent[6:]]
    for body in continuations:
        prefill = body["messages"][-1]
        assert body["continue_final_message"] is True and body["add_generation_prompt"] is False
        assert prefill["role"] == "assistant" and prefill["content"] and TEXT.startswith(prefill["content"])
        assert prefill["content"] != TEXT and body["messages"][:-1] in [r["body"]["messages"] for r in sent[:6]]
    assert metric(gateway, 'codebuddy2api_continuations_total{reason="abort"}') == 6


def test_a_gateway_held_abort_pause_holds_the_continuations_until_resume(
    server_loop: ServerLoop, tmp_path_factory: pytest.TempPathFactory
) -> None:
    gateway, simulator = engine_gateway(server_loop, tmp_path_factory, stream_mode="realtime")
    calls = [chat_call, messages_call, responses_call]
    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(call, gateway) for call in calls]
        wait_for(lambda: engine_state(simulator)["in_flight"] == 3, timeout=15)
        time.sleep(0.1)
        paused = httpx.post(gateway.url + "/admin/api/engines/pause", json={"mode": "abort"}, headers=gateway.admin)
        assert paused.status_code == 200 and engine_state(simulator)["aborted"] == 3
        wait_for(lambda: engines(gateway)["held"] == 3, timeout=15)  # the continuations wait in the hold
        time.sleep(0.2)
        assert len(simulator.requests()) == 3 and not any(f.done() for f in futures)
        resumed = httpx.post(gateway.url + "/admin/api/engines/resume", json={"weight_version": "v2"}, headers=gateway.admin)
        assert resumed.json()["released"] == 3
        answers = [f.result(timeout=60) for f in futures]
    assert answers == [(TEXT, FINISHED[call]) for call in calls]
    assert [r["body"].get("continue_final_message") for r in simulator.requests()] == [None] * 3 + [True] * 3


@pytest.mark.parametrize("mode", ["compatible", "realtime"])
def test_an_abort_under_a_responses_websocket_turn_is_continued(
    server_loop: ServerLoop, tmp_path_factory: pytest.TempPathFactory, mode: str
) -> None:
    """Codex's transport: one ``response.create`` frame, the engine aborts mid-answer, the
    turn ends ``response.completed`` with the whole text (each event valid for the SDK)."""
    gateway, simulator = engine_gateway(server_loop, tmp_path_factory, stream_mode=mode)
    with open_ws(gateway) as ws, ThreadPoolExecutor(1) as pool:
        turn = pool.submit(exchange, ws, {"type": "response.create", "model": SLOW, "input": "hi"})
        wait_for(lambda: engine_state(simulator)["in_flight"] == 1, timeout=15)
        time.sleep(0.1)
        httpx.post(simulator.url + "/pause", params={"mode": "abort"})
        time.sleep(0.2)
        httpx.post(simulator.url + "/resume")
        events = turn.result(timeout=60)
    assert events[-1]["type"] == "response.completed"
    [message] = events[-1]["response"]["output"]
    assert message["content"][0]["text"] == TEXT
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == TEXT
    assert [r["body"].get("continue_final_message") for r in simulator.requests()] == [None, True]


def _legs(*legs: list[Any]) -> Any:
    """A fake chat send answering each call with the next leg's items; the bodies it got."""
    bodies: list[dict[str, Any]] = []

    async def send(credential: Any, body: dict[str, Any], policy: Any, headers: Any = None) -> Any:
        bodies.append(body)
        for item in legs[len(bodies) - 1]:
            yield item

    return send, bodies


async def _collect(items: Any) -> list[Any]:
    return [item async for item in items]


async def test_the_shell_continues_on_the_same_send_and_hides_the_seam() -> None:
    send, bodies = _legs(
        [ANSWERED, chunk("Hel", delta={"role": "assistant"}), chunk(finish="abort"), DONE],
        [ANSWERED, chunk("lo", delta={"role": "assistant"}), chunk(finish="stop"), DONE],
    )
    waited: list[str] = []

    async def resumed(credential: Any, policy: Any) -> str:
        waited.append("resumed")
        return "v2"

    trail = VersionTrail("e")
    trail.switch("v1")
    body = {"messages": [{"role": "user", "content": "hi"}]}
    items = await _collect(continuing(send, resumed, trail=trail)(None, body, None))  # type: ignore[arg-type]
    assert items == [ANSWERED, chunk("Hel", delta={"role": "assistant"}), chunk("lo"), chunk(finish="stop"), DONE]
    assert waited == ["resumed"] and bodies[1]["messages"][-1] == {"role": "assistant", "content": "Hel"}
    assert trail.versions == [{"version": "v1", "from_token": 0}, {"version": "v2", "from_token": 1}]


async def test_an_engine_that_stays_paused_fails_the_call_after_the_partial() -> None:
    send, bodies = _legs([ANSWERED, chunk("Hel"), chunk(finish="abort"), DONE])

    async def resumed(credential: Any, policy: Any) -> str:
        raise engine_paused(0.1)

    seen: list[Any] = []
    with pytest.raises(GatewayError) as caught:
        async for item in continuing(send, resumed)(None, {"messages": []}, None):  # type: ignore[arg-type]
            seen.append(item)
    assert caught.value.code == "engine_paused" and seen == [ANSWERED, chunk("Hel")] and len(bodies) == 1


@pytest.mark.parametrize("mode", ["compatible", "realtime"])
def test_responses_websocket_turns_straddle_a_held_pause_and_an_engine_abort(
    server_loop: ServerLoop, tmp_path_factory: pytest.TempPathFactory, mode: str
) -> None:
    """Two Codex connections: one turn is mid-answer when the engine aborts it (the gateway
    not told) and a gateway-held pause follows; the other is sent while paused and waits in
    the gateway's hold. After the resume both end ``response.completed`` with the whole answer, and
    nothing reached the engine while it was paused."""
    gateway, simulator = engine_gateway(server_loop, tmp_path_factory, stream_mode=mode)
    turn = {"type": "response.create", "model": SLOW, "input": "hi"}
    with ThreadPoolExecutor(2) as pool, open_ws(gateway) as cut_ws, open_ws(gateway) as held_ws:
        cut = pool.submit(exchange, cut_ws, turn)
        wait_for(lambda: engine_state(simulator)["in_flight"] == 1, timeout=15)
        time.sleep(0.1)  # a few chunks into the answer
        assert httpx.post(simulator.url + "/pause", params={"mode": "abort"}).json() == {"status": "paused"}
        paused = httpx.post(gateway.url + "/admin/api/engines/pause", json={}, headers=gateway.admin, timeout=30)
        assert paused.status_code == 200, paused.text
        held = pool.submit(exchange, held_ws, turn)
        # the new turn waits in the hold; the cut turn's continuation waits for the engine's
        # /is_paused (it began waiting before the hold closed)
        wait_for(lambda: engines(gateway)["held"] == 1, timeout=15)
        time.sleep(0.3)
        assert len(simulator.requests()) == 1 and not cut.done() and not held.done()
        resumed = httpx.post(gateway.url + "/admin/api/engines/resume", json={"weight_version": "v2"},
                             headers=gateway.admin, timeout=30)
        assert resumed.json()["released"] == 1
        results = [cut.result(timeout=60), held.result(timeout=60)]
    for events in results:
        assert events[-1]["type"] == "response.completed"
        [message] = events[-1]["response"]["output"]
        assert message["content"][0]["text"] == TEXT
        assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == TEXT
        assert not any(e["type"] == "error" for e in events)
    kinds = sorted(bool(r["body"].get("continue_final_message")) for r in simulator.requests())
    assert kinds == [False, False, True]  # the cut turn, the held turn, the cut turn's continuation


def _completion(text: str, ids: list[int], finish: str | None = None) -> dict[str, Any]:
    return {"choices": [{"index": 0, "text": text, "token_ids": ids, "finish_reason": finish}]}


async def test_a_token_in_leg_cut_inside_a_call_it_began_goes_on_from_its_reader() -> None:
    """Chat leg cut inside a call's arguments, token-in leg that closes it and begins a
    second call, cut again, token-in leg that ends it: two whole calls, no markup as text,
    the second token-in prompt = prompt ids + every id sampled."""
    first_chunks = [ANSWERED, {"choices": [{"index": 0, "token_ids": [10, 11], "finish_reason": None, "delta": {
        "role": "assistant", "tool_calls": [{"index": 0, "id": "c0", "type": "function",
                                             "function": {"name": "f", "arguments": '{"a'}}]}}],
        "prompt_token_ids": [1, 2]}, chunk(finish="abort"), DONE]
    chat_send, _ = _legs(first_chunks)
    token_send, prompts = _legs(
        [ANSWERED, _completion('": 1}}\n</tool_call>\n<tool_call>\n{"name": "g", "argu', [12, 13, 14]),
         _completion("", [], "abort"), DONE],
        [ANSWERED, _completion('ments": {}}\n</tool_call>', [15, 16]), _completion("", [17], "stop"), DONE],
    )

    async def resumed(credential: Any, policy: Any) -> None:
        return None

    items = await _collect(continuing(chat_send, resumed, token_send=token_send)(None, {"messages": []}, None))  # type: ignore[arg-type]
    deltas = [i["choices"][0]["delta"] for i in items if isinstance(i, dict) and i.get("choices")]
    assert not any(d.get("content") for d in deltas)  # no markup reached the client as text
    calls = [c for d in deltas for c in d.get("tool_calls") or []]
    assert "".join(c["function"].get("arguments", "") for c in calls if c["index"] == 0) == '{"a": 1}'
    [second] = [c for c in calls if c["index"] == 1]
    assert second["function"] == {"name": "g", "arguments": "{}"}
    assert [p["prompt"] for p in prompts] == [[1, 2, 10, 11], [1, 2, 10, 11, 12, 13, 14]]
    finishes = [i["choices"][0]["finish_reason"] for i in items if isinstance(i, dict) and i.get("choices")]
    assert [f for f in finishes if f] == ["tool_calls"]
