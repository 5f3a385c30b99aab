"""Audit records, metrics and request logs of real gateways after a mixed burst.

Every request is matched to its audit row by the ``x-request-id`` the client saw; the
row's outcome, error code and status must be exactly what happened on the wire, and the
Prometheus counters must agree with the audit table.
"""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json
import logging
import sqlite3
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.app import create_app
from gateway.generation.record import RequestRecord
from gateway.http.servers import bind_loopback, start_embedded, stop_embedded
from gateway.observability.logging import make_formatter
from gateway.settings import Settings
from gateway.store.audit import (
    AUDIT_UPSERT,
    AuditOverflow,
    AuditRetention,
    AuditWriter,
    cap_bodies,
)
from gateway.store.audit_queries import FILTER_COLUMNS as AUDIT_FILTER_COLUMNS
from gateway.store.audit_queries import percentile
from gateway.store.db import Database
from gateway.store.spill import DurableWriter, SpillJournal
from tests.conftest import Gateway, ServerLoop, Simulator, start_gateway, wait_for

USER = [{"role": "user", "content": "hi there"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
RECORD_FIELDS = {f.name for f in dataclasses.fields(RequestRecord)}
FROM_BODY = "<from body>"
VALIDATION_CODES = {"tool_call_invalid", "upstream_incomplete", "tool_identity_changed", "empty_response"}


@dataclasses.dataclass
class Sent:
    """One request as the client saw it, and what its audit row must say."""

    request_id: str
    outcome: str
    error_code: str | None
    status: int
    protocol: str = "chat"
    streamed: bool = True
    check: Callable[[dict[str, Any]], None] | None = None


# -- request helpers ---------------------------------------------------------------------


def post(gw: Gateway, path: str, body: Any, **expect: Any) -> Sent:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    with httpx.Client(timeout=20) as http:
        response = http.post(gw.url + path, content=content, headers={"content-type": "application/json"})
    streamed = isinstance(body, dict) and body.get("stream") is True
    if "text/event-stream" in response.headers.get("content-type", ""):
        assert response.text  # the whole stream was read
    if expect.get("error_code") == FROM_BODY:  # the code the client was told
        expect["error_code"] = response.json()["error"]["code"]
    return Sent(response.headers["x-request-id"], status=response.status_code, streamed=streamed, **expect)


def chat(gw: Gateway, model: str, stream: bool = True, **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": USER, "stream": stream, **extra}


def sdk_stream(gw: Gateway) -> Sent:
    """A streamed success through the openai SDK (strict); the row must carry its facts."""
    client = openai.OpenAI(base_url=gw.base_url, api_key="k", _strict_response_validation=True, max_retries=0)
    with client.chat.completions.with_streaming_response.create(
        model="echo", messages=USER, stream=True, stream_options={"include_usage": True}  # type: ignore[arg-type]
    ) as raw:
        request_id = raw.headers["x-request-id"]
        chunks = list(raw.parse())
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = next(c.usage for c in chunks if c.usage)
    assert text == "You said: hi there"

    def check(row: dict[str, Any]) -> None:
        assert row["output_bytes"] == len(text.encode())
        assert row["finish_reason"] == "stop" and row["ttfb_ms"] is not None and row["ttfb_ms"] > 0
        assert row["usage"]["completion_tokens"] == usage.completion_tokens
        assert row["model"] == "echo" and row["upstream_attempts"][0]["status"] == 200

    return Sent(request_id, "success", None, 200, check=check)


def sdk_json(gw: Gateway) -> Sent:
    client = openai.OpenAI(base_url=gw.base_url, api_key="k", _strict_response_validation=True, max_retries=0)
    raw = client.chat.completions.with_raw_response.create(model="text", messages=USER)  # type: ignore[arg-type]
    completion = raw.parse()
    text = completion.choices[0].message.content or ""

    def check(row: dict[str, Any]) -> None:
        assert row["output_bytes"] == len(text.encode()) and row["ttfb_ms"] is None
        assert row["usage"]["prompt_tokens"] == completion.usage.prompt_tokens  # type: ignore[union-attr]

    return Sent(raw.headers["x-request-id"], "success", None, 200, streamed=False, check=check)


def disconnect(gw: Gateway, model: str = "large;first_chunk_delay=3") -> Sent:
    """Open a stream whose upstream answers (status committed) then stays silent for 3 s,
    and hang up once the status line is in.

    Not ``large;delay=0.01``: with chunks arriving while the client leaves, relay.py's
    ``asyncio.wait_for`` (Python 3.11) can swallow the cancellation and the record then
    says outcome=success + error_code=client_disconnected (reported to the lead)."""
    with httpx.Client(timeout=20) as http:
        with http.stream("POST", gw.url + "/v1/chat/completions", json=chat(gw, model)) as response:
            request_id = response.headers["x-request-id"]
            status = response.status_code
    return Sent(request_id, "cancelled", "client_disconnected", status)


def route_exists(gw: Gateway, path: str) -> bool:
    return httpx.get(gw.url + path).status_code == 405  # a GET probe leaves no audit row


#: The burst gateway's keepalive interval: far longer than an upstream error status takes
#: even on a loaded machine, so the 429s and 502s the burst asks for are HTTP statuses. At
#: the session's 0.5 s a keepalive could come first and (rightly) commit a 200 stream, the
#: error then going in-stream; only the ``ttfb`` job waits past it, to count a keepalive.
BURST_KEEPALIVE = 3.0


def burst(gw: Gateway) -> list[Callable[[], Sent]]:
    c = "/v1/chat/completions"
    jobs: list[Callable[[], Sent]] = [
        lambda: sdk_stream(gw),
        lambda: sdk_json(gw),
        lambda: post(gw, c, chat(gw, "reasoning"), outcome="success", error_code=None),
        lambda: post(gw, c, chat(gw, "tool", tools=TOOLS), outcome="success", error_code=None,
                     check=lambda r: r["tool_calls"] == 1 and r["finish_reason"] == "tool_calls" or _fail(r)),
        lambda: post(gw, c, chat(gw, "server_error"), outcome="error", error_code="upstream_error"),
        lambda: post(gw, c, chat(gw, "server_error", stream=False), outcome="error", error_code="upstream_error"),
        lambda: post(gw, c, chat(gw, "rate_limited"), outcome="error", error_code="upstream_rate_limited"),
        lambda: post(gw, c, b"{not json", outcome="invalid", error_code="invalid_json"),
        lambda: post(gw, c, {"model": "echo", "messages": "nope"}, outcome="invalid", error_code=FROM_BODY),
        lambda: post(gw, c, chat(gw, "error_frame"), outcome="error", error_code="upstream_error"),
        lambda: post(gw, c, chat(gw, "error_frame", stream=False), outcome="error", error_code="upstream_error"),
        lambda: post(gw, c, chat(gw, "no_finish"), outcome="error", error_code="upstream_incomplete"),
        lambda: post(gw, c, chat(gw, "invalid_json", tools=TOOLS), outcome="error", error_code="tool_call_invalid"),
        lambda: post(gw, c, chat(gw, f"echo;ttfb={BURST_KEEPALIVE + 0.5}"), outcome="success", error_code=None,
                     check=lambda r: r["keepalives"] >= 1 or _fail(r)),
        lambda: disconnect(gw),
        lambda: disconnect(gw),
    ]
    if route_exists(gw, "/v1/messages"):
        m = {"model": "echo", "max_tokens": 64, "messages": USER, "stream": True}
        jobs += [
            lambda: post(gw, "/v1/messages", m, outcome="success", error_code=None, protocol="messages"),
            lambda: post(gw, "/v1/messages", {**m, "model": "server_error"}, outcome="error",
                         error_code="upstream_error", protocol="messages"),
            lambda: post(gw, "/v1/messages", {**m, "stream": False}, outcome="success", error_code=None,
                         protocol="messages"),
        ]
    if route_exists(gw, "/v1/responses"):
        r = {"model": "echo", "input": "hi there", "stream": True}
        jobs += [
            lambda: post(gw, "/v1/responses", r, outcome="success", error_code=None, protocol="responses"),
            lambda: post(gw, "/v1/responses", {**r, "model": "error_frame"}, outcome="error",
                         error_code="upstream_error", protocol="responses"),
            lambda: post(gw, "/v1/responses", b"[]", outcome="invalid", error_code="invalid_json",
                         protocol="responses"),
        ]
    return jobs


def _fail(row: dict[str, Any]) -> bool:
    raise AssertionError(f"unexpected audit row {row}")


# -- admin/metrics helpers ---------------------------------------------------------------


def audit_rows(gw: Gateway, expected: int, timeout: float = 8.0, **params: Any) -> list[dict[str, Any]]:
    """Poll the admin API until ``expected`` rows are written (the writer is asynchronous)."""
    deadline = time.monotonic() + timeout
    while True:
        body = httpx.get(gw.url + "/admin/api/audit", params={"limit": 1000, **params}, headers=gw.admin).json()
        if body["total"] >= expected or time.monotonic() > deadline:
            return body["data"]  # type: ignore[no-any-return]
        time.sleep(0.02)


def scrape(url: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Sample name -> [(labels, value)] from /metrics."""
    response = httpx.get(url + "/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return out


def total(samples: dict[str, list[tuple[dict[str, str], float]]], name: str, **match: str) -> float:
    return sum(v for labels, v in samples.get(name, []) if all(labels.get(k) == x for k, x in match.items()))


# -- the burst, once per mode ------------------------------------------------------------


@dataclasses.dataclass
class BurstResult:
    gateway: Gateway
    sent: list[Sent]
    rows: dict[str, dict[str, Any]]


@pytest.fixture(scope="module", params=["compatible", "realtime"])
def burst_result(
    request: pytest.FixtureRequest, server_loop: ServerLoop, simulator: Simulator,
    tmp_path_factory: pytest.TempPathFactory,
) -> BurstResult:
    gw = start_gateway(server_loop, simulator, tmp_path_factory, stream_mode=request.param,
                       keepalive_interval=BURST_KEEPALIVE)
    jobs = burst(gw)
    with ThreadPoolExecutor(8) as pool:
        sent = list(pool.map(lambda job: job(), jobs))
    # an output-byte budget overflow (a saved settings change: bumps config_revision)
    gw.live.update({"max_collect_bytes": 2000})
    try:
        sent.append(post(gw, "/v1/chat/completions", chat(gw, "large"), outcome="error",
                         error_code="response_too_large",
                         check=lambda r: r["budget_exceeded"] is True or _fail(r)))
    finally:
        gw.live.update({"max_collect_bytes": 8 * 1024 * 1024})
    rows = audit_rows(gw, len(sent))
    return BurstResult(gw, sent, {row["request_id"]: row for row in rows})


def test_every_request_has_exactly_one_correct_audit_row(burst_result: BurstResult) -> None:
    sent, rows = burst_result.sent, burst_result.rows
    assert len(rows) == len(sent) == len({s.request_id for s in sent})
    mode = burst_result.gateway.live.current.stream_mode.value
    for s in sent:
        row = rows[s.request_id]
        assert RECORD_FIELDS <= set(row), RECORD_FIELDS - set(row)
        got = (row["outcome"], row["error_code"], row["http_status"], row["protocol"], row["streamed"])
        assert got == (s.outcome, s.error_code, s.status, s.protocol, s.streamed), json.dumps(row)
        assert row["mode"] == mode and row["bodies"] is None
        assert row["ended_at"] >= row["started_at"] and row["duration_ms"] >= 0
        if s.check is not None:
            s.check(row)
    statuses = {rows[s.request_id]["http_status"] for s in sent}
    assert {200, 400, 429, 502} <= statuses


def test_metrics_agree_with_the_audit_table(burst_result: BurstResult) -> None:
    gw, rows = burst_result.gateway, list(burst_result.rows.values())
    m = scrape(gw.url)
    by_outcome = Counter(r["outcome"] for r in rows)
    for outcome in ("success", "error", "cancelled", "invalid"):
        assert total(m, "codebuddy2api_requests_total", outcome=outcome) == by_outcome[outcome], outcome
    assert total(m, "codebuddy2api_requests_total") == len(rows)
    streamed = sum(1 for r in rows if r["streamed"])
    assert total(m, "codebuddy2api_requests_total", streamed="true") == streamed
    assert total(m, "codebuddy2api_in_flight_requests") == 0
    assert all(v == 0 for _, v in m["codebuddy2api_in_flight_requests"])
    assert total(m, "codebuddy2api_request_duration_seconds_count") == len(rows)
    assert total(m, "codebuddy2api_time_to_first_byte_seconds_count") == sum(r["ttfb_ms"] is not None for r in rows)
    assert total(m, "codebuddy2api_upstream_attempts_total") == sum(len(r["upstream_attempts"]) for r in rows)
    assert total(m, "codebuddy2api_upstream_attempts_total", status_class="4xx", outcome="error") == sum(
        r["error_code"] == "upstream_rate_limited" for r in rows
    )
    assert total(m, "codebuddy2api_keepalives_sent_total") == sum(r["keepalives"] for r in rows) > 0
    assert total(m, "codebuddy2api_budget_overflows_total") == sum(r["budget_exceeded"] for r in rows) == 1
    assert total(m, "codebuddy2api_relayed_output_bytes_total") == sum(r["output_bytes"] for r in rows)
    for code in VALIDATION_CODES:
        assert total(m, "codebuddy2api_terminal_validation_failures_total", reason=code) == sum(
            r["error_code"] == code for r in rows
        )
    assert total(m, "codebuddy2api_tool_repairs_total") == sum(len(r["repairs"]) for r in rows)
    assert total(m, "codebuddy2api_audit_dropped_total") == 0
    assert total(m, "codebuddy2api_audit_queue_depth") == 0
    assert total(m, "codebuddy2api_config_revision") == gw.live.revision == 2
    mode = gw.live.current.stream_mode.value
    assert total(m, "codebuddy2api_stream_mode", mode=mode) == 1
    assert total(m, "codebuddy2api_stream_mode") == 1


def test_admin_list_filters_and_pages_newest_first(burst_result: BurstResult) -> None:
    gw, rows = burst_result.gateway, burst_result.rows
    api = gw.url + "/admin/api/audit"
    admin = httpx.Client(headers=gw.admin)
    invalid = admin.get(api, params={"outcome": "invalid"}).json()
    assert invalid["total"] == sum(r["outcome"] == "invalid" for r in rows.values()) > 0
    assert {r["outcome"] for r in invalid["data"]} == {"invalid"}
    mode = gw.live.current.stream_mode.value
    assert admin.get(api, params={"mode": mode}).json()["total"] == len(rows)
    assert admin.get(api, params={"protocol": "chat", "model": "echo"}).json()["total"] == sum(
        r["protocol"] == "chat" and r["model"] == "echo" for r in rows.values()
    )
    page1 = admin.get(api, params={"limit": 5}).json()
    page2 = admin.get(api, params={"limit": 5, "offset": 5}).json()
    assert page1["has_more"] and len(page1["data"]) == len(page2["data"]) == 5
    listed = page1["data"] + page2["data"]
    assert len({r["request_id"] for r in listed}) == 10
    starts = [r["started_at"] for r in listed]
    assert starts == sorted(starts, reverse=True)
    newest = max(r["started_at"] for r in rows.values())
    assert page1["data"][0]["started_at"] == newest
    assert admin.get(api, params={"since": newest + 1}).json()["total"] == 0
    iso = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(newest + 3600))
    assert admin.get(api, params={"until": iso}).json()["total"] == len(rows)
    bad = admin.get(api, params={"limit": "lots"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "limit"
    assert admin.get(api, params={"since": "yesterday"}).json()["error"]["param"] == "since"


def test_admin_get_one_record(burst_result: BurstResult) -> None:
    gw = burst_result.gateway
    some = burst_result.sent[0].request_id
    response = httpx.get(f"{gw.url}/admin/api/audit/{some}", headers=gw.admin)
    assert response.status_code == 200 and response.json() == burst_result.rows[some]
    missing = httpx.get(gw.url + "/admin/api/audit/req_nope", headers=gw.admin)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "audit_not_found"


def test_admin_aggregate(burst_result: BurstResult) -> None:
    gw, rows = burst_result.gateway, list(burst_result.rows.values())
    agg = httpx.get(gw.url + "/admin/api/audit/aggregate", params={"window": 3600}, headers=gw.admin).json()
    by_outcome = Counter(r["outcome"] for r in rows)
    assert agg["requests"] == len(rows) and agg["by_outcome"] == dict(by_outcome)
    assert agg["error_rate"] == pytest.approx(by_outcome["error"] / len(rows))
    series = {(s["protocol"], s["mode"]): s for s in agg["by_protocol_mode"]}
    chat = series[("chat", gw.live.current.stream_mode.value)]
    ttfbs = sorted(r["ttfb_ms"] for r in rows if r["protocol"] == "chat" and r["ttfb_ms"] is not None)
    assert chat["ttfb_samples"] == len(ttfbs) > 0
    assert chat["ttfb_ms_p50"] == percentile(ttfbs, 50) and chat["ttfb_ms_p95"] == percentile(ttfbs, 95)
    assert chat["ttfb_ms_p50"] <= chat["ttfb_ms_p95"]
    assert sum(s["requests"] for s in series.values()) == len(rows)
    assert httpx.get(gw.url + "/admin/api/audit/aggregate", params={"window": 0}, headers=gw.admin).status_code == 400


def test_admin_export_streams_jsonl(burst_result: BurstResult) -> None:
    gw = burst_result.gateway
    with httpx.stream("GET", gw.url + "/admin/api/audit/export", headers=gw.admin) as response:
        assert response.headers["content-type"].startswith("application/x-ndjson")
        lines = [line for line in response.iter_lines() if line]
    exported = [json.loads(line) for line in lines]
    assert {r["request_id"] for r in exported} == set(burst_result.rows)
    assert [r["started_at"] for r in exported] == sorted(r["started_at"] for r in exported)
    newest = max(r["started_at"] for r in exported)
    later = httpx.get(gw.url + "/admin/api/audit/export", params={"since": newest}, headers=gw.admin)
    assert [json.loads(x)["started_at"] for x in later.text.splitlines()] == [newest]


def test_admin_export_honours_every_filter_the_list_does(burst_result: BurstResult) -> None:
    """For each filter the list takes, the export selects exactly the rows the list does
    (the issue: export?key_id= ignored the filter and returned every row)."""
    gw, rows = burst_result.gateway, list(burst_result.rows.values())
    first = rows[0]
    upstream = next(a["upstream"] for r in rows for a in r["upstream_attempts"] if a.get("upstream"))
    choices = {"outcome": "error", "protocol": "messages", "mode": first["mode"], "model": first["model"],
               "error_code": "response_too_large", "request_id": first["request_id"], "transport": "http",
               "upstream": upstream}
    assert set(choices) == {*AUDIT_FILTER_COLUMNS, "upstream"}  # key_id: tests/keys/test_keys.py
    for name, value in choices.items():
        listed = httpx.get(gw.url + "/admin/api/audit", params={name: value, "limit": 1000}, headers=gw.admin).json()
        exported = httpx.get(gw.url + "/admin/api/audit/export", params={name: value}, headers=gw.admin)
        ids = [json.loads(line)["request_id"] for line in exported.text.splitlines()]
        assert sorted(ids) == sorted(r["request_id"] for r in listed["data"]), name
        assert 0 < len(ids) and (len(ids) < len(rows) or name in ("mode", "transport")), (name, len(ids))  # every row: one mode, HTTP only
    both = {"protocol": "chat", "outcome": "error"}
    exported = httpx.get(gw.url + "/admin/api/audit/export", params=both, headers=gw.admin).text.splitlines()
    assert {(json.loads(x)["protocol"], json.loads(x)["outcome"]) for x in exported} == {("chat", "error")}


@pytest.mark.parametrize("path", ["/admin/api/audit", "/admin/api/audit/export"])
def test_admin_audit_refuses_unknown_parameters(burst_result: BurstResult, path: str) -> None:
    gw = burst_result.gateway
    refused = httpx.get(gw.url + path, params={"keyid": "k1"}, headers=gw.admin)  # a typo must not select everything
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", "invalid_parameter", "keyid")
    assert "key_id" in error["message"]
    paging = httpx.get(gw.url + "/admin/api/audit/export", params={"limit": 5}, headers=gw.admin)
    assert paging.status_code == 400 and paging.json()["error"]["param"] == "limit"  # the export has no pages


def test_admin_api_wants_the_token_even_from_loopback(burst_result: BurstResult) -> None:
    gateway = burst_result.gateway
    app = gateway.app

    async def call(host: str, headers: dict[str, str]) -> httpx.Response:
        transport = httpx.ASGITransport(app=app, client=(host, 4242))
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as http:
            return await http.get("/admin/api/audit/req_nope", headers=headers)

    for host in ("203.0.113.7", "127.0.0.1", "::1"):  # loopback is no credential (any web page reaches it)
        refused = asyncio.run(call(host, {}))
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "admin_login_required"
    assert asyncio.run(call("::1", gateway.admin)).status_code == 404  # the token gets through to the route


# -- shutdown, secrets, writer units -----------------------------------------------------


def test_graceful_shutdown_writes_every_queued_record(
    server_loop: ServerLoop, simulator: Simulator, tmp_path: Path
) -> None:
    settings = Settings(upstream_url=simulator.url + "/v1", data_dir=tmp_path, keepalive_interval=0.5)
    app = create_app(settings, {name: "default" for name in Settings.model_fields})  # type: ignore[arg-type]
    app.state.observability.audit.flush_interval = 30.0  # rows stay queued until shutdown
    sock = bind_loopback()
    server = server_loop.run(start_embedded(app, sock))
    gw = Gateway(f"http://127.0.0.1:{sock.getsockname()[1]}", app)
    jobs = [lambda i=i: post(gw, "/v1/chat/completions", chat(gw, "echo", stream=i % 2 == 0), outcome="success",
                             error_code=None) for i in range(16)]
    jobs += [lambda: post(gw, "/v1/chat/completions", b"{", outcome="invalid", error_code="invalid_json")] * 8
    with ThreadPoolExecutor(8) as pool:
        sent = list(pool.map(lambda job: job(), jobs))
    writer = app.state.observability.audit
    deadline = time.monotonic() + 5
    while writer.depth < len(sent) and time.monotonic() < deadline:  # the last on_finish may trail the client
        time.sleep(0.01)
    assert writer.depth == len(sent) and writer.written == 0  # everything still queued
    server_loop.run(stop_embedded(*server))
    with sqlite3.connect(tmp_path / "codebuddy2api.sqlite3") as conn:
        stored = dict(conn.execute("SELECT request_id, outcome FROM audit").fetchall())
    assert stored == {s.request_id: s.outcome for s in sent}
    assert app.state.observability.audit.dropped == 0


@pytest.fixture
def captured_logs() -> Iterator[io.StringIO]:
    """The JSON lines the gateway logs at info level, via the real formatter."""
    buffer = io.StringIO()
    handler = logging.StreamHandler(buffer)
    handler.setFormatter(make_formatter(json=True))
    root, access = logging.getLogger(), logging.getLogger("uvicorn.access")
    levels = root.level, access.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    access.setLevel(logging.INFO)
    propagate, access.propagate = access.propagate, True  # the test servers run without access logs
    try:
        yield buffer
    finally:
        root.removeHandler(handler)
        root.setLevel(levels[0])
        access.setLevel(levels[1])
        access.propagate = propagate


def test_secrets_never_reach_audit_metrics_or_logs(
    server_loop: ServerLoop, simulator: Simulator, tmp_path_factory: pytest.TempPathFactory,
    captured_logs: io.StringIO,
) -> None:
    secret, client_secret = "sk-secret-upstream-XYZ", "sk-client-secret-ABC"
    wrong = "sk-wrong-client-key-QQQ"
    gw = start_gateway(server_loop, simulator, tmp_path_factory, upstream_api_key=secret, api_key=[client_secret])
    access = logging.getLogger("uvicorn.access")  # the new server's uvicorn.Config reset it
    access.setLevel(logging.INFO)
    access.propagate = True
    simulator.clear()
    headers = {"authorization": f"Bearer {client_secret}", "x-api-key": client_secret}
    ids = []
    with httpx.Client(timeout=20, headers=headers) as http:
        for body in (chat(gw, "echo"), chat(gw, "echo", stream=False), chat(gw, "server_error"), b"{x"):
            content = body if isinstance(body, bytes) else json.dumps(body).encode()
            ids.append(http.post(gw.url + "/v1/chat/completions", content=content)
                       .headers["x-request-id"])
        refused = http.post(gw.url + "/v1/chat/completions", json=chat(gw, "echo"),
                            headers={"authorization": f"Bearer {wrong}", "x-api-key": wrong})
        assert refused.status_code == 401
        ids.append(refused.headers["x-request-id"])
    assert all(r["has_authorization"] for r in simulator.requests())  # the key was really in use
    logging.getLogger("uvicorn.access").info(
        '%s - "%s %s HTTP/%s" %d', "127.0.0.1:5555", "POST", f"/v1/chat/completions?key={client_secret}", "1.1", 200
    )
    rows = audit_rows(gw, len(ids))
    assert {r["request_id"] for r in rows} == set(ids)
    exported = httpx.get(gw.url + "/admin/api/audit/export", headers=gw.admin).text
    metrics = httpx.get(gw.url + "/metrics").text
    db_dir = gw.live.current.data_dir
    raw_db = b"".join(p.read_bytes() for p in db_dir.iterdir() if p.name.startswith("codebuddy2api.sqlite3"))
    logs = captured_logs.getvalue()
    for text in (json.dumps(rows), exported, metrics, logs, raw_db.decode("latin-1")):
        assert secret not in text and client_secret not in text and wrong not in text
    by_id = {r["request_id"]: r for r in rows}
    assert by_id[ids[-1]]["outcome"] == "refused" and by_id[ids[-1]]["http_status"] == 401
    prints = {by_id[i]["client_key_fingerprint"] for i in ids[:-1]}
    assert len(prints) == 1 and None not in prints  # the accepted key, only as a fingerprint
    lines = [json.loads(line) for line in logs.splitlines()]
    request_lines = {line["request_id"]: line for line in lines if line.get("event") == "request"}
    assert set(request_lines) >= set(ids)
    for request_id in ids:
        line = request_lines[request_id]
        assert {"protocol", "mode", "outcome", "status", "duration_ms", "ttfb_ms", "timestamp", "level"} <= set(line)
    access = [line for line in lines if line.get("logger") == "uvicorn.access"]
    manual = [line for line in access if line["client"] == "127.0.0.1:5555"]
    assert manual and manual[0]["path"] == "/v1/chat/completions" and manual[0]["status"] == 200
    assert {(x["method"], x["path"], x["status"]) for x in access} >= {  # uvicorn's own lines
        ("POST", "/v1/chat/completions", 400), ("GET", "/admin/api/audit/export", 200)
    }


def _record(request_id: str, **fields: Any) -> RequestRecord:
    return RequestRecord(request_id=request_id, protocol="chat", started_at=fields.pop("started_at", time.time()),
                         mode="compatible", model="echo", outcome="success", **fields)


async def test_writer_caps_bodies_only_when_enabled(tmp_path: Path) -> None:
    db = Database(tmp_path / "a.sqlite3")
    enabled = True
    writer = AuditWriter(db, store_bodies=lambda: enabled, body_max_bytes=lambda: 10, flush_interval=0.01)
    await writer.start()
    writer.submit(_record("req_big", bodies={"request": "x" * 50, "response": {"a": 1}}))
    enabled = False
    writer.submit(_record("req_off", bodies={"request": "secret prompt"}))
    await writer.aclose()
    rows = dict(db.execute("SELECT request_id, record FROM audit"))
    big = json.loads(rows["req_big"])["bodies"]
    assert big == {"request": "x" * 10, "request_truncated": 50, "response": '{"a":1}'}
    assert json.loads(rows["req_off"])["bodies"] is None
    assert cap_bodies({"r": "é" * 10}, 3) == {"r": "é", "r_truncated": 20}
    db.close()


async def test_retention_purges_on_its_interval_with_the_period_read_each_time(tmp_path: Path) -> None:
    db = Database(tmp_path / "r.sqlite3")
    days = [0.0]  # 0 = keep forever: nothing goes at start-up
    old = time.time() - 2 * 86400
    writer = AuditWriter(db, flush_interval=0.01)
    writer.submit(_record("req_old", started_at=old))
    writer.submit(_record("req_new"))
    await writer.aclose()
    retention = AuditRetention(db, lambda: days[0], interval=0.01)
    await retention.start()
    await asyncio.sleep(0.05)
    assert {r[0] for r in db.execute("SELECT request_id FROM audit")} == {"req_old", "req_new"}
    days[0] = 1.0  # the live setting changes: the next round purges by it
    for _ in range(500):
        if [r[0] for r in db.execute("SELECT request_id FROM audit")] == ["req_new"]:
            break
        await asyncio.sleep(0.01)
    assert [r[0] for r in db.execute("SELECT request_id FROM audit")] == ["req_new"]
    await retention.aclose()
    assert retention._task is not None and retention._task.cancelled()
    db.close()
    assert await AuditRetention(db, lambda: 1.0).purge() == 0  # a store that cannot delete: logged, 0


async def test_writer_retention_and_drops(tmp_path: Path) -> None:
    db = Database(tmp_path / "b.sqlite3")
    writer = AuditWriter(db, retention_days=lambda: 30, flush_interval=0.01)
    await writer.start()
    writer.submit(_record("req_old", started_at=time.time() - 31 * 86400))
    writer.submit(_record("req_new"))
    await writer.aclose()
    assert {r[0] for r in db.execute("SELECT request_id FROM audit")} == {"req_old", "req_new"}
    assert await AuditWriter(db, retention_days=lambda: 30).retention.purge() == 1  # what start-up does
    assert [r[0] for r in db.execute("SELECT request_id FROM audit")] == ["req_new"]
    assert await AuditWriter(db, retention_days=lambda: 0).retention.purge() == 0  # 0 = keep forever
    drops: list[int] = []
    small = AuditWriter(db, max_queue=2, on_drop=drops.append)
    for i in range(5):
        small.submit(_record(f"req_{i}"))
    assert small.depth == 2 and small.dropped == 3 and drops == [1, 1, 1]
    await small.aclose()  # never started: still drains
    assert {r[0] for r in db.execute("SELECT request_id FROM audit")} == {"req_new", "req_0", "req_1"}
    db.close()


async def test_overflow_holds_up_to_its_bound_and_spills_in_batches_in_order() -> None:
    batches: list[list[str]] = []
    gate = asyncio.Event()

    async def spill(batch: list[dict[str, Any]]) -> None:
        await gate.wait()  # a journal that is slow to take a batch
        batches.append([r["request_id"] for r in batch])

    overflow = AuditOverflow(max_queue=5, batch_size=2, spill=spill)
    for i in range(5):
        assert not overflow.full
        overflow.push({"request_id": f"r{i}"})
    assert overflow.full and len(overflow) == 5 and overflow.taken == 5
    overflow.start()
    await asyncio.sleep(0.01)  # the task took the first batch and waits on the journal
    assert len(overflow) == 3 and not overflow.full
    overflow.push({"request_id": "r5"})
    gate.set()
    await overflow.aclose()  # everything held is spilled before the task ends
    assert batches == [["r0", "r1"], ["r2", "r3"], ["r4", "r5"]] and len(overflow) == 0 and overflow.taken == 6
    never_started = AuditOverflow(max_queue=5, batch_size=4, spill=spill)
    never_started.push({"request_id": "late"})
    await never_started.aclose()  # nothing to stop; the writer drains what is left
    assert len(never_started) == 1
    await never_started.drain()
    assert batches[-1] == ["late"] and len(never_started) == 0


def audit_ids(db: Database) -> list[str]:
    return [r[0] for r in db.execute("SELECT request_id FROM audit ORDER BY request_id")]


class StalledStore:
    """A SQLite store whose writes hang while ``stalled`` is set (a store slower than the traffic)."""

    def __init__(self, path: Path) -> None:
        self.inner = Database(path)
        self.stalled = threading.Event()
        self.released = threading.Event()
        self.dialect, self.shared, self.errors = "sqlite", False, (sqlite3.Error,)

    def run_tx(self, fn: Any, write: bool = True) -> Any:
        if self.stalled.is_set():
            self.released.wait(30)
        return self.inner.run_tx(fn, write)


async def test_a_full_queue_overflows_to_the_spill_journal_not_to_the_floor(tmp_path: Path) -> None:
    store = StalledStore(tmp_path / "db.sqlite3")
    spilled: list[int] = []
    durable = DurableWriter(store, SpillJournal(tmp_path / "spill", 1 << 20), {"audit": AUDIT_UPSERT},  # type: ignore[arg-type]
                            write_timeout=60, on_spilled=lambda _, n: spilled.append(n))
    drops: list[int] = []
    writer = AuditWriter(store.inner, max_queue=3, batch_size=2, flush_interval=0.01, durable=durable,
                         on_drop=drops.append)
    await writer.start()
    store.stalled.set()
    writer.submit(_record("req_00"))
    await asyncio.to_thread(wait_for, lambda: writer._in_flight == 1)  # the writer hangs on the store
    ids = [f"req_{i:02d}" for i in range(1, 13)]
    for group in range(4):  # records keep arriving: 3 fit the queue, the other 9 take the overflow way
        for request_id in ids[group * 3:group * 3 + 3]:
            writer.submit(_record(request_id))
        await asyncio.to_thread(wait_for, lambda: durable.spill_entries == group * 3)
    assert writer.dropped == 0 and drops == [] and writer.overflow.taken == 9 and sum(spilled) == 9
    assert writer.depth == 4  # the batch stuck in the store + the full queue
    store.stalled.clear()
    store.released.set()
    await writer.aclose()
    assert await durable.recover() is True
    assert audit_ids(store.inner) == ["req_00", *ids]  # every record once: no loss, no duplicate
    assert writer.dropped == 0 and durable.lost == 0 and durable.spill_entries == 0
    durable.journal.close()  # type: ignore[union-attr]
    store.inner.close()


async def test_past_both_bounds_a_record_is_dropped_counted_and_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    db = Database(tmp_path / "d.sqlite3")
    durable = DurableWriter(db, SpillJournal(tmp_path / "spill", 1 << 20), {"audit": AUDIT_UPSERT})
    drops: list[int] = []
    writer = AuditWriter(db, max_queue=2, durable=durable, on_drop=drops.append)  # never started: nothing drains
    with caplog.at_level(logging.ERROR):
        for i in range(6):
            writer.submit(_record(f"req_{i}"))
    assert writer.depth == 4 and writer.overflow.taken == 2 and writer.dropped == 2 and drops == [1, 1]
    assert sum("audit_records_dropped" in r.getMessage() for r in caplog.records) == 1  # said once, counted always
    await writer.aclose()  # the overflow is spilled, the queue written
    assert await durable.recover() is True
    assert audit_ids(db) == ["req_0", "req_1", "req_2", "req_3"]
    durable.journal.close()  # type: ignore[union-attr]
    db.close()
