"""Chat Completions failures: bad input never reaches the upstream; upstream failures
before the first byte are real HTTP statuses; after it, an error frame and no finish."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from tests.conftest import Gateway, Simulator

MESSAGES = [{"role": "user", "content": "hi"}]


def post(gateway: Gateway, body: Any, **kwargs: Any) -> httpx.Response:
    if isinstance(body, (bytes, str)):
        return httpx.post(gateway.base_url + "/chat/completions", content=body, headers={"content-type": "application/json"}, **kwargs)
    return httpx.post(gateway.base_url + "/chat/completions", json=body, **kwargs)


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        (b"{not json", None, "invalid_json"),
        (b"[1, 2]", None, "invalid_json"),
        ({"messages": MESSAGES}, "model", "missing_required_parameter"),
        ({"model": "text"}, "messages", "missing_required_parameter"),
        ({"model": "text", "messages": "hi"}, "messages", "invalid_type"),
        ({"model": "text", "messages": MESSAGES, "stream": "false"}, "stream", "invalid_type"),
        ({"model": 7, "messages": MESSAGES}, "model", "invalid_type"),
        ({"model": "text", "messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role", "invalid_value"),
        ({"model": "text", "messages": MESSAGES, "n": 2}, "n", "n_not_supported"),
        ({"model": "text", "messages": MESSAGES, "tool_choice": "sometimes"}, "tool_choice", "invalid_request"),
    ],
)
def test_bad_requests_are_named_and_never_sent_upstream(gateways: dict[str, Gateway], simulator: Simulator, body: Any, param: str | None, code: str) -> None:
    simulator.clear()
    response = post(gateways["realtime"], body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert error["code"] == code
    if param:
        assert param.split(".")[0] in error["message"]
    assert response.headers["x-request-id"].startswith("req_")
    assert simulator.requests() == []


def test_model_passes_through_unchanged_and_stream_is_forced(gateway: Gateway, simulator: Simulator) -> None:
    simulator.clear()
    client = openai.OpenAI(base_url=gateway.base_url, api_key="k", max_retries=0)
    client.chat.completions.create(model="text;chunk=7", messages=MESSAGES, temperature=0.3, n=1)
    [sent] = [r["body"] for r in simulator.requests() if r["path"].endswith("/chat/completions")]
    assert sent["model"] == "text;chunk=7"
    assert sent["stream"] is True
    assert sent["stream_options"] == {"include_usage": True}
    assert sent["temperature"] == 0.3
    assert "n" not in sent


@pytest.mark.parametrize("stream", [True, False])
def test_upstream_429_keeps_retry_after(gateway: Gateway, simulator: Simulator, stream: bool) -> None:
    gateway.reset_cooldowns()  # the other stream value's case left this model cooling down
    simulator.clear()
    response = post(gateway, {"model": "rate_limited;retry_after=11", "messages": MESSAGES, "stream": stream})
    assert [r["body"]["model"] for r in simulator.requests() if r["path"].endswith("/chat/completions")] == [
        "rate_limited;retry_after=11"
    ]  # the upstream's own 429, not a cooldown the pool remembered
    assert response.status_code == 429
    assert response.headers["retry-after"] == "11"
    error = response.json()["error"]
    assert error["type"] == "rate_limit_error" and error["code"] == "upstream_rate_limited"
    client = openai.OpenAI(base_url=gateway.base_url, api_key="k", max_retries=0)
    with pytest.raises(openai.RateLimitError):
        with client.chat.completions.stream(model="rate_limited", messages=MESSAGES) as s:
            list(s)


@pytest.mark.parametrize(("scenario", "status", "code"), [
    ("server_error", 502, "upstream_error"),
    ("unavailable", 503, "upstream_unavailable"),
])
def test_upstream_status_before_first_byte(gateway: Gateway, scenario: str, status: int, code: str) -> None:
    response = post(gateway, {"model": scenario, "messages": MESSAGES, "stream": True})
    assert response.status_code == status
    assert response.json()["error"]["code"] == code
    assert "sk-" not in response.text


def sse_frames(response: httpx.Response) -> list[str]:
    return [line[len("data: "):] for line in response.text.split("\n") if line.startswith("data: ")]


@pytest.mark.parametrize(("scenario", "code"), [
    ("error_frame", "upstream_error"),
    ("drop", "upstream_disconnected"),
    ("no_finish", "upstream_incomplete"),
    ("invalid_json", "tool_call_invalid"),
    ("undeclared_tool", "tool_call_invalid"),
    ("identity_change", "tool_identity_changed"),
])
def test_failures_after_commit_are_error_frames(gateway: Gateway, scenario: str, code: str) -> None:
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    response = post(gateway, {"model": scenario + ";chunk=4", "messages": MESSAGES, "stream": True, "tools": tools})
    assert response.status_code == 200
    frames = sse_frames(response)
    assert frames[-1] == "[DONE]"
    error = httpx.Response(200, content=frames[-2]).json()
    assert error["error"]["code"] == code
    assert not any('"finish_reason":"stop"' in f or '"finish_reason":"tool_calls"' in f for f in frames)
    client = openai.OpenAI(base_url=gateway.base_url, api_key="k", _strict_response_validation=True, max_retries=0)
    with pytest.raises(openai.APIError, match=code.split("_")[0]):
        with client.chat.completions.stream(model=scenario + ";chunk=4", messages=MESSAGES, tools=tools) as s:
            list(s)


@pytest.mark.parametrize(("scenario", "finish"), [("length", "length"), ("content_filter", "content_filter"), ("content_filter_partial", "content_filter")])
def test_legitimate_non_success_terminals(gateway: Gateway, scenario: str, finish: str) -> None:
    response = post(gateway, {"model": scenario, "messages": MESSAGES, "stream": True})
    assert response.status_code == 200
    frames = sse_frames(response)
    assert f'"finish_reason":"{finish}"' in frames[-2]
    assert not any('"error"' in f for f in frames)
    as_json = post(gateway, {"model": scenario, "messages": MESSAGES}).json()
    assert as_json["choices"][0]["finish_reason"] == finish


def test_no_done_with_finish_is_accepted(gateway: Gateway) -> None:
    body = post(gateway, {"model": "no_done", "messages": MESSAGES}).json()
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["choices"][0]["message"]["content"]


def test_healthz(gateway: Gateway) -> None:
    response = httpx.get(gateway.url + "/healthz")
    assert response.status_code == 200 and response.json() == {"status": "ok"}
