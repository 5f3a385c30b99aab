"""Messages request translation without a server: effort mapping, tools and tool_choice,
sampling and ignored keys, content blocks."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from gateway.protocols.messages.room import MessagesRoom
from gateway.protocols.tokens import IMAGE_TOKENS, count_chat_tokens
from tests.protocols.test_messages import MESSAGES, TOOLS

# -- translation details (no server) -------------------------------------------------------------


def parse(**body: Any) -> Any:
    body = {"model": "m", "max_tokens": 16, "messages": MESSAGES, **body}
    return MessagesRoom().parse(orjson.dumps(body), {})


@pytest.mark.parametrize(
    ("thinking", "output_config", "effort"),
    [
        (None, None, None),
        ({"type": "enabled", "budget_tokens": 1024}, None, "low"),
        ({"type": "enabled", "budget_tokens": 10000}, None, "medium"),
        ({"type": "enabled", "budget_tokens": 31999}, None, "high"),
        ({"type": "adaptive"}, None, None),
        ({"type": "adaptive"}, {"effort": "low"}, "low"),
        ({"type": "enabled", "budget_tokens": 31999}, {"effort": "medium"}, "medium"),
        (None, {"effort": "max"}, "high"),
        (None, {"effort": "someday"}, None),
        ({"type": "disabled"}, {"effort": "high"}, None),
    ],
)
def test_reasoning_effort_mapping(thinking: Any, output_config: Any, effort: str | None) -> None:
    extra = {
        k: v for k, v in (("thinking", thinking), ("output_config", output_config)) if v is not None
    }
    assert parse(**extra).upstream_body.get("reasoning_effort") == effort


def test_tools_and_choice_translation() -> None:
    server = {"type": "text_editor_20250728", "name": "str_replace_based_edit_tool"}
    tools = [
        {**TOOLS[0], "cache_control": {"type": "ephemeral"}, "eager_input_streaming": True},
        server,
        TOOLS[1],
        {"type": "computer_20250124", "name": "computer", "display_width_px": 1024},
    ]
    parsed = parse(tools=tools, tool_choice={"type": "any", "disable_parallel_tool_use": True})
    body = parsed.upstream_body
    assert body["tools"] == [
        {
            "type": "function",
            "function": {
                "name": t["name"],
                "description": t["description"],
                "parameters": t["input_schema"],
            },
        }
        for t in TOOLS
    ]
    assert body["tool_choice"] == "required" and body["parallel_tool_calls"] is False
    assert parsed.rules.choice == "required" and parsed.rules.parallel is False
    assert parsed.rules.declared == {"get_weather", "get_time"}
    assert parsed.facts.dropped_tools == ("str_replace_based_edit_tool", "computer")
    named = parse(tools=TOOLS, tool_choice={"type": "tool", "name": "get_time"})
    assert named.upstream_body["tool_choice"] == {
        "type": "function",
        "function": {"name": "get_time"},
    }
    assert named.rules.choice == "get_time" and "parallel_tool_calls" not in named.upstream_body
    assert parse(tools=TOOLS, tool_choice={"type": "none"}).upstream_body["tool_choice"] == "none"
    only_server = parse(tools=[server], tool_choice={"type": "auto"}).upstream_body
    assert "tools" not in only_server and "tool_choice" not in only_server


def test_sampling_and_ignored_keys() -> None:
    body = parse(
        stop_sequences=["END"],
        temperature=0.2,
        top_p=0.9,
        top_k=40,
        metadata={"user_id": "u1"},
        context_management={"edits": []},
        container="c",
        mcp_servers=[],
        service_tier="auto",
        some_future_key={"x": 1},
    ).upstream_body
    assert body == {
        "model": "m",
        "messages": [{"role": "user", "content": MESSAGES[0]["content"]}],
        "max_tokens": 16,
        "stop": ["END"],
        "temperature": 0.2,
        "top_p": 0.9,
        "top_k": 40,
    }


def test_content_blocks_translation() -> None:
    png = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="},
    }
    url = {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "look"}, png, url]},
        {
            "role": "assistant",
            "content": [
                {"type": "redacted_thinking", "data": "x"},
                {"type": "tool_use", "id": "call_9", "name": "shot", "input": {}},
            ],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "call_9",
                    "is_error": True,
                    "content": [{"type": "text", "text": "partial"}, url],
                }
            ],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "call_9", "is_error": True}],
        },
    ]
    sent = parse(messages=messages).upstream_body["messages"]
    assert sent[0]["content"] == [
        {"type": "text", "text": "look"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
        {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
    ]
    assert sent[1] == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_9", "type": "function", "function": {"name": "shot", "arguments": "{}"}}
        ],
    }
    assert sent[2] == {"role": "tool", "tool_call_id": "call_9", "content": "Error: partial"}
    assert sent[3] == {
        "role": "user",
        "content": [{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}],
    }
    assert sent[4] == {"role": "tool", "tool_call_id": "call_9", "content": "Error"}
    assert len(sent) == 5
    with_image = count_chat_tokens({"messages": sent[:1]})
    assert with_image >= 2 * IMAGE_TOKENS
