"""Hostile request bodies for the generation routes, and what a correct answer to one looks like.

Shared by the property test (``tests/generation/test_hostile_input.py``, hypothesis draws from the
same pieces) and the benchmark (``bench/malformed.py``, a seeded corpus of a few thousand
bodies). Each case says whether it is invalid *by construction* (a known field given a
value of the wrong type or out of range, a body that is not an object, nesting deeper
than any request needs): those must be refused with the route's 400 and must never reach
the upstream. Other mutations (a random node replaced or deleted) may or may not be
valid; for them only the answer's shape is checked.
"""

from __future__ import annotations

import copy
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

ROUTES = ("/v1/chat/completions", "/v1/responses", "/v1/messages", "/v1/messages/count_tokens")
OPENAI_ROUTES = ("/v1/chat/completions", "/v1/responses")

#: A 2 MB string (the issue's ``system`` that crashed the tokenizer is half that).
HUGE = 2_000_000
#: Deeper than any request needs; orjson still parses it (its own limit is 1024).
DEEP = 1000

_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}

SEEDS: dict[str, list[dict[str, Any]]] = {
    "/v1/chat/completions": [
        {"model": "echo", "messages": [{"role": "user", "content": "hello"}]},
        {
            "model": "tool", "stream": True, "stream_options": {"include_usage": True},
            "max_tokens": 64, "temperature": 0.5, "top_p": 0.9, "stop": ["\n\n"],
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "weather?"}]},
            ],
            "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": _SCHEMA}}],
            "tool_choice": "auto",
        },
        {
            "model": "echo", "max_completion_tokens": 32, "presence_penalty": 0.1, "frequency_penalty": 0.2,
            "seed": 7, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": _SCHEMA}},
            "top_k": 20, "repetition_penalty": 1.05, "chat_template_kwargs": {"enable_thinking": False},
            "messages": [
                {"role": "user", "content": "go"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
            ],
        },
        {
            "model": "echo", "user": "u1", "logprobs": True, "top_logprobs": 2, "logit_bias": {"50256": -100},
            "messages": [
                {"role": "developer", "content": "be brief"},
                {"role": "user", "name": "ann", "content": [
                    {"type": "text", "text": "what is this?"},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo=", "detail": "low"}}]},
                {"role": "assistant", "content": "a cat", "reasoning_content": "looked at it"},
                {"role": "user", "content": "sure?"},
            ],
        },
    ],
    "/v1/responses": [
        {"model": "echo", "input": "hello"},
        {
            "model": "tool", "stream": True, "instructions": "be brief", "max_output_tokens": 64,
            "temperature": 0.3, "top_p": 0.8, "store": False,
            "input": [{"role": "user", "content": [{"type": "input_text", "text": "weather?"}]}],
            "tools": [{"type": "function", "name": "get_weather", "parameters": _SCHEMA}],
            "tool_choice": "auto", "reasoning": {"effort": "low"},
        },
        {
            "model": "echo", "store": False, "include": ["reasoning.encrypted_content"],
            "input": [
                {"type": "reasoning", "summary": [{"type": "summary_text", "text": "think"}], "encrypted_content": "e"},
                {"type": "function_call", "call_id": "c0", "name": "get_weather", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c0", "output": [{"type": "input_text", "text": "ok"}]},
                {"role": "user", "content": "thanks"},
            ],
        },
        {
            "model": "echo", "store": False, "text": {"format": {"type": "json_schema", "name": "x", "schema": _SCHEMA}},
            "input": [
                {"type": "message", "role": "user", "content": "go"},
                {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            ],
        },
    ],
    "/v1/messages": [
        {"model": "echo", "max_tokens": 64, "messages": [{"role": "user", "content": "hello"}]},
        {
            "model": "tool", "max_tokens": 64, "stream": True, "temperature": 0.5, "top_p": 0.9, "top_k": 5,
            "stop_sequences": ["END"], "system": [{"type": "text", "text": "be brief"}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "weather?"}]}],
            "tools": [{"name": "get_weather", "description": "w", "input_schema": _SCHEMA}],
            "tool_choice": {"type": "auto"}, "thinking": {"type": "enabled", "budget_tokens": 1024},
        },
        {
            "model": "echo", "max_tokens": 64,
            "messages": [
                {"role": "user", "content": "go"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_weather", "input": {}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sunny"}]},
            ],
            "tools": [{"name": "get_weather", "input_schema": _SCHEMA}],
        },
        {
            "model": "tool", "max_tokens": 64, "metadata": {"user_id": "u"}, "output_config": {"effort": "high"},
            "tool_choice": {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
            "tools": [{"name": "get_weather", "input_schema": _SCHEMA, "cache_control": {"type": "ephemeral"}},
                      {"type": "web_search_20250305", "name": "web_search"}],
            "messages": [
                {"role": "user", "content": [
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}},
                    {"type": "text", "text": "what is this?", "cache_control": {"type": "ephemeral"}}]},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "hmm", "signature": "s"},
                    {"type": "redacted_thinking", "data": "x"},
                    {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Paris"}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "is_error": True, "content": [
                        {"type": "text", "text": "no"},
                        {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}]}]},
                {"role": "system", "content": "keep going"},
            ],
        },
    ],
}
SEEDS["/v1/messages/count_tokens"] = [
    {k: v for k, v in body.items() if k not in ("max_tokens", "stream")} for body in SEEDS["/v1/messages"]
]

