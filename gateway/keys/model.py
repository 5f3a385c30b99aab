"""A managed client key and its limits (pure: no I/O).

The secret is ``sk-cb2a-`` + 43 URL-safe characters (256 bits); only its SHA-256 is
kept, so a plain hash (no salt, no stretching) is enough to look it up: nobody can guess
a 256-bit secret from its hash. ``prefix`` (the first 12 characters) lets a person tell
keys apart in the WebUI without the secret.
"""

from __future__ import annotations

import fnmatch
import hashlib
import math
import secrets
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from gateway.errors import GatewayError
from gateway.keys.periods import PERIODS

KEY_PREFIX = "sk-cb2a-"
#: Characters of the secret shown in listings.
PREFIX_CHARS = 12
#: The output reservation of a request that names no max_tokens (and the cap sent upstream
#: for it), for a key with a token limit and no ``max_output_tokens`` of its own.
DEFAULT_OUTPUT_CAP = 4096
#: Limits are counts: at most this (a bound for the store's integers and JSON numbers).
MAX_LIMIT = 10**12
MAX_NAME = 100
MAX_GLOBS = 100
MAX_METADATA_BYTES = 4096
#: A money budget is at most this, in the price table's currency (nano-units fit 64 bits).
MAX_BUDGET_COST = 10**9

LIMIT_FIELDS = ("rpm", "tpm", "max_concurrent", "daily_tokens", "budget_tokens", "max_output_tokens")


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode("utf-8", "surrogatepass")).hexdigest()


def new_secret() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def new_key_id() -> str:
    return "key_" + secrets.token_hex(8)


@dataclass(frozen=True, slots=True)
class KeyLimits:
    """What a key may do; ``None`` = no limit (``models`` None: every model)."""

    models: tuple[str, ...] | None = None
    rpm: int | None = None
    tpm: int | None = None
    max_concurrent: int | None = None
    daily_tokens: int | None = None
    max_output_tokens: int | None = None
    expires_at: float | None = None
    #: tokens per ``budget_period`` (a UTC day, ISO week or calendar month: gateway/keys/periods.py)
    budget_tokens: int | None = None
    budget_period: str = "day"
    #: money per ``budget_period``, in the currency of the ``price`` tables of ``--config``
    #: (a request's reservation priced at its model's price, settled to its cost)
    budget_cost: float | None = None
    #: a streamed answer whose client goes away: "cancel" stops the upstream at once (charged
    #: what arrived), "drain" reads it to its end, unsent, so its usage bills exactly
    on_disconnect: str = "cancel"

    @property
    def counted(self) -> bool:
        """Whether requests must reserve in the store before going upstream."""
        return any(v is not None for v in (self.rpm, self.tpm, self.max_concurrent, self.daily_tokens, self.budget_tokens,
                                           self.budget_cost))

    @property
    def token_limited(self) -> bool:
        """Whether a request reserves tokens (and an output cap): a money budget prices them."""
        return any(v is not None for v in (self.tpm, self.daily_tokens, self.budget_tokens, self.budget_cost))


@dataclass(frozen=True, slots=True)
class ManagedKey:
    """One key as every replica holds it in memory (its hash, never its secret)."""

    key_id: str
    name: str
    prefix: str
    secret_hash: str
    limits: KeyLimits
    created_at: float
    revoked_at: float | None = None
    metadata: dict[str, Any] = field(default_factory=dict)

    def refusal(self, now: float) -> GatewayError | None:
        """The 401 for a revoked or expired key, else None."""
        if self.revoked_at is not None:
            return GatewayError("authentication", "invalid_api_key", "this API key was revoked")
        if self.limits.expires_at is not None and now >= self.limits.expires_at:
            return GatewayError("authentication", "invalid_api_key", "this API key has expired")
        return None

    def allows(self, model: str) -> bool:
        globs = self.limits.models
        return globs is None or any(fnmatch.fnmatchcase(model, g) for g in globs)

    def check_model(self, model: str) -> None:
        if not self.allows(model):
            raise GatewayError("permission", "model_not_allowed",
                               f"this API key may not use the model {model!r}", param="model")

    def public(self) -> dict[str, Any]:
        """The key as the admin API shows it: never the secret, nor its hash."""
        limits = self.limits
        return {
            "id": self.key_id, "name": self.name, "prefix": self.prefix,
            "models": list(limits.models) if limits.models is not None else None,
            "rpm": limits.rpm, "tpm": limits.tpm, "max_concurrent": limits.max_concurrent,
            "daily_tokens": limits.daily_tokens, "budget_tokens": limits.budget_tokens,
            "budget_period": limits.budget_period, "budget_cost": limits.budget_cost,
            "max_output_tokens": limits.max_output_tokens,
            "on_disconnect": limits.on_disconnect,
            "expires_at": rfc3339(limits.expires_at), "created_at": rfc3339(self.created_at),
            "revoked_at": rfc3339(self.revoked_at), "metadata": self.metadata,
        }


