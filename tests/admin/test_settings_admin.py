"""Saved settings with precedence and revisions, the admin settings API, admin auth, and
offline removal of a saved key."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.app import create_app
from gateway.live_settings import LiveSettings, LockedSetting
from gateway.settings import Settings, Source, load_settings
from gateway.store.db import Database
from gateway.store.saved_settings import SavedSettings, StaleRevision
from tests.conftest import Gateway, ServerLoop, Simulator, wait_for


def live_on(path: Path, cli: dict[str, Any] | None = None) -> LiveSettings:
    settings, sources = load_settings(cli or {})
    return LiveSettings(settings, sources, SavedSettings(Database(path)))


# -- precedence: 4 sources x locked/unlocked ------------------------------------------------

@pytest.mark.parametrize(
    ("cli", "env", "saved", "value", "source", "locked"),
    [
        (None, None, None, "compatible", "default", False),
        (None, None, "realtime", "realtime", "saved", False),
        (None, "realtime", None, "realtime", "env", True),
        (None, "realtime", "compatible", "realtime", "env", True),
        ("realtime", None, None, "realtime", "cli", True),
        ("compatible", "realtime", "realtime", "compatible", "cli", True),
    ],
)
def test_precedence_matrix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cli: str | None, env: str | None,
                           saved: str | None, value: str, source: Source, locked: bool) -> None:
    db_path = tmp_path / "s.sqlite3"
    if saved is not None:  # saved by an earlier run with no flag or env
        live_on(db_path).update({"stream_mode": saved}, revision=0)
    if env is not None:
        monkeypatch.setenv("CODEBUDDY2API_STREAM_MODE", env)
    live = live_on(db_path, {"stream_mode": cli} if cli else None)
    assert live.current.stream_mode.value == value
    assert live.sources["stream_mode"] == source
    assert (live.locked_reason("stream_mode") is not None) == locked
    if locked:
        with pytest.raises(LockedSetting, match=source):
            live.update({"stream_mode": "realtime"})
    else:
        live.update({"stream_mode": "realtime" if value == "compatible" else "compatible"})
        assert live.sources["stream_mode"] == "saved"


def test_fixed_at_start_up_settings_are_locked(tmp_path: Path) -> None:
    live = live_on(tmp_path / "s.sqlite3")
    for name in ("port", "data_dir", "upstream_url", "admin_token"):
        with pytest.raises(LockedSetting, match="fixed at start-up"):
            live.update({name: 1})


def test_revisions_are_optimistic_and_every_reader_sees_the_new_one(tmp_path: Path) -> None:
    db_path = tmp_path / "s.sqlite3"
    a, b = live_on(db_path), live_on(db_path)  # two processes on one store
    assert a.revision == b.revision == 0
    a.update({"max_collect_bytes": 1000}, revision=0, actor="alice")
    # the other reader applies it from memory once its poller read it (no store read per request)
    wait_for(lambda: b.current.max_collect_bytes == 1000, timeout=30.0)  # polled; how soon is a speed
    assert b.revision == 1 and b.sources["max_collect_bytes"] == "saved"
    with pytest.raises(StaleRevision) as stale:
        b.update({"max_collect_bytes": 5}, revision=0)
    assert stale.value.current == 1
    b.update({"keepalive_interval": 2.5}, revision=1, actor="bob")
    wait_for(lambda: a.current.keepalive_interval == 2.5, timeout=30.0)  # polled; how soon is a speed
    assert a.current.keepalive_interval == 2.5 and a.current.max_collect_bytes == 1000
    history = a.saved.history()
    assert [(h["revision"], h["actor"]) for h in history] == [(2, "bob"), (1, "alice")]
    assert history[1]["changes"] == {"max_collect_bytes": {"old": None, "new": 1000}}


def test_invalid_saved_values_are_refused_and_a_corrupt_row_is_skipped(tmp_path: Path) -> None:
    db_path = tmp_path / "s.sqlite3"
    live = live_on(db_path)
    with pytest.raises(Exception, match="tool_repair_attempts"):
        live.update({"tool_repair_attempts": 99})
    assert live.revision == 0
    live.update({"tool_repair_attempts": 3, "failover_max": 4})
    conn = sqlite3.connect(db_path)  # someone edits the store by hand, badly
    conn.execute("UPDATE saved_settings SET value = '\"lots\"' WHERE key = 'failover_max'")
    conn.execute("UPDATE settings_revision SET revision = revision + 1")
    conn.commit()
    fresh = live_on(db_path)
    assert fresh.current.tool_repair_attempts == 3 and fresh.current.failover_max == 2


# -- the admin API -------------------------------------------------------------------------

def gateway_on(server_loop: ServerLoop, simulator: Simulator, data: Path, **overrides: Any) -> Gateway:
    sources = {name: "default" for name in Settings.model_fields}
    for name in overrides.pop("locked", ()):
        sources[name] = "env"
    settings = Settings(upstream_url=[simulator.url + "/v1"], data_dir=data, keepalive_interval=0.5, **overrides)
    app = create_app(settings, sources)  # type: ignore[arg-type]
    return Gateway(server_loop.serve(app), app)


def put(gateway: Gateway, body: dict[str, Any], **kwargs: Any) -> httpx.Response:
    return httpx.put(gateway.url + "/admin/api/settings", json=body, **kwargs, headers=gateway.admin)


def test_settings_api_toggle_lock_conflict_and_secret(server_loop: ServerLoop, simulator: Simulator, tmp_path: Path) -> None:
    gateway = gateway_on(server_loop, simulator, tmp_path, locked=["keepalive_interval"])
    other = gateway_on(server_loop, simulator, tmp_path)  # a second worker on the same store
    view = httpx.get(gateway.url + "/admin/api/settings", headers=gateway.admin).json()
    assert view["revision"] == 0
    assert view["settings"]["stream_mode"] == {**view["settings"]["stream_mode"], "value": "compatible",
                                               "source": "default", "locked": None}
    assert "env" in view["settings"]["keepalive_interval"]["locked"]
    assert set(view["modes"]) == {"compatible", "realtime"}

    changed = put(gateway, {"revision": 0, "changes": {"stream_mode": "realtime"}})
    assert changed.status_code == 200 and changed.json()["revision"] == 1
    assert changed.json()["settings"]["stream_mode"]["source"] == "saved"
    def mode(gw: Gateway) -> str:
        r = httpx.post(gw.base_url + "/chat/completions", json={"model": "text", "messages": [{"role": "user", "content": "x"}], "stream": True})
        return str(r.headers["x-codebuddy2api-stream-mode"])

    assert mode(gateway) == "realtime"  # the next request on the worker that saved it
    # the other worker picks it up from its poll (saved settings are read from memory); how
    # soon is a speed (LOCAL_REVISION_MAX_AGE), not asserted here: a busy machine is slower
    wait_for(lambda: mode(other) == "realtime", timeout=30.0)

    stale = put(other, {"revision": 0, "changes": {"stream_mode": "compatible"}})
    assert stale.status_code == 409 and stale.json()["error"]["code"] == "stale_revision"
    assert stale.json()["error"]["current_revision"] == 1
    locked = put(gateway, {"revision": 1, "changes": {"keepalive_interval": 2}})
    assert locked.status_code == 409 and locked.json()["error"]["code"] == "setting_locked"
    assert locked.json()["error"]["source"] == "env" and "environment" in locked.json()["error"]["message"]
    invalid = put(gateway, {"revision": 1, "changes": {"stream_mode": "fast"}})
    assert invalid.status_code == 400 and "stream_mode" in invalid.json()["error"]["message"]
    assert put(gateway, {"changes": {}}).json()["error"]["code"] == "missing_revision"

    keyed = put(gateway, {"revision": 1, "changes": {"api_key": ["ck-saved-secret-1"]}})
    assert keyed.status_code == 200 and keyed.json()["settings"]["api_key"]["value"] == ["set (1)"]
    assert "ck-saved-secret-1" not in keyed.text
    history = httpx.get(gateway.url + "/admin/api/settings/history", headers=gateway.admin).text
    assert "ck-saved-secret-1" not in history and "[redacted]" in history
    wait_for(lambda: httpx.post(other.base_url + "/chat/completions",
                                json={"model": "text", "messages": [{"role": "user", "content": "x"}]}).status_code == 401,
             timeout=3.0)
    allowed = httpx.post(other.base_url + "/chat/completions", headers={"authorization": "Bearer ck-saved-secret-1"},
                         json={"model": "text", "messages": [{"role": "user", "content": "x"}]})
    assert allowed.status_code == 200


def test_offline_key_removal_bumps_the_revision_and_keeps_the_store_sound(server_loop: ServerLoop, simulator: Simulator, tmp_path: Path) -> None:
    gateway = gateway_on(server_loop, simulator, tmp_path)
    put(gateway, {"revision": 0, "changes": {"api_key": ["ck-leaked-client-key-0009"], "max_collect_bytes": 4096}})
    body = {"model": "text", "messages": [{"role": "user", "content": "x"}]}
    assert httpx.post(gateway.base_url + "/chat/completions", json=body).status_code == 401
    result = subprocess.run([sys.executable, "-m", "gateway", "settings", "unset", "api_key", "--data-dir", str(tmp_path)],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report == {"removed": "api_key", "revision": 2, "integrity_check": "ok"}
    # the running gateway picks the new revision up within its poll interval; other values stay
    wait_for(lambda: httpx.post(gateway.base_url + "/chat/completions", json=body).status_code == 200, timeout=30.0)
    assert httpx.post(gateway.base_url + "/chat/completions", json=body).status_code == 200
    view = httpx.get(gateway.url + "/admin/api/settings", headers=gateway.admin).json()
    assert view["revision"] == 2 and view["settings"]["max_collect_bytes"]["value"] == 4096
    shown = subprocess.run([sys.executable, "-m", "gateway", "settings", "show", "--data-dir", str(tmp_path)],
                           capture_output=True, text=True, timeout=30)
    assert json.loads(shown.stdout) == {"revision": 2, "saved": {"max_collect_bytes": 4096}}


def test_admin_token_login_cookie_and_origin(server_loop: ServerLoop, simulator: Simulator, tmp_path: Path) -> None:
    gateway = gateway_on(server_loop, simulator, tmp_path, admin_token="adm-token-123-of-24-char")
    api = gateway.url + "/admin/api/settings"
    assert httpx.get(api).status_code == 401
    assert httpx.get(api, headers={"authorization": "Bearer wrong"}).status_code == 401
    assert httpx.get(api, headers={"authorization": "Bearer adm-token-123-of-24-char"}).status_code == 200
    assert httpx.post(gateway.url + "/admin/login", json={"token": "nope"}).status_code == 401
    foreign = httpx.post(gateway.url + "/admin/login", json={"token": "adm-token-123-of-24-char"}, headers={"origin": "http://evil.example"})
    assert foreign.status_code == 403
    login = httpx.post(gateway.url + "/admin/login", json={"token": "adm-token-123-of-24-char"})
    assert login.status_code == 200
    cookie = login.headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie.replace("Strict", "strict") and "Path=/admin" in cookie
    assert "adm-token-123-of-24-char" not in cookie
    session = login.cookies["cb2a_admin"]
    jar = {"cb2a_admin": session}
    assert httpx.get(api, cookies=jar).status_code == 200
    assert httpx.get(gateway.url + "/admin/session", cookies=jar).json()["authenticated"] is True
    change = {"revision": 0, "changes": {"stream_mode": "realtime"}}
    assert httpx.put(api, json=change, cookies=jar).status_code == 403  # no Origin
    assert httpx.put(api, json=change, cookies=jar, headers={"origin": "http://evil.example"}).status_code == 403
    ok = httpx.put(api, json=change, cookies=jar, headers={"origin": gateway.url})
    assert ok.status_code == 200
    assert httpx.get(gateway.url + "/admin/api/settings/history", cookies=jar).json()["history"][0]["actor"] == "admin-session"
    forged = {"cb2a_admin": session.split(".")[0] + ".deadbeef"}
    assert httpx.get(api, cookies=forged).status_code == 401


def test_a_saved_client_key_under_the_minimum_locks_v1_instead_of_opening_it(tmp_path: Path) -> None:
    """Keys saved before the 16-character minimum existed: the long ones stay, and when
    none is left one random key nobody holds keeps /v1 closed (401), never open."""
    db = tmp_path / "s.sqlite3"
    saved = SavedSettings(Database(db))
    saved.write(0, {"api_key": ["short"]}, [], "test")
    live = live_on(db)
    assert len(live.current.api_key) == 1
    assert live.current.api_key[0].get_secret_value() != "short"
    saved.write(1, {"api_key": ["short", "a-client-key-long-enough-0001"]}, [], "test")
    live = live_on(db)
    assert [k.get_secret_value() for k in live.current.api_key] == ["a-client-key-long-enough-0001"]
