"""/metrics: every documented family with its type, per-app registries, and the
multiprocess mode of ``serve --workers N`` (a real subprocess)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.app import create_app
from gateway.cli import CLI_VALUES_ENV, worker_app
from gateway.observability.logging import configure_logging
from gateway.observability.metric_labels import attempt_labels
from gateway.settings import Settings
from tests.conftest import ServerLoop, Simulator, start_gateway
from tests.processes import free_port

#: name -> type, as docs/observability.md lists them.
FAMILIES = {
    "codebuddy2api_requests": "counter",
    "codebuddy2api_request_duration_seconds": "histogram",
    "codebuddy2api_time_to_first_byte_seconds": "histogram",
    "codebuddy2api_in_flight_requests": "gauge",
    "codebuddy2api_upstream_attempts": "counter",
    "codebuddy2api_routing_decisions": "counter",
    "codebuddy2api_upstream_calls_in_flight": "gauge",
    "codebuddy2api_tool_repairs": "counter",
    "codebuddy2api_budget_overflows": "counter",
    "codebuddy2api_keepalives_sent": "counter",
    "codebuddy2api_terminal_validation_failures": "counter",
    "codebuddy2api_relayed_output_bytes": "counter",
    "codebuddy2api_audit_queue_depth": "gauge",
    "codebuddy2api_audit_dropped": "counter",
    "codebuddy2api_audit_write_errors": "counter",
    "codebuddy2api_records_spilled": "counter",
    "codebuddy2api_records_replayed": "counter",
    "codebuddy2api_records_lost": "counter",
    "codebuddy2api_store_writable": "gauge",
    "codebuddy2api_spill_entries": "gauge",
    "codebuddy2api_shutdown_cut_requests": "counter",
    "codebuddy2api_capture_records": "counter",
    "codebuddy2api_config_revision": "gauge",
    "codebuddy2api_stream_mode": "gauge",
    "codebuddy2api_time_to_first_token_seconds": "histogram",
    "codebuddy2api_tokens": "counter",
    "codebuddy2api_request_errors": "counter",
    "codebuddy2api_build_info": "gauge",
    "codebuddy2api_credentials": "gauge",
    "codebuddy2api_replicas_live": "gauge",
    "codebuddy2api_max_concurrent_share": "gauge",
    "codebuddy2api_cost": "counter",
    "codebuddy2api_engine_held_calls": "gauge",
    "codebuddy2api_continuations": "counter",
    "process_resident_memory_bytes": "gauge",
    "process_cpu_seconds": "counter",
}
USER = [{"role": "user", "content": "hi"}]


def families(text: str) -> dict[str, str]:
    return {f.name: f.type for f in text_string_to_metric_families(text)}


def requests_total(text: str) -> float:
    return sum(
        s.value for f in text_string_to_metric_families(text) for s in f.samples
        if s.name == "codebuddy2api_requests_total"
    )


def test_every_documented_family_is_exposed_with_its_type(
    server_loop: ServerLoop, simulator: Simulator, tmp_path_factory: pytest.TempPathFactory
) -> None:
    gw = start_gateway(server_loop, simulator, tmp_path_factory)
    chat = {"model": "tool", "messages": USER, "stream": True, "tools": [
        {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]}
    assert httpx.post(gw.base_url + "/chat/completions", json=chat).status_code == 200
    text = httpx.get(gw.url + "/metrics").text
    exposed = families(text)
    for name, kind in FAMILIES.items():
        assert exposed.get(name) == kind, name
    docs = (Path(__file__).parents[2] / "docs" / "observability.md").read_text()
    for name in FAMILIES:  # documented with the exposed suffix
        assert name + ("_total" if FAMILIES[name] == "counter" else "") in docs, name
    assert 'codebuddy2api_requests_total{mode="compatible",outcome="success",protocol="chat",streamed="true"} 1.0' in text


def test_two_apps_in_one_process_keep_separate_registries(tmp_path: Path) -> None:
    sources = {name: "default" for name in Settings.model_fields}
    apps = [create_app(Settings(data_dir=tmp_path / str(i)), sources) for i in range(2)]  # type: ignore[arg-type]
    try:
        first, second = (app.state.observability.metrics for app in apps)
        assert first.registry is not second.registry
        first.requests.labels("chat", "compatible", "true", "success").inc()
        assert requests_total(second.render()[0].decode()) == 0
        assert requests_total(first.render()[0].decode()) == 1
    finally:
        for app in apps:
            app.state.db.close()


def test_attempt_labels() -> None:
    assert attempt_labels({"status": 200}, "success") == ("success", "2xx")
    assert attempt_labels({"status": 200, "error": "upstream_error"}, "error") == ("error", "2xx")
    assert attempt_labels({"status": None, "error": "upstream_rate_limited"}, "error") == ("error", "4xx")
    assert attempt_labels({"status": 503, "error": "upstream_unavailable"}, "error") == ("error", "5xx")
    assert attempt_labels({"status": None, "error": "upstream_unreachable"}, "error") == ("error", "network")
    assert attempt_labels({"status": None}, "cancelled") == ("cancelled", "none")
    assert attempt_labels({"status": 200}, "cancelled") == ("cancelled", "2xx")


def test_worker_app_rebuilds_settings_with_their_sources(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What each worker process does with the CLI values the parent serialized."""
    monkeypatch.setenv("CODEBUDDY2API_KEEPALIVE_INTERVAL", "2.5")
    monkeypatch.setenv(CLI_VALUES_ENV, json.dumps(
        {"stream_mode": "realtime", "data_dir": str(tmp_path), "audit_bodies": True, "log_level": "warning"}
    ))
    app = worker_app()
    try:
        live = app.state.live
        assert live.current.stream_mode.value == "realtime" and live.sources["stream_mode"] == "cli"
        assert live.current.audit_bodies is True and live.sources["audit_bodies"] == "cli"
        assert live.current.keepalive_interval == 2.5 and live.sources["keepalive_interval"] == "env"
        assert live.sources["workers"] == "default" and live.current.audit_retention_days == 30
    finally:
        app.state.db.close()
        configure_logging("warning")


