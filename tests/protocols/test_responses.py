"""OpenAI Responses through the gateway, both modes: the SDK's own stream accumulator in
strict mode against the simulator's ground truth, raw-SSE invariants the SDK does not
check, request translation as seen by the upstream, stored responses and errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai._models import validate_type
from openai.types.responses import ResponseStreamEvent

from tests.conftest import TOOL_SCENARIOS, Gateway, Simulator

FIXTURES = Path(__file__).parents[1] / "fixtures"
QUESTION = "What is the weather in Paris, and the time?"
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Weather for a city",
        "strict": False,
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
        },
    },
    {
        "type": "function",
        "name": "get_time",
        "description": "Time in a timezone",
        "strict": False,
        "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}}},
    },
]
CHAT_TOOLS = [
    {"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")}}
    for t in TOOLS
]


def client(gateway: Gateway) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=gateway.base_url, api_key="k", _strict_response_validation=True, max_retries=0
    )


def upstream_truth(simulator: Simulator, model: str, tools: bool = False) -> dict[str, Any]:
    """The upstream's own non-streaming answer: message plus usage."""
    body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": QUESTION}]}
    if tools:
        body["tools"] = CHAT_TOOLS
    response = httpx.post(simulator.url + "/v1/chat/completions", json=body)
    response.raise_for_status()
    data = response.json()
    return {**data["choices"][0]["message"], "usage": data["usage"]}


def sdk_stream(gateway: Gateway, model: str, **kwargs: Any) -> tuple[Any, list[Any]]:
    """(final response, events) through ``client.responses.stream`` in strict mode."""
    kwargs.setdefault("input", QUESTION)
    with client(gateway).responses.stream(model=model, **kwargs) as stream:
        events = list(stream)
        return stream.get_final_response(), events


def assert_deltas_agree(final: Any, events: list[Any]) -> None:
    """Deltas accumulated per item equal the final output (nothing in the SDK checks it)."""
    text: dict[str, str] = {}
    args: dict[str, str] = {}
    summary: dict[str, str] = {}
    for e in events:
        if e.type == "response.output_text.delta":
            text[e.item_id] = text.get(e.item_id, "") + e.delta
        elif e.type == "response.function_call_arguments.delta":
            args[e.item_id] = args.get(e.item_id, "") + e.delta
        elif e.type == "response.reasoning_summary_text.delta":
            summary[e.item_id] = summary.get(e.item_id, "") + e.delta
    for item in final.output:
        if item.type == "message":
            assert text.get(item.id, "") == "".join(c.text for c in item.content)
        elif item.type == "function_call":
            assert args.get(item.id, "") == item.arguments
        elif item.type == "reasoning":
            assert summary.get(item.id, "") == "".join(s.text for s in item.summary)
    ids = {item.id for item in final.output}
    assert set(text) | set(args) | set(summary) <= ids


def raw_events(
    gateway: Gateway, body: dict[str, Any]
) -> tuple[httpx.Response, list[dict[str, Any]], str]:
    """POST a streamed request; every frame's ``event:`` line must equal its data type."""
    with httpx.stream(
        "POST", gateway.base_url + "/responses", json={"stream": True, **body}, timeout=20
    ) as r:
        raw = b"".join(r.iter_bytes()).decode()
    events = []
    for frame in filter(None, raw.split("\n\n")):
        lines = frame.split("\n")
        assert lines[0].startswith("event: ") and lines[1].startswith("data: "), frame
        data = json.loads(lines[1][len("data: ") :])
        assert data["type"] == lines[0][len("event: ") :]
        events.append(data)
    return r, events, raw


def assert_stream_invariants(events: list[dict[str, Any]], raw: str) -> None:
    assert "[DONE]" not in raw
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    lifecycle = [e for e in events if "response" in e]
    assert len({e["response"]["id"] for e in lifecycle}) == 1
    assert lifecycle[-1] is events[-1]
    assert events[-1]["type"] in ("response.completed", "response.incomplete", "response.failed")
    added: dict[str, int] = {}
    done: set[str] = set()
    for e in events:
        validate_type(type_=ResponseStreamEvent, value=e)  # strict SDK model of every event
        if e["type"] == "response.output_item.added":
            assert e["item"]["id"] not in added and e["output_index"] not in added.values()
            added[e["item"]["id"]] = e["output_index"]
        elif e["type"] == "response.output_item.done":
            assert added[e["item"]["id"]] == e["output_index"]
            done.add(e["item"]["id"])
        elif "item_id" in e:
            assert e["item_id"] in added and e["item_id"] not in done, e
            assert added[e["item_id"]] == e["output_index"]
    assert set(added) == done
    final_ids = [item["id"] for item in events[-1]["response"]["output"]]
    assert final_ids == sorted(added, key=added.__getitem__)


