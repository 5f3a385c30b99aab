"""Property: however the upstream splits an answer into chunks, both modes assemble the
same completion through the openai SDK, and it equals the gateway's JSON answer."""

from __future__ import annotations

import json
from typing import Any

import openai
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import Gateway, Simulator

TOOLS = [
    {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}
    for name in ("lookup", "write_file", "run")
]

texts = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=60)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-1000, 1000) | texts,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6,
)
arguments = st.dictionaries(st.text(min_size=1, max_size=8), json_values, max_size=4)


def split(draw: st.DrawFn, text: str) -> list[str]:
    """Cut text at random points (at least one piece, none empty)."""
    if not text:
        return []
    cuts = sorted(draw(st.sets(st.integers(1, max(1, len(text) - 1)), max_size=6)))
    bounds = [0, *[c for c in cuts if c < len(text)], len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:]) if b > a]


@st.composite
def scripted_answers(draw: st.DrawFn) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    reasoning = draw(st.one_of(st.just(""), texts))
    text = draw(st.one_of(st.just(""), texts))
    n_tools = draw(st.integers(0, 3)) if text else draw(st.integers(1, 3))
    style = draw(st.sampled_from(["standard", "repeat_identity", "no_index", "interleaved"]))
    calls = [
        {"id": f"call_{i}_{draw(st.integers(0, 9999))}", "name": TOOLS[i]["function"]["name"],
         "arguments": json.dumps(draw(arguments))}
        for i in range(n_tools)
    ]
    frames: list[dict[str, Any]] = [{"choices": [{"index": 0, "delta": {"role": "assistant"}}]}]
    for key, value in (("reasoning_content", reasoning), ("content", text)):
        frames += [{"choices": [{"index": 0, "delta": {key: piece}}]} for piece in split(draw, value)]
    per_call = []
    for i, call in enumerate(calls):
        pieces = split(draw, call["arguments"])
        deltas = []
        for j, piece in enumerate(pieces):
            delta: dict[str, Any] = {"function": {"arguments": piece}}
            if style != "no_index":
                delta["index"] = i
            if j == 0 or style == "repeat_identity":
                delta.update(id=call["id"], type="function")
                delta["function"]["name"] = call["name"]
            deltas.append(delta)
        per_call.append(deltas)
    if style == "interleaved":
        order = [d for group in zip(*[iter_pad(g) for g in per_call]) for d in group if d is not None] if per_call else []
    else:
        order = [d for group in per_call for d in group]
    frames += [{"choices": [{"index": 0, "delta": {"tool_calls": [d]}}]} for d in order]
    finish = "tool_calls" if calls else "stop"
    frames.append({"choices": [{"index": 0, "delta": {}, "finish_reason": finish}]})
    frames.append({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}})
    frames.append({"_op": "done"})
    expected = {"reasoning": reasoning, "text": text, "calls": calls, "finish": finish}
    return frames, expected


def iter_pad(deltas: list[dict[str, Any]], width: int = 64) -> list[dict[str, Any] | None]:
    return deltas + [None] * (width - len(deltas))


def assembled(gateway: Gateway, model: str) -> tuple[Any, ...]:
    client = openai.OpenAI(base_url=gateway.base_url, api_key="k", _strict_response_validation=True, max_retries=0)
    with client.chat.completions.stream(
        model=model, messages=[{"role": "user", "content": "go"}], tools=TOOLS,
        stream_options={"include_usage": True},
    ) as stream:
        final = stream.get_final_completion()
    return summary(final.choices[0], final.usage)


def summary(choice: Any, usage: Any) -> tuple[Any, ...]:
    message = choice.message
    calls = tuple((c.id, c.function.name, c.function.arguments) for c in message.tool_calls or ())
    reasoning = (message.model_extra or {}).get("reasoning_content") or ""
    return (message.content or "", reasoning, calls, choice.finish_reason, usage.completion_tokens)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(answer=scripted_answers())
def test_any_split_assembles_the_same(answer: tuple[list[dict[str, Any]], dict[str, Any]], gateways: dict[str, Gateway], simulator: Simulator) -> None:
    frames, expected = answer
    model = simulator.script(frames)
    compatible = assembled(gateways["compatible"], model)
    realtime = assembled(gateways["realtime"], model)
    client = openai.OpenAI(base_url=gateways["compatible"].base_url, api_key="k", _strict_response_validation=True, max_retries=0)
    json_answer = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "go"}], tools=TOOLS)
    as_json = summary(json_answer.choices[0], json_answer.usage)
    assert compatible == realtime == as_json
    want_calls = tuple((c["id"], c["name"], c["arguments"]) for c in expected["calls"])
    assert compatible == (expected["text"], expected["reasoning"], want_calls, expected["finish"], 7)
