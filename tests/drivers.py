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


@dataclass
class Outcome:
    ok: bool
    text: str = ""
    tools: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    finish: str | None = None  # canonical: stop | length | tool_calls | content_filter
    error: str = ""  # the error text the client saw (contains the gateway's error code)


def _error_text(exc: Exception) -> str:
    body = getattr(exc, "body", None)
    return f"{exc} {json.dumps(body) if body is not None else ''}"


def drive_chat(base_url: str, model: str, tool_choice: Any = None) -> Outcome:
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="k", _strict_response_validation=True, max_retries=0)
    tools = [{"type": "function", "function": {"name": t["name"], "description": t["description"], "parameters": t["schema"]}}
             for t in TOOLS]
    extra: dict[str, Any] = {}
    if tool_choice == "none":
        extra["tool_choice"] = "none"
    try:
        with client.chat.completions.stream(model=model, messages=[{"role": "user", "content": PROMPT}], tools=tools,
                                            stream_options={"include_usage": True}, timeout=30, **extra) as stream:
            for _ in stream:
                pass
            snapshot = stream.current_completion_snapshot
            final = stream.get_final_completion()
    except (openai.LengthFinishReasonError, openai.ContentFilterFinishReasonError):
        choice = snapshot.choices[0]
        return Outcome(True, choice.message.content or "", [], choice.finish_reason)
    except openai.APIError as exc:
        return Outcome(False, error=_error_text(exc))
    choice = final.choices[0]
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls or ()]
    return Outcome(True, choice.message.content or "", calls, choice.finish_reason)


def drive_messages(base_url: str, model: str, tool_choice: Any = None) -> Outcome:
    client = anthropic.Anthropic(base_url=base_url, api_key="k", _strict_response_validation=True, max_retries=0)
    tools = [{"name": t["name"], "description": t["description"], "input_schema": t["schema"]} for t in TOOLS]
    extra: dict[str, Any] = {"tool_choice": {"type": "none"}} if tool_choice == "none" else {}
    try:
        with client.messages.stream(model=model, max_tokens=1024, messages=[{"role": "user", "content": PROMPT}],
                                    tools=tools, timeout=30, **extra) as stream:
            for _ in stream:
                pass
            final = stream.get_final_message()
    except anthropic.APIError as exc:
        return Outcome(False, error=_error_text(exc))
    text = "".join(b.text for b in final.content if b.type == "text")
    calls = [(b.name, dict(b.input)) for b in final.content if b.type == "tool_use"]
    finish = {"end_turn": "stop", "tool_use": "tool_calls", "max_tokens": "length", "refusal": "content_filter"}
    return Outcome(True, text, calls, finish.get(final.stop_reason or "", final.stop_reason))


def drive_responses(base_url: str, model: str, tool_choice: Any = None) -> Outcome:
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="k", _strict_response_validation=True, max_retries=0)
    tools = [{"type": "function", "name": t["name"], "description": t["description"], "parameters": t["schema"], "strict": False}
             for t in TOOLS]
    extra: dict[str, Any] = {"tool_choice": "none"} if tool_choice == "none" else {}
    failed: list[str] = []
    incomplete = None
    try:
        with client.responses.stream(model=model, input=PROMPT, tools=tools, timeout=30, **extra) as stream:
            for event in stream:
                if event.type in ("error", "response.failed"):
                    failed.append(json.dumps(event.to_dict()))
                elif event.type == "response.incomplete":
                    incomplete = event.response
            final = incomplete if incomplete is not None else stream.get_final_response()
    except openai.APIError as exc:
        return Outcome(False, error=_error_text(exc))
    except RuntimeError as exc:  # the SDK's "Didn't receive a `response.completed` event."
        return Outcome(False, error=f"{exc} {' '.join(failed)}")
    if failed:
        return Outcome(False, error=" ".join(failed))
    calls = [(item.name, json.loads(item.arguments)) for item in final.output if item.type == "function_call"]
    if final.status == "incomplete":
        reason = final.incomplete_details.reason if final.incomplete_details else None
        finish = "length" if reason == "max_output_tokens" else reason
    else:
        finish = "tool_calls" if calls else "stop"
    return Outcome(True, final.output_text, calls, finish)


DRIVERS: dict[str, Callable[..., Outcome]] = {
    "chat": drive_chat,
    "messages": drive_messages,
    "responses": drive_responses,
}
