"""The accumulator and the realtime scheduler as plain classes, fed one input at a time."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.errors import GatewayError
from gateway.stream.accumulator import ChatSSEAccumulator, ToolRules
from gateway.stream.compatible import replay
from gateway.stream.events import BlockDelta, BlockStart, BlockStop, Finish
from gateway.stream.realtime import RealtimeScheduler, viable_object_prefix
from gateway.stream.tool_calls import ToolArgs, ToolCallMerger, ToolIdentified


def chunk(delta: dict, finish: str | None = None) -> dict:
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def tool(index: int | None = None, id: str | None = None, name: str | None = None, args: str | None = None) -> dict:
    delta: dict = {"function": {}}
    if index is not None:
        delta["index"] = index
    if id is not None:
        delta["id"] = id
    if name is not None:
        delta["function"]["name"] = name
    if args is not None:
        delta["function"]["arguments"] = args
    return chunk({"tool_calls": [delta]})


def run(chunks: list[dict], sequential: bool, rules: ToolRules | None = None) -> list:
    acc = ChatSSEAccumulator(rules=rules)
    scheduler = RealtimeScheduler(sequential)
    events = []
    for c in chunks:
        events += scheduler.push(acc.feed(c))
    completion = acc.seal()
    events += scheduler.finish(acc.sealed_slots, completion.finish_reason, completion.usage)
    return events


def check_sequential(events: list) -> None:
    """Never two blocks open; indexes 0,1,2... in order of start; deltas only to the open one."""
    open_block = None
    next_index = 0
    for e in events:
        if isinstance(e, BlockStart):
            assert open_block is None, f"block {e.index} started while {open_block} open"
            assert e.index == next_index
            open_block, next_index = e.index, next_index + 1
        elif isinstance(e, BlockDelta):
            assert e.index == open_block
        elif isinstance(e, BlockStop):
            assert e.index == open_block
            open_block = None
    assert open_block is None


def test_text_is_not_held_back_by_a_tool_waiting_for_its_name() -> None:
    acc = ChatSSEAccumulator()
    scheduler = RealtimeScheduler(sequential=False)
    assert scheduler.push(acc.feed(tool(0, id="call_1", args='{"a"'))) == []
    events = scheduler.push(acc.feed(chunk({"content": "meanwhile"})))
    assert [type(e) for e in events] == [BlockStart, BlockDelta]
    assert events[1].text == "meanwhile"
    events = scheduler.push(acc.feed(tool(0, name="lookup", args=": 1}")))
    assert events[0] == BlockStart(1, "tool", "call_1", "lookup")
    assert "".join(e.text for e in events if isinstance(e, BlockDelta)) == '{"a": 1}'


def test_interleaved_tools_are_serialized_for_sequential_protocols() -> None:
    chunks = [
        tool(0, "c0", "a", '{"x": '),
        tool(1, "c1", "b", '{"y": '),
        tool(0, args="1}"),
        tool(1, args="2}"),
        chunk({}, "tool_calls"),
    ]
    events = run(chunks, sequential=True)
    check_sequential(events)
    stops = [e for e in events if isinstance(e, BlockStop)]
    assert [(s.index, json.loads(s.content)) for s in stops] == [(0, {"x": 1}), (1, {"y": 2})]
    # the first call streamed live; the second waited until the first's JSON completed
    starts = [i for i, e in enumerate(events) if isinstance(e, BlockStart)]
    first_stop = next(i for i, e in enumerate(events) if isinstance(e, BlockStop))
    assert starts[1] > first_stop


def test_text_after_an_unfinished_tool_waits_then_gets_its_own_block() -> None:
    chunks = [
        chunk({"content": "before "}),
        tool(0, "c0", "a", '{"x": '),
        chunk({"content": "during"}),
        tool(0, args="1}"),
        chunk({"content": " after"}),
        chunk({}, "tool_calls"),
    ]
    events = run(chunks, sequential=True)
    check_sequential(events)
    stops = [(e.kind, e.content) for e in events if isinstance(e, BlockStop)]
    assert stops == [("text", "before "), ("tool", '{"x": 1}'), ("text", "during after")]


@pytest.mark.parametrize("sequential", [True, False])
def test_repeated_identity_is_not_concatenated(sequential: bool) -> None:
    chunks = [tool(0, "c0", "a", '{"x"'), tool(0, "c0", "a", ": 1}"), chunk({}, "stop")]
    events = run(chunks, sequential)
    assert [e for e in events if isinstance(e, BlockStart)] == [BlockStart(0, "tool", "c0", "a")]
    assert events[-1] == Finish("tool_calls", None)  # a stop with tools is a tool_calls finish


def test_missing_index_keys_by_id_then_continues_last() -> None:
    chunks = [
        chunk({"tool_calls": [{"id": "c0", "function": {"name": "a", "arguments": '{"x"'}}]}),
        chunk({"tool_calls": [{"function": {"arguments": ": 1}"}}]}),
        chunk({"tool_calls": [{"id": "c1", "function": {"name": "b", "arguments": "{}"}}]}),
        chunk({}, "tool_calls"),
    ]
    completion_events = run(chunks, sequential=False)
    stops = [(e.index, e.content) for e in completion_events if isinstance(e, BlockStop)]
    assert stops == [(0, '{"x": 1}'), (1, "{}")]


def test_identity_change_is_rejected() -> None:
    acc = ChatSSEAccumulator()
    acc.feed(tool(0, "c0", "a", "{"))
    with pytest.raises(GatewayError) as err:
        acc.feed(tool(0, "other", args="}"))
    assert err.value.code == "tool_identity_changed"


def test_name_without_id_gets_an_id_at_the_terminal() -> None:
    events = run([tool(0, name="a", args="{}"), chunk({}, "tool_calls")], sequential=True)
    start = next(e for e in events if isinstance(e, BlockStart))
    assert start.name == "a" and start.call_id and start.call_id.startswith("call_")


@pytest.mark.parametrize(
    ("rules", "chunks", "message"),
    [
        (ToolRules(declared=frozenset({"a"})), [tool(0, "c", "b", "{}")], "undeclared"),
        (ToolRules(choice="none"), [tool(0, "c", "a", "{}")], "tool_choice is none"),
        (ToolRules(choice="required"), [chunk({"content": "x"})], "requires a tool call"),
        (ToolRules(choice="a"), [tool(0, "c", "b", "{}")], "names 'a'"),
        (ToolRules(parallel=False), [tool(0, "c", "a", "{}"), tool(1, "d", "a", "{}")], "parallel"),
        (ToolRules(), [tool(0, "c", "a", "[1]")], "not a JSON object"),
        (ToolRules(), [tool(0, "c", "a", "{}"), tool(1, "c", "b", "{}")], "share one id"),
    ],
)
def test_terminal_validation(rules: ToolRules, chunks: list[dict], message: str) -> None:
    acc = ChatSSEAccumulator(rules=rules)
    for c in [*chunks, chunk({}, "stop")]:
        acc.feed(c)
    with pytest.raises(GatewayError, match=message) as err:
        acc.seal()
    assert err.value.code == "tool_call_invalid"


def test_terminal_outcomes() -> None:
    empty = ChatSSEAccumulator()
    empty.feed(chunk({}, "stop"))
    with pytest.raises(GatewayError, match="without any output"):
        empty.seal()
    refused = ChatSSEAccumulator()
    refused.feed(chunk({}, "content_filter"))
    assert refused.seal().finish_reason == "content_filter"
    unfinished = ChatSSEAccumulator()
    unfinished.feed(chunk({"content": "x"}))
    with pytest.raises(GatewayError, match="finish_reason"):
        unfinished.seal()


def test_budget_counts_utf8_bytes_of_everything_retained() -> None:
    acc = ChatSSEAccumulator(max_collect_bytes=10)
    acc.feed(chunk({"content": "ééé"}))  # 6 bytes
    acc.feed(chunk({"reasoning_content": "ab"}))  # 8
    with pytest.raises(GatewayError) as err:
        acc.feed(tool(0, "c", "a", "{}{}"))  # 12
    assert err.value.code == "response_too_large"


def test_upstream_error_frame() -> None:
    with pytest.raises(GatewayError, match="boom") as err:
        ChatSSEAccumulator().feed({"error": {"message": "boom"}})
    assert err.value.code == "upstream_error"


@settings(max_examples=200, deadline=None)
@given(
    pieces=st.lists(
        st.one_of(
            st.tuples(st.just("text"), st.text(min_size=1, max_size=5)),
            st.tuples(st.just("reasoning"), st.text(min_size=1, max_size=5)),
            st.tuples(st.sampled_from([0, 1, 2]), st.sampled_from(['{"k": ', '"v"', "}", "1"])),
        ),
        max_size=30,
    )
)
def test_sequential_release_never_overlaps_and_loses_nothing(pieces: list[tuple]) -> None:
    acc = ChatSSEAccumulator()
    scheduler = RealtimeScheduler(sequential=True)
    events = []
    started: set[int] = set()
    for kind, value in pieces:
        if kind in ("text", "reasoning"):
            key = "content" if kind == "text" else "reasoning_content"
            events += scheduler.push(acc.feed(chunk({key: value})))
        else:
            first = kind not in started
            started.add(kind)
            events += scheduler.push(acc.feed(tool(kind, f"c{kind}" if first else None, f"t{kind}" if first else None, value)))
    events += scheduler.finish([], "stop", None)
    check_sequential(events)
    texts = "".join(e.content for e in events if isinstance(e, BlockStop) and e.kind == "text")
    assert texts == acc.text
    call_of = {e.index: e.call_id for e in events if isinstance(e, BlockStart) and e.kind == "tool"}
    stopped = {call_of[e.index]: e.content for e in events if isinstance(e, BlockStop) and e.kind == "tool"}
    assert set(stopped) == {s.id for s in acc.slots}
    for slot in acc.slots:  # a block closes with its arguments; anything after a complete
        assert slot.arguments.startswith(stopped[slot.id])  # object is left to the terminal
        if viable_object_prefix(slot.arguments):
            assert stopped[slot.id] == slot.arguments
    for e in events:  # each block's deltas add up to its final content, or, for tool
        if isinstance(e, BlockStop):  # arguments that cannot be JSON, to a viable prefix of it
            released = "".join(d.text for d in events if isinstance(d, BlockDelta) and d.index == e.index)
            if e.kind != "tool" or viable_object_prefix(e.content):
                assert released == e.content
            else:
                assert e.content.startswith(released) and viable_object_prefix(released)


def test_arguments_that_cannot_be_json_are_never_released() -> None:
    acc = ChatSSEAccumulator()
    scheduler = RealtimeScheduler(sequential=True)
    events = scheduler.push(acc.feed(tool(0, "c", "a", "```json\n")))
    events += scheduler.push(acc.feed(tool(0, args='{"x": 1}\n```')))
    assert [e for e in events if isinstance(e, BlockDelta)] == []
    acc.feed(chunk({}, "tool_calls"))
    with pytest.raises(GatewayError, match="not a JSON object"):
        acc.seal()


def test_replay_keeps_the_upstream_order_of_reasoning_and_text_then_tools() -> None:
    acc = ChatSSEAccumulator()
    for c in [tool(0, "c", "a", "{}"), chunk({"content": "t"}), chunk({"reasoning_content": "r"}),
              chunk({"content": "u"}), chunk({"reasoning_content": "s", "content": "v"}), chunk({}, "tool_calls")]:
        acc.feed(c)
    events = list(replay(acc.seal()))
    check_sequential(events)
    starts = [e.kind for e in events if isinstance(e, BlockStart)]
    assert starts == ["text", "reasoning", "text", "reasoning", "text", "tool"]
    assert [e.content for e in events if isinstance(e, BlockStop)][:5] == ["t", "r", "u", "s", "v"]


def test_chat_realtime_never_interleaves_two_calls_and_never_holds_text() -> None:
    """Chat: call 1 waits while call 0's arguments are incomplete; text flows meanwhile."""
    acc = ChatSSEAccumulator()
    scheduler = RealtimeScheduler(sequential=False)
    steps = [
        (tool(0, "c0", "a", '{"x": '), [BlockStart(0, "tool", "c0", "a"), BlockDelta(0, "tool", '{"x": ')]),
        (tool(1, "c1", "b", '{"y": '), []),  # held: call 0 is not complete
        (chunk({"content": "meanwhile"}), [BlockStart(1, "text"), BlockDelta(1, "text", "meanwhile")]),
        (tool(1, args="2}"), []),  # call 1 complete, but still held behind call 0
        (tool(0, args="1}"), [BlockDelta(0, "tool", "1}"), BlockStop(0, "tool", '{"x": 1}'),
                              BlockStart(2, "tool", "c1", "b"), BlockDelta(2, "tool", '{"y": 2}'),
                              BlockStop(2, "tool", '{"y": 2}')]),
    ]
    for c, expected in steps:
        assert scheduler.push(acc.feed(c)) == expected
    acc.feed(chunk({}, "tool_calls"))
    completion = acc.seal()
    tail = scheduler.finish(acc.sealed_slots, completion.finish_reason, completion.usage)
    assert tail == [BlockStop(1, "text", "meanwhile"), Finish("tool_calls", None)]


