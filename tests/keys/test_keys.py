"""Managed client keys (issue #28, gateway/keys/): the admin API, and every rule enforced
end to end through the official SDKs (strict), both stream modes, HTTP and WebSocket, on
the real SQLite store. The PostgreSQL replicas' side is in test_keys_replicas.py."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.conftest import Gateway, ServerLoop, Simulator, start_gateway, wait_for
from tests.observability.test_audit import audit_rows, scrape
from tests.protocols.test_responses_ws import exchange, open_ws

MESSAGES = [{"role": "user", "content": "hi"}]
JSON_HEADERS = {"content-type": "application/json"}


def create_key(gw: Gateway, **fields: Any) -> dict[str, Any]:
    response = httpx.post(gw.url + "/admin/api/keys", json={"name": fields.pop("name", "k"), **fields}, headers=gw.admin)
    assert response.status_code == 201, response.text
    return response.json()  # type: ignore[no-any-return]


def listed(gw: Gateway) -> dict[str, dict[str, Any]]:
    response = httpx.get(gw.url + "/admin/api/keys", headers=gw.admin)
    assert response.status_code == 200
    return {k["id"]: k for k in response.json()["keys"]}


def revoke(gw: Gateway, key_id: str) -> httpx.Response:
    return httpx.request("DELETE", f"{gw.url}/admin/api/keys/{key_id}", headers={**gw.admin, **JSON_HEADERS})


def oai(gw: Gateway, secret: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.base_url, api_key=secret, max_retries=0, _strict_response_validation=True)


def ant(gw: Gateway, secret: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gw.url, api_key=secret, max_retries=0, _strict_response_validation=True)


@pytest.fixture(scope="module", params=["compatible", "realtime"])
def gw(request: pytest.FixtureRequest, server_loop: ServerLoop, simulator: Simulator, tmp_path_factory: pytest.TempPathFactory) -> Gateway:
    """A gateway of its own (a managed key makes keys required on it) with a static key too."""
    return start_gateway(server_loop, simulator, tmp_path_factory, stream_mode=request.param,
                         api_key=["ck-static-client-key-0001"])


# -- the admin API ------------------------------------------------------------------------


def test_create_list_change_revoke_and_the_secret_is_shown_once(gw: Gateway) -> None:
    created = create_key(gw, name="team-a", models=["text*"], rpm=5, tpm=1000, max_concurrent=2, daily_tokens=5000,
                         expires_at="2099-01-01T00:00:00Z", metadata={"team": "a"})
    secret = created["key"]
    assert secret.startswith("sk-cb2a-") and len(secret) > 40 and created["id"].startswith("key_")
    assert (created["name"], created["models"], created["rpm"], created["tpm"], created["max_concurrent"],
            created["daily_tokens"], created["expires_at"]) == ("team-a", ["text*"], 5, 1000, 2, 5000, "2099-01-01T00:00:00Z")
    row = listed(gw)[created["id"]]
    assert row["prefix"] == secret[:12] and row["revoked_at"] is None and row["usage"] == {"requests_today": 0, "tokens_today": 0}
    assert "key" not in row and "secret_hash" not in row
    listing = httpx.get(gw.url + "/admin/api/keys", headers=gw.admin).text
    assert secret not in listing and secret[12:] not in listing
    changed = httpx.patch(f"{gw.url}/admin/api/keys/{created['id']}", json={"rpm": 7, "models": None}, headers=gw.admin)
    assert changed.status_code == 200 and changed.json()["rpm"] == 7 and changed.json()["models"] is None
    assert changed.json()["tpm"] == 1000  # what was not sent stays
    assert listed(gw)[created["id"]]["rpm"] == 7
    assert revoke(gw, created["id"]).status_code == 204
    assert listed(gw)[created["id"]]["revoked_at"] is not None


@pytest.mark.parametrize("body,param", [
    ({"name": ""}, "name"), ({"name": "x", "rpm": -1}, "rpm"), ({"name": "x", "tpm": "10"}, "tpm"),
    ({"name": "x", "max_concurrent": True}, "max_concurrent"), ({"name": "x", "models": "gpt-*"}, "models"),
    ({"name": "x", "expires_at": "tomorrow"}, "expires_at"), ({"name": "x", "expires_at": "2030-01-01T00:00:00"}, "expires_at"),
    ({"name": "x", "metadata": [1]}, "metadata"), ({"name": "x", "colour": "red"}, "colour"),
])
def test_bad_admin_input_is_a_400_naming_the_field(gw: Gateway, body: dict[str, Any], param: str) -> None:
    response = httpx.post(gw.url + "/admin/api/keys", json=body, headers=gw.admin)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_value" and error["param"] == param


def test_unknown_keys_duplicate_names_and_no_admin_token(gw: Gateway) -> None:
    create_key(gw, name="dup")
    taken = httpx.post(gw.url + "/admin/api/keys", json={"name": "dup"}, headers=gw.admin)
    assert taken.status_code == 409 and taken.json()["error"]["code"] == "key_name_taken"
    missing = httpx.patch(gw.url + "/admin/api/keys/key_nope", json={"rpm": 1}, headers=gw.admin)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "key_not_found"
    assert revoke(gw, "key_nope").status_code == 404
    assert httpx.get(gw.url + "/admin/api/keys").status_code == 401
    assert httpx.post(gw.url + "/admin/api/keys", json={"name": "x"}).status_code == 401


# -- using a key ---------------------------------------------------------------------------


def test_a_key_serves_every_protocol_and_its_usage_is_counted_and_audited(gw: Gateway) -> None:
    key = create_key(gw, name="serves-all")
    secret = key["key"]
    client = oai(gw, secret)
    chunks = list(client.chat.completions.create(model="text", messages=MESSAGES, stream=True,  # type: ignore[arg-type]
                                                 stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    chat_usage = chunks[-1].usage
    assert chat_usage is not None and chat_usage.total_tokens > 0
    with client.responses.stream(model="text", input="hi") as stream:
        final = stream.get_final_response()
    assert final.status == "completed" and final.usage is not None
    message = ant(gw, secret).messages.create(model="text", max_tokens=50, messages=MESSAGES)  # type: ignore[arg-type]
    assert message.stop_reason == "end_turn"
    with ant(gw, secret).messages.stream(model="text", max_tokens=50, messages=MESSAGES) as s:  # type: ignore[arg-type]
        assert s.get_final_message().stop_reason == "end_turn"
    # the static --api-key still works, without limits, and is no managed key's
    assert oai(gw, "ck-static-client-key-0001").chat.completions.create(model="text", messages=MESSAGES).choices  # type: ignore[arg-type]
    rows = audit_rows(gw, 4, key_id=key["id"])
    assert len(rows) == 4 and {(r["key_id"], r["key_name"], r["outcome"]) for r in rows} == {(key["id"], "serves-all", "success")}
    # the export honours key_id as the list does: this key's 4 rows, not the gateway's every row
    exported = httpx.get(gw.url + "/admin/api/audit/export", params={"key_id": key["id"]}, headers=gw.admin)
    assert exported.status_code == 200
    assert sorted(json.loads(line)["request_id"] for line in exported.text.splitlines()) == sorted(r["request_id"] for r in rows)
    everything = httpx.get(gw.url + "/admin/api/audit/export", headers=gw.admin).text.splitlines()
    assert len(everything) > 4  # the static key's request (and the module's others) are left out above
    expected = sum(r["usage"].get("prompt_tokens", 0) + r["usage"].get("completion_tokens", 0) for r in rows)
    wait_for(lambda: listed(gw)[key["id"]]["usage"] == {"requests_today": 4, "tokens_today": expected})
    text = json.dumps(audit_rows(gw, 5)) + httpx.get(gw.url + "/metrics").text
    assert secret not in text and secret[12:] not in text
    samples = scrape(gw.url)
    served = [v for labels, v in samples["codebuddy2api_key_requests_total"]
              if labels["key"] == "serves-all" and labels["outcome"] == "success"]
    assert sum(served) == 4
    tokens = {labels["kind"]: v for labels, v in samples["codebuddy2api_key_tokens_total"] if labels["key"] == "serves-all"}
    assert tokens["input"] + tokens["output"] == expected


def test_a_model_outside_the_globs_is_403_in_each_shape_and_models_lists_only_its_own(gw: Gateway, simulator: Simulator) -> None:
    key = create_key(gw, name="text-only", models=["text", "tool*"])
    secret = key["key"]
    simulator.clear()
    with pytest.raises(openai.PermissionDeniedError) as chat:
        oai(gw, secret).chat.completions.create(model="reasoning", messages=MESSAGES, stream=True)  # type: ignore[arg-type]
    assert chat.value.status_code == 403
    assert chat.value.body == {"message": "this API key may not use the model 'reasoning'", "type": "permission_error",  # type: ignore[comparison-overlap]
                               "param": "model", "code": "model_not_allowed"}
    with pytest.raises(openai.PermissionDeniedError):
        oai(gw, secret).responses.create(model="reasoning", input="hi")
    with pytest.raises(anthropic.PermissionDeniedError) as messages:
        ant(gw, secret).messages.create(model="reasoning", max_tokens=10, messages=MESSAGES)  # type: ignore[arg-type]
    assert messages.value.body == {"type": "error", "error": {"type": "permission_error",
                                   "message": "model_not_allowed: this API key may not use the model 'reasoning'"}}
    assert not [r for r in simulator.requests() if r["path"].endswith("/chat/completions")]  # nothing went upstream
    assert oai(gw, secret).chat.completions.create(model="tool", messages=MESSAGES).choices  # type: ignore[arg-type]
    names = [m.id for m in oai(gw, secret).models.list()]
    assert names and all(n == "text" or n.startswith("tool") for n in names)
    all_names = [m.id for m in oai(gw, "ck-static-client-key-0001").models.list()]
    assert "reasoning" in all_names
    assert httpx.get(gw.base_url + "/models/reasoning", headers={"authorization": f"Bearer {secret}"}).status_code == 404
    rows = audit_rows(gw, 4, key_id=key["id"])
    assert sorted((r["outcome"], r["error_code"] or "", r["http_status"]) for r in rows) == [
        ("refused", "model_not_allowed", 403)] * 3 + [("success", "", 200)]


def test_a_monthly_budget_refuses_past_it_until_the_month_ends(gw: Gateway) -> None:
    from gateway.keys.periods import seconds_to_period_end

    key = create_key(gw, name="monthly", budget_tokens=600, budget_period="month", max_output_tokens=100)
    assert (key["budget_tokens"], key["budget_period"]) == (600, "month")
    assert (listed(gw)[key["id"]]["budget_tokens"], listed(gw)[key["id"]]["budget_period"]) == (600, "month")
    client = oai(gw, key["key"])
    served = 0
    with pytest.raises(openai.RateLimitError) as refused:
        for _ in range(20):  # each reserves its input bound + 100 output tokens, then settles to its usage
            assert client.chat.completions.create(model="text", messages=MESSAGES, max_tokens=100).choices  # type: ignore[arg-type]
            served += 1
    assert served >= 1
    assert refused.value.body["code"] == "budget_exceeded" and "per month" in refused.value.body["message"]  # type: ignore[index]
    wait = int(refused.value.response.headers["retry-after"])
    assert abs(wait - seconds_to_period_end(time.time(), "month")) <= 5
    bad = httpx.post(gw.url + "/admin/api/keys", json={"name": "yearly", "budget_period": "year"}, headers=gw.admin)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "budget_period"


def test_the_sixth_request_in_a_minute_under_rpm_5_is_429_with_retry_after(gw: Gateway) -> None:
    secret = create_key(gw, name="rpm5", rpm=5)["key"]
    client = oai(gw, secret)
    for _ in range(3):
        assert client.chat.completions.create(model="text", messages=MESSAGES).choices  # type: ignore[arg-type]
    with ant(gw, secret).messages.stream(model="text", max_tokens=20, messages=MESSAGES) as s:  # type: ignore[arg-type]
        s.get_final_message()
    with client.responses.stream(model="text", input="hi") as stream:
        stream.get_final_response()
    with pytest.raises(openai.RateLimitError) as refused:
        client.chat.completions.create(model="text", messages=MESSAGES, stream=True)  # type: ignore[arg-type]
    assert refused.value.body["code"] == "rate_limited"  # type: ignore[index]
    assert 1 <= int(refused.value.response.headers["retry-after"]) <= 60
    with pytest.raises(anthropic.RateLimitError) as in_shape:
        ant(gw, secret).messages.create(model="text", max_tokens=10, messages=MESSAGES)  # type: ignore[arg-type]
    assert in_shape.value.body["error"]["type"] == "rate_limit_error"  # type: ignore[index]
    assert int(in_shape.value.response.headers["retry-after"]) >= 1


def refusal_code(exc: openai.APIStatusError | anthropic.APIStatusError) -> str:
    """The gateway's error code of a refusal, in either SDK's shape (the Anthropic shape
    carries it as ``code: message``)."""
    if isinstance(exc, openai.APIStatusError):
        return exc.body["code"]  # type: ignore[index,no-any-return]
    return exc.body["error"]["message"].split(":")[0]  # type: ignore[index,no-any-return]


#: What a burst on one key may be refused with: its budget, and the store's 2 s reservation
#: bound failing closed (503 key_store_unavailable: a busy machine, #39), never served past it.
BURST_REFUSALS = {(429, "budget_exceeded"), (503, "key_store_unavailable")}


def burst_refusal(exc: openai.APIStatusError | anthropic.APIStatusError,
                  allowed: set[tuple[int, str]] = BURST_REFUSALS) -> str:
    """The refusal's code, asserted to be one of ``allowed`` (status and code)."""
    code = refusal_code(exc)
    assert (exc.status_code, code) in allowed, (exc.status_code, exc.body)
    if code == "budget_exceeded":
        assert "daily budget" in str(exc)
    return code


