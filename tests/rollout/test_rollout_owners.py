"""Rollouts belong to the client key that made them (issue #36, gateway/rollout/owners.py):
another managed key's call with the same rollout id is a 403 before anything is recorded,
read or sent upstream (never a write into the rollout, never a token-in continuation of
its sampled tokens); the admin read-back names the owning key; a deleted id is 410
``rollout_deleted`` for the grace period. Through the official SDKs, against the
simulator's vLLM token-in endpoints, both stream modes."""

from __future__ import annotations

import secrets
from typing import Any

import anthropic
import httpx
import openai
import pytest

from gateway.rollout import owners
from gateway.store.db import open_database
from tests.conftest import Gateway, ServerLoop, Simulator, start_gateway
from tests.keys.test_keys import create_key
from tests.upstream.test_token_in import CHAT_TOOLS, PLAN, engine_requests, read_back

MODES = ["compatible", "realtime"]


@pytest.fixture(scope="module", params=MODES)
def gw(request: pytest.FixtureRequest, server_loop: ServerLoop, simulator: Simulator,
       tmp_path_factory: pytest.TempPathFactory) -> Gateway:
    return start_gateway(server_loop, simulator, tmp_path_factory, stream_mode=request.param, token_in="vllm")


def client(gw: Gateway, secret: str, rollout: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gw.url}/rollouts/{rollout}/v1", api_key=secret,
                         _strict_response_validation=True, max_retries=0)


def turn(oai: openai.OpenAI, messages: list[dict[str, Any]]) -> Any:
    with oai.chat.completions.stream(model="agent;chunk=7", messages=messages, tools=CHAT_TOOLS) as s:  # type: ignore[arg-type]
        for _ in s:
            pass
        return s.get_final_completion().choices[0].message


def test_another_keys_call_cannot_write_into_or_continue_a_rollout(gw: Gateway, simulator: Simulator) -> None:
    alice = create_key(gw, name="alice-" + secrets.token_hex(3), daily_tokens=10**6)
    bob = create_key(gw, name="bob-" + secrets.token_hex(3))
    rollout, nonce = f"own.{secrets.token_hex(4)}", secrets.token_hex(6)
    messages: list[dict[str, Any]] = [{"role": "user", "content": f"{nonce}: {PLAN}"}]
    message = turn(client(gw, alice["key"], rollout), messages)
    messages.append(message.model_dump(exclude_none=True, exclude={"parsed"}))
    for call in message.tool_calls or []:
        messages.append({"role": "tool", "tool_call_id": call.id, "content": f"{call.function.name} says 18 C"})
    sent_before = len(engine_requests(simulator, nonce))
    # Bob sends the exact continuation of Alice's call, under her rollout id: refused, in every shape
    with pytest.raises(openai.PermissionDeniedError) as refused:
        turn(client(gw, bob["key"], rollout), messages)
    assert refused.value.body["code"] == "rollout_forbidden" and refused.value.body["param"] == "rollout_id"  # type: ignore[index]
    with pytest.raises(anthropic.PermissionDeniedError) as in_shape:
        anthropic.Anthropic(base_url=f"{gw.url}/rollouts/{rollout}", api_key=bob["key"], max_retries=0,
                            _strict_response_validation=True).messages.create(
            model="text", max_tokens=32, messages=[{"role": "user", "content": "hi"}])
    assert "another client key" in in_shape.value.message
    assert len(engine_requests(simulator, nonce)) == sent_before  # nothing of Bob's went upstream
    snap = read_back(gw, rollout)
    assert len(snap["calls"]) == 1 and snap["owner"] == "key:" + alice["id"] and snap["owner_key_id"] == alice["id"]
    # Alice's next call is still the exact continuation of her first, and goes token-in
    second = turn(client(gw, alice["key"], rollout), messages)
    assert second.tool_calls and second.tool_calls[0].function.name == "get_time"
    calls = read_back(gw, rollout)["calls"]
    assert [c["token_in"]["status"] for c in calls] == ["skipped: first_turn", "used"]
    engine = engine_requests(simulator, nonce)[-1]  # the token-id request carries the key's cap too
    assert engine["path"] == "/v1/completions" and engine["body"]["max_tokens"] == 4096
    assert calls[1]["continuity"] == {"previous_call_id": calls[0]["call_id"], "prefix": "exact", "diverged_at": None}
    [segment] = read_back(gw, rollout, "/trajectory")["segments"]
    assert segment["call_ids"] == [c["call_id"] for c in calls]
    listed = httpx.get(gw.url + "/admin/api/rollouts", headers=gw.admin).json()["rollouts"]
    assert [r["owner_key_id"] for r in listed if r["rollout_id"] == rollout] == [alice["id"]]