# -- ToolCallMerger alone (gateway/stream/tool_calls.py) ------------------------------------


class Merger:
    """A ToolCallMerger fed with a budget that records what it was told (or refuses)."""

    def __init__(self, refuse: bool = False) -> None:
        self.inner, self.retained, self.refuse = ToolCallMerger(), [], refuse

    def retain(self, fragment: str) -> None:
        if self.refuse:
            raise GatewayError("upstream", "response_too_large", "over")
        self.retained.append(fragment)

    def feed(self, delta: dict) -> list:
        return self.inner.feed(delta, self.retain)

    @property
    def slots(self) -> list:
        return self.inner.slots

    def seal_identities(self) -> list:
        return self.inner.seal_identities()


def call(index: int | None = None, id: str | None = None, name: str | None = None, args: object = None) -> dict:
    """One delta carrying one ``tool_calls`` item (``args`` may be an object, as llama.cpp sends)."""
    return tool(index, id, name, args)["choices"][0]["delta"]  # type: ignore[arg-type]


def test_merger_releases_a_call_once_identified_and_begun_then_each_fragment() -> None:
    tools = Merger()
    assert tools.feed(call(0, "c0", "a")) == []  # no arguments yet: not announced
    [identified] = tools.feed(call(0, args='{"x"'))
    assert isinstance(identified, ToolIdentified) and identified.slot.id == "c0"
    [args] = tools.feed(call(0, args=": 1}"))
    assert isinstance(args, ToolArgs) and args.fragment == ": 1}" and args.slot is identified.slot
    assert [s.arguments for s in tools.slots] == ['{"x": 1}']


