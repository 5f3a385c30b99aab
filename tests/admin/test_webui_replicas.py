"""The WebUI's last two operator items of issue #38, in Chromium at 390 px and 1280 px: the
dashboard names this replica, caps its "In flight" tile at this replica's share of
``max_concurrent`` (not the global cap) and lists the live replicas with their usable
credentials, saying plainly when they disagree; the Credentials page shows each credential's
label with its fingerprint and takes a label when one is added.

The replicas: two gateways on one fresh PostgreSQL schema (as tests/store/test_replicas.py
starts them), B with one more upstream than A, so they disagree on usable credentials."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.app import create_app
from gateway.http.servers import bind_loopback, start_embedded, stop_embedded
from gateway.settings import Settings
from gateway.simulator.server import create_simulator_app
from tests.admin.test_webui import browser, shot, shots  # noqa: F401 (fixtures)
from tests.admin.test_webui_operator import AUTH, SCREENS, TOKEN, login, no_page_scroll, on_screen
from tests.conftest import Gateway, ServerLoop, Simulator, fresh_schema, wait_for

pytest.importorskip("playwright.sync_api")

# a real browser: `make test-browser` (CI runs it), not the default suite
pytestmark = pytest.mark.browser

MAX_CONCURRENT = 6
CONFIG_KEY = "sk-webui-config-key-7f3a9c1e"


@pytest.fixture(scope="module")
def replicas(server_loop: ServerLoop, postgres_url: str,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Gateway, Gateway]]:
    """replica-a (one upstream) and replica-b (that one and a second simulator) on one store."""
    with fresh_schema(postgres_url) as url:
        sims = [Simulator(server_loop.serve(create_simulator_app())) for _ in range(2)]
        upstreams = {"replica-a": [sims[0].url + "/v1"], "replica-b": [sims[0].url + "/v1", sims[1].url + "/v1"]}
        servers, gateways = [], []
        try:
            for name, urls in upstreams.items():
                config = Settings(upstream_url=urls, data_dir=tmp_path_factory.mktemp(name), database_url=url,
                                  replica_id=name, max_concurrent=MAX_CONCURRENT, keepalive_interval=0.5,
                                  admin_token=TOKEN)
                app = create_app(config, {n: "default" for n in Settings.model_fields})  # type: ignore[arg-type]
                sock = bind_loopback()
                servers.append(server_loop.run(start_embedded(app, sock)))
                gateways.append(Gateway(f"http://127.0.0.1:{sock.getsockname()[1]}", app))
            a, b = gateways
            # both know the membership before anything is looked at (A learns of B at its next beat)
            wait_for(lambda: all(len(g.app.state.replication.capacity.live) == 2 for g in (a, b)))
            yield a, b
        finally:
            for server in reversed(servers):
                server_loop.run(stop_embedded(*server))


@pytest.fixture
def labelled(server_loop: ServerLoop, simulator: Simulator, tmp_path: Path) -> Gateway:
    """A gateway alone with one configured key (its default label: where it came from)."""
    settings = Settings(upstream_url=[simulator.url + "/v1"], upstream_api_key=CONFIG_KEY, data_dir=tmp_path,
                        keepalive_interval=0.5, admin_token=TOKEN)
    app = create_app(settings, {name: "default" for name in Settings.model_fields})  # type: ignore[arg-type]
    return Gateway(server_loop.serve(app), app)


@pytest.fixture
def screen(request: pytest.FixtureRequest) -> dict[str, int]:
    return request.param  # type: ignore[no-any-return]


@pytest.fixture
def page(browser: Any, screen: dict[str, int]) -> Iterator[Any]:  # noqa: F811
    context = browser.new_context(viewport=screen, bypass_csp=True)
    page = context.new_page()
    page.set_default_timeout(15_000)
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.on("dialog", lambda dialog: dialog.accept())
    yield page
    context.close()
    assert not errors, f"JavaScript errors in the page: {errors}"


@pytest.mark.parametrize("screen", SCREENS, indirect=True)
def test_the_dashboard_names_this_replica_its_share_and_the_live_replicas_that_disagree(
    replicas: tuple[Gateway, Gateway], page: Any, screen: dict[str, int], shots: Path  # noqa: F811
) -> None:  # replicas first: their apps are made before Playwright runs its event loop in this thread
    a, b = replicas
    wait_for(lambda: {m["replica_id"]: m.get("credentials_usable") for m in httpx.get(
        a.url + "/admin/api/status", headers=AUTH).json()["replica"]["live"]} == {"replica-a": 1, "replica-b": 2})
    login(page, a, "#/dashboard")
    card = page.wait_for_selector("#replicas[data-replica='replica-a']")
    assert page.text_content("#dash-replica") == "replica-a"  # the facts line says which replica answers

    # the In flight tile: this replica's share (6 over 2 replicas: 3), never the global 6
    share = MAX_CONCURRENT // 2
    assert page.get_attribute("#stat-inflight", "data-cap") == str(share)
    sub = page.text_content("#stat-inflight .stat-sub")
    assert sub == f"now, of {share} allowed here", sub
    assert page.locator("#stat-inflight .stat-sub").evaluate("e => e.scrollWidth <= e.clientWidth")  # not cut
    assert page.text_content("#replica-share") == str(share)
    assert f"of the {MAX_CONCURRENT} shared by 2 live replica(s)" in page.text_content("#replica-self")

    # both live replicas, each with its share and usable credentials, this one marked
    rows = {row.get_attribute("data-replica-id"): row for row in page.locator("#replica-rows tr").all()}
    assert set(rows) == {"replica-a", "replica-b"}
    assert rows["replica-a"].get_attribute("data-self") == "true" and "(this one)" in rows["replica-a"].text_content()
    assert rows["replica-b"].get_attribute("data-self") == "false"
    cells = {rid: row.locator("td").all_text_contents() for rid, row in rows.items()}
    assert [cells[r][3] for r in ("replica-a", "replica-b")] == [str(share), str(share)]
    assert (cells["replica-a"][4], cells["replica-b"][4]) == ("1", "2")
    agreement = page.locator("#replicas-agreement")
    assert agreement.get_attribute("data-agree") == "false"
    assert agreement.text_content() == "mismatch Replicas disagree on usable credentials: replica-a 1, replica-b 2"
    on_screen(agreement.bounding_box(), screen)
    assert card.evaluate("e => e.scrollWidth <= e.clientWidth")  # the table fits its card at 390 px too
    no_page_scroll(page, screen)
    card.scroll_into_view_if_needed()
    shot(page, shots, f"dashboard-replicas-{screen['width']}")

    # B's dashboard names B: the same card seen from the other replica (A's session cookie,
    # sent to any port of 127.0.0.1, is forgotten first: B asks for the token itself)
    page.context.clear_cookies()
    login(page, b, "#/dashboard")
    page.wait_for_selector("#replicas[data-replica='replica-b']")
    assert page.get_attribute("#replica-rows tr[data-self=true]", "data-replica-id") == "replica-b"


@pytest.mark.parametrize("screen", SCREENS, indirect=True)
def test_credentials_show_their_label_and_the_add_form_takes_one(
    page: Any, labelled: Gateway, simulator: Simulator, screen: dict[str, int], shots: Path  # noqa: F811
) -> None:
    [configured] = httpx.get(labelled.url + "/admin/api/credentials", headers=AUTH).json()["credentials"]
    assert configured["label"] == "--upstream-api-key"  # the default: where the key came from

    login(page, labelled, "#/credentials")
    row = page.locator(f"#credential-rows tr[data-credential-id='{configured['id']}']")
    assert row.locator(".cred-label").text_content() == "--upstream-api-key"
    assert row.locator(".cred-fingerprint").text_content() == configured["fingerprint"]

    # a label that looks like markup is shown as the text it is
    label = "<b>team-beta</b> rotation 2026-12"
    page.fill("#cred-base-url", simulator.url + "/v1")
    page.fill("#cred-api-key", "sk-webui-labelled-key-0123456789")
    page.fill("#cred-upstream", "second-webui")
    page.fill("#cred-label", label)
    page.click("#add-credential-button")
    page.wait_for_selector("#probe-result")
    assert label in page.text_content(".notice")
    added = page.locator("#credential-rows tr", has_text="second-webui")
    added.locator(".cred-label").wait_for()
    assert added.locator(".cred-label").text_content() == label
    assert added.locator(".cred-label b").count() == 0
    assert page.input_value("#cred-label") == ""
    listed = {c["upstream"]: c for c in httpx.get(labelled.url + "/admin/api/credentials", headers=AUTH).json()["credentials"]}
    assert listed["second-webui"]["label"] == label
    assert added.locator(".cred-fingerprint").text_content() == listed["second-webui"]["fingerprint"]
    assert CONFIG_KEY not in page.content() and "sk-webui-labelled-key" not in page.content()

    on_screen(page.locator("#cred-label").bounding_box(), screen)
    no_page_scroll(page, screen)  # the table scrolls inside its card on a phone
    shot(page, shots, f"credentials-labels-{screen['width']}", full_page=True)

    # the same gateway alone: its cap is all of max_concurrent, and the card says why
    cap = labelled.live.current.max_concurrent
    page.click("#nav a[data-page=dashboard]")
    page.wait_for_selector("#replicas[data-share]")
    assert page.get_attribute("#stat-inflight", "data-cap") == str(cap)
    assert page.text_content("#stat-inflight .stat-sub") == f"now, of {cap} allowed"
    assert page.text_content("#replica-self") == f"This replica standalone shares its store with no one: its cap is all of {cap}."
