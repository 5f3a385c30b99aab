"""Hostile input at the gateway's edge (issue #14): the admin surface against other web
pages, the request-body limit before anything is buffered, and secrets that never leave.

Real gateways on loopback in front of the session simulator; raw sockets where the test is
about what was sent and read on the wire.
"""

from __future__ import annotations

import io
import json
import logging
import socket
import sqlite3
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import structlog

from gateway.app import create_app
from gateway.http.connections import ConnectionLimits, protocol_class
from gateway.observability.logging import configure_logging
from gateway.redact import FEW_SECRETS, MASK, SecretSet
from gateway.settings import Settings
from gateway.store.db import SQLITE_FILENAME
from gateway.upstream.credential import fingerprint
from tests.conftest import Gateway, ServerLoop, Simulator, start_gateway, wait_for

KEY = "ck-edge-client-key-0001"
UPSTREAM_KEY = "sk-edge-upstream-secret-4242"
MB = 1000 * 1000
MESSAGES = [{"role": "user", "content": "hi"}]
BODIES = {
    "/v1/chat/completions": {"model": "text", "messages": MESSAGES},
    "/v1/responses": {"model": "text", "input": "hi"},
    "/v1/messages": {"model": "text", "max_tokens": 32, "messages": MESSAGES},
}


class Counting:
    """The app behind a counter of the body bytes the server handed it."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.received = 0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        async def counted() -> Any:
            message = await receive()
            if message["type"] == "http.request":
                self.received += len(message.get("body", b""))
            return message

        await self.app(scope, counted, send)


def serve_counted(server_loop: ServerLoop, settings: Settings) -> tuple[Gateway, Counting]:
    app = create_app(settings, {name: "default" for name in Settings.model_fields})  # type: ignore[arg-type]
    counting = Counting(app)
    # the HTTP protocol `serve` runs (gateway/http/connections.py): its lingering close is what
    # lets a client still sending a refused body read the answer instead of a reset
    return Gateway(server_loop.serve(counting, http=protocol_class(ConnectionLimits())), app), counting


def raw_post(url: str, path: str, headers: dict[str, str], body: Iterator[bytes], length: int | None) -> tuple[int, dict[str, str], bytes, int]:
    """POST on a raw socket, sending ``body`` piece by piece until the server answers (or
    closes). Returns (status, headers, body, bytes of the request body sent)."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    lines = [f"POST {path} HTTP/1.1", f"host: {host}:{port}", *(f"{k}: {v}" for k, v in headers.items())]
    lines.append(f"content-length: {length}" if length is not None else "transfer-encoding: chunked")
    sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
    sent = 0
    sock.setblocking(False)
    answer = b""
    try:
        for piece in body:
            try:
                answer += sock.recv(65536)
                break  # the server answered before the whole body went out
            except BlockingIOError:
                pass
            frame = piece if length is not None else b"%x\r\n%s\r\n" % (len(piece), piece)
            try:
                sock.setblocking(True)
                sock.sendall(frame)
                sock.setblocking(False)
                sent += len(piece)
            except (BrokenPipeError, ConnectionResetError):
                break
        else:
            if length is None:
                sock.sendall(b"0\r\n\r\n")
        sock.setblocking(True)
        while b"\r\n\r\n" not in answer:
            chunk = sock.recv(65536)
            if not chunk:
                break
            answer += chunk
        head, _, rest = answer.partition(b"\r\n\r\n")
        status_line, *header_lines = head.decode().split("\r\n")
        got = {k.lower(): v.strip() for k, _, v in (h.partition(":") for h in header_lines)}
        want = int(got.get("content-length", "0"))
        while len(rest) < want:
            chunk = sock.recv(65536)
            if not chunk:
                break
            rest += chunk
    finally:
        sock.close()
    return int(status_line.split()[1]), got, rest, sent


def pieces(total: int, size: int = 1024 * 1024) -> Iterator[bytes]:
    piece = b"x" * size
    for start in range(0, total, size):
        yield piece[: min(size, total - start)]


def audit_rows(gateway: Gateway, request_id: str) -> list[dict[str, Any]]:
    rows = httpx.get(gateway.url + "/admin/api/audit", params={"limit": 1000}, headers=gateway.admin).json()["data"]
    return [r for r in rows if r["request_id"] == request_id]


