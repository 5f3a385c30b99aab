"""One rollout as the records a trainer loads (docs/capture.md "Bulk export"): pure, fed
the rollout's snapshot (calls in order, marks), its trajectory segments and its labels.

``native`` is one line per rollout: the read-back's snapshot, its segments and rewards.
The trainer shapes are one line per trajectory segment (a chain of calls each extending
the previous token for token, :mod:`gateway.rollout.chain`), under the names each trainer
loads:

- ``nemo-gym``: NeMo Gym's ``TokenEntry`` per call of the segment (``prompt_token_ids``,
  ``generation_token_ids``, ``generation_log_probs``) in ``output``, and ``reward``;
- ``trl``: TRL's ``rollout_func`` / OpenEnv fields: ``prompt_ids``, ``completion_ids``,
  ``logprobs``, ``env_mask`` (1 on sampled tokens, 0 on what the environment added between
  turns, whose logprob is 0.0), ``env_reward``;
- ``verifiers``: verifiers / prime-rl: ``prompt_ids``, ``completion_ids``,
  ``completion_mask``, ``completion_logprobs`` (0.0 where the mask is 0), ``reward``.

The prompt of a segment is its first call's prompt; the completion is everything after it
(the sampled tokens, and the tool results and user turns in between, masked 0). Every line
carries ``rollout_id``, ``group_id``, ``complete`` and the ``cursor`` that resumes the
export after its rollout; segment lines also ``segment`` / ``segment_count`` (a rollout
is whole once the line with ``segment == segment_count - 1`` has arrived) and ``call_ids``.

Weight versions (docs/weight-sync.md) ride along under ``weight_versions``, an extra key
each trainer's loader ignores: per ``TokenEntry`` in ``nemo-gym`` (the call's own list,
``from_token`` into its ``generation_token_ids``), per line in ``trl`` / ``verifiers``
(``{"call_id", "version", "from_token"}``, ``from_token`` into the line's
``completion_ids``); ``[]`` when the upstream reports none.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

SHAPES = ("native", "nemo-gym", "trl", "verifiers")


def _reward_value(labels: dict[str, Any]) -> float | None:
    own = labels.get("reward")
    return float(own["reward"]) if own else None


def _completion_versions(segment: dict[str, Any], prompt_len: int) -> list[dict[str, Any]]:
    """The segment's versions with ``from_token`` into its completion, not its whole sequence."""
    return [{**v, "from_token": v["from_token"] - prompt_len} for v in segment.get("weight_versions") or []]


def _split(segment: dict[str, Any], prompt_len: int) -> tuple[list[int], list[int], list[int], list[float]]:
    """prompt ids, completion ids, completion mask, completion logprobs (0.0 off the mask)."""
    tokens, mask, logprobs = segment["tokens"], segment["mask"], segment["logprobs"]
    completion_logprobs = [float(lp) if m and lp is not None else 0.0
                           for m, lp in zip(mask[prompt_len:], logprobs[prompt_len:], strict=True)]
    return tokens[:prompt_len], tokens[prompt_len:], list(mask[prompt_len:]), completion_logprobs


def _trl(prompt: list[int], completion: list[int], mask: list[int], logprobs: list[float],
         reward: float | None) -> dict[str, Any]:
    return {"prompt_ids": prompt, "completion_ids": completion, "logprobs": logprobs, "env_mask": mask,
            "env_reward": reward}


def _verifiers(prompt: list[int], completion: list[int], mask: list[int], logprobs: list[float],
               reward: float | None) -> dict[str, Any]:
    return {"prompt_ids": prompt, "completion_ids": completion, "completion_mask": mask,
            "completion_logprobs": logprobs, "reward": reward}


_FLAT: dict[str, Callable[..., dict[str, Any]]] = {"trl": _trl, "verifiers": _verifiers}


def _token_entry(record: dict[str, Any]) -> dict[str, Any]:
    tokens = record["tokens"]
    return {"call_id": record["call_id"], "prompt_token_ids": tokens["prompt_ids"],
            "generation_token_ids": tokens["completion_ids"],
            "generation_log_probs": [float(lp) if lp is not None else 0.0 for lp in tokens["completion_logprobs"]],
            "weight_versions": [v for v in record.get("weight_versions") or [] if isinstance(v, dict)]}


def rollout_lines(
    shape: str, snapshot: dict[str, Any], segments: list[dict[str, Any]], labels: dict[str, Any], cursor: str,
    updated_at: float,
) -> list[dict[str, Any]]:
    """The lines of one rollout in ``shape``; ``snapshot`` is the read-back's
    (:func:`gateway.rollout.store.snapshot`), ``segments`` its trajectory's."""
    common = {"rollout_id": snapshot["rollout_id"], "group_id": labels.get("group_id"),
              "complete": snapshot["complete"], "frozen": snapshot["frozen"]}
    if shape == "native":
        return [{**common, "incomplete": snapshot["incomplete"], "undelivered": snapshot["undelivered"],
                 "forked": snapshot["forked"], "forks": snapshot["forks"], "updated_at": updated_at,
                 "reward": labels.get("reward"), "call_rewards": labels.get("call_rewards") or {},
                 "calls": snapshot["calls"], "segments": segments, "cursor": cursor}]
    by_id = {c["call_id"]: c for c in snapshot["calls"]}
    reward = _reward_value(labels)
    call_rewards = labels.get("call_rewards") or {}
    lines = []
    for n, segment in enumerate(segments):
        ids = segment["call_ids"]
        line: dict[str, Any] = {**common, "segment": n, "segment_count": len(segments), "call_ids": ids}
        line["call_rewards"] = {c: call_rewards[c]["reward"] for c in ids if c in call_rewards}
        if shape == "nemo-gym":
            line.update(output=[_token_entry(by_id[c]) for c in ids], reward=reward)
        else:
            prompt_len = len(by_id[ids[0]]["tokens"]["prompt_ids"])
            line.update(_FLAT[shape](*_split(segment, prompt_len), reward))
            line["weight_versions"] = _completion_versions(segment, prompt_len)
        line["cursor"] = cursor
        lines.append(line)
    return lines
