"""Fair shares (issue #36, ``--key-share``): one managed key may hold at most its share of
this process's generation slots and Responses WebSockets, so its flood is refused (429
``concurrency_limited`` before its body is read; 503 ``too_many_websockets`` before the
upgrade) while other keys are still served (one key could take all 64 WebSocket slots and
every other key's new socket got 503). Through the official SDK (strict)."""

from __future__ import annotations

import secrets
import threading

import openai
import pytest
from websockets.exceptions import InvalidStatus

from tests.conftest import Gateway, ServerLoop, Simulator, start_gateway, wait_for
from tests.keys.test_keys import create_key, oai
from tests.observability.test_audit import scrape
from tests.protocols.test_responses_ws import exchange, open_ws

HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def gw(server_loop: ServerLoop, simulator: Simulator, tmp_path_factory: pytest.TempPathFactory) -> Gateway:
    return start_gateway(server_loop, simulator, tmp_path_factory, max_concurrent=4, key_share=0.5,
                         ws_max_connections=4)


def test_a_keys_flood_is_held_to_its_share_while_another_key_is_served(gw: Gateway) -> None:
    flood, other = create_key(gw, name="flood-" + secrets.token_hex(3)), create_key(gw, name="other-" + secrets.token_hex(3))
    relay = gw.app.state.relay
    slow = [threading.Thread(target=lambda: oai(gw, flood["key"]).chat.completions.create(
        model="text;ttfb=1.5", messages=HI)) for _ in range(2)]  # type: ignore[arg-type]
    for t in slow:
        t.start()
    wait_for(lambda: relay.running.of_key(flood["id"]) == 2, timeout=10)
    with pytest.raises(openai.RateLimitError) as refused:  # its third: past its 2 of 4
        oai(gw, flood["key"]).chat.completions.create(model="text", messages=HI)  # type: ignore[arg-type]
    assert refused.value.body["code"] == "concurrency_limited" and "2 of its 4" in refused.value.message  # type: ignore[index]
    assert refused.value.response.headers["retry-after"] == "1"
    served = oai(gw, other["key"]).chat.completions.create(model="text", messages=HI)  # type: ignore[arg-type]
    assert served.choices[0].message.content  # the other key still has the gateway's other slots
    for t in slow:
        t.join(20)
    assert relay.running.of_key(flood["id"]) == 0
    assert oai(gw, flood["key"]).chat.completions.create(model="text", messages=HI).choices  # type: ignore[arg-type]


def test_one_key_cannot_take_every_websocket_slot(gw: Gateway) -> None:
    flood, other = create_key(gw, name="ws-flood-" + secrets.token_hex(3)), create_key(gw, name="ws-other-" + secrets.token_hex(3))
    with open_ws(gw, Authorization=f"Bearer {flood['key']}"), open_ws(gw, Authorization=f"Bearer {flood['key']}"):
        with pytest.raises(InvalidStatus) as refused:  # its third: past its 2 of 4
            open_ws(gw, Authorization=f"Bearer {flood['key']}")
        assert refused.value.response.status_code == 503
        assert b"for your API key" in refused.value.response.body
        with open_ws(gw, Authorization=f"Bearer {other['key']}") as ws:  # other keys still get a socket
            assert exchange(ws, {"type": "response.create", "model": "text", "input": "hi"})[-1]["type"] == "response.completed"
    wait_for(lambda: _open_sockets(gw) == 0, timeout=10)
    with open_ws(gw, Authorization=f"Bearer {flood['key']}") as ws:  # closed sockets gave their slots back
        assert exchange(ws, {"type": "response.create", "model": "text", "input": "hi"})[-1]["type"] == "response.completed"


def _open_sockets(gw: Gateway) -> float:
    return sum(v for _, v in scrape(gw.url)["codebuddy2api_websockets_open"])
