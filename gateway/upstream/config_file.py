"""The ``--config`` TOML file: its one validated model (``[[upstreams]]`` tables and per-model
``[models."<glob>"]`` options), read with errors that name the file, the key and its line.

::

    [models."qwen3*"]
    reasoning_tags = true        # or "auto"; "open" when the template opens <think>
    max_input_tokens = 131072    # what GET /v1/models reports (clients size compaction by it)
    max_output_tokens = 16384
    capabilities = { tools = true, reasoning = true }

Per-model options are read once per file version (path and modification time), so a
request's policy snapshot costs a stat, not a parse.
"""

from __future__ import annotations

import re
import tomllib
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator

from gateway.settings import SettingsError, check_base_url


class UpstreamEntry(BaseModel):
    """One ``[[upstreams]]`` table of the ``--config`` file (docs/configuration.md)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str | None = Field(None, description="shown in the banner, metrics and audit (default upstreamN)")
    base_url: str = Field(description="the upstream's OpenAI-compatible base URL, ending in /v1")
    api_key: SecretStr | None = Field(None, description="one key, sent as Authorization: Bearer")
    api_keys: list[SecretStr] = Field(default_factory=list, description="several keys = several credentials")
    api_key_env: list[str] = Field(default_factory=list, description="names of environment variables holding keys (each must be set)")
    label: str | None = Field(None, max_length=100, description="the operator's name for this table's credentials, shown"
                              " in the admin API (default: the variable or config key each key came from)")
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
    engine_api: Literal["vllm", "none"] | None = Field(
        None, description="this engine's control API for weight sync (docs/weight-sync.md; default: --engine-api)"
    )
    max_in_flight: int | None = Field(
        None, ge=1, description="requests this engine runs at once (llama-server --parallel N, vLLM --max-num-seqs):"
        " more wait in the gateway, before their first-byte timer starts, not in the engine's queue (docs/upstreams.md)"
    )
    queue_timeout: float = Field(
        300.0, gt=0, description="seconds a request may wait in the gateway for a free slot of max_in_flight"
        " (then 503 upstream_capacity)"
    )

    @field_validator("base_url")
    @classmethod
    def _url(cls, value: str) -> str:
        return check_base_url(value)


#: The capability flags a ``[models."<glob>"]`` table may state.
Capability = Literal["tools", "vision", "reasoning", "structured_outputs"]


class ModelPrice(BaseModel):
    """What a model's tokens cost, per million (in the operator's currency)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    input: float = Field(ge=0, description="per million input (prompt) tokens")
    cached_input: float | None = Field(None, ge=0, description="per million cached input tokens (default: input)")
    output: float = Field(ge=0, description="per million output tokens (reasoning included)")


class ModelEntry(BaseModel):
    """One ``[models."<glob>"]`` table: options for the models whose name matches the glob."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    reasoning_tags: bool | Literal["auto", "open"] = Field(
        False, description='split <think> tags out of content: true/"auto", or "open" when the template opens <think>'
    )
    max_input_tokens: int | None = Field(None, gt=0, description="the context window /v1/models reports (default: the"
                                         " upstream's own, e.g. vLLM's max_model_len)")
    max_output_tokens: int | None = Field(None, gt=0, description="the largest max_tokens /v1/models reports")
    capabilities: dict[Capability, bool] = Field(default_factory=dict, description="capability flags /v1/models"
                                                 " reports: tools, vision, reasoning, structured_outputs")
    price: ModelPrice | None = Field(None, description="per million tokens: input, cached_input, output (the audit"
                                     " record's cost and codebuddy2api_cost_total)")


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
        parent = (ConfigFile if len(loc) == 1 else (ModelPrice if "price" in loc else ModelEntry) if loc[0] == "models"
                  else UpstreamEntry)
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


def model_reasoning_tags(path: Path | None) -> dict[str, str]:
    """model glob -> "auto" | "open" from the config file (empty without one)."""
    if path is None:
        return {}
    try:
        mtime = path.stat().st_mtime_ns
    except OSError:
        return {}
    return dict(_read(str(path), mtime))


@lru_cache(maxsize=8)
def _read(path: str, mtime: int) -> tuple[tuple[str, str], ...]:
    """The file's ``[models]`` tables, validated by the one TOML model (unknown keys refused)."""
    found: list[tuple[str, str]] = []
    for glob, entry in load_config_file(Path(path)).models.items():
        value = entry.reasoning_tags
        if value is False:
            continue
        found.append((glob, "auto" if value is True else value))
    return tuple(found)


def model_entries(path: Path | None) -> tuple[tuple[str, ModelEntry], ...]:
    """Every ``[models."<glob>"]`` table in file order (empty without a file or when it
    cannot be read now: start-up already refused a bad one), read once per file version."""
    if path is None:
        return ()
    try:
        mtime = path.stat().st_mtime_ns
    except OSError:
        return ()
    try:
        return _entries(str(path), mtime)
    except SettingsError:
        return ()


@lru_cache(maxsize=8)
def _entries(path: str, mtime: int) -> tuple[tuple[str, ModelEntry], ...]:
    return tuple(load_config_file(Path(path)).models.items())
