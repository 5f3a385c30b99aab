"""The pure chain of a rollout's calls: continuity (exact / diverged / unknown) and the
trajectory's segments, fed call records directly."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.rollout.chain import RolloutChain, chain_of


def call(call_id: str, prompt: list[int] | None, completion: list[int] | None = None) -> dict[str, Any]:
    if prompt is None:
        return {"call_id": call_id, "tokens": None}
    completion = completion or []
    return {"call_id": call_id, "tokens": {"prompt_ids": prompt, "completion_ids": completion,
                                           "completion_logprobs": [-0.5 - i for i in range(len(completion))]}}


def continuity(chain: RolloutChain, call_id: str) -> tuple[str | None, str, int | None]:
    c = chain.continuity(call_id)
    assert c is not None
    return c.previous_call_id, c.prefix, c.diverged_at


def test_an_append_only_chain_is_one_segment_with_the_sampled_tokens_masked() -> None:
    chain = chain_of([call("a", [1, 2], [3, 4]), call("b", [1, 2, 3, 4, 5], [6]), call("c", [1, 2, 3, 4, 5, 6, 7], [8, 9])])
    assert [continuity(chain, x) for x in "abc"] == [(None, "exact", None), ("a", "exact", None), ("b", "exact", None)]
    [segment] = chain.segments()
    assert segment == {
        "call_ids": ["a", "b", "c"], "tokens": [1, 2, 3, 4, 5, 6, 7, 8, 9],
        "mask": [0, 0, 1, 1, 0, 1, 0, 1, 1],
        "logprobs": [None, None, -0.5, -1.5, None, -0.5, None, -0.5, -1.5],
        "weight_versions": [],
    }


def test_a_side_call_does_not_break_the_chain() -> None:
    chain = chain_of([call("main1", [9, 1, 2], [3]), call("title", [8, 7], [6]), call("main2", [9, 1, 2, 3, 4], [5])])
    assert continuity(chain, "title") == ("main1", "diverged", 0)
    assert continuity(chain, "main2") == ("main1", "exact", None)
    assert [s["call_ids"] for s in chain.segments()] == [["main1", "main2"], ["title"]]


def test_an_edited_history_diverges_at_the_first_differing_position() -> None:
    chain = chain_of([call("a", [1, 2, 3], [4]), call("b", [1, 2, 3, 4, 5], [6]), call("c", [1, 2, 30, 4, 5, 6, 7], [8])])
    assert continuity(chain, "c") == ("b", "diverged", 2)
    segments = chain.segments()
    assert [s["call_ids"] for s in segments] == [["a", "b"], ["c"]]
    assert segments[1]["mask"] == [0] * 7 + [1]


def test_a_fork_copies_the_chain_up_to_the_call_it_extends() -> None:
    chain = chain_of([call("a", [1], [2]), call("b", [1, 2, 3], [4]), call("retry", [1, 2, 5], [6])])
    assert continuity(chain, "retry") == ("a", "exact", None)
    assert [s["call_ids"] for s in chain.segments()] == [["a", "b"], ["a", "retry"]]
    assert chain.forks == [("retry", "a")]


def test_an_append_only_chain_and_a_side_call_are_no_fork() -> None:
    chain = chain_of([call("a", [1], [2]), call("title", [8], [9]), call("b", [1, 2, 3], [4])])
    assert chain.forks == []


def test_calls_without_token_ids_are_unknown_and_in_no_segment() -> None:
    chain = RolloutChain()
    assert chain.add(call("x", None)).as_dict() == {"previous_call_id": None, "prefix": "unknown", "diverged_at": None}
    chain.add(call("y", [1], [2]))
    assert continuity(chain, "y") == (None, "exact", None)
    assert [s["call_ids"] for s in chain.segments()] == [["y"]]
    assert chain.previous([1, 2, 3]) == (0, 2)


def test_a_retry_from_an_earlier_point_extends_that_point() -> None:
    chain = chain_of([call("a", [1], [2]), call("b", [1, 2, 3], [4]), call("again", [1, 2, 3], [5])])
    assert continuity(chain, "again") == ("a", "exact", None)
    assert [s["call_ids"] for s in chain.segments()] == [["a", "b"], ["a", "again"]]


def test_an_edit_after_an_exact_prefix_is_diverged_from_the_latest_call() -> None:
    # "c" extends "a" exactly, but shares more with "b": an edited history, not a fork of "a"
    chain = chain_of([call("a", [1], [2]), call("b", [1, 2, 3, 4], [5]), call("c", [1, 2, 3, 9, 5, 6], [7])])
    assert continuity(chain, "c") == ("b", "diverged", 3)


async def test_a_stalled_history_read_falls_back_within_its_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """Token-in's history read is bounded: a store that does not answer costs the call its
    token-in (no history: the chat way), never its answer; the fallback is logged."""
    import asyncio
    import types

    from gateway.rollout import recorder as recorder_module
    from gateway.rollout.recorder import RolloutRecorder

    stalled = asyncio.Event()

    class StalledStore:
        errors: tuple[type[BaseException], ...] = ()

        async def arun(self, fn: Any) -> Any:
            stalled.set()
            await asyncio.sleep(3600)

    monkeypatch.setattr(recorder_module, "HISTORY_TIMEOUT", 0.05)
    warnings: list[tuple[str, dict[str, Any]]] = []
    monkeypatch.setattr(recorder_module.log, "warning", lambda event, **kw: warnings.append((event, kw)))
    rec = RolloutRecorder(StalledStore(), None, types.SimpleNamespace(current=None), lambda: None)  # type: ignore[arg-type]
    async with asyncio.timeout(30):  # a hang bound, not a speed
        assert await rec.history("r1") == []
    assert stalled.is_set()
    assert warnings == [("rollout_history_failed", {"rollout": "r1", "error": "TimeoutError"})]
