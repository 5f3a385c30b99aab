"""The admin token and operator secrets: never in a log line, guessing rate-limited,
logout revokes (on every process sharing the store), short secrets refused at start-up;
and admin-added upstream URLs checked like ``--upstream-url`` (nothing answers 500)."""

from __future__ import annotations

import json
import os
import pty
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from gateway.admin.auth import COOKIE
from gateway.admin.throttle import AttemptThrottle
from gateway.app import create_app
from gateway.settings import Settings, SettingsError, load_settings
from gateway.store.credentials import CredentialState
from gateway.store.db import SQLITE_FILENAME, open_database
from gateway.upstream.urls import check_upstream_url
from tests.conftest import Gateway, ServerLoop, Simulator, start_gateway
from tests.processes import free_port, readable, wait_healthy
from tests.test_startup import clean_env, one_line_refusal, run_cli

ADMIN_TOKEN = "admin-secrets-test-token-0001"
CHAT = {"model": "text", "messages": [{"role": "user", "content": "hi"}]}


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# -- the throttle, pure -------------------------------------------------------------------


def test_the_throttle_lets_n_failures_through_then_backs_off_doubling() -> None:
    clock = FakeClock()
    throttle = AttemptThrottle(free=3, first_backoff=1.0, max_backoff=8.0, clock=clock)
    for _ in range(3):
        assert throttle.retry_after("10.0.0.1") == 0
        throttle.failed("10.0.0.1")
    assert throttle.retry_after("10.0.0.1") == 1.0  # the (N+1)th attempt waits
    assert throttle.retry_after("10.0.0.2") == 0  # per address
    waits = []
    for _ in range(5):
        clock.now += throttle.retry_after("10.0.0.1")
        throttle.failed("10.0.0.1")
        waits.append(throttle.retry_after("10.0.0.1"))
    assert waits == [2.0, 4.0, 8.0, 8.0, 8.0]  # doubling, capped
    throttle.succeeded("10.0.0.1")
    assert throttle.retry_after("10.0.0.1") == 0


def test_the_throttle_forgets_a_quiet_address_and_bounds_the_total() -> None:
    clock = FakeClock()
    throttle = AttemptThrottle(free=1, burst=5, rate=1.0, clock=clock)
    throttle.failed("a")
    throttle.failed("a")
    assert throttle.retry_after("a") > 0
    clock.now += 10_000  # quiet long enough: starts over (and the bucket refilled)
    assert throttle.retry_after("a") == 0
    for n in range(5):  # five addresses, one failure each: within every per-address allowance
        throttle.failed(f"spread-{n}")
    assert throttle.retry_after("fresh") == pytest.approx(1.0)  # ... but the total is spent
    clock.now += 1.0
    assert throttle.retry_after("fresh") == 0


# -- the running app: rate limit, logout -----------------------------------------------------


@pytest.fixture
def guarded(server_loop: ServerLoop, simulator: Simulator, tmp_path_factory: pytest.TempPathFactory) -> tuple[Gateway, FakeClock]:
    gateway = start_gateway(server_loop, simulator, tmp_path_factory, admin_token=ADMIN_TOKEN)
    clock = FakeClock()
    gateway.app.state.admin_throttle = AttemptThrottle(clock=clock)
    return gateway, clock


def _login(gateway: Gateway, token: str) -> httpx.Response:
    return httpx.post(gateway.url + "/admin/login", json={"token": token})


def _assert_429(response: httpx.Response, retry_after: int) -> None:
    assert response.status_code == 429 and response.headers["retry-after"] == str(retry_after)
    error = response.json()["error"]
    assert error["type"] == "rate_limit_error" and error["code"] == "too_many_attempts" and error["message"]
    assert ADMIN_TOKEN not in response.text


def test_logins_are_rate_limited_with_backoff(guarded: tuple[Gateway, FakeClock]) -> None:
    gateway, clock = guarded
    for n in range(5):
        wrong = _login(gateway, f"not-the-token-{n}")
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "bad_admin_token"
    _assert_429(_login(gateway, "not-the-token-5"), 1)
    _assert_429(_login(gateway, ADMIN_TOKEN), 1)  # refused before the token is even compared
    clock.now += 1
    assert _login(gateway, "not-the-token-6").status_code == 401
    _assert_429(_login(gateway, ADMIN_TOKEN), 2)  # the wait doubled
    clock.now += 2
    ok = _login(gateway, ADMIN_TOKEN)
    assert ok.status_code == 200 and COOKIE in ok.cookies
    assert _login(gateway, "not-the-token-7").status_code == 401  # a success cleared the record


