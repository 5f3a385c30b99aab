"""One driver per client protocol: run a request through the official SDK stream helper
(strict mode) and reduce what the client assembled to a protocol-neutral Outcome."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable

import anthropic
import openai

TOOLS = [
    {"name": "get_weather", "description": "Weather for a city",
     "schema": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
                "required": ["city"]}},
    {"name": "get_time", "description": "Time in a timezone",
     "schema": {"type": "object", "properties": {"timezone": {"type": "string"}}}},
]
PROMPT = "What is the weather in Paris?"


@dataclass(frozen=True)
class Named:
    """A ``tool_choice`` naming one tool, spelled per protocol by each driver."""

    name: str


@dataclass(frozen=True)
class Ask:
    """What to ask (defaults: the weather prompt, the two tools, a generous max_tokens)."""

    prompt: str = PROMPT
    max_tokens: int | None = None
    prefill: str | None = None  # a final assistant message the answer continues
    tools: bool = True
    temperature: float | None = None
    timeout: float = 30
    api_key: str = "k"  # a managed key's secret, for a gateway that requires one

    def chat_messages(self) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = [{"role": "user", "content": self.prompt}]
        if self.prefill is not None:
            messages.append({"role": "assistant", "content": self.prefill})
        return messages

    def options(self, max_key: str) -> dict[str, Any]:
        extra: dict[str, Any] = {}
        if self.max_tokens is not None:
            extra[max_key] = self.max_tokens
        if self.temperature is not None:
            extra["temperature"] = self.temperature
        return extra


DEFAULT_ASK = Ask()


@dataclass
class Outcome:
    ok: bool
    text: str = ""
    tools: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    finish: str | None = None  # canonical: stop | length | tool_calls | content_filter
    error: str = ""  # the error text the client saw (contains the gateway's error code)
    reasoning: str = ""
    usage: tuple[int, int] | None = None  # (input, output) tokens as the client saw them
    blocks: list[str] = field(default_factory=list)  # reasoning | text | tool, in order (not Chat)
    tool_ids: list[str] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)  # wire-order faults the SDK lets pass


def _error_text(exc: Exception) -> str:
    body = getattr(exc, "body", None)
    return f"{exc} {json.dumps(body) if body is not None else ''}"


def _openai(base_url: str, api_key: str = "k") -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key=api_key, _strict_response_validation=True, max_retries=0)


def _chat_options(tool_choice: Any, ask: Ask) -> dict[str, Any]:
    extra: dict[str, Any] = ask.options("max_tokens")
    if tool_choice in ("none", "required", "auto"):
        extra["tool_choice"] = tool_choice
    elif isinstance(tool_choice, Named):
        extra["tool_choice"] = {"type": "function", "function": {"name": tool_choice.name}}
    if ask.tools:
        # strict tools: the SDK then parses a call's arguments when the next call begins
        extra["tools"] = [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                                            "parameters": t["schema"], "strict": True}}
                          for t in TOOLS]
    return extra


def drive_chat(base_url: str, model: str, tool_choice: Any = None, ask: Ask = DEFAULT_ASK) -> Outcome:
    client = _openai(base_url, ask.api_key)
    extra = _chat_options(tool_choice, ask)
    try:
        with client.chat.completions.stream(model=model, messages=ask.chat_messages(),  # type: ignore[arg-type]
                                            stream_options={"include_usage": True}, timeout=ask.timeout, **extra) as stream:
            for _ in stream:  # with strict tools, length/content_filter raise in here
                pass
            final = stream.get_final_completion()
    except (openai.LengthFinishReasonError, openai.ContentFilterFinishReasonError):
        snapshot = stream.current_completion_snapshot
        choice = snapshot.choices[0]
        return Outcome(True, choice.message.content or "", [], choice.finish_reason,
                       reasoning=_chat_reasoning(choice.message), usage=_chat_usage(snapshot))
    except openai.APIError as exc:
        return Outcome(False, error=_error_text(exc))
    return _chat_outcome(final)


def _chat_outcome(completion: Any) -> Outcome:
    choice = completion.choices[0]
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls or ()]
    return Outcome(True, choice.message.content or "", calls, choice.finish_reason,
                   reasoning=_chat_reasoning(choice.message), usage=_chat_usage(completion),
                   tool_ids=[c.id for c in choice.message.tool_calls or ()])


def _chat_reasoning(message: Any) -> str:
    extra = message.model_extra or {}
    return extra.get("reasoning_content") or ""


def _chat_usage(completion: Any) -> tuple[int, int] | None:
    u = completion.usage
    return (u.prompt_tokens, u.completion_tokens) if u is not None else None


def _anthropic(base_url: str, api_key: str = "k") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base_url, api_key=api_key, _strict_response_validation=True, max_retries=0)


def _messages_options(tool_choice: Any, ask: Ask) -> dict[str, Any]:
    extra: dict[str, Any] = ask.options("max_tokens")
    extra.setdefault("max_tokens", 1024)
    if "temperature" in extra:  # not a parameter of this SDK's messages.stream()
        extra["extra_body"] = {"temperature": extra.pop("temperature")}
    if tool_choice in ("none", "required", "auto"):
        extra["tool_choice"] = {"type": {"required": "any"}.get(tool_choice, tool_choice)}
    elif isinstance(tool_choice, Named):
        extra["tool_choice"] = {"type": "tool", "name": tool_choice.name}
    if ask.tools:
        extra["tools"] = [{"name": t["name"], "description": t["description"], "input_schema": t["schema"]} for t in TOOLS]
    return extra


def drive_messages(base_url: str, model: str, tool_choice: Any = None, ask: Ask = DEFAULT_ASK) -> Outcome:
    client = _anthropic(base_url, ask.api_key)
    extra = _messages_options(tool_choice, ask)
    violations: list[str] = []
    try:
        with client.messages.stream(model=model, messages=ask.chat_messages(),  # type: ignore[arg-type]
                                    timeout=ask.timeout, **extra) as stream:
            for n, event in enumerate(stream):
                if n == 0 and event.type != "message_start":
                    violations.append(f"first event {event.type}")
            final = stream.get_final_message()
    except anthropic.APIError as exc:
        return Outcome(False, error=_error_text(exc), violations=violations)
    return _messages_outcome(final, violations)


def _messages_outcome(final: Any, violations: list[str]) -> Outcome:
    text = "".join(b.text for b in final.content if b.type == "text")
    calls = [(b.name, dict(b.input)) for b in final.content if b.type == "tool_use"]
    finish = {"end_turn": "stop", "tool_use": "tool_calls", "max_tokens": "length", "refusal": "content_filter"}
    kinds = {"thinking": "reasoning", "text": "text", "tool_use": "tool"}
    u = final.usage
    return Outcome(True, text, calls, finish.get(final.stop_reason or "", final.stop_reason),
                   reasoning="".join(b.thinking for b in final.content if b.type == "thinking"),
                   usage=(u.input_tokens + (u.cache_read_input_tokens or 0), u.output_tokens),
                   blocks=[kinds.get(b.type, b.type) for b in final.content],
                   tool_ids=[b.id for b in final.content if b.type == "tool_use"], violations=violations)


def _responses_options(tool_choice: Any, ask: Ask) -> dict[str, Any]:
    extra: dict[str, Any] = ask.options("max_output_tokens")
    if tool_choice in ("none", "required", "auto"):
        extra["tool_choice"] = tool_choice
    elif isinstance(tool_choice, Named):
        extra["tool_choice"] = {"type": "function", "name": tool_choice.name}
    if ask.tools:
        extra["tools"] = [{"type": "function", "name": t["name"], "description": t["description"],
                           "parameters": t["schema"], "strict": False}
                          for t in TOOLS]
    return extra


def _responses_input(ask: Ask) -> Any:
    if ask.prefill is None:
        return ask.prompt
    return [{"type": "message", "role": "user", "content": ask.prompt},
            {"type": "message", "role": "assistant", "content": ask.prefill}]


def drive_responses(base_url: str, model: str, tool_choice: Any = None, ask: Ask = DEFAULT_ASK) -> Outcome:
    client = _openai(base_url, ask.api_key)
    extra = _responses_options(tool_choice, ask)
    items = _responses_input(ask)
    failed: list[str] = []
    incomplete = None
    violations: list[str] = []
    try:
        with client.responses.stream(model=model, input=items, timeout=ask.timeout, **extra) as stream:
            for n, event in enumerate(stream):
                if n == 0 and event.type != "response.created":
                    violations.append(f"first event {event.type}")
                if event.sequence_number != n:  # Codex (Rust) rejects gaps and reordering
                    violations.append(f"event {n} ({event.type}) has sequence_number {event.sequence_number}")
                if event.type in ("error", "response.failed"):
                    failed.append(json.dumps(event.to_dict()))
                elif event.type == "response.incomplete":
                    incomplete = event.response
            final = incomplete if incomplete is not None else stream.get_final_response()
    except openai.APIError as exc:
        return Outcome(False, error=_error_text(exc), violations=violations)
    except RuntimeError as exc:  # the SDK's "Didn't receive a `response.completed` event."
        return Outcome(False, error=f"{exc} {' '.join(failed)}", violations=violations)
    if failed:
        return Outcome(False, error=" ".join(failed), violations=violations)
    return _responses_outcome(final, violations)


def _responses_outcome(final: Any, violations: list[str]) -> Outcome:
    calls = [(item.name, json.loads(item.arguments)) for item in final.output if item.type == "function_call"]
    if final.status == "incomplete":
        reason = final.incomplete_details.reason if final.incomplete_details else None
        finish = "length" if reason == "max_output_tokens" else reason
    else:
        finish = "tool_calls" if calls else "stop"
    kinds = {"reasoning": "reasoning", "message": "text", "function_call": "tool"}
    reasoning = "".join(s.text for item in final.output if item.type == "reasoning" for s in item.summary)
    u = final.usage
    return Outcome(True, final.output_text, calls, finish, reasoning=reasoning,
                   usage=(u.input_tokens, u.output_tokens) if u is not None else None,
                   blocks=[kinds.get(item.type, item.type) for item in final.output],
                   tool_ids=[item.call_id for item in final.output if item.type == "function_call"],
                   violations=violations)


DRIVERS: dict[str, Callable[..., Outcome]] = {
    "chat": drive_chat,
    "messages": drive_messages,
    "responses": drive_responses,
}


# -- the same requests, not streamed (the SDKs' create(), strict validation of the JSON) ----


def create_chat(base_url: str, model: str, tool_choice: Any = None, ask: Ask = DEFAULT_ASK) -> Outcome:
    try:
        completion = _openai(base_url, ask.api_key).chat.completions.create(
            model=model, messages=ask.chat_messages(), timeout=ask.timeout,  # type: ignore[arg-type]
            **_chat_options(tool_choice, ask))
    except openai.APIError as exc:
        return Outcome(False, error=_error_text(exc))
    return _chat_outcome(completion)


def create_messages(base_url: str, model: str, tool_choice: Any = None, ask: Ask = DEFAULT_ASK) -> Outcome:
    try:
        message = _anthropic(base_url, ask.api_key).messages.create(
            model=model, messages=ask.chat_messages(), timeout=ask.timeout,  # type: ignore[arg-type]
            **_messages_options(tool_choice, ask))
    except anthropic.APIError as exc:
        return Outcome(False, error=_error_text(exc))
    return _messages_outcome(message, [])


def create_responses(base_url: str, model: str, tool_choice: Any = None, ask: Ask = DEFAULT_ASK) -> Outcome:
    try:
        response = _openai(base_url, ask.api_key).responses.create(
            model=model, input=_responses_input(ask), timeout=ask.timeout, **_responses_options(tool_choice, ask))
    except openai.APIError as exc:
        return Outcome(False, error=_error_text(exc))
    return _responses_outcome(response, [])


#: protocol -> the non-streaming driver (same Outcome as its DRIVERS entry)
UNARY_DRIVERS: dict[str, Callable[..., Outcome]] = {
    "chat": create_chat,
    "messages": create_messages,
    "responses": create_responses,
}
