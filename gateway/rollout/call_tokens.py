"""Where a finished rollout call's token ids come from (the records' ``token_source`` and
prompt ids): the answering upstream's own ``capture_tokens`` or the flag's, the ids token-in
sent, or llama-server's own tokenization of the prompt (gateway/rollout/tokens.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import structlog

from gateway.rollout.records import answered_upstream
from gateway.rollout.tokens import llamacpp_prompt_ids

log = structlog.get_logger("gateway.rollout")


class CallTokens:
    """Where a finished rollout call's token ids come from: the answering upstream's own
    ``capture_tokens`` (else the flag's), the ids token-in sent, or llama-server's look-up
    of the prompt. ``pool`` returns the current upstream pool; ``default`` the flag's source."""

    def __init__(self, pool: Callable[[], Any], default: Callable[[], str]) -> None:
        self.pool = pool
        self.default = default
        self._http: httpx.AsyncClient | None = None

    def source(self, run: Any) -> str:
        credential = self._credential(run)
        own = getattr(credential.upstream, "capture_tokens", None) if credential is not None else None
        return str(own or self.default())

    def _credential(self, run: Any) -> Any:
        attempt = answered_upstream(run)
        if attempt is None:
            return None
        for c in self.pool().credentials:
            if c.upstream.name == attempt.get("upstream") and c.fingerprint == attempt.get("credential"):
                return c
        return None

    async def prompt_ids(self, run: Any, source: str) -> list[int] | None:
        """The prompt as the engine saw it: token-in's ids when it was used, else (llama.cpp)
        the server's own tokenization of the body sent, else None."""
        token_in = getattr(run.attempts, "token_in", None)
        if token_in is not None and token_in.status == "used":
            return token_in.prompt_ids
        if source != "llamacpp":
            return None
        credential = self._credential(run)
        if credential is None:
            return None
        if self._http is None:
            self._http = httpx.AsyncClient(trust_env=False, timeout=httpx.Timeout(5.0))
        body = run.answer.bodies[-1] if run.answer.bodies else run.upstream_body
        try:
            return await llamacpp_prompt_ids(self._http, credential.upstream.base_url, credential.api_key, body)
        except (httpx.HTTPError, KeyError, ValueError, TypeError) as exc:
            log.warning("rollout_prompt_ids_failed", rollout=run.rollout_id, error=type(exc).__name__)
            return None

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.aclose()
