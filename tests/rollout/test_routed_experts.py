"""MoE routing replay (docs/capture.md "Routed experts"): the engine's ``routed_experts``
(asked for with engine extras, as SGLang wants) is kept in the rollout call's record and
never reaches a client, on every protocol, streamed or not, and on the relayed
``/v1/completions``; a continued call keeps only its new tokens' experts (where they start
in ``routed_experts_from_token``), token-in calls included."""

from __future__ import annotations

import base64
import json
import secrets

import anthropic
import httpx
import openai
import pytest

from gateway.simulator.tokens import EXPERT_LAYERS, EXPERT_TOP_K, routed_experts
from tests.conftest import Gateway, ServerLoop, Simulator, start_gateway

CLIENT_KEY = "ck-routed-experts-key-0123456789"
AUTH = {"authorization": f"Bearer {CLIENT_KEY}", "x-api-key": CLIENT_KEY, "anthropic-version": "2023-06-01"}


@pytest.fixture(scope="module")
def gateway(server_loop: ServerLoop, simulator: Simulator, tmp_path_factory: pytest.TempPathFactory) -> Gateway:
    return start_gateway(server_loop, simulator, tmp_path_factory, capture_tokens="vllm", api_key=[CLIENT_KEY],
                         engine_extras={"*": {"return_routed_experts": True}})


BODIES = {
    "/v1/chat/completions": {"model": "text;chunk=6", "messages": [{"role": "user", "content": "hi"}]},
    "/v1/messages": {"model": "text;chunk=6", "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}]},
    "/v1/responses": {"model": "text;chunk=6", "input": "hi", "store": False},
}


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
@pytest.mark.parametrize("path", list(BODIES))
def test_routed_experts_are_recorded_and_never_sent_to_the_client(
    gateway: Gateway, simulator: Simulator, path: str, stream: bool
) -> None:
    rollout = f"moe.{secrets.token_hex(4)}"
    answer = httpx.post(f"{gateway.url}/rollouts/{rollout}{path}", json={**BODIES[path], "stream": stream}, headers=AUTH, timeout=30)
    assert answer.status_code == 200, answer.text
    assert "routed_experts" not in answer.text and "routed_experts" not in json.dumps(dict(answer.headers))
    assert "Hello from the codebuddy2api simulator." in answer.text.replace("\\", "")
    upstream = [r for r in simulator.requests() if r["path"].endswith("/chat/completions")][-1]["body"]
    assert upstream["return_routed_experts"] is True  # what the engine was asked for
    [call] = httpx.get(f"{gateway.url}/admin/api/rollouts/{rollout}", headers=gateway.admin).json()["calls"]
    tokens = call["tokens"]
    assert call["routed_experts"] == routed_experts(tokens["prompt_ids"] + tokens["completion_ids"])


def test_the_sdks_read_the_answers_of_an_engine_that_routes(gateway: Gateway) -> None:
    rollout = f"moe.{secrets.token_hex(4)}"
    chat = openai.OpenAI(base_url=f"{gateway.url}/rollouts/{rollout}/v1", api_key=CLIENT_KEY, max_retries=0,
                         _strict_response_validation=True)
    with chat.chat.completions.stream(model="text;chunk=6", messages=[{"role": "user", "content": "hi"}]) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].message.content and "routed_experts" not in final.model_dump_json()
    claude = anthropic.Anthropic(base_url=f"{gateway.url}/rollouts/{rollout}", api_key=CLIENT_KEY, max_retries=0,
                                 _strict_response_validation=True)
    message = claude.messages.create(model="text;chunk=6", max_tokens=64, messages=[{"role": "user", "content": "hi"}])
    assert message.content[0].type == "text" and "routed_experts" not in message.model_dump_json()
    calls = httpx.get(f"{gateway.url}/admin/api/rollouts/{rollout}", headers=gateway.admin).json()["calls"]
    assert [bool(c["routed_experts"]) for c in calls] == [True, True]


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
def test_the_relayed_completions_route_strips_them(gateway: Gateway, simulator: Simulator, stream: bool) -> None:
    body = {"model": "text", "prompt": "one two three", "max_tokens": 8, "stream": stream, "return_routed_experts": True}
    direct = httpx.post(simulator.url + "/v1/completions", json=body, timeout=30)
    assert "routed_experts" in direct.text  # the engine does send them
    relayed = httpx.post(gateway.url + "/v1/completions", json=body, headers=AUTH, timeout=30)
    assert relayed.status_code == 200 and "routed_experts" not in relayed.text
    if stream:
        text = "".join(c["text"] for line in relayed.text.splitlines() if line.startswith("data: {")
                       for c in json.loads(line[6:])["choices"])
    else:
        text = relayed.json()["choices"][0]["text"]
    assert text == " -> one two three."


# -- a continued call keeps only its new tokens' experts; token-in calls keep them too -------

