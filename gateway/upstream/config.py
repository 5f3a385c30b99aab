"""Building the upstream pool from settings: flags/env, a TOML config file, and
credentials added through the admin API (kept in the store)."""

from __future__ import annotations

import fnmatch
import os
import tomllib
from pathlib import Path
from typing import Any

from gateway.settings import Settings, SettingsError
from gateway.store.credentials import CredentialState
from gateway.upstream.pool import Credential, Upstream, UpstreamPool


def _keys_from_settings(settings: Settings) -> list[str | None]:
    keys: list[str] = []
    if settings.upstream_api_key:
        keys += [k.strip() for k in settings.upstream_api_key.get_secret_value().split(",") if k.strip()]
    if settings.upstream_api_key_file:
        text = Path(settings.upstream_api_key_file).read_text()
        keys += [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")]
    return list(keys) or [None]


def _upstreams_from_toml(path: Path) -> list[Credential]:
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise SettingsError(f"cannot read --config {path}: {exc}") from None
    credentials: list[Credential] = []
    for i, entry in enumerate(data.get("upstreams") or []):
        if not isinstance(entry, dict) or not isinstance(entry.get("base_url"), str):
            raise SettingsError(f"--config {path}: upstreams[{i}] needs a base_url")
        upstream = Upstream(
            name=str(entry.get("name") or f"upstream{i}"),
            base_url=entry["base_url"],
            headers={str(k): str(v) for k, v in (entry.get("headers") or {}).items()},
            models=frozenset(entry["models"]) if entry.get("models") else None,
            model_map={str(k): str(v) for k, v in (entry.get("model_map") or {}).items()},
        )
        keys: list[Any] = list(entry.get("api_keys") or [])
        if entry.get("api_key"):
            keys.append(entry["api_key"])
        for env_name in entry.get("api_key_env") or []:
            if os.environ.get(env_name):
                keys.append(os.environ[env_name])
        for key in keys or [None]:
            credentials.append(Credential(upstream, key))
    return credentials


def with_engine_extras(body: dict[str, Any], extras: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The upstream body plus the fields an inference engine needs for token data, for
    every configured model glob that matches (later globs win; the client's own fields
    are kept)."""
    model = str(body.get("model", ""))
    added: dict[str, Any] = {}
    for pattern, fields in extras.items():
        if fnmatch.fnmatchcase(model, pattern):
            added.update(fields)
    return {**added, **body} if added else body


def build_pool(settings: Settings, state: CredentialState | None, simulator_url: str | None) -> UpstreamPool:
    """Every credential the gateway may use, with persisted health restored."""
    credentials: list[Credential] = []
    keys = _keys_from_settings(settings)
    for i, url in enumerate(settings.upstream_url):
        upstream = Upstream(name=f"upstream{i}" if len(settings.upstream_url) > 1 else "upstream", base_url=url)
        credentials += [Credential(upstream, key) for key in keys]
    if settings.config:
        credentials += _upstreams_from_toml(settings.config)
    if not credentials and simulator_url:
        credentials.append(Credential(Upstream("simulator", simulator_url), None))
    if state is not None:
        by_name = {c.upstream.name: c.upstream for c in credentials}
        for credential_id, name, base_url, key in state.added_credentials():
            upstream = by_name.get(name) or Upstream(name, base_url)
            credentials.append(Credential(upstream, key, id=credential_id))
    return UpstreamPool(credentials, state, settings.max_in_flight_per_credential)