_NOT_INT = ["str", [], {}, True, 1.5, -1, 0, 2**70]
_NOT_PROB = ["hot", [], {}, True, -1, 2**70, 1.5]  # probabilities: 0..1
_NOT_TEMP = ["hot", [], {}, True, -1, 2**70]
_NOT_PENALTY = ["x", [], {}, True, -3, 2**70]
_NOT_STOP = [1, {}, [1], [None], [[]], True]
_NOT_SCHEMA = ["str", [], 1, True, {"type": 5}, {"type": "string"}]

#: Known fields of each route and values each of them must refuse (path segments, values).
BAD_FIELDS: dict[str, list[tuple[tuple[Any, ...], list[Any]]]] = {
    "/v1/chat/completions": [
        (("model",), [None, 1, [], {}, ""]),
        (("messages",), [None, "str", {}, [], [1], [{}], [{"role": "robot", "content": "x"}]]),
        (("messages", 0, "content"), [1, {}, True, [1], [{"type": "text", "text": 5}]]),
        (("stream",), ["yes", 1, [], {}]),
        (("max_tokens",), _NOT_INT),
        (("max_completion_tokens",), _NOT_INT),
        (("temperature",), _NOT_TEMP + [3]),
        (("top_p",), _NOT_PROB),
        (("presence_penalty",), _NOT_PENALTY),
        (("frequency_penalty",), _NOT_PENALTY),
        (("stop",), _NOT_STOP),
        (("seed",), ["x", 1.5, [], {}, 2**70]),
        (("n",), ["x", 0, -1, 1.5, 2**70]),
        (("response_format",), ["json", 1, [], {"type": "yaml"}, {"type": "json_schema"},
                                {"type": "json_schema", "json_schema": {"name": "x", "schema": "s"}}]),
        (("tools",), ["str", {}, [1], [{"type": "function"}], [{"type": "function", "function": {"name": 1}}]]),
        (("tools", 0, "function", "parameters"), _NOT_SCHEMA),
        (("tool_choice",), [1, [], "sometimes", {"type": "function"}, {"type": "function", "function": "f"},
                            {"type": "function", "function": {"name": ["f"]}}]),
        (("top_k",), ["x", 1.5, [], {}, 2**70]),
        (("repetition_penalty",), ["x", [], -1, 0, 2**70]),
        (("chat_template_kwargs",), ["x", 1, []]),
    ],
    "/v1/responses": [
        (("model",), [None, 1, [], {}, ""]),
        (("input",), [1, {}, True, [1], [{"type": "message", "role": "robot", "content": "x"}]]),
        (("instructions",), [1, [], {}]),
        (("stream",), ["yes", 1, [], {}]),
        (("max_output_tokens",), _NOT_INT),
        (("temperature",), _NOT_TEMP + [3]),
        (("top_p",), _NOT_PROB),
        (("tools",), ["str", {}, [1], [{"type": "function"}]]),
        (("tools", 0, "parameters"), _NOT_SCHEMA),
        (("text",), ["x", 1, []]),
        (("text", "format"), ["x", 1, [], {"type": "yaml"}, {"type": "json_schema", "name": "x", "schema": 1}]),
        (("reasoning",), ["x", 1, []]),
        (("reasoning", "effort"), [1, [], {}]),
        (("tool_choice",), [1, [], "sometimes", {"type": "function", "name": 1}, {"type": "web_search"}]),
        (("metadata",), ["x", 1, [], {"k": 1}]),
        (("input", 0, "summary"), [5, "x", {}, [1]]),
        (("input", 0, "content"), [5, {}, [1], [{"type": "input_text", "text": 1}]]),
        (("input", 1, "arguments"), [{}, 1, []]),
        (("input", 1, "call_id"), [1, None, ""]),
    ],
    "/v1/messages": [
        (("model",), [None, 1, [], {}, ""]),
        (("messages",), [None, "str", {}, [], [1], [{}], [{"role": "robot", "content": "x"}]]),
        (("messages", 0, "content"), [1, {}, True, [1], [{"type": "text", "text": 5}]]),
        (("max_tokens",), [*_NOT_INT, None]),
        (("stream",), ["yes", 1, [], {}]),
        (("system",), [1, {}, [1], [{"type": "image"}]]),
        (("temperature",), _NOT_PROB),
        (("top_p",), _NOT_PROB),
        (("top_k",), ["x", -1, 1.5, [], {}, 2**70]),
        (("stop_sequences",), _NOT_STOP + ["END"]),
        (("tools",), ["str", {}, [1], [{"name": "x"}], [{"name": 1, "input_schema": {}}]]),
        (("tools", 0, "input_schema"), _NOT_SCHEMA),
        (("tool_choice",), ["auto", 1, [], {"type": "sometimes"}]),
        (("thinking",), ["x", 1, [], {"type": "sometimes"}, {"type": "enabled", "budget_tokens": "x"}]),
        (("metadata",), ["x", 1, []]),
    ],
}
BAD_FIELDS["/v1/messages/count_tokens"] = [
    entry for entry in BAD_FIELDS["/v1/messages"] if entry[0] not in (("max_tokens",), ("stream",))
]

