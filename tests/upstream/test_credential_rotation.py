"""One credential per key, whatever its source (issue #38): a key rotated in through the
admin API and then written into ``--config`` is one credential (no duplicate id, traffic
not skewed toward it, disable reaches it); labels say where each key came from; an
``api_key_env`` naming an unset variable is a one-line start-up refusal."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest

from gateway.settings import Settings, SettingsError
from gateway.store.credentials import CredentialState
from gateway.store.db import open_database
from gateway.upstream.config import build_pool
from gateway.upstream.credential import Credential, Upstream, fingerprint
from gateway.upstream.pool import UpstreamPool
from tests.conftest import Gateway, ServerLoop
from tests.test_startup import clean_env, one_line_refusal, run_cli
from tests.upstream.keyed_upstream import KeyedUpstream
from tests.upstream.test_credentials import ADMIN, CLIENT_KEY, MESSAGES, start

OLD_KEY = "sk-rotation-old-key-0123456789"
NEW_KEY = "sk-rotation-new-key-9876543210"


def config_file(path: Path, url: str, env_names: list[str], label: str | None = None) -> Path:
    lines = ["[[upstreams]]", 'name = "prod"', f'base_url = "{url}/v1"', f"api_key_env = {orjson.dumps(env_names).decode()}"]
    if label:
        lines.append(f'label = "{label}"')
    path.write_text("\n".join(lines) + "\n")
    return path


def credentials(gateway: Gateway) -> list[dict[str, Any]]:
    answer = httpx.get(gateway.url + "/admin/api/credentials", headers=ADMIN)
    assert answer.status_code == 200
    return answer.json()["credentials"]  # type: ignore[no-any-return]


def ask(gateway: Gateway, n: int) -> None:
    """``n`` chat streams through the official SDK (strict), each assembled and checked."""
    client = openai.OpenAI(base_url=gateway.base_url, api_key=CLIENT_KEY, _strict_response_validation=True, max_retries=0)
    for _ in range(n):
        with client.chat.completions.stream(model="alpha", messages=MESSAGES) as events:
            assert events.get_final_completion().choices[0].message.content == "rotated"


def test_the_rotation_story_replays_with_one_credential_per_key(
    server_loop: ServerLoop, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    upstream = KeyedUpstream({OLD_KEY, NEW_KEY}, words=("rotated",))
    upstream.url = server_loop.serve(upstream.app())
    monkeypatch.setenv("ROT_OLD_KEY", OLD_KEY)
    monkeypatch.setenv("ROT_NEW_KEY", NEW_KEY)
    data = tmp_path / "data"
    before = start(server_loop, data, config=config_file(tmp_path / "a.toml", upstream.url, ["ROT_OLD_KEY"]))
    # 1. the new key goes in through the admin API, under the configured upstream
    added = httpx.post(before.url + "/admin/api/credentials", headers=ADMIN, timeout=20,
                       json={"base_url": upstream.url + "/v1", "api_key": NEW_KEY, "upstream": "prod", "label": "rotated in"})
    assert added.status_code == 201, added.text
    assert added.json()["label"] == "rotated in" and NEW_KEY not in added.text
    # the same key for the same URL under another upstream name is the same credential: refused
    again = httpx.post(before.url + "/admin/api/credentials", headers=ADMIN, timeout=20,
                       json={"base_url": upstream.url + "/v1", "api_key": NEW_KEY, "upstream": "other"})
    assert again.status_code == 409 and again.json()["error"]["code"] == "credential_exists"
    assert added.json()["id"] in again.json()["error"]["message"] and NEW_KEY not in again.text
    assert sorted(c["label"] for c in credentials(before)) == ["ROT_OLD_KEY", "rotated in"]
    # 2. then into the config, and a restart: one credential per key, no duplicate id
    after = start(server_loop, data, config=config_file(tmp_path / "b.toml", upstream.url, ["ROT_OLD_KEY", "ROT_NEW_KEY"]))
    listed = credentials(after)
    assert len(listed) == 2 and len({c["id"] for c in listed}) == 2
    assert {c["fingerprint"]: (c["label"], c["added_by_admin"]) for c in listed} == {
        fingerprint(OLD_KEY): ("ROT_OLD_KEY", False), fingerprint(NEW_KEY): ("ROT_NEW_KEY", False)}
    assert CredentialState(after.app.state.db).added_credentials() == []  # the config holds it now
    # traffic is even: 20 requests, 10 per key, none failed
    upstream.used.clear()
    ask(after, 20)
    assert Counter(upstream.used) == {OLD_KEY: 10, NEW_KEY: 10}
    # disabling the old key takes it out entirely (there is no second copy to keep serving)
    old_id = next(c["id"] for c in listed if c["fingerprint"] == fingerprint(OLD_KEY))
    disabled = httpx.post(f"{after.url}/admin/api/credentials/{old_id}/disable", headers=ADMIN, json={})
    assert disabled.status_code == 200 and disabled.json()["disabled"] is True
    upstream.used.clear()
    ask(after, 6)
    assert upstream.used == [NEW_KEY] * 6


def test_a_key_listed_twice_in_one_table_is_one_credential_with_labels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROT_SAME", OLD_KEY)
    path = tmp_path / "c.toml"
    path.write_text(
        '[[upstreams]]\nname = "u"\nbase_url = "http://127.0.0.1:9/v1"\n'
        f'api_key = "{OLD_KEY}"\napi_keys = ["{NEW_KEY}"]\napi_key_env = ["ROT_SAME"]\n'
        '[[upstreams]]\nname = "named"\nbase_url = "http://127.0.0.1:8/v1"\n'
        f'api_key = "{OLD_KEY}"\nlabel = "team gpu"\n'
    )
    pool = build_pool(Settings(config=path, data_dir=tmp_path), None, None)
    shown = [(c.upstream.name, c.fingerprint, c.label) for c in pool.credentials]
    assert shown == [
        ("u", fingerprint(NEW_KEY), "c.toml upstreams[0].api_keys[0]"),
        ("u", fingerprint(OLD_KEY), "c.toml upstreams[0].api_key"),  # ROT_SAME holds the same key: not a second one
        ("named", fingerprint(OLD_KEY), "team gpu"),  # another base URL: its own credential
    ]
    assert all(c.public()["label"] == c.label for c in pool.credentials)


def test_flag_and_file_keys_are_labelled_by_where_they_came_from(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    keys = tmp_path / "keys.txt"
    keys.write_text(f"# rotated monthly\n{OLD_KEY}\n\n{NEW_KEY}\n")
    monkeypatch.delenv("CODEBUDDY2API_UPSTREAM_API_KEY", raising=False)
    pool = build_pool(Settings(upstream_url=["http://127.0.0.1:9/v1"], upstream_api_key_file=keys, data_dir=tmp_path), None, None)
    assert [c.label for c in pool.credentials] == [f"{keys}:2", f"{keys}:4"]
    pool = build_pool(Settings(upstream_url=["http://127.0.0.1:9/v1"], upstream_api_key=f"{OLD_KEY},{NEW_KEY}",
                               data_dir=tmp_path), None, None)
    assert [c.label for c in pool.credentials] == ["--upstream-api-key #1", "--upstream-api-key #2"]


def test_a_stored_credential_whose_key_is_configured_is_superseded(tmp_path: Path) -> None:
    db = open_database(None, tmp_path)
    state = CredentialState(db)
    state.add_credential("fp@admin", "admin", "http://127.0.0.1:9/v1/", OLD_KEY, "from the WebUI")
    state.add_credential("fp2@admin", "admin", "http://127.0.0.1:9/v1", NEW_KEY, None)
    pool = build_pool(Settings(upstream_url=["http://127.0.0.1:9/v1"], upstream_api_key=OLD_KEY, data_dir=tmp_path), state, None)
    assert [(c.fingerprint, c.added_by_admin, c.label) for c in pool.credentials] == [
        (fingerprint(OLD_KEY), False, "--upstream-api-key"), (fingerprint(NEW_KEY), True, None)]
    assert pool.superseded == ["fp@admin"]
    db.close()


def test_a_shared_row_for_a_key_this_replica_configures_is_not_added() -> None:
    configured = Credential(Upstream("prod", "http://127.0.0.1:9/v1"), OLD_KEY, label="ROT_OLD_KEY")
    pool = UpstreamPool([configured])
    pool.apply_shared({}, [("fp@other", "other", "http://127.0.0.1:9/v1", OLD_KEY, "x"),
                           ("fp2@other", "other", "http://127.0.0.1:9/v1", NEW_KEY, "labelled")])
    assert [(c.id, c.label) for c in pool.credentials] == [(configured.id, "ROT_OLD_KEY"), ("fp2@other", "labelled")]


def test_an_unset_api_key_env_is_a_one_line_start_up_refusal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = config_file(tmp_path / "c.toml", "http://127.0.0.1:9", ["ROT_SET_KEY", "ROT_UNSET_KEY"])
    result = run_cli("serve", "--config", str(path), "--data-dir", str(tmp_path),
                     env=clean_env(ROT_SET_KEY=OLD_KEY))
    line = one_line_refusal(result)
    assert line == (f"codebuddy2api: error: --config {path}: upstreams[0].api_key_env: ROT_UNSET_KEY is not set "
                    "(or is empty); export it, or take it out of the list")
    assert OLD_KEY not in result.stderr
    monkeypatch.setenv("ROT_SET_KEY", OLD_KEY)
    monkeypatch.delenv("ROT_UNSET_KEY", raising=False)
    with pytest.raises(SettingsError, match="ROT_UNSET_KEY is not set"):  # in process too (create_app's pool)
        build_pool(Settings(config=path, data_dir=tmp_path), None, None)


def test_a_bad_label_is_a_400_naming_it(server_loop: ServerLoop, tmp_path: Path) -> None:
    gateway = start(server_loop, tmp_path, upstream_url=["http://127.0.0.1:9/v1"], upstream_api_key=OLD_KEY)
    for label in ("", "x" * 101, 7, "tab\there"):
        answer = httpx.post(gateway.url + "/admin/api/credentials", headers=ADMIN, timeout=20,
                            json={"base_url": "http://127.0.0.1:9/v1", "api_key": NEW_KEY, "label": label})
        assert answer.status_code == 400 and answer.json()["error"]["param"] == "label", label