# -- the admin surface -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def admin_gateway(server_loop: ServerLoop, simulator: Simulator, tmp_path_factory: pytest.TempPathFactory) -> Gateway:
    """No --admin-token: the token is generated; a public name is configured."""
    return start_gateway(server_loop, simulator, tmp_path_factory, public_url=["https://gw.example.com"])


def session_cookie(gateway: Gateway) -> dict[str, str]:
    login = httpx.post(gateway.url + "/admin/login", json={"token": gateway.app.state.admin_access.token},
                       headers={"origin": gateway.url})
    assert login.status_code == 200, login.text
    return {"cb2a_admin": login.cookies["cb2a_admin"]}


CREDENTIAL = {"base_url": "http://127.0.0.1:9/v1", "api_key": "sk-attacker-upstream-000", "upstream": "attacker"}

HOSTILE_WRITES = {
    "cross-origin": {"origin": "http://evil.example", "content-type": "application/json"},
    "text/plain": {"content-type": "text/plain"},
    "form": {"content-type": "application/x-www-form-urlencoded"},
    "no content-type": {},
    "Origin: null": {"origin": "null", "content-type": "application/json"},
    "foreign Host": {"host": "evil.example", "content-type": "application/json"},
    "rebinding Host with own port": {"host": "evil.example:{port}", "content-type": "application/json"},
    "Sec-Fetch-Site cross-site": {"sec-fetch-site": "cross-site", "content-type": "application/json"},
    "Sec-Fetch-Site same-site": {"sec-fetch-site": "same-site", "content-type": "application/json"},
}


@pytest.mark.parametrize("case", list(HOSTILE_WRITES))
@pytest.mark.parametrize("auth", ["cookie", "token"])
def test_a_hostile_admin_write_is_refused_and_nothing_is_persisted(admin_gateway: Gateway, case: str, auth: str) -> None:
    gateway = admin_gateway
    port = gateway.url.rsplit(":", 1)[1]
    headers = {k: v.format(port=port) for k, v in HOSTILE_WRITES[case].items()}
    cookies = session_cookie(gateway) if auth == "cookie" else {}
    if auth == "token":
        headers |= gateway.admin
    pool = gateway.app.state.relay.pool
    before = [c.id for c in pool.credentials]
    revision = gateway.live.revision
    with httpx.Client(cookies=cookies) as client:
        added = client.post(gateway.url + "/admin/api/credentials", content=json.dumps(CREDENTIAL), headers=headers)
        changed = client.put(gateway.url + "/admin/api/settings", headers=headers,
                             content=json.dumps({"revision": revision, "changes": {"stream_mode": "realtime"}}))
    for response in (added, changed):
        assert response.status_code in (403, 415), response.text
        error = response.json()["error"]
        assert error["code"] in ("cross_origin", "forbidden_host", "unsupported_media_type")
        assert error["type"] in ("permission_error", "invalid_request_error") and error["message"]
    assert [c.id for c in pool.credentials] == before
    assert gateway.app.state.credential_state.added_credentials() == []
    assert gateway.live.revision == revision and gateway.live.saved.load()[1].get("stream_mode") is None


def test_a_foreign_host_gets_neither_the_webui_nor_a_login(admin_gateway: Gateway) -> None:
    token = admin_gateway.app.state.admin_access.token
    for method, path in (("GET", "/ui/"), ("GET", "/"), ("GET", "/admin/session"), ("GET", "/admin/api/settings")):
        response = httpx.request(method, admin_gateway.url + path, headers={"host": "evil.example", **admin_gateway.admin})
        assert response.status_code == 403 and response.json()["error"]["code"] == "forbidden_host"
    login = httpx.post(admin_gateway.url + "/admin/login", json={"token": token}, headers={"host": "evil.example"})
    assert login.status_code == 403 and "set-cookie" not in login.headers


def test_the_same_write_from_the_gateways_own_origin_works(
    server_loop: ServerLoop, simulator: Simulator, tmp_path_factory: pytest.TempPathFactory
) -> None:
    gateway = start_gateway(server_loop, simulator, tmp_path_factory, public_url=["https://gw.example.com"])
    cookies = session_cookie(gateway)
    for i, (host, origin) in enumerate(((None, gateway.url), ("localhost:1234", "http://localhost:1234"),
                                        ("gw.example.com", "https://gw.example.com"))):  # the last: behind a TLS proxy
        headers = {"origin": origin, "sec-fetch-site": "same-origin", **({"host": host} if host else {})}
        body = dict(CREDENTIAL, upstream=f"spare-{i}", api_key=f"sk-spare-upstream-00{i}")  # one key is one credential
        added = httpx.post(gateway.url + "/admin/api/credentials", json=body, headers=headers, cookies=cookies)
        assert added.status_code == 201, added.text
    stored = gateway.app.state.credential_state.added_credentials()
    assert sorted(row[1] for row in stored) == ["spare-0", "spare-1", "spare-2"]
    # loopback alone is no credential any more; the generated token is
    assert httpx.get(gateway.url + "/admin/api/settings").status_code == 401
    assert httpx.get(gateway.url + "/admin/api/settings", headers=gateway.admin).status_code == 200


