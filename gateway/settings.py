"""Every configurable value, where it came from, and the one place it is validated.

Precedence: CLI flag > environment (``CODEBUDDY2API_*`` and ``.env``) > saved > default.
Settings are loaded once at start-up into a :class:`LiveSettings` holder; each request
takes a frozen :class:`~gateway.policy.StreamPolicy` snapshot from it, so a change made
while a request runs only affects the next request.
"""

from __future__ import annotations

import os
import threading
from enum import StrEnum
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SecretStr, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

ENV_PREFIX = "CODEBUDDY2API_"

Source = Literal["cli", "env", "saved", "default"]


class StreamMode(StrEnum):
    """How a streaming request is relayed; frozen per request when it starts."""

    COMPATIBLE = "compatible"
    REALTIME = "realtime"


class Settings(BaseSettings):
    """The gateway's configuration. Field names map to flags (``--stream-mode``) and
    environment variables (``CODEBUDDY2API_STREAM_MODE``)."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_file=".env",
        env_file_encoding="utf-8",
        extra="ignore",
        frozen=True,
    )

    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)
    upstream_url: str | None = Field(
        None, description="Upstream base URL ending in /v1; none = the built-in simulator"
    )
    upstream_api_key: SecretStr | None = None
    stream_mode: StreamMode = StreamMode.COMPATIBLE
    max_collect_bytes: int = Field(8 * 1024 * 1024, ge=0, description="0 = unlimited")
    tool_repair_attempts: int = Field(2, ge=0, le=10)
    keepalive_interval: float = Field(5.0, gt=0, le=60)
    connect_timeout: float = Field(10.0, gt=0)
    first_byte_timeout: float = Field(120.0, gt=0)
    idle_timeout: float = Field(120.0, gt=0)
    data_dir: Path = Path("data")
    log_level: Literal["debug", "info", "warning", "error"] = "info"


#: Settings that may be given on the command line of ``serve`` (name -> help text).
CLI_FIELDS: dict[str, str] = {
    "host": "address to bind",
    "port": "port to bind",
    "upstream_url": "upstream base URL ending in /v1 (default: the built-in simulator)",
    "upstream_api_key": "API key sent to the upstream as a Bearer token",
    "stream_mode": "compatible (aggregate, validate, replay) or realtime (relay as it arrives)",
    "max_collect_bytes": "output-byte budget per request, 0 = unlimited",
    "tool_repair_attempts": "how many times a bad tool call may be regenerated",
    "keepalive_interval": "seconds between keepalive events while the client waits",
    "connect_timeout": "seconds to connect to the upstream",
    "first_byte_timeout": "seconds to wait for the upstream's response headers",
    "idle_timeout": "seconds of upstream silence before the stream is abandoned",
    "data_dir": "directory for the SQLite store and other state",
    "log_level": "debug, info, warning or error",
}


class SettingsError(ValueError):
    """A value that failed validation, with a one-line message naming where it came from."""


def _describe_error(exc: ValidationError, cli_keys: set[str], saved: bool = False) -> str:
    err = exc.errors()[0]
    field = str(err["loc"][0]) if err["loc"] else "?"
    if saved:
        where = field
    elif field in cli_keys:
        where = f"--{field.replace('_', '-')}"
    else:
        where = f"{ENV_PREFIX}{field.upper()}"
    allowed = ""
    annotation = Settings.model_fields[field].annotation if field in Settings.model_fields else None
    if isinstance(annotation, type) and issubclass(annotation, StrEnum):
        allowed = " (allowed: " + ", ".join(m.value for m in annotation) + ")"
    return f"invalid value {err.get('input')!r} for {where}: {err['msg']}{allowed}"


def _env_keys() -> set[str]:
    names = {k.upper() for k in os.environ if k.upper().startswith(ENV_PREFIX)}
    return {n[len(ENV_PREFIX):].lower() for n in names}


def load_settings(cli_values: dict[str, Any] | None = None) -> tuple[Settings, dict[str, Source]]:
    """Build settings from CLI values (highest), the environment and ``.env``, defaults.

    Returns the settings and each field's source. Raises :class:`SettingsError` with a
    one-line message on an invalid value.
    """
    cli = {k: v for k, v in (cli_values or {}).items() if v is not None}
    try:
        settings = Settings(**cli)
    except ValidationError as exc:
        raise SettingsError(_describe_error(exc, set(cli))) from None
    env_keys = _env_keys()
    sources: dict[str, Source] = {}
    for name in Settings.model_fields:
        if name in cli:
            sources[name] = "cli"
        elif name in env_keys or name in settings.model_fields_set:
            sources[name] = "env"
        else:
            sources[name] = "default"
    return settings, sources


class LiveSettings:
    """The settings in force now, swappable at run time (admin API, tests).

    Readers take :attr:`current` once per request; writers replace the whole frozen
    object, so a reader never sees half an update.
    """

    def __init__(self, settings: Settings, sources: dict[str, Source]) -> None:
        self._lock = threading.Lock()
        self._current = settings
        self.sources = dict(sources)
        self.revision = 0

    @property
    def current(self) -> Settings:
        return self._current

    def update(self, **changes: Any) -> Settings:
        """Apply changes as ``saved`` values; source-locked (cli/env) fields are refused."""
        with self._lock:
            locked = [k for k in changes if self.sources.get(k) in ("cli", "env")]
            if locked:
                raise SettingsError(
                    f"{locked[0]} is set by {self.sources[locked[0]]} and cannot be changed here"
                )
            merged = self._current.model_dump() | changes
            try:
                new = Settings.model_validate(merged)
            except ValidationError as exc:
                raise SettingsError(_describe_error(exc, set(), saved=True)) from None
            self._current = new
            for k in changes:
                self.sources[k] = "saved"
            self.revision += 1
            return new
