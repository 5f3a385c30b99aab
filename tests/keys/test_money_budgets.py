"""Budgets in money (issue #38): a managed key's ``budget_cost`` per ``budget_period``, priced
from the ``price`` tables of ``--config``. A request reserves its token reservation priced
at its model's price (a cap it did not name lowered to what the money left holds), is
settled to its real cost, and is refused with 429 ``budget_exceeded`` naming the money
limit once the period's spend leaves no room; a model without a price is refused for such a
key (403 ``model_not_priced``): counted as free it would spend without limit."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from gateway.keys import store as key_store
from gateway.keys.model import InvalidField, KeyLimits, ManagedKey, limits_from
from gateway.keys.periods import seconds_to_period_end
from gateway.keys.quota import Ask, Counts, Grant, Rates, Refusal, decide
from gateway.observability.pricing import cost
from gateway.upstream.config_file import ModelPrice
from tests.conftest import Gateway, ServerLoop, Simulator, start_gateway, wait_for
from tests.keys.priced import priced_gateway
from tests.keys.test_keys import create_key
from tests.observability.test_audit import audit_rows

PRICE = ModelPrice(input=3.0, output=15.0)  # per million tokens
RATES = Rates.of(3.0, 15.0)  # 3,000 and 15,000 nano-units per token
MESSAGES = [{"role": "user", "content": "what does this cost"}]
NOW = 1_796_000_000.0  # 2026-11-30 (a Monday) 08:53 UTC


# -- the decision (pure) ---------------------------------------------------------------------


def test_rates_are_nano_units_per_token_rounded_up() -> None:
    assert (RATES.input, RATES.output) == (3_000, 15_000)
    assert Rates.of(0.0375, 0.0) == Rates(38, 0)  # never held below what a token can cost


def test_a_flexible_cap_is_lowered_to_what_the_money_left_holds() -> None:
    limits = KeyLimits(budget_cost=0.001)  # 1,000,000 nano-units a day
    ask = Ask(input_tokens=100, cap=4096, flexible=True, rates=RATES)
    grant = decide(limits, Counts(NOW, period_cost=400_000), ask)
    assert isinstance(grant, Grant)
    # 600,000 left - 100 x 3,000 input = 300,000 for output: 20 tokens at 15,000
    assert (grant.cap, grant.cost, grant.tokens) == (20, 100 * 3_000 + 20 * 15_000, 120)


def test_a_named_cap_that_does_not_fit_is_refused_naming_the_money_limit() -> None:
    limits = KeyLimits(budget_cost=0.001, budget_period="week")
    refused = decide(limits, Counts(NOW, period_cost=400_000), Ask(input_tokens=100, cap=40, rates=RATES))
    assert isinstance(refused, Refusal) and refused.code == "budget_exceeded"
    assert refused.message.startswith("this API key's budget of 0.001 per week (since 2026-11-30, budget_cost)")
    assert "cannot hold this request's 0.0009 (spent or held: 0.0004)" in refused.message
    assert refused.message.endswith("send max_tokens <= 20")
    assert refused.retry_after == seconds_to_period_end(NOW, "week")  # the request fits an empty week

    too_big = decide(limits, Counts(NOW), Ask(input_tokens=1_000, cap=10, rates=RATES))  # 0.00315 > 0.001 itself
    assert isinstance(too_big, Refusal) and too_big.retry_after is None
    assert too_big.message.endswith("waiting will not help")


def test_tokens_and_money_both_hold() -> None:
    limits = KeyLimits(budget_tokens=1_000, budget_cost=1.0)
    ask = Ask(input_tokens=100, cap=4096, flexible=True, rates=RATES)
    grant = decide(limits, Counts(NOW), ask)
    assert isinstance(grant, Grant) and grant.cap == 900  # tokens are tighter here
    grant = decide(KeyLimits(budget_tokens=10_000, budget_cost=0.0033), Counts(NOW), ask)
    assert isinstance(grant, Grant) and grant.cap == 200  # money is: (3,300,000 - 300,000) / 15,000


def test_limits_validate_budget_cost() -> None:
    limits = limits_from({"budget_cost": 25, "budget_period": "month"})
    assert (limits.budget_cost, limits.counted, limits.token_limited) == (25.0, True, True)
    assert limits_from({"rpm": 3}, limits).budget_cost == 25.0  # a change keeps what it does not name
    assert limits_from({"budget_cost": None}, limits).budget_cost is None
    for bad in ("25", True, -1, float("inf"), 10**10, [1]):
        with pytest.raises(InvalidField) as caught:
            limits_from({"budget_cost": bad})
        assert caught.value.param == "budget_cost", bad


# -- the store: reserve priced, settle to the cost ---------------------------------------------


@pytest.fixture(params=["sqlite", "postgres"])
def db(request: pytest.FixtureRequest, tmp_path: Path):  # type: ignore[no-untyped-def]
    from gateway.store.db import open_database

    url = request.getfixturevalue("postgres_schema") if request.param == "postgres" else None
    database = open_database(url, tmp_path)
    yield database
    database.close()


def test_the_store_holds_the_priced_reservation_and_settles_to_the_cost(db: Any) -> None:
    key = ManagedKey("key_money", "money", "sk-cb2a-xxxx", "h", KeyLimits(budget_cost=0.001, budget_period="month"),
                     time.time())
    key_store.insert(db, key)
    ask = Ask(input_tokens=100, cap=4096, flexible=True, rates=RATES)
    first = key_store.admit(db, key, "r1", ask)
    assert isinstance(first, Grant) and first.cap == (1_000_000 - 300_000) // 15_000  # 46: all the money left
    second = key_store.admit(db, key, "r2", ask)  # the first one's hold leaves 10,000: not one output token
    assert isinstance(second, Refusal) and "budget_cost" in second.message
    assert key_store.settle(db, "r1", 130, 450_000) is True  # it really cost 0.00045
    third = key_store.admit(db, key, "r3", ask)
    assert isinstance(third, Grant) and third.cap == (550_000 - 300_000) // 15_000
    assert key_store.settle(db, "r3", 50, None) is True  # no cost known: what it held stays spent
    refused = key_store.admit(db, key, "r4", ask)
    assert isinstance(refused, Refusal) and "(spent or held: 0.00099)" in refused.message
    spent = db.execute("SELECT SUM(cost_nanos) FROM client_key_usage WHERE key_id = 'key_money'")[0][0]
    assert int(spent) == 450_000 + third.cost


def test_settlements_journaled_before_money_budgets_replay(db: Any) -> None:
    """A spill journal written by the version before (rows without a cost) replays: the
    tokens settle, what the reservation held in money stays spent (the safe side)."""
    key = ManagedKey("key_old", "old", "sk-cb2a-yyyy", "h", KeyLimits(budget_cost=1.0), time.time())
    key_store.insert(db, key)
    grant = key_store.admit(db, key, "old-1", Ask(input_tokens=10, cap=10, rates=RATES))
    assert isinstance(grant, Grant) and grant.cost == 10 * 3_000 + 10 * 15_000
    settle_rows = key_store.statements(db)[key_store.SETTLE_KIND]
    db.run_tx(lambda conn: settle_rows(conn, [("old-1", 12)]))  # (request_id, used): no cost
    row = db.execute("SELECT tokens, cost_nanos FROM client_key_usage WHERE key_id = 'key_old'")[0]
    assert (int(row[0]), int(row[1])) == (12, grant.cost)
    grant = key_store.admit(db, key, "new-1", Ask(input_tokens=10, cap=10, rates=RATES))
    assert isinstance(grant, Grant)
    db.run_tx(lambda conn: settle_rows(conn, [("new-1", 15, 7_000)]))  # (request_id, used, cost)
    row = db.execute("SELECT tokens, cost_nanos FROM client_key_usage WHERE key_id = 'key_old'")[0]
    assert (int(row[0]), int(row[1])) == (27, 180_000 + 7_000)


# -- through the gateway, with the official SDKs ------------------------------------------------


@pytest.fixture(scope="module")
def priced(server_loop: ServerLoop, simulator: Simulator, tmp_path_factory: pytest.TempPathFactory) -> Gateway:
    return priced_gateway(server_loop, simulator, tmp_path_factory)


def test_a_money_budget_serves_until_spent_then_refuses_naming_it(priced: Gateway) -> None:
    budget = 0.002
    key = create_key(priced, name="money-month", budget_cost=budget, budget_period="month")
    assert (key["budget_cost"], key["budget_period"]) == (budget, "month")
    client = openai.OpenAI(base_url=priced.base_url, api_key=key["key"], max_retries=0, _strict_response_validation=True)
    served = 0
    with pytest.raises(openai.RateLimitError) as caught:
        for _ in range(20):
            # a cap the answer stays under (the simulator's chat answers ignore max_tokens;
            # an engine stops at it, so the hold is an upper bound of the cost either way)
            with client.chat.completions.stream(model="text", messages=MESSAGES, max_tokens=40,  # type: ignore[arg-type]
                                                stream_options={"include_usage": True}) as events:
                answer = events.get_final_completion()
            assert answer.choices[0].message.content and answer.usage is not None
            served += 1
    refusal = caught.value
    assert refusal.status_code == 429 and refusal.code == "budget_exceeded"
    assert f"budget of {budget:g} per month" in refusal.message and "budget_cost" in refusal.message
    assert int(refusal.response.headers["retry-after"]) == pytest.approx(seconds_to_period_end(time.time(), "month"), abs=5)
    assert served >= 1

    wait_for(lambda: len(audit_rows(priced, served + 1, key_id=key["id"])) == served + 1)
    rows = audit_rows(priced, served + 1, key_id=key["id"])
    spent = sum(r["cost"] or 0 for r in rows)
    assert all(r["cost"] == pytest.approx(cost(r["usage"], PRICE)) for r in rows if r["outcome"] == "success")
    assert 0 < spent <= budget, [(r["usage"], r["cost"]) for r in rows]  # never past the money limit
    assert spent + 40 * 15.0 / 1e6 > budget  # refused only when the next one's hold did not fit
    # what the store counts for the period is what the records cost (settled, not held)
    usage = httpx.get(f"{priced.url}/admin/api/keys/{key['id']}/usage", headers=priced.admin).json()
    assert usage["total"]["cost"] == pytest.approx(spent)

    # the Anthropic shape refuses the same way
    messages = anthropic.Anthropic(base_url=priced.url, api_key=key["key"], max_retries=0, _strict_response_validation=True)
    with pytest.raises(anthropic.RateLimitError) as refused:
        messages.messages.create(model="text", max_tokens=50, messages=MESSAGES)  # type: ignore[arg-type]
    assert refused.value.body["error"]["type"] == "rate_limit_error"  # type: ignore[index]
    assert "budget_cost" in refused.value.body["error"]["message"]  # type: ignore[index]


def test_a_model_without_a_price_is_refused_under_a_money_budget(priced: Gateway) -> None:
    key = create_key(priced, name="money-unpriced", budget_cost=5)
    client = openai.OpenAI(base_url=priced.base_url, api_key=key["key"], max_retries=0, _strict_response_validation=True)
    with pytest.raises(openai.PermissionDeniedError) as caught:
        client.chat.completions.create(model="echo", messages=MESSAGES)  # type: ignore[arg-type]
    assert caught.value.code == "model_not_priced" and "'echo' has no price" in caught.value.message
    assert caught.value.param == "model"
    answer = client.chat.completions.create(model="text", messages=MESSAGES)  # type: ignore[arg-type]
    assert answer.choices[0].message.content  # the priced one is served


def test_the_admin_api_validates_budget_cost(priced: Gateway, server_loop: ServerLoop, simulator: Simulator,
                                             tmp_path_factory: pytest.TempPathFactory) -> None:
    url = priced.url + "/admin/api/keys"
    for bad in ("ten", -1, True, 10**10):
        refused = httpx.post(url, json={"name": "bad-money", "budget_cost": bad}, headers=priced.admin)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "budget_cost", bad
    key = create_key(priced, name="patched-money")
    changed = httpx.patch(f"{url}/{key['id']}", json={"budget_cost": 2.5, "budget_period": "week"}, headers=priced.admin)
    assert changed.status_code == 200 and (changed.json()["budget_cost"], changed.json()["budget_period"]) == (2.5, "week")
    refused = httpx.patch(f"{url}/{key['id']}", json={"budget_cost": "2.5"}, headers=priced.admin)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "budget_cost"

    unpriced = start_gateway(server_loop, simulator, tmp_path_factory)  # no price table at all
    refused = httpx.post(unpriced.url + "/admin/api/keys", json={"name": "m", "budget_cost": 1}, headers=unpriced.admin)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "budget_cost"
    assert "needs prices" in refused.json()["error"]["message"]
