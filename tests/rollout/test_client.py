"""``codebuddy2api.client.Rollouts`` (docs/capture.md): a whole rollout driven through the
openai and anthropic SDKs at the base URLs it gives, against the running app; then read,
trajectory, reward, group, freeze, export and delete through it. The export's resumption
after a broken stream is a unit seam (httpx MockTransport)."""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from codebuddy2api.client import Rollouts, RolloutsError
from tests.conftest import Gateway, ServerLoop, Simulator, start_gateway

CLIENT_KEY = "ck-client-library-key-0123456789"
CALLS = 'CALL get_weather {"city": "Paris"} then CALL get_time {"timezone": "Europe/Paris"}'
TOOLS = [{"type": "function", "function": {"name": name, "description": name, "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "timezone": {"type": "string"}}}}}
    for name in ("get_weather", "get_time")]


@pytest.fixture(scope="module")
def gateway(server_loop: ServerLoop, simulator: Simulator, tmp_path_factory: pytest.TempPathFactory) -> Gateway:
    return start_gateway(server_loop, simulator, tmp_path_factory, capture_tokens="vllm", api_key=[CLIENT_KEY])


def test_the_client_drives_a_whole_rollout(gateway: Gateway) -> None:
    rollout, group = f"lib.{secrets.token_hex(4)}:ep1", "lib-group-" + secrets.token_hex(3)
    with Rollouts(gateway.url, gateway.app.state.admin_access.token) as rollouts:
        assert rollouts.base_url_for(rollout) == f"{gateway.url}/rollouts/{rollout}/v1"
        agent = openai.OpenAI(base_url=rollouts.base_url_for(rollout), api_key=CLIENT_KEY, max_retries=0,
                              _strict_response_validation=True, default_headers={"x-rollout-group": group})
        messages: list[dict[str, Any]] = [{"role": "user", "content": f"{secrets.token_hex(6)}: {CALLS}"}]
        for _ in range(3):
            with agent.chat.completions.stream(model="agent;chunk=5", messages=messages, tools=TOOLS) as stream:  # type: ignore[arg-type]
                message = stream.get_final_completion().choices[0].message
            messages.append(message.model_dump(exclude_none=True, exclude={"parsed"}))
            for call in message.tool_calls or []:
                messages.append({"role": "tool", "tool_call_id": call.id, "content": f"{call.function.name} says 18 C"})
        assert message.content and message.content.startswith("Done. The tool said: get_time")

        snapshot = rollouts.read(rollout)
        calls = snapshot["calls"]
        assert len(calls) == 3 and snapshot["complete"] and not snapshot["frozen"] and snapshot["group_id"] == group
        assert [c["continuity"]["prefix"] for c in calls] == ["exact"] * 3
        [segment] = rollouts.trajectory(rollout)["segments"]
        assert segment["call_ids"] == [c["call_id"] for c in calls]
        assert segment["tokens"] == calls[2]["tokens"]["prompt_ids"] + calls[2]["tokens"]["completion_ids"]

        scored = rollouts.reward(rollout, 0.5, details={"judge": "exact match"})
        assert (scored["rollout_id"], scored["call_id"], scored["reward"], scored["details"]) == (rollout, None, 0.5, {"judge": "exact match"})
        assert rollouts.reward(rollout, 1, call_id=calls[0]["call_id"])["call_id"] == calls[0]["call_id"]
        frozen = rollouts.freeze(rollout)
        assert frozen["frozen"] and frozen["reward"] is not None and frozen["reward"]["reward"] == 0.5
        with pytest.raises(openai.ConflictError):
            agent.chat.completions.create(model="text", messages=messages)  # type: ignore[arg-type]
        assert [r["rollout_id"] for r in rollouts.list_rollouts(group=group)] == [rollout]

        [sample] = list(rollouts.export(group=group, frozen=True, shape="verifiers"))
        first_prompt = calls[0]["tokens"]["prompt_ids"]
        assert sample["prompt_ids"] == first_prompt and sample["completion_ids"] == segment["tokens"][len(first_prompt):]
        assert sample["completion_mask"] == segment["mask"][len(first_prompt):] and sample["reward"] == 0.5
        assert sample["completion_logprobs"] == [lp if lp is not None else 0.0 for lp in segment["logprobs"][len(first_prompt):]]
        [native] = list(rollouts.export(group=group))
        assert native["calls"] == rollouts.read(rollout)["calls"] and native["call_rewards"][calls[0]["call_id"]]["reward"] == 1.0
        assert list(rollouts.export(group=group, frozen=False)) == []

        rollouts.delete(rollout)
        with pytest.raises(RolloutsError) as gone:
            rollouts.read(rollout)
        assert (gone.value.status, gone.value.code) == (404, "rollout_not_found")


def test_the_anthropic_base_url_and_the_errors(gateway: Gateway) -> None:
    rollout = f"lib.{secrets.token_hex(4)}:claude"
    with Rollouts(gateway.url + "/", gateway.app.state.admin_access.token) as rollouts:
        claude = anthropic.Anthropic(base_url=rollouts.base_url_for(rollout, api="anthropic"), api_key=CLIENT_KEY,
                                     max_retries=0, _strict_response_validation=True)
        claude.messages.create(model="text", max_tokens=64, messages=[{"role": "user", "content": "hi"}])
        [call] = rollouts.read(rollout)["calls"]
        assert call["protocol"] == "messages" and call["outcome"] == "success"
        with pytest.raises(RolloutsError) as early:
            rollouts.delete(rollout)
        assert (early.value.status, early.value.code) == (409, "rollout_not_frozen")
        aborted = rollouts.abort(rollout)  # nothing running: it freezes, and says so
        assert aborted["aborted"] == [] and aborted["frozen"] is True and aborted["calls"][0]["call_id"] == call["call_id"]
        with pytest.raises(anthropic.ConflictError):
            claude.messages.create(model="text", max_tokens=64, messages=[{"role": "user", "content": "again"}])
        with pytest.raises(RolloutsError) as bad:
            rollouts.reward(rollout, 1.0, call_id="req_not_of_this_rollout")
        assert (bad.value.status, bad.value.code) == (404, "call_not_found")
        with pytest.raises(ValueError):
            rollouts.reward(rollout, float("inf"))
        with pytest.raises(ValueError):
            rollouts.base_url_for("no spaces")
    with Rollouts(gateway.url, "wrong-admin-token-0123456789") as intruder, pytest.raises(RolloutsError) as denied:
        intruder.read(rollout)
    assert denied.value.status == 401


# -- the export's resumption (a unit seam) --------------------------------------------------


def line(rollout: str, segment: int, cursor: str) -> bytes:
    return json.dumps({"rollout_id": rollout, "segment": segment, "segment_count": 2, "cursor": cursor}).encode() + b"\n"


class Broken(httpx.SyncByteStream):
    """Yields ``chunks``, then the connection breaks (or ends cleanly)."""

    def __init__(self, chunks: list[bytes], breaks: bool) -> None:
        self.chunks, self.breaks = chunks, breaks

    def __iter__(self) -> Iterator[bytes]:
        yield from self.chunks
        if self.breaks:
            raise httpx.ReadError("connection reset")


def test_the_export_resumes_after_the_last_whole_rollout() -> None:
    seen: list[str | None] = []

    def handler(request: httpx.Request) -> httpx.Response:
        cursor = request.url.params.get("cursor")
        seen.append(cursor)
        assert request.url.params["shape"] == "trl" and request.headers["authorization"] == "Bearer token"
        if cursor is None:  # A whole, B's first segment, then the connection breaks
            return httpx.Response(200, stream=Broken([line("A", 0, "cA"), line("A", 1, "cA"), line("B", 0, "cB")], True))
        if len(seen) == 2:  # the server's own error line
            return httpx.Response(200, stream=Broken([b'{"error": {"code": "store_unavailable", "message": "x", "cursor": "cA"}}\n'], False))
        return httpx.Response(200, stream=Broken([line("B", 0, "cB"), line("B", 1, "cB")], False))

    with Rollouts("http://gw", "token", transport=httpx.MockTransport(handler)) as rollouts:
        lines = list(rollouts.export(shape="trl"))
    assert [(x["rollout_id"], x["segment"]) for x in lines] == [("A", 0), ("A", 1), ("B", 0), ("B", 1)]
    assert seen == [None, "cA", "cA"]


def test_the_export_gives_up_after_resume_breaks_in_a_row() -> None:
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.params.get("cursor"))
        return httpx.Response(200, stream=Broken([line("A", 0, "cA")], True))

    with Rollouts("http://gw", "token", transport=httpx.MockTransport(handler)) as rollouts:
        with pytest.raises(httpx.ReadError):
            list(rollouts.export(shape="trl", resume=2))
    assert calls == [None, None, None]