def test_wrong_bearer_tokens_are_rate_limited_on_the_admin_api(guarded: tuple[Gateway, FakeClock]) -> None:
    gateway, clock = guarded
    api = gateway.url + "/admin/api/settings"
    for n in range(5):
        assert httpx.get(api, headers={"authorization": f"Bearer guess-{n}"}).status_code == 401
    _assert_429(httpx.get(api, headers={"authorization": "Bearer guess-5"}), 1)
    _assert_429(httpx.get(gateway.url + "/admin/session", headers={"authorization": "Bearer guess-6"}), 1)
    assert httpx.get(api).status_code == 401  # no token at all is no guess: the plain 401
    clock.now += 1
    assert httpx.get(api, headers={"authorization": f"Bearer {ADMIN_TOKEN}"}).status_code == 200


def _two_instances(server_loop: ServerLoop, simulator: Simulator, data_dir: Path, database_url: str | None = None) -> list[Gateway]:
    """Two apps (as two replicas or workers would be) on one store."""
    apps = []
    for n in range(2):
        settings = Settings(upstream_url=[simulator.url + "/v1"], data_dir=data_dir / str(n) if database_url else data_dir,
                            admin_token=ADMIN_TOKEN, spill_max_bytes=1 << 20, database_url=database_url)
        apps.append(create_app(settings, {name: "default" for name in Settings.model_fields}))  # type: ignore[arg-type]
    return [Gateway(server_loop.serve(app), app) for app in apps]


def test_logout_revokes_the_cookie_on_every_instance_sharing_the_store(
    server_loop: ServerLoop, simulator: Simulator, tmp_path: Path
) -> None:
    _logout_revokes_everywhere(_two_instances(server_loop, simulator, tmp_path / "data"))


def test_logout_revokes_on_every_postgresql_replica(server_loop: ServerLoop, simulator: Simulator, tmp_path: Path,
                                                    postgres_schema: str) -> None:
    _logout_revokes_everywhere(_two_instances(server_loop, simulator, tmp_path, postgres_schema))


def _logout_revokes_everywhere(instances: list[Gateway]) -> None:
    """The other instance sees the new epoch with its next settings revision poll (SQLite
    100 ms, PostgreSQL 250 ms: gateway/store/saved_settings.py): waited for, never assumed."""
    from tests.conftest import wait_for

    first, second = instances
    cookie = _login(first, ADMIN_TOKEN).cookies[COOKIE]
    other_cookie = _login(second, ADMIN_TOKEN).cookies[COOKIE]
    for gateway in (first, second):
        for value in (cookie, other_cookie):
            assert httpx.get(gateway.url + "/admin/api/settings", cookies={COOKIE: value}).status_code == 200
    out = httpx.post(first.url + "/admin/logout", json={}, cookies={COOKIE: cookie}, headers={"origin": first.url})
    assert out.status_code == 200 and out.json() == {"authenticated": False, "revoked": True}
    wait_for(lambda: httpx.get(second.url + "/admin/api/settings", cookies={COOKIE: cookie}).status_code == 401)
    for gateway in (first, second):  # every session, on every instance, is gone
        for value in (cookie, other_cookie):
            refused = httpx.get(gateway.url + "/admin/api/settings", cookies={COOKIE: value})
            assert refused.status_code == 401 and refused.json()["error"]["code"] == "admin_login_required"
        assert httpx.get(gateway.url + "/admin/session", cookies={COOKIE: cookie}).json()["authenticated"] is False
    fresh = _login(second, ADMIN_TOKEN).cookies[COOKIE]  # a new login works at once, everywhere
    wait_for(lambda: httpx.get(first.url + "/admin/api/settings", cookies={COOKIE: fresh}).status_code == 200)
    assert all(httpx.get(g.url + "/admin/api/settings", cookies={COOKIE: fresh}).status_code == 200 for g in (first, second))
    history = httpx.get(first.url + "/admin/api/settings/history", headers={"authorization": f"Bearer {ADMIN_TOKEN}"})
    assert history.status_code == 200 and "admin_session_epoch" in history.text  # the logout is on record


