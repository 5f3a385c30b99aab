"""Which weight version produced which tokens of an answer (issue #35): a call that
straddles a weight update (frozen by ``keep`` and resumed, or aborted and continued) was
sampled by two versions, and a trainer must know where the second begins (vLLM RFC
#54443; reading the version once after the stream mislabels it, rLLM#622).

``VersionTrail`` is one attempt's list ``[{"version", "from_token"}]``: the version at
admission from token 0, then each new version from the completion token where it begins.
It is fed the attempt's chunks (``count``) and told each version change (``switch``):
by the fleet at a resume, for the calls in flight at that engine, and by a continuation
once the engine accepts again. Tokens are the chunks' ``token_ids`` when the engine sends
them (``--capture-tokens vllm``), else one per chunk that carries output (vLLM streams one
token per chunk by default).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(eq=False)
class VersionTrail:
    """One attempt at one engine: its weight versions per completion-token range."""

    engine: str
    versions: list[dict[str, Any]] = field(default_factory=list)
    tokens: int = 0  # completion tokens received so far

    def count(self, chunk: dict[str, Any]) -> None:
        """One more chunk of the answer."""
        choices = chunk.get("choices")
        choice = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else None
        if choice is None:
            return
        ids = choice.get("token_ids")
        if isinstance(ids, list):
            self.tokens += len(ids)
            return
        delta = choice.get("delta")
        if isinstance(delta, dict) and any(delta.get(k) for k in ("content", "reasoning_content", "reasoning", "tool_calls")):
            self.tokens += 1

    def switch(self, version: str | None) -> None:
        """The engine runs ``version`` from the next token on (None: not known)."""
        if version is None or self.versions and self.versions[-1]["version"] == version:
            return
        if self.versions and self.versions[-1]["from_token"] == self.tokens:
            self.versions[-1]["version"] = version  # no token came from the one before
            return
        self.versions.append({"version": version, "from_token": self.tokens})
