"""A store that hangs costs the request path a bounded wait (issue #40), through a running
gateway on both backends: SQLite with its one connection held, PostgreSQL with the
gateway's tables locked by another session (its queries then wait inside the server, as
with a hung server). Rollout calls and Responses WebSocket turns answer while the store
hangs; admin reads answer 503 ``store_unavailable`` within their bound, never a 500
after 30 s."""

from __future__ import annotations

import contextlib
import secrets
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import psycopg
import pytest

from gateway.admin import store_bound
from tests.conftest import Gateway, ServerLoop, Simulator, start_gateway
from tests.protocols.test_responses_ws import exchange, open_ws

CLIENT_KEY = "ck-store-stalls-client-key-0123456789"


@contextlib.contextmanager
def hung_store(gw: Gateway, backend: str) -> Iterator[None]:
    """Until the block ends, every store call of the gateway's main handle waits."""
    db = gw.app.state.db
    release, held = threading.Event(), threading.Event()
    if backend == "sqlite":
        def hold() -> None:
            def stall(conn: Any) -> None:
                held.set()
                release.wait(60)
            db.run(stall)
    else:
        def hold() -> None:
            with psycopg.connect(db.url, autocommit=False) as conn:
                conn.execute("LOCK TABLE rollout_calls, rollout_marks, audit, responses IN ACCESS EXCLUSIVE MODE")
                held.set()
                release.wait(60)
                conn.rollback()
    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert held.wait(10)
        yield
    finally:
        release.set()
        holder.join(60)


@pytest.fixture(params=["sqlite", "postgres"])
def gw(request: pytest.FixtureRequest, server_loop: ServerLoop, simulator: Simulator,
       tmp_path_factory: pytest.TempPathFactory) -> Gateway:
    extra = {"database_url": request.getfixturevalue("postgres_schema")} if request.param == "postgres" else {}
    gateway = start_gateway(server_loop, simulator, tmp_path_factory, capture_tokens="vllm", api_key=[CLIENT_KEY],
                            **extra)
    gateway.backend = request.param  # type: ignore[attr-defined]
    return gateway


def rollout_call(gw: Gateway, rollout: str, text: str) -> str:
    client = openai.OpenAI(base_url=f"{gw.url}/rollouts/{rollout}/v1", api_key=CLIENT_KEY, max_retries=0, timeout=20,
                           _strict_response_validation=True)
    with client.chat.completions.stream(model="echo", messages=[{"role": "user", "content": text}]) as stream:
        return stream.get_final_completion().choices[0].message.content or ""


def test_rollout_calls_websocket_turns_and_admin_reads_are_bounded_while_the_store_hangs(
    gw: Gateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(store_bound, "ADMIN_STORE_TIMEOUT", 1.0)
    rollout = f"stall.{secrets.token_hex(4)}:r-1"
    assert rollout_call(gw, rollout, "before") == "You said: before"
    answers: dict[int, str] = {}
    failures: list[BaseException] = []

    def call(i: int) -> None:
        try:
            answers[i] = rollout_call(gw, rollout, f"call {i}")
        except Exception as exc:  # a call that waited out the client's 20 s: the store held it
            failures.append(exc)

    with hung_store(gw, gw.backend):  # type: ignore[attr-defined]
        calls = [threading.Thread(target=call, args=(i,)) for i in range(12)]  # more than the shared executor's threads
        for t in calls:
            t.start()
        for t in calls:
            t.join(30)
        assert failures == [] and answers == {i: f"You said: call {i}" for i in range(12)}
        with open_ws(gw, Authorization=f"Bearer {CLIENT_KEY}") as ws:
            for turn in range(2):
                events = exchange(ws, {"type": "response.create", "model": "echo", "store": False,
                                       "input": f"turn {turn}"})
                assert events[-1]["type"] == "response.completed"
                assert events[-1]["response"]["output"][0]["content"][0]["text"] == f"You said: turn {turn}"
        for path in ("/admin/api/audit", f"/admin/api/rollouts/{rollout}"):
            refused = httpx.get(gw.url + path, headers=gw.admin, timeout=20)
            assert refused.status_code == 503, (path, refused.text)
            assert refused.headers["retry-after"] == "1"
            error = refused.json()["error"]
            assert error["code"] == "store_unavailable" and error["type"] == "api_error" and error["message"]
    # the store is back: the same reads answer, with every call recorded once
    def recorded() -> list[dict[str, Any]]:
        response = httpx.get(f"{gw.url}/admin/api/rollouts/{rollout}", headers=gw.admin, timeout=20)
        return response.json()["calls"] if response.status_code == 200 else []  # type: ignore[no-any-return]

    from tests.conftest import wait_for

    found: list[dict[str, Any]] = []

    def all_recorded() -> bool:  # one read both counts and names them (the read's 1 s bound
        found[:] = recorded()     # above can pass on a loaded machine: a 503 reads as [])
        return len(found) == 13

    wait_for(all_recorded, timeout=30)
    assert len({c["call_id"] for c in found}) == 13
