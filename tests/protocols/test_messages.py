"""Anthropic Messages through the gateway, both modes: assembled with the anthropic SDK's
own stream accumulator in strict mode, checked frame by frame with httpx where the SDK is
lenient, and compared with the simulator's non-streaming ground truth."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import orjson
import pytest

from gateway.protocols.messages.translate import translate
from gateway.protocols.tokens import count_chat_tokens, count_text, quick_token_estimate
from gateway.simulator.server import REASONING, TEXT
from tests.conftest import TOOL_SCENARIOS, Gateway, Simulator
from tests.fixtures import claude_code

TOOLS = [
    {
        "name": "get_weather",
        "description": "Weather for a city",
        "input_schema": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
        },
    },
    {
        "name": "get_time",
        "description": "Time in a timezone",
        "input_schema": {"type": "object", "properties": {"timezone": {"type": "string"}}},
    },
]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris, and the time?"}]


def client(gateway: Gateway) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        base_url=gateway.url, api_key="k", _strict_response_validation=True, max_retries=0
    )


def stream_final(
    gateway: Gateway, model: str, tools: list[dict] | None = None, **kwargs: Any
) -> Any:
    extra: dict[str, Any] = {"tools": tools} if tools else {}
    kwargs.setdefault("messages", MESSAGES)
    with client(gateway).messages.stream(model=model, max_tokens=1024, **extra, **kwargs) as stream:
        for _ in stream:
            pass
        return stream.get_final_message()


def last_upstream_body(simulator: Simulator) -> dict[str, Any]:
    return simulator.requests()[-1]["body"]


def upstream_truth(simulator: Simulator) -> dict[str, Any]:
    """Replay what the gateway last sent upstream, without streaming: the upstream's meaning."""
    body = {
        k: v
        for k, v in last_upstream_body(simulator).items()
        if k not in ("stream", "stream_options")
    }
    response = httpx.post(simulator.url + "/v1/chat/completions", json=body)
    response.raise_for_status()
    return response.json()


def raw_frames(
    gateway: Gateway, body: dict[str, Any], path: str = "/v1/messages", **kw: Any
) -> tuple[int, list[tuple[str | None, dict]]]:
    """(status, [(event name, data)]) of one raw streamed request."""
    with httpx.stream("POST", gateway.url + path, json=body, timeout=20, **kw) as response:
        raw = b"".join(response.iter_bytes())
    frames: list[tuple[str | None, dict]] = []
    for chunk in raw.decode().split("\n\n"):
        if not chunk.strip():
            continue
        event = None
        data = None
        for line in chunk.split("\n"):
            if line.startswith("event: "):
                event = line[len("event: ") :]
            elif line.startswith("data: "):
                data = json.loads(line[len("data: ") :])
        assert data is not None, chunk
        frames.append((event, data))
    return response.status_code, frames


def check_contract(
    frames: list[tuple[str | None, dict]], *, ends_with_error: bool = False
) -> list[dict]:
    """The Messages wire contract; returns the assembled blocks."""
    assert all(event is not None and event == data["type"] for event, data in frames), frames
    assert frames[0][0] == "message_start"
    assert frames[0][1]["message"]["id"].startswith("msg_")
    blocks: list[dict] = []
    open_index: int | None = None
    inputs: dict[int, str] = {}
    for event, data in frames[1:]:
        if event == "content_block_start":
            assert open_index is None, "a block started while another was open"
            assert data["index"] == len(blocks), "block indexes must be contiguous from 0"
            open_index = data["index"]
            blocks.append(dict(data["content_block"]))
        elif event == "content_block_delta":
            assert data["index"] == open_index
            block, delta = blocks[open_index], data["delta"]
            kind = {
                "text": "text_delta",
                "thinking": "thinking_delta",
                "tool_use": "input_json_delta",
            }[block["type"]]
            assert delta["type"] == kind
            if kind == "input_json_delta":
                inputs[open_index] = inputs.get(open_index, "") + delta["partial_json"]
            else:
                key = "text" if kind == "text_delta" else "thinking"
                block[key] += delta[key]
        elif event == "content_block_stop":
            assert data["index"] == open_index
            open_index = None
        elif event == "ping":
            assert data == {"type": "ping"}
    for index, text in inputs.items():
        value = json.loads(text)
        assert isinstance(value, dict)
        blocks[index]["input"] = value
    names = [event for event, _ in frames]
    if ends_with_error:
        assert names[-1] == "error" and "message_stop" not in names and names.count("error") == 1
    else:
        assert names[-2:] == ["message_delta", "message_stop"]
        assert open_index is None
        assert "usage" in frames[-2][1] and frames[-2][1]["delta"]["stop_reason"]
    return blocks