def spend_to_refusal(clients: list[Any]) -> int:
    """After a burst that ended in store refusals alone (a busy machine): one request at a
    time until the budget refuses, round the given SDK clients; the tokens served meanwhile."""
    tokens = 0
    for i in range(50):
        client = clients[i % len(clients)]
        try:
            if isinstance(client, openai.OpenAI):
                usage = client.chat.completions.create(model="text", messages=MESSAGES, max_tokens=100).usage  # type: ignore[arg-type]
                tokens += usage.total_tokens  # type: ignore[union-attr]
            else:
                message = client.messages.create(model="text", max_tokens=100, messages=MESSAGES)
                tokens += message.usage.input_tokens + message.usage.output_tokens
        except (openai.APIStatusError, anthropic.APIStatusError) as exc:
            if burst_refusal(exc) == "budget_exceeded":
                return tokens
    pytest.fail("the daily budget never refused")


def test_fifty_concurrent_requests_never_serve_more_than_the_daily_budget(gw: Gateway) -> None:
    key = create_key(gw, name="budget", daily_tokens=1000)
    secret = key["key"]
    served: list[int] = []
    refused: list[str] = []
    lock = threading.Lock()
    start = threading.Barrier(50)

    def one(i: int) -> None:
        start.wait()
        try:
            if i % 2:
                stream = oai(gw, secret).chat.completions.create(
                    model="text", messages=MESSAGES, max_tokens=100, stream=True, stream_options={"include_usage": True})  # type: ignore[arg-type]
                usage = [c.usage for c in stream if c.usage][-1]
                tokens = usage.total_tokens
            else:
                message = ant(gw, secret).messages.create(model="text", max_tokens=100, messages=MESSAGES)  # type: ignore[arg-type]
                tokens = message.usage.input_tokens + message.usage.output_tokens
            with lock:
                served.append(tokens)
        except (openai.APIStatusError, anthropic.APIStatusError) as exc:
            code = burst_refusal(exc)
            with lock:
                refused.append(code)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(50)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    # every request accounted for: served, or refused by the budget or (fail closed) the store
    assert len(served) + len(refused) == 50
    assert served and refused and set(refused) <= {code for _, code in BURST_REFUSALS}
    assert sum(served) <= 1000
    print(f"\nbudget 1000: served {len(served)} requests, {sum(served)} tokens; refused {len(refused)} "
          f"({ {code: refused.count(code) for code in sorted(set(refused))} })")
    # a late reservation (committed after its 503) is given back: usage is what was served
    wait_for(lambda: listed(gw)[key["id"]]["usage"]["tokens_today"] == sum(served), 30)
    rows = audit_rows(gw, 50, 30, key_id=key["id"])
    assert len(rows) == 50  # exactly one record each, refused ones included
    for code in set(refused):
        assert sum(r["outcome"] == "refused" and r["error_code"] == code for r in rows) == refused.count(code)
    if "budget_exceeded" not in refused:  # the store refused all the rest: the budget still ends it
        more = spend_to_refusal([oai(gw, secret), ant(gw, secret)])
        assert sum(served) + more <= 1000


