"""Delivery of rollout calls (gateway/rollout/store.py, "Delivery"), fed records and marks
directly: a success committed ``delivered: false`` and never confirmed makes the rollout
incomplete with the reason; a retry of it forks the trajectory, and the export can leave
it out. The fault test with a real SIGKILL is tests/rollout/test_rollout_kill.py."""

from __future__ import annotations

from typing import Any

import orjson

from gateway.rollout import store as rollout_store
from gateway.rollout.bulk_export import render


def record(call_id: str, started: float, prompt: list[int], completion: list[int],
           outcome: str = "success", delivered: bool | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "call_id": call_id, "rollout_id": "r", "started_at": started, "ended_at": started + 0.5, "outcome": outcome,
        "tokens": {"prompt_ids": prompt, "completion_ids": completion,
                   "completion_logprobs": [-0.25] * len(completion)},
    }
    if delivered is not None:
        out["delivered"] = delivered
    return out


# a: delivered; x: committed, the gateway killed before its terminal went out; y: the
# client's retry of the same turn (extends a, as x did); z: the next turn after y
A = record("a", 1.0, [1], [2], delivered=False)
X = record("x", 2.0, [1, 2, 3], [4], delivered=False)
Y = record("y", 3.0, [1, 2, 3], [5], delivered=False)
Z = record("z", 4.0, [1, 2, 3, 5, 6], [7], delivered=False)
MARKS = [("delivered", 1.6, "a"), ("delivered", 3.6, "y"), ("delivered", 4.6, "z")]


def test_a_success_never_confirmed_delivered_leaves_the_rollout_incomplete_and_forked() -> None:
    snap = rollout_store.snapshot([Z, X, A, Y], MARKS, "r")
    assert snap["complete"] is False
    assert snap["undelivered"] == ["x"]
    assert snap["incomplete"] == [rollout_store.undelivered_reason("x")]
    assert "not known to have reached the client" in snap["incomplete"][0]
    assert snap["forked"] is True and snap["forks"] == [{"call_id": "y", "extends": "a"}]
    assert [(c["call_id"], c["delivered"], c["seq"]) for c in snap["calls"]] == [
        ("a", True, 0), ("x", False, 1), ("y", True, 2), ("z", True, 3)]


def test_every_call_confirmed_is_complete_and_unforked() -> None:
    snap = rollout_store.snapshot([A, Y, Z], MARKS, "r")
    assert snap["complete"] is True and snap["incomplete"] == [] and snap["undelivered"] == []
    assert snap["forked"] is False and snap["forks"] == []


def test_a_call_a_later_call_extends_was_delivered_whatever_its_mark() -> None:
    # the gateway died after x's terminal went out but before its mark was stored: the
    # client had x's answer, its next call w extends x token for token
    w = record("w", 3.0, [1, 2, 3, 4, 5], [6], delivered=False)
    snap = rollout_store.snapshot([A, X, w], [("delivered", 1.6, "a"), ("delivered", 3.6, "w")], "r")
    assert snap["complete"] is True and snap["undelivered"] == [] and snap["forked"] is False
    assert [c["delivered"] for c in snap["calls"]] == [True, True, True]


def test_records_from_before_delivery_was_recorded_and_failed_calls_count_as_delivered() -> None:
    old = {k: v for k, v in X.items() if k != "delivered"}
    failed = record("f", 5.0, [9], [9], outcome="error", delivered=False)
    snap = rollout_store.snapshot([old, failed], [], "r")
    assert snap["complete"] is True and snap["undelivered"] == []


def test_excluding_undelivered_calls_leaves_one_straight_trajectory() -> None:
    forked = rollout_store.trajectory([A, X, Y, Z], "r", MARKS)["segments"]
    assert [s["call_ids"] for s in forked] == [["a", "x"], ["a", "y", "z"]]
    straight = rollout_store.trajectory([A, X, Y, Z], "r", MARKS, exclude_undelivered=True)["segments"]
    assert [s["call_ids"] for s in straight] == [["a", "y", "z"]]
    snap = rollout_store.snapshot([A, X, Y, Z], MARKS, "r", exclude_undelivered=True)
    assert [c["call_id"] for c in snap["calls"]] == ["a", "y", "z"] and [c["seq"] for c in snap["calls"]] == [0, 1, 2]
    assert snap["forked"] is False and snap["undelivered"] == ["x"] and snap["complete"] is False


def test_the_bulk_export_says_so_and_can_leave_undelivered_calls_out() -> None:
    read = ([A, X, Y, Z], MARKS)
    [native] = [orjson.loads(line) for line in render("native", "r", 4.5, read, {}).splitlines()]
    assert native["complete"] is False and native["undelivered"] == ["x"] and native["forked"] is True
    assert [s["call_ids"] for s in native["segments"]] == [["a", "x"], ["a", "y", "z"]]
    trl = [orjson.loads(line) for line in render("trl", "r", 4.5, read, {}, exclude_undelivered=True).splitlines()]
    assert [(line["call_ids"], line["segment_count"], line["complete"]) for line in trl] == [(["a", "y", "z"], 1, False)]
    assert trl[0]["prompt_ids"] == [1] and trl[0]["completion_ids"] == [2, 3, 5, 6, 7]