def test_a_deleted_rollout_id_is_410_for_its_grace_period(gw: Gateway) -> None:
    alice = create_key(gw, name="alice-del-" + secrets.token_hex(3))
    bob = create_key(gw, name="bob-del-" + secrets.token_hex(3))
    rollout = f"del.{secrets.token_hex(4)}"
    hi = [{"role": "user", "content": "hi"}]
    assert client(gw, alice["key"], rollout).chat.completions.create(model="text", messages=hi).choices  # type: ignore[arg-type]
    assert httpx.post(f"{gw.url}/admin/api/rollouts/{rollout}/freeze", json={}, headers=gw.admin).status_code == 200
    assert httpx.request("DELETE", f"{gw.url}/admin/api/rollouts/{rollout}", json={}, headers=gw.admin).status_code == 204
    for secret in (alice["key"], bob["key"]):  # neither the owner nor anyone else starts it again
        with pytest.raises(openai.APIStatusError) as gone:
            client(gw, secret, rollout).chat.completions.create(model="text", messages=hi)  # type: ignore[arg-type]
        assert gone.value.status_code == 410 and gone.value.body["code"] == "rollout_deleted"  # type: ignore[index]
    assert httpx.get(f"{gw.url}/admin/api/rollouts/{rollout}", headers=gw.admin).status_code == 404


def test_claims_on_the_store_first_wins_and_the_grace_ends(tmp_path: Any) -> None:
    db = open_database(None, tmp_path)
    try:
        assert owners.claim(db, "r1", "key:a", 1000.0) is None
        assert owners.claim(db, "r1", "key:a", 1001.0) is None
        taken = owners.claim(db, "r1", "key:b", 1002.0)
        assert taken is not None and (taken.status, taken.code) == (403, "rollout_forbidden")
        db.run_tx(lambda conn: owners.mark_deleted(conn, "r1", 2000.0))
        during = owners.claim(db, "r1", "key:a", 2000.0 + owners.DELETED_GRACE - 1)
        assert during is not None and (during.status, during.code) == (410, "rollout_deleted")
        assert owners.claim(db, "r1", "key:b", 2000.0 + owners.DELETED_GRACE) is None  # a new rollout now: Bob's
        assert db.run(lambda conn: owners.owner_of(conn, "r1")) == "key:b"
    finally:
        db.close()


async def test_a_claim_in_a_store_outage_falls_back_to_what_this_process_claimed() -> None:
    """The owner of a rollout never changes: one this process saw claimed goes on for its
    owner while the store does not answer (rollout calls flow through an outage); another
    identity is still refused; a rollout never seen is a 503 (fail closed)."""
    from gateway.errors import GatewayError
    from gateway.rollout.owners import OwnerClaims

    class FlakyStore:
        errors: tuple[type[BaseException], ...] = (ConnectionError,)
        down = False

        async def acall(self, fn: Any, *args: Any) -> Any:
            if self.down:
                raise ConnectionError("store is down")
            return None  # the claim is granted

    store = FlakyStore()
    rec = OwnerClaims(store)  # type: ignore[arg-type]
    await rec.claim("r1", "key:a")
    store.down = True
    await rec.claim("r1", "key:a")  # from memory
    with pytest.raises(GatewayError) as other:
        await rec.claim("r1", "key:b")
    assert (other.value.status, other.value.code) == (403, "rollout_forbidden")
    with pytest.raises(GatewayError) as unseen:
        await rec.claim("r2", "key:a")
    assert (unseen.value.status, unseen.value.code) == (503, "store_unavailable")
    rec.forget("r1")  # deleted through this process: memory no longer vouches for it
    with pytest.raises(GatewayError) as forgotten:
        await rec.claim("r1", "key:a")
    assert forgotten.value.code == "store_unavailable"
