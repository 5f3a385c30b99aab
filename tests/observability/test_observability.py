"""Observability that answers operators' questions: time to first token against time to
first byte, tokens by model that add up to the audit, errors by code, series declared at
zero, the model-label bound, process and build metrics, and OpenTelemetry spans (the SDK's
in-memory exporter, and a real OTLP/HTTP receiver on loopback)."""

from __future__ import annotations

import collections
import http.server
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from prometheus_client.parser import text_string_to_metric_families

from gateway.generation.record import RequestRecord
from gateway.observability.metric_labels import DYNAMIC_MODELS, OTHER, BoundedLabel
from gateway.observability.metrics import Metrics
from gateway.observability.tracing import Tracing, traces_url
from tests.conftest import Gateway, ServerLoop, Simulator, start_gateway, wait_for
from tests.drivers import DRIVERS

USER = [{"role": "user", "content": "hi"}]
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_SPAN}-01"


def samples(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {
        tuple(sorted(s.labels.items())): s.value
        for f in text_string_to_metric_families(text) for s in f.samples if s.name == name
    }


def metrics_text(gw: Gateway) -> str:
    return httpx.get(gw.url + "/metrics").text


def audited(gw: Gateway, expected: int, **filters: str) -> list[dict[str, Any]]:
    """Audit rows (written off the hot path): wait until ``expected`` are on disk."""
    rows: list[dict[str, Any]] = []

    def enough() -> bool:
        nonlocal rows
        rows = httpx.get(gw.url + "/admin/api/audit", params={"limit": 1000, **filters}, headers=gw.admin).json()["data"]
        return len(rows) >= expected

    wait_for(enough)
    return rows


# -- time to first token ----------------------------------------------------------------


def test_ttft_comes_long_after_ttfb_in_compatible_mode_on_a_slow_upstream(
    server_loop: ServerLoop, simulator: Simulator, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Compatible mode commits the stream (the role chunk: TTFB) when the upstream answers,
    and the first text only once the whole answer is collected and validated (TTFT)."""
    gw = start_gateway(server_loop, simulator, tmp_path_factory, stream_mode="compatible", keepalive_interval=5)
    delay, chunk = 0.1, 16
    model = f"text;delay={delay};chunk={chunk}"
    client = openai.OpenAI(base_url=gw.base_url, api_key="k", _strict_response_validation=True, max_retries=0)
    with client.chat.completions.stream(model=model, messages=USER, timeout=30) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    text = "Hello from the codebuddy2api simulator. This reply is scripted, deterministic and split into fragments."
    assert final.choices[0].message.content == text
    (row,) = audited(gw, 1, model=model)
    frames = -(-len(text) // chunk) + 1  # the role chunk, the text pieces (each after `delay`), the finish...
    assert row["ttfb_ms"] is not None and row["ttft_ms"] is not None
    # every frame after the first waits `delay` upstream: all of that lies between TTFB and TTFT
    assert row["ttft_ms"] - row["ttfb_ms"] >= (frames - 1) * delay * 1000 * 0.95
    assert row["ttft_ms"] <= row["duration_ms"]
    text_ = metrics_text(gw)
    ttft = samples(text_, "codebuddy2api_time_to_first_token_seconds_sum")
    ttfb = samples(text_, "codebuddy2api_time_to_first_byte_seconds_sum")
    key = (("mode", "compatible"), ("protocol", "chat"))
    assert ttft[key] == pytest.approx(row["ttft_ms"] / 1000, abs=1e-3)
    assert ttfb[key] == pytest.approx(row["ttfb_ms"] / 1000, abs=1e-3)
    assert ttft[(("mode", "realtime"), ("protocol", "chat"))] == 0  # declared, never observed


def test_ttft_follows_the_first_text_in_realtime_mode(gateways: dict[str, Gateway]) -> None:
    gw = gateways["realtime"]
    model = "text;delay=0.05;chunk=32;first_chunk_delay=0.01"
    outcome = DRIVERS["messages"](gw.url, model)
    assert outcome.ok and outcome.text.startswith("Hello from the codebuddy2api simulator.")
    (row,) = audited(gw, 1, model=model)
    # realtime relays the first text piece as it arrives: before the later pieces' delays
    assert row["ttfb_ms"] <= row["ttft_ms"] <= row["duration_ms"] - 0.05 * 1000 * 2


# -- tokens -----------------------------------------------------------------------------


def test_token_counters_equal_the_audit_sums_after_a_mixed_burst(
    server_loop: ServerLoop, simulator: Simulator, tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    """Per protocol, mode, model and kind, with the models from the upstream's allow-list
    (as an operator configures them: each has its own label from the first request)."""
    cached = simulator.script([
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": "cached answer"}}]},
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
        {"choices": [], "usage": {"prompt_tokens": 40, "completion_tokens": 3,
                                  "prompt_tokens_details": {"cached_tokens": 32}}},
    ])
    config = tmp_path / "upstreams.toml"
    config.write_text(f'[[upstreams]]\nname = "upstream"\nbase_url = "{simulator.url}/v1"\n'
                      f'models = ["echo", "reasoning", "tool", "server_error", "{cached}"]\n')
    gw = start_gateway(server_loop, simulator, tmp_path_factory, upstream_url=[], config=config)
    sent = 0
    for protocol, driver in DRIVERS.items():
        for model in ("echo", "reasoning", "tool", "server_error", cached):
            driver(gw.url, model)
            sent += 1
    for stream in (True, False):  # JSON answers count too
        body = {"model": "reasoning", "messages": USER, "stream": stream}
        assert httpx.post(gw.base_url + "/chat/completions", json=body).status_code == 200
        sent += 1
    assert httpx.post(gw.base_url + "/chat/completions", content=b"{").status_code == 400
    sent += 1
    rows = audited(gw, sent)
    expected: collections.Counter[tuple[str, str, str, str]] = collections.Counter()
    fields = {"input": "prompt_tokens", "output": "completion_tokens", "reasoning": "reasoning_tokens",
              "cached": "cached_tokens"}
    for row in rows:
        for kind, field in fields.items():
            if row["usage"].get(field):
                expected[(row["protocol"], row["mode"], row["model"], kind)] += row["usage"][field]
    assert expected[("chat", "compatible", cached, "cached")] == 32  # the burst covers every kind
    assert all(any(k[3] == kind for k in expected) for kind in fields)
    exposed: collections.Counter[tuple[str, str, str, str]] = collections.Counter()
    for labels, value in samples(metrics_text(gw), "codebuddy2api_tokens_total").items():
        d = dict(labels)
        assert d["upstream"] == "upstream"
        if value:
            exposed[(d["protocol"], d["mode"], d["model"], d["kind"])] += int(value)
    assert exposed == expected, (exposed - expected, expected - exposed)
    errors = samples(metrics_text(gw), "codebuddy2api_request_errors_total")
    by_code = collections.Counter()
    for labels, value in errors.items():
        by_code[dict(labels)["error_code"]] += value
    audit_codes = collections.Counter(r["error_code"] for r in rows if r["error_code"])
    assert audit_codes and all(by_code[c] == n for c, n in audit_codes.items())
    assert sum(by_code.values()) == sum(audit_codes.values())


def _record(model: str, **usage: int) -> RequestRecord:
    record = RequestRecord(request_id="req_x", protocol="chat", started_at=time.time(), mode="compatible",
                           model=model, outcome="success", duration_ms=10)
    record.usage = {"prompt_tokens": 5, "completion_tokens": 2, **usage}
    record.upstream_attempts = [{"upstream": "upstream", "status": 200}]
    return record


def test_model_labels_stay_bounded_over_1000_distinct_model_names() -> None:
    metrics = Metrics()
    metrics.models.add_known(["configured-a", "configured-b"])
    metrics.upstreams.add_known(["upstream"])
    frequent = [f"frequent-{i}" for i in range(DYNAMIC_MODELS + 5)]  # more than there is room for
    fed = 0
    for round_ in range(4):
        for name in frequent:
            metrics.on_finish(_record(name))
            fed += 1
    for i in range(1000):
        metrics.on_finish(_record(f"one-off-{i}"))
        metrics.on_finish(_record("configured-a"))
        fed += 2
    text = metrics.render()[0].decode()
    tokens = samples(text, "codebuddy2api_tokens_total")
    names = {dict(labels)["model"] for labels in tokens}
    assert len(names) <= 2 + DYNAMIC_MODELS + 1
    assert {"configured-a", OTHER} <= names
    assert not any(n.startswith("one-off-") for n in names)
    assert sum(1 for n in names if n.startswith("frequent-")) == DYNAMIC_MODELS
    inputs = sum(v for labels, v in tokens.items() if dict(labels)["kind"] == "input")
    assert inputs == 5 * fed  # nothing is lost: the rest is counted under `other`
    assert tokens[(("kind", "input"), ("mode", "compatible"), ("model", "configured-a"),
                   ("protocol", "chat"), ("upstream", "upstream"))] == 5 * 1000


def test_bounded_label_forgets_candidates_within_its_bound() -> None:
    label = BoundedLabel(["known"], capacity=2, min_hits=2, max_candidates=10)
    assert [label("known"), label(""), label("a"), label("a"), label("a")] == ["known", "none", OTHER, "a", "a"]
    for i in range(100):
        assert label(f"x{i}") == OTHER
        assert len(label._hits) <= 10
    assert label("b") == OTHER and label("b") == "b"
    assert label("c") == OTHER and label("c") == OTHER  # full
    assert label.values() == {"known", "a", "b", OTHER}


# -- declared series, process and build metrics -------------------------------------------


def test_configured_series_are_declared_at_zero_with_process_and_build_info(
    server_loop: ServerLoop, simulator: Simulator, tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    config = tmp_path / "upstreams.toml"
    config.write_text(
        f'[[upstreams]]\nname = "primary"\nbase_url = "{simulator.url}/v1"\nmodels = ["echo", "tool"]\n'
        f'model_map = {{ "gpt-house" = "echo" }}\n'
    )
    gw = start_gateway(server_loop, simulator, tmp_path_factory, upstream_url=[], config=config)
    text = metrics_text(gw)
    tokens = samples(text, "codebuddy2api_tokens_total")
    models = {dict(k)["model"] for k in tokens}
    assert models == {"echo", "tool", "gpt-house"} and set(tokens.values()) == {0.0}
    assert len(tokens) == 3 * 3 * 2 * 4  # models x protocols x modes x kinds
    attempts = samples(text, "codebuddy2api_upstream_attempts_total")
    assert {dict(k)["upstream"] for k in attempts} == {"primary"} and set(attempts.values()) == {0.0}
    errors = samples(text, "codebuddy2api_request_errors_total")
    assert errors[(("error_code", "upstream_rate_limited"), ("mode", "realtime"), ("protocol", "messages"))] == 0
    requests = samples(text, "codebuddy2api_requests_total")
    assert len(requests) == 3 * 2 * 2 * 5 and set(requests.values()) == {0.0}
    assert samples(text, "process_resident_memory_bytes")[()] > 1_000_000
    assert samples(text, "process_cpu_seconds_total")[()] > 0
    (build,) = samples(text, "codebuddy2api_build_info").items()
    assert dict(build[0])["version"] == "0.1.0" and build[1] == 1

    # a failing upstream attempt moves exactly its own series
    assert httpx.post(gw.base_url + "/chat/completions",
                      json={"model": "echo", "messages": USER}).status_code == 200
    after = samples(metrics_text(gw), "codebuddy2api_upstream_attempts_total")
    moved = {k: v for k, v in after.items() if v}
    assert moved == {(("outcome", "success"), ("status_class", "2xx"), ("upstream", "primary")): 1.0}


# -- traces -----------------------------------------------------------------------------


@pytest.fixture
def traced(server_loop: ServerLoop, simulator: Simulator,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Gateway, InMemorySpanExporter]]:
    gw = start_gateway(server_loop, simulator, tmp_path_factory, stream_mode="compatible", keepalive_interval=0.2,
                       upstream_url=[simulator.url + "/v1", simulator.url + "/v1/"])
    exporter = InMemorySpanExporter()
    gw.app.state.observability.observer.tracing = Tracing(SimpleSpanProcessor(exporter))  # before any request
    yield gw, exporter


def _tree(exporter: InMemorySpanExporter, request_id: str) -> tuple[Any, list[Any]]:
    spans: list[Any] = []

    def found() -> bool:
        nonlocal spans
        spans = list(exporter.get_finished_spans())
        return any(s.attributes.get("codebuddy2api.request_id") == request_id for s in spans)

    wait_for(found)
    root = next(s for s in spans if s.attributes.get("codebuddy2api.request_id") == request_id)
    children = [s for s in spans if s.parent is not None and s.parent.span_id == root.context.span_id]
    return root, children


def test_spans_follow_the_genai_conventions_and_the_clients_traceparent(
    traced: tuple[Gateway, InMemorySpanExporter], simulator: Simulator
) -> None:
    gw, exporter = traced
    body = {"model": "reasoning;ttfb=0.7", "messages": USER, "stream": True, "stream_options": {"include_usage": True}}
    response = httpx.post(gw.base_url + "/chat/completions", json=body, headers={"traceparent": TRACEPARENT})
    assert response.status_code == 200 and "[DONE]" in response.text
    root, children = _tree(exporter, response.headers["x-request-id"])
    (row,) = audited(gw, 1, request_id=response.headers["x-request-id"])
    assert root.name == "chat reasoning;ttfb=0.7" and root.kind is SpanKind.SERVER
    assert format(root.context.trace_id, "032x") == TRACE_ID  # the client's trace
    assert format(root.parent.span_id, "016x") == PARENT_SPAN
    a = root.attributes
    assert a["gen_ai.operation.name"] == "chat"
    assert a["gen_ai.request.model"] == a["gen_ai.response.model"] == "reasoning;ttfb=0.7"
    assert a["gen_ai.usage.input_tokens"] == row["usage"]["prompt_tokens"] > 0
    assert a["gen_ai.usage.output_tokens"] == row["usage"]["completion_tokens"] > 0
    assert tuple(a["gen_ai.response.finish_reasons"]) == ("stop",)
    assert a["codebuddy2api.stream_mode"] == "compatible" and a["codebuddy2api.protocol"] == "chat"
    assert {e.name for e in root.events} == {"first_byte", "first_token"}
    by_name = {s.name: s for s in children}
    attempt = by_name["chat reasoning;ttfb=0.7"]
    assert attempt.kind is SpanKind.CLIENT and attempt.attributes["http.response.status_code"] == 200
    assert attempt.attributes["codebuddy2api.routing"] == row["upstream_attempts"][0]["routing"] == "least_loaded"
    wait = by_name["keepalive_wait"]
    assert wait.attributes["codebuddy2api.keepalives"] == row["keepalives"] >= 2
    assert root.start_time <= attempt.start_time <= attempt.end_time <= root.end_time
    assert root.start_time <= wait.start_time < wait.end_time <= root.end_time
    # the upstream was told the attempt span's context, and the audit row names the trace
    told = [r["headers"]["traceparent"] for r in simulator.requests()
            if TRACE_ID in r["headers"].get("traceparent", "")]
    assert told == [f"00-{TRACE_ID}-{attempt.context.span_id:016x}-01"]
    assert row["trace_context"] == f"00-{TRACE_ID}-{root.context.span_id:016x}-01"


def test_a_malformed_traceparent_starts_a_trace_of_its_own(traced: tuple[Gateway, InMemorySpanExporter]) -> None:
    gw, exporter = traced
    response = httpx.post(gw.base_url + "/chat/completions", json={"model": "echo", "messages": USER},
                          headers={"traceparent": "00-not-a-trace-01"})
    assert response.status_code == 200
    root, children = _tree(exporter, response.headers["x-request-id"])
    assert root.parent is None and format(root.context.trace_id, "032x") != TRACE_ID
    assert [c.kind for c in children] == [SpanKind.CLIENT]
    assert "keepalive_wait" not in {c.name for c in children}  # a quick answer needed none
    (row,) = audited(gw, 1, request_id=response.headers["x-request-id"])
    assert row["traceparent"] == "00-not-a-trace-01" and row["first_keepalive_ms"] is None


def test_failover_and_repair_attempts_are_child_spans(
    traced: tuple[Gateway, InMemorySpanExporter], simulator: Simulator
) -> None:
    gw, exporter = traced
    response = httpx.post(gw.base_url + "/chat/completions", json={"model": "server_error", "messages": USER})
    assert response.status_code == 502
    root, children = _tree(exporter, response.headers["x-request-id"])
    assert root.status.status_code.name == "ERROR" and root.attributes["error.type"] == "upstream_error"
    assert len(children) == 2 and all(c.kind is SpanKind.CLIENT for c in children)  # both credentials tried
    assert [c.attributes["error.type"] for c in children] == ["upstream_error", "upstream_error"]
    trace = format(root.context.trace_id, "032x")
    told = {r["headers"]["traceparent"] for r in simulator.requests() if trace in r["headers"].get("traceparent", "")}
    assert told == {f"00-{trace}-{c.context.span_id:016x}-01" for c in children}  # one context per attempt
    # one after the other (durations are kept to 0.1 ms: that much overlap is rounding)
    assert children[0].start_time < children[1].start_time
    assert children[0].end_time <= children[1].start_time + 100_000

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    body = {"model": "undeclared_tool;repairable=1", "messages": USER, "tools": tools}
    response = httpx.post(gw.base_url + "/chat/completions", json=body)
    assert response.status_code == 200, response.text
    root, children = _tree(exporter, response.headers["x-request-id"])
    repairs = sorted((s for s in children if s.name.startswith("repair ")), key=lambda s: s.start_time)
    assert [(s.name, s.attributes["codebuddy2api.repair.outcome"]) for s in repairs] == [
        ("repair original", "invalid"), ("repair regenerate", "valid")]
    # each repair step spans the answer it judged: the original's read, then the regeneration's
    rounding = 100_000  # durations are kept to 0.1 ms
    for s in repairs:
        assert root.start_time <= s.start_time < s.end_time <= root.end_time + rounding, (
            s.name, s.start_time - root.start_time, s.end_time - s.start_time, root.end_time - s.end_time)
    assert repairs[0].end_time <= repairs[1].start_time + rounding
    attempts = sorted((s for s in children if s.kind is SpanKind.CLIENT), key=lambda s: s.start_time)
    assert all(r.start_time <= a.start_time for r, a in zip(repairs, attempts))
    assert sum(1 for s in children if s.kind is SpanKind.CLIENT) == 2  # the original and the regeneration
    assert tuple(root.attributes["gen_ai.response.finish_reasons"]) == ("tool_calls",)


class _Receiver(http.server.BaseHTTPRequestHandler):
    """An OTLP/HTTP collector: decodes each export request's protobuf."""

    received: list[tuple[str, ExportTraceServiceRequest]] = []

    def do_POST(self) -> None:  # noqa: N802
        body = self.rfile.read(int(self.headers["content-length"]))
        message = ExportTraceServiceRequest()
        message.ParseFromString(body)
        self.received.append((self.path, message))
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


def test_spans_reach_a_real_otlp_http_receiver(
    server_loop: ServerLoop, simulator: Simulator, tmp_path_factory: pytest.TempPathFactory
) -> None:
    _Receiver.received = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        endpoint = f"http://127.0.0.1:{server.server_address[1]}"
        gw = start_gateway(server_loop, simulator, tmp_path_factory, otlp_endpoint=endpoint)
        outcome = DRIVERS["responses"](gw.url, "echo")
        assert outcome.ok
        tracing = gw.app.state.observability.tracing

        def received() -> list[Any]:
            return [s for _, m in _Receiver.received for rs in m.resource_spans for ss in rs.scope_spans
                    for s in ss.spans]

        wait_for(lambda: tracing.provider.force_flush() and any(s.kind == s.SPAN_KIND_SERVER for s in received()))
        spans = received()
        assert {p for p, _ in _Receiver.received} == {"/v1/traces"}
        server_span = next(s for s in spans if s.kind == s.SPAN_KIND_SERVER)
        attrs = {kv.key: kv.value for kv in server_span.attributes}
        assert server_span.name == "chat echo"
        assert attrs["gen_ai.operation.name"].string_value == "chat"
        assert attrs["codebuddy2api.protocol"].string_value == "responses"
        assert attrs["gen_ai.usage.output_tokens"].int_value > 0
        client_span = next(s for s in spans if s.kind == s.SPAN_KIND_CLIENT)
        assert client_span.parent_span_id == server_span.span_id and client_span.trace_id == server_span.trace_id
        resource = {kv.key: kv.value.string_value for kv in _Receiver.received[0][1].resource_spans[0].resource.attributes}
        assert resource["service.name"] == "codebuddy2api"
    finally:
        server.shutdown()


def test_traces_url_and_no_sdk_without_an_endpoint(tmp_path: Path) -> None:
    assert traces_url("http://c:4318") == "http://c:4318/v1/traces"
    assert traces_url("http://c:4318/v1/traces/") == "http://c:4318/v1/traces"
    from gateway.app import create_app
    from gateway.cli import build_parser
    from gateway.settings import CLI_FIELDS, Settings, SettingsError, load_settings

    args = build_parser().parse_args(["serve", "--otlp-endpoint", "http://127.0.0.1:4318"])
    settings, sources = load_settings({name: getattr(args, name) for name in CLI_FIELDS})
    assert (settings.otlp_endpoint, sources["otlp_endpoint"]) == ("http://127.0.0.1:4318", "cli")
    with pytest.raises(SettingsError, match="--otlp-endpoint.*OTEL_EXPORTER_OTLP_HEADERS") as caught:
        load_settings({"otlp_endpoint": "https://user:s3cret@collector:4318"})
    assert "s3cret" not in str(caught.value)
    with pytest.raises(SettingsError, match="--otlp-endpoint"):
        load_settings({"otlp_endpoint": "collector:4318"})

    app = create_app(Settings(data_dir=tmp_path), {n: "default" for n in Settings.model_fields})  # type: ignore[arg-type]
    try:
        assert app.state.observability.tracing is None
    finally:
        app.state.db.close()
