"""The simulator's scenarios: pure functions from a request to the frames an upstream
would send, plus the fold of frames into the equivalent non-streaming answer.

Here: the scripted and agent scenarios, the scenario table, errors and 200s that are no
stream, and the framing every reply gets; the upstream quirks are in ``sim_quirks``, the
options, request readers and reply builders in ``sim_reply``.

The request's ``model`` string selects a scenario (plus ``;key=value`` options), so every
quirk seen in vLLM, llama.cpp, DeepSeek and hosted providers can be reproduced
deterministically, and tests can build the same frames without a server.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
import zlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from gateway.protocols.responses.compaction import SUMMARY_PROMPT
from gateway.simulator import quirks
from gateway.simulator.reply import (
    DEFAULT_TOOLS,
    GREETING,
    REASONING,
    TEXT,
    Ctx,
    Delta,
    Frame,
    Options,
    Reply,
    call_deltas,
    chat_messages,
    content_deltas,
    last_user_text,
    parse_model,
    text_of,
    tool_args,
    tool_delta,
)
from gateway.simulator.tokens import add_token_data
from gateway.stream.repair import REPAIR_MARKER

ERROR_FRAME: Frame = {
    "error": {"message": "upstream exploded", "type": "server_error", "code": "internal_error"}
}


def _tool_names(body: Mapping[str, Any]) -> tuple[str, str]:
    """Use declared function names so gateway-side tool validation passes."""
    tools = body.get("tools") if isinstance(body.get("tools"), list) else []
    names = [
        t["function"]["name"] for t in tools
        if isinstance(t, dict) and isinstance(t.get("function"), dict)
        and isinstance(t["function"].get("name"), str)
    ]
    if not names:
        return DEFAULT_TOOLS
    return names[0], names[1] if len(names) > 1 else names[0]


def _wants_usage(body: Mapping[str, Any]) -> bool:
    opts = body.get("stream_options")
    return isinstance(opts, dict) and opts.get("include_usage") is True


def _echo(ctx: Ctx) -> Reply:
    return Reply(content_deltas(ctx, "You said: " + last_user_text(ctx.body)))


#: ``agent``: a tool the user's text asks for, as ``CALL <tool name> <JSON arguments>``.
DIRECTIVE = "CALL "


def _directives(text: str) -> list[tuple[str, str]]:
    """Every ``CALL <name> <JSON object>`` in ``text``, in order (name, arguments)."""
    found: list[tuple[str, str]] = []
    decoder = json.JSONDecoder()
    start = text.find(DIRECTIVE)
    while start >= 0:
        name, _, rest = text[start + len(DIRECTIVE) :].partition(" ")
        try:
            args, _ = decoder.raw_decode(rest.lstrip())
        except ValueError:
            args = None
        if name and isinstance(args, dict):
            found.append((name, json.dumps(args)))
        start = text.find(DIRECTIVE, start + len(DIRECTIVE))
    return found


#: ``agent``'s answer to a summary request: how far the plan got (read back after compaction).
PROGRESS = re.compile(r"Progress: (\d+) tool call\(s\) completed\.")


def _agent_progress(messages: list[dict[str, Any]]) -> int:
    """Tool calls of the plan already made: those summarised by a compaction, plus the
    tool results since."""
    done = 0
    for message in messages:
        found = PROGRESS.findall(text_of(message.get("content")))
        if found and message.get("role") != "tool":
            done = int(found[-1])
        elif message.get("role") == "tool":
            done += 1
    return done


def _agent(ctx: Ctx) -> Reply:
    """A scripted agent model for real CLIs: the user's first message lists the tool calls
    to make (``CALL <name> <JSON>``), made one per turn while tool results come back; then
    a text answer quoting the last tool result. A summary request (a compaction turn) is
    answered with the progress, so the plan continues after the history is replaced.
    Any other request gets an echo."""
    messages = chat_messages(ctx.body)
    users = [text_of(m.get("content")) for m in messages if m.get("role") == "user"]
    plan = next((d for d in map(_directives, users) if d), [])
    declared = {
        t["function"]["name"] for t in ctx.body.get("tools") or []
        if isinstance(t, dict) and isinstance(t.get("function"), dict)
    }
    done = _agent_progress(messages)
    # the last turn (Claude Code sends a system item after the user's message)
    last = next((m for m in reversed(messages) if m.get("role") != "system"), {})
    if last.get("role") == "user" and SUMMARY_PROMPT in text_of(last.get("content")):
        return Reply(content_deltas(ctx, f"Progress: {done} tool call(s) completed."))
    if last.get("role") in ("user", "tool") and declared:
        for i, (name, args) in enumerate(plan[done:]):
            if name in declared:
                start = tool_delta(index=0, id=f"call_agent_{done + i}", name=name, args="", typed=True)
                return Reply([start, *(tool_delta(index=0, args=f) for f in ctx.split(args))], "tool_calls")
    if last.get("role") == "tool":
        return Reply(content_deltas(ctx, "Done. The tool said: " + text_of(last.get("content"))[:300]))
    return Reply(content_deltas(ctx, "You said: " + (users[-1] if users else "")[-300:]))


def _large(ctx: Ctx) -> Reply:
    size = max(0, ctx.opts.size)
    return Reply(content_deltas(ctx, (GREETING * (size // len(GREETING) + 1))[:size]))


SCENARIOS: dict[str, Callable[[Ctx], Reply]] = {
    "echo": _echo,
    "text": lambda c: Reply(content_deltas(c, TEXT)),
    "reasoning": lambda c: Reply(content_deltas(c, REASONING, "reasoning_content") + content_deltas(c, TEXT)),
    "reasoning_field": lambda c: Reply(content_deltas(c, REASONING, "reasoning") + content_deltas(c, TEXT)),
    "tool": lambda c: Reply(call_deltas(c, 0), "tool_calls"),
    "text_then_tool": lambda c: Reply(content_deltas(c, "Let me check. ") + call_deltas(c, 0), "tool_calls"),
    "parallel_tools": lambda c: Reply(call_deltas(c, 0) + call_deltas(c, 1), "tool_calls"),
    "interleaved_tools": quirks.interleaved_tools,
    "missing_index": quirks.missing_index,
    "repeated_id": quirks.repeated_id,
    "late_name": quirks.late_name,
    "empty_tool_array": quirks.empty_tool_array,
    "invalid_json": lambda c: Reply(call_deltas(c, 0, args='{"city": "Par'), "tool_calls"),
    "fenced_json": lambda c: Reply(call_deltas(c, 0, args=f"```json\n{tool_args(0)}\n```"), "tool_calls"),
    "undeclared_tool": lambda c: Reply(call_deltas(c, 0, name="not_a_declared_tool"), "tool_calls"),
    "identity_change": quirks.identity_change,
    "content_filter": lambda c: Reply([], "content_filter"),
    "content_filter_partial": lambda c: Reply(content_deltas(c, GREETING), "content_filter"),
    "length": lambda c: Reply(content_deltas(c, TEXT), "length"),
    "no_done": lambda c: Reply(content_deltas(c, TEXT), done=False),
    "no_finish": lambda c: Reply(content_deltas(c, TEXT), finish=None),
    "error_frame": lambda c: Reply(content_deltas(c, GREETING), None, [copy.deepcopy(ERROR_FRAME)]),
    "drop": lambda c: Reply(content_deltas(c, TEXT), None, [{"_op": "drop"}]),
    "slow_first_byte": lambda c: Reply(content_deltas(c, TEXT)),
    "slow_headers": lambda c: Reply(content_deltas(c, TEXT)),
    "large": _large,
    "agent": _agent,
    "object_arguments": quirks.object_arguments,
    "usage_in_choice": quirks.usage_placed("choice"),
    "usage_x_groq": quirks.usage_placed("x_groq"),
    "usage_running": quirks.usage_placed("running"),
    "finish_eos": lambda c: Reply(content_deltas(c, TEXT), "eos"),
    "finish_eos_token": lambda c: Reply(content_deltas(c, TEXT), "eos_token"),
    "finish_empty": lambda c: Reply(content_deltas(c, TEXT), ""),
    "finish_tool_call": lambda c: Reply(call_deltas(c, 0), "tool_call"),
    "finish_function_call": lambda c: Reply(call_deltas(c, 0), "function_call"),
    "finish_error": lambda c: Reply(content_deltas(c, GREETING), "error"),
    "legacy_function_call": quirks.legacy_function_call,
    "only_function_call": quirks.only_function_call,
    "explicit_nulls": quirks.explicit_nulls,
    "reasoning_after_text": quirks.reasoning_after_text,
    "reasoning_with_content": quirks.reasoning_with_content,
    "think_tags": quirks.think_tags,
    "think_close_only": quirks.think_close_only,
    "gemini_signature": quirks.gemini_signature,
}

#: 200 answers that are no stream: name -> (content type, body)
RAW_200: dict[str, tuple[str, bytes]] = {
    "json_error_200": ("application/json", json.dumps(
        {"error": {"message": "tool_choice 'required' is not supported", "type": "invalid_request_error"}}).encode()),
    "html_200": ("text/html", b"<html><head><title>Gateway Timeout from the proxy</title></head>"
                 b"<body><h1>504</h1></body></html>"),
    "empty_200": ("application/json", b""),
}

# name -> (default status, error type, error code, message)
_ERRORS: dict[str, tuple[int, str, str, str]] = {
    "http_error": (500, "server_error", "internal_error", "The simulated upstream failed."),
    "server_error": (500, "server_error", "internal_error", "The simulated upstream failed."),
    "rate_limited": (429, "requests", "rate_limit_exceeded", "Rate limit reached for requests."),
    "unauthorized": (401, "invalid_request_error", "invalid_api_key", "Incorrect API key."),
    "unavailable": (503, "server_error", "service_unavailable", "The upstream is overloaded."),
}


@dataclass
class Plan:
    """What to send: an HTTP status, extra headers and frames (errors: frames[0] is the body)."""

    status: int
    headers: dict[str, str]
    frames: list[Frame]
    options: Options
    raw: tuple[str, bytes] | None = None  # (content type, body): a 200 that is no stream


@dataclass
class ScriptSpec:
    """Frames registered through ``POST /_sim/scripts``."""

    frames: list[Frame]
    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)


def error_body(message: str, type_: str, code: str | None) -> dict[str, Any]:
    """OpenAI-shaped error payload."""
    return {"error": {"message": message, "type": type_, "param": None, "code": code}}


def _chunk(delta: Delta, finish: str | None = None) -> Frame:
    return {"choices": [{"index": 0, "delta": dict(delta), "finish_reason": finish}]}


#: What the simulator charges an image part: OpenAI's high detail for a 512 x 512 image.
IMAGE_PROMPT_TOKENS = 765


def _images(content: Any) -> int:
    return sum(1 for p in content if isinstance(p, dict) and p.get("type") == "image_url") if isinstance(content, list) else 0


def usage_of(body: Mapping[str, Any], deltas: list[Delta]) -> dict[str, Any]:
    """Deterministic token counts: characters // 4 + 1, and :data:`IMAGE_PROMPT_TOKENS` an image."""
    messages = chat_messages(body)
    prompt = sum(len(text_of(m.get("content"))) for m in messages) // 4 + 1
    prompt += IMAGE_PROMPT_TOKENS * sum(_images(m.get("content")) for m in messages)
    text = reasoning = 0
    for d in deltas:
        text += len(d.get("content") or "")
        reasoning += len(d.get("reasoning_content") or d.get("reasoning") or "")
        for tc in d.get("tool_calls") or []:
            text += len(_arguments_text(tc))
    completion = (text + reasoning) // 4 + 1
    usage: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion,
                             "total_tokens": prompt + completion}
    if reasoning:
        usage["completion_tokens_details"] = {"reasoning_tokens": reasoning // 4 + 1}
    return usage


def _arguments_text(tc: Mapping[str, Any]) -> str:
    args = (tc.get("function") or {}).get("arguments") or ""
    return args if isinstance(args, str) else json.dumps(args)


def token_id(piece: str) -> int:
    """A deterministic stand-in token id (one 'token' per fragment)."""
    return zlib.crc32(piece.encode()) % 100_000


def _frames(reply: Reply, ctx: Ctx) -> list[Frame]:
    """Generic wrapping: role on first chunk, finish placement, usage placement, [DONE]."""
    chunks = [_chunk(d) for d in reply.deltas] or [_chunk({})]
    add_token_data(chunks, reply.deltas, ctx.body)  # vLLM's token fields, when asked for
    first = chunks[0]["choices"][0]
    first["delta"] = {"role": "assistant", **first["delta"]}
    if reply.terminal is not None:
        return chunks + reply.terminal
    if reply.finish == "":
        for chunk in chunks:  # "" on every chunk, never a real value
            chunk["choices"][0]["finish_reason"] = ""
    elif reply.finish and ctx.opts.finish_chunk == "last":
        chunks[-1]["choices"][0]["finish_reason"] = reply.finish
    elif reply.finish:
        chunks.append(_chunk({}, reply.finish))
    where = reply.usage_at or ("running" if ctx.opts.usage == "running" else None)
    if where is not None:
        _place_usage(chunks, reply, ctx, where)
    elif ctx.opts.usage == "last":
        chunks[-1]["usage"] = usage_of(ctx.body, reply.deltas)
    elif ctx.opts.usage == "separate" and _wants_usage(ctx.body):
        chunks.append({"choices": [], "usage": usage_of(ctx.body, reply.deltas)})
    if reply.done and ctx.opts.done:
        chunks.append({"_op": "done"})
    return chunks


def _place_usage(chunks: list[Frame], reply: Reply, ctx: Ctx, where: str) -> None:
    """Usage where some servers put it (always sent, as they do)."""
    usage = usage_of(ctx.body, reply.deltas)
    if where == "choice":
        chunks[-1]["choices"][0]["usage"] = usage
    elif where == "x_groq":
        chunks[-1]["x_groq"] = {"id": "req_sim", "usage": usage}
    else:  # running: a growing total on every chunk, the last one exact
        for n, chunk in enumerate(chunks, 1):
            partial = dict(usage, completion_tokens=usage["completion_tokens"] * n // len(chunks))
            partial["total_tokens"] = partial["prompt_tokens"] + partial["completion_tokens"]
            chunk["usage"] = partial


def _error_plan(opts: Options) -> Plan:
    status, type_, code, message = _ERRORS[opts.scenario]
    status = opts.status or status
    headers: dict[str, str] = {}
    if opts.scenario == "rate_limited" or opts.retry_after is not None:
        headers["Retry-After"] = str(opts.retry_after if opts.retry_after is not None else 7)
    return Plan(status, headers, [error_body(message, type_, code)], opts)


def _script_plan(opts: Options, scripts: Mapping[str, ScriptSpec]) -> Plan:
    script_id = opts.scenario.removeprefix("script:")
    spec = scripts.get(script_id)
    if spec is None:
        message = f"unknown script {script_id!r}"
        return Plan(404, {}, [error_body(message, "invalid_request_error", "not_found")], opts)
    frames = copy.deepcopy(spec.frames)
    if spec.status != 200:
        frames = frames[:1] or [error_body("scripted error", "server_error", None)]
    return Plan(spec.status, dict(spec.headers), frames, opts)


def _echo_auth_plan(opts: Options, authorization: str) -> Plan:
    """A careless upstream whose error quotes the Authorization header it was sent
    (``echo_auth``, status 400 unless ``;status=N``): what the gateway must never relay."""
    message = f"Invalid request: header 'Authorization: {authorization}' is not accepted for this model"
    return Plan(opts.status or 400, {}, [error_body(message, "invalid_request_error", "invalid_header")], opts)


def build_plan(
    model: str, request_body: Mapping[str, Any], scripts: Mapping[str, ScriptSpec] | None = None,
    authorization: str = "",
) -> Plan:
    """Pure: decide status, headers and frames for one request (ValueError on bad options).
    ``authorization`` is the request's header, which only ``echo_auth`` looks at."""
    opts = parse_model(model)
    if opts.scenario == "echo_auth":
        return _echo_auth_plan(opts, authorization)
    if opts.scenario.startswith("script:"):
        return _script_plan(opts, scripts or {})
    if opts.scenario in _ERRORS:
        return _error_plan(opts)
    if opts.scenario in RAW_200:
        return Plan(200, {}, [], opts, raw=RAW_200[opts.scenario])
    if opts.repairable and _asks_for_repair(request_body):
        opts = dataclasses.replace(opts, scenario="tool")
    ctx = Ctx(opts, request_body, _tool_names(request_body))
    reply = SCENARIOS.get(opts.scenario, _echo)(ctx)
    return Plan(200, {}, _frames(reply, ctx), opts)


def _asks_for_repair(body: Mapping[str, Any]) -> bool:
    """A model that listens: the gateway's repair note is the last message."""
    messages = chat_messages(body)
    return bool(messages) and REPAIR_MARKER in text_of(messages[-1].get("content"))


def build_frames(
    model: str, request_body: Mapping[str, Any], scripts: Mapping[str, ScriptSpec] | None = None
) -> tuple[int, dict[str, str], list[Frame]]:
    """Tuple form of :func:`build_plan` for tests that only care about the wire content."""
    plan = build_plan(model, request_body, scripts)
    return plan.status, plan.headers, plan.frames


def scenario_names() -> list[str]:
    return [*SCENARIOS, *_ERRORS, *RAW_200]


def _as_chunk(frame: Frame) -> Frame | None:
    """Return the chunk a frame represents, or None for control/error frames."""
    if frame.get("_op") == "raw":
        try:
            parsed = json.loads(str(frame.get("data", "")))
        except ValueError:
            return None
        return parsed if isinstance(parsed, dict) and "error" not in parsed else None
    return None if "_op" in frame or "error" in frame else frame


def _merge_tool_call(calls: list[dict[str, Any]], tc: Mapping[str, Any]) -> None:
    """Merge one tool delta, tolerating missing index (continue last call) like clients do."""
    index = tc.get("index")
    if index is not None:
        target = next((c for c in calls if c["_index"] == index), None)
    elif calls and (tc.get("id") is None or tc.get("id") == calls[-1]["id"]):
        target = calls[-1]
    else:
        target = None
    if target is None:
        target = {"_index": len(calls) if index is None else index, "id": tc.get("id"),
                  "type": "function", "function": {"name": "", "arguments": ""}}
        calls.append(target)
    fn = tc.get("function") or {}
    if fn.get("name") and not target["function"]["name"]:
        target["function"]["name"] = fn["name"]
    target["function"]["arguments"] += _arguments_text(tc)
    target["id"] = target["id"] or tc.get("id")


def assemble_completion(frames: Iterable[Frame], model: str) -> dict[str, Any]:
    """Fold stream frames into the equivalent non-streaming ``chat.completion`` object."""
    chunks = [c for c in map(_as_chunk, frames) if c is not None]
    parts: dict[str, list[str]] = {"content": [], "reasoning_content": [], "reasoning": []}
    calls: list[dict[str, Any]] = []
    finish: str | None = None
    usage: dict[str, Any] | None = None
    logprobs: list[dict[str, Any]] = []
    token_ids: list[int] | None = None
    prompt_token_ids = None
    experts = None
    for chunk in chunks:
        usage = chunk.get("usage") or usage
        prompt_token_ids = chunk.get("prompt_token_ids", prompt_token_ids)
        for choice in chunk.get("choices") or []:
            logprobs += (choice.get("logprobs") or {}).get("content") or []
            if "token_ids" in choice:
                token_ids = (token_ids or []) + list(choice["token_ids"])
            experts = choice.get("routed_experts", experts)
            delta = choice.get("delta") or {}
            for key, bucket in parts.items():
                if isinstance(delta.get(key), str):
                    bucket.append(delta[key])
            for tc in delta.get("tool_calls") or []:
                _merge_tool_call(calls, tc)
            finish = choice.get("finish_reason") or finish
    message: dict[str, Any] = {
        "role": "assistant", "content": "".join(parts["content"]) if parts["content"] else None,
    }
    for key in ("reasoning_content", "reasoning"):
        if parts[key]:
            message[key] = "".join(parts[key])
    if calls:
        message["tool_calls"] = [{k: v for k, v in c.items() if k != "_index"} for c in calls]
    head = chunks[0] if chunks else {}
    result: dict[str, Any] = {
        "id": head.get("id", "chatcmpl-sim"), "object": "chat.completion",
        "created": head.get("created", 0), "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": finish,
                     "logprobs": {"content": logprobs} if logprobs else None}],
    }
    if token_ids is not None:
        result["choices"][0]["token_ids"] = token_ids
    if experts is not None:
        result["choices"][0]["routed_experts"] = experts
    if prompt_token_ids is not None:
        result["prompt_token_ids"] = prompt_token_ids
    if usage:
        result["usage"] = usage
    return result
