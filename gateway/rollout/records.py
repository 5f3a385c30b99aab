"""One model call's record (docs/capture.md), built from a finished or finishing run.

Pure apart from reading the run: no I/O. ``seq`` and ``continuity`` are not stored; the
read-back computes them over the rollout's calls in order (:mod:`gateway.rollout.store`),
so every replica answers the same.
"""

from __future__ import annotations

import time
from typing import Any

from gateway.rollout.tokens import tokens_from
from gateway.stream.events import Completion


def _usage(completion: Completion) -> dict[str, Any] | None:
    u = completion.usage
    if u is None:
        return None
    usage: dict[str, Any] = {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
                             "reasoning_tokens": u.reasoning_tokens, "cached_tokens": u.cached_tokens}
    if u.estimated:
        usage["estimated"] = True
    return usage


def answered_upstream(run: Any) -> dict[str, Any] | None:
    """The attempt that answered (the last one with a 200), else the last one tried."""
    log = run.attempts.log
    ok = [a for a in log if a.get("status") == 200]
    return (ok or log or [None])[-1]


def call_record(
    run: Any, outcome: str, error_code: str | None, source: str | None, prompt_ids: list[int] | None = None
) -> dict[str, Any]:
    """The record of ``run``'s call; ``source`` is the token source it ran under."""
    record = run.record
    completion: Completion | None = run.completion if run.error is None else None
    answer: dict[str, Any] | None
    tokens = None
    experts = None
    if completion is not None:
        answer = {
            "text": completion.text, "reasoning": completion.reasoning,
            "tool_calls": [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in completion.tool_calls],
            "finish_reason": completion.finish_reason, "usage": _usage(completion),
        }
        tokens = tokens_from(completion.token_data, source, prompt_ids)
        experts = completion.token_data.routed_experts if completion.token_data is not None else None
    else:
        acc = run.answer.acc
        answer = None if acc is None else {
            "text": acc.text, "reasoning": acc.reasoning, "tool_calls": [],
            "finish_reason": acc.finish_reason, "usage": None, "partial": True,
        }
    bodies = run.answer.bodies
    attempt = answered_upstream(run)
    return {
        "call_id": record.request_id,
        "rollout_id": run.rollout_id,
        "group_id": run.rollout_group,
        "started_at": record.started_at,
        "ended_at": record.ended_at or time.time(),
        "protocol": record.protocol,
        "transport": record.transport,
        "mode": record.mode,
        "model": record.model,
        "upstream": attempt.get("upstream") if attempt else None,
        "outcome": outcome,
        "error_code": error_code,
        "upstream_request": bodies[-1] if bodies else run.upstream_body,
        "answer": answer,
        "tokens": tokens,
        "routed_experts": experts,
        # whole from token 0 here; the recorder cuts a continued call's (gateway/rollout/experts.py)
        "routed_experts_from_token": 0 if experts is not None else None,
        "token_source": source or "none",
        "token_in": _token_in(run),
        # the weight versions that sampled the answer, per completion-token range (gateway/engines/versions.py)
        "weight_versions": attempt.get("weight_versions") if attempt else None,
    }


def _token_in(run: Any) -> dict[str, Any] | None:
    """What token-in did for this call (``used`` | ``skipped: <reason>``), None when no
    upstream with token-in was tried."""
    token_in = getattr(run.attempts, "token_in", None)
    return token_in.describe() if token_in is not None else None