# -- text and thinking ----------------------------------------------------------------------


@pytest.mark.parametrize("scenario", ["text", "echo", "no_done", "reasoning", "reasoning_field"])
def test_text_and_thinking_assemble(gateway: Gateway, simulator: Simulator, scenario: str) -> None:
    final = stream_final(gateway, scenario + ";chunk=3")
    truth = upstream_truth(simulator)
    message = truth["choices"][0]["message"]
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    kinds = [b.type for b in final.content]
    assert kinds == (["thinking", "text"] if reasoning else ["text"])
    if reasoning:
        assert final.content[0].thinking == reasoning == REASONING
        assert final.content[0].signature == ""
    assert final.content[-1].text == message["content"]
    assert final.stop_reason == "end_turn" and final.stop_sequence is None
    assert final.role == "assistant" and final.model == scenario + ";chunk=3"
    assert final.id.startswith("msg_") and len(final.id) == 4 + 24
    assert final.usage.output_tokens == truth["usage"]["completion_tokens"]
    assert final.usage.input_tokens == truth["usage"]["prompt_tokens"]


# -- tools -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "scenario",
    TOOL_SCENARIOS,
)
@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_tool_use_assembles(
    gateway: Gateway, simulator: Simulator, scenario: str, chunk: int
) -> None:
    final = stream_final(gateway, f"{scenario};chunk={chunk}", TOOLS)
    truth = upstream_truth(simulator)["choices"][0]["message"]
    assert final.stop_reason == "tool_use"
    texts = [b.text for b in final.content if b.type == "text"]
    assert texts == ([truth["content"]] if truth.get("content") else [])
    uses = [b for b in final.content if b.type == "tool_use"]
    expected = truth["tool_calls"]
    assert [u.name for u in uses] == [c["function"]["name"] for c in expected]
    assert [u.id for u in uses] == [c["id"] for c in expected]  # upstream ids kept as-is
    assert [u.input for u in uses] == [json.loads(c["function"]["arguments"]) for c in expected]
    assert [b.type for b in final.content][-len(uses) :] == ["tool_use"] * len(uses)


@pytest.mark.parametrize(
    "scenario", ["reasoning", "text_then_tool", "parallel_tools", "interleaved_tools", "late_name"]
)
def test_raw_stream_contract(gateway: Gateway, simulator: Simulator, scenario: str) -> None:
    body = {
        "model": f"{scenario};chunk=2",
        "max_tokens": 512,
        "messages": MESSAGES,
        "tools": TOOLS,
        "stream": True,
    }
    status, frames = raw_frames(gateway, body)
    assert status == 200
    blocks = check_contract(frames)
    truth = upstream_truth(simulator)["choices"][0]["message"]
    assert [b["input"] for b in blocks if b["type"] == "tool_use"] == [
        json.loads(c["function"]["arguments"]) for c in truth.get("tool_calls") or []
    ]
    start = frames[0][1]["message"]
    assert start["usage"] == {
        "input_tokens": quick_token_estimate(translate(orjson.dumps(body)).body),
        "output_tokens": 0,
    }
    assert (
        start["content"] == [] and start["stop_reason"] is None and start["model"] == body["model"]
    )


@pytest.mark.parametrize(
    ("scenario", "stop_reason", "kinds"),
    [
        ("length", "max_tokens", ["text"]),
        ("content_filter", "refusal", []),
        ("content_filter_partial", "refusal", ["text"]),
    ],
)
def test_stop_reasons(gateway: Gateway, scenario: str, stop_reason: str, kinds: list[str]) -> None:
    final = stream_final(gateway, scenario)
    assert final.stop_reason == stop_reason
    assert [b.type for b in final.content] == kinds