#: Whole bodies that are not a request at all (raw bytes).
BAD_BODIES: list[bytes] = [
    b"", b" ", b"null", b"true", b"1", b"-1", b'"str"', b"[]", b"{}", b"[{}]", b"{", b"NaN",
    b'{"model": NaN}', b'{"model": "echo", "temperature": Infinity}', b'{"max_tokens": 1e400}',
    b"\xff\xfe", b'{"model": "echo", "messages": [' + b"[" * DEEP + b"]" * DEEP + b"]}",
]

HOSTILE_VALUES: list[Any] = ["str", "", [], {}, -1, 0, 1.5, 2**70, -(2**70), True, None, [None], {"": None}]


@dataclass(frozen=True)
class Case:
    route: str
    body: bytes
    invalid: bool  # refused by construction: a 400 and no upstream call
    label: str  # how it was made, for the report


#: Stands for :func:`deep_bytes` inside a value given to :func:`encode`.
DEEP_MARK = "\x00deep\x00"


def deep_bytes(depth: int = DEEP) -> bytes:
    """``depth`` levels of alternating objects and lists (built as bytes: Python's json
    module cannot serialise that deep)."""
    opens = b"".join(b"[" if i % 2 else b'{"k":' for i in range(depth))
    closes = b"".join(b"]" if i % 2 else b"}" for i in reversed(range(depth)))
    return opens + b'"bottom"' + closes


def encode(value: Any) -> bytes:
    """JSON bytes (NaN/Infinity as Python writes them); :data:`DEEP_MARK` becomes a deep value."""
    raw = json.dumps(value, allow_nan=True).encode()
    marker = json.dumps(DEEP_MARK).encode()
    return raw.replace(marker, deep_bytes()) if marker in raw else raw


