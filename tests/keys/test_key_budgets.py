"""Budgets that tell the truth (issue #36), end to end through the official SDKs (strict)
against the simulator, both stream modes: the output cap is the gateway's in every
engine's length field, a request without a cap is served what remains, a cap that does
not fit is refused naming the one that would (Retry-After only when waiting helps), and
every answer of a key with limits carries LiteLLM's ``x-ratelimit-*`` headers."""

from __future__ import annotations

import secrets
from typing import Any

import anthropic
import openai
import pytest

from tests.conftest import Gateway, ServerLoop, Simulator, start_gateway, wait_for
from tests.keys.test_keys import ant, create_key, listed, oai


@pytest.fixture(scope="module", params=["compatible", "realtime"])
def gw(request: pytest.FixtureRequest, server_loop: ServerLoop, simulator: Simulator,
       tmp_path_factory: pytest.TempPathFactory) -> Gateway:
    return start_gateway(server_loop, simulator, tmp_path_factory, stream_mode=request.param)


def marked() -> tuple[str, list[dict[str, str]]]:
    """A user message no other test sends, to find this test's upstream bodies."""
    mark = "budget-" + secrets.token_hex(4)
    return mark, [{"role": "user", "content": mark}]


def upstream_bodies(simulator: Simulator, mark: str) -> list[dict[str, Any]]:
    return [r["body"] for r in simulator.requests() if mark in str(r["body"].get("messages"))]


def input_bound(messages: list[dict[str, str]]) -> int:
    import orjson

    return len(orjson.dumps(messages)) + len(orjson.dumps([]))


def test_engine_length_fields_cannot_raise_the_cap(gw: Gateway, simulator: Simulator) -> None:
    """``n_predict: 30000`` beside ``max_tokens: 5`` reached llama.cpp as sent (30,005
    tokens generated under a 2,000-token budget): now every length field says 5."""
    key = create_key(gw, name="engine-fields-" + secrets.token_hex(3), daily_tokens=2000)
    client = oai(gw, key["key"])
    mark, messages = marked()
    extra = {"n_predict": 30000, "max_new_tokens": 30000, "min_tokens": 30000, "ignore_eos": True}
    stream = client.chat.completions.create(model="text", messages=messages, max_tokens=5, stream=True,  # type: ignore[arg-type]
                                            stream_options={"include_usage": True}, extra_body=extra)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    [body] = upstream_bodies(simulator, mark)
    assert (body["max_tokens"], body["n_predict"], body["max_new_tokens"], body["min_tokens"]) == (5, 5, 5, 5)
    # a relayed text completion speaking llama.cpp gets n_predict too, at the key's cap
    mark2 = "budget-" + secrets.token_hex(4)
    completion = client.completions.create(model="text", prompt=mark2, extra_body={"cache_prompt": True, "n_predict": -1})
    assert completion.choices
    [relayed] = [r["body"] for r in simulator.requests() if r["body"].get("prompt") == mark2]
    assert relayed["n_predict"] == relayed["max_tokens"] <= 2000


def test_only_an_engine_field_over_the_budget_is_refused_naming_what_fits(gw: Gateway, simulator: Simulator) -> None:
    key = create_key(gw, name="n-predict-only-" + secrets.token_hex(3), daily_tokens=2000)
    mark, messages = marked()
    with pytest.raises(openai.RateLimitError) as refused:
        oai(gw, key["key"]).chat.completions.create(model="text", messages=messages,  # type: ignore[arg-type]
                                                   extra_body={"n_predict": 30000})
    fits = 2000 - input_bound(messages)
    assert refused.value.body["code"] == "budget_exceeded"  # type: ignore[index]
    assert f"send max_tokens <= {fits}" in refused.value.message
    headers = refused.value.response.headers
    assert "retry-after" not in headers and headers["x-should-retry"] == "false"  # waiting cannot help
    assert headers["x-ratelimit-remaining-tokens"] == "2000"
    assert upstream_bodies(simulator, mark) == []  # nothing went upstream