# -- assembled answers against ground truth --------------------------------------------


@pytest.mark.parametrize("scenario", ["text", "echo", "reasoning", "reasoning_field"])
def test_text_answers_assemble(gateway: Gateway, simulator: Simulator, scenario: str) -> None:
    truth = upstream_truth(simulator, scenario)
    final, events = sdk_stream(gateway, scenario + ";chunk=3")
    assert final.status == "completed"
    assert final.output_text == truth["content"]
    reasoning = truth.get("reasoning_content") or truth.get("reasoning")
    items = [i for i in final.output if i.type == "reasoning"]
    if reasoning:
        assert [s.text for s in items[0].summary] == [reasoning]
        assert final.output[0].type == "reasoning"
    else:
        assert not items
    assert final.usage.output_tokens == truth["usage"]["completion_tokens"]
    assert final.usage.input_tokens == truth["usage"]["prompt_tokens"]
    assert final.usage.total_tokens == final.usage.input_tokens + final.usage.output_tokens
    assert final.model == scenario + ";chunk=3"
    assert_deltas_agree(final, events)


@pytest.mark.parametrize(
    "scenario",
    TOOL_SCENARIOS,
)
@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_tool_calls_assemble(
    gateway: Gateway, simulator: Simulator, scenario: str, chunk: int
) -> None:
    truth = upstream_truth(simulator, scenario, tools=True)
    final, events = sdk_stream(gateway, f"{scenario};chunk={chunk}", tools=TOOLS)
    assert final.status == "completed"
    assert (final.output_text or None) == (truth.get("content") or None)
    calls = [i for i in final.output if i.type == "function_call"]
    expected = truth["tool_calls"]
    assert [c.name for c in calls] == [c["function"]["name"] for c in expected]
    assert [json.loads(c.arguments) for c in calls] == [
        json.loads(c["function"]["arguments"]) for c in expected
    ]
    assert [c.call_id for c in calls] == [c["id"] for c in expected]
    assert all(c.status == "completed" and c.id.startswith("fc_") for c in calls)
    assert final.usage.output_tokens == truth["usage"]["completion_tokens"]
    assert_deltas_agree(final, events)


@pytest.mark.parametrize(
    "scenario", ["text", "reasoning", "text_then_tool", "parallel_tools", "interleaved_tools"]
)
def test_raw_stream_invariants(gateway: Gateway, scenario: str) -> None:
    response, events, raw = raw_events(
        gateway, {"model": scenario + ";chunk=2", "input": QUESTION, "tools": TOOLS}
    )
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert_stream_invariants(events, raw)
    assert events[-1]["type"] == "response.completed"
    assert events[0]["response"]["id"].startswith("resp_")


def test_json_answer_matches_stream(gateway: Gateway) -> None:
    created = client(gateway).responses.create(model="reasoning", input=QUESTION)
    streamed, _ = sdk_stream(gateway, "reasoning;chunk=2")
    assert created.object == "response" and created.status == "completed"
    assert (
        [i.type for i in created.output]
        == [i.type for i in streamed.output]
        == ["reasoning", "message"]
    )
    assert created.output_text == streamed.output_text
    assert created.usage.output_tokens == streamed.usage.output_tokens
    stored = httpx.get(f"{gateway.base_url}/responses/{created.id}").json()
    assert stored == created.model_dump(mode="json", exclude_unset=True)
    calls = client(gateway).responses.create(model="parallel_tools", input=QUESTION, tools=TOOLS)
    assert [
        (c.name, json.loads(c.arguments)) for c in calls.output if c.type == "function_call"
    ] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}),
        ("get_time", {"timezone": "Europe/Paris"}),
    ]


