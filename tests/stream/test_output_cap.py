"""The output cap held while reading (gateway/stream/output_cap.py), fed chunks directly."""

from __future__ import annotations

from typing import Any

from gateway.protocols.tokens import count_text
from gateway.stream.output_cap import OutputCap

WORDS = "Hello there, general Kenobi. " * 200


def chunk(**delta: Any) -> dict[str, Any]:
    return {"id": "c1", "object": "chat.completion.chunk", "model": "m",
            "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}


def feed_text(cap: OutputCap, text: str, size: int, field: str = "content") -> str:
    kept = []
    for i in range(0, len(text), size):
        out = cap.feed(chunk(**{field: text[i:i + size]}))
        kept.append(out["choices"][0]["delta"].get(field, ""))
        if cap.reached:
            break
    return "".join(kept)


def test_an_answer_within_the_cap_passes_untouched_and_counts_nothing() -> None:
    calls: list[str] = []
    cap = OutputCap(1000, lambda t: calls.append(t) or count_text(t))  # type: ignore[func-returns-value]
    piece = chunk(content="short answer")
    assert cap.feed(piece) is piece
    assert not cap.reached and calls == []  # 12 bytes cannot be 1000 tokens: no tokenizer


def test_the_crossing_piece_is_trimmed_to_exactly_the_cap() -> None:
    for size in (1, 7, 64, 500):
        cap = OutputCap(40, count_text)
        kept = feed_text(cap, WORDS, size)
        assert cap.reached, size
        assert 39 <= count_text(kept) <= 40, (size, count_text(kept))
        assert WORDS.startswith(kept)
        assert cap.finish_chunk()["choices"] == [{"index": 0, "delta": {}, "finish_reason": "length"}]
        assert cap.finish_chunk()["id"] == "c1"


def test_reasoning_and_tool_arguments_count_and_later_fields_are_dropped() -> None:
    cap = OutputCap(30, count_text)
    assert feed_text(cap, WORDS[:60], 20, "reasoning_content")  # within the cap
    assert not cap.reached
    out = cap.feed(chunk(content=WORDS[:400], tool_calls=[{"index": 0, "function": {"arguments": "{}"}}]))
    assert cap.reached
    delta = out["choices"][0]["delta"]
    assert "tool_calls" not in delta and out["choices"][0]["finish_reason"] is None
    assert count_text(WORDS[:60] + delta["content"]) <= 30
    cap = OutputCap(20, count_text)
    out = cap.feed(chunk(tool_calls=[{"index": 0, "id": "call_1", "function": {"name": "f", "arguments": '{"a": "' + WORDS}}]))
    assert cap.reached
    arguments = out["choices"][0]["delta"]["tool_calls"][0]["function"]["arguments"]
    assert count_text("f" + arguments) <= 20 and arguments.startswith('{"a": "Hello')


def test_a_finish_reason_on_the_crossing_chunk_is_replaced_by_length() -> None:
    cap = OutputCap(10, count_text)
    piece = chunk(content=WORDS[:300])
    piece["choices"][0]["finish_reason"] = "stop"
    out = cap.feed(piece)
    assert cap.reached and out["choices"][0]["finish_reason"] is None
    assert cap.feed(chunk(content="more")) == {}  # nothing passes after the cap