# -- the body limit --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def keyed(server_loop: ServerLoop, simulator: Simulator, tmp_path_factory: pytest.TempPathFactory) -> tuple[Gateway, Counting]:
    """Client keys and the default 32 MiB limit."""
    settings = Settings(upstream_url=[simulator.url + "/v1"], data_dir=tmp_path_factory.mktemp("keyed"),
                        keepalive_interval=0.5, api_key=[KEY])
    return serve_counted(server_loop, settings)


@pytest.mark.parametrize("path", [*BODIES, "/v1/messages/count_tokens"])
def test_a_50_mb_body_is_answered_without_being_read(keyed: tuple[Gateway, Counting], path: str) -> None:
    gateway, counting = keyed
    counting.received = 0
    status, headers, body, sent = raw_post(gateway.url, path, {"content-type": "application/json"}, pieces(50 * MB), 50 * MB)
    assert status == 401 and sent < 50 * MB  # answered before the client had sent it all
    assert counting.received == 0 and headers.get("connection") == "close"
    error = json.loads(body)
    assert (error["error"]["type"] if path.startswith("/v1/messages") else error["error"]["code"]) in (
        "authentication_error", "invalid_api_key")
    if path != "/v1/messages/count_tokens":  # a generation request: its one audit record
        refused_id = headers["x-request-id"]
        wait_for(lambda: len(audit_rows(gateway, refused_id)) == 1)
        assert audit_rows(gateway, refused_id)[0]["outcome"] == "refused"

    authed = {"content-type": "application/json", "authorization": f"Bearer {KEY}", "x-api-key": KEY}
    status, headers, body, sent = raw_post(gateway.url, path, authed, pieces(50 * MB), 50 * MB)
    assert status == 413 and sent < 50 * MB and counting.received == 0
    error = json.loads(body)
    if path.startswith("/v1/messages"):
        assert error["type"] == "error" and error["error"]["type"] == "request_too_large"
        assert str(32 * 1024 * 1024) in error["error"]["message"]
    else:
        assert error["error"]["code"] == "request_too_large" and error["error"]["type"] == "invalid_request_error"
    if path != "/v1/messages/count_tokens":  # a generation request: exactly one audit record
        request_id = headers["x-request-id"]
        wait_for(lambda: len(audit_rows(gateway, request_id)) == 1)
        [row] = audit_rows(gateway, request_id)
        assert row["error_code"] == "request_too_large" and row["http_status"] == 413 and row["outcome"] == "invalid"


@pytest.fixture(scope="module")
def small(server_loop: ServerLoop, simulator: Simulator, tmp_path_factory: pytest.TempPathFactory) -> tuple[Gateway, Counting]:
    """A 64 KiB limit, no client keys."""
    settings = Settings(upstream_url=[simulator.url + "/v1"], data_dir=tmp_path_factory.mktemp("small"),
                        keepalive_interval=0.5, max_body_bytes=64 * 1024)
    return serve_counted(server_loop, settings)


@pytest.mark.parametrize("path", [*BODIES, "/v1/messages/count_tokens"])
def test_a_chunked_body_over_the_limit_is_cut_off_with_413(small: tuple[Gateway, Counting], simulator: Simulator, path: str) -> None:
    gateway, counting = small
    counting.received = 0
    simulator.clear()
    status, headers, body, sent = raw_post(gateway.url, path, {"content-type": "application/json"},
                                           pieces(8 * MB, 16 * 1024), None)
    assert status == 413 and sent < 8 * MB
    # read up to the limit plus the message that crossed it: at most what uvicorn buffers before
    # it pauses reading (64 KiB high-water mark) plus one socket read (asyncio: up to 256 KiB)
    assert counting.received <= 64 * 1024 + 64 * 1024 + 256 * 1024
    error = json.loads(body)
    assert (error["error"]["type"] if path.startswith("/v1/messages") else error["error"]["code"]) == "request_too_large"
    assert simulator.requests() == []  # nothing went upstream
    if path != "/v1/messages/count_tokens":
        request_id = headers["x-request-id"]
        wait_for(lambda: len(audit_rows(gateway, request_id)) == 1)


