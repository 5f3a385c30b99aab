"""The WebUI in a real browser (Playwright driving Debian's chromium) against a real gateway.

One gateway for the module: an admin token (so the login page shows), ``--audit-bodies``
(so the audit detail shows bodies), and ``keepalive_interval`` owned by the environment (so
the settings page shows a locked value). One browser for the module; a fresh context (no
cookies) per test.

Screenshots of every page are taken on each run; they are written to docs/screenshots/
only with ``CB2A_SCREENSHOTS=1`` (otherwise to a temporary directory, so a test run never
dirties the tree).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from gateway.app import create_app
from gateway.http.servers import bind_loopback, start_embedded, stop_embedded
from gateway.observability.tracing import Tracing
from gateway.settings import Settings
from tests.conftest import Gateway, ServerLoop, Simulator, start_gateway

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--no-first-run"]
TOKEN = "webui-admin-token-7f3a"
AUTH = {"authorization": f"Bearer {TOKEN}"}
VIEWPORT = {"width": 1280, "height": 800}
XSS = '<img src=x onerror="window.__xss=1">'
REPO = Path(__file__).resolve().parents[2]

# a real browser: `make test-browser` (CI runs it), not the default suite
pytestmark = pytest.mark.browser

try:
    from playwright import sync_api
except ImportError:  # pragma: no cover - in CI a missing Playwright is a failure, not a skip
    if os.environ.get("CI"):
        raise
    pytest.skip("playwright is not installed (pip install -e '.[dev]')", allow_module_level=True)


# -- fixtures ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not CHROMIUM.exists():
        message = f"{CHROMIUM} is missing (Debian: apt-get install -y --no-install-recommends chromium)"
        if os.environ.get("CI"):
            pytest.fail(f"the WebUI browser tests need chromium in CI: {message}", pytrace=False)
        pytest.skip(message)
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True)
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def ui(server_loop: ServerLoop, simulator: Simulator, tmp_path_factory: pytest.TempPathFactory) -> Gateway:
    sources: dict[str, Any] = {name: "default" for name in Settings.model_fields}
    sources["keepalive_interval"] = "env"  # as if CODEBUDDY2API_KEEPALIVE_INTERVAL were set
    settings = Settings(upstream_url=[simulator.url + "/v1"], data_dir=tmp_path_factory.mktemp("webui"),
                        keepalive_interval=0.5, admin_token=TOKEN, audit_bodies=True)
    app = create_app(settings, sources)
    # traces to memory: the audit detail shows each request's trace id
    app.state.observability.observer.tracing = Tracing(SimpleSpanProcessor(InMemorySpanExporter()))
    return Gateway(server_loop.serve(app), app)


@pytest.fixture(scope="module")
def shots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if os.environ.get("CB2A_SCREENSHOTS"):
        path = REPO / "docs" / "screenshots"
        path.mkdir(parents=True, exist_ok=True)
        return path
    return tmp_path_factory.mktemp("screenshots")


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    # bypass_csp: the page's Content-Security-Policy would also stop an injected handler;
    # with it off, the XSS test proves the rendering itself (textContent) is safe.
    context = browser.new_context(viewport=VIEWPORT, bypass_csp=True)
    page = context.new_page()
    page.set_default_timeout(10_000)
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    yield page
    context.close()
    assert not errors, f"JavaScript errors in the page: {errors}"


# -- helpers -------------------------------------------------------------------------------


def login(page: Any, ui: Gateway, hash_: str = "#/dashboard") -> None:
    page.goto(ui.url + "/" + hash_)
    page.fill("#token", TOKEN)
    page.click("#login-button")
    page.wait_for_selector("#topbar:not([hidden])")


def chat(ui: Gateway, text: str = "hi", model: str = "echo", stream: bool = True) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": text}], "stream": stream}
    response = httpx.post(ui.base_url + "/chat/completions", json=body, timeout=20)
    assert response.text  # the whole answer was read
    return response


def wait_audited(ui: Gateway, request_id: str) -> dict[str, Any]:
    """The audit row is written off the hot path: wait until it is on disk."""
    deadline = time.monotonic() + 5
    while True:
        response = httpx.get(f"{ui.url}/admin/api/audit/{request_id}", headers=AUTH)
        if response.status_code == 200:
            return response.json()
        assert time.monotonic() < deadline, f"{request_id} never reached the audit store"
        time.sleep(0.05)


def settings_api(ui: Gateway) -> dict[str, Any]:
    return httpx.get(ui.url + "/admin/api/settings", headers=AUTH).json()


def shot(page: Any, shots: Path, name: str, full_page: bool = False) -> None:
    page.screenshot(path=str(shots / f"{name}.png"), full_page=full_page)


# -- tests ---------------------------------------------------------------------------------


def test_login_refuses_a_wrong_token_and_enters_with_the_right_one(page: Any, ui: Gateway, shots: Path) -> None:
    page.goto(ui.url + "/")
    assert page.url == ui.url + "/ui/"  # / redirects to the WebUI
    page.wait_for_selector("#token")
    assert page.is_hidden("#topbar")
    shot(page, shots, "login")

    page.fill("#token", "not-the-token")
    page.click("#login-button")
    error = page.wait_for_selector("#login-error:not([hidden])")
    assert error.text_content() == "That is not the admin token."
    assert page.is_hidden("#topbar")
    assert not page.context.cookies()

    page.fill("#token", TOKEN)
    page.click("#login-button")
    page.wait_for_selector("#topbar:not([hidden])")
    page.wait_for_selector("h1:text('Dashboard')")
    assert page.url.endswith("#/dashboard")
    [cookie] = page.context.cookies()
    assert (cookie["name"], cookie["httpOnly"], cookie["sameSite"], cookie["path"]) == ("cb2a_admin", True, "Strict", "/admin")
    assert TOKEN not in cookie["value"]

    page.click("#logout")
    page.wait_for_selector("#token")
    assert httpx.get(ui.url + "/admin/api/settings").status_code == 401  # and nothing is open without it


def test_settings_show_the_locked_value_and_the_mode_toggle_drives_the_next_request(
    page: Any, ui: Gateway, shots: Path
) -> None:
    assert settings_api(ui)["settings"]["stream_mode"]["value"] == "compatible"
    login(page, ui, "#/settings")
    page.wait_for_selector("#field-keepalive_interval")

    locked = page.locator("[data-setting=keepalive_interval]")
    assert page.is_disabled("#field-keepalive_interval")
    assert locked.locator(".badge").text_content() == "env"
    assert "Locked: set by the environment (env)" in locked.locator(".lock").text_content()
    assert page.is_enabled("#field-max_collect_bytes")
    assert page.locator("[data-setting=max_collect_bytes] .badge").text_content() == "default"
    for mode, help_text in settings_api(ui)["modes"].items():  # each mode with its one-line explanation
        assert page.locator(f"label.mode-choice:has([data-testid=mode-{mode}]) .mode-help").text_content() == help_text
    assert page.is_checked("[data-testid=mode-compatible]")
    shot(page, shots, "settings")

    before = chat(ui)
    assert before.headers["x-codebuddy2api-stream-mode"] == "compatible"

    page.check("[data-testid=mode-realtime]")
    page.click("#save-settings")
    page.wait_for_selector(".notice.ok:has-text('Saved: stream_mode')")
    assert page.locator("[data-setting=max_collect_bytes] .badge").text_content() == "default"
    assert page.locator("#stream-mode-card .badge").text_content() == "saved"

    after = chat(ui)
    assert after.headers["x-codebuddy2api-stream-mode"] == "realtime"
    request_id = after.headers["x-request-id"]
    assert wait_audited(ui, request_id)["mode"] == "realtime"

    page.goto(ui.url + "/ui/#/audit")  # the audit row, in the UI, says so too
    row = page.wait_for_selector(f"tr[data-request-id='{request_id}']")
    assert row.query_selector("[data-col=mode]").text_content() == "realtime"
    old_row = page.wait_for_selector(f"tr[data-request-id='{before.headers['x-request-id']}']")
    assert old_row.query_selector("[data-col=mode]").text_content() == "compatible"


def test_a_change_made_elsewhere_is_a_conflict_and_reload_shows_it(page: Any, ui: Gateway) -> None:
    login(page, ui, "#/settings")
    page.wait_for_selector("#field-max_collect_bytes")
    revision = settings_api(ui)["revision"]
    assert page.text_content("#settings-revision") == f"revision {revision}"

    behind = httpx.put(ui.url + "/admin/api/settings", headers=AUTH,  # someone else, meanwhile
                       json={"revision": revision, "changes": {"max_collect_bytes": 123456}})
    assert behind.status_code == 200

    page.fill("#field-tool_repair_attempts", "3")
    page.click("#save-settings")
    warning = page.wait_for_selector(".notice.warn")
    assert "changed elsewhere" in warning.text_content()
    assert f"now revision {revision + 1}" in warning.text_content()
    assert settings_api(ui)["settings"]["tool_repair_attempts"]["value"] == 2  # nothing was overwritten

    page.click("#reload-settings")
    page.wait_for_selector(".notice.ok:has-text('Reloaded')")
    assert page.input_value("#field-max_collect_bytes") == "123456"
    assert page.locator("[data-setting=max_collect_bytes] .badge").text_content() == "saved"
    assert page.input_value("#field-tool_repair_attempts") == "2"

    page.fill("#field-tool_repair_attempts", "11")  # out of range: the API's own message
    page.click("#save-settings")
    error = page.wait_for_selector(".notice.error")
    assert "Not saved" in error.text_content() and "tool_repair_attempts" in error.text_content()

    page.fill("#field-tool_repair_attempts", "3")
    page.click("#save-settings")
    page.wait_for_selector(".notice.ok:has-text('Saved: tool_repair_attempts')")
    assert settings_api(ui)["settings"]["tool_repair_attempts"]["value"] == 3


def test_the_dashboard_moves_after_a_burst(page: Any, ui: Gateway, shots: Path) -> None:
    login(page, ui, "#/dashboard")
    page.wait_for_function("document.querySelector('#stat-requests').dataset.value !== undefined"
                           " && document.querySelector('#stat-requests').dataset.value !== ''")
    start = int(page.get_attribute("#stat-requests", "data-value"))

    bodies = [
        ("/chat/completions", {"model": "echo", "messages": [{"role": "user", "content": "hi"}], "stream": True}),
        ("/messages", {"model": "echo", "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}],
                       "stream": True}),
        ("/responses", {"model": "echo", "input": "hi", "stream": True}),
    ]
    with httpx.Client(timeout=20) as http:
        for i in range(10):
            path, body = bodies[i % 3]
            assert http.post(ui.base_url + path, json=body).status_code == 200
        failed = http.post(ui.base_url + "/chat/completions",
                           json={"model": "server_error", "messages": [{"role": "user", "content": "hi"}]})
        assert failed.status_code >= 500

    page.wait_for_function(
        f"Number(document.querySelector('#stat-requests').dataset.value) >= {start + 11}", timeout=15_000)
    assert float(page.get_attribute("#stat-error-rate", "data-value")) > 0
    assert float(page.get_attribute("#stat-p50", "data-value")) > 0
    rows = page.locator("#breakdown tr[data-group='protocol:messages'] td")
    assert int(rows.nth(1).text_content()) >= 3
    assert page.locator("#credential-health tbody .pill.ok").count() == 1
    assert page.text_content("#dash-ready .pill") == "ready"  # the same reasons as /readyz
    assert page.locator(".chart canvas").count() == 12  # every chart drew
    # the per-upstream charts name this gateway's one upstream
    page.wait_for_function("(document.querySelector('#chart-upstream-requests').dataset.series || '') === 'upstream'")
    assert page.get_attribute("#chart-upstream-errors", "data-series") == "upstream"
    page.wait_for_timeout(300)  # let the charts settle before the picture
    shot(page, shots, "dashboard")


RANGES = {"300": ("5 min", 5), "3600": ("1 h", 10), "21600": ("6 h", 60), "86400": ("24 h", 300),
          "604800": ("7 d", 1800)}


def test_the_range_picker_drives_every_chart_and_the_new_panels_show_ttft_tokens_and_codes(
    page: Any, ui: Gateway, shots: Path
) -> None:
    with httpx.Client(timeout=20) as http:
        for model in ("reasoning", "echo", "reasoning"):
            body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": True,
                    "stream_options": {"include_usage": True}}
            assert http.post(ui.base_url + "/chat/completions", json=body).status_code == 200
        failed = http.post(ui.base_url + "/chat/completions",
                           json={"model": "server_error", "messages": [{"role": "user", "content": "hi"}]})
        wait_audited(ui, failed.headers["x-request-id"])
    login(page, ui, "#/dashboard")
    page.wait_for_selector("#chart-tokens[data-series]")
    charts = page.locator(".charts .chart")
    ids = [charts.nth(i).get_attribute("id") for i in range(charts.count())]
    for panel in ("chart-ttft", "chart-tokens", "chart-error-codes", "chart-duration", "chart-upstream-requests",
                  "chart-upstream-errors"):
        assert panel in ids
    for seconds, (label, bucket) in RANGES.items():
        page.click(f"#range-picker button[data-range='{seconds}']")
        page.wait_for_function(f"document.querySelector('.page-head').dataset.range === '{seconds}'")
        assert page.get_attribute(f"#range-picker button[data-range='{seconds}']", "aria-pressed") == "true"
        assert page.locator("#range-picker button[aria-pressed='true']").count() == 1
        assert page.text_content("#dash-updated").startswith(f"last {label} · {bucket}s buckets")
        assert page.text_content("#stat-requests .stat-sub") == f"last {label}"
        for chart in ids:  # every chart, in-flight included
            since, until = (float(v) for v in page.get_attribute(f"#{chart}", "data-range").split(":"))
            assert until - since == int(seconds), chart  # the x axis spans the chosen range
            assert int(page.get_attribute(f"#{chart}", "data-points")) == int(seconds) // bucket
        assert float(page.get_attribute("#stat-ttft-p50", "data-value")) > 0
        assert "reasoning" in page.get_attribute("#chart-tokens", "data-series").split(",")
        assert "upstream_error" in page.get_attribute("#chart-error-codes", "data-series").split(",")
        if seconds == "300":
            page.wait_for_timeout(300)
            shot(page, shots, "dashboard-5min", full_page=True)
    assert page.locator(".chart canvas").count() == 12
    ttft_p95 = float(page.get_attribute("#stat-ttft-p95", "data-value"))
    series = httpx.get(ui.url + "/admin/api/audit/timeseries?window=604800&bucket=1800", headers=AUTH).json()
    assert ttft_p95 == series["total"]["summary"]["ttft_ms_p95"]
    page.click("#range-picker button[data-range='3600']")  # the default again, for the other tests


def test_audit_filters_by_code_model_protocol_mode_and_request_id_and_fits_1280(
    page: Any, ui: Gateway, shots: Path
) -> None:
    long_model = "echo;chunk=7;delay=0" + ";usage=separate" * 4  # a long name must not widen the table
    ok = chat(ui, model=long_model, stream=True)
    failed = chat(ui, model="server_error", stream=False)
    for response in (ok, failed):
        wait_audited(ui, response.headers["x-request-id"])
    login(page, ui, "#/audit")
    page.wait_for_selector(f"tr[data-request-id='{ok.headers['x-request-id']}']")
    sizes = page.evaluate("""() => ({page: document.documentElement.scrollWidth,
        card: document.querySelector('.table-card').scrollWidth,
        cardClient: document.querySelector('.table-card').clientWidth})""")
    assert sizes["page"] <= VIEWPORT["width"] and sizes["card"] <= sizes["cardClient"], sizes
    shot(page, shots, "audit")

    def rows() -> list[str]:
        return page.eval_on_selector_all("#audit-rows tr[data-request-id]", "els => els.map(e => e.dataset.requestId)")

    def apply(**fields: str) -> list[str]:
        for selector, value in fields.items():
            if selector in ("f-outcome", "f-protocol", "f-mode"):
                page.select_option(f"#{selector}", value)
            else:
                page.fill(f"#{selector}", value)
        loads = int(page.get_attribute("#audit-rows", "data-loads") or 0)
        page.click("#apply-filters")
        page.wait_for_function(f"Number(document.querySelector('#audit-rows').dataset.loads) > {loads}")
        return rows()

    found = apply(**{"f-error-code": "upstream_error"})
    assert set(page.locator("#audit-rows td[data-col=error] .mono").all_text_contents()) == {"upstream_error"}
    # the message beside the code: what the client was told
    messages = set(page.locator("#audit-rows td[data-col=error] .error-message").all_text_contents())
    assert messages and all(m.startswith("the upstream failed with HTTP 500") for m in messages), messages
    shot(page, shots, "audit-filtered")
    expected = httpx.get(ui.url + "/admin/api/audit?error_code=upstream_error&limit=50", headers=AUTH).json()
    assert found == [r["request_id"] for r in expected["data"]] and failed.headers["x-request-id"] in found
    assert apply(**{"f-error-code": "", "f-model": long_model}) == [ok.headers["x-request-id"]]
    assert apply(**{"f-protocol": "messages"}) == []  # the model was asked over chat
    assert apply(**{"f-protocol": "chat", "f-mode": "realtime", "f-model": ""}) == [
        r["request_id"] for r in httpx.get(ui.url + "/admin/api/audit?protocol=chat&mode=realtime&limit=50",
                                           headers=AUTH).json()["data"]]
    assert apply(**{"f-mode": "", "f-protocol": "", "f-outcome": "error",
                    "f-request-id": failed.headers["x-request-id"]}) == [failed.headers["x-request-id"]]
    assert page.locator("#audit-rows .pill").all_text_contents() == ["error"]
    assert apply(**{"f-outcome": "success"}) == []  # filters combine
    apply(**{"f-outcome": "", "f-request-id": ""})


def test_audit_detail_renders_model_output_as_text(page: Any, ui: Gateway, shots: Path) -> None:
    response = chat(ui, text=XSS, stream=False)
    answer = response.json()["choices"][0]["message"]["content"]
    assert XSS in answer  # the simulator echoed the payload back as model output
    request_id = response.headers["x-request-id"]
    record = wait_audited(ui, request_id)
    assert json.loads(record["bodies"]["response"])["text"] == answer

    failed = chat(ui, model="server_error", stream=False)
    wait_audited(ui, failed.headers["x-request-id"])

    login(page, ui, "#/audit")
    page.wait_for_selector(f"tr[data-request-id='{request_id}']")
    page.select_option("#f-outcome", "error")  # the filter: only failed requests
    page.click("#apply-filters")
    page.wait_for_selector(f"tr[data-request-id='{request_id}']", state="detached")
    outcomes = page.locator("#audit-rows .pill").all_text_contents()
    assert outcomes and set(outcomes) == {"error"}
    page.select_option("#f-outcome", "")
    page.click("#apply-filters")
    row = page.wait_for_selector(f"tr[data-request-id='{request_id}']")
    shot(page, shots, "audit")

    row.click()
    text = page.wait_for_selector("#detail-response-text")
    assert page.url.endswith(f"#/audit/{request_id}")
    assert text.text_content() == answer  # the literal characters, as text
    assert page.get_by_text(XSS, exact=False).first.is_visible()
    assert json.dumps(XSS) in page.text_content("#detail-request")  # the JSON body, pretty-printed
    assert page.locator("#audit-bodies img").count() == 0
    assert page.evaluate("typeof window.__xss") == "undefined"
    assert page.text_content("#detail-mode") == record["mode"]
    assert page.text_content("#detail-transport") == record["transport"] == "http"
    assert page.text_content("#detail-trace") == record["trace_context"].split("-")[1]
    page.wait_for_timeout(200)  # an injected onerror handler would have fired by now
    assert page.evaluate("typeof window.__xss") == "undefined"
    page.evaluate("window.scrollTo(0, document.querySelector('#audit-bodies').offsetTop - 300)")
    shot(page, shots, "audit-detail")


def test_audit_detail_names_a_websocket_request(page: Any, ui: Gateway) -> None:
    from websockets.sync.client import connect

    with connect(ui.url.replace("http://", "ws://") + "/v1/responses") as ws:
        ws.send(json.dumps({"type": "response.create", "model": "text", "input": "over the socket"}))
        while json.loads(ws.recv(timeout=20))["type"] != "response.completed":
            pass
    deadline = time.monotonic() + 5
    while True:  # the audit row is written off the hot path
        rows = httpx.get(ui.url + "/admin/api/audit?protocol=responses&limit=50", headers=AUTH).json()["data"]
        found = [r["request_id"] for r in rows if r["transport"] == "websocket"]
        if found or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert len(found) == 1
    login(page, ui, f"#/audit/{found[0]}")
    page.wait_for_selector("#detail-transport")
    assert page.text_content("#detail-transport") == "websocket"
    assert page.text_content("#detail-id") == found[0]


def test_audit_filters_by_transport(page: Any, ui: Gateway) -> None:
    """The Transport filter: the same model asked over HTTP and over the Responses WebSocket;
    each filter shows its own request (and the API's answer for that filter), the WebSocket
    row marked "(ws)"."""
    from websockets.sync.client import connect

    model = "echo;chunk=13"  # asked only here
    over_http = httpx.post(ui.base_url + "/responses", json={"model": model, "input": "over http"}, timeout=20)
    assert over_http.json()["status"] == "completed"
    with connect(ui.url.replace("http://", "ws://") + "/v1/responses") as ws:
        ws.send(json.dumps({"type": "response.create", "model": model, "input": "over the socket"}))
        while json.loads(ws.recv(timeout=20))["type"] != "response.completed":
            pass
    http_id = over_http.headers["x-request-id"]
    wait_audited(ui, http_id)
    deadline = time.monotonic() + 5
    while True:
        rows = httpx.get(ui.url + "/admin/api/audit", params={"model": model, "transport": "websocket"}, headers=AUTH).json()
        if rows["total"] or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    [ws_row] = rows["data"]
    assert ws_row["transport"] == "websocket" and ws_row["request_id"] != http_id

    login(page, ui, "#/audit")
    page.wait_for_selector(f"tr[data-request-id='{http_id}']")

    def apply(transport: str) -> list[str]:
        page.fill("#f-model", model)
        page.select_option("#f-transport", transport)
        loads = int(page.get_attribute("#audit-rows", "data-loads") or 0)
        page.click("#apply-filters")
        page.wait_for_function(f"Number(document.querySelector('#audit-rows').dataset.loads) > {loads}")
        return page.eval_on_selector_all("#audit-rows tr[data-request-id]", "els => els.map(e => e.dataset.requestId)")

    assert apply("websocket") == [ws_row["request_id"]]
    assert page.locator("#audit-rows td[data-col=protocol]").all_text_contents() == ["responses (ws)"]
    assert apply("http") == [http_id]
    assert page.locator("#audit-rows td[data-col=protocol]").all_text_contents() == ["responses (json)"]  # not streamed
    assert sorted(apply("")) == sorted([http_id, ws_row["request_id"]])
    page.fill("#f-model", "")
    page.click("#apply-filters")


def test_credentials_add_disable_enable_reset(page: Any, ui: Gateway, shots: Path) -> None:
    secret = "sk-webui-never-shown-0123456789"
    login(page, ui, "#/credentials")
    page.wait_for_selector("#credential-rows tr[data-credential-id]")
    assert page.locator("#credential-rows tr[data-credential-id]").count() == 1

    page.fill("#cred-base-url", "http://127.0.0.1:9/v1")
    page.fill("#cred-api-key", secret)
    page.fill("#cred-upstream", "spare")
    page.click("#add-credential-button")
    # probed at once: nothing listens on port 9, and the page says so
    page.wait_for_selector(".notice.warn:has-text('Added spare')")
    assert page.get_attribute("#probe-result", "data-ok") == "false"
    assert "could not be reached" in page.text_content("#probe-result")
    row = page.locator("#credential-rows tr", has_text="spare")
    row.wait_for()
    assert secret not in page.content()
    assert page.input_value("#cred-api-key") == ""
    [added] = [c for c in httpx.get(ui.url + "/admin/api/credentials", headers=AUTH).json()["credentials"]
               if c["upstream"] == "spare"]
    assert row.get_attribute("data-credential-id") == added["id"]

    page.fill("#cred-base-url", "http://127.0.0.1:9/v1")  # the same key again: the API's message
    page.fill("#cred-api-key", secret)
    page.fill("#cred-upstream", "spare")
    page.click("#add-credential-button")
    assert "already configured" in page.wait_for_selector(".notice.error").text_content()

    row.locator("button[data-action=disable]").click()
    row.locator(".pill.error").wait_for()
    assert "disabled by admin" in row.locator(".pill").text_content()
    assert row.locator(".cred-since").text_content().startswith("out since ")
    assert row.locator(".cred-probe").text_content() == "not probed: stays out until enabled"
    shot(page, shots, "credentials")
    row.locator("button[data-action=enable]").click()
    row.locator(".pill.ok").wait_for()
    row.locator("button[data-action=reset]").click()
    page.wait_for_selector(".notice.ok:has-text('Reset cooldown')")
    # leave the unreachable spare disabled: later requests on this gateway must not pick it
    row.locator("button[data-action=disable]").click()
    row.locator(".pill.error").wait_for()
    state = {c["id"]: c for c in httpx.get(ui.url + "/admin/api/credentials", headers=AUTH).json()["credentials"]}
    assert state[added["id"]]["disabled"] is True


def test_credentials_show_each_ones_success_rate_and_last_error(page: Any, ui: Gateway, shots: Path) -> None:
    failed = chat(ui, model="server_error", stream=False)
    ok = chat(ui)
    wait_audited(ui, failed.headers["x-request-id"])
    wait_audited(ui, ok.headers["x-request-id"])  # both in the store before it is counted twice
    rows = httpx.get(ui.url + "/admin/api/audit?limit=1000", headers=AUTH).json()["data"]
    [main] = [c for c in httpx.get(ui.url + "/admin/api/credentials", headers=AUTH).json()["credentials"]
              if c["upstream"] == "upstream"]
    attempts = [a for r in rows for a in r["upstream_attempts"] if a["credential"] == main["fingerprint"]]
    succeeded = sum(1 for a in attempts if a["status"] == 200 and not a.get("error"))
    failures = [a for a in attempts if a.get("error")]
    stats = main["stats"]
    assert (stats["succeeded"], stats["failed"]) == (succeeded, len(failures)) and failures and succeeded
    assert stats["success_rate"] == succeeded / (succeeded + len(failures))
    assert stats["last_error"]["code"] == "upstream_error" and stats["last_error"]["status"] == 500

    login(page, ui, "#/credentials")
    row = page.locator(f"#credential-rows tr[data-credential-id='{main['id']}']")
    row.wait_for()
    rate = row.locator("td.success-rate")
    assert float(rate.get_attribute("data-value")) == stats["success_rate"]
    assert rate.text_content().startswith(f"{stats['success_rate'] * 100:.1f} %")
    assert f"of {succeeded + len(failures)}" in rate.text_content()
    assert "upstream_error (HTTP 500)" in row.locator("td.last-error").text_content()
    sizes = page.evaluate("() => [document.documentElement.scrollWidth, window.innerWidth]")
    assert sizes[0] <= sizes[1]
    shot(page, shots, "credentials")


def test_without_an_admin_token_loopback_needs_the_login_url_and_its_writes_work(
    browser: Any, server_loop: ServerLoop, simulator: Simulator, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Loopback is no credential: the console asks for a login; the start-up login URL
    (generated token) enters, leaves no token in the address bar, and the page's own
    same-origin JSON writes (with the cookie) are accepted and persisted."""
    gateway = start_gateway(server_loop, simulator, tmp_path_factory)
    access = gateway.app.state.admin_access
    assert access.generated and gateway.app.state.admin_login_url.endswith("/ui/?token=" + access.token)
    context = browser.new_context(viewport=VIEWPORT)
    try:
        page = context.new_page()
        page.goto(gateway.url + "/ui/#/settings")
        page.wait_for_selector("#token")  # no way in without the token, loopback or not
        assert page.is_hidden("#topbar")

        page.goto(f"{gateway.url}/ui/?token={access.token}#/settings")
        page.wait_for_selector("#field-max_collect_bytes")
        assert access.token not in page.url and page.url.endswith("/ui/#/settings")
        assert page.text_content("#who") == "signed in" and page.is_visible("#logout")
        [cookie] = context.cookies()
        assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and cookie["path"] == "/admin"

        page.check("[data-testid=mode-realtime]")
        page.click("#save-settings")
        page.wait_for_selector(".notice.ok:has-text('Saved: stream_mode')")
        assert gateway.app.state.live.saved.load()[1]["stream_mode"] == "realtime"  # in the store
        history = httpx.get(gateway.url + "/admin/api/settings/history", headers=gateway.admin).json()["history"]
        assert history[0]["actor"] == "admin-session"

        page.goto(gateway.url + "/ui/?token=not-the-token#/dashboard")
        assert "not valid" in page.wait_for_selector(".notice.warn").text_content()
    finally:
        context.close()


def test_status_and_timeseries_agree_with_the_audit_store(ui: Gateway) -> None:
    check_status_and_timeseries(ui)


def test_status_and_timeseries_on_postgres(
    server_loop: ServerLoop, simulator: Simulator, tmp_path_factory: pytest.TempPathFactory, postgres_schema: str
) -> None:
    """The same SQL on the second backend (skipped without a test server, see conftest)."""
    settings = Settings(upstream_url=[simulator.url + "/v1"], data_dir=tmp_path_factory.mktemp("webui-pg"),
                        database_url=postgres_schema, admin_token=TOKEN)
    app = create_app(settings, {name: "default" for name in Settings.model_fields})  # type: ignore[arg-type]
    sock = bind_loopback()
    server = server_loop.run(start_embedded(app, sock))
    try:  # stopped before the fixture drops its schema
        gateway = Gateway(f"http://127.0.0.1:{sock.getsockname()[1]}", app)
        for _ in range(3):
            chat(gateway)
        check_status_and_timeseries(gateway)
    finally:
        server_loop.run(stop_embedded(*server))


def check_status_and_timeseries(ui: Gateway) -> None:
    """The two routes the dashboard reads, checked against the audit rows themselves."""
    wait_audited(ui, chat(ui, model="reasoning").headers["x-request-id"])  # streamed: TTFB, TTFT, tokens
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    body = {"model": "invalid_json", "messages": [{"role": "user", "content": "hi"}], "tools": tools}
    repaired = httpx.post(ui.base_url + "/chat/completions", json=body, timeout=20)
    repairs = len(wait_audited(ui, repaired.headers["x-request-id"])["repairs"])
    assert repairs >= 1

    view = settings_api(ui)
    saved = httpx.put(ui.url + "/admin/api/settings", headers=AUTH,
                      json={"revision": view["revision"], "changes": {"max_collect_bytes": 1024}})
    assert saved.status_code == 200
    try:
        over = chat(ui, model="large;size=5000", stream=False)
    finally:
        current = settings_api(ui)
        httpx.put(ui.url + "/admin/api/settings", headers=AUTH,
                  json={"revision": current["revision"], "changes": {"max_collect_bytes": 8 * 1024 * 1024}})
    assert wait_audited(ui, over.headers["x-request-id"])["budget_exceeded"] is True

    rows = httpx.get(ui.url + "/admin/api/audit?limit=1000", headers=AUTH).json()["data"]
    status = httpx.get(ui.url + "/admin/api/status", headers=AUTH).json()
    assert status["requests"] == len(rows)
    assert status["tool_repairs"] == sum(len(r["repairs"]) for r in rows)
    assert status["requests_with_repairs"] == sum(1 for r in rows if r["repairs"])
    assert status["budget_overflows"] == sum(1 for r in rows if r["budget_exceeded"]) >= 1
    assert status["in_flight"] == 0 and status["revision"] == settings_api(ui)["revision"]
    assert status["stream_mode"] == settings_api(ui)["settings"]["stream_mode"]["value"]
    assert {c["upstream"] for c in status["credentials"]} >= {"upstream"}
    assert all("api_key" not in c for c in status["credentials"])

    series = httpx.get(ui.url + "/admin/api/audit/timeseries?window=3600&bucket=60", headers=AUTH).json()
    assert len(series["times"]) == 60 and series["until"] % 60 == 0
    assert series["times"][0] == series["since"] and series["until"] - series["since"] == 3600
    in_window = [r for r in rows if series["since"] <= r["started_at"] < series["until"]]
    total = series["total"]
    assert sum(total["requests"]) == total["summary"]["requests"] == len(in_window)
    assert sum(total["errors"]) == sum(1 for r in in_window if r["outcome"] == "error") >= 1
    for group, column in (("by_protocol", "protocol"), ("by_mode", "mode")):
        counted = {key: value["summary"]["requests"] for key, value in series[group].items()}
        expected: dict[str, int] = {}
        for r in in_window:
            expected[r[column]] = expected.get(r[column], 0) + 1
        assert counted == expected
    ttfbs = sorted(r["ttfb_ms"] for r in in_window if r["ttfb_ms"] is not None)
    assert total["summary"]["ttfb_ms_p50"] == ttfbs[(len(ttfbs) + 1) // 2 - 1]  # nearest rank
    for name in ("ttft", "duration"):
        values = sorted(r[f"{name}_ms"] for r in in_window if r.get(f"{name}_ms") is not None)
        assert values and total["summary"][f"{name}_ms_p95"] == values[-(-len(values) * 95 // 100) - 1]
    tokens: dict[str, float] = {}
    codes: dict[str, int] = {}
    for r in in_window:
        if r["usage"].get("completion_tokens"):
            tokens[r["model"]] = tokens.get(r["model"], 0) + r["usage"]["completion_tokens"]
        if r["error_code"]:
            codes[r["error_code"]] = codes.get(r["error_code"], 0) + 1
    assert {m: v["total_output_tokens"] for m, v in series["by_model"].items()} == tokens  # < 8 models: no "other"
    assert all(sum(v["tokens_per_second"]) * 60 == v["total_output_tokens"] for v in series["by_model"].values())
    assert {c: v["total"] for c, v in series["by_error_code"].items()} == codes and codes
    # mean requests in flight per bucket: every request's duration, spread over its buckets
    busy = sum(total["in_flight_mean"]) * 60
    spent = sum(min(r["started_at"] + r["duration_ms"] / 1000, series["until"]) - r["started_at"] for r in in_window)
    assert busy == pytest.approx(spent, rel=1e-6) and busy > 0
    assert sum(sum(g["in_flight_mean"]) for g in series["by_protocol"].values()) == pytest.approx(sum(total["in_flight_mean"]))

    # per-credential stats (JSON arrays out of the store: text on SQLite, jsonb on PostgreSQL)
    for credential in httpx.get(ui.url + "/admin/api/credentials", headers=AUTH).json()["credentials"]:
        attempts = [a for r in rows for a in r["upstream_attempts"] if a["credential"] == credential["fingerprint"]]
        assert credential["stats"]["attempts"] == len(attempts)
        assert credential["stats"]["failed"] == sum(1 for a in attempts if a.get("error"))

    bad = httpx.get(ui.url + "/admin/api/audit/timeseries?window=86400&bucket=1", headers=AUTH)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "bucket"
    assert httpx.get(ui.url + "/admin/api/status?window=0", headers=AUTH).json()["error"]["param"] == "window"
    assert httpx.get(ui.url + "/admin/api/status").status_code == 401


# -- any screen: 390 px phones, 1280 px laptops ----------------------------------------------

PHONE = {"width": 390, "height": 844}
PAGES = {"dashboard": "Dashboard", "settings": "Settings", "audit": "Audit log", "credentials": "Credentials"}


def _fits(page: Any) -> dict[str, int]:
    return page.evaluate("() => ({scroll: document.documentElement.scrollWidth, inner: window.innerWidth,"
                         " body: document.body.scrollWidth})")


def test_every_page_fits_a_phone_and_is_reached_from_the_nav(browser: Any, ui: Gateway, shots: Path) -> None:
    failed = chat(ui, model="server_error", stream=False)
    wait_audited(ui, failed.headers["x-request-id"])
    context = browser.new_context(viewport=PHONE, bypass_csp=True)
    page = context.new_page()
    page.set_default_timeout(10_000)
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    try:
        login(page, ui, "#/dashboard")
        for name, title in PAGES.items():
            link = page.locator(f"#nav a[data-page={name}]")
            box = link.bounding_box()
            assert box and box["x"] >= 0 and box["x"] + box["width"] <= PHONE["width"], (name, box)  # on screen
            link.click()  # a real tap on the link: it must be visible and not covered
            page.wait_for_selector(f"h1:text('{title}')")
            page.wait_for_timeout(600 if name == "dashboard" else 300)  # charts and tables drawn
            sizes = _fits(page)
            assert sizes["scroll"] <= sizes["inner"] and sizes["body"] <= sizes["inner"], (name, sizes)
            shot(page, shots, f"phone-{name}", full_page=True)
        # one record's page too (reached from the list, as on a phone)
        page.locator("#nav a[data-page=audit]").click()
        page.locator(f"tr[data-request-id='{failed.headers['x-request-id']}']").click()
        page.wait_for_selector("#detail-error")
        sizes = _fits(page)
        assert sizes["scroll"] <= sizes["inner"], ("audit detail", sizes)
        shot(page, shots, "phone-audit-detail", full_page=True)
    finally:
        context.close()
    assert not errors, errors


def test_at_1280_the_tiles_stay_in_one_row_and_no_label_is_cut(page: Any, ui: Gateway, shots: Path) -> None:
    login(page, ui, "#/dashboard")
    page.wait_for_function("document.querySelector('#stat-requests').dataset.value !== ''")
    tiles = page.evaluate("""() => [...document.querySelectorAll('.stats .stat')].map(s => ({
        top: s.getBoundingClientRect().top,
        cut: [...s.querySelectorAll('.stat-label, .stat-value, .stat-sub')].some(e => e.scrollWidth > e.clientWidth + 1)}))""")
    assert len(tiles) == 10
    assert len({round(t["top"]) for t in tiles}) == 1, tiles  # one row: no tile wrapped under the others
    assert not any(t["cut"] for t in tiles), tiles
    for name, title in PAGES.items():
        page.locator(f"#nav a[data-page={name}]").click()
        page.wait_for_selector(f"h1:text('{title}')")
        page.wait_for_timeout(300)
        sizes = _fits(page)
        assert sizes["scroll"] <= VIEWPORT["width"], (name, sizes)
        heads = page.evaluate("() => [...document.querySelectorAll('th, label.filter, .stat-label')]"
                              ".filter(e => e.offsetParent && e.scrollWidth > e.clientWidth + 1).map(e => e.textContent)")
        assert heads == [], (name, heads)  # no header or label cut short


def test_audit_shows_and_filters_by_upstream_with_local_times(page: Any, ui: Gateway) -> None:
    ok = chat(ui, model="echo", stream=True)
    record = wait_audited(ui, ok.headers["x-request-id"])
    assert record["upstream_attempts"][-1]["upstream"] == "upstream"
    login(page, ui, "#/audit")
    row = page.locator(f"tr[data-request-id='{ok.headers['x-request-id']}']")
    row.wait_for()
    assert row.locator("td[data-col=upstream]").text_content() == "upstream"

    def apply(value: str) -> list[str]:
        page.fill("#f-upstream", value)
        loads = int(page.get_attribute("#audit-rows", "data-loads") or 0)
        page.click("#apply-filters")
        page.wait_for_function(f"Number(document.querySelector('#audit-rows').dataset.loads) > {loads}")
        return page.eval_on_selector_all("#audit-rows tr[data-request-id]", "els => els.map(e => e.dataset.requestId)")

    assert apply("no-such-upstream") == []
    found = apply("upstream")
    api = httpx.get(ui.url + "/admin/api/audit?upstream=upstream&limit=50&since=" + str(time.time() - 3600),
                    headers=AUTH).json()["data"]
    assert ok.headers["x-request-id"] in found and found == [r["request_id"] for r in api]
    assert all(a["upstream"] == "upstream" for r in api for a in r["upstream_attempts"])
    apply("")
    row.click()
    page.wait_for_selector("#detail-attempts")
    assert page.text_content("#detail-upstream") == "upstream"
    started = page.locator("#detail-attempts tbody td").all_text_contents()
    raw = str(record["upstream_attempts"][0]["started_at"])
    assert raw not in started  # not Unix seconds
    local = page.evaluate(f"""() => new Date({record['upstream_attempts'][0]['started_at']} * 1000)
        .toLocaleString(undefined, {{year: 'numeric', month: '2-digit', day: '2-digit', hour: '2-digit',
                                     minute: '2-digit', second: '2-digit'}})""")
    assert local in started


def test_credentials_delete_button_and_probe_result(page: Any, ui: Gateway, simulator: Simulator, shots: Path) -> None:
    login(page, ui, "#/credentials")
    page.wait_for_selector("#credential-rows tr[data-credential-id]")
    configured = page.locator("#credential-rows tr", has_text="upstream").first
    assert configured.locator("button[data-action=delete]").count() == 0  # from the flag: not deletable here
    page.fill("#cred-base-url", simulator.url + "/v1")
    page.fill("#cred-api-key", "sk-webui-probed-key-0123456789")
    page.fill("#cred-upstream", "second-webui")
    page.click("#add-credential-button")
    page.wait_for_selector(".notice.ok:has-text('Added second-webui')")
    assert page.get_attribute("#probe-result", "data-ok") == "true"
    assert page.text_content("#probe-result") == "probe: HTTP 200"
    row = page.locator("#credential-rows tr", has_text="second-webui")
    row.locator(".cred-probe").wait_for()
    assert "HTTP 200" in row.locator(".cred-probe").text_content()
    shot(page, shots, "credentials-probed")
    page.once("dialog", lambda dialog: dialog.accept())
    row.locator("button[data-action=delete]").click()
    page.wait_for_selector(".notice.ok:has-text('Deleted second-webui')")
    row.wait_for(state="detached")
    listed = httpx.get(ui.url + "/admin/api/credentials", headers=AUTH).json()["credentials"]
    assert "second-webui" not in {c["upstream"] for c in listed}
