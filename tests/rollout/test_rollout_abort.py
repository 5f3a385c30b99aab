"""``POST /admin/api/rollouts/{id}/abort`` (docs/capture.md "Abort"): a rollout's calls in
flight end at once (a streamed one with the in-stream error, a JSON one with a 409), their
records say ``cancelled``, the rollout is frozen; each call still has its one audit record.
An upstream with an engine API is told through its ``/abort_requests``, with the
``X-Request-Id`` each call was sent with."""

from __future__ import annotations

import secrets
import threading
from typing import Any

import httpx
import openai
import pytest

from gateway.simulator.server import create_simulator_app
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



def stream_in_thread(gateway: Gateway, rollout: str, outcomes: dict[str, Any]) -> threading.Thread:
    """A streamed rollout call of SLOW in a thread (its outcome in ``outcomes["stream"]``),
    started and past its first text."""
    agent = openai.OpenAI(base_url=f"{gateway.url}/rollouts/{rollout}/v1", api_key=CLIENT_KEY, max_retries=0,
                          _strict_response_validation=True)
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

    thread = threading.Thread(target=streamed)
    thread.start()
    assert first_text.wait(20)
    return thread


def audit_record(gateway: Gateway, call_id: str) -> dict[str, Any]:
    def audited() -> httpx.Response:
        return httpx.get(f"{gateway.url}/admin/api/audit/{call_id}", headers=gateway.admin)

    wait_for(lambda: audited().status_code == 200, timeout=10)
    return audited().json()  # type: ignore[no-any-return]


def test_abort_reaches_the_engines_abort_requests_with_the_calls_request_id(
    server_loop: ServerLoop, tmp_path_factory: pytest.TempPathFactory
) -> None:
    engine = Simulator(server_loop.serve(create_simulator_app()))  # its own: its abort log is this test's
    gateway = start_gateway(server_loop, engine, tmp_path_factory, capture_tokens="vllm", api_key=[CLIENT_KEY],
                            engine_api="vllm")
    rollout, outcomes = f"engine-abort.{secrets.token_hex(4)}", {}
    thread = stream_in_thread(gateway, rollout, outcomes)
    sent = [r for r in engine.requests() if r["path"] == "/v1/chat/completions"]
    assert len(sent) == 1
    engine_request_id = sent[0]["headers"]["x-request-id"]
    response = httpx.post(f"{gateway.url}/admin/api/rollouts/{rollout}/abort", json={}, headers=gateway.admin, timeout=30)
    thread.join(20)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["engine_abort"] == [{"upstream": "upstream", "ok": True}]
    assert httpx.get(engine.url + "/_sim/engine").json()["abort_requested"] == [engine_request_id]
    (call,) = answer["calls"]
    assert answer["aborted"] == [call["call_id"]] and answer["frozen"] is True
    assert engine_request_id == f"{call['call_id']}-1"  # the call's id and its attempt's number
    assert (call["outcome"], call["error_code"]) == ("cancelled", "rollout_aborted")
    assert isinstance(outcomes["stream"], openai.APIError) and "aborted" in str(outcomes["stream"])
    # the attempt log names the id the attempt was sent with
    attempts = audit_record(gateway, call["call_id"])["upstream_attempts"]
    assert [a.get("engine_request_id") for a in attempts] == [engine_request_id]


def test_an_engine_that_fails_its_abort_is_named_in_the_answer_not_a_500(
    server_loop: ServerLoop, simulator: Simulator, tmp_path_factory: pytest.TempPathFactory
) -> None:
    gateway = start_gateway(server_loop, simulator, tmp_path_factory, capture_tokens="vllm", api_key=[CLIENT_KEY],
                            engine_api="vllm")
    rollout, outcomes = f"engine-abort-fails.{secrets.token_hex(4)}", {}
    thread = stream_in_thread(gateway, rollout, outcomes)
    # the engine's control API now answers 500 (the chat stream already running is untouched)
    gateway.app.state.engines.control.http = httpx.AsyncClient(
        transport=httpx.MockTransport(lambda request: httpx.Response(500)))
    response = httpx.post(f"{gateway.url}/admin/api/rollouts/{rollout}/abort", json={}, headers=gateway.admin, timeout=30)
    thread.join(20)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["engine_abort"] == [{"upstream": "upstream", "ok": False, "error": "POST /abort_requests: HTTP 500"}]
    (call,) = answer["calls"]
    assert (call["outcome"], call["error_code"]) == ("cancelled", "rollout_aborted")
    assert isinstance(outcomes["stream"], openai.APIError) and "aborted" in str(outcomes["stream"])
