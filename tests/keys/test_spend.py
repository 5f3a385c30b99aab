"""Spend (issue #38): a price per model in ``--config`` makes each audit record carry its
``cost`` and ``codebuddy2api_cost_total`` count it; a managed key's requests, tokens and
cost over any window (``GET /admin/api/keys/{id}/usage``), revoked keys included, read from
the audit records on SQLite and PostgreSQL alike."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from gateway.generation.record import RequestRecord
from gateway.keys.usage_window import summarise
from gateway.observability.pricing import cost, price_of
from gateway.store import audit_queries
from gateway.store.audit import AuditWriter
from gateway.upstream.config_file import ModelEntry, ModelPrice
from tests.conftest import Gateway, ServerLoop, Simulator, wait_for
from tests.keys.priced import priced_gateway
from tests.keys.test_keys import create_key, revoke
from tests.observability.test_audit import audit_rows, scrape

PRICE = ModelPrice(input=3.0, cached_input=0.3, output=15.0)
MESSAGES = [{"role": "user", "content": "what does this cost"}]


def test_cost_prices_prompt_cached_and_output_tokens_per_million() -> None:
    usage = {"prompt_tokens": 1_000_000, "cached_tokens": 400_000, "completion_tokens": 200_000}
    assert cost(usage, PRICE) == pytest.approx(600_000 * 3 / 1e6 + 400_000 * 0.3 / 1e6 + 200_000 * 15 / 1e6)
    assert cost(usage, ModelPrice(input=2.0, output=4.0)) == pytest.approx(2.0 + 0.8)  # cached at the input price
    assert cost({"prompt_tokens": 10, "cached_tokens": 99}, PRICE) == pytest.approx(10 * 0.3 / 1e6)  # cached <= prompt
    assert cost(usage, None) is None and cost({}, PRICE) is None  # no price, no usage: no cost, not 0


def test_the_last_matching_table_with_a_price_wins() -> None:
    cheap, dear = ModelPrice(input=1, output=1), ModelPrice(input=9, output=9)
    entries = (("*", ModelEntry(price=cheap)), ("gpt-*", ModelEntry(price=dear)), ("gpt-4o", ModelEntry(max_input_tokens=5)))
    assert price_of("gpt-4o", entries) is dear and price_of("qwen", entries) is cheap
    assert price_of("qwen", entries[1:]) is None


def test_usage_windows_add_up_by_day_with_empty_days_kept() -> None:
    day = 86400.0
    since = 1_767_225_600.0  # 2026-01-01T00:00:00Z
    rows = [(since + 10, "success", 100, 20, 0, 0.5), (since + 20, "error", 5, None, None, None),
            (since + 2 * day + 5, "success", 50, 10, 40, 0.25)]
    out = summarise(rows, since, since + 3 * day, "day")
    assert out["total"] == {"requests": 3, "succeeded": 2, "input_tokens": 155, "output_tokens": 30,
                            "cached_tokens": 40, "cost": 0.75}
    assert [(d["day"], d["requests"], d["cost"]) for d in out["days"]] == [
        ("2026-01-01", 2, 0.5), ("2026-01-02", 0, None), ("2026-01-03", 1, 0.25)]
    assert "days" not in summarise(rows, since, since + 3 * day, "total")


@pytest.fixture(params=["sqlite", "postgres"])
def store(request: pytest.FixtureRequest, tmp_path: Path):  # type: ignore[no-untyped-def]
    from gateway.store.db import open_database

    url = request.getfixturevalue("postgres_schema") if request.param == "postgres" else None
    db = open_database(url, tmp_path)
    yield db
    db.close()


async def test_key_usage_rows_read_the_records_fields_on_both_backends(store: Any) -> None:
    writer = AuditWriter(store, flush_interval=0.01)
    await writer.start()
    now = time.time()
    for n, (key_id, usage, price) in enumerate([("k1", {"prompt_tokens": 7, "completion_tokens": 3, "cached_tokens": 2}, 0.01),
                                                 ("k1", {}, None), ("k10", {"prompt_tokens": 1}, 0.5)]):
        writer.submit(RequestRecord(request_id=f"r{n}", protocol="chat", started_at=now - n, model="m", outcome="success",
                                    key_id=key_id, usage=usage, cost=price))
    await writer.aclose()
    rows = sorted(await audit_queries.key_usage_rows(store, "k1", now - 60, now + 60), key=lambda r: -r[0])
    assert [tuple(r[1:]) for r in rows] == [("success", 7, 3, 2, 0.01), ("success", None, None, None, None)]


@pytest.fixture(scope="module")
def priced(server_loop: ServerLoop, simulator: Simulator, tmp_path_factory: pytest.TempPathFactory) -> Gateway:
    return priced_gateway(server_loop, simulator, tmp_path_factory, "{ input = 3.0, cached_input = 0.3, output = 15.0 }")


def test_each_record_carries_its_cost_and_the_metric_adds_them_up(priced: Gateway) -> None:
    key = create_key(priced, name="spender")
    client = openai.OpenAI(base_url=priced.base_url, api_key=key["key"], max_retries=0, _strict_response_validation=True)
    for _ in range(3):
        with client.chat.completions.stream(model="text", messages=MESSAGES) as events:  # type: ignore[arg-type]
            assert events.get_final_completion().choices[0].message.content
    unpriced = client.chat.completions.create(model="echo", messages=MESSAGES)  # type: ignore[arg-type]
    assert unpriced.choices[0].message.content
    rows = audit_rows(priced, 4, key_id=key["id"])
    assert len(rows) == 4
    for row in rows:
        if row["model"] == "text":
            assert row["usage"]["prompt_tokens"] > 0
            assert row["cost"] == pytest.approx(cost(row["usage"], PRICE)) and row["cost"] > 0
        else:
            assert row["cost"] is None  # no price for echo: no cost, not 0
    spent = sum(r["cost"] for r in rows if r["cost"])
    samples = scrape(priced.url)["codebuddy2api_cost_total"]
    # (the model label is bounded like every model label: a name is a label once seen often enough)
    assert sum(v for labels, v in samples if labels["key"] == "spender") == pytest.approx(spent)

    # the key's usage over a window: the same requests, tokens and cost, by UTC day
    usage = httpx.get(f"{priced.url}/admin/api/keys/{key['id']}/usage", params={"by": "day"}, headers=priced.admin)
    assert usage.status_code == 200, usage.text
    body = usage.json()
    assert body["total"]["requests"] == 4 and body["total"]["succeeded"] == 4
    assert body["total"]["input_tokens"] == sum(r["usage"]["prompt_tokens"] for r in rows)
    assert body["total"]["output_tokens"] == sum(r["usage"]["completion_tokens"] for r in rows)
    assert body["total"]["cost"] == pytest.approx(spent)
    assert len(body["days"]) in (30, 31) and sum(d["requests"] for d in body["days"]) == 4
    assert body["days"][-1]["day"] == time.strftime("%Y-%m-%d", time.gmtime())

    # revoked: its history stays readable
    assert revoke(priced, key["id"]).status_code == 204
    after = httpx.get(f"{priced.url}/admin/api/keys/{key['id']}/usage", headers=priced.admin).json()
    assert after["total"] == body["total"] and "days" not in after


def test_a_window_in_the_past_and_bad_parameters(priced: Gateway) -> None:
    key = create_key(priced, name="window")
    client = openai.OpenAI(base_url=priced.base_url, api_key=key["key"], max_retries=0)
    client.chat.completions.create(model="text", messages=MESSAGES)  # type: ignore[arg-type]
    wait_for(lambda: len(audit_rows(priced, 1, key_id=key["id"])) == 1)
    url = f"{priced.url}/admin/api/keys/{key['id']}/usage"
    old = httpx.get(url, params={"since": "2026-01-01T00:00:00Z", "until": "2026-01-02T00:00:00Z"}, headers=priced.admin).json()
    assert old["total"]["requests"] == 0 and old["total"]["cost"] is None
    for params, param in (({"by": "week"}, "by"), ({"limit": 5}, "limit"), ({"since": "yesterday"}, "since"),
                          ({"since": "2026-01-01T00:00:00"}, "since"), ({"since": "2020-01-01T00:00:00Z"}, "since")):
        refused = httpx.get(url, params=params, headers=priced.admin)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param, params
    missing = httpx.get(f"{priced.url}/admin/api/keys/key_nope/usage", headers=priced.admin)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "key_not_found"
