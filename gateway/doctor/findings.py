"""What ``codebuddy2api doctor`` concludes from what an upstream sent: pure functions of
the raw probes (no I/O), so every quirk can be tested from frames alone.

Each probe's stream is also fed to the gateway's own :class:`ChatSSEAccumulator`, so a
verdict of "the gateway relays this" is the gateway's, not a guess. A finding's status:

- ``ok``: what the gateway expects;
- ``quirk``: off the OpenAI shape, and the gateway normalises it (named by ``quirk``);
- ``problem``: the gateway cannot relay it as is (or a probe failed);
- ``info``: worth knowing, no action.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import orjson

from gateway.errors import GatewayError
from gateway.stream.accumulator import ChatSSEAccumulator, ToolRules, parse_arguments
from gateway.stream.events import Completion
from gateway.stream.repair import repair_arguments

Status = Literal["ok", "quirk", "problem", "info"]

#: The tool the doctor asks the model to call (the simulator uses declared names too).
PROBE_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city"],
        },
    },
}


@dataclass
class StreamCapture:
    """One streamed probe as received: status, content type, every SSE data payload
    (parsed when JSON), comment lines, whether ``[DONE]`` came, or the error body."""

    status: int = 0
    content_type: str = ""
    chunks: list[dict[str, Any]] = field(default_factory=list)
    unparsed: list[str] = field(default_factory=list)
    comments: int = 0
    done: bool = False
    body: str = ""  # the body of a non-200 answer
    transport_error: str | None = None


def parse_sse_lines(lines: Iterable[str], capture: StreamCapture) -> StreamCapture:
    """Fold raw SSE lines into ``capture`` (comments counted; httpx-sse would hide them)."""
    data: list[str] = []

    def flush() -> None:
        if not data:
            return
        payload = "\n".join(data)
        data.clear()
        if payload.strip() == "[DONE]":
            capture.done = True
            return
        try:
            value = orjson.loads(payload)
        except orjson.JSONDecodeError:
            capture.unparsed.append(payload[:200])
            return
        if isinstance(value, dict):
            capture.chunks.append(value)
        else:
            capture.unparsed.append(payload[:200])

    for line in lines:
        line = line.rstrip("\r\n")
        if not line:
            flush()
        elif line.startswith(":"):
            capture.comments += 1
        elif line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
    flush()
    return capture


@dataclass
class Probes:
    """Everything the doctor sent and got back."""

    url: str
    model: str
    models_status: int = 0
    models: list[str] | None = None
    models_error: str | None = None
    text: StreamCapture = field(default_factory=StreamCapture)
    tool: StreamCapture = field(default_factory=StreamCapture)
    plain_status: int = 0
    plain_body: Any = None
    plain_error: str | None = None
    bad_request_status: int = 0
    bad_request_body: str = ""


@dataclass(frozen=True)
class Finding:
    check: str
    status: Status
    detail: str
    quirk: str | None = None


@dataclass
class Report:
    url: str
    model: str
    findings: list[Finding]
    stream_mode: str
    upstream_stream: str
    notes: list[str]

    def quirks(self) -> list[str]:
        return [f.quirk for f in self.findings if f.quirk]

    def problems(self) -> list[Finding]:
        return [f for f in self.findings if f.status == "problem"]

    def as_json(self) -> dict[str, Any]:
        """The ``--json`` document (its schema is asserted by the tests)."""
        flags = [f"--stream-mode {self.stream_mode}", f"--upstream-stream {self.upstream_stream}"]
        return {
            "url": self.url,
            "model": self.model,
            "findings": [asdict(f) for f in self.findings],
            "quirks": self.quirks(),
            "recommended": {
                "stream_mode": self.stream_mode,
                "upstream_stream": self.upstream_stream,
                "command": f"codebuddy2api serve --upstream-url {self.url} " + " ".join(flags),
                "notes": self.notes,
            },
            "ok": not self.problems(),
        }


# -- per-chunk observations ----------------------------------------------------------------


def _choices(chunk: dict[str, Any]) -> list[dict[str, Any]]:
    choices = chunk.get("choices")
    return [c for c in choices if isinstance(c, dict)] if isinstance(choices, list) else []


def _deltas(capture: StreamCapture) -> list[dict[str, Any]]:
    return [c.get("delta") or {} for chunk in capture.chunks for c in _choices(chunk) if isinstance(c.get("delta") or {}, dict)]


def _tool_deltas(capture: StreamCapture) -> list[dict[str, Any]]:
    return [tc for d in _deltas(capture) for tc in (d.get("tool_calls") or []) if isinstance(tc, dict)]


def _finish(capture: StreamCapture) -> tuple[str | None, bool]:
    """The finish reason, and whether it came on a chunk that also carried content."""
    for chunk in capture.chunks:
        for choice in _choices(chunk):
            if choice.get("finish_reason"):
                delta = choice.get("delta") or {}
                carried = any(delta.get(k) for k in ("content", "reasoning_content", "reasoning", "tool_calls"))
                return str(choice["finish_reason"]), carried
    return None, False


def gateway_outcome(capture: StreamCapture, tools: bool) -> Completion | GatewayError:
    """Feed the stream to the gateway's accumulator as a request would: the answer it
    seals, or its error."""
    rules = ToolRules(declared=frozenset({PROBE_TOOL["function"]["name"]})) if tools else ToolRules()
    acc = ChatSSEAccumulator(rules=rules)
    try:
        for chunk in capture.chunks:
            acc.feed(chunk)
        return acc.seal()
    except GatewayError as err:
        return err


def gateway_verdict(capture: StreamCapture, tools: bool) -> GatewayError | None:
    outcome = gateway_outcome(capture, tools)
    return outcome if isinstance(outcome, GatewayError) else None


def _object_arguments_kept(capture: StreamCapture) -> bool:
    """Arguments sent as JSON objects: does the sealed answer carry those same objects?"""
    sent = [(tc.get("function") or {}).get("arguments") for tc in _tool_deltas(capture)]
    objects = [a for a in sent if isinstance(a, dict)]
    outcome = gateway_outcome(capture, True)
    if isinstance(outcome, GatewayError) or not outcome.tool_calls:
        return False
    return [parse_arguments(c.arguments) for c in outcome.tool_calls][: len(objects)] == objects


# -- the checks ------------------------------------------------------------------------------


def _models(p: Probes) -> list[Finding]:
    if p.models is None:
        why = p.models_error or f"HTTP {p.models_status}"
        return [Finding("models list", "info", f"GET /models failed ({why}): /v1/models lists only configured names")]
    listed = f"{len(p.models)} model(s)" + (f", e.g. {', '.join(p.models[:3])}" if p.models else "")
    if p.model and p.models and p.model not in p.models:
        return [Finding("models list", "info", f"{listed}; {p.model!r} is not among them")]
    return [Finding("models list", "ok", listed)]


def _stream_basics(name: str, c: StreamCapture) -> list[Finding]:
    if c.transport_error:
        return [Finding(name, "problem", f"no answer: {c.transport_error}")]
    if c.status != 200:
        return [Finding(name, "problem", f"HTTP {c.status}: {c.body[:160]}")]
    found = []
    if "text/event-stream" not in c.content_type:
        found.append(Finding(name, "info", f"content-type {c.content_type or 'missing'} (expected text/event-stream)"))
    if c.unparsed:
        found.append(Finding(name, "problem", f"{len(c.unparsed)} data line(s) are not JSON objects: {c.unparsed[0][:80]!r}"))
    if not c.chunks:
        found.append(Finding(name, "problem", "the stream carried no chunk", "empty_stream"))
    errors = [chunk["error"] for chunk in c.chunks if chunk.get("error")]
    if errors:
        message = errors[0].get("message") if isinstance(errors[0], dict) else errors[0]
        found.append(Finding(name, "problem", f"an error inside a 200 stream: {str(message)[:120]!r} (clients get the protocol's error event)", "error_in_stream"))
    return found


def _text_checks(c: StreamCapture) -> list[Finding]:
    found = _stream_basics("streamed text", c)
    if c.status != 200 or not c.chunks:
        return found
    deltas = _deltas(c)
    text = "".join(d["content"] for d in deltas if isinstance(d.get("content"), str))
    pieces = sum(1 for d in deltas if d.get("content"))
    found.append(Finding("streamed text", "ok" if text else "info", f"{pieces} content fragment(s), {len(text)} characters" if text else "no text content"))
    if any(d.get("tool_calls") for d in deltas):
        found.append(Finding("streamed text", "info", "the plain question was answered with a tool call"))
    if any(isinstance(d.get("tool_calls"), list) and not d["tool_calls"] for d in deltas):
        found.append(Finding("empty tool_calls", "quirk", "text deltas carry \"tool_calls\": [] (ignored)", "empty_tool_calls_array"))
    found += _reasoning(deltas)
    found += _terminal(c)
    found += _usage(c)
    ids = {chunk.get("id") for chunk in c.chunks if "id" in chunk}
    if len(ids) > 1:
        found.append(Finding("chunk ids", "quirk", f"{len(ids)} different chunk ids in one stream (the gateway sets its own)", "unstable_chunk_id"))
    else:
        found.append(Finding("chunk ids", "ok", "one id for the whole stream"))
    roles = [d.get("role") for d in deltas if d.get("role")]
    if not roles:
        found.append(Finding("role", "info", "no delta carries role (the gateway adds it)"))
    return found


def _reasoning(deltas: list[dict[str, Any]]) -> list[Finding]:
    if any(isinstance(d.get("reasoning_content"), str) and d["reasoning_content"] for d in deltas):
        return [Finding("reasoning", "ok", "reasoning in delta.reasoning_content (relayed as thinking/reasoning)")]
    if any(isinstance(d.get("reasoning"), str) and d["reasoning"] for d in deltas):
        return [Finding("reasoning", "quirk", "reasoning in delta.reasoning (read like reasoning_content)", "reasoning_field")]
    return [Finding("reasoning", "info", "no reasoning fields (not a reasoning model, or reasoning disabled)")]


def _terminal(c: StreamCapture) -> list[Finding]:
    found = []
    finish, on_content = _finish(c)
    if finish is None:
        found.append(Finding("finish_reason", "problem", "the stream never sets finish_reason: the gateway answers upstream_incomplete", "no_finish_reason"))
    elif on_content:
        found.append(Finding("finish_reason", "quirk", f"{finish!r} arrives on the last content chunk, not its own", "finish_on_content_chunk"))
    else:
        found.append(Finding("finish_reason", "ok", f"{finish!r} in its own chunk"))
    if c.done:
        found.append(Finding("[DONE]", "ok", "the stream ends with data: [DONE]"))
    else:
        found.append(Finding("[DONE]", "quirk", "no data: [DONE] (the end of the body ends the answer)", "no_done"))
    if c.comments:
        found.append(Finding("keepalive comments", "quirk", f"{c.comments} SSE comment line(s) (ignored; the gateway sends its own keepalives)", "keepalive_comments"))
    else:
        found.append(Finding("keepalive comments", "info", "none seen (the gateway sends its own keepalives while it waits)"))
    return found


def _usage(c: StreamCapture) -> list[Finding]:
    with_usage = [chunk for chunk in c.chunks if isinstance(chunk.get("usage"), dict) and chunk["usage"]]
    if not with_usage:
        return [Finding("include_usage", "quirk", "stream_options.include_usage sent, no usage came: token counts are estimated (o200k) in every room", "no_usage")]
    last = with_usage[-1]
    if _choices(last):
        return [Finding("include_usage", "quirk", "usage rides on a chunk with choices, not a separate final chunk (read anyway)", "usage_on_last_chunk")]
    return [Finding("include_usage", "ok", f"a final usage chunk ({last['usage'].get('prompt_tokens')} prompt / {last['usage'].get('completion_tokens')} completion tokens)")]


def _tool_checks(c: StreamCapture) -> list[Finding]:
    found = _stream_basics("streamed tool call", c)
    if c.status != 200 or not c.chunks:
        return found
    calls = _tool_deltas(c)
    if not calls:
        found.append(Finding("streamed tool call", "info", "the model did not call the offered tool (tool support disabled, or try --model)"))
        return found
    found.append(Finding("streamed tool call", "ok", f"{len(calls)} tool_calls delta(s)"))
    if all("index" in tc for tc in calls):
        found.append(Finding("tool index", "ok", "every tool delta carries index"))
    else:
        found.append(Finding("tool index", "quirk", "tool deltas without index (keyed by id, else they continue the last call)", "missing_tool_index"))
    found += _tool_identity(calls)
    found += _tool_arguments(calls)
    finish, on_content = _finish(c)
    if finish == "tool_calls":
        found.append(Finding("tool finish_reason", "ok", "'tool_calls'"))
    elif finish is None:
        found.append(Finding("tool finish_reason", "problem", "no finish_reason after the tool call", "no_finish_reason"))
    else:
        found.append(Finding("tool finish_reason", "quirk", f"{finish!r} after a tool call (reported as tool_calls)", "finish_not_tool_calls"))
    if on_content:
        found.append(Finding("tool finish_reason", "quirk", "finish_reason on the last tool delta, not its own chunk", "finish_on_content_chunk"))
    return found


def _tool_identity(calls: list[dict[str, Any]]) -> list[Finding]:
    ids = [tc.get("id") for tc in calls if tc.get("id")]
    names = [(tc.get("function") or {}).get("name") for tc in calls if (tc.get("function") or {}).get("name")]
    found = []
    first = calls[0]
    if not ids:
        found.append(Finding("tool id", "quirk", "no tool call id (the gateway makes one up at the end)", "missing_tool_id"))
    elif len(ids) > 1 and len(set(ids)) == 1:
        found.append(Finding("tool id", "quirk", f"the id is repeated on {len(ids)} deltas (repeats ignored)", "repeated_tool_id"))
    elif len(set(ids)) > 1 and all("index" in tc for tc in calls) and len({tc["index"] for tc in calls}) == 1:
        found.append(Finding("tool id", "problem", f"the id changes mid-call ({ids[0]!r} -> {ids[-1]!r}): the gateway answers tool_identity_changed", "tool_identity_change"))
    else:
        found.append(Finding("tool id", "ok", f"{len(set(ids))} call id(s), sent once each"))
    if not names:
        found.append(Finding("tool name", "problem", "no function name in any tool delta"))
    elif not (first.get("function") or {}).get("name"):
        found.append(Finding("tool name", "quirk", "the name arrives after the first tool delta (realtime waits for it)", "late_tool_name"))
    else:
        found.append(Finding("tool name", "ok", f"{names[0]!r} in the first tool delta"))
    return found


def _tool_arguments(calls: list[dict[str, Any]]) -> list[Finding]:
    fragments = [(tc.get("function") or {}).get("arguments") for tc in calls if isinstance(tc.get("function"), dict) and "arguments" in tc["function"]]
    if any(isinstance(f, dict) for f in fragments):
        return [Finding("tool arguments", "problem", "arguments arrive as JSON objects, not strings: the gateway drops them", "tool_arguments_objects")]
    pieces = sum(1 for f in fragments if isinstance(f, str) and f)
    found = [Finding("tool arguments", "ok" if pieces > 1 else "info", f"{pieces} string fragment(s)" + ("" if pieces > 1 else " (no incremental arguments)"))]
    by_call: dict[Any, str] = {}
    last_key: Any = None
    for tc in calls:
        key = tc.get("index", tc.get("id") or last_key)
        last_key = key
        fragment = (tc.get("function") or {}).get("arguments")
        if isinstance(fragment, str):
            by_call[key] = by_call.get(key, "") + fragment
    for args in by_call.values():
        if parse_arguments(args) is not None:
            continue
        if repair_arguments(args, PROBE_TOOL["function"]["parameters"]) is not None:
            found.append(Finding("tool arguments", "quirk", f"not plain JSON ({args[:40]!r}...): repaired locally (fences/prose stripped)", "tool_arguments_repaired"))
        else:
            found.append(Finding("tool arguments", "problem", f"not a JSON object ({args[:40]!r}): compatible mode regenerates, realtime fails", "tool_arguments_invalid"))
    return found


def _plain(p: Probes) -> list[Finding]:
    if p.plain_error or p.plain_status != 200 or not isinstance(p.plain_body, dict):
        why = p.plain_error or f"HTTP {p.plain_status}"
        return [Finding("non-streamed answer", "problem", f"stream: false failed ({why}): --upstream-stream never is not possible")]
    choices = p.plain_body.get("choices")
    message = choices[0].get("message") if isinstance(choices, list) and choices and isinstance(choices[0], dict) else None
    if not isinstance(message, dict):
        return [Finding("non-streamed answer", "problem", "the JSON answer has no choices[0].message")]
    usage = "with usage" if isinstance(p.plain_body.get("usage"), dict) else "without usage"
    return [Finding("non-streamed answer", "ok", f"a chat.completion {usage}")]


def _error_shape(p: Probes) -> list[Finding]:
    status, body = p.bad_request_status, p.bad_request_body
    if status == 0:
        return [Finding("error shape", "info", "the invalid request got no answer")]
    if status < 400:
        return [Finding("error shape", "info", f"an invalid request was accepted (HTTP {status})")]
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        data = None
    if isinstance(data, dict) and isinstance(data.get("error"), dict) and isinstance(data["error"].get("message"), str):
        return [Finding("error shape", "ok", f"HTTP {status} with the OpenAI {{\"error\": {{\"message\"}}}} body")]
    return [Finding("error shape", "quirk", f"HTTP {status} with a non-OpenAI body ({body[:60]!r}): relayed as the room's error with that text", "error_shape_not_openai")]


def _verdicts(p: Probes) -> list[Finding]:
    found = []
    for name, capture, tools in (("gateway relays text", p.text, False), ("gateway relays tool call", p.tool, True)):
        if capture.status != 200 or not capture.chunks:
            continue
        error = gateway_verdict(capture, tools)
        if error is None:
            found.append(Finding(name, "ok", "the accumulator seals this stream"))
        elif error.code == "tool_call_invalid" and "not a JSON object" in error.message:
            found.append(Finding(name, "info", f"{error.code}: {error.message} (compatible mode repairs it)"))
        else:
            found.append(Finding(name, "problem", f"{error.code}: {error.message}"))
    return found


#: Quirks whose fate is the accumulator's: a problem while it refuses them, a quirk once it
#: normalises them (the verdict decides, so the doctor stays true as the gateway learns).
ACCUMULATOR_DECIDES = frozenset({"tool_arguments_objects", "no_finish_reason"})


def _settle(findings: list[Finding], p: Probes) -> list[Finding]:
    normalised = {
        "tool_arguments_objects": _object_arguments_kept(p.tool),
        "no_finish_reason": gateway_verdict(p.text, False) is None and gateway_verdict(p.tool, True) is None,
    }
    settled = []
    for f in findings:
        if f.quirk in ACCUMULATOR_DECIDES and f.status == "problem" and normalised[f.quirk]:
            f = Finding(f.check, "quirk", f.detail.split(":")[0] + ": normalised by the gateway", f.quirk)
        settled.append(f)
    return settled


def analyse(p: Probes) -> Report:
    """All findings and the recommended settings for this upstream."""
    findings = [*_models(p), *_text_checks(p.text), *_tool_checks(p.tool), *_plain(p), *_error_shape(p), *_verdicts(p)]
    findings = _settle(findings, p)
    quirks = {f.quirk for f in findings if f.quirk}
    streaming = p.text.status == 200 and bool(p.text.chunks) and not p.text.transport_error
    plain_ok = any(f.check == "non-streamed answer" and f.status == "ok" for f in findings)
    upstream_stream = "always" if streaming or not plain_ok else "never"
    # text streams but the tool question got an empty 200 (llama-cpp-python cannot stream
    # the tool choice): auto asks again for JSON exactly then
    tool_stream_empty = p.tool.status == 200 and not p.tool.chunks and not p.tool.transport_error
    if streaming and plain_ok and tool_stream_empty:
        upstream_stream = "auto"
        findings = [Finding(f.check, "quirk", f.detail + " (a 200 and nothing in it): --upstream-stream auto asks again for JSON", f.quirk)
                    if f.quirk == "empty_stream" else f for f in findings]
        quirks = {f.quirk for f in findings if f.quirk}
    risky = {"missing_tool_index", "late_tool_name", "tool_identity_change", "tool_arguments_repaired",
             "tool_arguments_invalid", "tool_arguments_objects", "no_finish_reason", "missing_tool_id"}
    tool_seen = bool(_tool_deltas(p.tool))
    stream_mode = "realtime" if streaming and tool_seen and not (quirks & risky) else "compatible"
    notes = []
    if stream_mode == "compatible":
        notes.append("compatible: the whole answer is validated (and tool calls repaired) before the client sees it"
                     + ("" if tool_seen else "; no tool call was seen, so realtime is unproven"))
    else:
        notes.append("realtime: tool calls arrive well-formed, so relaying as they come is safe")
    if upstream_stream == "never":
        notes.append("streaming failed but stream: false works: the gateway asks for JSON and streams it itself")
    if upstream_stream == "auto":
        notes.append("the tool question's stream was an empty 200 but stream: false works: auto asks again for JSON then")
    if "no_usage" in quirks:
        notes.append("no usage from the upstream: billing/metrics token counts are estimates")
    return Report(p.url, p.model, findings, stream_mode, upstream_stream, notes)


def render_table(report: Report) -> str:
    """The human form: one row per finding, then the recommendation."""
    rows = [("check", "status", "quirk", "detail")] + [
        (f.check, f.status.upper() if f.status in ("quirk", "problem") else f.status, f.quirk or "", f.detail)
        for f in report.findings
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = [f"codebuddy2api doctor: {report.url} (model {report.model or '?'})", ""]
    for n, row in enumerate(rows):
        lines.append("  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row[:3])) + "  " + row[3])
        if n == 0:
            lines.append("  ".join("-" * w for w in widths) + "  " + "-" * 6)
    rec = report.as_json()["recommended"]
    lines += ["", f"recommended: --stream-mode {report.stream_mode} --upstream-stream {report.upstream_stream}",
              f"  {rec['command']}", *(f"  note: {n}" for n in report.notes)]
    problems = report.problems()
    lines.append(f"{len(problems)} problem(s) the gateway cannot normalise" if problems else "nothing the gateway cannot normalise")
    return "\n".join(lines) + "\n"
