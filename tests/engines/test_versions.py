"""Weight versions per completion-token range (gateway/engines/versions.py): the trail fed
directly, and in rollout call records end to end: a call frozen by a gateway-held ``keep``
pause and resumed on new weights, and a call an engine aborted and the gateway continued
(its tokens exactly as sampled: prompt + partial + continuation)."""

from __future__ import annotations

import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest

from gateway.engines.versions import VersionTrail
from gateway.simulator.server import TEXT
from gateway.simulator.tokens import END
from tests.conftest import Gateway, ServerLoop, wait_for
from tests.engines.test_weight_sync import SLOW, USER, engine_gateway, engine_state


def piece(content: str = "", ids: list[int] | None = None) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "delta": {"content": content}, "finish_reason": None}
    if ids is not None:
        choice["token_ids"] = ids
    return {"choices": [choice]}


def test_a_trail_counts_tokens_and_marks_where_each_version_begins() -> None:
    trail = VersionTrail("e")
    trail.switch("v1")
    trail.count(piece("ab", [1, 2]))
    trail.count(piece("c"))  # no ids: one token per chunk with output
    trail.count(piece(""))  # nothing sampled
    trail.count({"choices": [], "usage": {"completion_tokens": 3}})
    trail.switch("v1")  # the same version again: no new range
    assert trail.versions == [{"version": "v1", "from_token": 0}] and trail.tokens == 3
    trail.switch("v2")
    trail.switch(None)  # unknown: nothing said
    trail.count(piece("d", [4]))
    assert trail.versions == [{"version": "v1", "from_token": 0}, {"version": "v2", "from_token": 3}]
    trail.switch("v3")
    trail.switch("v4")  # no token came from v3
    assert trail.versions[-1] == {"version": "v4", "from_token": 4}
    unknown_start = VersionTrail("e")
    unknown_start.count(piece("x", [9]))
    unknown_start.switch("v2")
    assert unknown_start.versions == [{"version": "v2", "from_token": 1}]


def rollout_chat(gateway: Gateway, rollout: str) -> str:
    client = openai.OpenAI(base_url=f"{gateway.url}/rollouts/{rollout}/v1", api_key="x", max_retries=0,
                           timeout=30, _strict_response_validation=True)
    with client.chat.completions.stream(model=SLOW, messages=USER) as stream:  # type: ignore[arg-type]
        return stream.get_final_completion().choices[0].message.content or ""


def the_call(gateway: Gateway, rollout: str) -> dict[str, Any]:
    def calls() -> list[dict[str, Any]]:
        response = httpx.get(f"{gateway.url}/admin/api/rollouts/{rollout}", headers=gateway.admin)
        return response.json()["calls"] if response.status_code == 200 else []  # type: ignore[no-any-return]

    wait_for(lambda: len(calls()) == 1, timeout=10)
    return calls()[0]


def trajectory_versions(gateway: Gateway, rollout: str) -> list[dict[str, Any]]:
    response = httpx.get(f"{gateway.url}/admin/api/rollouts/{rollout}/trajectory", headers=gateway.admin)
    [segment] = response.json()["segments"]
    return segment["weight_versions"]  # type: ignore[no-any-return]


@pytest.mark.parametrize("who_pauses", ["gateway keep", "engine abort"])
def test_a_call_across_a_weight_update_records_both_versions(
    server_loop: ServerLoop, tmp_path_factory: pytest.TempPathFactory, who_pauses: str
) -> None:
    gateway, simulator = engine_gateway(server_loop, tmp_path_factory, capture_tokens="vllm", stream_mode="realtime")
    rollout = f"ws.{secrets.token_hex(4)}:r-1"
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(rollout_chat, gateway, rollout)
        wait_for(lambda: engine_state(simulator)["in_flight"] == 1, timeout=15)
        time.sleep(0.1)  # a few tokens into the answer
        if who_pauses == "gateway keep":
            paused = httpx.post(gateway.url + "/admin/api/engines/pause", json={}, headers=gateway.admin)
            assert paused.status_code == 200
            time.sleep(0.2)
            resumed = httpx.post(gateway.url + "/admin/api/engines/resume", json={"weight_version": "v2"},
                                 headers=gateway.admin)
            assert resumed.status_code == 200
        else:  # a trainer the gateway does not know of: abort, new weights, resume
            httpx.post(simulator.url + "/pause", params={"mode": "abort"})
            time.sleep(0.2)
            httpx.post(simulator.url + "/update_weight_version", json={"weight_version": "v2"})
            httpx.post(simulator.url + "/resume")
        assert future.result(timeout=60) == TEXT
    call = the_call(gateway, rollout)
    completion = call["tokens"]["completion_ids"]
    # prompt + partial + continuation, exactly as sampled (a token-in continuation ends
    # with the end-of-turn id the engine samples, which a chat stream does not report)
    assert completion == [ord(ch) for ch in TEXT] + ([END] if who_pauses == "engine abort" else [])
    first, second = call["weight_versions"]
    assert first == {"version": "default", "from_token": 0}
    assert second["version"] == "v2" and 0 < second["from_token"] < len(completion)
    prompt = len(call["tokens"]["prompt_ids"])
    assert trajectory_versions(gateway, rollout) == [
        {"call_id": call["call_id"], "version": "default", "from_token": prompt},
        {"call_id": call["call_id"], "version": "v2", "from_token": prompt + second["from_token"]}]
    continued = [r["body"] for r in simulator.requests() if r["path"] == "/v1/completions"]
    assert not any(r["body"].get("continue_final_message") for r in simulator.requests())
    if who_pauses == "engine abort":  # token-in: where v2 begins is where the partial answer ended
        [body] = continued
        assert body["prompt"] == call["tokens"]["prompt_ids"] + completion[: second["from_token"]]
    else:
        assert continued == []