def test_max_concurrent_and_an_unstated_max_tokens_gets_the_keys_cap(gw: Gateway, simulator: Simulator) -> None:
    secret = create_key(gw, name="one-at-a-time", max_concurrent=1, daily_tokens=100000, max_output_tokens=300)["key"]
    simulator.clear()
    slow = threading.Thread(target=lambda: oai(gw, secret).chat.completions.create(model="slow_first_byte", messages=MESSAGES))  # type: ignore[arg-type]
    slow.start()
    wait_for(lambda: any(r["path"].endswith("/chat/completions") for r in simulator.requests()))
    with pytest.raises(openai.RateLimitError) as refused:
        oai(gw, secret).chat.completions.create(model="text", messages=MESSAGES)  # type: ignore[arg-type]
    assert refused.value.body["code"] == "concurrency_limited"  # type: ignore[index]
    assert refused.value.response.headers["retry-after"] == "1"
    slow.join(20)
    assert oai(gw, secret).chat.completions.create(model="text", messages=MESSAGES).choices  # type: ignore[arg-type]
    bodies = [r["body"] for r in simulator.requests() if r["path"].endswith("/chat/completions")]
    assert [b.get("max_tokens") for b in bodies] == [300, 300]  # the reservation's cap, sent upstream


def test_revoked_and_expired_keys_are_401_over_http_and_websocket(gw: Gateway) -> None:
    key = create_key(gw, name="to-revoke")
    secret = key["key"]
    with open_ws(gw, Authorization=f"Bearer {secret}") as ws:
        assert exchange(ws, {"type": "response.create", "model": "text", "input": "hi"})[-1]["type"] == "response.completed"
        assert revoke(gw, key["id"]).status_code == 204
        refused = exchange(ws, {"type": "response.create", "model": "text", "input": "again"})[-1]
        assert refused["type"] == "error" and refused["status"] == 401
        assert refused["error"]["code"] == "invalid_api_key" and refused["error"]["message"] == "this API key was revoked"
    with pytest.raises(openai.AuthenticationError) as chat:
        oai(gw, secret).chat.completions.create(model="text", messages=MESSAGES)  # type: ignore[arg-type]
    assert chat.value.body["message"] == "this API key was revoked"  # type: ignore[index]
    with pytest.raises(anthropic.AuthenticationError):
        ant(gw, secret).messages.create(model="text", max_tokens=10, messages=MESSAGES)  # type: ignore[arg-type]
    from websockets.exceptions import InvalidStatus

    with pytest.raises(InvalidStatus) as upgrade:
        open_ws(gw, Authorization=f"Bearer {secret}")
    assert upgrade.value.response.status_code == 401
    expired = create_key(gw, name="expired", expires_at="2020-01-01T00:00:00Z")["key"]
    with pytest.raises(openai.AuthenticationError) as old:
        oai(gw, expired).responses.create(model="text", input="hi")
    assert old.value.body["message"] == "this API key has expired"  # type: ignore[index]
    with pytest.raises(openai.AuthenticationError):  # an unknown key of the managed shape
        oai(gw, "sk-cb2a-" + "x" * 43).chat.completions.create(model="text", messages=MESSAGES)  # type: ignore[arg-type]


