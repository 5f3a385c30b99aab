"""Client keys (``--api-key``): every generation route and every other /v1 route needs
one when configured, compared in constant time, never echoed. (Moved from test_pool.py.)"""

from __future__ import annotations

import httpx
import pytest

from tests.conftest import ServerLoop, Simulator, start_gateway

MESSAGES = [{"role": "user", "content": "hi"}]


def chat_calls(sim: Simulator) -> list[dict]:
    return [r for r in sim.requests() if r["path"].endswith("/chat/completions")]


@pytest.mark.parametrize("protocol", ["chat", "messages", "responses"])
def test_client_keys_required_when_configured(server_loop: ServerLoop, simulator: Simulator, tmp_path_factory: pytest.TempPathFactory, protocol: str) -> None:
    gateway = start_gateway(server_loop, simulator, tmp_path_factory, api_key=["ck-good-client-key-0001", "ck-good-client-key-0002"])
    route = {"chat": "/chat/completions", "messages": "/messages", "responses": "/responses"}[protocol]
    body = {"model": "text", "messages": MESSAGES, "input": "hi", "max_tokens": 10}
    simulator.clear()
    for headers in ({}, {"authorization": "Bearer ck-bad"}, {"x-api-key": "ck-good"}):
        response = httpx.post(gateway.base_url + route, json=body, headers=headers)
        assert response.status_code == 401
        error = response.json()["error"]
        assert error["type"] == "authentication_error"
        assert "ck-good" not in response.text
    assert chat_calls(simulator) == []
    for headers in ({"authorization": "Bearer ck-good-client-key-0002"}, {"x-api-key": "ck-good-client-key-0001"}):
        assert httpx.post(gateway.base_url + route, json=body, headers=headers).status_code == 200


def test_non_generation_routes_need_the_client_key_too(server_loop: ServerLoop, simulator: Simulator, tmp_path_factory: pytest.TempPathFactory) -> None:
    gateway = start_gateway(server_loop, simulator, tmp_path_factory, api_key=["ck-good-client-key-0003"])
    good = {"authorization": "Bearer ck-good-client-key-0003"}
    count = {"model": "text", "messages": MESSAGES}
    denied = httpx.post(gateway.base_url + "/messages/count_tokens", json=count)
    assert denied.status_code == 401 and denied.json()["type"] == "error"
    assert denied.json()["error"]["type"] == "authentication_error"
    assert httpx.post(gateway.base_url + "/messages/count_tokens", json=count, headers=good, timeout=60).json()["input_tokens"] > 0
    stored = httpx.post(gateway.base_url + "/responses", json={"model": "text", "input": "hi"}, headers=good).json()
    assert httpx.get(gateway.base_url + f"/responses/{stored['id']}").status_code == 401
    assert httpx.get(gateway.base_url + f"/responses/{stored['id']}", headers=good).json()["id"] == stored["id"]
    assert httpx.get(gateway.base_url + "/models").json()["error"]["code"] == "invalid_api_key"
