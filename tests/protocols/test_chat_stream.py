"""Chat Completions through the gateway, both modes, asserted with the openai SDK's own
stream accumulator in strict mode, against the simulator's ground truth."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import TOOL_SCENARIOS, Gateway, Simulator

WEATHER_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}}},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Time in a timezone",
            "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}}},
        },
    },
]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris, and the time?"}]


def client(gateway: Gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.base_url, api_key="test-key", _strict_response_validation=True, max_retries=0)


def upstream_truth(simulator: Simulator, model: str, tools: list[dict] | None = None) -> dict[str, Any]:
    """What the upstream means, taken from its own non-streaming answer."""
    body: dict[str, Any] = {"model": model, "messages": MESSAGES}
    if tools:
        body["tools"] = tools
    response = httpx.post(simulator.url + "/v1/chat/completions", json=body)
    response.raise_for_status()
    return response.json()["choices"][0]["message"]


def stream_final(gateway: Gateway, model: str, tools: list[dict] | None = None, **kwargs: Any) -> Any:
    extra: dict[str, Any] = {"tools": tools} if tools else {}
    with client(gateway).chat.completions.stream(
        model=model, messages=MESSAGES, stream_options={"include_usage": True}, **extra, **kwargs
    ) as stream:
        for _ in stream:
            pass
        return stream.get_final_completion()


@pytest.mark.parametrize("scenario", ["text", "echo", "no_done", "empty_tool_array", "reasoning", "reasoning_field"])
def test_text_answers_assemble(gateway: Gateway, simulator: Simulator, scenario: str) -> None:
    truth = upstream_truth(simulator, scenario)
    final = stream_final(gateway, scenario + ";chunk=3")
    choice = final.choices[0]
    assert choice.message.content == truth["content"]
    assert choice.finish_reason == "stop"
    assert not choice.message.tool_calls
    reasoning = truth.get("reasoning_content") or truth.get("reasoning")
    if reasoning:
        assert choice.message.model_extra.get("reasoning_content") == reasoning
    assert final.usage is not None and final.usage.completion_tokens > 0
    assert final.usage.total_tokens == final.usage.prompt_tokens + final.usage.completion_tokens


@pytest.mark.parametrize(
    "scenario",
    TOOL_SCENARIOS,
)
@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_tool_calls_assemble(gateway: Gateway, simulator: Simulator, scenario: str, chunk: int) -> None:
    truth = upstream_truth(simulator, scenario, WEATHER_TOOLS)
    final = stream_final(gateway, f"{scenario};chunk={chunk}", WEATHER_TOOLS)
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert (choice.message.content or None) == (truth.get("content") or None)
    calls = choice.message.tool_calls
    expected = truth["tool_calls"]
    assert [c.function.name for c in calls] == [c["function"]["name"] for c in expected]
    assert [json.loads(c.function.arguments) for c in calls] == [
        json.loads(c["function"]["arguments"]) for c in expected
    ]
    assert [c.id for c in calls] == [c["id"] for c in expected]
    assert [c.index for c in calls] == list(range(len(expected)))


def test_usage_chunk_only_when_asked(gateway: Gateway) -> None:
    with client(gateway).chat.completions.stream(model="text", messages=MESSAGES) as stream:
        chunks = [event.chunk for event in stream if event.type == "chunk"]
        final = stream.get_final_completion()
    assert final.choices[0].message.content
    assert all(chunk.choices for chunk in chunks)
    assert final.usage is None


def test_json_answer_matches_stream(gateway: Gateway, simulator: Simulator) -> None:
    completion = client(gateway).chat.completions.create(model="parallel_tools", messages=MESSAGES, tools=WEATHER_TOOLS)
    streamed = stream_final(gateway, "parallel_tools;chunk=2", WEATHER_TOOLS)
    assert completion.object == "chat.completion"
    assert completion.choices[0].finish_reason == "tool_calls"
    got = [(c.id, c.function.name, json.loads(c.function.arguments)) for c in completion.choices[0].message.tool_calls]
    want = [(c.id, c.function.name, json.loads(c.function.arguments)) for c in streamed.choices[0].message.tool_calls]
    assert got == want
    assert completion.usage.completion_tokens == streamed.usage.completion_tokens


def test_one_id_and_model_for_the_whole_stream(gateway: Gateway) -> None:
    with client(gateway).chat.completions.create(
        model="text;unstable_id=1;chunk=2", messages=MESSAGES, stream=True
    ) as stream:
        chunks = list(stream)
    assert len(chunks) >= 3
    assert len({c.id for c in chunks}) == 1
    assert {c.model for c in chunks} == {"text;unstable_id=1;chunk=2"}


def test_realtime_first_text_before_upstream_finishes(gateways: dict[str, Gateway]) -> None:
    """The upstream takes ~1.5 s in total; the first text must arrive long before."""
    started = time.monotonic()
    first_text_at = None
    with client(gateways["realtime"]).chat.completions.stream(
        model="text;chunk=4;delay=0.05", messages=MESSAGES
    ) as stream:
        for event in stream:
            if event.type == "content.delta" and first_text_at is None:
                first_text_at = time.monotonic() - started
        total = time.monotonic() - started
        text = stream.get_final_completion().choices[0].message.content
    assert first_text_at is not None and text
    assert total > 0.5
    assert first_text_at < total / 3


def test_compatible_sends_keepalives_while_collecting(keepalive_gateways: dict[str, Gateway]) -> None:
    """A slow upstream: the compatible gateway keeps the client's idle timer alive with
    SSE comment lines, which the SDK ignores, and the answer still assembles.

    The keepalive interval is 0.5 s; the upstream's first chunk comes after 8 s, room for
    about sixteen keepalives, of which at least two (repeated, not a single one) must come
    before the first text even when a busy machine fires the loop's timers late (#39: with
    4 s, only one came at load 19)."""
    with httpx.stream(
        "POST",
        keepalive_gateways["compatible"].base_url + "/chat/completions",
        json={"model": "text;first_chunk_delay=8", "messages": MESSAGES, "stream": True},
        timeout=60,
    ) as response:
        raw = b"".join(response.iter_bytes())
    assert response.status_code == 200
    lines = raw.decode().split("\n")
    first_data = next(i for i, line in enumerate(lines) if line.startswith("data:") and '"content":""' not in line)
    assert sum(1 for line in lines[:first_data] if line == ": keepalive") >= 2
    final = stream_final(keepalive_gateways["compatible"], "text;first_chunk_delay=0.8")
    assert final.choices[0].message.content
