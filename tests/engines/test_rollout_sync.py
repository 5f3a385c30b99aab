"""A gateway-held weight sync under 12 concurrent rollouts (issue #35, docs/weight-sync.md):
each rollout makes three calls through the strict official SDKs (Chat, Messages and
Responses in turn) under its rollout base URL: one wholly before the pause, one that is
either in flight across the pause (frozen by ``keep``, resumed on new weights) or sent
while the gateway holds calls, and one after the resume. No client sees an error, no call
reaches the engine while it is paused, and each call record read back through the admin
API carries exactly the versions that sampled its tokens: ``default`` before, ``v2`` after
and while held (from token 0), both across (``v2`` from the token the engine had reached
at the pause)."""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import anthropic
import httpx
import openai
import pytest

from gateway.simulator.server import TEXT
from tests.conftest import Gateway, ServerLoop, wait_for
from tests.engines.test_weight_sync import USER, answered_listing, engine_gateway, engine_state

FAST = "text"
#: 52 two-character chunks, 50 ms apart: the six calls are all mid-answer when the pause
#: comes, however slowly a busy machine starts them
SLOW = "text;chunk=2;delay=0.05"
#: the simulator's tokens are characters: each chunk of SLOW is two tokens
TOKENS_PER_CHUNK = 2
ROLLOUTS = 12


def chat(gateway: Gateway, rollout: str, model: str) -> tuple[str, str | None]:
    client = openai.OpenAI(base_url=f"{gateway.url}/rollouts/{rollout}/v1", api_key="x", max_retries=0,
                           timeout=60, _strict_response_validation=True)
    with client.chat.completions.stream(model=model, messages=USER) as stream:  # type: ignore[arg-type]
        final = stream.get_final_completion()
    return final.choices[0].message.content or "", final.choices[0].finish_reason


def messages(gateway: Gateway, rollout: str, model: str) -> tuple[str, str | None]:
    client = anthropic.Anthropic(base_url=f"{gateway.url}/rollouts/{rollout}", api_key="x", max_retries=0,
                                 timeout=60, _strict_response_validation=True)
    with client.messages.stream(model=model, max_tokens=256, messages=USER) as stream:  # type: ignore[arg-type]
        final = stream.get_final_message()
    return "".join(b.text for b in final.content if b.type == "text"), final.stop_reason


def responses(gateway: Gateway, rollout: str, model: str) -> tuple[str, str | None]:
    client = openai.OpenAI(base_url=f"{gateway.url}/rollouts/{rollout}/v1", api_key="x", max_retries=0,
                           timeout=60, _strict_response_validation=True)
    with client.responses.stream(model=model, input="hi") as stream:
        final = stream.get_final_response()
    return final.output_text, final.status


Call = Callable[[Gateway, str, str], tuple[str, str | None]]
PROTOCOLS: list[Call] = [chat, messages, responses]
FINISHED = {chat: "stop", messages: "end_turn", responses: "completed"}


def record_calls(gateway: Gateway, rollout: str, count: int) -> list[dict[str, Any]]:
    """The rollout's call records, in order, once all ``count`` are stored."""
    found: list[dict[str, Any]] = []

    def stored() -> bool:
        response = httpx.get(f"{gateway.url}/admin/api/rollouts/{rollout}", headers=gateway.admin)
        found[:] = response.json()["calls"] if response.status_code == 200 else []
        return len(found) == count

    wait_for(stored, timeout=30)
    return found


