"""The three rooms' stream encoders, fed canonical events directly: golden frame
sequences for one answer with reasoning, text and a tool call, and for a mid-stream
error (no server; random ids and timestamps are normalised)."""

from __future__ import annotations

import re
from typing import Any

import orjson

from gateway.errors import GatewayError
from gateway.protocols.chat import ChatRoom
from gateway.protocols.messages.room import MessagesRoom
from gateway.protocols.responses.room import ResponsesRoom
from gateway.stream.events import (
    KEEPALIVE,
    BlockDelta,
    BlockStart,
    BlockStop,
    Error,
    Event,
    Finish,
    Usage,
)

ANSWER: list[Event] = [
    BlockStart(0, "reasoning"), BlockDelta(0, "reasoning", "think"), BlockStop(0, "reasoning", "think"),
    BlockStart(1, "text"), BlockDelta(1, "text", "Hi"), BlockStop(1, "text", "Hi"),
    BlockStart(2, "tool", "call_1", "get_weather"), BlockDelta(2, "tool", '{"city":'),
    BlockDelta(2, "tool", '"Paris"}'), BlockStop(2, "tool", '{"city":"Paris"}'),
    Finish("tool_calls", Usage(prompt_tokens=5, completion_tokens=7, total_tokens=12, reasoning_tokens=2, cached_tokens=1)),
]
FAILED: list[Event] = [BlockStart(0, "text"), BlockDelta(0, "text", "Hal"), Error(GatewayError("upstream", "upstream_disconnected", "cut"))]
USER = [{"role": "user", "content": "hi"}]


class DictStore:
    async def save(self, response_id: str, record: dict[str, Any]) -> None: ...

    async def load(self, response_id: str) -> dict[str, Any] | None:
        return None


def encode(room: Any, body: dict[str, Any], events: list[Event]) -> list[tuple[str | None, Any]]:
    """(event name, data) per SSE frame; comment frames as (None, comment)."""
    encoder = room.encoder(room.parse(orjson.dumps(body), {}), "resp_X")
    raw = encoder.start() + encoder.encode(KEEPALIVE) + b"".join(encoder.encode(e) for e in events)
    frames: list[tuple[str | None, Any]] = []
    for block in raw.decode().split("\n\n")[:-1]:
        if block.startswith(":"):
            frames.append((None, block))
            continue
        name = block.split("\n")[0][7:] if block.startswith("event: ") else None
        data = block.split("data: ", 1)[1]
        frames.append((name, data if data == "[DONE]" else orjson.loads(data)))
    return frames


def chat_body(**extra: Any) -> dict[str, Any]:
    return {"model": "m", "stream": True, "messages": USER, **extra}


