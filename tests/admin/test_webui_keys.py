"""The WebUI's Keys page in Chromium (issue #28): create a key (its secret shown once, the
copy button puts it on the clipboard), edit its limits, see its usage today (also on the
dashboard's panel), revoke it. A gateway of its own: a managed key makes keys required."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from gateway.settings import Settings
from tests.admin.test_webui import CHROMIUM, CHROMIUM_ARGS, VIEWPORT, shot, shots  # noqa: F401 (fixture)
from tests.conftest import Gateway, ServerLoop, Simulator

TOKEN = "webui-keys-admin-token-5e1b"
AUTH = {"authorization": f"Bearer {TOKEN}"}

sync_api = pytest.importorskip("playwright.sync_api")

# a real browser: `make test-browser` (CI runs it), not the default suite
pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def keys_ui(server_loop: ServerLoop, simulator: Simulator, tmp_path_factory: pytest.TempPathFactory) -> Gateway:
    from gateway.app import create_app

    settings = Settings(upstream_url=[simulator.url + "/v1"], data_dir=tmp_path_factory.mktemp("webui-keys"),
                        keepalive_interval=0.5, admin_token=TOKEN)
    app = create_app(settings, {name: "default" for name in Settings.model_fields})  # type: ignore[arg-type]
    return Gateway(server_loop.serve(app), app)


@pytest.fixture
def page(keys_ui: Gateway) -> Iterator[Any]:
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} is missing")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True)
        context = browser.new_context(viewport=VIEWPORT)
        context.grant_permissions(["clipboard-read", "clipboard-write"], origin=keys_ui.url)
        page = context.new_page()
        page.set_default_timeout(10_000)
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.on("dialog", lambda dialog: dialog.accept())
        yield page
        browser.close()
    assert not errors, f"JavaScript errors in the page: {errors}"


def test_create_copy_edit_use_and_revoke_a_key(page: Any, keys_ui: Gateway, shots: Path) -> None:  # noqa: F811
    page.goto(keys_ui.url + "/#/keys")
    page.fill("#token", TOKEN)
    page.click("#login-button")
    page.wait_for_selector("h1:text('Keys')")
    assert page.locator("#nav a[data-page=keys]").get_attribute("class") == "active"
    page.fill("#key-name", "ui-team")
    page.fill("#key-models", "text*, tool")
    page.fill("#key-rpm", "5")
    page.fill("#key-daily-tokens", "100000")
    page.click("#create-key-button")
    secret = page.wait_for_selector("#key-secret-value").input_value()
    assert secret.startswith("sk-cb2a-")
    page.click("#copy-key")
    page.wait_for_selector("#key-copied:text('Copied.')")
    assert page.evaluate("navigator.clipboard.readText()") == secret
    row = page.locator("#key-rows tr[data-key-name='ui-team']")
    row.wait_for()
    assert row.locator("td").nth(2).text_content() == "text*, tool"
    assert row.locator("td").nth(3).text_content() == "5"
    shot(page, shots, "keys-created")
    [listed] = httpx.get(keys_ui.url + "/admin/api/keys", headers=AUTH).json()["keys"]
    assert (listed["name"], listed["models"], listed["rpm"], listed["daily_tokens"]) == ("ui-team", ["text*", "tool"], 5, 100000)

    row.locator("button[data-action=edit]").click()
    assert page.input_value("#edit-rpm") == "5"
    page.fill("#edit-rpm", "7")
    page.fill("#edit-tpm", "50000")
    page.click("#save-key-button")
    page.wait_for_selector(".notice.ok:has-text('Saved the limits of ui-team')")
    row.locator("td:nth-child(4):text('7')").wait_for()
    [changed] = httpx.get(keys_ui.url + "/admin/api/keys", headers=AUTH).json()["keys"]
    assert (changed["rpm"], changed["tpm"], changed["models"]) == (7, 50000, ["text*", "tool"])

    client = openai.OpenAI(base_url=keys_ui.base_url, api_key=secret, max_retries=0, _strict_response_validation=True)
    answer = client.chat.completions.create(model="text", messages=[{"role": "user", "content": "hi"}])  # type: ignore[list-item]
    assert answer.usage is not None
    page.click("#dismiss-key")
    page.reload()
    row.wait_for()
    page.wait_for_function("document.querySelector(\"#key-rows tr[data-key-name='ui-team'] .requests-today\").textContent === '1'")
    assert row.locator(".tokens-today").text_content() == str(answer.usage.total_tokens)
    assert secret not in page.content() and secret[12:] not in page.content()  # shown once only

    page.click("#nav a[data-page=dashboard]")
    panel = page.locator("#key-usage tr[data-key-name='ui-team']")
    panel.wait_for()
    assert panel.locator("td").nth(1).text_content() == "1"
    assert panel.locator("td").nth(2).text_content() == f"{answer.usage.total_tokens} of 100,000"

    page.click("#nav a[data-page=keys]")
    row.locator("button[data-action=revoke]").click()
    row.locator(".key-state .pill.error").wait_for()
    assert row.locator(".key-state").text_content().startswith("revoked")
    with pytest.raises(openai.AuthenticationError):
        client.chat.completions.create(model="text", messages=[{"role": "user", "content": "hi"}])  # type: ignore[list-item]
    shot(page, shots, "keys")