def test_a_logout_without_a_session_revokes_nothing(server_loop: ServerLoop, simulator: Simulator, tmp_path: Path) -> None:
    [gateway, _] = _two_instances(server_loop, simulator, tmp_path / "data")
    cookie = _login(gateway, ADMIN_TOKEN).cookies[COOKIE]
    out = httpx.post(gateway.url + "/admin/logout", json={}, headers={"origin": gateway.url})
    assert out.status_code == 200 and out.json()["revoked"] is False  # anyone may drop their own cookie ...
    assert httpx.get(gateway.url + "/admin/api/settings", cookies={COOKIE: cookie}).status_code == 200  # ... only


# -- short secrets at start-up -----------------------------------------------------------------


@pytest.mark.parametrize(("args", "env", "named"), [
    (["--admin-token", "abc"], {}, "--admin-token"),
    (["--api-key", "k"], {}, "--api-key"),
    (["--api-key", "a-long-enough-client-key-01", "--api-key", "short-key"], {}, "--api-key"),
    ([], {"CODEBUDDY2API_ADMIN_TOKEN": "abc"}, "CODEBUDDY2API_ADMIN_TOKEN"),
    ([], {"CODEBUDDY2API_API_KEY": "k1,k2"}, "CODEBUDDY2API_API_KEY"),
])
def test_short_operator_secrets_are_refused_with_one_line(args: list[str], env: dict[str, str], named: str, tmp_path: Path) -> None:
    line = one_line_refusal(run_cli("serve", "--data-dir", str(tmp_path), *args, env=clean_env(**env)))
    assert named in line and "at least 16 characters" in line
    assert "abc" not in line and "short-key" not in line and "k1" not in line  # the value is never echoed


def test_a_short_client_key_is_refused_by_the_admin_api_too(guarded: tuple[Gateway, FakeClock]) -> None:
    gateway, _ = guarded
    put = httpx.put(gateway.url + "/admin/api/settings", headers={"authorization": f"Bearer {ADMIN_TOKEN}"},
                    json={"revision": gateway.live.revision, "changes": {"api_key": ["short"]}})
    assert put.status_code == 400 and "at least 16 characters" in put.json()["error"]["message"]
    assert "'short'" not in put.text  # the value is never echoed
    assert gateway.live.current.api_key == []


# -- no token in any log line --------------------------------------------------------------------


def _exercise(url: str, token: str) -> None:
    """What puts a token in front of the log pipeline: the login URL's page, a login, a
    wrong login, Bearer calls, a generation."""
    assert httpx.get(f"{url}/ui/?token={token}").status_code == 200
    assert httpx.post(url + "/admin/login", json={"token": token}).status_code == 200
    assert httpx.post(url + "/admin/login", json={"token": token + "x"}).status_code == 401
    assert httpx.get(url + "/admin/api/status", headers={"authorization": f"Bearer {token}"}).status_code == 200
    assert httpx.get(f"{url}/admin/api/status?token={token}").status_code == 401
    assert httpx.post(url + "/v1/chat/completions", json=CHAT, timeout=30).status_code == 200


def test_the_generated_token_is_in_no_json_log_line(tmp_path: Path) -> None:
    port = free_port()
    data = tmp_path / "data"
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway", "serve", "--port", str(port), "--data-dir", str(data), "--log-level", "debug"],
        env=clean_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    try:
        wait_healthy(proc, f"http://127.0.0.1:{port}")
        login_file = data / "admin-login-url"
        url = login_file.read_text().strip()
        token = url.rsplit("?token=", 1)[1]
        assert login_file.stat().st_mode & 0o777 == 0o600 and len(token) >= 32
        _exercise(f"http://127.0.0.1:{port}", token)
    finally:
        proc.terminate()
        _, stderr = proc.communicate(timeout=30)
    lines = stderr.splitlines()
    assert len(lines) > 5 and all(line.startswith("{") for line in lines)  # JSON, debug level: many lines
    assert token not in stderr and token[:12] not in stderr
    [startup] = [json.loads(line) for line in lines if '"startup"' in line]
    assert startup["admin_login_file"] == str(login_file) and startup["admin_token_prefix"] == token[:6] + "..."
    assert any('"path": "/ui/"' in line or '"path":"/ui/"' in line for line in lines)  # the access line, without its query


