"""The trainer shapes of the bulk export (gateway/rollout/shapes.py), fed directly: a 3-call
rollout with an edit (two segments) whose weights changed in the middle of its second and
third calls, and the weight versions each shape carries, with their exact token offsets."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.rollout import store
from gateway.rollout.shapes import rollout_lines


def record(call_id: str, started: float, prompt: list[int], completion: list[int],
           versions: list[dict[str, Any]]) -> dict[str, Any]:
    return {"call_id": call_id, "rollout_id": "R", "started_at": started, "ended_at": started + 0.5,
            "outcome": "success", "weight_versions": versions,
            "tokens": {"prompt_ids": prompt, "completion_ids": completion,
                       "completion_logprobs": [-0.25 * (i + 1) for i in range(len(completion))]}}


# a: prompt 1 2 3, samples 10 11 (v1); b extends a (+ tool result 4 5), samples 12 13 14, v2
# from its second token; c: the history edited (3 -> 30), samples 15 16, v3 from its second
RECORDS = [
    record("a", 1.0, [1, 2, 3], [10, 11], [{"version": "v1", "from_token": 0}]),
    record("b", 2.0, [1, 2, 3, 10, 11, 4, 5], [12, 13, 14],
           [{"version": "v1", "from_token": 0}, {"version": "v2", "from_token": 1}]),
    record("c", 3.0, [1, 2, 30, 10, 11, 4, 5, 12, 13, 14, 6], [15, 16],
           [{"version": "v2", "from_token": 0}, {"version": "v3", "from_token": 1}]),
]


def lines(shape: str) -> list[dict[str, Any]]:
    snap = store.snapshot(RECORDS, [], "R")
    segments = store.trajectory(RECORDS, "R")["segments"]
    return rollout_lines(shape, snap, segments, {}, "cursor", 3.5)


def test_nemo_gym_entries_carry_each_calls_versions_from_its_generation() -> None:
    first, second = lines("nemo-gym")
    assert [e["weight_versions"] for e in first["output"]] == [
        [{"version": "v1", "from_token": 0}],
        [{"version": "v1", "from_token": 0}, {"version": "v2", "from_token": 1}]]
    # v2 begins at the second generated token of b: 13
    assert first["output"][1]["generation_token_ids"][1] == 13
    assert [e["weight_versions"] for e in second["output"]] == [
        [{"version": "v2", "from_token": 0}, {"version": "v3", "from_token": 1}]]


@pytest.mark.parametrize("shape", ["trl", "verifiers"])
def test_flat_lines_carry_versions_from_their_completion(shape: str) -> None:
    first, second = lines(shape)
    # segment 0: prompt 1 2 3; completion 10 11 | 4 5 | 12 13 14
    assert first["completion_ids"] == [10, 11, 4, 5, 12, 13, 14]
    assert first["weight_versions"] == [
        {"call_id": "a", "version": "v1", "from_token": 0},
        {"call_id": "b", "version": "v1", "from_token": 4},
        {"call_id": "b", "version": "v2", "from_token": 5}]
    assert first["completion_ids"][5] == 13  # where v2 begins
    assert second["completion_ids"] == [15, 16]
    assert second["weight_versions"] == [
        {"call_id": "c", "version": "v2", "from_token": 0}, {"call_id": "c", "version": "v3", "from_token": 1}]


def test_calls_without_versions_give_empty_lists() -> None:
    bare = [{**r, "weight_versions": None} for r in RECORDS]
    snap, segments = store.snapshot(bare, [], "R"), store.trajectory(bare, "R")["segments"]
    for shape in ("trl", "verifiers"):
        assert [line["weight_versions"] for line in rollout_lines(shape, snap, segments, {}, "c", 1.0)] == [[], []]
    nemo = rollout_lines("nemo-gym", snap, segments, {}, "c", 1.0)
    assert [[e["weight_versions"] for e in line["output"]] for line in nemo] == [[[], []], [[]]]