def test_a_body_within_the_limit_still_works_chunked_or_not(small: tuple[Gateway, Counting]) -> None:
    gateway, _ = small
    for path, payload in BODIES.items():
        data = json.dumps(payload).encode()
        for length in (len(data), None):
            status, _, body, _ = raw_post(gateway.url, path, {"content-type": "application/json"}, iter([data]), length)
            assert status == 200, body


def test_admin_routes_answer_413_in_the_admin_shape(small: tuple[Gateway, Counting]) -> None:
    gateway, _ = small
    headers = {"content-type": "application/json", **gateway.admin}
    response = httpx.put(gateway.url + "/admin/api/settings", headers=headers, content=b"x" * (100 * 1024))
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"
    login = httpx.post(gateway.url + "/admin/login", headers={"content-type": "application/json"},
                       content=b'{"token": "' + b"x" * (32 * 1024) + b'"}')
    assert login.status_code == 413  # anonymous: a small bound of its own, far below the limit


# -- secrets never leave ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def secretive(server_loop: ServerLoop, simulator: Simulator, tmp_path_factory: pytest.TempPathFactory) -> Gateway:
    return start_gateway(server_loop, simulator, tmp_path_factory, api_key=[KEY], upstream_api_key=UPSTREAM_KEY,
                         audit_bodies=True, capture_dir=tmp_path_factory.mktemp("capture"))


@pytest.fixture
def log_output() -> Iterator[io.StringIO]:
    buffer = io.StringIO()
    configure_logging("info", stream=buffer, json=True)
    yield buffer
    configure_logging("warning")


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", list(BODIES))
def test_an_upstream_echoing_its_key_never_shows_it(
    secretive: Gateway, simulator: Simulator, log_output: io.StringIO, path: str, stream: bool
) -> None:
    gateway = secretive
    simulator.clear()
    # the prompt quotes the key too: it must not reach the audit row or the capture either
    body = json.loads(json.dumps(BODIES[path]).replace('"hi"', json.dumps(f"is {UPSTREAM_KEY} mine?")))
    body |= {"model": "echo_auth", "stream": stream}
    headers = {"authorization": f"Bearer {KEY}", "x-api-key": KEY}
    with httpx.stream("POST", gateway.base_url + path.removeprefix("/v1"), json=body, headers=headers, timeout=30) as response:
        raw = b"".join(response.iter_raw())
        head = "\n".join(f"{k}: {v}" for k, v in response.headers.items())
    [sent] = simulator.requests()
    assert sent["key_fingerprint"] == fingerprint(UPSTREAM_KEY)  # the upstream got the key and echoed it back
    assert response.status_code == 400
    assert UPSTREAM_KEY.encode() not in raw and UPSTREAM_KEY not in head
    assert b"Authorization: Bearer " + MASK.encode() in raw  # the upstream's message, masked, not dropped
    error = json.loads(raw)
    assert (error["error"]["type"] if path == "/v1/messages" else error["error"]["code"]) in (
        "invalid_request_error", "upstream_rejected")

    request_id = response.headers["x-request-id"]
    wait_for(lambda: len(audit_rows(gateway, request_id)) == 1)
    shown = httpx.get(f"{gateway.url}/admin/api/audit/{request_id}", headers=gateway.admin).text
    assert UPSTREAM_KEY not in shown and MASK in shown
    with sqlite3.connect(gateway.live.current.data_dir / SQLITE_FILENAME) as db:  # the store itself
        stored = json.dumps(db.execute("SELECT * FROM audit WHERE request_id = ?", (request_id,)).fetchall())
    assert UPSTREAM_KEY not in stored and MASK in stored

    capture = gateway.app.state.relay.capture
    wait_for(lambda: capture.written >= 1 and any(
        request_id in p.read_text() for p in gateway.live.current.capture_dir.glob("*.jsonl")))
    captured = "".join(p.read_text() for p in gateway.live.current.capture_dir.glob("*.jsonl"))
    assert UPSTREAM_KEY not in captured and MASK in captured

    structlog.get_logger("test").warning("upstream said", detail=f"Bearer {UPSTREAM_KEY}", nested={"k": [UPSTREAM_KEY]})
    logging.getLogger("uvicorn.error").warning("peer sent %s", UPSTREAM_KEY)
    logged = log_output.getvalue()
    assert request_id in logged  # the request's own line is there ...
    assert UPSTREAM_KEY not in logged and logged.count(MASK) >= 3  # ... and no line shows the key


