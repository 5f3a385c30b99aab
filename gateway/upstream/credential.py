"""What the pool holds: an upstream (base URL, extra headers, model allow-list and rename
map, its engine's token fields) and its credentials, each with the state the pool learns
(disabled, cooldowns, penalties, in flight). The pool (gateway/upstream/pool.py) decides;
these only hold and show it (``public()`` never shows a key)."""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from typing import Any

from gateway.upstream.urls import without_userinfo

#: The cooldown key that covers every model.
ANY_MODEL = "*"


def fingerprint(secret: str | None) -> str:
    """A stable, non-reversible name for a secret: safe for logs, audit and the WebUI."""
    if not secret:
        return "none"
    return "fp_" + hashlib.sha256(secret.encode()).hexdigest()[:12]


@dataclass(slots=True)
class Upstream:
    name: str
    base_url: str
    headers: dict[str, str] = field(default_factory=dict)
    models: frozenset[str] | None = None  # allow-list; None = every model
    model_map: dict[str, str] = field(default_factory=dict)  # client model -> upstream model
    capture_tokens: str | None = None  # this upstream's token source (None: --capture-tokens)
    token_in: str | None = None  # "vllm" | "llamacpp": rollout continuations sent as token ids
    engine_api: str | None = None  # "vllm": paused and resumed for weight updates (gateway/engines/)
    #: requests this engine runs at once (over all its keys); more wait in the gateway
    max_in_flight: int | None = None
    queue_timeout: float = 300.0  # seconds a request waits for one of those slots

    def allows(self, model: str) -> bool:
        """Every model when no allow-list is set; else the list and the renamed names."""
        return self.models is None or model in self.models or model in self.model_map

    def upstream_model(self, model: str) -> str:
        return self.model_map.get(model, model)


@dataclass(slots=True)
class Credential:
    upstream: Upstream
    api_key: str | None
    id: str = ""
    disabled: bool = False
    disabled_reason: str | None = None
    disabled_by: str | None = None  # "upstream" (a 401/403: probed again) or "admin" (stays out)
    disabled_at: float | None = None
    last_probe_at: float | None = None
    last_probe_result: str | None = None
    next_probe_at: float | None = None
    probe_failures: int = 0
    cooldowns: dict[str, float] = field(default_factory=dict)  # model or ANY_MODEL -> until (epoch)
    penalty_until: float = 0.0  # after a 5xx or connect error: tried last, not refused
    in_flight: int = 0
    #: model -> (until, why): a 404 for that model, or a 401/403 that named it (memory only)
    unavailable: dict[str, tuple[float, str]] = field(default_factory=dict)
    added_by_admin: bool = False  # through the admin API (kept in the store; may be deleted)
    added_at: float | None = None  # when this process added it (admin API or a replica's row)
    #: the operator's name for it: ``label`` in --config or the admin API, else where the key
    #: came from (its environment variable, file and line, or config key); never the key
    label: str | None = None

    def __post_init__(self) -> None:
        if not self.id:
            self.id = self.fingerprint + "@" + self.upstream.name

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.api_key)

    @property
    def identity(self) -> tuple[str, str]:
        """What makes two credentials one: the same key sent to the same base URL, whatever
        their source (flag, --config or the admin API) or upstream name."""
        return (self.upstream.base_url.rstrip("/"), self.fingerprint)

    def unavailable_for(self, model: str, now: float) -> bool:
        entry = self.unavailable.get(model)
        return entry is not None and entry[0] > now

    def cooling_until(self, model: str, now: float) -> float:
        until = max(self.cooldowns.get(model, 0.0), self.cooldowns.get(ANY_MODEL, 0.0))
        return until if until > now else 0.0

    def public(self, now: float | None = None) -> dict[str, Any]:
        """What the admin API may show: never the key."""
        now = time.time() if now is None else now
        return {
            "id": self.id,
            "upstream": self.upstream.name,
            "base_url": without_userinfo(self.upstream.base_url),  # a URL's password is a key too
            "fingerprint": self.fingerprint,
            "label": self.label,
            "disabled": self.disabled,
            "disabled_reason": self.disabled_reason,
            "disabled_by": self.disabled_by,
            "disabled_at": self.disabled_at,
            "last_probe_at": self.last_probe_at,
            "last_probe_result": self.last_probe_result,
            "next_probe_at": self.next_probe_at if self.disabled else None,
            "probe_failures": self.probe_failures,
            "cooldowns": {m: round(u - now, 1) for m, u in self.cooldowns.items() if u > now},
            "in_flight": self.in_flight,
            "unavailable_models": {
                m: {"for_s": round(u - now, 1), "reason": why} for m, (u, why) in self.unavailable.items() if u > now
            },
            "added_by_admin": self.added_by_admin,
        }