def test_merger_index_reused_after_a_complete_object_is_a_new_call_else_an_identity_change() -> None:
    tools = Merger()
    tools.feed(call(0, "c0", "a", "{}"))
    tools.feed(call(0, "c1", "b", '{"y": 2}'))  # index 0 again, after a whole object: a second call
    assert [(s.ordinal, s.id, s.name, s.arguments) for s in tools.slots] == [(0, "c0", "a", "{}"), (1, "c1", "b", '{"y": 2}')]
    unfinished = Merger()
    unfinished.feed(call(0, "c0", "a", '{"x"'))
    with pytest.raises(GatewayError) as err:
        unfinished.feed(call(0, "c1", "b", "}"))
    assert err.value.code == "tool_identity_changed" and "'c0' to 'c1'" in err.value.message


def test_merger_counts_a_legacy_function_call_only_without_tool_calls() -> None:
    both = Merger()
    for args in ('{"x"', ": 1}"):  # llama-cpp-python: both shapes on every chunk
        both.feed({**call(0, "c0", "a", args), "function_call": {"name": "a", "arguments": args}})
    assert [s.arguments for s in both.slots] == ['{"x": 1}']
    legacy = Merger()
    legacy.feed({"function_call": {"name": "a", "arguments": "{"}})
    legacy.feed({"function_call": {"arguments": "}"}})
    assert [(s.name, s.arguments) for s in legacy.slots] == [("a", "{}")]


