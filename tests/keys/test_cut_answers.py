"""Cancelled and cut answers are charged what the upstream generated (issue #36): a stream
the client drops half-way or at 99%, in both stream modes, and a Responses WebSocket
closed mid-answer, were charged 0. Now the reservation settles to the upstream's last
running usage when it sent one (vLLM continuous usage), else to the o200k count of the
prompt and of what arrived. The simulator stalls the stream at a known frame
(``pause_at``), so "what the upstream generated" is exact: its last usage sent, or the
text of the frames it sent."""

from __future__ import annotations

import json
import secrets
from typing import Any

import pytest

from gateway.protocols.tokens import count_chat_tokens, count_text
from gateway.simulator.scenarios import build_plan
from tests.conftest import Gateway, ServerLoop, Simulator, start_gateway, wait_for
from tests.keys.test_keys import create_key, listed, oai
from tests.observability.test_audit import audit_rows
from tests.protocols.test_responses_ws import open_ws

SIZE = 12800  # 200 content frames of 64 characters


@pytest.fixture(scope="module", params=["compatible", "realtime"])
def gw(request: pytest.FixtureRequest, server_loop: ServerLoop, simulator: Simulator,
       tmp_path_factory: pytest.TempPathFactory) -> Gateway:
    return start_gateway(server_loop, simulator, tmp_path_factory, stream_mode=request.param)


def model(fraction: float, usage: str) -> str:
    return f"large;size={SIZE};chunk=64;pause_at={fraction};usage={usage}"


def arrived_chars(gw: Gateway, key_id: str) -> int:
    """Characters of answer the gateway has read from the upstream for the key's request."""
    for run in gw.app.state.relay.running:
        if run.record.key_id == key_id and run.answer.acc is not None:
            return len(run.answer.acc.text)
    return -1


def sent_before_pause(simulator: Simulator, mark: str, fraction: float, name: str) -> tuple[dict[str, Any], str]:
    """The body the simulator got and the text of the frames it sent before stalling."""
    [body] = [r["body"] for r in simulator.requests() if mark in str(r["body"].get("messages"))]
    frames = build_plan(name, body).frames
    sent = frames[: int(len(frames) * fraction)]
    return body, "".join((f.get("choices") or [{}])[0].get("delta", {}).get("content") or "" for f in sent)


def charged(gw: Gateway, key_id: str) -> int:
    """The key's settled tokens today, once no reservation of it is open (a drained answer
    runs to its end first: 2 s idle, far longer on a busy machine; the bound only catches a
    reservation that never settles)."""
    db = gw.app.state.db
    wait_for(lambda: db.execute("SELECT COALESCE(SUM(open), 0) FROM client_key_requests WHERE key_id = ?", (key_id,))[0][0] == 0,
             timeout=60)
    return int(listed(gw)[key_id]["usage"]["tokens_today"])


@pytest.mark.parametrize("fraction", [0.5, 0.99])
def test_a_dropped_stream_is_charged_the_upstreams_running_usage(gw: Gateway, simulator: Simulator, fraction: float) -> None:
    key = create_key(gw, name="drop-" + secrets.token_hex(3), daily_tokens=1_000_000)
    mark = "cut-" + secrets.token_hex(4)
    name = model(fraction, "running")
    stream = oai(gw, key["key"]).chat.completions.create(model=name, messages=[{"role": "user", "content": mark}], stream=True)  # type: ignore[arg-type]
    _, text = sent_before_pause(simulator, mark, fraction, name)
    wait_for(lambda: arrived_chars(gw, key["id"]) == len(text), timeout=20)  # the gateway read all that was sent
    generated = simulator.stats()["last_sent_usage"]
    stream.close()  # the client goes away mid-answer
    assert charged(gw, key["id"]) == generated["total_tokens"]
    assert generated["completion_tokens"] >= int(SIZE / 4 * fraction) - 2  # the partial answer, not the whole
    [row] = audit_rows(gw, 1, key_id=key["id"])
    assert row["outcome"] == "cancelled"


