"""The wait for an upstream's response head is ``--first-byte-timeout``, not the smaller of
it and ``--idle-timeout`` (issue #40); the idle bound still cuts a body that stops coming.
Through the running gateway and the simulator (``ttfb``: seconds before the head;
``delay``: seconds between chunks), with the strict SDK."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from tests.conftest import Gateway, ServerLoop, Simulator, start_gateway

MESSAGES: Any = [{"role": "user", "content": "hi"}]


def client(gw: Gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.base_url, api_key="k", max_retries=0, timeout=30, _strict_response_validation=True)


def test_a_head_slower_than_the_idle_timeout_but_within_the_first_byte_timeout_is_answered(
    server_loop: ServerLoop, simulator: Simulator, tmp_path_factory: pytest.TempPathFactory
) -> None:
    gw = start_gateway(server_loop, simulator, tmp_path_factory, idle_timeout=0.5, first_byte_timeout=20.0)
    answer = client(gw).chat.completions.create(model="echo;ttfb=1.5", messages=MESSAGES)
    assert answer.choices[0].message.content == "You said: hi"
    with client(gw).chat.completions.stream(model="echo;ttfb=1.5", messages=MESSAGES) as stream:
        assert stream.get_final_completion().choices[0].message.content == "You said: hi"
    # the body's reads keep the idle bound: a chunk 3 s after the last is cut at 0.5 s
    with pytest.raises(openai.APIStatusError) as cut:
        client(gw).chat.completions.create(model="echo;delay=3;chunk=4", messages=MESSAGES)
    assert cut.value.status_code == 504 and cut.value.body["code"] == "upstream_idle_timeout"  # type: ignore[index]


def test_a_head_past_the_first_byte_timeout_is_a_504(
    server_loop: ServerLoop, simulator: Simulator, tmp_path_factory: pytest.TempPathFactory
) -> None:
    gw = start_gateway(server_loop, simulator, tmp_path_factory, idle_timeout=20.0, first_byte_timeout=0.5)
    with pytest.raises(openai.APIStatusError) as waited:
        client(gw).chat.completions.create(model="echo;ttfb=5", messages=MESSAGES)
    assert waited.value.status_code == 504 and waited.value.body["code"] == "upstream_timeout"  # type: ignore[index]
