"""The doctor's I/O: the requests the gateway makes, sent once each, answers kept raw."""

from __future__ import annotations

from typing import Any

import httpx
import orjson

from gateway.doctor.findings import PROBE_TOOL, Probes, StreamCapture, parse_sse_lines

TEXT_PROMPT = "Say hello in one short sentence."
TOOL_PROMPT = "What is the weather in Paris? Use the get_weather tool."
#: Small answers: the doctor checks shapes, not prose (and a small local model stays quick).
TEXT_MAX_TOKENS = 48
TOOL_MAX_TOKENS = 160


def _stream(client: httpx.Client, url: str, body: dict[str, Any]) -> StreamCapture:
    capture = StreamCapture()
    try:
        with client.stream("POST", url, json=body) as response:
            capture.status = response.status_code
            capture.content_type = response.headers.get("content-type", "")
            if response.status_code != 200:
                capture.body = response.read().decode("utf-8", "replace")
                return capture
            parse_sse_lines(response.iter_lines(), capture)
    except httpx.HTTPError as exc:
        capture.transport_error = f"{type(exc).__name__}: {exc}"
    return capture


def run_probes(
    base_url: str, api_key: str | None, model: str | None, timeout: float = 60.0, tool_choice: str = "auto"
) -> Probes:
    """Models list, a streamed text answer with include_usage, a streamed tool call, a
    non-streamed answer and an invalid request, against ``base_url``."""
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    root = base_url.rstrip("/")
    probes = Probes(url=base_url, model=model or "")
    # a connection per probe: a server that failed inside a stream (llama-cpp-python) closes
    # that connection, and the next probe sent over it would fail for that alone
    with httpx.Client(headers=headers, timeout=httpx.Timeout(timeout, connect=min(timeout, 10.0)),
                      limits=httpx.Limits(max_keepalive_connections=0)) as client:
        try:
            response = client.get(root + "/models")
            probes.models_status = response.status_code
            data = orjson.loads(response.content).get("data") if response.status_code == 200 else None
            if isinstance(data, list):
                probes.models = [m["id"] for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]
        except (httpx.HTTPError, orjson.JSONDecodeError, AttributeError) as exc:
            probes.models_error = type(exc).__name__
        if not probes.model:
            probes.model = probes.models[0] if probes.models else "default"
        chat = root + "/chat/completions"
        common = {"model": probes.model, "stream": True, "stream_options": {"include_usage": True}}
        text = {"messages": [{"role": "user", "content": TEXT_PROMPT}], "max_tokens": TEXT_MAX_TOKENS}
        probes.text = _stream(client, chat, {**common, **text})
        probes.tool = _stream(client, chat, {
            **common, "messages": [{"role": "user", "content": TOOL_PROMPT}], "max_tokens": TOOL_MAX_TOKENS,
            "tools": [PROBE_TOOL], "tool_choice": tool_choice,
        })
        try:
            response = client.post(chat, json={"model": probes.model, **text})
            probes.plain_status = response.status_code
            probes.plain_body = orjson.loads(response.content)
        except (httpx.HTTPError, orjson.JSONDecodeError) as exc:
            probes.plain_error = type(exc).__name__
        try:
            response = client.post(chat, json={"model": probes.model, "messages": "not a list"})
            probes.bad_request_status = response.status_code
            probes.bad_request_body = response.text[:2000]
        except httpx.HTTPError:
            pass
    return probes
