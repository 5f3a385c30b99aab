"""The WebUI for an operator putting the gateway in front of a team (issue #38), in Chromium at
390 px (a phone) and 1280 px (a laptop): the audit list names each request's managed key and
filters by it, a long model name reads in full, an empty dashboard offers a first request to
copy and run, the live indicator says "offline" when the gateway does not answer, and the Keys
page warns before the first key locks /v1.

A fresh gateway per test (a managed key locks /v1 for good, and the empty dashboard needs a
store with no requests)."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from gateway.settings import Settings
from tests.admin.test_webui import CHROMIUM, VIEWPORT, browser, shot, shots  # noqa: F401 (fixtures)
from tests.conftest import Gateway, ServerLoop, Simulator

TOKEN = "webui-operator-admin-token-41c9"
AUTH = {"authorization": f"Bearer {TOKEN}"}
PHONE = {"width": 390, "height": 844}
SCREENS = [pytest.param(PHONE, id="390px"), pytest.param(VIEWPORT, id="1280px")]
LONG_MODEL = "team-alpha/qwen2.5-coder-32b-instruct"

pytest.importorskip("playwright.sync_api")

# a real browser: `make test-browser` (CI runs it), not the default suite
pytestmark = pytest.mark.browser


@pytest.fixture
def fresh(server_loop: ServerLoop, simulator: Simulator, tmp_path: Path) -> Gateway:
    from gateway.app import create_app

    settings = Settings(upstream_url=[simulator.url + "/v1"], data_dir=tmp_path, keepalive_interval=0.5, admin_token=TOKEN)
    app = create_app(settings, {name: "default" for name in Settings.model_fields})  # type: ignore[arg-type]
    return Gateway(server_loop.serve(app), app)


@pytest.fixture
def screen(request: pytest.FixtureRequest) -> dict[str, int]:
    return request.param  # type: ignore[no-any-return]


@pytest.fixture
def page(browser: Any, fresh: Gateway, screen: dict[str, int]) -> Iterator[Any]:  # noqa: F811
    context = browser.new_context(viewport=screen, bypass_csp=True)
    context.grant_permissions(["clipboard-read", "clipboard-write"], origin=fresh.url)
    page = context.new_page()
    page.set_default_timeout(15_000)
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.on("dialog", lambda dialog: dialog.accept())
    yield page
    context.close()
    assert not errors, f"JavaScript errors in the page: {errors}"


def login(page: Any, gateway: Gateway, hash_: str) -> None:
    page.goto(gateway.url + "/" + hash_)
    page.fill("#token", TOKEN)
    page.click("#login-button")
    page.wait_for_selector("#topbar:not([hidden])")


def no_page_scroll(page: Any, screen: dict[str, int]) -> None:
    sizes = page.evaluate("() => ({scroll: document.documentElement.scrollWidth, body: document.body.scrollWidth})")
    assert sizes["scroll"] <= screen["width"] and sizes["body"] <= screen["width"], sizes


def on_screen(box: dict[str, float] | None, screen: dict[str, int]) -> None:
    assert box is not None and box["x"] >= 0 and box["x"] + box["width"] <= screen["width"] + 0.5, box


def wait_audited(gateway: Gateway, request_id: str) -> dict[str, Any]:
    deadline = time.monotonic() + 10
    while True:
        response = httpx.get(f"{gateway.url}/admin/api/audit/{request_id}", headers=AUTH)
        if response.status_code == 200:
            return response.json()  # type: ignore[no-any-return]
        assert time.monotonic() < deadline, f"{request_id} never reached the audit store"
        time.sleep(0.05)


def create_key(gateway: Gateway, name: str) -> dict[str, Any]:
    response = httpx.post(gateway.url + "/admin/api/keys", headers=AUTH, json={"name": name})
    assert response.status_code == 201, response.text
    return response.json()  # type: ignore[no-any-return]


@pytest.mark.parametrize("screen", SCREENS, indirect=True)
def test_audit_names_each_requests_key_filters_by_it_and_shows_long_model_names_in_full(
    page: Any, fresh: Gateway, screen: dict[str, int], shots: Path  # noqa: F811
) -> None:
    alpha, beta = create_key(fresh, "team-alpha"), create_key(fresh, "team-beta")
    ids: dict[str, list[str]] = {"team-alpha": [], "team-beta": []}
    for key, model in ((alpha, LONG_MODEL), (beta, "echo"), (alpha, "echo")):
        client = openai.OpenAI(base_url=fresh.base_url, api_key=key["key"], max_retries=0, _strict_response_validation=True)
        raw = client.chat.completions.with_raw_response.create(model=model, messages=[{"role": "user", "content": "hi"}])
        assert raw.parse().choices[0].message.content
        ids[key["name"]].append(raw.headers["x-request-id"])
    for request_id in ids["team-alpha"] + ids["team-beta"]:
        wait_audited(fresh, request_id)

    login(page, fresh, "#/audit")
    page.wait_for_selector(f"tr[data-request-id='{ids['team-beta'][0]}']")
    heads = page.locator("#audit-table th").all_text_contents()
    assert "Key" in heads and "Model" in heads
    keys_shown = {row.get_attribute("data-request-id"): row.locator("td[data-col=key]").text_content()
                  for row in page.locator("#audit-rows tr[data-request-id]").all()}
    assert keys_shown == {i: name for name, group in ids.items() for i in group}
    key_cell = page.locator(f"tr[data-request-id='{ids['team-beta'][0]}'] td[data-col=key]")
    assert key_cell.is_visible() and key_cell.evaluate("e => e.scrollWidth <= e.clientWidth")  # "team-beta", not cut

    # the long model name: all of it in the cell, nothing hidden (wrapped at most over two lines)
    model_cell = page.locator(f"tr[data-request-id='{ids['team-alpha'][0]}'] td[data-col=model]")
    model_cell.scroll_into_view_if_needed()
    assert model_cell.text_content() == LONG_MODEL
    fit = model_cell.evaluate("""e => { const text = document.createRange(); text.selectNodeContents(e);
        return {scroll: e.scrollWidth, client: e.clientWidth,
                lines: new Set([...text.getClientRects()].map(r => Math.round(r.top))).size}; }""")
    assert fit["scroll"] <= fit["client"], fit
    assert fit["lines"] <= 2, fit
    if screen["width"] == VIEWPORT["width"]:  # a laptop: the whole row on screen, no scrolling at all
        on_screen(model_cell.bounding_box(), screen)
        card = page.evaluate("() => [document.querySelector('.table-card').scrollWidth, document.querySelector('.table-card').clientWidth]")
        assert card[0] <= card[1], card
    no_page_scroll(page, screen)  # a phone: the table scrolls inside its card, never the page
    shot(page, shots, f"audit-keys-{screen['width']}")

    page.select_option("#f-key", label="team-alpha")
    loads = int(page.get_attribute("#audit-rows", "data-loads") or 0)
    page.click("#apply-filters")
    page.wait_for_function(f"Number(document.querySelector('#audit-rows').dataset.loads) > {loads}")
    shown = page.eval_on_selector_all("#audit-rows tr[data-request-id]", "els => els.map(e => e.dataset.requestId)")
    api = httpx.get(f"{fresh.url}/admin/api/audit", params={"key_id": alpha["id"]}, headers=AUTH).json()["data"]
    assert sorted(shown) == sorted(ids["team-alpha"]) == sorted(r["request_id"] for r in api)
    assert set(page.locator("#audit-rows td[data-col=key]").all_text_contents()) == {"team-alpha"}

    page.locator(f"tr[data-request-id='{ids['team-alpha'][0]}']").click()
    assert page.wait_for_selector("#detail-key").text_content() == "team-alpha"
    assert alpha["key"] not in page.content() and beta["key"] not in page.content()


@pytest.mark.parametrize("screen", SCREENS, indirect=True)
def test_an_empty_dashboard_offers_a_first_request_to_copy_and_run(
    page: Any, fresh: Gateway, screen: dict[str, int], shots: Path  # noqa: F811
) -> None:
    login(page, fresh, "#/dashboard")
    hint = page.wait_for_selector("#first-request:not([hidden])")
    assert "No requests yet" in hint.text_content()
    assert page.is_hidden(".charts")  # not a wall of blank charts
    command = page.text_content("#first-request-command")
    assert command.startswith(f"curl -sS {fresh.url}/v1/chat/completions")
    assert TOKEN not in page.content() and "authorization" not in command  # no secret, and none needed here
    on_screen(page.locator("#first-request-command").bounding_box(), screen)
    no_page_scroll(page, screen)
    shot(page, shots, f"dashboard-empty-{screen['width']}", full_page=True)

    page.click("#copy-first-request")
    page.wait_for_selector("#first-request-copied:text('Copied.')")
    copied = page.evaluate("navigator.clipboard.readText()")
    assert copied == command
    ran = subprocess.run(["bash", "-c", copied], capture_output=True, text=True, timeout=30, check=True)
    answer = json.loads(ran.stdout)
    assert answer["object"] == "chat.completion" and answer["choices"][0]["message"]["content"]

    page.wait_for_selector("#first-request", state="hidden")  # the next poll sees the request
    assert page.is_visible(".charts")
    assert page.wait_for_selector("#stat-requests[data-value='1']")


@pytest.mark.parametrize("screen", SCREENS, indirect=True)
def test_the_live_indicator_says_offline_when_the_gateway_does_not_answer(
    page: Any, fresh: Gateway, screen: dict[str, int], shots: Path  # noqa: F811
) -> None:
    login(page, fresh, "#/dashboard")
    live = page.wait_for_selector("#live-state[data-state=live]")
    assert live.text_content() == "live"
    green = page.eval_on_selector("#live-state .live-dot", "e => getComputedStyle(e).backgroundColor")

    # refused connections: what the browser sees when the gateway is down
    page.route("**/admin/api/**", lambda route: route.abort("connectionrefused"))
    page.wait_for_selector("#live-state[data-state=offline]")
    assert page.text_content("#live-state").startswith("offline: the gateway does not answer")
    assert page.eval_on_selector("#live-state .live-dot", "e => getComputedStyle(e).backgroundColor") != green
    assert page.is_visible("#live-state .live-text")
    on_screen(page.locator("#live-state").bounding_box(), screen)
    no_page_scroll(page, screen)
    shot(page, shots, f"dashboard-offline-{screen['width']}")

    page.unroute("**/admin/api/**")  # the gateway answers again
    page.wait_for_selector("#live-state[data-state=live]")
    assert page.text_content("#live-state") == "live"

    if screen["width"] == VIEWPORT["width"]:  # a gateway that accepts and never answers: the poll's bound says offline
        page.route("**/admin/api/status*", lambda route: None)
        page.wait_for_selector("#live-state[data-state=offline]", timeout=30_000)
        page.unroute("**/admin/api/status*")
        page.wait_for_selector("#live-state[data-state=live]")


@pytest.mark.parametrize("screen", SCREENS, indirect=True)
def test_the_keys_page_warns_before_the_first_key_locks_v1(
    page: Any, fresh: Gateway, screen: dict[str, int], shots: Path  # noqa: F811
) -> None:
    body = {"model": "echo", "messages": [{"role": "user", "content": "hi"}]}
    assert httpx.post(fresh.base_url + "/chat/completions", json=body, timeout=20).status_code == 200  # open on loopback

    login(page, fresh, "#/keys")
    notice = page.wait_for_selector("#keys-lock-notice:not([hidden])")
    assert notice.get_attribute("data-state") == "open"
    assert notice.text_content().startswith("Creating the first key locks /v1.")
    assert "loopback calls included" in notice.text_content()
    box = page.locator("#keys-lock-notice").bounding_box()
    on_screen(box, screen)
    create_button = page.locator("#create-key-button").bounding_box()
    assert box is not None and create_button is not None and box["y"] < create_button["y"]  # read before the click
    no_page_scroll(page, screen)
    shot(page, shots, f"keys-warning-{screen['width']}", full_page=True)

    page.fill("#key-name", "first")
    page.click("#create-key-button")
    secret = page.wait_for_selector("#key-secret-value").input_value()
    page.wait_for_selector("#keys-lock-notice[data-state=required]")
    assert page.text_content("#keys-lock-notice") == "Every /v1 request needs a key, loopback calls included."
    assert httpx.post(fresh.base_url + "/chat/completions", json=body, timeout=20).status_code == 401  # as warned
    headers = {"authorization": f"Bearer {secret}"}
    assert httpx.post(fresh.base_url + "/chat/completions", json=body, headers=headers, timeout=20).status_code == 200

    page.click("#dismiss-key")
    page.locator("#key-rows tr[data-key-name='first'] button[data-action=revoke]").click()
    page.wait_for_selector("#keys-lock-notice[data-state=locked]")
    assert "none is usable" in page.text_content("#keys-lock-notice")


@pytest.fixture
def priced(server_loop: ServerLoop, simulator: Simulator, tmp_path: Path) -> Gateway:
    from gateway.app import create_app

    config = tmp_path / "prices.toml"
    config.write_text(f'[[upstreams]]\nname = "sim"\nbase_url = "{simulator.url}/v1"\n\n'
                      '[models."text"]\nprice = { input = 3.0, output = 15.0 }\n')
    settings = Settings(data_dir=tmp_path / "data", keepalive_interval=0.5, admin_token=TOKEN, config=config)
    app = create_app(settings, {name: "default" for name in Settings.model_fields})  # type: ignore[arg-type]
    return Gateway(server_loop.serve(app), app)


@pytest.mark.parametrize("screen", SCREENS, indirect=True)
def test_the_keys_page_sets_and_shows_a_money_budget_and_what_is_left(
    browser: Any, priced: Gateway, screen: dict[str, int], shots: Path  # noqa: F811
) -> None:
    context = browser.new_context(viewport=screen, bypass_csp=True)
    page = context.new_page()
    page.set_default_timeout(15_000)
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    try:
        login(page, priced, "#/keys")
        page.fill("#key-name", "money-ui")
        page.fill("#key-budget-tokens", "500000")
        page.fill("#key-budget-cost", "2.5")
        page.select_option("#key-budget-period", "month")
        page.click("#create-key-button")
        secret = page.wait_for_selector("#key-secret-value").input_value()
        row = page.locator("#key-rows tr[data-key-name='money-ui'] td.budget")
        row.wait_for()
        assert row.evaluate("e => e.firstChild.textContent") == "500,000 tokens, 2.50 / month"
        assert row.locator(".budget-left").text_content() == "left: 500,000 tokens, 2.5000"
        [listed] = httpx.get(priced.url + "/admin/api/keys", headers=AUTH).json()["keys"]
        assert (listed["budget_tokens"], listed["budget_cost"], listed["budget_period"]) == (500_000, 2.5, "month")

        client = openai.OpenAI(base_url=priced.base_url, api_key=secret, max_retries=0, _strict_response_validation=True)
        answer = client.chat.completions.create(model="text", messages=[{"role": "user", "content": "hi"}])  # type: ignore[list-item]
        assert answer.usage is not None
        spent = (answer.usage.prompt_tokens * 3.0 + answer.usage.completion_tokens * 15.0) / 1e6
        page.click("#dismiss-key")
        expected = f"left: {500_000 - answer.usage.total_tokens:,} tokens, {2.5 - spent:.4f}"
        deadline = time.monotonic() + 10
        while row.locator(".budget-left").text_content() != expected:  # settled after the answer
            assert time.monotonic() < deadline, row.locator(".budget-left").text_content()
            page.reload()
            row.wait_for()
        on_screen(page.locator("#create-key-button").bounding_box(), screen)
        no_page_scroll(page, screen)
        shot(page, shots, f"keys-money-{screen['width']}", full_page=True)

        # a change through the edit form, and a bad value named by the API
        page.locator("#key-rows tr[data-key-name='money-ui'] button[data-action=edit]").click()
        assert page.input_value("#edit-budget-cost") == "2.5" and page.input_value("#edit-budget-period") == "month"
        page.fill("#edit-budget-cost", "4")
        page.select_option("#edit-budget-period", "week")
        page.click("#save-key-button")
        page.wait_for_selector(".notice.ok:has-text('Saved the limits of money-ui')")
        page.wait_for_selector("#key-rows tr[data-key-name='money-ui'] td.budget:has-text('4.00 / week')")
        page.fill("#key-name", "bad-money")
        page.fill("#key-budget-cost", "10000000000")  # over the API's bound (the field stops negatives itself)
        page.click("#create-key-button")
        page.wait_for_selector(".notice.error:has-text('budget_cost must be a number')")
    finally:
        context.close()
    assert not errors, errors
