"""The gateway stops reading past a key's output cap (issue #36): the cap is sent upstream
in every engine's field, but the simulator's ``large`` scenario ignores them all (as a
careless engine would) and streams 60,000 characters. The answer the client assembles
through the official SDKs (strict) ends as ``length`` at the cap, in all three protocols,
both stream modes, streamed or not; the upstream is closed (its stream never completes)
and the key is charged what was read, never the whole answer."""

from __future__ import annotations

import secrets

import pytest

from gateway.protocols.tokens import count_chat_tokens, count_text
from tests.conftest import Gateway, ServerLoop, Simulator, start_gateway
from tests.drivers import DRIVERS, UNARY_DRIVERS, Ask
from tests.keys.test_cut_answers import charged
from tests.keys.test_keys import create_key
from tests.observability.test_audit import audit_rows

CAP = 40
SIZE = 60_000  # ~15,000 tokens the engine would send
MODEL = f"large;size={SIZE};chunk=16;delay=0.001"


@pytest.fixture(scope="module", params=["compatible", "realtime"])
def gw(request: pytest.FixtureRequest, server_loop: ServerLoop, simulator: Simulator,
       tmp_path_factory: pytest.TempPathFactory) -> Gateway:
    return start_gateway(server_loop, simulator, tmp_path_factory, stream_mode=request.param)


@pytest.mark.parametrize("streamed", [True, False], ids=["stream", "json"])
@pytest.mark.parametrize("protocol", ["chat", "messages", "responses"])
def test_an_engine_that_ignores_the_cap_is_cut_at_it_and_charged_what_was_read(
        gw: Gateway, simulator: Simulator, protocol: str, streamed: bool) -> None:
    key = create_key(gw, name="cap-" + secrets.token_hex(3), daily_tokens=1_000_000)
    mark = "cap-" + secrets.token_hex(4)
    completed = simulator.stats()["completed"]
    drive = (DRIVERS if streamed else UNARY_DRIVERS)[protocol]
    outcome = drive(gw.url, MODEL, ask=Ask(prompt=mark, max_tokens=CAP, tools=False, api_key=key["key"]))
    assert outcome.ok, outcome.error
    assert outcome.finish == "length"
    assert CAP - 2 <= count_text(outcome.text) <= CAP  # cut at the cap, not 15,000 tokens
    assert SIZE // 4 > 10 * CAP  # (the engine would have sent far more)
    [body] = [r["body"] for r in simulator.requests() if mark in str(r["body"].get("messages"))]
    assert body["max_tokens"] == CAP  # the cap was sent; the engine ignored it
    assert outcome.usage is not None and outcome.usage[1] == count_text(outcome.text)
    [row] = audit_rows(gw, 1, key_id=key["id"])
    assert row["outcome"] == "success" and row["finish_reason"] == "length"
    assert charged(gw, key["id"]) == count_chat_tokens(body) + count_text(outcome.text)
    assert simulator.stats()["completed"] == completed  # the upstream was closed, not read to its end
