"""Managed client keys on two replicas sharing one PostgreSQL database (issue #28): the
limits are per key, not per replica, and a key revoked through one replica is refused by
the other within two seconds."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import anthropic
import httpx
import openai
import pytest

from tests.conftest import Gateway, ServerLoop, replica_pair, wait_for
from tests.keys.test_keys import (
    BURST_REFUSALS,
    JSON_HEADERS,
    MESSAGES,
    burst_refusal,
    create_key,
    listed,
    oai,
    spend_to_refusal,
)

Pair = tuple[Gateway, Gateway]


@pytest.fixture(scope="module")
def pair(server_loop: ServerLoop, postgres_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    with replica_pair(server_loop, postgres_url, tmp_path_factory, ("keys-a", "keys-b"),
                      keepalive_interval=0.5, stream_mode="realtime") as (a, b, _sim):
        yield a, b


def test_a_key_revoked_on_a_is_refused_by_b_within_two_seconds(pair: Pair) -> None:
    a, b = pair
    key = create_key(a, name="revoked-across")
    wait_for(lambda: b.app.state.client_keys.get(key["id"]) is not None, 30)  # B learns of it
    assert oai(b, key["key"]).chat.completions.create(model="text", messages=MESSAGES).choices  # type: ignore[arg-type]
    revoked_at = time.monotonic()
    assert httpx.request("DELETE", f"{a.url}/admin/api/keys/{key['id']}", headers={**a.admin, **JSON_HEADERS}).status_code == 204

    def refused_on_b() -> bool:
        try:
            oai(b, key["key"]).chat.completions.create(model="text", messages=MESSAGES)  # type: ignore[arg-type]
        except openai.AuthenticationError as exc:
            assert exc.body["message"] == "this API key was revoked"  # type: ignore[index]
            return True
        return False

    wait_for(refused_on_b, 2.0)
    seen = time.monotonic() - revoked_at
    print(f"\nrevocation seen by the second replica after {seen * 1000:.0f} ms")
    assert seen < 2.0


def test_rpm_10_holds_across_both_replicas(pair: Pair) -> None:
    a, b = pair
    key = create_key(a, name="rpm10", rpm=10)
    wait_for(lambda: b.app.state.client_keys.get(key["id"]) is not None, 30)
    outcomes = []
    for i in range(14):
        gw = (a, b)[i % 2]
        try:
            oai(gw, key["key"]).chat.completions.create(model="text", messages=MESSAGES)  # type: ignore[arg-type]
            outcomes.append("ok")
        except openai.RateLimitError as exc:
            assert exc.body["code"] == "rate_limited" and int(exc.response.headers["retry-after"]) >= 1  # type: ignore[index]
            outcomes.append("429")
    assert outcomes == ["ok"] * 10 + ["429"] * 4
    assert listed(b)[key["id"]]["usage"]["requests_today"] == 10


def test_fifty_concurrent_requests_over_both_replicas_hold_the_budget(pair: Pair) -> None:
    a, b = pair
    key = create_key(a, name="budget-across", daily_tokens=1000, max_concurrent=40)
    wait_for(lambda: b.app.state.client_keys.get(key["id"]) is not None, 30)
    served: list[int] = []
    refused: list[str] = []
    lock = threading.Lock()
    barrier = threading.Barrier(50)

    def one(i: int) -> None:
        gw = (a, b)[i % 2]
        barrier.wait()
        try:
            if i % 4 < 2:
                stream = oai(gw, key["key"]).chat.completions.create(
                    model="text", messages=MESSAGES, max_tokens=100, stream=True, stream_options={"include_usage": True})  # type: ignore[arg-type]
                tokens = [c.usage for c in stream if c.usage][-1].total_tokens
            else:
                client = anthropic.Anthropic(base_url=gw.url, api_key=key["key"], max_retries=0, _strict_response_validation=True)
                with client.messages.stream(model="text", max_tokens=100, messages=MESSAGES) as s:  # type: ignore[arg-type]
                    usage = s.get_final_message().usage
                tokens = usage.input_tokens + usage.output_tokens
            with lock:
                served.append(tokens)
        except (openai.APIStatusError, anthropic.APIStatusError) as exc:
            code = burst_refusal(exc, allowed)
            with lock:
                refused.append(code)

    # the budget, max_concurrent, and the store's 2 s reservation bound failing closed
    # (503 key_store_unavailable, a busy machine: #39); never a request served past them
    allowed = BURST_REFUSALS | {(429, "concurrency_limited")}
    threads = [threading.Thread(target=one, args=(i,)) for i in range(50)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(served) + len(refused) == 50 and served and refused
    assert set(refused) <= {code for _, code in allowed}
    assert sum(served) <= 1000
    print(f"\ntwo replicas, budget 1000: served {len(served)} requests, {sum(served)} tokens; refused {len(refused)} "
          f"({ {code: refused.count(code) for code in sorted(set(refused))} })")
    # a late reservation (committed after its 503) is given back: usage is what was served
    wait_for(lambda: listed(b)[key["id"]]["usage"]["tokens_today"] == sum(served), 30)
    if "budget_exceeded" not in refused:  # the store refused all the rest: the budget still ends it
        more = spend_to_refusal([oai(a, key["key"]), oai(b, key["key"])])
        assert sum(served) + more <= 1000
