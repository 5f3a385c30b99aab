"""Building the upstream pool from settings: flags/env, the ``--config`` TOML file
(gateway/upstream/config_file.py), and credentials added through the admin API (kept in
the store)."""

from __future__ import annotations

import fnmatch
import os
from pathlib import Path
from typing import Any

import structlog

from gateway.settings import Settings, SettingsError
from gateway.store.credentials import CredentialState
from gateway.upstream.config_file import load_config_file, model_reasoning_tags
from gateway.upstream.credential import Credential, Upstream
from gateway.upstream.pool import UpstreamPool
from gateway.upstream.urls import UpstreamURLError, check_upstream_url

log = structlog.get_logger("gateway.config")


def _keys_from_settings(settings: Settings) -> list[str | None]:
    keys: list[str] = []
    if settings.upstream_api_key:
        keys += [k.strip() for k in settings.upstream_api_key.get_secret_value().split(",") if k.strip()]
    if settings.upstream_api_key_file:
        text = Path(settings.upstream_api_key_file).read_text()
        keys += [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")]
    return list(keys) or [None]


def _upstreams_from_toml(path: Path, allowed_hosts: list[str]) -> list[Credential]:
    credentials: list[Credential] = []
    for i, entry in enumerate(load_config_file(path).upstreams):
        try:
            check_upstream_url(entry.base_url, allowed_hosts)
        except UpstreamURLError as exc:
            raise SettingsError(f"--config {path}: upstreams[{i}].base_url: {exc}") from None
        upstream = Upstream(
            name=entry.name or f"upstream{i}",
            base_url=entry.base_url,
            headers=dict(entry.headers),
            models=frozenset(entry.models) if entry.models else None,
            model_map=dict(entry.model_map),
            capture_tokens=entry.capture_tokens or entry.token_in,
            token_in=entry.token_in,
            engine_api=None if entry.engine_api in (None, "none") else entry.engine_api,
        )
        keys: list[Any] = [k.get_secret_value() for k in entry.api_keys]
        if entry.api_key:
            keys.append(entry.api_key.get_secret_value())
        for env_name in entry.api_key_env:
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
        token_in = None if settings.token_in == "none" else settings.token_in
        upstream = Upstream(name=f"upstream{i}" if len(settings.upstream_url) > 1 else "upstream", base_url=url,
                            capture_tokens=token_in, token_in=token_in,
                            engine_api=None if settings.engine_api == "none" else settings.engine_api)
        credentials += [Credential(upstream, key) for key in keys]
    if settings.config:
        credentials += _upstreams_from_toml(settings.config, settings.allow_upstream_host)
        model_reasoning_tags(settings.config)  # a bad [models] table fails at start-up
    if not credentials and simulator_url:
        credentials.append(Credential(Upstream("simulator", simulator_url), None))
    if state is not None:
        by_name = {c.upstream.name: c.upstream for c in credentials}
        for credential_id, name, base_url, key in state.added_credentials():
            try:  # a row saved before the URL check (or by an older version): skipped, never a 500
                check_upstream_url(base_url, settings.allow_upstream_host)
            except UpstreamURLError as exc:
                log.warning("stored_credential_skipped", credential_id=credential_id, upstream=name, reason=str(exc))
                continue
            upstream = by_name.get(name) or Upstream(name, base_url)
            credentials.append(Credential(upstream, key, id=credential_id, added_by_admin=True))
    return UpstreamPool(credentials, state, settings.max_in_flight_per_credential)
