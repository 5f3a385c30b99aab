"""The WebUI dashboard's facts line says whether rollout capture is on and where each
upstream's token ids come from (`#dash-capture`, from `GET /admin/api/status`'s `capture`,
gateway/rollout/facts.py), and says nothing of capture when it is off; in Chromium."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.settings import Settings
from tests.admin.test_webui import VIEWPORT, browser  # noqa: F401 (fixture)
from tests.conftest import Gateway, ServerLoop, Simulator

TOKEN = "webui-capture-admin-token-5e21"

pytest.importorskip("playwright.sync_api")

# a real browser: `make test-browser` (CI runs it), not the default suite
pytestmark = pytest.mark.browser


def serve(server_loop: ServerLoop, simulator: Simulator, data_dir: Path, **overrides: Any) -> Gateway:
    from gateway.app import create_app

    settings = Settings(upstream_url=[simulator.url + "/v1"], data_dir=data_dir, keepalive_interval=0.5,
                        admin_token=TOKEN, **overrides)
    app = create_app(settings, {name: "default" for name in Settings.model_fields})  # type: ignore[arg-type]
    return Gateway(server_loop.serve(app), app)


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:  # noqa: F811
    context = browser.new_context(viewport=VIEWPORT)
    page = context.new_page()
    page.set_default_timeout(15_000)
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    yield page
    context.close()
    assert not errors, f"JavaScript errors in the page: {errors}"


def dashboard_facts(page: Any, gateway: Gateway) -> str:
    page.goto(gateway.url + "/#/dashboard")
    page.fill("#token", TOKEN)
    page.click("#login-button")
    page.wait_for_selector("#dash-mode")  # the facts line is drawn
    return page.text_content("#dash-mode >> xpath=..")  # type: ignore[no-any-return]


def test_the_dashboard_says_capture_is_on_with_its_token_source(
    server_loop: ServerLoop, simulator: Simulator, tmp_path: Path, page: Any
) -> None:
    gateway = serve(server_loop, simulator, tmp_path, capture_tokens="vllm")
    status = httpx.get(gateway.url + "/admin/api/status", headers={"authorization": f"Bearer {TOKEN}"}).json()
    assert status["capture"]["token_sources"] == {"upstream": "vllm"}
    facts = dashboard_facts(page, gateway)
    assert page.text_content("#dash-capture") == "ON, token ids from upstream vllm"
    assert "· capture ON, token ids from upstream vllm" in " ".join(facts.split())


def test_the_dashboard_says_nothing_of_capture_when_it_is_off(
    server_loop: ServerLoop, simulator: Simulator, tmp_path: Path, page: Any
) -> None:
    gateway = serve(server_loop, simulator, tmp_path)
    facts = dashboard_facts(page, gateway)
    assert "Stream mode" in facts and "audit queue" in facts  # the line is there, whole
    assert page.query_selector("#dash-capture") is None and "capture" not in facts