def test_a_websocket_frame_outside_the_keys_models_is_its_403_event(gw: Gateway) -> None:
    secret = create_key(gw, name="ws-models", models=["text"])["key"]
    with open_ws(gw, **{"x-api-key": secret}) as ws:
        error = exchange(ws, {"type": "response.create", "model": "reasoning", "input": "hi"})[-1]
    assert error["type"] == "error" and error["status"] == 403 and error["error"]["code"] == "model_not_allowed"


def test_revoking_the_last_managed_key_does_not_open_the_gateway(server_loop: ServerLoop, simulator: Simulator,
                                                                  tmp_path_factory: pytest.TempPathFactory) -> None:
    gw = start_gateway(server_loop, simulator, tmp_path_factory)  # no --api-key: open
    assert client_auth(gw) == {"key_required": False, "locked": False, "static_keys": 0, "managed_keys": 0,
                               "usable_managed_keys": 0, "allow_open": False, "summary": "no client key (loopback bind only)"}
    assert httpx.post(gw.base_url + "/chat/completions", json={"model": "text", "messages": MESSAGES}).status_code == 200
    foreign = {"host": "gateway.example.com"}  # keyless: only loopback names (DNS rebinding)
    refused = httpx.post(gw.base_url + "/chat/completions", json={"model": "text", "messages": MESSAGES}, headers=foreign)
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "forbidden_host"
    key = create_key(gw, name="only")
    keyed = {**foreign, "authorization": f"Bearer {key['key']}"}  # a key is required now: any Host
    assert httpx.post(gw.base_url + "/chat/completions", json={"model": "text", "messages": MESSAGES}, headers=keyed).status_code == 200
    keyless = httpx.post(gw.base_url + "/chat/completions", json={"model": "text", "messages": MESSAGES})
    assert keyless.status_code == 401 and keyless.json()["error"]["code"] == "invalid_api_key"
    status = client_auth(gw)  # the status says so: the operator is not told "loopback bind only"
    assert status["key_required"] and not status["locked"]
    assert (status["managed_keys"], status["usable_managed_keys"], status["static_keys"]) == (1, 1, 0)
    assert status["summary"] == "1 managed key(s) (1 usable): every /v1 request needs a key, loopback too"
    revoke(gw, key["id"])
    assert httpx.post(gw.base_url + "/chat/completions", json={"model": "text", "messages": MESSAGES}).status_code == 401
    assert httpx.get(gw.base_url + "/models").status_code == 401
    status = client_auth(gw)  # every /v1 call is a 401 now: locked, and the way out named
    assert status["key_required"] and status["locked"] and status["usable_managed_keys"] == 0
    assert "none is usable" in status["summary"] and "Keys page" in status["summary"]


