"""Web pages against the client API (gateway/http/cross_site.py), in the default no-key loopback
set-up: foreign Origin / Sec-Fetch-Site refused on /v1 (HTTP and the WebSocket upgrade), the
Host allow-list while no key is configured, real CORS for --cors-allow-origin, and a real
Chromium page on another loopback origin that cannot open the socket or read an answer and
makes no upstream call. SDKs send no Origin and keep working (asserted here too)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from gateway.http.servers import bind_loopback
from tests.conftest import Gateway, ServerLoop, Simulator, start_gateway, wait_for
from tests.observability.test_audit import audit_rows

CHAT = {"model": "text", "messages": [{"role": "user", "content": "hi"}]}
COUNT = {"model": "text", "messages": [{"role": "user", "content": "hi"}]}
KEY = "sk-cross-site-0123456789abcdef"


def upstream_calls(simulator: Simulator) -> int:
    return sum(1 for r in simulator.requests() if r["path"].endswith("/chat/completions"))


@pytest.fixture(scope="module")
def keyless(server_loop: ServerLoop, simulator: Simulator, tmp_path_factory: pytest.TempPathFactory) -> Gateway:
    return start_gateway(server_loop, simulator, tmp_path_factory)


def _port(gw: Gateway) -> int:
    return int(gw.url.rsplit(":", 1)[1])


@pytest.mark.parametrize(
    ("path", "body", "shape"),
    [("/v1/chat/completions", CHAT, "openai"), ("/v1/messages/count_tokens", COUNT, "anthropic"),
     ("/v1/messages", {**COUNT, "max_tokens": 16}, "anthropic"), ("/v1/responses", {"model": "text", "input": "hi"}, "openai")],
)
@pytest.mark.parametrize(
    "headers",
    [{"origin": "http://evil.example"}, {"origin": "http://127.0.0.1:1"}, {"origin": "null"},
     {"sec-fetch-site": "cross-site"}, {"sec-fetch-site": "same-site"}],
)
def test_a_foreign_origin_is_refused_before_anything_goes_upstream(
    keyless: Gateway, simulator: Simulator, path: str, body: dict[str, Any], shape: str, headers: dict[str, str]
) -> None:
    """The "simple" cross-site POST a page can send without a preflight (text/plain)."""
    simulator.clear()
    response = httpx.post(keyless.url + path, content=json.dumps(body), headers={"content-type": "text/plain", **headers})
    assert response.status_code == 403 and response.headers["content-type"] == "application/json"
    if shape == "openai":
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert (error["type"], error["code"]) == ("permission_error", "cross_origin")
    else:
        assert response.json()["type"] == "error" and response.json()["error"]["type"] == "permission_error"
        assert response.json()["error"]["message"].startswith("cross_origin: ")
    assert "access-control-allow-origin" not in response.headers
    assert upstream_calls(simulator) == 0


def test_a_refused_generation_request_has_its_one_audit_record(
    server_loop: ServerLoop, simulator: Simulator, tmp_path_factory: pytest.TempPathFactory
) -> None:
    gw = start_gateway(server_loop, simulator, tmp_path_factory)
    response = httpx.post(gw.url + "/v1/chat/completions", json=CHAT, headers={"origin": "http://evil.example"})
    assert response.status_code == 403
    rows = audit_rows(gw, 1)
    assert [(r["outcome"], r["error_code"], r["http_status"]) for r in rows] == [("refused", "cross_origin", 403)]
    assert rows[0]["request_id"] == response.headers["x-request-id"]


def test_the_gateways_own_origin_and_the_sdks_are_served(keyless: Gateway) -> None:
    port = _port(keyless)
    for origin in (f"http://127.0.0.1:{port}", f"http://localhost:{port}", f"http://[::1]:{port}"):
        response = httpx.post(keyless.url + "/v1/chat/completions", json=CHAT,
                              headers={"origin": origin, "sec-fetch-site": "same-origin"})
        assert response.status_code == 200, origin
        assert response.json()["choices"][0]["message"]["content"]
    chat = openai.OpenAI(base_url=keyless.base_url, api_key="unused", _strict_response_validation=True)
    with chat.chat.completions.stream(model="text", messages=[{"role": "user", "content": "hi"}]) as stream:
        assert stream.get_final_completion().choices[0].finish_reason == "stop"
    messages = anthropic.Anthropic(base_url=keyless.url, api_key="unused", _strict_response_validation=True)
    assert messages.messages.count_tokens(model="text", messages=[{"role": "user", "content": "hi"}]).input_tokens > 0


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/models", "/v1/messages/count_tokens"])
def test_a_rebinding_host_is_refused_without_a_client_key(keyless: Gateway, simulator: Simulator, path: str) -> None:
    simulator.clear()
    method = "GET" if path == "/v1/models" else "POST"
    response = httpx.request(method, keyless.url + path, json=CHAT if method == "POST" else None,
                             headers={"host": f"evil.example:{_port(keyless)}"})
    assert response.status_code == 403
    body = response.json()
    code = body["error"]["code"] if "code" in body["error"] else body["error"]["message"].split(":")[0]
    assert code == "forbidden_host"
    assert upstream_calls(simulator) == 0


def test_with_a_client_key_the_key_is_the_fence_not_the_host(
    server_loop: ServerLoop, simulator: Simulator, tmp_path_factory: pytest.TempPathFactory
) -> None:
    gw = start_gateway(server_loop, simulator, tmp_path_factory, api_key=[KEY])
    host = {"host": "gateway.internal.example"}
    assert httpx.post(gw.url + "/v1/chat/completions", json=CHAT, headers=host).status_code == 401
    served = httpx.post(gw.url + "/v1/chat/completions", json=CHAT, headers={**host, "authorization": f"Bearer {KEY}"})
    assert served.status_code == 200 and served.json()["object"] == "chat.completion"
    # a foreign Origin is refused even with the key (a page may hold one from a leaked config)
    refused = httpx.post(gw.url + "/v1/chat/completions", json=CHAT,
                         headers={"authorization": f"Bearer {KEY}", "origin": "http://evil.example"})
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "cross_origin"


def _ws(gw: Gateway, **headers: str) -> Any:
    return connect(gw.url.replace("http://", "ws://") + "/v1/responses", additional_headers=headers)


def test_a_websocket_upgrade_from_a_foreign_origin_is_refused_before_accept(keyless: Gateway, simulator: Simulator) -> None:
    simulator.clear()
    for headers in ({"Origin": "http://evil.example"}, {"Origin": "http://127.0.0.1:1"},
                    {"Host": f"evil.example:{_port(keyless)}"}):
        with pytest.raises(InvalidStatus) as refused:
            _ws(keyless, **headers)
        response = refused.value.response
        assert response.status_code == 403
        error = json.loads(response.body)["error"]
        assert error["code"] in ("cross_origin", "forbidden_host") and error["type"] == "permission_error"
    assert upstream_calls(simulator) == 0
    with _ws(keyless, Origin=f"http://127.0.0.1:{_port(keyless)}") as ws:  # its own origin
        ws.send(json.dumps({"type": "response.create", "model": "text", "input": "hi"}))
        while json.loads(ws.recv(timeout=20))["type"] != "response.completed":
            pass


def test_a_listed_origin_gets_real_cors(server_loop: ServerLoop, simulator: Simulator, tmp_path_factory: pytest.TempPathFactory) -> None:
    app_origin = "https://app.example.com"
    gw = start_gateway(server_loop, simulator, tmp_path_factory, cors_allow_origin=[app_origin])
    preflight = httpx.options(gw.url + "/v1/chat/completions", headers={
        "origin": app_origin, "access-control-request-method": "POST",
        "access-control-request-headers": "authorization, content-type, x-stainless-lang",
    })
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == app_origin
    assert "POST" in preflight.headers["access-control-allow-methods"]
    assert preflight.headers["access-control-allow-headers"] == "authorization, content-type, x-stainless-lang"
    answer = httpx.post(gw.url + "/v1/chat/completions", json=CHAT, headers={"origin": app_origin, "sec-fetch-site": "cross-site"})
    assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"]
    assert answer.headers["access-control-allow-origin"] == app_origin
    assert "x-request-id" in answer.headers["access-control-expose-headers"]
    other = httpx.options(gw.url + "/v1/chat/completions", headers={
        "origin": "https://other.example.com", "access-control-request-method": "POST"})
    assert other.status_code == 403 and "access-control-allow-origin" not in other.headers
    with _ws(gw, Origin=app_origin) as ws:
        ws.send(json.dumps({"type": "response.create", "model": "text", "input": "hi"}))
        while json.loads(ws.recv(timeout=20))["type"] != "response.completed":
            pass


# -- a real browser -------------------------------------------------------------------------

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--no-first-run"]

EVIL_PAGE = """<!doctype html><meta charset=utf-8><title>evil</title><script>
window.results = {};
const gw = "GATEWAY";
const ws = new WebSocket(gw.replace("http://", "ws://") + "/v1/responses");
ws.onopen = () => { results.ws_open = true; ws.send(JSON.stringify({type: "response.create", model: "text", input: "steal"})); };
ws.onmessage = (e) => { (results.ws_messages = results.ws_messages || []).push(JSON.parse(e.data).type); };
ws.onclose = (e) => { results.ws_closed = e.code; };
const chat = JSON.stringify({model: "text", messages: [{role: "user", content: "steal"}]});
fetch(gw + "/v1/chat/completions", {method: "POST", headers: {"content-type": "text/plain"}, body: chat})
  .then((r) => r.text()).then((t) => { results.chat = t; }, (e) => { results.chat_error = String(e); });
