"""Cutting a continued call's routed experts to its new tokens (gateway/rollout/experts.py),
fed records directly: engines that cover every token and all but the last sampled one, and
the values kept whole because the stride is not known."""

from __future__ import annotations

import base64
import struct
from typing import Any

from gateway.rollout.experts import compacted, stride_of


def encoded(tokens: int, per_token: int = 4, base: int = 0) -> str:
    values = [base + t * per_token + k for t in range(tokens) for k in range(per_token)]
    return base64.b64encode(struct.pack(f"<{len(values)}i", *values)).decode()


def record(call_id: str, started: float, prompt: list[int], completion: list[int], experts: Any) -> dict[str, Any]:
    return {"call_id": call_id, "started_at": started, "routed_experts": experts, "routed_experts_from_token": 0,
            "tokens": {"prompt_ids": prompt, "completion_ids": completion, "completion_logprobs": [-0.1] * len(completion)}}


A = record("a", 1.0, [1, 2, 3, 4, 5, 6], [7, 8], encoded(8))
B_PROMPT = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]


def test_a_continued_call_keeps_the_tokens_past_the_previous_ones() -> None:
    b = compacted(record("b", 2.0, B_PROMPT, [11, 12], encoded(12)), [A])
    assert b["routed_experts_from_token"] == 8
    assert base64.b64decode(b["routed_experts"]) == base64.b64decode(encoded(12))[8 * 16 :]
    c = compacted(record("c", 3.0, [*B_PROMPT, 11, 12, 13], [14], encoded(14)), [A, b])
    assert c["routed_experts_from_token"] == 12  # b's slice ends where its sequence ends


def test_an_engine_that_skips_the_last_sampled_token_is_cut_where_the_previous_record_ends() -> None:
    a = record("a", 1.0, [1, 2, 3, 4, 5, 6], [7, 8], encoded(7))  # 7 of 8 tokens
    b = compacted(record("b", 2.0, B_PROMPT, [11, 12], encoded(11)), [a])
    assert b["routed_experts_from_token"] == 7  # the previous call never routed token 8: kept here
    assert base64.b64decode(b["routed_experts"]) == base64.b64decode(encoded(11))[7 * 16 :]


def test_what_is_kept_whole() -> None:
    first = compacted(A, [])
    assert (first["routed_experts"], first["routed_experts_from_token"]) == (A["routed_experts"], 0)
    edited = compacted(record("b", 2.0, [1, 2, 30, 4, 5, 6, 7, 8, 9], [11], encoded(10)), [A])
    assert edited["routed_experts_from_token"] == 0  # diverged: a new segment
    for odd in ([[1, 2], [3, 4]], "not base64!", encoded(12)[:-4]):
        kept = compacted(record("b", 2.0, B_PROMPT, [11, 12], odd), [A])
        assert (kept["routed_experts"], kept["routed_experts_from_token"]) == (odd, 0)
    assert compacted({**A, "routed_experts": None}, [])["routed_experts_from_token"] is None
    assert stride_of(64, 12) is None  # fits neither 12 nor 11 tokens of int32 values
    assert stride_of(16, 2) is None  # fits both 2 tokens x 8 bytes and 1 x 16: not known
    assert stride_of(192, 12) == (12, 16)
    # the right length, but the kept tail is no base64: kept whole as the engine sent it
    bad = encoded(12)[:-8] + "!!!!" + encoded(12)[-4:]
    assert compacted(record("b", 2.0, B_PROMPT, [11, 12], bad), [A])["routed_experts"] == bad