def client_auth(gw: Gateway) -> dict[str, Any]:
    response = httpx.get(gw.url + "/admin/api/status", headers=gw.admin)
    assert response.status_code == 200
    return response.json()["client_auth"]  # type: ignore[no-any-return]


def test_a_key_with_limits_is_refused_when_the_store_cannot_answer(gw: Gateway) -> None:
    """Fail closed: the reservation is bounded; past it the request is a 503, not served."""
    limiter = gw.app.state.relay.limiter
    stalled = create_key(gw, name="store-stalls", rpm=100)
    secret = stalled["key"]
    unlimited = create_key(gw, name="store-stalls-free")["key"]
    db = gw.app.state.db
    original, limiter.reserve_timeout = limiter.reserve_timeout, 0.2
    locked = threading.Event()
    release = threading.Event()

    def hold() -> None:
        def stall(conn: Any) -> None:
            locked.set()
            release.wait(30)
        db.run(stall)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert locked.wait(30)
        started = time.monotonic()
        with pytest.raises(openai.InternalServerError) as refused:
            oai(gw, secret).chat.completions.create(model="text", messages=MESSAGES)  # type: ignore[arg-type]
        assert time.monotonic() - started < 25  # refused before the 30 s lock ends: it did not wait it out
        assert refused.value.status_code == 503 and refused.value.body["code"] == "key_store_unavailable"  # type: ignore[index]
        assert oai(gw, unlimited).chat.completions.create(model="text", messages=MESSAGES).choices  # type: ignore[arg-type]
    finally:
        release.set()
        holder.join()
        limiter.reserve_timeout = original
    # the late reservation committed after the refusal: given back, nothing stays held
    held = "SELECT COUNT(*), COALESCE(SUM(open), 0) FROM client_key_requests WHERE key_id = ?"
    wait_for(lambda: db.execute(held, (stalled["id"],))[0] == (1, 0), 30)


