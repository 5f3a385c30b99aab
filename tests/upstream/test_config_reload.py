"""Re-reading ``--config`` while serving (issue #38): ``POST /admin/api/reload`` and SIGHUP
swap the configured credentials without dropping a request (an answer in flight on a key
that leaves ends normally), keep a kept credential's state, refuse a bad file with its one
line and change nothing, and keep a gone key masked."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson

from gateway.redact import SECRETS
from gateway.upstream.credential import fingerprint
from tests.conftest import ServerLoop, wait_for
from tests.processes import free_port, wait_healthy
from tests.test_startup import clean_env
from tests.upstream.keyed_upstream import WORDS, KeyedUpstream
from tests.upstream.test_credentials import ADMIN, ADMIN_TOKEN, CLIENT_KEY, MESSAGES, start

OLD_KEY = "sk-reload-old-key-0123456789"
NEW_KEY = "sk-reload-new-key-9876543210"


def write_config(path: Path, url: str, keys: list[str], extra: str = "") -> Path:
    path.write_text(f'[[upstreams]]\nname = "prod"\nbase_url = "{url}/v1"\napi_keys = {orjson.dumps(keys).decode()}\n{extra}')
    return path


def answer(base_url: str, model: str = "alpha") -> str:
    client = openai.OpenAI(base_url=base_url, api_key=CLIENT_KEY, _strict_response_validation=True, max_retries=0)
    with client.chat.completions.stream(model=model, messages=MESSAGES) as events:
        return events.get_final_completion().choices[0].message.content or ""


def reload(url: str) -> httpx.Response:
    return httpx.post(url + "/admin/api/reload", headers=ADMIN, json={}, timeout=30)


def test_a_reload_rotates_the_key_without_dropping_the_answer_in_flight(server_loop: ServerLoop, tmp_path: Path) -> None:
    upstream = KeyedUpstream({OLD_KEY, NEW_KEY}, delay=0.15)
    upstream.url = server_loop.serve(upstream.app())
    config = write_config(tmp_path / "gw.toml", upstream.url, [OLD_KEY])
    gateway = start(server_loop, tmp_path / "data", config=config)
    old_id = gateway.app.state.relay.pool.credentials[0].id
    # an answer streams on the old key while the key rotates under it
    results: dict[str, Any] = {}
    streaming = threading.Thread(target=lambda: results.update(text=answer(gateway.base_url, "slow")))
    streaming.start()
    wait_for(lambda: upstream.used == [OLD_KEY])
    write_config(config, upstream.url, [NEW_KEY])
    reloaded = reload(gateway.url)
    assert reloaded.status_code == 200, reloaded.text
    body = reloaded.json()
    new_id = f"{fingerprint(NEW_KEY)}@prod"
    assert (body["added"], body["removed"], body["superseded"]) == ([new_id], [old_id], [])
    assert [c["id"] for c in body["credentials"]] == [new_id] and OLD_KEY not in reloaded.text
    streaming.join(30)
    assert results["text"] == "".join(WORDS)  # whole: not cut by the reload
    upstream.used.clear()
    for _ in range(4):
        assert answer(gateway.base_url).startswith("w0")
    assert upstream.used == [NEW_KEY] * 4
    assert OLD_KEY not in SECRETS.mask(f"leaked {OLD_KEY}")  # the gone key stays masked for the life of the process


def test_a_kept_credential_keeps_its_state_and_a_new_one_joins(server_loop: ServerLoop, tmp_path: Path) -> None:
    upstream = KeyedUpstream({OLD_KEY, NEW_KEY})
    upstream.url = server_loop.serve(upstream.app())
    config = write_config(tmp_path / "gw.toml", upstream.url, [OLD_KEY])
    gateway = start(server_loop, tmp_path / "data", config=config)
    old_id = gateway.app.state.relay.pool.credentials[0].id
    assert httpx.post(f"{gateway.url}/admin/api/credentials/{old_id}/disable", headers=ADMIN, json={}).status_code == 200
    write_config(config, upstream.url, [OLD_KEY, NEW_KEY], extra='label = "rotating"\n')
    body = reload(gateway.url).json()
    shown = {c["id"]: c for c in body["credentials"]}
    assert shown[old_id]["disabled"] is True and shown[old_id]["label"] == f"rotating ({config.name} upstreams[0].api_keys[0])"
    assert body["removed"] == [] and len(body["added"]) == 1
    upstream.used.clear()
    for _ in range(3):
        answer(gateway.base_url)
    assert Counter(upstream.used) == {NEW_KEY: 3}  # the disabled one stays out


def test_a_bad_file_is_refused_and_changes_nothing(server_loop: ServerLoop, tmp_path: Path) -> None:
    upstream = KeyedUpstream({OLD_KEY})
    upstream.url = server_loop.serve(upstream.app())
    config = write_config(tmp_path / "gw.toml", upstream.url, [OLD_KEY])
    gateway = start(server_loop, tmp_path / "data", config=config)
    before = [c.id for c in gateway.app.state.relay.pool.credentials]
    config.write_text(config.read_text() + "model_maps = {}\n")
    refused = reload(gateway.url)
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "invalid_config"
    assert "model_maps: unknown key" in refused.json()["error"]["message"]
    write_config(config, upstream.url, [OLD_KEY], extra='api_key_env = ["RELOAD_UNSET_VARIABLE"]\n')
    unset = reload(gateway.url)
    assert unset.status_code == 400 and "RELOAD_UNSET_VARIABLE is not set" in unset.json()["error"]["message"]
    assert [c.id for c in gateway.app.state.relay.pool.credentials] == before
    assert answer(gateway.base_url).startswith("w0")


def test_nothing_to_reload_without_a_config(server_loop: ServerLoop, tmp_path: Path) -> None:
    gateway = start(server_loop, tmp_path / "data", simulator=True)
    refused = reload(gateway.url)
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "nothing_to_reload"


def test_sighup_reloads_a_serving_process(server_loop: ServerLoop, tmp_path: Path) -> None:
    upstream = KeyedUpstream({OLD_KEY, NEW_KEY})
    upstream.url = server_loop.serve(upstream.app())
    config = write_config(tmp_path / "gw.toml", upstream.url, [OLD_KEY])
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway", "serve", "--port", str(port), "--config", str(config), "--data-dir",
         str(tmp_path / "data"), "--admin-token", ADMIN_TOKEN, "--log-level", "info"],
        env=clean_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url)

        def fingerprints() -> set[str]:
            return {c["fingerprint"] for c in httpx.get(url + "/admin/api/credentials", headers=ADMIN).json()["credentials"]}

        assert fingerprints() == {fingerprint(OLD_KEY)}
        write_config(config, upstream.url, [OLD_KEY, NEW_KEY])
        proc.send_signal(signal.SIGHUP)
        wait_for(lambda: fingerprints() == {fingerprint(OLD_KEY), fingerprint(NEW_KEY)}, timeout=15)
        assert proc.poll() is None  # SIGHUP no longer ends the process
        config.write_text("not toml [")
        proc.send_signal(signal.SIGHUP)  # refused: one log line, the pool kept, still serving
        time.sleep(0.5)
        assert proc.poll() is None and len(fingerprints()) == 2
    finally:
        proc.terminate()
        _, stderr = proc.communicate(timeout=20)
    assert '"config_reloaded"' in stderr and '"config_reload_refused"' in stderr
    assert OLD_KEY not in stderr and NEW_KEY not in stderr