# -- terminals and errors ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("model", "reason"),
    [
        ("length", "max_output_tokens"),
        ("content_filter", "content_filter"),
        ("content_filter_partial", "content_filter"),
    ],
)
def test_incomplete_terminals(gateway: Gateway, model: str, reason: str) -> None:
    response, events, raw = raw_events(gateway, {"model": model, "input": QUESTION})
    assert response.status_code == 200
    assert_stream_invariants(events, raw)
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["status"] == "incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": reason}
    created = client(gateway).responses.create(model=model, input=QUESTION)
    assert created.status == "incomplete" and created.incomplete_details.reason == reason


def test_error_after_commit_is_error_then_failed(gateway: Gateway) -> None:
    response, events, raw = raw_events(gateway, {"model": "error_frame;chunk=4", "input": QUESTION})
    assert response.status_code == 200
    assert_stream_invariants(events, raw)
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    error, failed = events[-2], events[-1]
    assert error["message"] and error["code"] and error["param"] is None
    assert failed["response"]["status"] == "failed"
    assert failed["response"]["error"]["code"] == "server_error"
    with client(gateway).responses.stream(model="error_frame", input=QUESTION) as stream:
        types = [e.type for e in stream]
        assert types[-2:] == ["error", "response.failed"]
        with pytest.raises(RuntimeError):
            stream.get_final_response()


def test_rate_limited_is_429(gateway: Gateway, simulator: Simulator) -> None:
    with pytest.raises(openai.RateLimitError) as info:
        sdk_stream(gateway, "rate_limited;retry_after=7")
    assert info.value.response.headers["retry-after"] == "7"
    body = info.value.body
    assert isinstance(body, dict) and body["type"] == "rate_limit_error"


def test_compatible_keepalive_is_in_progress(keepalive_gateways: dict[str, Gateway]) -> None:
    response, events, raw = raw_events(
        # 8 s of silence: room for ~16 keepalives, of which it asks 2 (a loaded machine fires
        # the loop's timers late: 4 s saw one of the Chat twin's at load 19)
        keepalive_gateways["compatible"], {"model": "text;first_chunk_delay=8", "input": QUESTION}
    )
    assert_stream_invariants(events, raw)
    first_item = next(i for i, e in enumerate(events) if e["type"] == "response.output_item.added")
    before = [e["type"] for e in events[:first_item]]
    assert before[0] == "response.created"
    assert set(before[1:]) == {"response.in_progress"} and len(before) >= 3
    assert events[-1]["type"] == "response.completed"


