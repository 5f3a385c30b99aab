"""Building the upstream pool from settings: flags/env, the ``--config`` TOML file
(gateway/upstream/config_file.py), and credentials added through the admin API (kept in
the store)."""

from __future__ import annotations

import fnmatch
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import structlog

from gateway.settings import ENV_PREFIX, Settings, SettingsError
from gateway.store.credentials import CredentialState
from gateway.upstream.config_file import UpstreamEntry, load_config_file, model_reasoning_tags
from gateway.upstream.credential import Credential, Upstream
from gateway.upstream.pool import UpstreamPool
from gateway.upstream.routing import build_router
from gateway.upstream.urls import UpstreamURLError, check_upstream_url

log = structlog.get_logger("gateway.config")


#: A key and its default label (where it came from: never the key).
LabelledKey = tuple[str | None, str | None]


def _numbered(keys: list[str], label: str) -> list[LabelledKey]:
    return [(key, label if len(keys) == 1 else f"{label} #{n}") for n, key in enumerate(keys, 1)]


def _keys_from_settings(settings: Settings) -> list[LabelledKey]:
    keys: list[LabelledKey] = []
    if settings.upstream_api_key:
        values = [k.strip() for k in settings.upstream_api_key.get_secret_value().split(",") if k.strip()]
        variable = ENV_PREFIX + "UPSTREAM_API_KEY"
        keys += _numbered(values, variable if os.environ.get(variable) else "--upstream-api-key")
    if settings.upstream_api_key_file:
        path = Path(settings.upstream_api_key_file)
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if line.strip() and not line.startswith("#"):
                keys.append((line.strip(), f"{path}:{n}"))
    return keys or [(None, None)]


def unset_key_variable(path: Path, entries: list[UpstreamEntry], environ: Mapping[str, str]) -> str | None:
    """An ``api_key_env`` naming a variable that is unset or empty: the one-line refusal
    (a credential silently missing would leave the upstream with fewer keys than listed)."""
    for i, entry in enumerate(entries):
        for name in entry.api_key_env:
            if not environ.get(name):
                return (f"--config {path}: upstreams[{i}].api_key_env: {name} is not set (or is empty); "
                        "export it, or take it out of the list")
    return None


def _entry_keys(path: Path, i: int, entry: UpstreamEntry) -> list[LabelledKey]:
    """One [[upstreams]] table's keys, each with its label: the table's ``label`` (numbered
    when it has several keys), else the config key or environment variable it came from."""
    where = f"{path.name} upstreams[{i}]"
    keys: list[LabelledKey] = [(k.get_secret_value(), f"{where}.api_keys[{j}]") for j, k in enumerate(entry.api_keys)]
    if entry.api_key:
        keys.append((entry.api_key.get_secret_value(), f"{where}.api_key"))
    keys += [(os.environ[name], name) for name in entry.api_key_env]
    if not keys:
        return [(None, entry.label)]
    if entry.label:
        return [(key, entry.label if len(keys) == 1 else f"{entry.label} ({source})") for key, source in keys]
    return keys


def _upstreams_from_toml(path: Path, allowed_hosts: list[str]) -> list[Credential]:
    credentials: list[Credential] = []
    entries = load_config_file(path).upstreams
    problem = unset_key_variable(path, entries, os.environ)
    if problem:
        raise SettingsError(problem)
    for i, entry in enumerate(entries):
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
            max_in_flight=entry.max_in_flight,
            queue_timeout=entry.queue_timeout,
        )
        for key, label in _entry_keys(path, i, entry):
            credentials.append(Credential(upstream, key, label=label))
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


def _one_per_key(credentials: list[Credential]) -> list[Credential]:
    """A key listed twice for one upstream (api_key and api_keys, two variables holding the
    same value) is one credential: twice in the pool it would get twice the traffic."""
    kept: dict[tuple[str, str, str], Credential] = {}
    for credential in credentials:
        twin = kept.setdefault((credential.upstream.name, *credential.identity), credential)
        if twin is not credential:
            log.warning("credential_listed_twice", credential=credential.id, label=credential.label, kept_label=twin.label)
    return list(kept.values())


def configured_credentials(settings: Settings) -> list[Credential]:
    """The credentials the flags and the ``--config`` file name (one per key and base URL
    within an upstream). Reads the key file and the TOML file: a SettingsError names a bad one."""
    credentials: list[Credential] = []
    keys = _keys_from_settings(settings)
    for i, url in enumerate(settings.upstream_url):
        token_in = None if settings.token_in == "none" else settings.token_in
        upstream = Upstream(name=f"upstream{i}" if len(settings.upstream_url) > 1 else "upstream", base_url=url,
                            capture_tokens=token_in, token_in=token_in,
                            engine_api=None if settings.engine_api == "none" else settings.engine_api)
        credentials += [Credential(upstream, key, label=label) for key, label in keys]
    if settings.config:
        credentials += _upstreams_from_toml(settings.config, settings.allow_upstream_host)
        model_reasoning_tags(settings.config)  # a bad [models] table fails at start-up
    return _one_per_key(credentials)


def build_pool(settings: Settings, state: CredentialState | None, simulator_url: str | None) -> UpstreamPool:
    """Every credential the gateway may use, with persisted health restored: one per key
    and base URL, whatever its source. An admin-added credential whose key the
    configuration now holds too (the key rotated in through the admin API, then written
    into --config) is left out: ``pool.superseded`` lists those stored ids."""
    credentials = configured_credentials(settings)
    if not credentials and simulator_url:
        credentials.append(Credential(Upstream("simulator", simulator_url), None))
    superseded: list[str] = []
    if state is not None:
        by_name = {c.upstream.name: c.upstream for c in credentials}
        configured = {c.identity: c for c in credentials}
        for row in state.added_credentials():
            try:  # a row saved before the URL check (or by an older version): skipped, never a 500
                check_upstream_url(row.base_url, settings.allow_upstream_host)
            except UpstreamURLError as exc:
                log.warning("stored_credential_skipped", credential_id=row.credential_id, upstream=row.upstream, reason=str(exc))
                continue
            upstream = by_name.get(row.upstream) or Upstream(row.upstream, row.base_url)
            credential = Credential(upstream, row.api_key, id=row.credential_id, added_by_admin=True, label=row.label)
            twin = configured.get(credential.identity)
            if twin is not None:
                log.warning("stored_credential_superseded", credential_id=row.credential_id, configured_as=twin.id)
                superseded.append(row.credential_id)
                continue
            configured[credential.identity] = credential
            credentials.append(credential)
    router = build_router(settings.routing, time.time, settings.routing_imbalance_rel, settings.routing_imbalance_abs,
                          settings.routing_slow_factor)
    pool = UpstreamPool(credentials, state, settings.max_in_flight_per_credential, router=router)
    pool.superseded = superseded
    return pool