CALLS = 'CALL get_weather {"city": "Paris"} then CALL get_time {"timezone": "Europe/Paris"}'
TOOLS = [{"type": "function", "function": {"name": name, "description": name, "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "timezone": {"type": "string"}}}}}
    for name in ("get_weather", "get_time")]
STRIDE = EXPERT_LAYERS * EXPERT_TOP_K * 4  # int32 [layers, top_k] per token


@pytest.fixture(scope="module")
def token_in_gateway(server_loop: ServerLoop, simulator: Simulator, tmp_path_factory: pytest.TempPathFactory) -> Gateway:
    return start_gateway(server_loop, simulator, tmp_path_factory, token_in="vllm", api_key=[CLIENT_KEY],
                         engine_extras={"*": {"return_routed_experts": True}})


def three_turns(gateway: Gateway, rollout: str, stream: bool, edit: bool) -> None:
    """Two tool turns and the final answer through the strict SDK; ``edit``: the harness
    rewrites a tool result before the third call (a new segment). No answer carries experts."""
    client = openai.OpenAI(base_url=f"{gateway.url}/rollouts/{rollout}/v1", api_key=CLIENT_KEY, max_retries=0,
                           _strict_response_validation=True)
    messages: list[dict[str, object]] = [{"role": "user", "content": f"{secrets.token_hex(6)}: {CALLS}"}]
    for turn in range(3):
        if turn == 2 and edit:
            messages[2] = {**messages[2], "content": "get_weather says 19 C"}
        if stream:
            with client.chat.completions.stream(model="agent;chunk=7", messages=messages, tools=TOOLS) as s:  # type: ignore[arg-type]
                message = s.get_final_completion().choices[0].message
            assert "routed_experts" not in s.get_final_completion().model_dump_json()
        else:
            raw = client.chat.completions.with_raw_response.create(model="agent;chunk=7", messages=messages, tools=TOOLS)  # type: ignore[arg-type]
            assert "routed_experts" not in raw.http_response.text
            message = raw.parse().choices[0].message
        messages.append(message.model_dump(exclude_none=True, exclude={"parsed"}))
        for call in message.tool_calls or []:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": f"{call.function.name} says 18 C"})
    assert message.content and message.content.startswith("Done.")


def check_compact(calls: list[dict[str, object]], continued: list[bool]) -> None:
    """Each call's experts: whole (from 0) when it starts a segment, else from where the call it
    extends ended; the previous slices + its own rebuild the engine's whole array."""
    rebuilt = b""
    for call, extends in zip(calls, continued, strict=True):
        tokens = call["tokens"]
        assert isinstance(tokens, dict)
        sequence = tokens["prompt_ids"] + tokens["completion_ids"]
        full = base64.b64decode(routed_experts(sequence))
        start = call["routed_experts_from_token"]
        assert isinstance(start, int) and isinstance(call["routed_experts"], str)
        if extends:
            assert start == len(rebuilt) // STRIDE > 0
        else:
            assert start == 0 and call["routed_experts"] == routed_experts(sequence)
            rebuilt = b""
        rebuilt = rebuilt[: start * STRIDE] + base64.b64decode(call["routed_experts"])
        assert rebuilt == full


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
def test_a_continued_call_records_only_its_new_tokens_experts(gateway: Gateway, stream: bool) -> None:
    rollout = f"moe.{secrets.token_hex(4)}"
    three_turns(gateway, rollout, stream, edit=True)
    calls = httpx.get(f"{gateway.url}/admin/api/rollouts/{rollout}", headers=gateway.admin).json()["calls"]
    assert [c["continuity"]["prefix"] for c in calls] == ["exact", "exact", "diverged"]
    check_compact(calls, [False, True, False])  # the edited third call starts a segment: whole
    previous = calls[0]["tokens"]
    assert calls[1]["routed_experts_from_token"] == len(previous["prompt_ids"]) + len(previous["completion_ids"])


def test_token_in_calls_keep_their_experts_compactly(token_in_gateway: Gateway, simulator: Simulator) -> None:
    rollout = f"moe-ti.{secrets.token_hex(4)}"
    three_turns(token_in_gateway, rollout, True, edit=False)
    calls = httpx.get(f"{token_in_gateway.url}/admin/api/rollouts/{rollout}", headers=token_in_gateway.admin).json()["calls"]
    assert [c["token_in"]["status"] for c in calls] == ["skipped: first_turn", "used", "used"]
    engine = [r["body"] for r in simulator.requests() if r["path"] == "/v1/completions"][-2:]
    assert [b["prompt"] for b in engine] == [c["tokens"]["prompt_ids"] for c in calls[1:]]
    assert all(b["return_routed_experts"] is True for b in engine)  # asked of the engine's token-in endpoint
    check_compact(calls, [False, True, True])
