"""A bug of ours anywhere in the request path (parse, tokenizer, encoder, completed hook)
reaches the client as the protocol's 500 (or in-stream error) with code internal_error,
and leaves exactly one audit record with outcome ``error`` — never plain text, never
``success``. Driven through the real app and the official SDKs (strict validation)."""

from __future__ import annotations

import time
from typing import Any

import anthropic
import httpx
import openai
import pytest

from gateway.protocols import tokens as tokens_module
from gateway.protocols.chat import ChatRoom
from tests.conftest import Gateway

USER = [{"role": "user", "content": "hi there"}]


def audit_row(gw: Gateway, request_id: str) -> dict[str, Any]:
    deadline = time.monotonic() + 8
    while True:
        response = httpx.get(f"{gw.url}/admin/api/audit/{request_id}", headers=gw.admin)
        if response.status_code == 200 or time.monotonic() > deadline:
            assert response.status_code == 200, response.text
            return response.json()  # type: ignore[no-any-return]
        time.sleep(0.02)


def boom(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("Input too long to encode safely")


def test_a_failing_parser_is_a_chat_500_in_the_openai_shape(gateway: Gateway, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ChatRoom, "parse", boom)
    client = openai.OpenAI(base_url=gateway.base_url, api_key="x", max_retries=0, _strict_response_validation=True)
    with pytest.raises(openai.InternalServerError) as caught:
        client.chat.completions.create(model="hello", messages=USER)  # type: ignore[arg-type]
    response = caught.value.response
    assert response.status_code == 500
    assert response.json() == {"error": {"message": "internal error (RuntimeError)", "type": "server_error", "param": None, "code": "internal_error"}}
    row = audit_row(gateway, response.headers["x-request-id"])
    assert row["outcome"] == "error" and row["error_code"] == "internal_error" and row["http_status"] == 500


def test_a_failing_tokenizer_in_a_messages_json_answer_is_an_anthropic_500(gateway: Gateway, monkeypatch: pytest.MonkeyPatch) -> None:
    # the o200k count (the usage estimate every room shares) runs only when the upstream
    # gave no usage (scenario usage=none)
    monkeypatch.setattr(tokens_module, "count_chat_tokens", boom)
    monkeypatch.setattr(tokens_module, "count_text", boom)
    client = anthropic.Anthropic(base_url=gateway.url, api_key="x", max_retries=0, _strict_response_validation=True)
    with pytest.raises(anthropic.InternalServerError) as caught:
        client.messages.create(model="text;usage=none", max_tokens=64, messages=USER)  # type: ignore[arg-type]
    response = caught.value.response
    assert response.json() == {"type": "error", "error": {"type": "api_error", "message": "internal_error: internal error (RuntimeError)"}}
    row = audit_row(gateway, response.headers["x-request-id"])
    assert row["outcome"] == "error" and row["error_code"] == "internal_error" and row["http_status"] == 500


def test_a_failing_tokenizer_mid_stream_is_the_in_stream_error_event(gateway: Gateway, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tokens_module, "count_chat_tokens", boom)
    monkeypatch.setattr(tokens_module, "count_text", boom)
    client = anthropic.Anthropic(base_url=gateway.url, api_key="x", max_retries=0, _strict_response_validation=True)
    with client.messages.with_streaming_response.create(
        model="text;usage=none", max_tokens=64, messages=USER, stream=True  # type: ignore[arg-type]
    ) as raw:
        request_id = raw.headers["x-request-id"]
        assert raw.status_code == 200
        body = raw.read().decode()
    assert body.startswith("event: message_start")
    assert body.rstrip().endswith(
        'data: {"type":"error","error":{"type":"api_error","message":"internal_error: internal error (RuntimeError)"}}'
    )
    assert "message_stop" not in body
    row = audit_row(gateway, request_id)
    assert row["outcome"] == "error" and row["error_code"] == "internal_error" and row["http_status"] == 200