def test_on_a_terminal_the_login_url_is_the_only_place_the_token_shows(tmp_path: Path) -> None:
    """Text mode (stderr a terminal): the banner shows the whole login URL, once; no log
    line (the access line of /ui/?token= included) carries the token."""
    port = free_port()
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway", "serve", "--port", str(port), "--data-dir", str(tmp_path / "data")],
        env=clean_env(TERM="dumb", NO_COLOR="1"), stdin=subprocess.DEVNULL, stdout=slave, stderr=slave,
    )
    os.close(slave)
    chunks: list[bytes] = []

    def drain(seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if readable(master, 0.05):
                try:
                    chunks.append(os.read(master, 65536))
                except OSError:
                    return

    try:
        for _ in range(200):
            drain(0.1)
            if b"/ui/?token=" in b"".join(chunks):
                break
        wait_healthy(proc, f"http://127.0.0.1:{port}")
        text = b"".join(chunks).decode(errors="replace")
        token = text.split("/ui/?token=", 1)[1].split()[0]
        _exercise(f"http://127.0.0.1:{port}", token)
        drain(1.0)
    finally:
        proc.terminate()
        proc.wait(30)
        drain(0.5)
        os.close(master)
    output = b"".join(chunks).decode(errors="replace")
    assert output.count(token) == 1, output
    [line] = [line for line in output.splitlines() if token in line]
    assert line.strip().startswith("WebUI") and f"http://127.0.0.1:{port}/ui/?token={token}" in line
    assert "GET /ui/" in output or "/ui/" in output.split(line, 1)[1]  # the access line was logged, token-free


# -- upstream URLs -------------------------------------------------------------------------------------

BAD_URLS = {
    "crlf": "http://127.0.0.1:9/v1\r\nX-Injected: 1",
    "lf_in_host": "http://exa\nmple.com/v1",
    "no_host": "http:///v1",
    "no_host_port": "http://:8080/v1",
    "bad_port": "http://127.0.0.1:99999/v1",
    "fragment": "http://127.0.0.1:9/v1#x",
    "space": "http://127.0.0.1:9/v 1",
    "scheme": "ftp://127.0.0.1/v1",
    "no_v1": "http://127.0.0.1:9/api",
    "aws_metadata": "http://169.254.169.254/v1",
    "aws_metadata_decimal": "http://2852039166/v1",
    "aws_metadata_ipv6": "http://[fd00:ec2::254]/v1",
    "gcp_metadata": "http://metadata.google.internal/v1",
    "link_local_v6": "http://[fe80::1]/v1",
    "mapped_metadata": "http://[::ffff:169.254.169.254]/v1",
}
CLIENT_CALLS = [
    ("POST", "/chat/completions", CHAT),
    ("POST", "/chat/completions", CHAT | {"stream": True}),
    ("POST", "/responses", {"model": "text", "input": "hi"}),
    ("POST", "/responses", {"model": "text", "input": "hi", "stream": True}),
    ("POST", "/messages", CHAT | {"max_tokens": 20}),
    ("POST", "/messages", CHAT | {"max_tokens": 20, "stream": True}),
    ("POST", "/messages/count_tokens", CHAT),
    ("POST", "/responses/compact", {"model": "text", "input": "hi"}),
    ("GET", "/models", None),
    ("GET", "/models/text", None),
]


def _nothing_answers_500(gateway: Gateway) -> None:
    for method, path, body in CLIENT_CALLS:
        response = httpx.request(method, gateway.base_url + path, json=body, timeout=30)
        assert response.status_code == 200, (path, response.status_code, response.text[:300])


def test_bad_admin_urls_are_a_named_400_and_nothing_answers_500_afterwards(
    server_loop: ServerLoop, simulator: Simulator, tmp_path_factory: pytest.TempPathFactory
) -> None:
    gateway = start_gateway(server_loop, simulator, tmp_path_factory, admin_token=ADMIN_TOKEN)
    admin = {"authorization": f"Bearer {ADMIN_TOKEN}"}
    before = len(gateway.app.state.relay.pool.credentials)
    for name, url in BAD_URLS.items():
        added = httpx.post(gateway.url + "/admin/api/credentials", headers=admin,
                           json={"base_url": url, "api_key": "sk-some-upstream-key-000", "upstream": name})
        assert added.status_code == 400, (name, added.text)
        error = added.json()["error"]
        assert error["code"] == "invalid_upstream_url" and error["param"] == "base_url" and error["message"], name
        assert error["type"] == "invalid_request_error"
    for key in ("sk-with\r\nnewline-000000", "sk with space 0000000"):
        bad_key = httpx.post(gateway.url + "/admin/api/credentials", headers=admin,
                             json={"base_url": "http://127.0.0.1:9/v1", "api_key": key, "upstream": "k"})
        assert bad_key.status_code == 400 and bad_key.json()["error"]["param"] == "api_key"
    assert len(gateway.app.state.relay.pool.credentials) == before
    with sqlite3.connect(gateway.live.current.data_dir / SQLITE_FILENAME) as db:
        assert db.execute("SELECT count(*) FROM credentials").fetchone()[0] == 0
    _nothing_answers_500(gateway)


def test_bad_urls_already_in_the_store_are_skipped_with_a_warning(
    server_loop: ServerLoop, simulator: Simulator, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Rows an older version let in: the gateway starts, serves, lists only good ones."""
    data = tmp_path / "data"
    db = open_database(None, data)
    state = CredentialState(db)
    for n, url in enumerate([BAD_URLS["crlf"], BAD_URLS["no_host"], BAD_URLS["aws_metadata"], BAD_URLS["bad_port"]]):
        state.add_credential(f"old-{n}", "old", url, "sk-old-upstream-key-000")
    db.close()
    settings = Settings(upstream_url=[simulator.url + "/v1"], data_dir=data, admin_token=ADMIN_TOKEN, spill_max_bytes=1 << 20)
    app = create_app(settings, {name: "default" for name in Settings.model_fields})  # type: ignore[arg-type]
    gateway = Gateway(server_loop.serve(app), app)
    listed = httpx.get(gateway.url + "/admin/api/credentials", headers={"authorization": f"Bearer {ADMIN_TOKEN}"})
    assert listed.status_code == 200
    assert [c["upstream"] for c in listed.json()["credentials"]] == ["upstream"]
    _nothing_answers_500(gateway)


def test_every_way_in_uses_the_same_check(tmp_path: Path) -> None:
    for name, url in BAD_URLS.items():
        if name == "no_v1":
            continue  # the flag keeps accepting other paths (with a banner hint); the admin API does not
        with pytest.raises(SettingsError, match="--upstream-url"):
            load_settings({"upstream_url": [url]})
        config = tmp_path / f"{name}.toml"
        config.write_text(f"[[upstreams]]\nbase_url = {json.dumps(url)}\n")
        line = one_line_refusal(run_cli("serve", "--config", str(config), "--data-dir", str(tmp_path / "d")))
        assert "--config" in line and "base_url" in line, name
    line = one_line_refusal(run_cli("serve", "--data-dir", str(tmp_path / "d"),
                                    env=clean_env(CODEBUDDY2API_UPSTREAM_URL=BAD_URLS["aws_metadata"])))
    assert "CODEBUDDY2API_UPSTREAM_URL" in line and "--allow-upstream-host 169.254.169.254" in line


def test_allow_upstream_host_lets_one_named_metadata_host_through() -> None:
    settings, _ = load_settings({"upstream_url": ["http://169.254.169.254/v1"], "allow_upstream_host": ["169.254.169.254"]})
    assert settings.upstream_url == ["http://169.254.169.254/v1"]
    with pytest.raises(SettingsError):  # another metadata host is still refused
        load_settings({"upstream_url": ["http://metadata.google.internal/v1"], "allow_upstream_host": ["169.254.169.254"]})
    assert check_upstream_url("http://[fd00:ec2::254]/v1", ["[fd00:ec2::254]"]) == "http://[fd00:ec2::254]/v1"
    with pytest.raises(ValueError, match="CR, LF"):  # syntax is never allowed through
        check_upstream_url("http://169.254.169.254/v1\n", ["169.254.169.254"])


def test_a_url_password_is_never_echoed_in_a_refusal() -> None:
    with pytest.raises(SettingsError) as refused:
        load_settings({"upstream_url": ["http://user:hunter2-password-x@169.254.169.254/v1"]})
    assert "hunter2-password-x" not in str(refused.value) and "169.254.169.254" in str(refused.value)
