"""Every route counts (issue #36): ``count_tokens`` and Responses WebSocket warm-up frames
(``generate: false``) go through a managed key's ``rpm`` and model globs, as generating
requests do (an ``rpm: 1`` key made 427 count_tokens calls in 10 s; 100 warm-up frames in
2.7 s, a model outside its globs accepted). Through the Anthropic SDK (strict) and the
WebSocket frames validated against the OpenAI SDK's event types."""

from __future__ import annotations

import secrets

import anthropic
import pytest

from tests.conftest import Gateway, ServerLoop, Simulator, start_gateway
from tests.keys.test_keys import ant, create_key
from tests.protocols.test_responses_ws import exchange, open_ws

HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def gw(server_loop: ServerLoop, simulator: Simulator, tmp_path_factory: pytest.TempPathFactory) -> Gateway:
    return start_gateway(server_loop, simulator, tmp_path_factory)


def test_count_tokens_counts_against_rpm_and_the_model_globs(gw: Gateway, simulator: Simulator) -> None:
    key = create_key(gw, name="count-" + secrets.token_hex(3), rpm=2, models=["text"])
    client = ant(gw, key["key"])
    first = client.messages.with_raw_response.count_tokens(model="text", messages=HI)  # type: ignore[arg-type]
    assert first.parse().input_tokens > 0
    assert first.headers["x-ratelimit-limit-requests"] == "2" and first.headers["x-ratelimit-remaining-requests"] == "1"
    with pytest.raises(anthropic.PermissionDeniedError) as outside:
        client.messages.count_tokens(model="reasoning", messages=HI)  # type: ignore[arg-type]
    assert outside.value.body["error"]["type"] == "permission_error" and "'reasoning'" in outside.value.message  # type: ignore[index]
    with pytest.raises(anthropic.RateLimitError) as limited:  # the third call in the minute
        client.messages.count_tokens(model="text", messages=HI)  # type: ignore[arg-type]
    assert "2 requests per minute" in limited.value.message
    assert 1 <= int(limited.value.response.headers["retry-after"]) <= 60
    assert limited.value.response.headers["x-ratelimit-remaining-requests"] == "0"
    # and a generation of the same key is refused too: one window for every route
    with pytest.raises(anthropic.RateLimitError):
        client.messages.create(model="text", max_tokens=16, messages=HI)  # type: ignore[arg-type]


def test_count_tokens_of_a_key_without_rpm_is_not_refused_for_its_budget(gw: Gateway) -> None:
    key = create_key(gw, name="count-budget-" + secrets.token_hex(3), daily_tokens=10, max_concurrent=1)
    for _ in range(5):
        assert ant(gw, key["key"]).messages.count_tokens(model="text", messages=HI).input_tokens > 0  # type: ignore[arg-type]


def test_warm_up_frames_count_against_rpm_and_the_model_globs(gw: Gateway) -> None:
    key = create_key(gw, name="warm-" + secrets.token_hex(3), rpm=2, models=["text"])
    with open_ws(gw, Authorization=f"Bearer {key['key']}") as ws:
        outside = exchange(ws, {"type": "response.create", "model": "reasoning", "input": "hi", "generate": False})[-1]
    assert outside["type"] == "error" and outside["status"] == 403 and outside["error"]["code"] == "model_not_allowed"
    with open_ws(gw, Authorization=f"Bearer {key['key']}") as ws:
        for _ in range(2):
            warm = exchange(ws, {"type": "response.create", "model": "text", "input": "hi", "generate": False})
            assert warm[-1]["type"] == "response.completed" and warm[-1]["response"]["output"] == []
        limited = exchange(ws, {"type": "response.create", "model": "text", "input": "hi", "generate": False})[-1]
    assert limited["type"] == "error" and limited["status"] == 429 and limited["error"]["code"] == "rate_limited"
    with open_ws(gw, Authorization=f"Bearer {key['key']}") as ws:  # the same minute for generating frames
        refused = exchange(ws, {"type": "response.create", "model": "text", "input": "hi"})[-1]
    assert refused["type"] == "error" and refused["error"]["code"] == "rate_limited"