def test_serve_with_two_workers_aggregates_metrics(tmp_path: Path) -> None:
    port = free_port()
    data = tmp_path / "data"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CODEBUDDY2API_", "PROMETHEUS_"))}
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway", "serve", "--workers", "2", "--port", str(port), "--data-dir", str(data),
         "--stream-mode", "realtime"],
        env=env, stdout=subprocess.DEVNULL, stderr=(tmp_path / "stderr").open("w"), text=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90  # two worker processes starting on a loaded machine
        while True:
            try:
                if httpx.get(base + "/healthz").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, "gateway did not start"
            time.sleep(0.1)
        sent = 0
        for i in range(12):  # a new connection each: any worker may take it
            stream = i % 2 == 0
            body = {"model": "echo" if i % 3 else "server_error", "messages": USER, "stream": stream}
            response = httpx.post(base + "/v1/chat/completions", json=body, headers={"connection": "close"})
            assert response.status_code in (200, 502)
            sent += 1
        assert httpx.post(base + "/v1/chat/completions", content=b"{").status_code == 400
        sent += 1
        for _ in range(4):
            text = httpx.get(base + "/metrics", headers={"connection": "close"}).text
            assert requests_total(text) == sent
            samples = {
                (s.name, tuple(sorted(s.labels.items()))): s.value
                for f in text_string_to_metric_families(text) for s in f.samples
            }
            assert sum(v for (n, _), v in samples.items() if n == "codebuddy2api_in_flight_requests") == 0
            assert samples[("codebuddy2api_stream_mode", (("mode", "realtime"),))] == 1  # the CLI flag reached workers
            assert sum(v for (n, _), v in samples.items() if n == "codebuddy2api_request_duration_seconds_count") == sent
            # process_* of both workers, summed (prometheus-client's own collector sees one process)
            assert samples[("codebuddy2api_workers", ())] == 2
            assert samples[("process_resident_memory_bytes", ())] > 2 * 10_000_000
            assert samples[("process_open_fds", ())] > 0
            assert samples[("codebuddy2api_build_info", (("python", sys.version.split()[0]), ("version", "0.1.0")))] == 1
        # no --admin-token: the CLI generated one for this run, printed its login URL once,
        # and every worker accepts it (new connections: either worker may answer)
        login = [json.loads(line)["admin_login_file"] for line in (tmp_path / "stderr").read_text().splitlines() if '"startup"' in line]
        assert len(login) == 1, "one banner on stderr (the parent's), naming the login URL's file"
        token = Path(login[0]).read_text().rsplit("?token=", 1)[1].strip()
        assert token not in (tmp_path / "stderr").read_text()
        admin = {"authorization": f"Bearer {token}", "connection": "close"}
        assert httpx.get(base + "/admin/api/audit", headers={"connection": "close"}).status_code == 401
        audit = httpx.get(base + "/admin/api/audit", headers=admin).json()
        deadline = time.monotonic() + 5
        while audit["total"] < sent and time.monotonic() < deadline:
            time.sleep(0.05)
            audit = httpx.get(base + "/admin/api/audit", headers=admin).json()
        assert all(httpx.get(base + "/admin/api/status", headers=admin).status_code == 200 for _ in range(6))
        assert audit["total"] == sent and {r["mode"] for r in audit["data"]} == {"realtime"}
        assert (data / "prometheus-multiproc").is_dir()
    finally:
        proc.terminate()
        proc.wait(timeout=15)
    lines = [json.loads(line) for line in (tmp_path / "stderr").read_text().splitlines() if line.startswith("{")]
    assert sum(1 for line in lines if line.get("event") == "request") == sent  # one JSON line per request
    assert any(line.get("logger") == "uvicorn.access" and line.get("path") == "/metrics" for line in lines)