# -- request validation --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b'{"model": "text", "input": ', None),
        ({"model": "text", "input": 123}, "input"),
        ({"model": "text", "input": "hi", "stream": "yes"}, "stream"),
        ({"input": "hi"}, "model"),
        ({"model": "text"}, "input"),
        ({"model": "text", "input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]"),
        (
            {"model": "text", "input": [{"type": "computer_call_output", "call_id": "c"}]},
            "input[0].type",
        ),
        (
            {
                "model": "text",
                "input": [
                    {"role": "user", "content": [{"type": "input_image", "file_id": "file-1"}]}
                ],
            },
            "input[0].content[0].file_id",
        ),
        ({"model": "text", "input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
        ({"model": "text", "input": "hi", "tool_choice": {"type": "web_search"}}, "tool_choice"),
        ({"model": "text", "input": "hi", "tools": [{"type": "frobnicate"}]}, "tools[0].type"),
        ({"model": "text", "input": "hi", "prompt": {"id": "pmpt_1"}}, "prompt"),
        ({"model": "text", "input": "hi", "conversation": "conv_1"}, "conversation"),
        ({"model": "text", "input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
        (
            {
                "model": "text",
                "input": "hi",
                "tools": TOOLS,
                "tool_choice": {"type": "function", "name": "nope"},
            },
            "tool_choice.name",
        ),
    ],
)
def test_invalid_requests_are_named_400s(
    gateway: Gateway, simulator: Simulator, body: Any, param: str | None
) -> None:
    simulator.clear()
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(
        gateway.base_url + "/responses",
        content=content,
        headers={"content-type": "application/json"},
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] == param
    assert simulator.requests() == []


def test_item_reference_code(gateway: Gateway) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client(gateway).responses.create(
            model="text", input=[{"type": "item_reference", "id": "msg_1"}]
        )
    assert info.value.code == "item_reference_not_supported"


# -- translation as seen by the upstream ----------------------------------------------------


def last_upstream(simulator: Simulator) -> dict[str, Any]:
    bodies = [r["body"] for r in simulator.requests() if r["path"].endswith("/chat/completions")]
    assert len(bodies) == 1
    return bodies[0]


def test_codex_request(gateway: Gateway, simulator: Simulator) -> None:
    body = json.loads((FIXTURES / "codex_request.json").read_text())
    simulator.clear()
    response, events, raw = raw_events(gateway, body)
    assert response.status_code == 200
    assert_stream_invariants(events, raw)
    final = events[-1]["response"]
    assert final["status"] == "completed" and final["store"] is False
    calls = [i for i in final["output"] if i["type"] == "function_call"]
    assert [(c["name"], c.get("namespace")) for c in calls] == [
        ("read_resource", "mcp_docs"),
        ("shell", None),
    ]
    assert all(isinstance(json.loads(c["arguments"]), dict) for c in calls)
    sent = last_upstream(simulator)
    assert [t["function"]["name"] for t in sent["tools"]] == [
        "mcp_docs__read_resource",
        "shell",
        "update_plan",
    ]
    assert sent["tool_choice"] == "auto" and sent["parallel_tool_calls"] is True
    assert sent["reasoning_effort"] == "medium"
    for key in (
        "input",
        "include",
        "store",
        "prompt_cache_key",
        "client_metadata",
        "text",
        "reasoning",
    ):
        assert key not in sent
    messages = sent["messages"]
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "tool", "user"]
    assert messages[0]["content"] == (
        "You are Codex, a coding agent running in a terminal.\n"
        "<permissions>sandbox_mode=workspace-write</permissions>"
    )
    assistant = messages[2]
    assert assistant["content"] == "Listing the files."
    assert assistant["reasoning_content"] == "I should list the files first."
    assert [(c["id"], c["function"]["name"]) for c in assistant["tool_calls"]] == [
        ("call_prev_shell", "shell"),
        ("call_prev_mcp", "mcp_docs__read_resource"),
    ]
    assert messages[3] == {
        "role": "tool",
        "tool_call_id": "call_prev_shell",
        "content": "README.md\nsrc\n",
    }
    assert messages[4] == {"role": "tool", "tool_call_id": "call_prev_mcp", "content": "# Readme"}
    # The SDK accepts the same stream (namespace resolves to the declared nested tool).
    with client(gateway).responses.stream(
        model=body["model"],
        input=body["input"],
        tools=body["tools"],
        extra_body={"client_metadata": {"a": "b"}},
    ) as stream:
        for _ in stream:
            pass
        got = stream.get_final_response()
    assert [(c.name, c.namespace) for c in got.output if c.type == "function_call"] == [
        ("read_resource", "mcp_docs"),
        ("shell", None),
    ]


def test_hosted_tools_dropped_and_keys_translated(gateway: Gateway, simulator: Simulator) -> None:
    simulator.clear()
    final, _ = sdk_stream(
        gateway,
        "tool",
        instructions="Be brief.",
        input=[
            {"role": "developer", "content": "dev rules"},
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "look"},
                    {
                        "type": "input_image",
                        "image_url": "data:image/png;base64,AAAA",
                        "detail": "low",
                    },
                ],
            },
        ],
        tools=[
            {"type": "web_search"},
            {"type": "file_search", "vector_store_ids": ["vs_1"]},
            TOOLS[1],
        ],
        tool_choice={"type": "function", "name": "get_time"},
        max_output_tokens=321,
        temperature=0.2,
        top_p=0.9,
        text={
            "format": {
                "type": "json_schema",
                "name": "out",
                "schema": {"type": "object"},
                "strict": True,
            }
        },
        metadata={"k": "v"},
    )
    assert [c.name for c in final.output if c.type == "function_call"] == ["get_time"]
    assert (
        final.max_output_tokens == 321 and final.temperature == 0.2 and final.metadata == {"k": "v"}
    )
    assert final.instructions == "Be brief."
    sent = last_upstream(simulator)
    assert [t["function"]["name"] for t in sent["tools"]] == ["get_time"]
    assert sent["tool_choice"] == {"type": "function", "function": {"name": "get_time"}}
    assert sent["max_tokens"] == 321 and sent["temperature"] == 0.2 and sent["top_p"] == 0.9
    assert sent["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "out", "schema": {"type": "object"}, "strict": True},
    }
    assert sent["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "system", "content": "dev rules"},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "look"},
                {
                    "type": "image_url",
                    "image_url": {"url": "data:image/png;base64,AAAA", "detail": "low"},
                },
            ],
        },
    ]


