"""What the simulator's scenarios are made of: the model string's options, the request
they read, the reply they return, and the delta builders they share.

Pure, no I/O: ``sim_scenarios`` (scripted and agent scenarios, framing) and ``sim_quirks``
(what real upstreams send differently) build their replies from these.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

Frame = dict[str, Any]
Delta = dict[str, Any]

GREETING = "Hello from the codebuddy2api simulator. "
TEXT = GREETING + "This reply is scripted, deterministic and split into fragments."
REASONING = "The user wants a short greeting. I will answer politely and briefly."
DEFAULT_TOOLS = ("get_weather", "get_time")
TOOL_ARGS: tuple[dict[str, str], ...] = (
    {"city": "Paris", "unit": "celsius"},
    {"timezone": "Europe/Paris"},
)


def _flag(raw: str) -> bool:
    return raw.strip().lower() in {"1", "true", "yes", "on"}


_OPTION_TYPES: dict[str, Callable[[str], Any]] = {
    "chunk": int, "delay": float, "ttfb": float, "first_chunk_delay": float,
    "usage": str, "done": _flag, "finish_chunk": str, "unstable_id": _flag,
    "size": int, "status": int, "retry_after": int, "repairable": _flag, "pause_at": float,
}
_SCENARIO_DEFAULTS: dict[str, dict[str, Any]] = {
    "slow_first_byte": {"ttfb": 2.0}, "slow_headers": {"ttfb": 2.0}, "large": {"chunk": 256},
}
_CHOICES = {"usage": {"separate", "last", "none", "running"}, "finish_chunk": {"own", "last"}}


@dataclass(frozen=True)
class Options:
    """Behaviour knobs parsed from ``<scenario>;key=value;...`` model strings."""

    scenario: str = "echo"
    chunk: int = 8
    delay: float = 0.0
    ttfb: float = 0.0
    first_chunk_delay: float = 0.0
    usage: str = "separate"
    done: bool = True
    finish_chunk: str = "own"
    unstable_id: bool = False
    size: int = 100_000
    status: int | None = None
    retry_after: int | None = None
    repairable: bool = False  # answer like `tool` once the gateway asks for a repair
    pause_at: float = 0.0  # a fraction of the frames (0 < f < 1) after which the stream stalls (PAUSE_SECONDS)


def parse_model(model: str) -> Options:
    """Split the model string into scenario + options; raise ValueError on bad values.

    Unknown option keys are ignored so newer clients can talk to older simulators.
    """
    scenario, *pairs = (part.strip() for part in model.split(";"))
    values: dict[str, Any] = dict(_SCENARIO_DEFAULTS.get(scenario, {}))
    for pair in pairs:
        key, sep, raw = (s.strip() for s in pair.partition("="))
        convert = _OPTION_TYPES.get(key)
        if not sep or convert is None:
            continue
        try:
            values[key] = convert(raw)
        except ValueError as exc:
            raise ValueError(f"invalid simulator option {pair!r}") from exc
        if key in _CHOICES and raw not in _CHOICES[key]:
            raise ValueError(f"invalid simulator option {pair!r}")
    return Options(scenario=scenario or "echo", **values)


def text_of(content: Any) -> str:
    """Flatten string or list-of-parts message content to plain text."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)
        )
    return ""


def chat_messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    messages = body.get("messages")
    return [m for m in messages if isinstance(m, dict)] if isinstance(messages, list) else []


def last_user_text(body: Mapping[str, Any]) -> str:
    users = [m for m in chat_messages(body) if m.get("role") == "user"]
    return text_of(users[-1].get("content")) if users else ""


@dataclass(frozen=True)
class Ctx:
    """Everything a scenario may depend on; scenarios stay pure functions of it."""

    opts: Options
    body: Mapping[str, Any]
    tools: tuple[str, str]

    def split(self, text: str) -> list[str]:
        size = max(1, self.opts.chunk)
        return [text[i : i + size] for i in range(0, len(text), size)]

    def split_two(self, text: str) -> list[str]:
        """Split into at least two fragments (for quirks that need a second delta)."""
        parts = self.split(text)
        if len(parts) >= 2:
            return parts
        half = max(1, len(text) // 2)
        return [text[:half], text[half:]]


@dataclass
class Reply:
    """A scenario's output: content deltas plus how the stream should end."""

    deltas: list[Delta]
    finish: str | None = "stop"
    terminal: list[Frame] | None = None  # ends the stream abruptly (no finish/usage/done)
    done: bool = True
    usage_at: str | None = None  # choice (Moonshot), x_groq (Groq), running (vLLM continuous)


def tool_args(i: int) -> str:
    return json.dumps(TOOL_ARGS[i % len(TOOL_ARGS)])


def call_id(i: int) -> str:
    return f"call_sim_{i}"


def tool_delta(
    *, index: int | None = None, id: str | None = None, name: str | None = None,
    args: str | None = None, typed: bool = False,
) -> Delta:
    """One ``tool_calls`` delta carrying only the fields given (quirks omit some)."""
    entry: dict[str, Any] = {} if index is None else {"index": index}
    if id is not None:
        entry["id"] = id
    if typed:
        entry["type"] = "function"
    fn = {k: v for k, v in (("name", name), ("arguments", args)) if v is not None}
    if fn:
        entry["function"] = fn
    return {"tool_calls": [entry]}


def content_deltas(ctx: Ctx, text: str, key: str = "content") -> list[Delta]:
    return [{key: frag} for frag in ctx.split(text)]


def call_deltas(ctx: Ctx, i: int, name: str | None = None, args: str | None = None) -> list[Delta]:
    """Canonical OpenAI shape: a start delta with id/type/name, then argument fragments."""
    start = tool_delta(index=i, id=call_id(i), name=name or ctx.tools[i], args="", typed=True)
    frags = ctx.split(tool_args(i) if args is None else args)
    return [start, *(tool_delta(index=i, args=f) for f in frags)]
