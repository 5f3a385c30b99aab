"""The pure halves of a generation: answer states per mode, the repair policy, the
outcome writer, bounded stickiness. Fed directly, no server, no event loop."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.errors import GatewayError
from gateway.generation.outcome import RequestOutcome
from gateway.generation.record import RequestRecord
from gateway.stream.accumulator import ChatSSEAccumulator, ToolRules
from gateway.stream.answer import DONE, CompatibleAnswer, RealtimeAnswer
from gateway.stream.events import BlockDelta, BlockStart, BlockStop, Completion, Finish
from gateway.stream.repair import REPAIR_MARKER, RepairPolicy, repair_arguments
from gateway.upstream.routing import StickySessions

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
BODY: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "weather?"}], "tools": TOOLS}
RULES = ToolRules(declared=frozenset({"get_weather"}))


def text(content: str, finish: str | None = None) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": {"content": content}, "finish_reason": finish}]}


def tool(arguments: str, finish: str | None = "tool_calls") -> dict[str, Any]:
    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
    return {"choices": [{"index": 0, "delta": {"tool_calls": [call]}, "finish_reason": finish}]}


def compatible(max_regenerations: int = 1, budget: int = 0) -> CompatibleAnswer:
    return CompatibleAnswer(budget, RULES, BODY, RepairPolicy(BODY, max_regenerations))


# -- answer states -----------------------------------------------------------------------


def test_realtime_releases_text_as_it_comes_and_closes_at_finish() -> None:
    answer = RealtimeAnswer(0, RULES, BODY, sequential=True)
    assert answer.begin() == BODY
    assert answer.handle(text("Hel")) == [BlockStart(0, "text"), BlockDelta(0, "text", "Hel")]
    assert answer.handle(text("lo", "stop")) == [BlockDelta(0, "text", "lo")]
    assert answer.handle(DONE) == []
    assert answer.finish() == [BlockStop(0, "text", "Hello"), Finish("stop", None)]
    assert answer.begin() is None and answer.completion is not None and answer.completion.text == "Hello"


def test_realtime_invalid_terminal_raises_and_never_regenerates() -> None:
    answer = RealtimeAnswer(0, RULES, BODY, sequential=True)
    answer.begin()
    answer.handle(text("partial"))
    with pytest.raises(GatewayError) as caught:
        answer.finish()
    assert caught.value.code == "upstream_incomplete" and answer.begin() is None


def test_compatible_collects_silently_then_replays() -> None:
    answer = compatible()
    answer.begin()
    assert answer.handle(text("Hi", "stop")) == [] and answer.handle(DONE) == []
    assert list(answer.finish()) == [BlockStart(0, "text"), BlockDelta(0, "text", "Hi"), BlockStop(0, "text", "Hi"),
                                     Finish("stop", None)]
    assert answer.begin() is None and answer.repair.log == []


def test_compatible_regenerates_an_unrepairable_call_then_accepts_the_valid_one() -> None:
    answer = compatible(max_regenerations=1)
    answer.begin()
    answer.handle(tool('{"city": "Par'))  # cut inside a string: no safe local repair
    assert answer.finish() == []
    retry = answer.begin()
    assert retry is not None and REPAIR_MARKER in retry["messages"][-1]["content"]
    assert retry["messages"][:-1] == BODY["messages"]  # the original body is untouched
    answer.handle(tool('{"city": "Paris"}'))
    events = list(answer.finish())
    assert isinstance(events[-1], Finish) and events[-1].finish_reason == "tool_calls"
    assert [(r["kind"], r["outcome"]) for r in answer.repair.log] == [("original", "invalid"), ("regenerate", "valid")]
    assert len(answer.bodies) == 2


def test_compatible_gives_up_after_the_bound() -> None:
    answer = compatible(max_regenerations=1)
    for _ in range(2):
        answer.begin()
        answer.handle(tool("not json at all"))
        if len(answer.bodies) == 1:
            assert answer.finish() == []
    with pytest.raises(GatewayError) as caught:
        answer.finish()
    assert caught.value.code == "tool_call_invalid" and "after 1 regeneration" in caught.value.message


def test_the_budget_spans_every_attempt() -> None:
    answer = compatible(max_regenerations=1, budget=40)
    answer.begin()
    answer.handle(tool('{"city": "Paris is a very long na'))  # 33 bytes retained
    answer.finish()
    answer.begin()
    with pytest.raises(GatewayError) as caught:
        answer.handle(tool('{"city": "Paris"}'))
    assert caught.value.code == "response_too_large"


# -- repair policy -----------------------------------------------------------------------


def test_local_repair_is_taken_when_it_invents_nothing() -> None:
    acc = ChatSSEAccumulator(0, RULES)
    acc.feed(tool('```json\n{"city": "Paris",}\n```'))
    policy = RepairPolicy(BODY, 0)
    decided = policy.decide(acc, 0)
    assert isinstance(decided, Completion) and decided.tool_calls[0].arguments == '{"city":"Paris"}'
    assert [(r["kind"], r["outcome"]) for r in policy.log] == [("local", "repaired")]


def test_repair_steps_are_timed_once_each_a_read_as_a_span_a_local_repair_as_an_instant() -> None:
    policy = RepairPolicy(BODY, 1)
    acc = ChatSSEAccumulator(0, RULES)
    acc.feed(tool('{"city": "Par'))
    assert not isinstance(policy.decide(acc, 0), Completion)  # original: invalid
    policy.time_since(0, 100.0, 100.5)
    acc = ChatSSEAccumulator(0, RULES)
    acc.feed(tool('```json\n{"city": "Paris",}\n```'))
    assert isinstance(policy.decide(acc, 1), Completion)  # repaired locally
    policy.time_since(1, 101.0, 101.25)
    policy.time_since(0, 900.0, 901.0)  # already timed: kept as it was
    assert [(e["kind"], e["started_at"], e["duration_ms"]) for e in policy.log] == [
        ("original", 100.0, 500.0), ("local", 101.25, 0.0)]
    assert compatible().repair is not None and RealtimeAnswer(0, RULES, BODY, sequential=True).repair is None


def test_non_repairable_errors_are_final_at_once() -> None:
    acc = ChatSSEAccumulator(0, RULES)
    acc.feed(text("no finish"))
    with pytest.raises(GatewayError) as caught:
        RepairPolicy(BODY, 3).decide(acc, 0)
    assert caught.value.code == "upstream_incomplete"


@pytest.mark.parametrize(
    ("arguments", "repaired"),
    [('{"city": "Paris"', '{"city":"Paris"}'), ('Sure: {"city": "Rome"} done', '{"city":"Rome"}'),
     ('{"city": "Par', None), ('{"city":', None), ('{"town": "Paris"}', None)],
)
def test_repair_arguments(arguments: str, repaired: str | None) -> None:
    assert repair_arguments(arguments, TOOLS[0]["function"]["parameters"]) == repaired


# -- the outcome writer ------------------------------------------------------------------


def test_the_first_decision_wins_and_is_reported_once() -> None:
    record = RequestRecord("req_1", "chat", 0.0)
    reports: list[str] = []
    outcome = RequestOutcome(record, lambda: reports.append(record.outcome))
    outcome.failed(GatewayError("upstream", "upstream_error", "x"), committed=True)
    outcome.cancelled()
    outcome.succeeded()
    assert reports == ["error"] and record.error_code == "upstream_error" and record.http_status == 200


@pytest.mark.parametrize(
    ("decide", "outcome", "code", "status"),
    [("invalid", "invalid", "invalid_json", 400), ("refused", "refused", "invalid_json", 400),
     ("failed", "error", "invalid_json", 400)],
)
def test_outcome_fields(decide: str, outcome: str, code: str, status: int) -> None:
    record = RequestRecord("req_1", "chat", 0.0)
    writer = RequestOutcome(record, lambda: None)
    getattr(writer, decide)(GatewayError("invalid_request", "invalid_json", "x"))
    assert (record.outcome, record.error_code, record.http_status) == (outcome, code, status)


def test_budget_errors_are_flagged() -> None:
    record = RequestRecord("req_1", "chat", 0.0)
    RequestOutcome(record, lambda: None).failed(GatewayError("upstream", "response_too_large", "x"))
    assert record.budget_exceeded


def test_cancelled_is_client_disconnected() -> None:
    record = RequestRecord("req_1", "chat", 0.0)
    RequestOutcome(record, lambda: None).cancelled(http_status=499)
    assert (record.outcome, record.error_code, record.http_status) == ("cancelled", "client_disconnected", 499)


# -- bounded stickiness ------------------------------------------------------------------


def test_sticky_sessions_are_bounded_by_count_and_idle_time() -> None:
    now = [0.0]
    sticky = StickySessions(lambda: now[0], max_sessions=2, ttl=10)
    sticky.put("a", "c1")
    sticky.put("b", "c2")
    assert sticky.get("a") == "c1"
    sticky.put("a", "c1")  # a is now the most recent
    sticky.put("c", "c3")  # evicts b, the least recently used
    assert (sticky.get("b"), sticky.get("a"), sticky.get("c"), len(sticky)) == (None, "c1", "c3", 2)
    now[0] = 11
    assert sticky.get("a") is None  # idle too long
    sticky.put("d", "c4")
    assert len(sticky) == 1  # expired entries go on the next write