def test_merger_object_arguments_once_and_every_fragment_retained_before_it_is_kept() -> None:
    tools = Merger()
    tools.feed(call(0, "c0", "a", {"x": [1]}))
    tools.feed(call(0, args={"x": [1]}))  # the same object repeated: not a second fragment
    assert tools.slots[0].parts == ['{"x":[1]}'] and tools.retained == ['{"x":[1]}']
    full = Merger(refuse=True)
    with pytest.raises(GatewayError):
        full.feed(call(0, "c0", "a", "{}"))
    assert full.slots[0].parts == []  # refused before it was kept


def test_merger_seal_names_id_less_calls_and_returns_only_the_unannounced() -> None:
    tools = Merger()
    tools.feed(call(0, "c0", "a", "{}"))  # announced while streaming
    tools.feed(call(1, name="b", args="{}"))  # no id: never announced
    tools.feed(call(2, "c2", "c"))  # no arguments ever: never announced
    tools.feed(call(3, args="{}"))  # no name: left for terminal validation
    sealed = tools.seal_identities()
    assert [s.ordinal for s in sealed] == [1, 2]
    assert sealed[0].id is not None and sealed[0].id.startswith("call_") and len(sealed[0].id) == 29
    assert tools.slots[3].id is None and not tools.slots[3].announced
    assert tools.seal_identities() == []  # sealing twice announces nothing again


def test_an_accumulator_with_tool_calls_is_freed_without_the_cycle_collector() -> None:
    import gc
    import weakref

    acc = ChatSSEAccumulator()
    acc.feed(tool(0, "c0", "a", '{"x": 1}'))
    ref = weakref.ref(acc)
    gc.disable()
    try:
        del acc
        assert ref() is None  # no reference cycle (the merger holds none back): a large answer goes at once
    finally:
        gc.enable()
