"""What a failed upstream attempt teaches about its credential.

Apart from the pool's choice of a credential because it is a rule table of its own, pure
but for the credential it marks (the clock is passed in): 401/403 disables the
credential (the :class:`~gateway.upstream.prober.CredentialProber` re-enables it), or only
for the model when the message is about the model; 404 passes it over for the model; 429
cools it down for the model (its Retry-After, else 30 s); a 503 with Retry-After cools it
for every model; 5xx and connect errors put it last for a few seconds, no response head
at all (a hung engine) for a minute. The pool persists what the lesson says changed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import structlog

from gateway.errors import ErrorCode, GatewayError
from gateway.upstream.credential import ANY_MODEL, Credential

log = structlog.get_logger("gateway.pool")

#: How long a credential is tried last after a 5xx or a connect failure (seconds). It is
#: a penalty, not a cooldown: with nothing healthier left it is still used.
SERVER_ERROR_PENALTY = 5.0
#: ... and after no response head within ``--first-byte-timeout`` (a hung engine: every
#: request it takes waits that whole timeout before failing over, so it is tried last for
#: longer; still used when nothing healthier is left). Issue #40.
HUNG_PENALTY = 60.0
#: Cooldown after a 429 that carried no Retry-After (seconds).
DEFAULT_RATE_LIMIT_COOLDOWN = 30.0
#: How long a credential is passed over for a model its upstream answered 404 for, or
#: refused (401/403) naming that model: other credentials serve the model meanwhile.
MODEL_UNAVAILABLE_FOR = 300.0  # passed over, not refused: with no other credential it is asked again
#: A 401/403 whose message is about the model (access, permission, entitlement), not the key:
#: the credential is kept for every other model.
_MODEL_SCOPED_REFUSAL = re.compile(
    r"\bmodels?\b.{0,80}\b(access|permi\w*|allow\w*|entitle\w*|authori[sz]\w*|not available|forbidden)"
    r"|\b(access|permi\w*|allow\w*|entitle\w*|authori[sz]\w*)\b.{0,80}\bmodels?\b",
    re.IGNORECASE | re.DOTALL,
)


def model_scoped_refusal(detail: str | None, model: str, upstream_model: str) -> bool:
    """Does a 401/403's message say the key may not use *this model* (rather than that
    the key is bad)? Only then the refusal is scoped to the model."""
    if not detail:
        return False
    names = {m for m in (model, upstream_model) if m}
    return bool(_MODEL_SCOPED_REFUSAL.search(detail)) or any(f"'{m}'" in detail or f'"{m}"' in detail for m in names)


@dataclass(frozen=True, slots=True)
class Lesson:
    """What one failure taught: may another credential be tried, and did the credential's
    stored state (disabled, cooldowns) change."""

    failover: bool
    persist: bool = False


def learn_from_failure(credential: Credential, model: str, error: GatewayError, now: float) -> Lesson:
    """Mark ``credential`` for a failure before the first client byte. ``failover`` False:
    the error is the client's to see as is."""
    status = error.upstream_status
    detail = getattr(error, "upstream_detail", None)
    if status == 404 or (status in (401, 403) and model_scoped_refusal(detail, model, credential.upstream.upstream_model(model))):
        # about this model on this upstream (unknown there, or the key may not use it):
        # another credential that serves it is tried; this one keeps its other models
        credential.unavailable[model] = (now + MODEL_UNAVAILABLE_FOR, f"upstream answered {status}")
        log.warning("credential_model_unavailable", credential=credential.id, model=model, status=status)
        return Lesson(failover=True)
    if status in (401, 403):
        if not credential.disabled:
            credential.disabled_at, credential.next_probe_at, credential.probe_failures = now, None, 0
        credential.disabled = True
        credential.disabled_reason = f"upstream answered {status}"
        credential.disabled_by = "upstream"
        log.warning("credential_disabled", credential=credential.id, status=status)
    elif status == 429:
        wait = error.retry_after if error.retry_after is not None else DEFAULT_RATE_LIMIT_COOLDOWN
        credential.cooldowns[model] = now + float(wait)
    elif status == 503 and error.retry_after is not None:
        credential.cooldowns[ANY_MODEL] = now + float(error.retry_after)
    elif error.code == ErrorCode.UPSTREAM_TIMEOUT and status is None:  # no head at all, not a 504
        credential.penalty_until = now + HUNG_PENALTY
        log.warning("credential_hung", credential=credential.id, tried_last_for_s=HUNG_PENALTY)
        return Lesson(failover=True)
    elif error.code in (ErrorCode.UPSTREAM_UNREACHABLE, ErrorCode.UPSTREAM_TIMEOUT) or (status is not None and status >= 500):
        credential.penalty_until = now + SERVER_ERROR_PENALTY
        return Lesson(failover=True)
    else:
        return Lesson(failover=False)
    return Lesson(failover=True, persist=True)