def test_a_request_without_a_cap_is_served_what_remains(gw: Gateway, simulator: Simulator) -> None:
    """``daily_tokens: 200``, nothing used: the 4,096-token default cap no longer refuses
    every request to midnight; the request is capped at what remains, in every room."""
    key = create_key(gw, name="small-budget-" + secrets.token_hex(3), daily_tokens=200)
    client = oai(gw, key["key"])
    mark, messages = marked()
    raw = client.chat.completions.with_raw_response.create(model="text", messages=messages)  # type: ignore[arg-type]
    answer = raw.parse()
    assert answer.choices[0].message.content
    [body] = upstream_bodies(simulator, mark)
    assert body["max_tokens"] == 200 - input_bound(messages)  # min(4096, what remains), sent upstream
    assert raw.headers["x-ratelimit-limit-tokens"] == "200" and raw.headers["x-ratelimit-remaining-tokens"] == "0"
    assert answer.usage is not None
    used = answer.usage.total_tokens
    wait_for(lambda: listed(gw)[key["id"]]["usage"]["tokens_today"] == used)
    # a streamed Responses call: served too, with what is left after the first one settled
    mark2 = "budget-" + secrets.token_hex(4)
    with client.responses.stream(model="text", input=mark2) as stream:
        final = stream.get_final_response()
    assert final.status == "completed" and final.usage is not None
    [second] = upstream_bodies(simulator, mark2)
    assert second["max_tokens"] == 200 - used - input_bound(second["messages"])
    # Messages names its max_tokens (required): too large is refused, naming what would fit
    wait_for(lambda: listed(gw)[key["id"]]["usage"]["tokens_today"] == used + final.usage.total_tokens)
    with pytest.raises(anthropic.RateLimitError) as named:
        ant(gw, key["key"]).messages.create(model="text", max_tokens=1024, messages=messages)  # type: ignore[arg-type]
    assert "send max_tokens <=" in named.value.message and "daily budget of 200" in named.value.message
    assert named.value.response.headers["x-should-retry"] == "false"  # 1024 never fits 200: no Retry-After
    assert "retry-after" not in named.value.response.headers


def test_every_answer_of_a_key_with_limits_says_what_it_has_left(gw: Gateway) -> None:
    key = create_key(gw, name="headers-" + secrets.token_hex(3), rpm=3, daily_tokens=100_000)
    client = oai(gw, key["key"])
    _, messages = marked()
    first = client.chat.completions.with_raw_response.create(model="text", messages=messages, max_tokens=100)  # type: ignore[arg-type]
    assert first.headers["x-ratelimit-limit-requests"] == "3" and first.headers["x-ratelimit-remaining-requests"] == "2"
    assert 58 <= int(first.headers["x-ratelimit-reset-requests"].removesuffix("s")) <= 60
    assert int(first.headers["x-ratelimit-remaining-tokens"]) == 100_000 - input_bound(messages) - 100
    assert 1 <= int(first.headers["x-ratelimit-reset-tokens"].removesuffix("s")) <= 86400
    with client.chat.completions.with_streaming_response.create(model="text", messages=messages,  # type: ignore[arg-type]
                                                                max_tokens=100, stream=True) as streamed:
        assert streamed.headers["x-ratelimit-remaining-requests"] == "1"
        assert any(chunk.choices for chunk in streamed.parse())
    with ant(gw, key["key"]).messages.with_streaming_response.create(model="text", max_tokens=50, messages=messages,  # type: ignore[arg-type]
                                                                     stream=True) as anthropic_stream:
        assert anthropic_stream.headers["x-ratelimit-remaining-requests"] == "0"
    with pytest.raises(openai.RateLimitError) as refused:
        client.chat.completions.create(model="text", messages=messages)  # type: ignore[arg-type]
    headers = refused.value.response.headers
    assert headers["x-ratelimit-remaining-requests"] == "0" and int(headers["retry-after"]) >= 1
    assert "x-should-retry" not in headers  # waiting helps here
    unlimited = create_key(gw, name="no-limits-" + secrets.token_hex(3))
    free = oai(gw, unlimited["key"]).chat.completions.with_raw_response.create(model="text", messages=messages)  # type: ignore[arg-type]
    assert not any(h.startswith("x-ratelimit-") for h in free.headers)