def test_usage_maps_cache_and_thinking_tokens(gateway: Gateway, simulator: Simulator) -> None:
    usage = {
        "prompt_tokens": 100,
        "completion_tokens": 9,
        "total_tokens": 109,
        "prompt_tokens_details": {"cached_tokens": 60},
        "completion_tokens_details": {"reasoning_tokens": 4},
    }
    model = simulator.script(
        [
            {
                "choices": [
                    {
                        "index": 0,
                        "delta": {"role": "assistant", "reasoning_content": "hm"},
                        "finish_reason": None,
                    }
                ]
            },
            {"choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": "stop"}]},
            {"choices": [], "usage": usage},
            {"_op": "done"},
        ]
    )
    final = stream_final(gateway, model)
    assert final.usage.input_tokens == 40 and final.usage.cache_read_input_tokens == 60
    assert final.usage.output_tokens == 9 and final.usage.output_tokens_details.thinking_tokens == 4


def test_usage_estimated_when_upstream_reports_none(gateway: Gateway) -> None:
    """No upstream usage: input from the request estimate, output from the answer's tokens."""
    final = stream_final(gateway, "text;usage=none")
    body = {"model": "text;usage=none", "max_tokens": 1024, "messages": MESSAGES}
    assert final.usage.input_tokens == count_chat_tokens(translate(orjson.dumps(body)).body)
    assert final.usage.output_tokens == count_text(TEXT)


def test_error_after_commit_is_an_error_event(gateway: Gateway) -> None:
    status, frames = raw_frames(
        gateway, {"model": "error_frame", "max_tokens": 64, "messages": MESSAGES, "stream": True}
    )
    assert status == 200
    check_contract(frames, ends_with_error=True)
    error = frames[-1][1]
    assert (
        error["error"]["type"] == "api_error" and "upstream exploded" in error["error"]["message"]
    )
    with pytest.raises(anthropic.APIStatusError) as caught:
        stream_final(gateway, "error_frame")
    assert "upstream exploded" in str(caught.value)


def test_json_answer_matches_stream(gateway: Gateway) -> None:
    for model in ("parallel_tools", "reasoning", "text_then_tool"):
        created = client(gateway).messages.create(
            model=model, max_tokens=256, messages=MESSAGES, tools=TOOLS
        )
        streamed = stream_final(gateway, model + ";chunk=4", TOOLS)
        assert created.type == "message" and created.id.startswith("msg_")
        assert [b.to_dict() for b in created.content] == [b.to_dict() for b in streamed.content]
        assert created.stop_reason == streamed.stop_reason
        assert created.usage.output_tokens == streamed.usage.output_tokens


def test_ids_round_trip_and_thinking_replays(gateway: Gateway, simulator: Simulator) -> None:
    """Three turns: thinking and tool_use blocks go back as received, tool ids survive."""
    history: list[dict[str, Any]] = list(MESSAGES)
    first = stream_final(gateway, "reasoning", TOOLS, messages=history)
    history += [first.to_param(), {"role": "user", "content": "Now call the tool."}]
    second = stream_final(gateway, "tool", TOOLS, messages=history)
    call = next(b for b in second.content if b.type == "tool_use")
    history += [
        second.to_param(),
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "18 C"}],
        },
    ]
    third = stream_final(gateway, "echo", TOOLS, messages=history)
    assert third.stop_reason == "end_turn"
    sent = last_upstream_body(simulator)["messages"]
    assert sent[1] == {"role": "assistant", "content": TEXT, "reasoning_content": REASONING}
    assert sent[3]["tool_calls"][0]["id"] == call.id
    assert json.loads(sent[3]["tool_calls"][0]["function"]["arguments"]) == call.input
    assert sent[4] == {"role": "tool", "tool_call_id": call.id, "content": "18 C"}


# -- Claude Code -----------------------------------------------------------------------------