def test_chat_golden_answer() -> None:
    frames = encode(ChatRoom(), chat_body(stream_options={"include_usage": True}), ANSWER)
    assert all(f[1]["id"] == "resp_X" and f[1]["object"] == "chat.completion.chunk" for f in frames if isinstance(f[1], dict))
    short = [f[1] if not isinstance(f[1], dict) else (f[1]["choices"][0]["delta"], f[1]["choices"][0]["finish_reason"]) if f[1]["choices"] else ("usage", f[1]["usage"]) for f in frames]
    assert short == [
        ({"role": "assistant", "content": ""}, None),
        ": keepalive",
        ({"reasoning_content": "think"}, None),
        ({"content": "Hi"}, None),
        ({"tool_calls": [{"index": 0, "id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ""}}]}, None),
        ({"tool_calls": [{"index": 0, "function": {"arguments": '{"city":'}}]}, None),
        ({"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}, None),
        ({}, "tool_calls"),
        ("usage", {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12,
                   "completion_tokens_details": {"reasoning_tokens": 2}, "prompt_tokens_details": {"cached_tokens": 1}}),
        "[DONE]",
    ]


def test_chat_usage_chunk_only_when_asked_and_error_frame() -> None:
    assert not any(isinstance(f[1], dict) and "usage" in f[1] for f in encode(ChatRoom(), chat_body(), ANSWER))
    frames = encode(ChatRoom(), chat_body(), FAILED)
    assert frames[-2][1] == {"error": {"message": "cut", "type": "api_error", "param": None, "code": "upstream_disconnected"}}
    assert frames[-1][1] == "[DONE]"


MESSAGES_BODY = {"model": "m", "max_tokens": 9, "stream": True, "messages": USER}


def test_messages_golden_answer() -> None:
    frames = encode(MessagesRoom(), MESSAGES_BODY, ANSWER)
    assert [name for name, _ in frames] == [name for name, _ in frames if name]  # every frame has an event line
    start = frames[0][1]
    assert frames[0][0] == "message_start" and start["message"]["id"] == "resp_X" and start["message"]["content"] == []
    assert frames[1:] == [
        ("ping", {"type": "ping"}),
        ("content_block_start", {"type": "content_block_start", "index": 0, "content_block": {"type": "thinking", "thinking": "", "signature": ""}}),
        ("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": {"type": "thinking_delta", "thinking": "think"}}),
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        ("content_block_start", {"type": "content_block_start", "index": 1, "content_block": {"type": "text", "text": ""}}),
        ("content_block_delta", {"type": "content_block_delta", "index": 1, "delta": {"type": "text_delta", "text": "Hi"}}),
        ("content_block_stop", {"type": "content_block_stop", "index": 1}),
        ("content_block_start", {"type": "content_block_start", "index": 2, "content_block": {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {}}}),
        ("content_block_delta", {"type": "content_block_delta", "index": 2, "delta": {"type": "input_json_delta", "partial_json": '{"city":'}}),
        ("content_block_delta", {"type": "content_block_delta", "index": 2, "delta": {"type": "input_json_delta", "partial_json": '"Paris"}'}}),
        ("content_block_stop", {"type": "content_block_stop", "index": 2}),
        ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": None},
                           "usage": {"input_tokens": 4, "output_tokens": 7, "cache_read_input_tokens": 1, "output_tokens_details": {"thinking_tokens": 2}}}),
        ("message_stop", {"type": "message_stop"}),
    ]


def test_messages_error_ends_the_stream() -> None:
    frames = encode(MessagesRoom(), MESSAGES_BODY, [*FAILED, Finish("stop", None)])
    assert frames[-1] == ("error", {"type": "error", "error": {"type": "api_error", "message": "upstream_disconnected: cut"}})
    assert "message_stop" not in [name for name, _ in frames]


RESPONSES_BODY = {"model": "m", "stream": True, "store": False, "input": "hi"}
_ID = re.compile(r"^(rs|msg|fc)_[0-9a-f]{32}$")


def responses_short(frames: list[tuple[str | None, Any]]) -> list[tuple[Any, ...]]:
    out = []
    for name, data in frames:
        assert name == data["type"]
        item_id = data.get("item_id") or (data.get("item") or {}).get("id")
        if item_id is not None:
            assert _ID.match(item_id), item_id
        detail = data.get("delta") or data.get("text") or data.get("arguments") or (data.get("item") or {}).get("status")
        out.append((data["sequence_number"], name, data.get("output_index"), detail))
    return out


def test_responses_golden_answer() -> None:
    frames = encode(ResponsesRoom(DictStore()), RESPONSES_BODY, ANSWER)
    assert responses_short(frames) == [
        (0, "response.created", None, None),
        (1, "response.in_progress", None, None),
        (2, "response.in_progress", None, None),  # the keepalive
        (3, "response.output_item.added", 0, None),
        (4, "response.reasoning_summary_part.added", 0, None),
        (5, "response.reasoning_summary_text.delta", 0, "think"),
        (6, "response.reasoning_summary_text.done", 0, "think"),
        (7, "response.reasoning_summary_part.done", 0, None),
        (8, "response.output_item.done", 0, None),
        (9, "response.output_item.added", 1, "in_progress"),
        (10, "response.content_part.added", 1, None),
        (11, "response.output_text.delta", 1, "Hi"),
        (12, "response.output_text.done", 1, "Hi"),
        (13, "response.content_part.done", 1, None),
        (14, "response.output_item.done", 1, "completed"),
        (15, "response.output_item.added", 2, "in_progress"),
        (16, "response.function_call_arguments.delta", 2, '{"city":'),
        (17, "response.function_call_arguments.delta", 2, '"Paris"}'),
        (18, "response.function_call_arguments.done", 2, '{"city":"Paris"}'),
        (19, "response.output_item.done", 2, "completed"),
        (20, "response.completed", None, None),
    ]
    final = frames[-1][1]["response"]
    assert final["id"] == "resp_X" and final["status"] == "completed"
    assert [i["type"] for i in final["output"]] == ["reasoning", "message", "function_call"]
    assert final["output"][2]["arguments"] == '{"city":"Paris"}' and final["output"][2]["call_id"] == "call_1"
    assert final["usage"]["input_tokens"] == 5 and final["usage"]["output_tokens_details"] == {"reasoning_tokens": 2}


def test_responses_error_closes_the_open_item_then_fails() -> None:
    frames = encode(ResponsesRoom(DictStore()), RESPONSES_BODY, FAILED)
    short = responses_short(frames)
    assert [s[1] for s in short[3:]] == [
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "error", "response.failed",
    ]
    assert [s[0] for s in short] == list(range(len(short)))
    assert frames[-2][1]["code"] == "upstream_disconnected"
    failed = frames[-1][1]["response"]
    assert failed["status"] == "failed" and failed["error"] == {"code": "server_error", "message": "cut (upstream_disconnected)"}
    assert failed["output"][0]["status"] == "incomplete"


def test_streamed_response_numbers_every_event_and_outputs_items_in_finish_order() -> None:
    from gateway.protocols.responses.streamed_response import StreamedResponse

    response = StreamedResponse("resp_1", {"model": "m"})
    raw = response.added(1, {"id": "b", "v": "announced"}) + response.added(0, {"id": "a", "v": "announced"})
    assert response.snapshot("in_progress")["output"] == []  # nothing finished is shown in progress
    raw += response.finished(0, {"id": "a", "v": "final"}) + response.event("response.in_progress", {})
    raw += response.finished(1, {"id": "b", "v": "final"})
    events = [orjson.loads(block.split("data: ", 1)[1]) for block in raw.decode().split("\n\n")[:-1]]
    assert [e["sequence_number"] for e in events] == [0, 1, 2, 3, 4]
    assert [(e["type"], e.get("output_index")) for e in events] == [
        ("response.output_item.added", 1), ("response.output_item.added", 0), ("response.output_item.done", 0),
        ("response.in_progress", None), ("response.output_item.done", 1),
    ]
    final = response.snapshot("completed", usage=None)
    assert final["id"] == "resp_1" and final["model"] == "m" and final["status"] == "completed"
    assert final["output"] == [{"id": "a", "v": "final"}, {"id": "b", "v": "final"}]  # finish order, last state