def test_relayed_routes_reserve_too_and_embeddings_get_no_output_cap(gw: Gateway, simulator: Simulator) -> None:
    key = create_key(gw, name="relayed", daily_tokens=100000, max_output_tokens=64)
    client = oai(gw, key["key"])
    simulator.clear()
    completion = client.completions.create(model="text", prompt="hello there")
    embedding = client.embeddings.create(model="text", input="hello", encoding_format="float")
    assert completion.choices and embedding.data
    bodies = {r["path"].rsplit("/", 1)[-1]: r["body"] for r in simulator.requests()}
    assert bodies["completions"]["max_tokens"] == 64 and "max_tokens" not in bodies["embeddings"]
    rows = audit_rows(gw, 2, key_id=key["id"])
    assert sorted(r["protocol"] for r in rows) == ["completions", "embeddings"]
    used = sum(r["usage"].get("prompt_tokens", 0) + r["usage"].get("completion_tokens", 0) for r in rows)
    wait_for(lambda: listed(gw)[key["id"]]["usage"] == {"requests_today": 2, "tokens_today": used})


def test_stored_responses_belong_to_the_managed_key_that_made_them(gw: Gateway) -> None:
    alice, bob = create_key(gw, name="owner-alice")["key"], create_key(gw, name="owner-bob")["key"]
    stored = oai(gw, alice).responses.create(model="text", input="hi")
    assert oai(gw, alice).responses.retrieve(stored.id).id == stored.id
    with pytest.raises(openai.NotFoundError):
        oai(gw, bob).responses.retrieve(stored.id)
    with pytest.raises(openai.BadRequestError) as other:
        oai(gw, bob).responses.create(model="text", input="more", previous_response_id=stored.id)
    assert other.value.body["code"] == "previous_response_not_found"  # type: ignore[index]
    follow = oai(gw, alice).responses.create(model="text", input="more", previous_response_id=stored.id)
    assert follow.status == "completed"