# -- stored responses, previous_response_id, reasoning replay --------------------------------


def test_previous_response_round_trip_and_get(gateway: Gateway, simulator: Simulator) -> None:
    response, events, _ = raw_events(
        gateway, {"model": "tool", "input": "first question", "tools": TOOLS}
    )
    streamed_final = events[-1]["response"]
    first_id = streamed_final["id"]
    call = next(i for i in streamed_final["output"] if i["type"] == "function_call")
    got = httpx.get(f"{gateway.base_url}/responses/{first_id}")
    assert got.status_code == 200 and got.json() == streamed_final
    assert client(gateway).responses.retrieve(first_id).id == first_id

    simulator.clear()
    final, _ = sdk_stream(
        gateway,
        "text",
        previous_response_id=first_id,
        instructions="Now answer.",
        input=[{"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"}],
        tools=TOOLS,
    )
    assert final.status == "completed" and final.previous_response_id == first_id
    messages = last_upstream(simulator)["messages"]
    assert messages[0] == {"role": "system", "content": "Now answer."}
    assert messages[1] == {"role": "user", "content": "first question"}
    assert messages[2]["role"] == "assistant"
    assert [(c["id"], c["function"]["name"]) for c in messages[2]["tool_calls"]] == [
        (call["call_id"], call["name"])
    ]
    assert messages[3] == {"role": "tool", "tool_call_id": call["call_id"], "content": "sunny"}

    # A third turn chains through the second (whose history includes the first).
    simulator.clear()
    third = client(gateway).responses.create(
        model="echo", previous_response_id=final.id, input="third"
    )
    assert third.status == "completed"
    roles = [m["role"] for m in last_upstream(simulator)["messages"]]
    assert roles == ["user", "assistant", "tool", "assistant", "user"]


def test_unknown_previous_response_and_get(gateway: Gateway, simulator: Simulator) -> None:
    simulator.clear()
    with pytest.raises(openai.BadRequestError) as info:
        sdk_stream(gateway, "text", previous_response_id="resp_does_not_exist")
    assert info.value.code == "previous_response_not_found"
    assert info.value.param == "previous_response_id"
    assert simulator.requests() == []
    with pytest.raises(openai.NotFoundError):
        client(gateway).responses.retrieve("resp_does_not_exist")
    body = httpx.get(gateway.base_url + "/responses/resp_nope").json()
    assert body["error"]["code"] == "response_not_found"


def test_store_false_is_not_stored(gateway: Gateway) -> None:
    final, _ = sdk_stream(gateway, "text", store=False)
    assert httpx.get(f"{gateway.base_url}/responses/{final.id}").status_code == 404
    with pytest.raises(openai.BadRequestError):
        sdk_stream(gateway, "text", previous_response_id=final.id)


def test_reasoning_replays_across_three_turns(gateway: Gateway, simulator: Simulator) -> None:
    """Turn 1 emits a reasoning item with an encrypted_content envelope; replaying it
    restores reasoning_content upstream; a summary-only or forged item falls back to its
    summary text."""
    truth = upstream_truth(simulator, "reasoning")
    history: list[Any] = [{"role": "user", "content": "q1"}]
    first, _ = sdk_stream(
        gateway, "reasoning", input=history, store=False, include=["reasoning.encrypted_content"]
    )
    reasoning = first.output[0]
    assert reasoning.type == "reasoning" and reasoning.encrypted_content
    history += [item.model_dump(exclude_none=True) for item in first.output] + [
        {"role": "user", "content": "q2"}
    ]

    simulator.clear()
    second, _ = sdk_stream(gateway, "reasoning", input=history, store=False)
    assert second.output[0].encrypted_content is None  # not asked for this time
    sent = last_upstream(simulator)["messages"]
    assert sent[1] == {
        "role": "assistant",
        "content": first.output_text,
        "reasoning_content": truth["reasoning_content"],
    }

    forged = {
        **second.output[0].model_dump(exclude_none=True),
        "encrypted_content": "cb2a1.Zm9v.bad",
    }
    forged["summary"] = [{"type": "summary_text", "text": "summary only"}]
    history += [
        forged,
        second.output[1].model_dump(exclude_none=True),
        {"role": "user", "content": "q3"},
    ]
    simulator.clear()
    third, _ = sdk_stream(gateway, "text", input=history, store=False)
    assert third.status == "completed"
    sent = last_upstream(simulator)["messages"]
    assert [m["role"] for m in sent] == ["user", "assistant", "user", "assistant", "user"]
    assert sent[1]["reasoning_content"] == truth["reasoning_content"]
    assert sent[3]["reasoning_content"] == "summary only"


