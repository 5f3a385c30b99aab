"""Every configurable value, where it came from, and the one place it is validated.

Precedence: CLI flag > environment (``CODEBUDDY2API_*`` and ``.env``) > saved > default.
Settings are loaded once at start-up into a :class:`~gateway.live_settings.LiveSettings`
holder (the saved layer and run-time edits live there); each request takes a frozen
:class:`~gateway.generation.policy.StreamPolicy` snapshot from it, so a change made
while a request runs only affects the next request.
"""

from __future__ import annotations

import os
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, SecretStr, ValidationError, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

ENV_PREFIX = "CODEBUDDY2API_"

Source = Literal["cli", "env", "saved", "default"]

#: The shortest admin token or client key accepted (start-up refuses shorter ones).
MIN_OPERATOR_SECRET = 16


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
    allow_upstream_host: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="hosts allowed as upstreams although link-local or cloud metadata"
    )  # before upstream_url: its validator reads this one
    upstream_url: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="Upstream base URLs ending in /v1"
    )
    simulator: bool = Field(False, description="serve the built-in upstream simulator (demo, tests)")
    upstream_api_key: SecretStr | None = Field(
        None, description="Upstream key(s); several comma-separated keys = several credentials"
    )
    upstream_api_key_file: Path | None = None
    config: Path | None = None
    api_key: Annotated[list[SecretStr], NoDecode] = Field(default_factory=list)
    allow_open: bool = False
    max_concurrent: int = Field(64, ge=1)
    key_share: float = Field(0.5, gt=0, le=1, description="share of max_concurrent and ws_max_connections one managed key may hold")
    max_in_flight_per_credential: int = Field(0, ge=0, description="0 = no per-credential cap")
    failover_max: int = Field(2, ge=0, le=20)
    session_header: str | None = None
    routing: Literal["cache-aware", "round-robin"] = "cache-aware"
    routing_imbalance_rel: float = Field(1.5, ge=1.0, le=100.0)
    routing_imbalance_abs: int = Field(8, ge=0, le=100_000)
    routing_slow_factor: float = Field(3.0, ge=0, le=100.0)
    upstream_session_header: str | None = None
    admin_token: SecretStr | None = None
    upstream_stream: Literal["auto", "always", "never"] = "always"
    engine_extras: dict[str, dict[str, Any]] = Field(default_factory=dict)
    reasoning_tags: Annotated[dict[str, Literal["auto", "open"]], NoDecode] = Field(
        default_factory=dict, description="model glob -> how <think> tags in content are split into reasoning"
    )
    capture_dir: Path | None = None
    capture_max_bytes: int = Field(256 * 1024 * 1024, ge=1024)
    rollout_header: str = "x-rollout-id"
    capture_tokens: Literal["none", "vllm", "llamacpp"] = "none"
    token_in: Literal["none", "vllm", "llamacpp"] = "none"
    engine_api: Literal["none", "vllm"] = Field(
        "none", description="the --upstream-url upstreams' engine control API (vllm: the dev RL API, for weight sync)"
    )
    engine_pause_max: float = Field(
        600.0, gt=0, description="seconds a generation call may wait in the gateway while the engines are paused"
    )
    capture_strict: bool = False
    stream_mode: StreamMode = StreamMode.COMPATIBLE
    max_collect_bytes: int = Field(8 * 1024 * 1024, ge=0, description="0 = unlimited")
    tool_repair_attempts: int = Field(2, ge=0, le=10)
    keepalive_interval: float = Field(5.0, gt=0, le=60)
    connect_timeout: float = Field(10.0, gt=0)
    first_byte_timeout: float = Field(120.0, gt=0)
    idle_timeout: float = Field(120.0, gt=0)
    attempt_timeout: float = Field(1800.0, gt=0, description="seconds one upstream attempt may take in all")
    max_empty_events: int = Field(1000, ge=1, description="consecutive upstream events that carry nothing")
    upstream_pool_timeout: float = Field(10.0, gt=0, description="seconds to wait for a free upstream connection")
    upstream_max_connections: int = Field(1000, ge=1, description="upstream connections open at once per process")
    ready_max_loop_lag: float = Field(1.0, gt=0, description="event-loop lag (seconds) past which /readyz is red")
    ws_idle_timeout: float = Field(
        300.0, gt=0, description="seconds a Responses WebSocket with nothing in flight may stay silent"
    )
    ws_max_connections: int = Field(
        256, ge=1, description="Responses WebSockets open at once in this process (the upgrade is refused past it)"
    )
    ws_max_lifetime: float = Field(
        3600.0, gt=0, description="seconds a Responses WebSocket may live; closed after that once nothing is in flight"
    )
    ws_max_connections_per_ip: int = Field(
        32, ge=1, description="Responses WebSockets open at once from one client address (loopback included)"
    )
    max_connections_per_ip: int = Field(
        256, ge=1, description="TCP connections open at once from one client address (HTTP and WebSocket; loopback included)"
    )
    header_timeout: float = Field(
        10.0, gt=0, description="seconds a connection may take to send a request's headers (from connect, or from the last answer)"
    )
    cors_allow_origin: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="web origins allowed to call /v1 (real CORS); every other Origin is refused"
    )
    data_dir: Path = Path("data")
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    audit_retention_days: float = Field(30, ge=0, description="0 = keep audit rows forever")
    audit_bodies: bool = False
    audit_body_max_bytes: int = Field(64 * 1024, ge=0)
    workers: int = Field(1, ge=1, le=256)
    database_url: SecretStr | None = Field(
        None, description="postgresql://user:pass@host:port/db (shared by replicas); none = SQLite in the data dir"
    )
    replica_id: str | None = Field(None, description="this replica's name in the replicas table; none = host-pid-random")
    max_body_bytes: int = Field(32 * 1024 * 1024, ge=1024, description="largest request body accepted (413 past it)")
    max_body_bytes_in_flight: int = Field(
        64 * 1024 * 1024, ge=0, description="request-body bytes held by requests at once (503 past it); 0 = unbounded"
    )
    public_url: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="URL(s) the gateway is reached at besides loopback (admin Host/Origin allow-list)"
    )
    spill_dir: Path | None = Field(None, description="spill journal directory; none = <data_dir>/spill")
    spill_max_bytes: int = Field(32 * 1024 * 1024, ge=4096, description="the spill journal's bound (reserved on disk)")
    shutdown_timeout: float = Field(30.0, ge=0, description="seconds open requests may run on after SIGTERM")
    credential_probe_interval: float = Field(
        5.0, gt=0, description="first re-probe of a credential disabled by a 401/403 (seconds; doubles up to 300)"
    )
    otlp_endpoint: str | None = Field(
        None, description="OTLP/HTTP collector URL for OpenTelemetry traces, e.g. http://127.0.0.1:4318; none = no tracing"
    )
    serve_unrecorded: bool = Field(
        False, description="serve generation requests even when neither the store nor the spill journal can record them"
    )
    database_wait: float = Field(60.0, ge=0, description="seconds to wait for an unreachable PostgreSQL at start-up")
    worker_restart_attempts: int = Field(
        8, ge=0, le=1000, description="--workers: failed replacements of one worker (with backoff) before the gateway exits 1"
    )


    @field_validator("upstream_url", "api_key", "allow_upstream_host", mode="before")
    @classmethod
    def _split_list(cls, value: Any) -> Any:
        """Env values are comma-separated; flags arrive as lists."""
        if isinstance(value, str):
            return [v.strip() for v in value.split(",") if v.strip()]
        return value

    @field_validator("routing_slow_factor")
    @classmethod
    def _slow_factor_off_or_above_noise(cls, value: float) -> float:
        if 0 < value < 1.2:  # within the answers' own spread every replica would look slow in turn
            raise ValueError("must be 0 (off) or at least 1.2")
        return value

    @field_validator("upstream_session_header")
    @classmethod
    def _header_name(cls, value: str | None) -> str | None:
        """An HTTP header name (RFC 9110 token characters), or none."""
        import re

        if not value:
            return None
        if not re.fullmatch(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+", value):
            raise ValueError("must be an HTTP header name, e.g. x-session-id")
        return value.lower()

    @field_validator("api_key", "admin_token")
    @classmethod
    def _long_enough(cls, value: Any) -> Any:
        """Operator secrets shorter than :data:`MIN_OPERATOR_SECRET` are refused: they can
        be guessed, and the redaction point would not mask them (docs/configuration.md)."""
        for secret in value if isinstance(value, list) else [value]:
            if secret is not None and len(secret.get_secret_value()) < MIN_OPERATOR_SECRET:
                raise ValueError(f"must be at least {MIN_OPERATOR_SECRET} characters (e.g. openssl rand -hex 16)")
        return value

    @field_validator("public_url", mode="before")
    @classmethod
    def _split_urls(cls, value: Any) -> Any:
        """Repeatable and comma-separated alike; each must be an http(s) URL with a host."""
        from urllib.parse import urlsplit

        items = [value] if isinstance(value, str) else list(value or [])
        urls = [v.strip().rstrip("/") for item in items for v in str(item).split(",") if v.strip()]
        for url in urls:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(f"{url!r} is not an http(s) URL with a host name")
        return urls

    @field_validator("cors_allow_origin", mode="before")
    @classmethod
    def _origins(cls, value: Any) -> Any:
        """Repeatable and comma-separated alike; each an exact ``scheme://host[:port]``."""
        from urllib.parse import urlsplit

        items = [value] if isinstance(value, str) else list(value or [])
        origins = [v.strip().rstrip("/").lower() for item in items for v in str(item).split(",") if v.strip()]
        for origin in origins:
            parts = urlsplit(origin)
            if parts.scheme not in ("http", "https") or not parts.hostname or parts.path or parts.query:
                raise ValueError(f"{origin!r} is not an origin (scheme://host[:port], e.g. https://app.example.com)")
        return origins

    @field_validator("upstream_url")
    @classmethod
    def _upstream_urls(cls, value: list[str], info: ValidationInfo) -> list[str]:
        """Every URL checked at start-up, not at the first request (gateway.upstream.urls)."""
        from gateway.upstream.urls import check_upstream_url

        for url in value:
            check_upstream_url(url, info.data.get("allow_upstream_host") or ())
        return value

    @field_validator("database_url")
    @classmethod
    def _database_scheme(cls, value: SecretStr | None) -> SecretStr | None:
        """Only the two backends there are (the URL itself is a secret: never echoed)."""
        if value is not None and value.get_secret_value() and not value.get_secret_value().startswith(
            ("postgresql://", "postgres://", "sqlite:///")
        ):
            raise ValueError("must start with postgresql:// (or sqlite:///path)")
        return value if value is not None and value.get_secret_value() else None

    @field_validator("reasoning_tags", mode="before")
    @classmethod
    def _globs_with_mode(cls, value: Any) -> Any:
        """``glob[=auto|open],...``: which models write ``<think>`` tags into content."""
        if isinstance(value, str):
            pairs = (p.strip().partition("=") for p in value.split(",") if p.strip())
            return {glob.strip(): (mode.strip() or "auto") for glob, _, mode in pairs}
        return value

    @field_validator("otlp_endpoint")
    @classmethod
    def _otlp_url(cls, value: str | None) -> str | None:
        """An http(s) URL without credentials: settings are shown in the admin API and the
        WebUI; a collector's auth goes in OTEL_EXPORTER_OTLP_HEADERS (read by the exporter)."""
        if not value:
            return None
        from urllib.parse import urlsplit

        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("must be an http:// or https:// URL, e.g. http://127.0.0.1:4318")
        if parts.username or parts.password:
            raise ValueError("must not carry credentials; put them in OTEL_EXPORTER_OTLP_HEADERS")
        return value

    @field_validator("engine_extras", mode="before")
    @classmethod
    def _json_object(cls, value: Any) -> Any:
        """A flag's value is JSON text (the environment's is decoded already)."""
        if isinstance(value, str):
            import json

            try:
                return json.loads(value)
            except ValueError as exc:
                raise ValueError(f"not valid JSON: {exc}") from None
        return value


def check_base_url(url: str) -> str:
    """Raise ValueError unless ``url`` is an http(s) URL httpx can send (the path is free;
    the host is not judged: see gateway.upstream.urls.check_upstream_url)."""
    from gateway.upstream.urls import check_upstream_url

    return check_upstream_url(url, None)


def base_url_hint(url: str) -> str | None:
    """A warning for a base URL whose path does not end in /v1 (most OpenAI-compatible
    servers serve /v1/chat/completions; some providers really use another path)."""
    from urllib.parse import urlsplit

    path = urlsplit(url).path.rstrip("/")
    if path.endswith("/v1"):
        return None
    return f"{url} does not end in /v1: requests go to {url.rstrip('/')}/chat/completions (is that right?)"


#: Settings that may be given on the command line of ``serve`` (name -> help text).
CLI_FIELDS: dict[str, str] = {
    "host": "address to bind",
    "port": "port to bind",
    "upstream_url": "upstream base URL ending in /v1 (repeatable)",
    "allow_upstream_host": "a host that may be an upstream although it is link-local or a cloud metadata service"
                           " (refused by default: 169.254.0.0/16, fe80::/10, fd00:ec2::254, metadata.google.internal; repeatable)",
    "simulator": "serve the built-in upstream simulator instead of a real upstream (demo, tests)",
    "upstream_api_key": "API key(s) sent to the upstream as a Bearer token (comma-separated = several credentials)",
    "upstream_api_key_file": "file with upstream API keys, one per line",
    "config": "TOML file describing upstreams, credentials, headers and model maps",
    "api_key": "client API key the gateway requires (repeatable)",
    "allow_open": "allow binding a non-loopback address with no client API keys",
    "max_concurrent": "global cap on concurrent generation requests",
    "key_share": "share (0-1] of --max-concurrent and of --ws-max-connections that one managed client key may hold"
                 " in this process (at least 1 each; default 0.5)",
    "max_in_flight_per_credential": "cap on concurrent requests per upstream credential (0 = none)",
    "failover_max": "how many other credentials to try before the first client byte",
    "session_header": "request header naming a conversation, for credential stickiness",
    "routing": "how a call picks among the replicas (credentials) serving its model: cache-aware (session, then"
               " longest prompt prefix sent, then fewest calls in flight, with an imbalance gate) or round-robin"
               " (docs/routing.md)",
    "routing_imbalance_rel": "cache-aware: a call goes to the least-loaded replica instead when the chosen one has"
                             " more than min_in_flight * this + --routing-imbalance-abs calls in flight (default 1.5)",
    "routing_imbalance_abs": "cache-aware: the absolute part of that imbalance gate (default 8)",
    "routing_slow_factor": "cache-aware: a replica answering more than this many times slower than the fastest"
                           " lately loses its sessions and gets no new calls while a faster one is usable"
                           " (default 3; 0 = off; otherwise at least 1.2)",
    "upstream_session_header": "send the call's session id (rollout id or --session-header value) upstream under"
                               " this header, for a router in front of the engines (e.g. x-session-id); default off",
    "admin_token": "token for the admin API and WebUI (without one: a token generated at start-up, its login URL in the banner)",
    "upstream_stream": "always (stream from the upstream), never (ask for JSON, synthesize the stream) or auto",
    "engine_extras": 'JSON {"model glob": {extra upstream body fields}}, e.g. vLLM logprobs / return_token_ids',
    "reasoning_tags": "model globs whose <think>...</think> content is split into reasoning: glob[=auto|open],..."
    " (open: the template opened the tag, output starts as reasoning)",
    "capture_dir": "write one model-call record per generation request here (training harnesses)",
    "capture_max_bytes": "rotate a capture file past this size",
    "rollout_header": "request header carrying the rollout/session id for capture",
    "capture_tokens": "token source for rollout call records: vllm (return_token_ids), llamacpp (llama-server) or none;"
    " any value but none also turns the call records on",
    "token_in": "token-in continuation for the --upstream-url upstreams: vllm or llamacpp sends a rollout call that"
    " extends the previous one as token ids (its exact prompt + completion, then the new messages rendered"
    " by the engine) to the engine's completion endpoint; implies --capture-tokens of the same engine for them",
    "engine_api": "engine control API of the --upstream-url upstreams: vllm (the dev RL API at the server root:"
    " /pause, /resume, /is_paused, /weight_info, /update_weight_version) lets the admin API pause them for a weight"
    " update while the gateway holds new calls (docs/weight-sync.md), or none; per upstream: engine_api",
    "engine_pause_max": "seconds a generation call waits in the gateway while the engines are paused (admin"
    " /admin/api/engines/pause) before it fails with engine_paused",
    "capture_strict": "a call record that cannot be made durable fails the call with the protocol's error"
    " (default: the answer is released, the rollout marked incomplete)",
    "stream_mode": "compatible (aggregate, validate, replay) or realtime (relay as it arrives)",
    "max_collect_bytes": "output-byte budget per request, 0 = unlimited",
    "tool_repair_attempts": "how many times a bad tool call may be regenerated",
    "keepalive_interval": "seconds between keepalive events while the client waits",
    "connect_timeout": "seconds to connect to the upstream",
    "first_byte_timeout": "seconds to wait for the upstream's response headers",
    "idle_timeout": "seconds without a data-bearing upstream event before the stream is abandoned (bytes that"
                    " complete no event, keepalive comments and empty chunks do not count)",
    "attempt_timeout": "seconds one upstream attempt may take in all, headers to last event",
    "max_empty_events": "consecutive upstream events that carry nothing (no content, reasoning, tool delta, usage"
                        " or finish) before the answer is abandoned",
    "upstream_pool_timeout": "seconds a request waits for a free upstream connection before a retryable 503"
                             " upstream_pool_exhausted",
    "upstream_max_connections": "upstream connections open at once per process (the pool's size)",
    "ready_max_loop_lag": "event-loop lag (seconds) past which /readyz is red (for 5 s after the last lagging sample)",
    "ws_idle_timeout": "seconds a Responses WebSocket with nothing in flight may go without a frame before it is closed",
    "ws_max_connections": "Responses WebSockets (Codex) open at once per process; past it the upgrade is refused with"
                          " a 503 too_many_websockets (default 256: four per --max-concurrent slot, since a Codex"
                          " session holds its socket between turns, while one idle socket holds at most its"
                          " inbox and remembered conversations)",
    "ws_max_lifetime": "seconds a Responses WebSocket may stay open; after that it is closed (1001) as soon as nothing"
                       " is in flight, never mid-answer (default 3600, OpenAI's own 60-minute limit; Codex reconnects)",
    "ws_max_connections_per_ip": "Responses WebSockets open at once from one client address, loopback included"
                                 " (past it: 503 too_many_websockets before the upgrade is accepted)",
    "max_connections_per_ip": "TCP connections (HTTP and WebSocket) open at once from one peer address, loopback"
                              " included; past it a new connection is answered 503 and closed",
    "header_timeout": "seconds a connection may take to send a request's headers, from connect or from the"
                      " previous answer (slow-header sockets are closed)",
    "cors_allow_origin": "a web origin (scheme://host[:port]) allowed to call /v1 from a browser, with real CORS"
                         " headers (repeatable or comma list); every other Origin is refused with 403 cross_origin",
    "data_dir": "directory for the SQLite store and other state",
    "log_level": "debug, info, warning or error",
    "audit_retention_days": "days to keep audit records (0 = forever)",
    "audit_bodies": "also store request/response bodies in the audit record (capped)",
    "audit_body_max_bytes": "cap per stored body with --audit-bodies",
    "workers": "worker processes (>1: prometheus multiprocess mode, app built per worker)",
    "database_url": "PostgreSQL URL shared by several replicas (default: SQLite in --data-dir)",
    "replica_id": "this replica's name among replicas sharing the database (default: host-pid-random)",
    "max_body_bytes": "largest request body accepted, in bytes (default 32 MiB; 413 past it)",
    "max_body_bytes_in_flight": "request-body bytes all requests together may hold (default 64 MiB, two largest"
                                " bodies); past it a request is refused 503 with Retry-After before its body is"
                                " read (0 = unbounded)",
    "public_url": "URL the gateway is reached at besides loopback, e.g. https://gw.example.com (repeatable or comma list):"
                  " the admin API and WebUI answer only loopback names and these",
    "spill_dir": "where audit rows and stored responses go while the store cannot write (default: <data-dir>/spill)",
    "spill_max_bytes": "the spill journal's bound, reserved on disk at start-up",
    "shutdown_timeout": "on SIGTERM, seconds open requests may finish before they are ended with an error event",
    "credential_probe_interval": "seconds before re-probing a credential disabled by a 401/403 (doubles up to 300)",
    "otlp_endpoint": "send OpenTelemetry traces (GenAI conventions) to this OTLP/HTTP collector, e.g. http://127.0.0.1:4318",
    "serve_unrecorded": "keep serving when neither the store nor the spill journal can keep a request's record (e.g. the"
                        " journal's reservation failed on a full disk); default: refuse with 503 recording_unavailable",
    "database_wait": "seconds to wait for PostgreSQL at start-up (retried with backoff) before exit code 75 (default 60)",
    "worker_restart_attempts": "with --workers: times a dead worker's replacement may fail (backoff 1 s doubling"
                               " up to 30 s) before the gateway gives up with exit code 1 (default 8)",
}


class SettingsError(ValueError):
    """A value that failed validation, with a one-line message naming where it came from."""


def describe_error(exc: ValidationError, cli_keys: set[str], saved: bool = False) -> str:
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
    shown = "[redacted]" if field in ("database_url", "upstream_api_key", "admin_token", "api_key", "otlp_endpoint",
                                      "upstream_url") else err.get("input")  # a URL's userinfo is a secret
    return f"invalid value {shown!r} for {where}: {err['msg'].removeprefix('Value error, ')}{allowed}"


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
        raise SettingsError(describe_error(exc, set(cli))) from None
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