def test_over_tpm_is_429_and_the_window_never_holds_more_than_tpm(gw: Gateway) -> None:
    """Each request reserves its input bound (the messages' JSON bytes) + max_tokens, and
    is settled to its real usage: the minute admits requests until the next reservation
    would pass tpm."""
    key = create_key(gw, name="tpm300", tpm=300)
    client = oai(gw, key["key"])
    served: list[int] = []
    with pytest.raises(openai.RateLimitError) as refused:
        for _ in range(20):
            answer = client.chat.completions.create(model="text", messages=MESSAGES, max_tokens=100)  # type: ignore[arg-type]
            assert answer.usage is not None
            served.append(answer.usage.total_tokens)
    assert refused.value.body["code"] == "rate_limited" and "300 tokens per minute" in refused.value.message  # type: ignore[index]
    assert 1 <= int(refused.value.response.headers["retry-after"]) <= 60
    reservation = len(json.dumps(MESSAGES, separators=(",", ":"))) + 100
    assert sum(served) <= 300 < sum(served) + reservation  # refused exactly when it would not fit


def test_the_secret_is_stored_hashed_and_never_logged(gw: Gateway, caplog: pytest.LogCaptureFixture) -> None:
    import hashlib
    import logging

    with caplog.at_level(logging.INFO):
        key = create_key(gw, name="never-logged", rpm=1)
        secret = key["key"]
        assert oai(gw, secret).chat.completions.create(model="text", messages=MESSAGES).choices  # type: ignore[arg-type]
        with pytest.raises(openai.RateLimitError):
            oai(gw, secret).chat.completions.create(model="text", messages=MESSAGES)  # type: ignore[arg-type]
        revoke(gw, key["id"])
        with pytest.raises(openai.AuthenticationError):
            oai(gw, secret).chat.completions.create(model="text", messages=MESSAGES)  # type: ignore[arg-type]
        rows = audit_rows(gw, 3, key_id=key["id"])
    assert sorted((r["outcome"], r["error_code"] or "") for r in rows) == [
        ("refused", "invalid_api_key"), ("refused", "rate_limited"), ("success", "")]  # the revoked key is named too
    lines = [r.getMessage() for r in caplog.records]
    events = [r.msg for r in caplog.records if isinstance(r.msg, dict) and r.msg.get("event") == "request"]
    assert sum(e.get("key_id") == key["id"] for e in events) == 3  # served, rate-limited, refused as revoked
    assert not [line for line in lines if secret in line or secret[12:] in line]
    rows = gw.app.state.db.execute("SELECT * FROM client_keys WHERE key_id = ?", (key["id"],))
    stored = " ".join(str(v) for v in rows[0])
    assert secret not in stored and secret[12:] not in stored
    assert hashlib.sha256(secret.encode()).hexdigest() in stored