def set_path(body: dict[str, Any], path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    """A copy of ``body`` with ``value`` at ``path`` (missing containers are created)."""
    out = copy.deepcopy(body)
    node: Any = out
    for segment in path[:-1]:
        if isinstance(node, list):
            node = node[segment]
        else:
            node = node.setdefault(segment, {} if not isinstance(segment, int) else [])
    if isinstance(node, list):
        node[path[-1]] = value
    else:
        node[path[-1]] = value
    return out


def paths(value: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every path into a JSON value (not the root)."""
    if isinstance(value, dict):
        items: Any = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    else:
        return
    for key, child in items:
        yield (*prefix, key)
        yield from paths(child, (*prefix, key))


def delete_path(body: dict[str, Any], path: tuple[Any, ...]) -> dict[str, Any]:
    out = copy.deepcopy(body)
    node: Any = out
    for segment in path[:-1]:
        node = node[segment]
    del node[path[-1]]
    return out


def applicable(seed: dict[str, Any], path: tuple[Any, ...]) -> bool:
    """A bad-field path applies to a seed that has it (a nested value is replaced, never
    invented: ``input.0.summary`` only where ``input[0]`` is a reasoning item); a top-level
    key applies to every seed."""
    node: Any = seed
    for segment in path if len(path) > 1 else ():
        if (isinstance(node, list) and isinstance(segment, int) and segment < len(node)) or (
            isinstance(node, dict) and segment in node
        ):
            node = node[segment]
        else:
            return False
    return True


def huge_prompt(route: str, stream: bool, size: int = HUGE) -> dict[str, Any]:
    """A valid request whose one prompt is ``size`` characters of words."""
    text = ("lorem ipsum dolor sit amet " * (size // 27 + 1))[:size]
    if route == "/v1/responses":
        return {"model": "echo", "input": text, "stream": stream, "store": False}
    if route == "/v1/chat/completions":
        return {"model": "echo", "messages": [{"role": "user", "content": text}], "stream": stream}
    body: dict[str, Any] = {"model": "echo", "system": text, "messages": [{"role": "user", "content": "hi"}]}
    if route == "/v1/messages":
        body.update(max_tokens=16, stream=stream)
    return body


def corpus(seed: int = 14, random_mutations: int = 1250) -> list[Case]:
    """The benchmark's corpus: every bad field on every seed, every bad body on every route,
    deep values and huge strings at random places, random node replacements and deletions."""
    rng = random.Random(seed)
    cases: list[Case] = []
    for route in ROUTES:
        cases += [Case(route, raw, True, "bad_body") for raw in BAD_BODIES]
        for seed_body in SEEDS[route]:
            for path, values in BAD_FIELDS[route]:
                if not applicable(seed_body, path):
                    continue
                for value in values:
                    label = "bad_field:" + ".".join(map(str, path))
                    cases.append(Case(route, encode(set_path(seed_body, path, value)), True, label))
            all_paths = list(paths(seed_body))
            for path in rng.sample(all_paths, min(3, len(all_paths))):
                cases.append(Case(route, encode(set_path(seed_body, path, DEEP_MARK)), True, "deep"))
            cases.append(Case(route, encode({**seed_body, "x_extra": DEEP_MARK}), True, "deep_unknown_key"))
        for stream in (False, True):
            if route == "/v1/messages/count_tokens" and stream:
                continue
            cases.append(Case(route, encode(huge_prompt(route, stream)), False, "huge_prompt"))
    for _ in range(random_mutations):
        route = rng.choice(ROUTES)
        seed_body = rng.choice(SEEDS[route])
        path = rng.choice(list(paths(seed_body)))
        roll = rng.random()
        if roll < 0.2:
            cases.append(Case(route, encode(delete_path(seed_body, path)), False, "delete"))
        elif roll < 0.3:
            cases.append(Case(route, encode(set_path(seed_body, path, "x" * HUGE)), False, "huge_string"))
        else:
            value = rng.choice(HOSTILE_VALUES)
            cases.append(Case(route, encode(set_path(seed_body, path, value)), False, "replace"))
    return cases


# -- what a correct answer looks like ---------------------------------------------------------


def error_shape_problem(route: str, body: Any) -> str | None:
    """None when ``body`` is exactly the route's error shape, else what is wrong with it."""
    if route in OPENAI_ROUTES:
        if not isinstance(body, dict) or set(body) != {"error"}:
            return f"not {{'error': ...}}: {str(body)[:200]}"
        err = body["error"]
        if not isinstance(err, dict) or set(err) != {"message", "type", "param", "code"}:
            return f"error keys {sorted(err) if isinstance(err, dict) else err!r}"
        if not (isinstance(err["message"], str) and isinstance(err["type"], str)):
            return "message/type not strings"
        if not all(err[k] is None or isinstance(err[k], str) for k in ("param", "code")):
            return "param/code not string or null"
        return None
    if not isinstance(body, dict) or set(body) != {"type", "error"} or body["type"] != "error":
        return f"not {{'type': 'error', 'error': ...}}: {str(body)[:200]}"
    err = body["error"]
    if not isinstance(err, dict) or set(err) != {"type", "message"}:
        return f"error keys {sorted(err) if isinstance(err, dict) else err!r}"
    if not (isinstance(err["type"], str) and isinstance(err["message"], str)):
        return "type/message not strings"
    return None


#: The last SSE event of a finished stream, per route.
_TERMINALS = {
    "/v1/chat/completions": ("[DONE]",),
    "/v1/responses": ("response.completed", "response.incomplete", "response.failed"),
    "/v1/messages": ("message_stop", "error"),
}


def stream_problem(route: str, text: str) -> str | None:
    """None when an SSE body ends with the route's terminal event."""
    frames = [f for f in text.replace("\r\n", "\n").split("\n\n") if f.strip() and not f.startswith(":")]
    if not frames:
        return "empty stream"
    last = frames[-1]
    if route == "/v1/chat/completions":
        return None if last.strip() == "data: [DONE]" else f"ends with {last[:120]!r}"
    event = next((line[7:] for line in last.splitlines() if line.startswith("event: ")), None)
    return None if event in _TERMINALS[route] else f"ends with event {event!r}"