def test_every_kind_of_configured_secret_is_masked(secretive: Gateway) -> None:
    """The live set: client keys, upstream keys, the admin token and its signing key, and a
    credential added at run time (and one given by a saved client-key change)."""
    from gateway.redact import SECRETS

    access = secretive.app.state.admin_access
    added = "sk-added-at-runtime-777"
    assert httpx.post(secretive.url + "/admin/api/credentials", headers=secretive.admin,
                      json={"base_url": "http://127.0.0.1:9/v1", "api_key": added, "upstream": "late"}).status_code == 201
    pool = secretive.app.state.relay.pool
    pool.disable(next(c for c in pool.credentials if c.upstream.name == "late").id)  # unreachable: never picked
    saved = "ck-saved-later-31337"
    put = httpx.put(secretive.url + "/admin/api/settings", headers=secretive.admin,
                    json={"revision": secretive.live.revision, "changes": {"api_key": [KEY, saved]}})
    assert put.status_code == 200
    for secret in (KEY, UPSTREAM_KEY, access.token, access.signing_key.hex(), added, saved):
        assert SECRETS.mask(f"<{secret}>") == f"<{MASK}>"


def test_the_secret_set_masks_every_owner_and_forgets_a_dropped_one() -> None:
    secrets = SecretSet()
    secrets.set("a", ["alpha-secret-1", None, "short"])  # under 6 characters: not masked
    secrets.set("b", ["alpha-secret-1-longer"])
    text = "x alpha-secret-1-longer y alpha-secret-1 z short"
    assert secrets.mask(text) == f"x {MASK} y {MASK} z short"  # the longer one first, whole
    assert secrets.mask_bytes(text.encode()) == f"x {MASK} y {MASK} z short".encode()
    assert secrets.mask_value({"k": ["alpha-secret-1", 3]}) == {"k": [MASK, 3]}
    secrets.drop("b")
    assert secrets.mask(text) == f"x {MASK}-longer y {MASK} z short"
    secrets.drop("a")
    assert secrets.mask(text) == text


def test_the_secret_set_masks_the_same_with_few_secrets_or_many() -> None:
    """Few secrets are looked for one by one before the pattern runs; many (a pool of
    client keys) by the pattern alone: either way every one is masked, and text holding
    none comes back as the very same object."""
    for count in (1, FEW_SECRETS, FEW_SECRETS + 1, 40):
        secrets = SecretSet()
        keys = [f"sk-client-key-{i:03d}" for i in range(count)]
        secrets.set("keys", keys)
        text = f"first {keys[0]} last {keys[-1]} and {keys[-1]}x"
        assert secrets.mask(text) == f"first {MASK} last {MASK} and {MASK}x", count
        assert secrets.mask_bytes(text.encode()) == f"first {MASK} last {MASK} and {MASK}x".encode()
        clean = "data: {\"delta\": \"sk-client-key\"}\n\n"  # a prefix of a key is not the key
        assert secrets.mask(clean) is clean and secrets.mask_bytes(clean.encode()) == clean.encode()


def test_responses_are_masked_on_the_way_out_with_a_correct_length() -> None:
    """RedactingSend on its own: a one-piece JSON body (content-length fixed) and a streamed
    body, on /v1 and /admin, and header values (as a header set from upstream or config data
    would carry one); other paths (the static WebUI) pass untouched."""
    import asyncio

    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    from gateway.redact import SECRETS, RedactingSend

    secret = "sk-leaky-handler-5150"

    async def leaky_json(request: Any) -> Any:
        return JSONResponse({"message": f"key {secret} here"}, headers={"x-upstream-note": f"used {secret}", "retry-after": "2"})

    async def leaky_stream(request: Any) -> Any:
        async def frames() -> Any:
            yield f"data: {secret}\n\n".encode()
            yield b"data: [DONE]\n\n"

        return StreamingResponse(frames(), media_type="text/event-stream", headers={"x-upstream-note": secret})

    app = RedactingSend(Starlette(routes=[Route("/v1/json", leaky_json), Route("/admin/api/x", leaky_json),
                                          Route("/v1/stream", leaky_stream), Route("/ui/x", leaky_json)]))

    async def fetch(path: str) -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as http:
            return await http.get(path)

    SECRETS.set("test-redacting-send", [secret])
    try:
        for path in ("/v1/json", "/admin/api/x"):
            response = asyncio.run(fetch(path))
            assert response.json() == {"message": f"key {MASK} here"}
            assert int(response.headers["content-length"]) == len(response.content)
            assert response.headers["x-upstream-note"] == f"used {MASK}" and response.headers["retry-after"] == "2"
        streamed = asyncio.run(fetch("/v1/stream"))
        assert streamed.text == f"data: {MASK}\n\ndata: [DONE]\n\n" and streamed.headers["x-upstream-note"] == MASK
        static = asyncio.run(fetch("/ui/x"))  # static files are not rewritten
        assert secret in static.text and static.headers["x-upstream-note"] == f"used {secret}"
    finally:
        SECRETS.drop("test-redacting-send")


