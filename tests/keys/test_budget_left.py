"""``codebuddy2api_key_budget_left{key, budget}`` (issue #38): what is left of each managed
key's budgets (daily_tokens, budget_tokens, budget_cost), read from the store after each
settlement and when the keys change; one series per active key and budget (a revoked key or
a removed budget drops its series). Also ``budget_left`` in ``GET /admin/api/keys``."""

from __future__ import annotations

import httpx
import openai
import pytest

from gateway.keys.budget_left import left_of
from gateway.keys.model import KeyLimits, ManagedKey
from gateway.keys.quota import Counts
from gateway.observability.pricing import cost
from gateway.upstream.config_file import ModelPrice
from tests.conftest import Gateway, ServerLoop, Simulator, wait_for
from tests.keys.priced import priced_gateway
from tests.keys.test_keys import create_key, listed, revoke
from tests.observability.test_audit import audit_rows, scrape

METRIC = "codebuddy2api_key_budget_left"
PRICE = ModelPrice(input=3.0, output=15.0)


def test_left_of_each_budget_never_below_zero() -> None:
    key = ManagedKey("key_1", "k", "p", "h", KeyLimits(daily_tokens=1_000, budget_tokens=5_000, budget_cost=2.0), 0.0)
    assert left_of(key, Counts(0.0, day_tokens=300, period_tokens=1_200, period_cost=500_000_000)) == {
        "daily_tokens": 700, "budget_tokens": 3_800, "budget_cost": 1.5}
    assert left_of(key, Counts(0.0, day_tokens=2_000, period_tokens=9_000, period_cost=3 * 10**9)) == {
        "daily_tokens": 0, "budget_tokens": 0, "budget_cost": 0.0}
    assert left_of(ManagedKey("key_2", "n", "p", "h", KeyLimits(rpm=5), 0.0), Counts(0.0)) == {}


@pytest.fixture(scope="module")
def priced(server_loop: ServerLoop, simulator: Simulator, tmp_path_factory: pytest.TempPathFactory) -> Gateway:
    return priced_gateway(server_loop, simulator, tmp_path_factory)


def left(gw: Gateway, name: str) -> dict[str, float]:
    return {labels["budget"]: value for labels, value in scrape(gw.url).get(METRIC, []) if labels["key"] == name}


def test_the_gauge_follows_settlements_changes_and_revocation(priced: Gateway) -> None:
    key = create_key(priced, name="left-team", daily_tokens=100_000, budget_tokens=1_000_000, budget_cost=2,
                     budget_period="month")
    plain = create_key(priced, name="left-plain", rpm=100)
    wait_for(lambda: left(priced, "left-team") == {"daily_tokens": 100_000, "budget_tokens": 1_000_000, "budget_cost": 2.0})
    assert left(priced, "left-plain") == {}  # no budget, no series

    client = openai.OpenAI(base_url=priced.base_url, api_key=key["key"], max_retries=0, _strict_response_validation=True)
    spent_tokens = 0
    for _ in range(2):
        with client.chat.completions.stream(model="text", messages=[{"role": "user", "content": "how much is left"}],
                                            stream_options={"include_usage": True}) as events:
            answer = events.get_final_completion()
        assert answer.usage is not None and answer.choices[0].message.content
        spent_tokens += answer.usage.total_tokens
    rows = audit_rows(priced, 2, key_id=key["id"])
    spent_money = sum(cost(r["usage"], PRICE) or 0 for r in rows)
    assert spent_money > 0
    expected = {"daily_tokens": 100_000 - spent_tokens, "budget_tokens": 1_000_000 - spent_tokens,
                "budget_cost": pytest.approx(2 - spent_money, abs=1e-9)}
    wait_for(lambda: left(priced, "left-team") == expected)  # settled: the holds are gone, the real usage counted

    # the admin list says the same
    assert listed(priced)[key["id"]]["budget_left"] == {"daily_tokens": 100_000 - spent_tokens, "tokens": 1_000_000 - spent_tokens,
                                    "cost": pytest.approx(2 - spent_money, abs=1e-9)}
    assert "budget_left" not in listed(priced)[plain["id"]]

    # a budget removed drops its series; a revoked key drops them all
    changed = httpx.patch(f"{priced.url}/admin/api/keys/{key['id']}", json={"budget_tokens": None}, headers=priced.admin)
    assert changed.status_code == 200
    wait_for(lambda: set(left(priced, "left-team")) == {"daily_tokens", "budget_cost"})
    assert revoke(priced, key["id"]).status_code == 204
    wait_for(lambda: left(priced, "left-team") == {})
