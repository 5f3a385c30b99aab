"""MoE routing replay (docs/capture.md "Routed experts"): the engine's ``routed_experts``
(asked for with engine extras, as SGLang wants) is kept in the rollout call's record and
never reaches a client, on every protocol, streamed or not, and on the relayed
``/v1/completions``."""

from __future__ import annotations

import json
import secrets

import anthropic
import httpx
import openai
import pytest

from gateway.simulator.tokens import routed_experts
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
