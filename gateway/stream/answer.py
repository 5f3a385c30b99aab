"""The answer state of one generation, per mode: upstream items in, canonical events out.

Both states are pure (no I/O, no clock) and are driven the same way by the generation
loop::

    body = answer.begin()
    while body is not None:
        for item in <one upstream answer to body>:  # chunk dicts and DONE
            emit(answer.handle(item))
        emit(answer.finish())                       # may raise GatewayError
        body = answer.begin()                       # a regeneration, or None when done

- :class:`RealtimeAnswer`: the accumulator's pieces go through the
  :class:`~gateway.stream.realtime.RealtimeScheduler` as they come; ``finish`` validates
  the terminal and closes the blocks. One upstream answer.
- :class:`CompatibleAnswer`: collects silently; ``finish`` lets the
  :class:`~gateway.stream.repair.RepairPolicy` decide (valid, repaired locally,
  regenerate, or fail) and, once valid, returns the replay of the whole answer (lazy:
  an iterator the loop writes a bounded piece at a time).

The byte budget spans every attempt of a request: each new accumulator starts from the
bytes retained so far.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from gateway.stream.accumulator import ChatSSEAccumulator, ToolRules, UsageEstimator
from gateway.stream.compatible import replay
from gateway.stream.events import Completion, Event
from gateway.stream.masking import DeltaMasker
from gateway.stream.realtime import RealtimeScheduler
from gateway.stream.repair import RepairPolicy
from gateway.stream.signatures import Seal
from gateway.stream.think_tags import Start


class Done:
    """The upstream sent ``data: [DONE]``."""


DONE = Done()

AnswerItem = dict[str, Any] | Done


class _Answer:
    """What both modes share: the current accumulator, the budget, the result."""

    def __init__(self, max_collect_bytes: int, rules: ToolRules, upstream_body: dict[str, Any]) -> None:
        self.max_collect_bytes = max_collect_bytes
        self.rules = rules
        self.acc: ChatSSEAccumulator | None = None  # the current attempt's
        self.completion: Completion | None = None
        self.bodies: list[dict[str, Any]] = []  # every body sent upstream, in order
        self._next: dict[str, Any] | None = upstream_body
        # set by the generation from its policy (see ChatSSEAccumulator):
        self.reasoning_tags: Start | None = None  # <think> splitting for this model
        self.estimate_usage: Callable[[dict[str, Any]], UsageEstimator] | None = None  # body -> estimator
        self.repair: RepairPolicy | None = None  # compatible mode's; realtime never repairs
        self.seal_signature: Seal | None = None  # thought signatures into call ids (the tenant's)
        self.masker: DeltaMasker | None = None  # secrets masked across delta boundaries

    def _masked(self, events: list[Event]) -> list[Event]:
        return self.masker.feed(events) if self.masker is not None and events else events

    @property
    def retained_bytes(self) -> int:
        return self.acc.retained_bytes if self.acc is not None else 0

    def begin(self) -> dict[str, Any] | None:
        """The body of the next upstream answer to read, or None when the answer is done."""
        body, self._next = self._next, None
        if body is not None:
            estimate = self.estimate_usage(body) if self.estimate_usage is not None else None
            acc = ChatSSEAccumulator(self.max_collect_bytes, self.rules, self.reasoning_tags, estimate, self.seal_signature)
            acc.retained_bytes = self.retained_bytes
            self.acc = acc
            self.bodies.append(body)
        return body

    def _feed(self, item: AnswerItem) -> list[Any]:
        assert self.acc is not None
        if isinstance(item, Done):
            self.acc.feed_done()
            return []
        return self.acc.feed(item)


class RealtimeAnswer(_Answer):
    """Realtime: released as the client's protocol allows, validated at the terminal."""

    def __init__(self, max_collect_bytes: int, rules: ToolRules, upstream_body: dict[str, Any], sequential: bool) -> None:
        super().__init__(max_collect_bytes, rules, upstream_body)
        # a text block's stop takes its text from the accumulator: relayed text is kept once
        self.scheduler = RealtimeScheduler(sequential, self._text_of)

    def handle(self, item: AnswerItem) -> list[Event]:
        pieces = self._feed(item)
        return self._masked(self.scheduler.push(pieces)) if pieces else []

    def _text_of(self, kind: str, start: int, end: int) -> str:
        assert self.acc is not None
        return self.acc.text_range(kind, start, end)

    def finish(self) -> list[Event]:
        assert self.acc is not None
        completion = self.completion = self.acc.seal()
        return self._masked(self.scheduler.finish(
            self.acc.sealed_slots, completion.finish_reason, completion.usage, completion.stop_sequence
        ))


class CompatibleAnswer(_Answer):
    """Compatible: collect, validate, repair or regenerate within the bound, replay."""

    def __init__(self, max_collect_bytes: int, rules: ToolRules, upstream_body: dict[str, Any], repair: RepairPolicy) -> None:
        super().__init__(max_collect_bytes, rules, upstream_body)
        self.repair: RepairPolicy = repair

    def handle(self, item: AnswerItem) -> list[Event]:
        self._feed(item)
        return []

    def finish(self) -> Iterable[Event]:
        """Once valid: the replay, lazily (one event at a time as the caller takes them;
        the accumulator released its raw pieces when it sealed); else nothing."""
        assert self.acc is not None
        decided = self.repair.decide(self.acc, len(self.bodies) - 1)
        if isinstance(decided, Completion):
            self.completion = decided
            events = replay(decided)
            return self.masker.stream(events) if self.masker is not None else events
        self._next = decided  # regenerate: begin() hands it out
        return []
