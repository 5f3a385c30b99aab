"""``POST /admin/api/rollouts/{id}/abort`` (docs/capture.md "Abort"): a rollout's calls in
flight end at once (a streamed one with the in-stream error, a JSON one with a 409), their
records say ``cancelled``, the rollout is frozen; each call still has its one audit record."""

from __future__ import annotations

import secrets
import threading
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import Gateway, ServerLoop, Simulator, start_gateway, wait_for

CLIENT_KEY = "ck-rollout-abort-key-0123456789"
SLOW = "text;chunk=2;delay=0.2"  # about 15 s of answer: the abort comes long before its end


@pytest.fixture(scope="module")
def gateway(server_loop: ServerLoop, simulator: Simulator, tmp_path_factory: pytest.TempPathFactory) -> Gateway:
    return start_gateway(server_loop, simulator, tmp_path_factory, capture_tokens="vllm", api_key=[CLIENT_KEY])


def running_calls(gateway: Gateway, rollout: str) -> list[Any]:
    return [run for run in gateway.app.state.relay.running if run.rollout_id == rollout]


def test_abort_ends_the_rollouts_calls_records_them_cancelled_and_freezes(gateway: Gateway) -> None:
    rollout, bystander = f"abort.{secrets.token_hex(4)}", f"keep.{secrets.token_hex(4)}"
    agent = openai.OpenAI(base_url=f"{gateway.url}/rollouts/{rollout}/v1", api_key=CLIENT_KEY, max_retries=0,
                          _strict_response_validation=True)
    other = openai.OpenAI(base_url=f"{gateway.url}/rollouts/{bystander}/v1", api_key=CLIENT_KEY, max_retries=0,
                          _strict_response_validation=True)
    outcomes: dict[str, Any] = {}
    first_text = threading.Event()

    def streamed() -> None:
        try:
            with agent.chat.completions.stream(model=SLOW, messages=[{"role": "user", "content": "a"}]) as stream:
                for event in stream:
                    if event.type == "content.delta":
                        first_text.set()
            outcomes["stream"] = "finished"
        except openai.APIError as exc:
            outcomes["stream"] = exc

    def collected(client: openai.OpenAI, key: str) -> None:
        try:
            client.chat.completions.create(model=SLOW if key == "json" else "text", messages=[{"role": "user", "content": "b"}])
            outcomes[key] = "finished"
        except openai.APIError as exc:
            outcomes[key] = exc

    threads = [threading.Thread(target=streamed), threading.Thread(target=collected, args=(agent, "json"))]
    for thread in threads:
        thread.start()
    assert first_text.wait(20)
    wait_for(lambda: len(running_calls(gateway, rollout)) == 2, timeout=20)
    response = httpx.post(f"{gateway.url}/admin/api/rollouts/{rollout}/abort", json={}, headers=gateway.admin, timeout=30)
    for thread in threads:
        thread.join(20)
    assert response.status_code == 200, response.text
    snap = response.json()
    assert snap["frozen"] is True and snap["complete"] is True
    assert sorted(c["call_id"] for c in snap["calls"]) == snap["aborted"] and len(snap["aborted"]) == 2
    for call in snap["calls"]:
        assert (call["outcome"], call["error_code"]) == ("cancelled", "rollout_aborted")
        assert call["tokens"] is None and call["answer"]["partial"] is True
    streamed_call = next(c for c in snap["calls"] if c["answer"]["text"])  # it had sent text when the abort came
    assert streamed_call["answer"]["text"] and len(streamed_call["answer"]["text"]) < 60
    # the clients: an in-stream error event, and a 409 in the OpenAI shape
    assert isinstance(outcomes["stream"], openai.APIError) and "aborted" in str(outcomes["stream"])
    assert isinstance(outcomes["json"], openai.ConflictError) and outcomes["json"].code == "rollout_aborted"
    # every call keeps its one audit record (written by the audit queue, a moment later)
    for call_id in snap["aborted"]:
        def audited(call_id: str = call_id) -> httpx.Response:
            return httpx.get(f"{gateway.url}/admin/api/audit/{call_id}", headers=gateway.admin)

        wait_for(lambda: audited().status_code == 200, timeout=10)
        assert (audited().json()["outcome"], audited().json()["error_code"]) == ("error", "rollout_aborted")
    # frozen: the next call of the rollout is refused; another rollout is untouched
    with pytest.raises(openai.ConflictError) as refused:
        agent.chat.completions.create(model="text", messages=[{"role": "user", "content": "c"}])
    assert refused.value.code == "rollout_frozen"
    collected(other, "bystander")
    assert outcomes["bystander"] == "finished"


def test_abort_of_an_unknown_rollout_is_a_404(gateway: Gateway) -> None:
    response = httpx.post(f"{gateway.url}/admin/api/rollouts/nothing-here/abort", json={}, headers=gateway.admin)
    assert response.status_code == 404 and response.json()["error"]["code"] == "rollout_not_found"
    bad = httpx.post(f"{gateway.url}/admin/api/rollouts/bad%20id/abort", json={}, headers=gateway.admin)
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_rollout_id"
