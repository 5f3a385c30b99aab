"""What a stream holds while its client does not read (issue #40): the answer once.

Fed directly, no server. Sizes are counted with tracemalloc (what the pure classes keep
allocated), never timed: a compatible answer is held once after it is sealed (was four
times: the raw pieces, the text, each run joined again, the replay's pieces), its replay is
built a piece at a time as it is taken, and relayed token-sized pieces are kept compactly
(a list of 4-character strings cost ~19 times the text)."""

from __future__ import annotations

import gc
import tracemalloc
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from gateway.redact import SECRETS
from gateway.stream.accumulator import ChatSSEAccumulator, ToolRules
from gateway.stream.answer import DONE, CompatibleAnswer, RealtimeAnswer
from gateway.stream.compatible import REPLAY_PIECE_CHARS, replay
from gateway.stream.events import BlockDelta, BlockStop, Finish
from gateway.stream.masking import DeltaMasker
from gateway.stream.realtime import RealtimeScheduler
from gateway.stream.repair import RepairPolicy
from gateway.stream.text_log import CHUNK_CHARS, TextLog

BODY: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
USAGE = {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}


def delta(**fields: str) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": fields, "finish_reason": None}]}


def stop() -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}], "usage": USAGE}


def pieces(total: int, size: int) -> Iterator[dict[str, Any]]:
    """``total`` characters of content in pieces of ``size``, each a fresh string (as parsed)."""
    for i in range(total // size):
        yield delta(content=(f"{i:07d} " * (size // 8 + 1))[:size])


#: Where the allocations counted are made: the stream classes and this file. The process's
#: other threads (the servers other tests in this worker started) allocate meanwhile, and
#: counted in the process's total they made these figures depend on what else was running.
COUNTED = [tracemalloc.Filter(True, "*/gateway/stream/*"), tracemalloc.Filter(True, "*/gateway/redact.py"),
           tracemalloc.Filter(True, __file__)]


def held_while(build: Callable[[], object]) -> tuple[object, int]:
    """What ``build()`` leaves allocated (bytes) by the stream classes, with what it returned
    kept alive."""
    gc.collect()
    tracemalloc.start()
    try:
        kept = build()
        gc.collect()
        return kept, sum(trace.size for trace in tracemalloc.take_snapshot().filter_traces(COUNTED).traces)
    finally:
        tracemalloc.stop()


# -- TextLog -----------------------------------------------------------------------------


def test_text_log_joins_small_pieces_and_shares_large_ones() -> None:
    log = TextLog()
    small = [f"{i:03d}|" for i in range(5000)]
    for piece in small:
        log.append(piece)
    big = "x" * 5000
    log.append(big)
    log.append("tail")
    whole = "".join(small) + big + "tail"
    assert log.text() == whole and len(log) == len(whole) and log
    chunks = log.chunks()
    assert len(chunks) <= len("".join(small)) // CHUNK_CHARS + 3  # not 5,002 strings
    assert any(chunk is big for chunk in chunks)  # a large piece is not copied
    for start, end in [(0, 1), (3, 4099), (19_990, 20_010), (20_000, 25_004), (0, len(whole)), (7, 7)]:
        assert log.slice(start, end) == whole[start:end]
    assert not TextLog() and TextLog().text() == ""


# -- compatible: held once, replayed lazily ------------------------------------------------


def test_a_sealed_answer_is_held_once_and_its_raw_pieces_released() -> None:
    size = 1_000_000

    def build() -> ChatSSEAccumulator:
        acc = ChatSSEAccumulator()
        for chunk in pieces(size, 4096):
            acc.feed(chunk)
        acc.feed(stop())
        acc.seal()
        return acc

    acc, held = held_while(build)
    assert isinstance(acc, ChatSSEAccumulator) and acc.sealed is not None
    completion = acc.sealed
    assert len(completion.text) == size // 4096 * 4096
    assert held < 1.2 * size  # was ~3x: the raw pieces, the text, the run joined again
    assert not acc.output.logs["text"]  # the raw pieces went with the seal
    assert acc.text is completion.text  # read from the answer: no copy
    assert acc.arrived()[0][0] is completion.text  # what a cut request is charged: the same string
    assert acc.seal() is completion


def test_runs_are_ranges_of_the_answer_not_copies() -> None:
    acc = ChatSSEAccumulator()
    for chunk in [delta(reasoning_content="think "), delta(content="say "), delta(reasoning_content="again"),
                  delta(content="done"), stop()]:
        acc.feed(chunk)
    completion = acc.seal()
    assert completion.reasoning == "think again" and completion.text == "say done"
    assert [(r.kind, r.text) for r in completion.runs()] == [
        ("reasoning", "think "), ("text", "say "), ("reasoning", "again"), ("text", "done")]
    one = ChatSSEAccumulator()
    for chunk in [delta(reasoning_content="a"), delta(reasoning_content="b"), delta(content="c"), delta(content="d"), stop()]:
        one.feed(chunk)
    sealed = one.seal()
    runs = sealed.runs()
    assert runs[0].text is sealed.reasoning and runs[1].text is sealed.text  # one run per kind: the same string


def test_the_replay_is_built_a_piece_at_a_time() -> None:
    acc = ChatSSEAccumulator()
    for chunk in pieces(1_000_000, 4096):
        acc.feed(chunk)
    acc.feed(stop())
    completion = acc.seal()

    def take_three() -> list[object]:
        events = replay(completion)
        return [next(events) for _ in range(3)]  # BlockStart and two deltas: a stalled client

    taken, held = held_while(take_three)
    assert held < 3 * REPLAY_PIECE_CHARS  # was the whole answer again, as 16 KiB pieces
    assert [type(e) for e in taken][1:] == [BlockDelta, BlockDelta]  # type: ignore[misc]
    events = list(replay(completion))
    deltas = [e for e in events if isinstance(e, BlockDelta)]
    assert all(len(d.text) <= REPLAY_PIECE_CHARS for d in deltas)
    assert "".join(d.text for d in deltas) == completion.text
    stop_event = next(e for e in events if isinstance(e, BlockStop))
    assert stop_event.content is completion.text and isinstance(events[-1], Finish)


def test_a_compatible_answer_holds_its_answer_once_while_the_client_does_not_read() -> None:
    size = 1_000_000

    def collect_then_stall() -> tuple[CompatibleAnswer, list[object]]:
        answer = CompatibleAnswer(0, ToolRules(), BODY, RepairPolicy(BODY, 0))
        answer.masker = DeltaMasker(SECRETS)
        answer.begin()
        for chunk in pieces(size, 4096):
            answer.handle(chunk)
        answer.handle(stop())
        answer.handle(DONE)
        events = iter(answer.finish())
        return answer, [events, next(events), next(events)]  # started, one piece written

    (answer, _), held = held_while(collect_then_stall)  # type: ignore[misc]
    assert held < 1.2 * size  # was ~4x
    assert isinstance(answer, CompatibleAnswer) and answer.completion is not None


# -- realtime: relayed text kept compactly, once ---------------------------------------------


@pytest.mark.parametrize("sequential", [False, True])
def test_realtime_keeps_token_sized_pieces_compactly(sequential: bool) -> None:
    size = 200_000

    def relay() -> RealtimeAnswer:
        answer = RealtimeAnswer(0, ToolRules(), BODY, sequential)
        answer.masker = DeltaMasker(SECRETS)
        answer.begin()
        for chunk in pieces(size, 4):
            answer.handle(chunk)  # the events were written: the client's buffers hold them
        return answer

    answer, held = held_while(relay)
    assert held < 1.5 * size  # was ~19x: a str object and list slots per 4-character piece
    assert isinstance(answer, RealtimeAnswer)
    answer.handle(stop())
    events = answer.finish()
    stop_event = next(e for e in events if isinstance(e, BlockStop))
    assert answer.completion is not None and stop_event.content == answer.completion.text
    assert len(answer.completion.text) == size


def test_a_scheduler_reading_its_text_from_the_accumulator_says_the_same() -> None:
    """Sequential, with text held behind an incomplete call: each block's stop carries the
    same text whether the scheduler keeps it or reads its range from the accumulator."""
    call = {"index": 0, "id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": '}}
    chunks = [delta(content="one "), {"choices": [{"index": 0, "delta": {"tool_calls": [call]}}]},
              delta(content="held "), delta(reasoning_content="why"), delta(content="more"),
              {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]}}]},
              delta(content=" after"), stop()]
    outs = []
    for source in (False, True):
        acc = ChatSSEAccumulator()
        scheduler = RealtimeScheduler(True, acc.text_range if source else None)
        events = []
        for chunk in chunks:
            events += scheduler.push(acc.feed(chunk))
        completion = acc.seal()
        events += scheduler.finish(acc.sealed_slots, completion.finish_reason, completion.usage)
        outs.append(events)
    assert outs[0] == outs[1]
    assert [e.content for e in outs[1] if isinstance(e, BlockStop)] == ["one ", '{"a": 1}', "held ", "why", "more after"]