@pytest.mark.parametrize("mode", ["compatible", "realtime"])
def test_twelve_rollouts_across_a_held_pause_record_the_versions_that_sampled_each_call(
    server_loop: ServerLoop, tmp_path_factory: pytest.TempPathFactory, mode: str
) -> None:
    gateway, simulator = engine_gateway(server_loop, tmp_path_factory, stream_mode=mode, capture_tokens="vllm")
    # the version calls are admitted with, known once the engine answered a status read
    # (the start-up read has a 2 s bound a loaded machine can outlast)
    assert answered_listing(gateway, held=0)["engines"][0]["weight_version"] == "default"
    tag = secrets.token_hex(4)
    rollouts = [f"sync.{tag}:r-{i}" for i in range(ROLLOUTS)]
    across = set(rollouts[0::2])  # the second call is mid-answer at the pause; the others send it while paused
    firsts_done = threading.Semaphore(0)
    all_firsts_done, paused = threading.Event(), threading.Event()

    def rollout(rollout_id: str, call: Call) -> list[tuple[str, str | None]]:
        answers = [call(gateway, rollout_id, FAST)]
        firsts_done.release()
        assert (all_firsts_done if rollout_id in across else paused).wait(timeout=120)
        answers.append(call(gateway, rollout_id, SLOW))
        answers.append(call(gateway, rollout_id, FAST))  # after the resume: the second ended after it
        return answers

    calls = [PROTOCOLS[i % 3] for i in range(ROLLOUTS)]
    with ThreadPoolExecutor(ROLLOUTS) as pool:
        futures: list[Future[list[tuple[str, str | None]]]] = [
            pool.submit(rollout, r, c) for r, c in zip(rollouts, calls, strict=True)]
        for _ in range(ROLLOUTS):
            assert firsts_done.acquire(timeout=60)
        all_firsts_done.set()  # the second calls of the "across" rollouts start together

        def across_mid_answer() -> bool:
            said = engine_state(simulator)["said"]
            return len(said) == len(across) and all(s.get("content", 0) >= 2 for s in said)

        wait_for(across_mid_answer, timeout=30)
        paused_answer = httpx.post(gateway.url + "/admin/api/engines/pause", json={}, headers=gateway.admin, timeout=30)
        assert paused_answer.status_code == 200, paused_answer.text
        frozen = engine_state(simulator)
        assert frozen["paused_mode"] == "keep" and frozen["in_flight"] == len(across)
        said_at_pause = sorted(s.get("content", 0) for s in frozen["said"])
        assert all(0 < n < len(TEXT) for n in said_at_pause), said_at_pause
        sent = len(simulator.requests())
        assert sent == ROLLOUTS + len(across)
        paused.set()
        answered_listing(gateway, held=ROLLOUTS - len(across))
        time.sleep(0.3)  # a held call that slipped through would reach the engine meanwhile
        assert len(simulator.requests()) == sent, "a call reached the engine while it was paused"
        assert engine_state(simulator)["said"] == frozen["said"], "a frozen stream went on while paused"
        assert not any(f.done() for f in futures)
        resumed = httpx.post(gateway.url + "/admin/api/engines/resume", json={"weight_version": "v2"},
                             headers=gateway.admin, timeout=30)
        assert resumed.status_code == 200, resumed.text
        assert resumed.json() == {"weight_version": "v2", "engines": ["upstream"], "released": ROLLOUTS - len(across)}
        answers = [f.result(timeout=120) for f in futures]
    for got, call in zip(answers, calls, strict=True):
        assert got == [(TEXT, FINISHED[call])] * 3
    assert len(simulator.requests()) == 3 * ROLLOUTS

    default, v2 = {"version": "default", "from_token": 0}, {"version": "v2", "from_token": 0}
    switched_at: list[int] = []
    for rollout_id in rollouts:
        before, middle, after = record_calls(gateway, rollout_id, 3)
        for record in (before, middle, after):
            assert record["tokens"]["completion_ids"][: len(TEXT)] == [ord(ch) for ch in TEXT], rollout_id
        assert before["weight_versions"] == [default], rollout_id
        assert after["weight_versions"] == [v2], rollout_id
        if rollout_id in across:  # frozen mid-answer, resumed on v2: both, v2 from where it froze
            first, second = middle["weight_versions"]
            assert first == default and second["version"] == "v2", rollout_id
            switched_at.append(second["from_token"])
        else:  # held in the gateway: admitted after the resume, wholly v2
            assert middle["weight_versions"] == [v2], rollout_id
    # v2 begins at the token each frozen stream had reached when the engine paused
    assert sorted(switched_at) == [TOKENS_PER_CHUNK * n for n in said_at_pause]
