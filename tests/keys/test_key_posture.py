"""Who may call /v1, as the banner and the status API say it (gateway/keys/posture.py):
once a managed key exists, keys are required on loopback too, and a store whose keys are
all revoked or expired locks /v1; the banner must never say ``loopback bind only`` then."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
from pydantic import SecretStr

from gateway.banner import render_text, startup_facts
from gateway.keys.model import KeyLimits, ManagedKey
from gateway.keys.posture import ClientAuth
from gateway.settings import Settings
from gateway.upstream.credential import Upstream
from tests.processes import free_port, wait_healthy
from tests.test_startup import clean_env

NOW = 1_800_000_000.0


def key(key_id: str, revoked: bool = False, expires_at: float | None = None) -> ManagedKey:
    return ManagedKey(key_id, key_id, "cb2_xxxx", "h" + key_id, KeyLimits(expires_at=expires_at), NOW - 100,
                      NOW - 50 if revoked else None)


def test_no_key_of_either_kind_is_the_loopback_only_gateway() -> None:
    auth = ClientAuth.of(0, [], allow_open=False, now=NOW)
    assert not auth.key_required and not auth.locked
    assert auth.summary() == "no client key (loopback bind only)"
    assert ClientAuth.of(0, [], allow_open=True, now=NOW).summary().startswith("OPEN")


def test_revoked_and_expired_keys_still_require_a_key_but_are_not_usable() -> None:
    auth = ClientAuth.of(0, [key("a"), key("b", revoked=True), key("c", expires_at=NOW - 1), key("d", expires_at=NOW + 60)],
                         allow_open=True, now=NOW)
    assert (auth.managed_keys, auth.usable_managed_keys) == (4, 2)
    assert auth.key_required and not auth.locked
    assert auth.public()["allow_open"] is False  # --allow-open no longer opens anything
    assert auth.summary() == "4 managed key(s) (2 usable): every /v1 request needs a key, loopback too"


def test_only_revoked_keys_lock_the_gateway_unless_a_static_key_remains() -> None:
    locked = ClientAuth.of(0, [key("a", revoked=True)], allow_open=False, now=NOW)
    assert locked.locked and "none is usable" in locked.summary() and "Keys page" in locked.summary()
    static = ClientAuth.of(2, [key("a", revoked=True)], allow_open=False, now=NOW)
    assert static.key_required and not static.locked
    assert static.summary().startswith("2 static + 1 managed key(s) (0 usable)")
    assert ClientAuth.of(1, [], allow_open=False, now=NOW).summary() == "1 client key(s) required"


def test_the_banner_facts_say_managed_keys_lock_loopback(tmp_path: Path) -> None:
    settings = Settings(upstream_url=["http://h:1/v1"], data_dir=tmp_path, admin_token=SecretStr("admin-secret-token-0001"))
    facts = startup_facts(settings, [Upstream("upstream", "http://h:1/v1")], None, webui=True, managed_keys=[key("a")])
    assert facts["client_key_required"] is True and facts["managed_keys"] == 1
    text = render_text(facts)
    assert "loopback bind only" not in text
    [line] = [line for line in text.splitlines() if line.strip().startswith("clients")]
    assert line.split(None, 1)[1] == "1 managed key(s) (1 usable): every /v1 request needs a key, loopback too"
    plain = startup_facts(settings, [Upstream("upstream", "http://h:1/v1")], None, webui=True)
    assert plain["client_key_required"] is False and "no client key (loopback bind only)" in render_text(plain)


def test_serve_after_a_key_was_created_says_so_and_loopback_is_401(tmp_path: Path) -> None:
    """The issue's replay: a key created (then revoked) before a restart; the restarted
    gateway's banner says keys are required and none is usable, and /v1 on loopback is 401."""
    from gateway.keys import store as key_store
    from gateway.store.db import open_database

    db = open_database(None, tmp_path)
    key_store.insert(db, ManagedKey("k1", "team", "cb2_abcd", "0" * 64, KeyLimits(), time.time(), time.time()))
    db.close()
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway", "serve", "--simulator", "--port", str(port), "--data-dir", str(tmp_path),
         "--log-level", "error"],
        env=clean_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    try:
        wait_healthy(proc, f"http://127.0.0.1:{port}")
        refused = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions",
                             json={"model": "text", "messages": [{"role": "user", "content": "hi"}]})
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    finally:
        proc.terminate()
        _, stderr = proc.communicate(timeout=15)
    banner = next(json.loads(line) for line in stderr.splitlines() if '"startup"' in line)
    assert banner["client_key_required"] is True and banner["managed_keys"] == 1
    assert banner["client_auth"].startswith("1 managed key(s) (0 usable): every /v1 request needs a key, loopback too")
    assert "loopback bind only" not in stderr
