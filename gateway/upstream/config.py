"""Building the upstream pool from settings: flags/env, a TOML config file, and
credentials added through the admin API (kept in the store)."""

from __future__ import annotations

import fnmatch
import os
import re
import tomllib
from pathlib import Path
from typing import Any, Literal

import structlog
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator

from gateway.settings import Settings, SettingsError, check_base_url
from gateway.store.credentials import CredentialState
from gateway.upstream.model_options import model_reasoning_tags
from gateway.upstream.pool import Credential, Upstream, UpstreamPool
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


class UpstreamEntry(BaseModel):
    """One ``[[upstreams]]`` table of the ``--config`` file (docs/configuration.md)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str | None = Field(None, description="shown in the banner, metrics and audit (default upstreamN)")
    base_url: str = Field(description="the upstream's OpenAI-compatible base URL, ending in /v1")
    api_key: SecretStr | None = Field(None, description="one key, sent as Authorization: Bearer")
    api_keys: list[SecretStr] = Field(default_factory=list, description="several keys = several credentials")
    api_key_env: list[str] = Field(default_factory=list, description="names of environment variables holding keys")
    headers: dict[str, str] = Field(default_factory=dict, description="extra request headers for this upstream")
    models: list[str] | None = Field(None, description="allow-list of client model names this upstream serves")
    model_map: dict[str, str] = Field(default_factory=dict, description="client model name -> upstream model name")
    capture_tokens: Literal["none", "vllm", "llamacpp"] | None = Field(
        None, description="this upstream's token source for rollout records (default: --capture-tokens)"
    )
    token_in: Literal["vllm", "llamacpp"] | None = Field(
        None, description="token-in continuation of rollout calls through this engine (docs/capture.md);"
        " implies capture_tokens of the same engine unless set"
    )

    @field_validator("base_url")
    @classmethod
    def _url(cls, value: str) -> str:
        return check_base_url(value)


class ModelEntry(BaseModel):
    """One ``[models."<glob>"]`` table: options for the models whose name matches the glob."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    reasoning_tags: bool | Literal["auto", "open"] = Field(
        False, description='split <think> tags out of content: true/"auto", or "open" when the template opens <think>'
    )


class ConfigFile(BaseModel):
    """The whole ``--config`` TOML file: unknown keys are refused (a typo must not
    silently disable a setting)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    upstreams: list[UpstreamEntry] = Field(default_factory=list, description="one table per upstream")
    models: dict[str, ModelEntry] = Field(default_factory=dict, description='per-model options, keyed by a name glob')


def _key_line(text: str, loc: tuple[int | str, ...]) -> int | None:
    """The 1-based line a validation error's location points at. tomllib keeps no
    positions, so scan: the ``loc[1]``-th ``[[upstreams]]`` header, then the key in it."""
    lines = text.splitlines()
    if not loc:
        return None
    table, rest = loc[0], loc[1:]
    if table == "models" and len(rest) >= 2:  # [models."<glob>"], then the key in it
        header = re.compile(rf"""^\s*\[\s*models\s*\.\s*["']?{re.escape(str(rest[0]))}["']?\s*\]""")
        key = re.compile(rf"^\s*{re.escape(str(rest[1]))}\s*=")
        start = next((n for n, line in enumerate(lines, 1) if header.match(line)), None)
        if start is not None:
            for n in range(start + 1, len(lines) + 1):
                if re.match(r"^\s*\[", lines[n - 1]):
                    break
                if key.match(lines[n - 1]):
                    return n
        return start
    if table != "upstreams" or not rest or not isinstance(rest[0], int):
        pattern = re.compile(rf"^\s*(\[\[?\s*)?{re.escape(str(table))}\b")
        return next((n for n, line in enumerate(lines, 1) if pattern.match(line)), None)
    headers = [n for n, line in enumerate(lines, 1) if re.match(r"^\s*\[\[\s*upstreams\s*\]\]", line)]
    if rest[0] >= len(headers):
        return next((n for n, line in enumerate(lines, 1) if re.match(r"^\s*upstreams\s*=", line)), None)
    start = headers[rest[0]]
    if len(rest) < 2:
        return start
    key = re.compile(rf"^\s*[\"']?{re.escape(str(rest[1]))}[\"']?\s*[=.]")
    for n in range(start + 1, len(lines) + 1):
        line = lines[n - 1]
        if re.match(r"^\s*\[", line) and not re.match(rf"^\s*\[\s*upstreams\.{re.escape(str(rest[1]))}", line):
            break
        if key.match(line):
            return n
    return start


def _error_line(path: Path, text: str, exc: ValidationError) -> str:
    """The first validation error as one line: file:line: key: what is wrong."""
    err = exc.errors()[0]
    loc = tuple(err["loc"])
    key = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc).lstrip(".") or "(file)"
    line = _key_line(text, loc)
    where = f"{path}:{line}" if line else str(path)
    message = err["msg"].removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        parent = ConfigFile if len(loc) == 1 else ModelEntry if loc[0] == "models" else UpstreamEntry
        message = "unknown key (allowed: " + ", ".join(parent.model_fields) + ")"
    return f"--config {where}: {key}: {message}"


def load_config_file(path: Path) -> ConfigFile:
    """Read and validate ``--config``; raises SettingsError with one line naming the
    file, the key and its line."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise SettingsError(f"--config {path}: cannot read it: {exc.strerror or exc}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise SettingsError(f"--config {path}: not valid TOML: {exc}") from None
    try:
        return ConfigFile.model_validate(data)
    except ValidationError as exc:
        raise SettingsError(_error_line(path, text, exc)) from None


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
                            capture_tokens=token_in, token_in=token_in)
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