def _check_claude_code_upstream(body: dict[str, Any]) -> None:
    cc = claude_code
    messages = body["messages"]
    assert messages[0] == {"role": "system", "content": "\n\n".join(cc.SYSTEM_BLOCKS)}
    names = [t["function"]["name"] for t in body["tools"]]
    assert names == [spec[0] for spec in cc.TOOL_SPECS]  # server tools dropped, order kept
    by_name = {t["name"]: t for t in cc.tools() if "input_schema" in t}
    for tool in body["tools"]:
        fn = tool["function"]
        assert tool["type"] == "function" and set(fn) == {"name", "description", "parameters"}
        assert fn["parameters"] == by_name[fn["name"]]["input_schema"]  # $schema and all
    assert [m["role"] for m in messages] == [
        "system",
        "user",
        "assistant",
        "tool",
        "tool",
        "user",
        "assistant",
        "system",
        "user",
    ]
    assert messages[2]["reasoning_content"] == cc.THINKING_1
    assert [c["id"] for c in messages[2]["tool_calls"]] == ["toolu_01A", "toolu_01B"]
    assert messages[3] == {"role": "tool", "tool_call_id": "toolu_01A", "content": cc.TOOL_OUTPUT}
    assert messages[4] == {
        "role": "tool",
        "tool_call_id": "toolu_01B",
        "content": "Error: " + cc.MISSING_FILE,
    }
    assert messages[5] == {"role": "user", "content": cc.REMINDER}
    assert messages[6] == {
        "role": "assistant",
        "content": "The failing test is tests/test_api.py::test_retry.",
    }
    assert messages[7] == {"role": "system", "content": cc.SYSTEM_ITEM}
    assert messages[8] == {"role": "user", "content": cc.LAST_PROMPT}
    assert body["reasoning_effort"] == "medium"  # output_config.effort wins over the budget
    assert body["max_tokens"] == 32000
    for key in ("metadata", "thinking", "context_management", "output_config", "system", "user"):
        assert key not in body


def test_claude_code_request_raw(gateway: Gateway, simulator: Simulator) -> None:
    body = claude_code.request("text_then_tool;chunk=7")
    assert len(orjson.dumps(body)) > 70_000
    simulator.clear()
    status, frames = raw_frames(
        gateway, body, "/v1/messages?beta=true", headers=claude_code.HEADERS
    )
    assert status == 200
    blocks = check_contract(frames)
    assert [b["type"] for b in blocks] == ["text", "tool_use"]
    assert blocks[1]["name"] == "Task" and blocks[1]["input"] == {
        "city": "Paris",
        "unit": "celsius",
    }
    assert frames[-2][1]["delta"]["stop_reason"] == "tool_use"
    (sent,) = simulator.requests()
    assert sent["path"] == "/v1/chat/completions"
    _check_claude_code_upstream(sent["body"])


def test_claude_code_request_sdk_beta(gateway: Gateway, simulator: Simulator) -> None:
    """The SDK's beta client posts to /v1/messages?beta=true, as Claude Code does."""
    body = claude_code.request("reasoning;chunk=16")
    rest = {k: v for k, v in body.items() if k not in ("model", "max_tokens", "messages", "stream")}
    simulator.clear()
    with client(gateway).beta.messages.stream(
        model=body["model"],
        max_tokens=body["max_tokens"],
        messages=body["messages"],
        betas=["interleaved-thinking-2025-05-14", "context-management-2025-06-27"],
        extra_body=rest,
    ) as stream:
        for _ in stream:
            pass
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == REASONING and final.content[1].text == TEXT
    (sent,) = simulator.requests()
    _check_claude_code_upstream(sent["body"])


def test_pings_while_compatible_collects(keepalive_gateways: dict[str, Gateway]) -> None:
    """The keepalive interval is 0.5 s; the first chunk comes after 8 s, room for about
    sixteen pings, of which at least two must come first even when a busy machine fires the
    loop's timers late (1.2 s left room for two, and a loaded run saw one; 4 s saw one of
    the Chat twin's keepalives at load 19)."""
    body = {
        "model": "text;first_chunk_delay=8",
        "max_tokens": 64,
        "messages": MESSAGES,
        "stream": True,
    }
    status, frames = raw_frames(keepalive_gateways["compatible"], body)
    assert status == 200
    check_contract(frames)
    names = [event for event, _ in frames]
    first_block = names.index("content_block_start")
    assert names[0] == "message_start"
    assert names[1:first_block].count("ping") >= 2 and set(names[1:first_block]) == {"ping"}


# -- errors ------------------------------------------------------------------------------------


BASE = {"model": "text", "max_tokens": 10, "messages": MESSAGES, "stream": True}
DROP = object()


