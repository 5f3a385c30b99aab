"""Flags and environment variables -> settings, their sources, and the process itself."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from gateway.live_settings import LiveSettings
from gateway.settings import SettingsError, StreamMode, load_settings
from tests.processes import free_port


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway", *args], capture_output=True, text=True, timeout=30,
        env={**os.environ, **(env or {})},
    )


def test_invalid_flag_value_exits_with_one_line() -> None:
    result = run_cli("serve", "--stream-mode", "fast")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1
    assert "--stream-mode" in lines[0] and "compatible" in lines[0] and "realtime" in lines[0]


def test_invalid_env_value_exits_with_one_line() -> None:
    result = run_cli("serve", env={"CODEBUDDY2API_STREAM_MODE": "fast"})
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1
    assert "CODEBUDDY2API_STREAM_MODE" in lines[0] and "compatible, realtime" in lines[0]


def test_invalid_number_names_the_flag() -> None:
    result = run_cli("serve", "--max-collect-bytes", "-5")
    assert result.returncode == 2
    assert "--max-collect-bytes" in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_precedence_cli_over_env_over_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CODEBUDDY2API_STREAM_MODE", "realtime")
    monkeypatch.setenv("CODEBUDDY2API_KEEPALIVE_INTERVAL", "3")
    settings, sources = load_settings({"keepalive_interval": "1.5"})
    assert settings.stream_mode is StreamMode.REALTIME and sources["stream_mode"] == "env"
    assert settings.keepalive_interval == 1.5 and sources["keepalive_interval"] == "cli"
    assert settings.max_collect_bytes == 8 * 1024 * 1024 and sources["max_collect_bytes"] == "default"


def test_live_settings_refuse_locked_values_and_apply_saved(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CODEBUDDY2API_STREAM_MODE", "realtime")
    settings, sources = load_settings({"port": "9999"})
    live = LiveSettings(settings, sources)
    with pytest.raises(SettingsError, match="stream_mode is set by the environment"):
        live.update({"stream_mode": "compatible"})
    with pytest.raises(SettingsError, match="port is set by a command-line flag"):
        live.update({"port": 1})
    with pytest.raises(SettingsError, match="tool_repair_attempts"):
        live.update({"tool_repair_attempts": -1})
    live.update({"max_collect_bytes": 1234})
    assert live.current.max_collect_bytes == 1234 and live.sources["max_collect_bytes"] == "saved"
    assert live.revision == 1


def test_serve_runs_on_the_builtin_simulator(tmp_path: Path) -> None:
    """What `make run` does: no upstream configured, the built-in simulator answers."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("CODEBUDDY2API_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway", "serve", "--port", str(port), "--data-dir", str(tmp_path / "data"),
         "--stream-mode", "realtime"],
        env=env, stdout=subprocess.PIPE, stderr=(tmp_path / "stderr").open("w"), text=True,
    )
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/healthz").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "stderr").read_text()
            time.sleep(0.1)
        # no --admin-token: a token generated for this run; the banner (no terminal: JSON) names
        # the 0600 file holding its login URL and shows a prefix of it only
        [banner] = [json.loads(line) for line in (tmp_path / "stderr").read_text().splitlines() if '"startup"' in line]
        login_file = Path(banner["admin_login_file"])
        assert login_file == tmp_path / "data" / "admin-login-url" and login_file.stat().st_mode & 0o777 == 0o600
        url = login_file.read_text().strip()
        assert url.startswith(f"http://127.0.0.1:{port}/ui/?token=")
        assert banner["admin_token_prefix"] == url.rsplit("=", 1)[1][:6] + "..."
        token = url.rsplit("=", 1)[1]
        settings_api = f"http://127.0.0.1:{port}/admin/api/settings"
        assert httpx.get(settings_api).status_code == 401  # loopback alone is no credential
        assert httpx.get(settings_api, headers={"authorization": f"Bearer {token}"}).status_code == 200
        assert httpx.get(url).status_code == 200  # the WebUI page (its access-log line must not show the token)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k", _strict_response_validation=True)
        with client.chat.completions.stream(model="any-model", messages=[{"role": "user", "content": "ping"}]) as stream:
            text = stream.get_final_completion().choices[0].message.content
        assert text == "You said: ping"
        assert (tmp_path / "data" / "codebuddy2api.sqlite3").stat().st_mode & 0o777 == 0o600
    finally:
        proc.terminate()
        proc.wait(10)
    logged = (tmp_path / "stderr").read_text()
    assert logged.count(token) == 0  # never on stderr (the access line of /ui/?token= included)


def test_public_url_is_repeatable_and_comma_separated() -> None:
    settings, _ = load_settings({"public_url": ["https://a.example", "https://b.example/, http://c.example:8080"]})
    assert settings.public_url == ["https://a.example", "https://b.example", "http://c.example:8080"]
    with pytest.raises(SettingsError, match="--public-url"):
        load_settings({"public_url": ["gw.example.com"]})  # no scheme: not a URL


def test_the_login_url_is_in_the_banner_only_for_a_generated_token() -> None:
    from pydantic import SecretStr

    from gateway.admin.auth import AdminAccess
    from gateway.banner import render_text, startup_facts
    from gateway.cli import admin_login_url

    settings, _ = load_settings({"host": "0.0.0.0", "port": 9000, "public_url": ["https://gw.example.com"]})
    generated = AdminAccess.from_settings(None)
    url = admin_login_url(settings, generated)
    assert url == f"https://gw.example.com/ui/?token={generated.token}"
    facts = startup_facts(settings, [], None, webui=True, admin_login_url=url, admin_login_file=Path("/d/admin-login-url"))
    assert generated.token not in json.dumps(facts)  # the facts are what a JSON log keeps: a prefix at most
    assert facts["admin_token_prefix"] == generated.token[:6] + "..." and facts["admin_login_file"] == "/d/admin-login-url"
    assert render_text(facts, login_url=url).count(generated.token) == 1  # a terminal shows it, once
    assert generated.token not in render_text(facts) and "/d/admin-login-url" in render_text(facts)
    assert admin_login_url(settings, AdminAccess.from_settings(SecretStr("configured-admin-token"))) is None  # never printed
    local, _ = load_settings({"host": "0.0.0.0", "port": 9000})
    assert admin_login_url(local, generated) == f"http://127.0.0.1:9000/ui/?token={generated.token}"


def test_open_bind_without_client_keys_is_refused() -> None:
    result = run_cli("serve", "--host", "0.0.0.0", "--port", "1")
    assert result.returncode == 2
    assert "--api-key" in result.stderr and "--allow-open" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_a_database_not_there_at_start_exits_ex_tempfail_not_the_refusal_status(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue #40: exit 2 means a refused configuration (the systemd unit never restarts it);
    a PostgreSQL that is not up yet is worth a restart: 75 (EX_TEMPFAIL)."""
    from gateway.cli import EXIT_TEMPFAIL, main

    for name in [k for k in os.environ if k.startswith("CODEBUDDY2API_")]:
        monkeypatch.delenv(name)
    port = free_port()  # a loopback port nobody listens on (no bind(0) will be handed it meanwhile)
    status = main(["serve", "--data-dir", str(tmp_path / "d"), "--database-wait", "0", "--port", "0",
                   "--database-url", f"postgresql://gw:secret-pw@127.0.0.1:{port}/gateway"])
    said = capsys.readouterr().err
    assert status == EXIT_TEMPFAIL == 75, said
    assert said.strip().splitlines()[-1].startswith("codebuddy2api: error: database 127.0.0.1:")
    assert "secret-pw" not in said and "Traceback" not in said
