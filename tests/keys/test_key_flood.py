"""One key's flood does not slow the others (issue #36): what makes it hold, asserted (the
latency figures are bench/key_flood.py's, docs/performance.md). A key past its ``rpm`` is
refused from memory before its body is read, parsed or reserved (each refusal was a body
parse and a store transaction on the store's threads); refused requests hold no slot
another key needs; the tokenizer's tables (seconds to load) never load on the event loop."""

from __future__ import annotations

import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anthropic
import httpx
import openai
import pytest

from gateway.keys import store
from gateway.keys.limiter import REFUSAL_PACE
from gateway.protocols import tokens
from tests.conftest import Gateway, ServerLoop, Simulator, start_gateway, wait_for
from tests.keys.test_keys import ant, create_key, oai
from tests.observability.test_audit import audit_rows

HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def gw(server_loop: ServerLoop, simulator: Simulator, tmp_path_factory: pytest.TempPathFactory) -> Gateway:
    return start_gateway(server_loop, simulator, tmp_path_factory, max_concurrent=2, key_share=1.0)


@pytest.fixture
def store_admits(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The request ids the key store was asked to admit (its transaction, on its threads)."""
    asked: list[str] = []
    real = store.admit

    def admit(db: Any, key: Any, request_id: str, ask: Any) -> Any:
        asked.append(request_id)
        return real(db, key, request_id, ask)

    monkeypatch.setattr(store, "admit", admit)
    return asked


def test_a_key_past_its_rpm_is_refused_before_its_body_is_read_or_the_store_asked(gw: Gateway, store_admits: list[str]) -> None:
    key = create_key(gw, name="flood-" + secrets.token_hex(3), rpm=1)
    assert oai(gw, key["key"]).chat.completions.create(model="text", messages=HI).choices  # type: ignore[arg-type]
    with pytest.raises(openai.RateLimitError) as first:  # the store finds the window full
        oai(gw, key["key"]).chat.completions.create(model="text", messages=HI)  # type: ignore[arg-type]
    assert len(store_admits) == 2
    headers = {"authorization": f"Bearer {key['key']}", "content-type": "application/json"}
    began = time.monotonic()
    for _ in range(4):  # not even JSON: the refusal comes before the body is read
        refused = httpx.post(gw.base_url + "/chat/completions", content=b"{not json", headers=headers)
        assert refused.status_code == 429, refused.text
        assert refused.json()["error"]["code"] == "rate_limited" and "1 requests per minute" in refused.json()["error"]["message"]
        assert 1 <= int(refused.headers["retry-after"]) <= int(first.value.response.headers["retry-after"])
        assert refused.headers["x-ratelimit-remaining-requests"] == "0"
        assert refused.headers["x-ratelimit-reset-requests"] == refused.headers["retry-after"] + "s"
    # paced: a key that asks again while told to wait gets each refusal after REFUSAL_PACE
    # (one connection cannot repeat them faster; a lower bound, which a busy machine only raises)
    assert time.monotonic() - began >= 4 * REFUSAL_PACE * 0.95
    with pytest.raises(anthropic.RateLimitError):  # count_tokens, the same window
        ant(gw, key["key"]).messages.count_tokens(model="text", messages=HI)  # type: ignore[arg-type]
    assert len(store_admits) == 2  # none of the 5 refusals from memory asked the store
    rows = audit_rows(gw, 6, key_id=key["id"])  # each refused generation still has its audit record
    assert sum(r["error_code"] == "rate_limited" for r in rows) == 5


def test_a_changed_limit_forgets_the_full_window(gw: Gateway) -> None:
    key = create_key(gw, name="raised-" + secrets.token_hex(3), rpm=1)
    client = oai(gw, key["key"])
    client.chat.completions.create(model="text", messages=HI)  # type: ignore[arg-type]
    with pytest.raises(openai.RateLimitError):
        client.chat.completions.create(model="text", messages=HI)  # type: ignore[arg-type]
    raised = httpx.patch(f"{gw.url}/admin/api/keys/{key['id']}", json={"rpm": 100}, headers=gw.admin)
    assert raised.status_code == 200

    def served() -> bool:
        try:
            return bool(client.chat.completions.create(model="text", messages=HI).choices)  # type: ignore[arg-type]
        except openai.RateLimitError:
            return False

    wait_for(served, timeout=10)  # once the registry reloaded the key (every second)


def test_refused_requests_hold_no_slot_another_key_needs(gw: Gateway) -> None:
    """Two slots in all, one key's 60 refused requests at once beside another key's two
    answers in flight: the other key is served every time, the flood only ever gets 429s."""
    flood = create_key(gw, name="flood2-" + secrets.token_hex(3), rpm=1)
    other = create_key(gw, name="other-" + secrets.token_hex(3))
    oai(gw, flood["key"]).chat.completions.create(model="text", messages=HI)  # type: ignore[arg-type]
    statuses: list[int] = []
    stop = threading.Event()

    def hammer() -> None:
        with httpx.Client(timeout=30) as c:
            while not stop.is_set():
                r = c.post(gw.base_url + "/chat/completions", json={"model": "text", "messages": HI},
                           headers={"authorization": f"Bearer {flood['key']}"})
                statuses.append(r.status_code)

    def other_answer(_: int) -> str:
        return oai(gw, other["key"]).chat.completions.create(model="text;ttfb=0.2", messages=HI).choices[0].message.content or ""  # type: ignore[arg-type]

    flooders = [threading.Thread(target=hammer) for _ in range(6)]
    for t in flooders:
        t.start()
    try:
        with ThreadPoolExecutor(2) as pool:
            answers = list(pool.map(other_answer, range(8)))
    finally:
        stop.set()
        for t in flooders:
            t.join(30)
    assert all(answers) and len(answers) == 8
    assert statuses and set(statuses) == {429}


def test_the_tokenizer_loads_off_the_loop(gw: Gateway, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first ``count_tokens`` of a process loaded the tokenizer's tables on the event
    loop (2-4 s here, every request and /healthz waiting). Here the load waits until
    /healthz has answered while it is under way: on the loop it would wait in vain (the
    loop is the one that must answer), and the test fails on that wait's bound, whatever
    the machine's pace."""
    real = tokens._tables
    loading = threading.Event()
    answered = threading.Event()
    loaded_on: list[str] = []

    @tokens.lru_cache(maxsize=1)
    def slow_tables() -> Any:
        loaded_on.append(threading.current_thread().name)
        loading.set()
        answered.wait(30)
        return real()

    monkeypatch.setattr(tokens, "_tables", slow_tables)
    assert not tokens.tokenizer_loaded()
    key = create_key(gw, name="count-" + secrets.token_hex(3))
    counted: list[int] = []
    counter = threading.Thread(target=lambda: counted.append(
        ant(gw, key["key"]).messages.count_tokens(model="text", messages=HI).input_tokens))  # type: ignore[arg-type]
    counter.start()
    assert loading.wait(60)
    try:
        healthz = httpx.get(gw.url + "/healthz", timeout=20)  # while the load is held
    finally:
        answered.set()
    counter.join(60)
    assert healthz.status_code == 200 and healthz.json()["status"] == "ok"
    assert counted and counted[0] > 0 and tokens.tokenizer_loaded()
    assert loaded_on and loaded_on[0] != "servers"  # not the servers' event loop thread


def test_a_refused_requests_connection_stays_open_for_the_next(gw: Gateway) -> None:
    """Refused before its body was read, a small body is still read (not parsed), so the
    connection is not closed: a flooding client reconnected after every refusal, which cost
    the gateway more than the refusal itself."""
    import socket

    key = create_key(gw, name="conn-" + secrets.token_hex(3), rpm=1)
    oai(gw, key["key"]).chat.completions.create(model="text", messages=HI)  # type: ignore[arg-type]
    with pytest.raises(openai.RateLimitError):  # the store finds the window full: remembered
        oai(gw, key["key"]).chat.completions.create(model="text", messages=HI)  # type: ignore[arg-type]
    host, port = gw.url.removeprefix("http://").split(":")
    body = b'{"model": "text", "messages": [{"role": "user", "content": "hi"}]}'
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        reader = sock.makefile("rb")
        for path in ("/v1/chat/completions", "/v1/messages/count_tokens", "/v1/chat/completions"):
            sock.sendall(f"POST {path} HTTP/1.1\r\nhost: {host}\r\nauthorization: Bearer {key['key']}\r\n"
                         f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n".encode() + body)
            status = reader.readline()
            assert status.startswith(b"HTTP/1.1 429"), status
            length = 0
            while (line := reader.readline()) != b"\r\n":
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
                assert not line.lower().startswith(b"connection: close"), line
            assert b"rate_limited" in reader.read(length)