fetch(gw + "/v1/messages/count_tokens", {method: "POST", headers: {"content-type": "text/plain"}, body: chat})
  .then((r) => r.text()).then((t) => { results.count = t; }, (e) => { results.count_error = String(e); });
fetch(gw + "/v1/chat/completions", {method: "POST", mode: "no-cors", headers: {"content-type": "text/plain"}, body: chat})
  .then(() => { results.blind = "sent"; }, (e) => { results.blind = String(e); });
</script>"""


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    try:
        from playwright import sync_api
    except ImportError:  # pragma: no cover
        if os.environ.get("CI"):
            raise
        pytest.skip("playwright is not installed (pip install -e '.[dev]')")
    if not CHROMIUM.exists():
        message = f"{CHROMIUM} is missing (Debian: apt-get install -y --no-install-recommends chromium)"
        if os.environ.get("CI"):
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True)
        yield browser
        browser.close()


def _page_server(server_loop: ServerLoop, target: dict[str, str], host: str) -> str:
    """The evil page, served from another loopback origin (``host``, a port of its own),
    aimed at ``target["url"]`` (read per visit, so the origin can be listed first)."""
    from starlette.applications import Starlette
    from starlette.responses import HTMLResponse
    from starlette.routing import Route

    from gateway.http.servers import start_embedded

    async def page(request: Any) -> HTMLResponse:
        return HTMLResponse(EVIL_PAGE.replace("GATEWAY", target["url"]))

    sock = bind_loopback(host=host)
    server_loop._servers.append(server_loop.run(start_embedded(Starlette(routes=[Route("/", page)]), sock)))
    return f"http://{host}:{sock.getsockname()[1]}"


def _visit(browser: Any, url: str) -> dict[str, Any]:
    page = browser.new_page()
    try:
        page.goto(url)
        page.wait_for_function(FINISHED, timeout=20_000)
        return page.evaluate("window.results")  # type: ignore[no-any-return]
    finally:
        page.close()


FINISHED = ("() => ('ws_closed' in results || (results.ws_messages || []).includes('response.completed')) && ('chat' in results || 'chat_error' in results)"
            " && ('count' in results || 'count_error' in results) && 'blind' in results")


@pytest.mark.browser
def test_a_cross_site_page_in_chromium_gets_nothing_and_reaches_no_upstream(
    browser: Any, server_loop: ServerLoop, simulator: Simulator, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The same page from a listed origin (the control: the page's code works there) and from
    unlisted ones (127.0.0.2, and 127.0.0.1 on another port: both foreign origins)."""
    target = {"url": ""}
    listed = _page_server(server_loop, target, "127.0.0.2")
    evil_pages = [_page_server(server_loop, target, "127.0.0.2"), _page_server(server_loop, target, "127.0.0.1")]
    gw = start_gateway(server_loop, simulator, tmp_path_factory, cors_allow_origin=[listed])
    target["url"] = gw.url

    simulator.clear()
    control = _visit(browser, listed)
    assert control["ws_open"] is True and control["ws_messages"][-1] == "response.completed", control
    assert json.loads(control["chat"])["choices"][0]["message"]["content"]
    assert json.loads(control["count"])["input_tokens"] > 0
    wait_for(lambda: upstream_calls(simulator) == 3)  # the socket's answer and two chat completions

    for evil in evil_pages:
        simulator.clear()
        results = _visit(browser, evil)
        assert "ws_open" not in results and "ws_messages" not in results, (evil, results)
        assert results["ws_closed"] == 1006  # the upgrade was refused: never a socket
        assert "chat" not in results and "Failed to fetch" in results["chat_error"]
        assert "count" not in results and "Failed to fetch" in results["count_error"]
        assert results["blind"] == "sent"  # an opaque no-cors request goes out ...
        assert upstream_calls(simulator) == 0, evil  # ... and is refused before anything goes upstream
    rows = audit_rows(gw, 5)  # the control's two chat completions and socket answer; each evil page's two chat POSTs
    refused = [r for r in rows if r["outcome"] == "refused"]
    assert len(refused) == 4 and {r["error_code"] for r in refused} == {"cross_origin"}


def test_a_key_saved_at_run_time_moves_the_fence_from_the_host_to_the_key(
    server_loop: ServerLoop, simulator: Simulator, tmp_path_factory: pytest.TempPathFactory
) -> None:
    gw = start_gateway(server_loop, simulator, tmp_path_factory)
    host = {"host": "gateway.internal.example"}
    assert httpx.post(gw.url + "/v1/chat/completions", json=CHAT, headers=host).json()["error"]["code"] == "forbidden_host"
    gw.live.update({"api_key": [KEY]})  # what the admin API's settings write does
    served = httpx.post(gw.url + "/v1/chat/completions", json=CHAT, headers={**host, "authorization": f"Bearer {KEY}"})
    assert served.status_code == 200 and served.json()["object"] == "chat.completion"
    gw.live.update({}, unset=("api_key",))
    assert httpx.post(gw.url + "/v1/chat/completions", json=CHAT, headers=host).json()["error"]["code"] == "forbidden_host"
