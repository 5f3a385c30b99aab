"""MoE routing replay, compactly (docs/capture.md "Routed experts"): a continued call's
record keeps only the routed experts of the tokens past what the call it extends already
recorded, and says where they start (``routed_experts_from_token``). Pure; run in the
recorder's worker thread. A long call's experts are tens of megabytes of base64, so lengths
are counted from the strings and only the kept tail is decoded (checked) and re-encoded.

The engines (vLLM ``--enable-return-routed-experts``, SGLang ``return_routed_experts``)
send base64 of a flat int32 array ``[tokens, layers, top_k]`` over the prompt and the
sampled tokens: some cover every token, some all but the last sampled one (it was never
fed through the model). The per-token stride is the byte length over that count, when
exactly one of the two counts gives a whole number of int32 values per token; otherwise
(another encoding, a list, a count that fits neither or both) the record keeps the value
whole, from token 0.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

from gateway.rollout.chain import chain_of

#: The record's key for the token where its ``routed_experts`` begin.
FROM_TOKEN = "routed_experts_from_token"


def _byte_length(value: Any) -> int | None:
    """How many bytes a base64 string holds, from its length (no decoding: a long call's
    experts are tens of megabytes); None when it is no base64 string."""
    if not isinstance(value, str) or len(value) % 4:
        return None
    padding = len(value) - len(value.rstrip("="))
    return len(value) // 4 * 3 - padding if padding <= 2 else None


def stride_of(length: int, tokens: int) -> tuple[int, int] | None:
    """(tokens covered, bytes per token) of an int32 array of ``length`` bytes over
    ``tokens`` prompt and sampled tokens, or over all but the last; None when that is not
    known for sure."""
    fits = [(n, length // n) for n in (tokens, tokens - 1)
            if n > 0 and length % n == 0 and (length // n) % 4 == 0 and length // n > 0]
    return fits[0] if len(fits) == 1 else None


def _recorded(previous: dict[str, Any], stride: int) -> int | None:
    """How many tokens' experts ``previous``'s record holds, counted from token 0."""
    length = _byte_length(previous.get("routed_experts"))
    if length is None or length % stride:
        return None
    return int(previous.get(FROM_TOKEN) or 0) + length // stride


def _tail(value: str, start: int) -> str | None:
    """base64 of the bytes of ``value`` from byte ``start`` on, decoding only those (the
    4-character group holding byte ``start`` onwards); None when they are no valid base64."""
    group, skip = divmod(start, 3)
    tail = value[group * 4 :]
    try:
        data = base64.b64decode(tail, validate=True)
    except (binascii.Error, ValueError):
        return None
    return tail if skip == 0 else base64.b64encode(data[skip:]).decode()


def compacted(record: dict[str, Any], history: list[dict[str, Any]]) -> dict[str, Any]:
    """``record`` with ``routed_experts`` cut to the tokens past what the call it extends
    token for token (from ``history``, the rollout's earlier records) recorded, and
    ``routed_experts_from_token`` (0: whole; None: no experts)."""
    value = record.get("routed_experts")
    if value is None:
        return {**record, FROM_TOKEN: None}
    whole = {**record, FROM_TOKEN: 0}
    tokens = record.get("tokens")
    length = _byte_length(value)
    if length is None or not isinstance(tokens, dict) or tokens.get("prompt_ids") is None:
        return whole
    found = stride_of(length, len(tokens["prompt_ids"]) + len(tokens.get("completion_ids") or []))
    if found is None:
        return whole
    covered, stride = found
    earlier = sorted((r for r in history if r.get("call_id") != record.get("call_id")),
                     key=lambda r: (float(r.get("started_at") or 0), str(r.get("call_id"))))
    chain = chain_of([*earlier, record])
    continuity = chain.continuity(str(record.get("call_id")))
    if continuity is None or continuity.prefix != "exact" or continuity.previous_call_id is None:
        return whole
    previous = next(r for r in earlier if str(r.get("call_id")) == continuity.previous_call_id)
    offset = _recorded(previous, stride)
    if offset is None or not 0 < offset <= covered:
        return whole
    cut = _tail(value, offset * stride)
    if cut is None:
        return whole
    return {**record, "routed_experts": cut, FROM_TOKEN: offset}