def rfc3339(at: float | None) -> str | None:
    if at is None:
        return None
    from datetime import UTC

    return datetime.fromtimestamp(at, UTC).isoformat().replace("+00:00", "Z")


class InvalidField(ValueError):
    """A field of an admin request that cannot be a key's: its name and why."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message


def _limit(payload: dict[str, Any], name: str) -> int | None:
    value = payload.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_LIMIT:
        raise InvalidField(name, f"{name} must be an integer from 0 to {MAX_LIMIT}, or null")
    return value


def _globs(value: Any) -> tuple[str, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list) or len(value) > MAX_GLOBS or not all(
        isinstance(g, str) and 0 < len(g) <= 200 and g.isprintable() for g in value
    ):
        raise InvalidField("models", f"models must be a list of at most {MAX_GLOBS} glob patterns (strings), or null")
    return tuple(value)


def _expires(value: Any) -> float | None:
    if value is None:
        return None
    if not isinstance(value, str) or len(value) > 64:
        raise InvalidField("expires_at", "expires_at must be an RFC 3339 date-time string, or null")
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        raise InvalidField("expires_at", "expires_at must be an RFC 3339 date-time string, or null") from None
    if parsed.tzinfo is None:
        raise InvalidField("expires_at", "expires_at must carry a time zone (e.g. 2026-01-01T00:00:00Z)")
    at = parsed.timestamp()
    if not math.isfinite(at):
        raise InvalidField("expires_at", "expires_at is out of range")
    return at


def name_of(value: Any) -> str:
    if not isinstance(value, str) or not value.strip() or len(value) > MAX_NAME or not value.isprintable():
        raise InvalidField("name", f"name must be a printable string of 1 to {MAX_NAME} characters")
    return value.strip()


def metadata_of(value: Any) -> dict[str, Any]:
    import orjson

    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidField("metadata", "metadata must be a JSON object")
    try:
        size = len(orjson.dumps(value))
    except (TypeError, orjson.JSONEncodeError):
        raise InvalidField("metadata", "metadata must be a JSON object") from None
    if size > MAX_METADATA_BYTES:
        raise InvalidField("metadata", f"metadata must be at most {MAX_METADATA_BYTES} bytes of JSON")
    return value


#: What a streamed answer of a key does when its client goes away (``None``: the default).
DISCONNECT_POLICIES = ("cancel", "drain")
#: Fields a create or a change may carry.
KNOWN_FIELDS = frozenset({"name", "models", *LIMIT_FIELDS, "budget_period", "budget_cost", "expires_at", "metadata",
                          "on_disconnect"})


def _period(value: Any) -> str:
    if value not in PERIODS:
        raise InvalidField("budget_period", f"budget_period must be one of {', '.join(PERIODS)}")
    return str(value)


def _budget_cost(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
            or not 0 <= value <= MAX_BUDGET_COST:
        raise InvalidField("budget_cost", f"budget_cost must be a number from 0 to {MAX_BUDGET_COST} (money per "
                                          "budget_period, in the currency of the --config prices), or null")
    return float(value)


def _on_disconnect(value: Any) -> str:
    if value is None:
        return "cancel"
    if value not in DISCONNECT_POLICIES:
        raise InvalidField("on_disconnect", "on_disconnect must be \"cancel\" or \"drain\", or null")
    return str(value)


def limits_from(payload: dict[str, Any], base: KeyLimits | None = None) -> KeyLimits:
    """The limits a create (``base`` None) or a change (only the fields present) asks for."""
    unknown = sorted(set(payload) - KNOWN_FIELDS)
    if unknown:
        raise InvalidField(unknown[0], f"unknown field {unknown[0]!r}")
    current = base or KeyLimits()
    values: dict[str, Any] = {}
    for name in LIMIT_FIELDS:
        values[name] = _limit(payload, name) if name in payload else getattr(current, name)
    values["models"] = _globs(payload["models"]) if "models" in payload else current.models
    values["expires_at"] = _expires(payload["expires_at"]) if "expires_at" in payload else current.expires_at
    values["budget_period"] = _period(payload["budget_period"]) if "budget_period" in payload else current.budget_period
    values["budget_cost"] = _budget_cost(payload["budget_cost"]) if "budget_cost" in payload else current.budget_cost
    values["on_disconnect"] = (_on_disconnect(payload["on_disconnect"]) if "on_disconnect" in payload
                               else current.on_disconnect)
    return KeyLimits(**values)