def test_without_usage_a_dropped_stream_is_charged_its_prompt_and_what_arrived(gw: Gateway, simulator: Simulator) -> None:
    key = create_key(gw, name="drop-count-" + secrets.token_hex(3), daily_tokens=1_000_000)
    mark = "cut-" + secrets.token_hex(4)
    name = model(0.5, "none")
    stream = oai(gw, key["key"]).chat.completions.create(model=name, messages=[{"role": "user", "content": mark}], stream=True)  # type: ignore[arg-type]
    body, text = sent_before_pause(simulator, mark, 0.5, name)
    wait_for(lambda: arrived_chars(gw, key["id"]) == len(text), timeout=20)
    stream.close()
    generated = count_chat_tokens(body) + count_text(text)  # o200k: the prompt, and the half answer sent
    assert charged(gw, key["id"]) == generated
    assert count_text(text) > 1000  # a real share of the answer (was charged 0)


def test_a_websocket_closed_mid_answer_is_charged_what_was_generated(gw: Gateway, simulator: Simulator) -> None:
    key = create_key(gw, name="ws-cut-" + secrets.token_hex(3), daily_tokens=1_000_000)
    mark = "cut-" + secrets.token_hex(4)
    name = model(0.9, "running")
    with open_ws(gw, Authorization=f"Bearer {key['key']}") as ws:
        ws.send(json.dumps({"type": "response.create", "model": name, "input": mark}))
        wait_for(lambda: any(mark in str(r["body"].get("messages")) for r in simulator.requests()), timeout=20)
        _, text = sent_before_pause(simulator, mark, 0.9, name)
        wait_for(lambda: arrived_chars(gw, key["id"]) == len(text), timeout=20)
        generated = simulator.stats()["last_sent_usage"]
    assert charged(gw, key["id"]) == generated["total_tokens"] > 0


def test_a_drain_key_reads_the_answer_to_its_usage_after_the_client_left(gw: Gateway, simulator: Simulator) -> None:
    """``on_disconnect: "drain"``: the upstream is read to its end, unsent, and the request
    is charged its final usage exactly (the default ``cancel`` stops it at once)."""
    key = create_key(gw, name="drain-" + secrets.token_hex(3), daily_tokens=1_000_000, on_disconnect="drain")
    assert key["on_disconnect"] == "drain" and listed(gw)[key["id"]]["on_disconnect"] == "drain"
    completed = simulator.stats()["completed"]
    mark = "cut-" + secrets.token_hex(4)
    stream = oai(gw, key["key"]).chat.completions.create(
        model=f"large;size={SIZE};chunk=64;delay=0.01", messages=[{"role": "user", "content": mark}], stream=True)  # type: ignore[arg-type]
    wait_for(lambda: arrived_chars(gw, key["id"]) > 0, timeout=20)
    stream.close()  # the client leaves at the start of a 2 s answer
    total = charged(gw, key["id"])  # settled once the drained answer ended
    assert simulator.stats()["completed"] == completed + 1  # the upstream ran to its end, not cancelled
    assert total == simulator.stats()["last_sent_usage"]["total_tokens"] > SIZE // 4
    [row] = audit_rows(gw, 1, key_id=key["id"])
    assert row["outcome"] == "cancelled" and row["usage"]["completion_tokens"] == SIZE // 4 + 1


def test_on_disconnect_takes_cancel_or_drain(gw: Gateway) -> None:
    import httpx

    bad = httpx.post(gw.url + "/admin/api/keys", json={"name": "bad-drain", "on_disconnect": "wait"}, headers=gw.admin)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "on_disconnect"
    key = create_key(gw, name="default-" + secrets.token_hex(3))
    assert key["on_disconnect"] == "cancel"
    changed = httpx.patch(f"{gw.url}/admin/api/keys/{key['id']}", json={"on_disconnect": "drain"}, headers=gw.admin)
    assert changed.status_code == 200 and changed.json()["on_disconnect"] == "drain"
