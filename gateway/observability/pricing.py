"""What a request cost: its usage priced by the ``price`` of the ``[models."<glob>"]`` table
that matches the model the client asked for (the last matching table with a price wins,
as for every per-model option). Pure: the observer stamps ``record.cost`` before the audit
and the metrics read the record.

Cached input tokens are priced at ``cached_input`` (``input`` when unset) and the rest of
the prompt at ``input``; output at ``output``. A request with no usage, or whose model has
no price, has no cost (``None``): never a made-up zero.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping
from typing import Any

from gateway.upstream.config_file import ModelEntry, ModelPrice

PER = 1_000_000


def price_of(model: str, entries: Iterable[tuple[str, ModelEntry]]) -> ModelPrice | None:
    """The price of the last ``[models."<glob>"]`` table matching ``model`` that has one."""
    found = None
    for glob, entry in entries:
        if entry.price is not None and fnmatch.fnmatchcase(model, glob):
            found = entry.price
    return found


def cost(usage: Mapping[str, Any] | None, price: ModelPrice | None) -> float | None:
    """The request's cost from its usage (``prompt_tokens``, ``cached_tokens``,
    ``completion_tokens``), rounded to 1e-9; ``None`` without a price or a usage."""
    if price is None or not usage:
        return None
    prompt = max(0, int(usage.get("prompt_tokens") or 0))
    cached = min(prompt, max(0, int(usage.get("cached_tokens") or 0)))
    output = max(0, int(usage.get("completion_tokens") or 0))
    cached_rate = price.input if price.cached_input is None else price.cached_input
    total = ((prompt - cached) * price.input + cached * cached_rate + output * price.output) / PER
    return round(total, 9)