def test_grafana_dashboard_queries_only_exposed_metrics(
    server_loop: ServerLoop, simulator: Simulator, tmp_path_factory: pytest.TempPathFactory
) -> None:
    import re

    gw = start_gateway(server_loop, simulator, tmp_path_factory)
    httpx.post(gw.base_url + "/chat/completions", json={"model": "echo", "messages": USER, "stream": True})
    exposed = families(httpx.get(gw.url + "/metrics").text)  # labelled families may have no sample yet
    dashboard = json.loads((Path(__file__).parents[2] / "docs" / "grafana-dashboard.json").read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert {"job", "instance"} <= set(variables)
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    queries = [v["query"]["query"] for v in variables.values() if v["type"] == "query"]
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"  # provisioned dashboards pick their data source
    metric = re.compile(r"\b((?:codebuddy2api|process)_[a-z_]+)\b(\{[^}]*\})?")
    used = {m.group(1) for e in exprs + queries for m in metric.finditer(e)}
    suffix = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    valid = {name + end for name, kind in exposed.items() for end in suffix[kind]}
    assert used and used <= valid, used - valid
    docs = (Path(__file__).parents[2] / "docs" / "observability.md").read_text()
    alerts = docs.split("### Alerts to start from", 1)[1].split("```yaml", 1)[1].split("```", 1)[0]
    alerted = {m.group(1) for m in metric.finditer(alerts)}
    assert len(alerted) >= 4 and alerted <= valid, alerted - valid  # the documented alert rules too
    for e in exprs:  # every series is narrowed to the chosen jobs and instances (two replicas: scaling.md)
        for m in metric.finditer(e):
            assert m.group(2) and 'job=~"$job"' in m.group(2) and 'instance=~"$instance"' in m.group(2), e
    titles = " ".join(p["title"] for p in dashboard["panels"]).lower()
    for topic in ("requests/s", "error rate", "first byte", "first token", "duration", "tokens/s by model",
                  "error code", "upstream attempts", "process", "build", "in-flight", "repairs", "budget",
                  "keepalives", "store writable", "spill journal", "lost", "shutdown"):
        assert topic in titles, topic
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    cells = set()
    for p in dashboard["panels"]:  # no two panels overlap on the 24-column grid
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not mine & cells, p["title"]
        cells |= mine


def test_observability_flags_map_onto_settings() -> None:
    from gateway.cli import build_parser
    from gateway.settings import CLI_FIELDS, SettingsError, load_settings

    args = build_parser().parse_args(
        ["serve", "--audit-bodies", "--audit-retention-days", "7", "--audit-body-max-bytes", "1024", "--workers", "3"]
    )
    settings, sources = load_settings({name: getattr(args, name) for name in CLI_FIELDS})
    assert (settings.audit_bodies, settings.audit_retention_days, settings.audit_body_max_bytes, settings.workers) == (
        True, 7, 1024, 3
    )
    assert {sources[k] for k in ("audit_bodies", "audit_retention_days", "audit_body_max_bytes", "workers")} == {"cli"}
    args = build_parser().parse_args(["serve"])
    settings, sources = load_settings({name: getattr(args, name) for name in CLI_FIELDS})
    assert (settings.audit_bodies, settings.audit_retention_days, settings.audit_body_max_bytes, settings.workers) == (
        False, 30, 64 * 1024, 1
    )
    with pytest.raises(SettingsError, match="--workers"):
        load_settings({"workers": "0"})


def samples_of(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {tuple(sorted(s.labels.items())): s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == name}


def test_credential_states_replicas_and_the_share_are_gauges_at_the_scrape(
    server_loop: ServerLoop, simulator: Simulator, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Issue #38: credential state, live replicas and this replica's share, read at the scrape."""
    gw = start_gateway(server_loop, simulator, tmp_path_factory, max_concurrent=9, upstream_api_key="sk-a-key-0001,sk-a-key-0002")
    text = httpx.get(gw.url + "/metrics").text
    states = samples_of(text, "codebuddy2api_credentials")
    assert states == {(("state", "usable"), ("upstream", "upstream")): 2.0, (("state", "cooling"), ("upstream", "upstream")): 0.0,
                      (("state", "disabled"), ("upstream", "upstream")): 0.0}
    assert samples_of(text, "codebuddy2api_replicas_live") == {(): 1.0}
    assert samples_of(text, "codebuddy2api_max_concurrent_share") == {(): 9.0}
    first = gw.app.state.relay.pool.credentials[0].id
    admin = httpx.post(f"{gw.url}/admin/api/credentials/{first}/disable", headers=gw.admin, json={})
    assert admin.status_code == 200
    states = samples_of(httpx.get(gw.url + "/metrics").text, "codebuddy2api_credentials")
    assert states[(("state", "usable"), ("upstream", "upstream"))] == 1.0
    assert states[(("state", "disabled"), ("upstream", "upstream"))] == 1.0


def test_credential_states_counts_each_credential_once() -> None:
    from gateway.observability.state_gauges import credential_states
    from gateway.upstream.credential import Credential, Upstream

    a, b = Upstream("a", "http://127.0.0.1:1/v1"), Upstream("b", "http://127.0.0.1:2/v1")
    cooling = Credential(a, "k2", cooldowns={"m": 200.0, "old": 50.0})
    expired = Credential(a, "k3", cooldowns={"m": 50.0})
    off = Credential(b, "k4", disabled=True, cooldowns={"m": 200.0})
    counts = credential_states([Credential(a, "k1"), cooling, expired, off], now=100.0)
    assert counts == {("a", "usable"): 2, ("a", "cooling"): 1, ("a", "disabled"): 0,
                      ("b", "usable"): 0, ("b", "cooling"): 0, ("b", "disabled"): 1}
