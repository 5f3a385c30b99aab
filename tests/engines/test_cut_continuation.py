"""Continuation after an engine-side abort (``/pause?mode=abort``, the gateway not told),
end to end through the strict official SDK stream helpers, over Chat, Messages and
Responses in both stream modes:

- through token-in (``--capture-tokens vllm``): the prompt ids plus the partial answer's
  ids go to the engine's ``/v1/completions``; the rollout call record's tokens are the
  prompt, the partial and the continuation exactly as sampled, with two weight versions
  split where the abort cut;
- a cut reasoning and a cut tool call (through token-in and through a chat markup
  prefill): the client gets the whole reasoning, and one tool call whose arguments are
  the uncut run's (the simulator is greedy).
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anthropic
import httpx
import openai
import pytest

from gateway.simulator.reply import REASONING, TOOL_ARGS
from gateway.simulator.server import TEXT
from gateway.simulator.tokens import END, prompt_ids
from tests.conftest import Gateway, ServerLoop, Simulator, wait_for
from tests.engines.test_versions import the_call
from tests.engines.test_weight_sync import engine_gateway, engine_state
from tests.upstream.test_token_in import PLAN

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}, "unit": {"type": "string"}}}}}
ARGUMENTS = json.dumps(TOOL_ARGS[0])
#: scenario -> (the model string: 2-character chunks, 50 ms apart; what the abort must cut)
CUTS = {"text": ("text;chunk=2;delay=0.05", "content"),
        "reasoning": ("reasoning;chunk=2;delay=0.05", "reasoning_content"),
        "tool": ("tool;chunk=2;delay=0.15", "tool_calls")}  # a short answer: slower, so the cut finds it mid-way


def chat(base: str, model: str, tools: bool) -> dict[str, Any]:
    client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=60,
                           _strict_response_validation=True)
    extra: dict[str, Any] = {"tools": [WEATHER]} if tools else {}
    with client.chat.completions.stream(model=model, messages=[{"role": "user", "content": "hi"}], **extra) as stream:
        final = stream.get_final_completion()
    message = final.choices[0].message
    calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
    return {"text": message.content or "", "reasoning": (message.model_extra or {}).get("reasoning_content") or "",
            "calls": calls, "finish": final.choices[0].finish_reason}


def messages(base: str, model: str, tools: bool) -> dict[str, Any]:
    client = anthropic.Anthropic(base_url=base, api_key="x", max_retries=0, timeout=60,
                                 _strict_response_validation=True)
    extra: dict[str, Any] = {"tools": [{"name": "get_weather", "description": "Weather in a city",
                                        "input_schema": WEATHER["function"]["parameters"]}]} if tools else {}
    with client.messages.stream(model=model, max_tokens=1024, messages=[{"role": "user", "content": "hi"}],
                                **extra) as stream:
        final = stream.get_final_message()
    return {"text": "".join(b.text for b in final.content if b.type == "text"),
            "reasoning": "".join(b.thinking for b in final.content if b.type == "thinking"),
            "calls": [(b.name, json.dumps(b.input)) for b in final.content if b.type == "tool_use"],
            "finish": final.stop_reason}


def responses(base: str, model: str, tools: bool) -> dict[str, Any]:
    client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=60,
                           _strict_response_validation=True)
    extra: dict[str, Any] = {"tools": [{"type": "function", "name": "get_weather",
                                        "parameters": WEATHER["function"]["parameters"]}]} if tools else {}
    with client.responses.stream(model=model, input="hi", **extra) as stream:
        final = stream.get_final_response()
    reasoning = "".join(part.text for item in final.output if item.type == "reasoning" for part in item.summary)
    return {"text": final.output_text, "reasoning": reasoning,
            "calls": [(i.name, i.arguments) for i in final.output if i.type == "function_call"],
            "finish": final.status}


PROTOCOLS: dict[str, Callable[[str, str, bool], dict[str, Any]]] = {
    "chat": chat, "messages": messages, "responses": responses}
FINISHED = {("chat", False): "stop", ("chat", True): "tool_calls", ("messages", False): "end_turn",
            ("messages", True): "tool_use", ("responses", False): "completed", ("responses", True): "completed"}


def cut_and_continue(simulator: Simulator, kind: str, version: str = "v2") -> None:
    """Once the in-flight answer has said a few chunks of ``kind``: the engine aborts it
    (the gateway not told), takes new weights and resumes."""
    wait_for(lambda: any(said.get(kind, 0) >= 4 for said in engine_state(simulator)["said"]), timeout=30)
    assert httpx.post(simulator.url + "/pause", params={"mode": "abort"}).json() == {"status": "paused"}
    assert engine_state(simulator)["aborted"] == 1
    time.sleep(0.2)
    httpx.post(simulator.url + "/update_weight_version", json={"weight_version": version})
    httpx.post(simulator.url + "/resume")


def run_cut(gateway: Gateway, simulator: Simulator, protocol: str, scenario: str, base: str) -> dict[str, Any]:
    model, kind = CUTS[scenario]
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(PROTOCOLS[protocol], base, model, scenario == "tool")
        cut_and_continue(simulator, kind)
        return answer.result(timeout=90)


@pytest.mark.parametrize("mode", ["compatible", "realtime"])
@pytest.mark.parametrize("protocol", list(PROTOCOLS))
def test_a_token_in_continuation_records_exactly_what_was_sampled(
    server_loop: ServerLoop, tmp_path_factory: pytest.TempPathFactory, protocol: str, mode: str
) -> None:
    gateway, simulator = engine_gateway(server_loop, tmp_path_factory, capture_tokens="vllm", stream_mode=mode)
    rollout = f"ws.{secrets.token_hex(4)}:r-1"
    answer = run_cut(gateway, simulator, protocol, "text", f"{gateway.url}/rollouts/{rollout}")
    assert answer == {"text": TEXT, "reasoning": "", "calls": [], "finish": FINISHED[(protocol, False)]}
    first, continued = simulator.requests()
    assert first["path"] == "/v1/chat/completions" and continued["path"] == "/v1/completions"
    call = the_call(gateway, rollout)
    tokens = call["tokens"]
    assert tokens["prompt_ids"] == prompt_ids(first["body"])
    # prompt + partial + continuation exactly as sampled: one id per character, then the
    # end-of-turn id the engine samples (a chat stream does not report it)
    assert tokens["completion_ids"] == [ord(ch) for ch in TEXT] + [END]
    assert len(tokens["completion_logprobs"]) == len(tokens["completion_ids"])
    old, new = call["weight_versions"]
    assert old == {"version": "default", "from_token": 0}
    assert new["version"] == "v2" and 0 < new["from_token"] < len(TEXT)
    # the engine got the prompt ids plus exactly the partial answer's ids, and no chat prefill
    assert continued["body"]["prompt"] == tokens["prompt_ids"] + tokens["completion_ids"][: new["from_token"]]
    assert continued["body"]["return_token_ids"] is True and "messages" not in continued["body"]
    assert continued["headers"]["x-request-id"] == first["headers"]["x-request-id"]


#: What the uncut answer of each cut scenario is (text, reasoning, calls).
WHOLE = {"reasoning": {"text": TEXT, "reasoning": REASONING, "calls": []},
         "tool": {"text": "", "reasoning": "", "calls": [("get_weather", ARGUMENTS)]}}
SAMPLED = {"reasoning": REASONING + TEXT, "tool": ARGUMENTS}  # the chat stream's ids, one per character


@pytest.mark.parametrize("path", ["token_in", "prefill"])
@pytest.mark.parametrize("scenario", ["reasoning", "tool"])
@pytest.mark.parametrize("mode", ["compatible", "realtime"])
@pytest.mark.parametrize("protocol", list(PROTOCOLS))
def test_a_cut_reasoning_or_tool_call_goes_on_where_it_was_cut(
    server_loop: ServerLoop, tmp_path_factory: pytest.TempPathFactory, protocol: str, mode: str, scenario: str,
    path: str,
) -> None:
    tokens = {"capture_tokens": "vllm"} if path == "token_in" else {}
    gateway, simulator = engine_gateway(server_loop, tmp_path_factory, stream_mode=mode, **tokens)
    rollout = f"ws.{secrets.token_hex(4)}:r-1"
    base = f"{gateway.url}/rollouts/{rollout}" if path == "token_in" else gateway.url
    answer = run_cut(gateway, simulator, protocol, scenario, base)
    assert answer == {**WHOLE[scenario], "finish": FINISHED[(protocol, scenario == "tool")]}
    first, continued = simulator.requests()
    if path == "token_in":
        assert continued["path"] == "/v1/completions"
        call = the_call(gateway, rollout)
        assert call["tokens"]["completion_ids"] == [ord(ch) for ch in SAMPLED[scenario]] + [END]
        cut = call["weight_versions"][1]["from_token"]
        assert 0 < cut < len(SAMPLED[scenario])
        assert continued["body"]["prompt"] == call["tokens"]["prompt_ids"] + call["tokens"]["completion_ids"][:cut]
        return
    assert continued["path"] == "/v1/chat/completions" and continued["body"]["continue_final_message"] is True
    prefill = continued["body"]["messages"][-1]
    assert prefill["role"] == "assistant"
    # the partial in the markup the model writes, left open where it was cut
    opening = "<think>" if scenario == "reasoning" else '<tool_call>\n{"name": "get_weather", "arguments": '
    assert prefill["content"].startswith(opening)
    so_far = prefill["content"][len(opening):]
    assert so_far and so_far != SAMPLED[scenario] and SAMPLED[scenario].startswith(so_far)


@pytest.mark.parametrize("mode", ["compatible", "realtime"])
def test_a_token_in_rollout_turn_cut_inside_its_call_goes_on_from_its_ids(
    server_loop: ServerLoop, tmp_path_factory: pytest.TempPathFactory, mode: str
) -> None:
    """A rollout call sent through token-in (``token_in = "vllm"``: its second turn), aborted
    while the engine writes its Hermes tool call (held in the gateway's reader, nothing of
    the call said yet): the continuation sends the turn's prompt ids + the partial ids, the
    reader goes on, the client gets the one call, the record the ids exactly as sampled."""
    gateway, simulator = engine_gateway(server_loop, tmp_path_factory, stream_mode=mode, token_in="vllm")
    rollout, nonce = f"ws.{secrets.token_hex(4)}:r-1", secrets.token_hex(6)
    client = openai.OpenAI(base_url=f"{gateway.url}/rollouts/{rollout}/v1", api_key="x", max_retries=0, timeout=60,
                           _strict_response_validation=True)
    model = "agent;chunk=7;delay=0.05"
    tools = [WEATHER, {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    messages: list[dict[str, Any]] = [{"role": "user", "content": f"{nonce}: {PLAN}"}]

    def turn() -> Any:
        with client.chat.completions.stream(model=model, messages=messages, tools=tools) as stream:  # type: ignore[arg-type]
            return stream.get_final_completion().choices[0].message

    first = turn()
    messages.append(first.model_dump(exclude_none=True, exclude={"parsed"}))
    messages.append({"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": "18 C"})
    with ThreadPoolExecutor(1) as pool:
        second = pool.submit(turn)
        cut_and_continue(simulator, "text")
        message = second.result(timeout=90)
    assert not message.content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("get_time", {"timezone": "Europe/Paris"})]
    legs = [r["body"] for r in simulator.requests() if r["path"] == "/v1/completions"]
    assert len(legs) == 2  # the token-in turn and its continuation
    call = the_calls(gateway, rollout, 2)[1]
    assert call["token_in"]["status"] == "used"
    sampled = '<tool_call>\n{"name": "get_time", "arguments": {"timezone": "Europe/Paris"}}\n</tool_call>'
    assert call["tokens"]["completion_ids"] == [ord(ch) for ch in sampled] + [END]
    assert call["tokens"]["prompt_ids"] == legs[0]["prompt"]
    old, new = call["weight_versions"]
    assert old == {"version": "default", "from_token": 0} and new["version"] == "v2"
    assert legs[1]["prompt"] == legs[0]["prompt"] + call["tokens"]["completion_ids"][: new["from_token"]]


def the_calls(gateway: Gateway, rollout: str, count: int) -> list[dict[str, Any]]:
    def calls() -> list[dict[str, Any]]:
        response = httpx.get(f"{gateway.url}/admin/api/rollouts/{rollout}", headers=gateway.admin)
        return response.json()["calls"] if response.status_code == 200 else []  # type: ignore[no-any-return]

    wait_for(lambda: len(calls()) == count, timeout=10)
    return calls()
