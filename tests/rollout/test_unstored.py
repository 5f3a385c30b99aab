"""What a process holds of its rollouts that the store may not have yet
(gateway/rollout/unstored.py), fed directly: laid over the store's rows on a read-back
(the store's record wins, a reason the store has is not repeated), the spilled records
dropped once the journal is empty, the pending ``delivered`` marks bounded and forgotten
with their rollout. The store outage end to end is tests/rollout/test_rollouts.py."""

from __future__ import annotations

from typing import Any

from gateway.rollout.unstored import UnstoredRolloutFacts


def call(call_id: str, outcome: str = "success") -> dict[str, Any]:
    return {"call_id": call_id, "rollout_id": "r", "outcome": outcome}


def test_a_read_back_lays_what_is_held_over_the_store_and_the_stored_row_wins() -> None:
    facts = UnstoredRolloutFacts()
    facts.spilled_call("r", "a", call("a", "spilled copy"))
    facts.spilled_call("r", "b", call("b"))
    facts.incomplete_because("r", "call c: record not durable (lost)")
    facts.incomplete_because("r", "call d: record not durable (timeout)")
    facts.delivered_call("r", "b")
    facts.delivered_call("other", "e")
    held = facts.held("r", lambda: False)
    stored_marks = [("incomplete", 7.0, "call d: record not durable (timeout)")]
    records, marks = facts.over("r", held, [call("a")], stored_marks) or ([], [])
    assert sorted((r["call_id"], r["outcome"]) for r in records) == [("a", "success"), ("b", "success")]
    assert marks == [("incomplete", 7.0, "call d: record not durable (timeout)"),
                     ("incomplete", 0.0, "call c: record not durable (lost)"),
                     ("delivered", 0.0, "b")]


def test_an_empty_journal_drops_the_spilled_records_but_not_the_reasons() -> None:
    facts = UnstoredRolloutFacts()
    facts.spilled_call("r", "a", call("a"))
    facts.incomplete_because("r", "why")
    assert facts.held("r", lambda: True) == ([], ["why"])
    assert facts.held("r", lambda: False) == ([], ["why"])  # replayed: not brought back


def test_a_rollout_nothing_is_known_of_reads_as_none() -> None:
    facts = UnstoredRolloutFacts()
    facts.spilled_call("other", "a", call("a"))
    assert facts.over("r", facts.held("r", lambda: False), [], []) is None


def test_pending_delivered_marks_are_bounded_and_leave_once_stored_or_forgotten() -> None:
    facts = UnstoredRolloutFacts(max_delivered=2)
    for call_id in ("a", "b", "c"):
        facts.delivered_call("r", call_id)
    assert list(facts.delivered) == ["b", "c"]  # the least recent went first
    facts.delivery_stored("b")
    facts.delivered_call("s", "d")
    facts.spilled_call("r", "c", call("c"))
    facts.incomplete_because("r", "why")
    facts.forget("r")
    assert dict(facts.delivered) == {"d": "s"}
    assert facts.over("r", facts.held("r", lambda: False), [], []) is None