@pytest.mark.parametrize("path", list(BODIES))
def test_an_upstreams_headers_and_error_quoting_the_key_never_reach_the_client(
    secretive: Gateway, simulator: Simulator, path: str
) -> None:
    """An upstream 429 whose headers and message quote the configured upstream key: the
    client gets the error (Retry-After re-rendered from its number), never the key."""
    model = simulator.script(
        [{"error": {"message": f"slow down, {UPSTREAM_KEY}", "type": "rate_limit_error", "code": None}}],
        status=429, headers={"Retry-After": "3", "x-upstream-debug": f"key={UPSTREAM_KEY}", "x-ratelimit-key": UPSTREAM_KEY},
    )
    body = json.loads(json.dumps(BODIES[path])) | {"model": model}
    response = httpx.post(secretive.base_url + path.removeprefix("/v1"), json=body,
                          headers={"authorization": f"Bearer {KEY}"}, timeout=30)
    head = "\n".join(f"{k}: {v}" for k, v in response.headers.multi_items())
    assert response.status_code == 429 and response.headers["retry-after"] == "3"
    assert UPSTREAM_KEY not in head and UPSTREAM_KEY not in response.text
    error = response.json()["error"]
    assert (error["type"] if path == "/v1/messages" else error["code"]) in ("rate_limit_error", "upstream_rate_limited")


def test_websocket_frames_never_carry_a_secret(secretive: Gateway, simulator: Simulator) -> None:
    """Responses over a WebSocket pass the same redaction point: a model answer quoting
    the upstream key (the echo model repeats the prompt) and an upstream error quoting it."""
    from websockets.sync.client import connect

    url = secretive.url.replace("http://", "ws://") + "/v1/responses"
    with connect(url, additional_headers={"Authorization": f"Bearer {KEY}"}) as ws:
        ws.send(json.dumps({"type": "response.create", "model": "echo", "input": f"is {UPSTREAM_KEY} mine?"}))
        frames = []
        while not frames or json.loads(frames[-1])["type"] != "response.completed":
            frames.append(ws.recv(timeout=20))
        ws.send(json.dumps({"type": "response.create", "model": "echo_auth", "input": "hi"}))
        error = ws.recv(timeout=20)
    assert all(UPSTREAM_KEY not in f for f in frames) and UPSTREAM_KEY not in error
    answer = json.loads(frames[-1])["response"]["output"][0]["content"][0]["text"]
    assert answer == f"You said: is {MASK} mine?"
    assert json.loads(error)["type"] == "error" and f"Bearer {MASK}" in json.loads(error)["error"]["message"]


def test_a_traceback_quoting_a_secret_is_masked_in_the_log(secretive: Gateway, log_output: io.StringIO) -> None:
    try:
        raise RuntimeError(f"connect failed with key {UPSTREAM_KEY}")
    except RuntimeError:
        structlog.get_logger("test").exception("upstream_call_failed")
        logging.getLogger("uvicorn.error").exception("stdlib too")
    logged = log_output.getvalue()
    assert "connect failed with key" in logged and "Traceback" in logged
    assert UPSTREAM_KEY not in logged


def test_a_credential_learned_from_another_replica_is_masked_too() -> None:
    from gateway.upstream.pool import UpstreamPool

    secrets = SecretSet()
    pool = UpstreamPool([])
    pool.on_change = lambda: secrets.set("pool", [c.api_key for c in pool.credentials])
    pool.apply_shared({}, [("id-1", "far", "http://127.0.0.1:9/v1", "sk-from-the-other-replica-1")])
    assert secrets.mask("sk-from-the-other-replica-1") == MASK
