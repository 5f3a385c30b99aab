"""The seam of a continued answer, pure: :class:`CutTail` fed the engine's raw text after a
cut, and :class:`PartialAnswer`'s markup prefill and token-in prompt for each kind of cut."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.engines.continuation import through_tail
from gateway.engines.partial import PartialAnswer
from gateway.engines.seam import REASONING, TEXT, TOOL_CALL, CutTail, JsonValueEnd


def fed(tail: CutTail, *pieces: str) -> list[dict[str, Any]]:
    out = []
    for piece in pieces:
        out += tail.feed(piece)
    return out + tail.finish()


def test_a_cut_reasoning_goes_on_as_reasoning_until_its_closing_tag_split_anywhere() -> None:
    tail = CutTail(REASONING)
    out = fed(tail, "ly.</th", "ink>\\n\\nHel".replace("\\n", "\n"), "lo")
    assert out == [{"reasoning_content": "ly."}, {"content": "Hel"}, {"content": "lo"}]


def test_a_cut_call_gets_the_rest_of_its_arguments_then_the_next_calls_numbered_after_it() -> None:
    tail = CutTail(TOOL_CALL, calls_said=1, arguments_so_far='{"city": "Pa')
    out = fed(tail, 'ris", "q": "}{\\"', '"}', '}\n</tool', '_call>\n<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>')
    args = "".join(d["tool_calls"][0]["function"]["arguments"] for d in out if "id" not in d["tool_calls"][0])
    assert args == 'ris", "q": "}{\\""}'  # braces inside a string do not end the value
    assert all(d["tool_calls"][0]["index"] == 0 for d in out[:-1])
    assert out[-1]["tool_calls"][0]["index"] == 1 and out[-1]["tool_calls"][0]["function"] == {"name": "g", "arguments": "{}"}
    assert tail.calls == 2


def test_a_call_cut_after_its_whole_arguments_says_nothing_more_of_it() -> None:
    tail = CutTail(TOOL_CALL, calls_said=1, arguments_so_far='{"a": 1}')
    assert fed(tail, "}\n</tool_call>") == [] and tail.calls == 1


def test_text_after_a_cut_text_is_read_as_hermes() -> None:
    tail = CutTail(TEXT)
    assert fed(tail, "lo <tool_", "call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>")[0] == {"content": "lo "}
    assert tail.calls == 1


@pytest.mark.parametrize(("text", "end"), [('{"a": [1, {"b": "}"}]} rest', 22), ('"x\\"y" rest', 6), ("  {}", 4)])
def test_the_end_of_a_json_value(text: str, end: int) -> None:
    assert JsonValueEnd().feed(text) == end


def chunk(delta: dict[str, Any], ids: list[int] | None = None, **extra: Any) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": extra.pop("finish", None)}
    if ids is not None:
        choice["token_ids"] = ids
    return {"choices": [choice], **extra}


def test_a_cut_reasoning_is_prefilled_open_and_continued_from_its_ids() -> None:
    partial = PartialAnswer()
    partial.feed(chunk({"role": "assistant", "reasoning_content": "Th"}, [84, 104], prompt_token_ids=[1, 2]))
    assert partial.feed(chunk({}, [], finish="abort")) is None and partial.aborted
    assert partial.token_prompt() == [1, 2, 84, 104]
    body = partial.continuation_body({"messages": [{"role": "user", "content": "q"}]})
    assert body["messages"][-1] == {"role": "assistant", "content": "<think>Th"}
    assert partial.needs_tail() and partial.tail().state == REASONING


def test_a_cut_tool_call_is_prefilled_as_its_markup_after_the_reasoning_and_text() -> None:
    partial = PartialAnswer()
    partial.feed(chunk({"reasoning_content": "R"}))
    partial.feed(chunk({"content": "T"}))
    partial.feed(chunk({"tool_calls": [{"index": 0, "id": "c0", "function": {"name": "f", "arguments": "{}"}}]}))
    partial.feed(chunk({"tool_calls": [{"index": 1, "id": "c1", "function": {"name": "g", "arguments": ""}}]}))
    partial.feed(chunk({"tool_calls": [{"index": 1, "function": {"arguments": '{"a'}}]}, finish="abort"))
    assert partial.aborted and partial.token_prompt() is None  # no ids: through chat
    content = partial.continuation_body({"messages": []})["messages"][-1]["content"]
    assert content == ('<think>R</think>T<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
                       '<tool_call>\n{"name": "g", "arguments": {"a')
    tail = partial.tail()
    assert (tail.state, tail.cut_index) == (TOOL_CALL, 1)


def test_an_engine_that_parses_the_continued_reasoning_itself_is_trusted() -> None:
    """vLLM's qwen3 / deepseek_r1 parsers read output before ``</think>`` as reasoning even
    when ``<think>`` was in the prompt: then its ``content`` is the text, not reasoning."""
    tail = CutTail(REASONING)
    legs = through_tail({"choices": [{"index": 0, "delta": {"reasoning_content": "ly."}, "finish_reason": None}]}, tail)
    legs += through_tail({"choices": [{"index": 0, "delta": {"content": "Hello"}, "finish_reason": "stop"}]}, tail)
    deltas = [c["choices"][0]["delta"] for c in legs if c["choices"][0]["delta"]]
    assert deltas == [{"reasoning_content": "ly."}, {"content": "Hello"}]
    assert legs[-1]["choices"][0]["finish_reason"] == "stop"