def _user(*blocks: dict) -> list[dict]:
    return [{"role": "user", "content": list(blocks)}]


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"max_tokens": DROP}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"messages": "hi"}, "messages"),
        ({"messages": []}, "messages"),
        ({"stream": "yes"}, "stream"),
        ({"model": 5}, "model"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0.role"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
        (
            {"messages": _user({"type": "tool_result", "tool_use_id": "t", "is_error": "yes"})},
            "messages.0.content.0.is_error",
        ),
        ({"temperature": "hot"}, "temperature"),
        (
            {"messages": _user({"type": "document", "source": {"type": "text", "data": "x"}})},
            "messages.0.content.0.type",
        ),
        ({"tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice.name"),
        ({"thinking": {"type": "enabled"}}, "thinking.budget_tokens"),
        ({"system": 3}, "system"),
        ({"tool_choice": {"type": "any"}}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
        ({"tools": [{"name": "x"}]}, "tools.0.input_schema"),
    ],
)
def test_invalid_requests_are_named_400s(
    gateway: Gateway, simulator: Simulator, change: dict, param: str
) -> None:
    body = {k: v for k, v in {**BASE, **change}.items() if v is not DROP}
    simulator.clear()
    response = httpx.post(gateway.url + "/v1/messages", json=body)
    assert response.status_code == 400
    payload = response.json()
    assert payload["type"] == "error" and payload["error"]["type"] == "invalid_request_error"
    assert param in payload["error"]["message"]
    assert simulator.requests() == []


def test_malformed_json_is_a_400(gateway: Gateway, simulator: Simulator) -> None:
    simulator.clear()
    response = httpx.post(
        gateway.url + "/v1/messages",
        content=b'{"model": "text", ',
        headers={"content-type": "application/json"},
    )
    assert response.status_code == 400
    assert response.json()["error"] == {
        "type": "invalid_request_error",
        "message": response.json()["error"]["message"],
    }
    assert "not valid JSON" in response.json()["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as caught:
        client(gateway).messages.create(model="text", max_tokens=0, messages=MESSAGES)  # type: ignore[arg-type]
    assert "max_tokens" in caught.value.message
    assert simulator.requests() == []


def test_upstream_rate_limit_is_a_429(gateway: Gateway) -> None:
    gateway.reset_cooldowns()  # another module's "rate_limited" may still cool down: Retry-After < 7
    response = httpx.post(
        gateway.url + "/v1/messages",
        json={"model": "rate_limited", "max_tokens": 10, "messages": MESSAGES, "stream": True},
    )
    assert response.status_code == 429 and response.headers["retry-after"] == "7"
    assert response.json()["error"]["type"] == "rate_limit_error"
    with pytest.raises(anthropic.RateLimitError) as caught:
        stream_final(gateway, "rate_limited")
    assert caught.value.body["error"]["type"] == "rate_limit_error"  # type: ignore[index]


def test_upstream_failure_is_a_502(gateway: Gateway) -> None:
    with pytest.raises(anthropic.InternalServerError) as caught:
        stream_final(gateway, "server_error")
    assert caught.value.status_code == 502
    assert (
        caught.value.body["type"] == "error" and caught.value.body["error"]["type"] == "api_error"
    )  # type: ignore[index]
    with pytest.raises(anthropic.InternalServerError):
        client(gateway).messages.create(model="server_error", max_tokens=10, messages=MESSAGES)


# -- count_tokens ------------------------------------------------------------------------------


def test_count_tokens(gateways: dict[str, Gateway], simulator: Simulator) -> None:
    gateway = gateways["realtime"]
    simulator.clear()
    small = client(gateway).messages.count_tokens(model="text", messages=MESSAGES)
    bigger = client(gateway).messages.count_tokens(
        model="text", messages=MESSAGES, tools=TOOLS, system="Be brief."
    )
    assert 0 < small.input_tokens < bigger.input_tokens
    body = claude_code.request("text")
    response = httpx.post(
        gateway.url + "/v1/messages/count_tokens?beta=true", json=body, headers=claude_code.HEADERS
    )
    assert response.status_code == 200
    expected = count_chat_tokens(translate(orjson.dumps(body)).body)
    assert response.json() == {"input_tokens": expected} and expected > 10_000
    assert small.input_tokens == count_chat_tokens(
        translate(orjson.dumps({"model": "text", "messages": MESSAGES}), count_only=True).body
    )
    bad = httpx.post(
        gateway.url + "/v1/messages/count_tokens", json={"model": "text", "messages": "x"}
    )
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
    assert simulator.requests() == []
