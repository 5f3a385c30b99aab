"""What ``GET /v1/models`` says about each model beyond its name: the context window
(``max_input_tokens``), the largest output (``max_tokens`` / ``max_output_tokens``) and
capability flags. Agent clients size their work by these (Claude Code compacts by
``max_input_tokens``); without them they guess.

Two sources, pure functions over both: the upstream's own model entry (vLLM's
``max_model_len``, and the names other OpenAI-compatible servers use), and the
``[models."<glob>"]`` tables of ``--config``, which win where they state a value (the
operator knows what the deployment allows; later tables win over earlier ones).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from gateway.upstream.config_file import ModelEntry

#: Names an upstream's model entry may give its context window, in order of preference
#: (vLLM ``max_model_len``; OpenRouter ``context_length``; others ``context_window``).
_CONTEXT_FIELDS = ("max_model_len", "max_input_tokens", "context_length", "context_window")
_OUTPUT_FIELDS = ("max_output_tokens", "max_completion_tokens", "max_tokens")


def _positive_int(item: Mapping[str, Any], names: Iterable[str]) -> int | None:
    for name in names:
        value = item.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """One model's limits and flags (``None``: nobody said)."""

    max_input_tokens: int | None = None
    max_output_tokens: int | None = None
    capabilities: Mapping[str, bool] = field(default_factory=dict)

    @classmethod
    def from_upstream(cls, item: Mapping[str, Any]) -> ModelInfo:
        """What an upstream's own ``/v1/models`` entry says."""
        return cls(_positive_int(item, _CONTEXT_FIELDS), _positive_int(item, _OUTPUT_FIELDS))

    def configured(self, name: str, entries: Iterable[tuple[str, ModelEntry]]) -> ModelInfo:
        """This, with what every matching ``[models."<glob>"]`` table states laid over it."""
        info = self
        for glob, entry in entries:
            if not fnmatch.fnmatchcase(name, glob):
                continue
            info = replace(
                info,
                max_input_tokens=entry.max_input_tokens or info.max_input_tokens,
                max_output_tokens=entry.max_output_tokens or info.max_output_tokens,
                capabilities={**info.capabilities, **entry.capabilities},
            )
        return info

    def openai_fields(self) -> dict[str, Any]:
        """Extra fields of an OpenAI model object (only those known)."""
        fields: dict[str, Any] = {}
        if self.max_input_tokens is not None:
            fields["max_input_tokens"] = self.max_input_tokens
        if self.max_output_tokens is not None:
            fields["max_output_tokens"] = fields["max_tokens"] = self.max_output_tokens
        if self.capabilities:
            fields["capabilities"] = dict(sorted(self.capabilities.items()))
        return fields

    def anthropic_fields(self) -> dict[str, Any]:
        """The Anthropic ``ModelInfo`` fields (its ``capabilities`` object has a fixed set of
        required members the gateway cannot vouch for, so it is left out)."""
        fields = {"max_input_tokens": self.max_input_tokens, "max_tokens": self.max_output_tokens}
        return {name: value for name, value in fields.items() if value is not None}