def test_tool_output_images_follow_the_tool_messages(
    gateway: Gateway, simulator: Simulator
) -> None:
    """Chat tool messages are text-only: images from function_call_output parts go in one
    user message after the run of tool messages (never between an assistant's tool_calls
    and their results)."""
    image = {"type": "input_image", "image_url": "https://example.test/a.png"}
    simulator.clear()
    final, _ = sdk_stream(
        gateway,
        "text",
        input=[
            {"role": "user", "content": "look at both"},
            {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
            {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": "{}"},
            {
                "type": "function_call_output",
                "call_id": "c1",
                "output": [{"type": "input_text", "text": "shot"}, image],
            },
            {"type": "function_call_output", "call_id": "c2", "output": "12:00"},
        ],
        tools=TOOLS,
        tool_choice="none",
    )
    assert final.status == "completed" and final.tool_choice == "none"
    sent = last_upstream(simulator)
    assert sent["tool_choice"] == "none"
    messages = sent["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "tool", "user"]
    assert [c["id"] for c in messages[1]["tool_calls"]] == ["c1", "c2"]
    assert messages[2] == {"role": "tool", "tool_call_id": "c1", "content": "shot"}
    assert messages[4]["content"][1] == {
        "type": "image_url",
        "image_url": {"url": "https://example.test/a.png"},
    }


def test_encoder_directly_keeps_deltas_and_final_in_agreement() -> None:
    """A BlockStop whose content extends what was streamed gets the missing delta first;
    an error with no open block still continues the sequence."""
    from gateway.errors import GatewayError
    from gateway.protocols.responses.room import ResponsesRoom
    from gateway.stream.events import KEEPALIVE, BlockDelta, BlockStart, BlockStop, Error

    class _NoDb:
        pass

    room = ResponsesRoom(_NoDb())  # type: ignore[arg-type]
    parsed = room.parse(json.dumps({"model": "m", "input": "hi", "tools": TOOLS}).encode(), {})
    encoder = room.encoder(parsed, "resp_x")
    out = encoder.start() + encoder.encode(KEEPALIVE)
    out += encoder.encode(BlockStart(0, "tool", "call_1", "get_time"))
    out += encoder.encode(BlockDelta(0, "tool", '{"timezone":'))
    out += encoder.encode(BlockStop(0, "tool", '{"timezone":"UTC"}'))
    out += encoder.encode(Error(GatewayError("timeout", "upstream_timeout", "too slow")))
    events = [json.loads(f.split("\ndata: ")[1]) for f in out.decode().split("\n\n") if f]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    deltas = "".join(e["delta"] for e in events if e["type"].endswith("arguments.delta"))
    assert deltas == '{"timezone":"UTC"}'
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    assert events[-1]["response"]["output"][0]["arguments"] == deltas
    assert encoder.encode(KEEPALIVE) == b""  # nothing after the terminal


@pytest.mark.parametrize("kind", [[], {}, 3, None])
def test_an_input_item_whose_type_is_no_string_is_a_named_400(gateway: Gateway, simulator: Simulator, kind: Any) -> None:
    """Was a 500 (an unhashable type reached a set lookup), found by the hostile property test."""
    simulator.clear()
    item = {"type": kind, "role": "user", "content": "hi"}
    answer = httpx.post(gateway.base_url + "/responses", json={"model": "echo", "input": [item]})
    if kind is None:  # an explicit null is an absent type: a message
        assert answer.status_code == 200
        return
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == "input[0].type" and answer.json()["error"]["code"] == "invalid_type"
    assert simulator.requests() == []
