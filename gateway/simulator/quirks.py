"""The simulator's upstream-quirk scenarios: what vLLM, llama.cpp, llama-cpp-python,
DeepSeek, Gemini and hosted providers stream differently from OpenAI (tool deltas without
an index or with a late name, object arguments, legacy ``function_call``, reasoning fields
and ``<think>`` tags, usage placements, thought signatures), each a pure function of the
request context. docs/upstreams.md lists what the gateway makes of each.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import zip_longest

from gateway.simulator.reply import (
    TEXT,
    TOOL_ARGS,
    Ctx,
    Delta,
    Reply,
    call_deltas,
    call_id,
    content_deltas,
    tool_args,
    tool_delta,
)

# -- round 1: tool-call deltas in odd shapes ----------------------------------------------


def interleaved_tools(ctx: Ctx) -> Reply:
    first, second = call_deltas(ctx, 0), call_deltas(ctx, 1)
    rest = [d for pair in zip_longest(first[1:], second[1:]) for d in pair if d is not None]
    return Reply([first[0], second[0], *rest], "tool_calls")


def missing_index(ctx: Ctx) -> Reply:
    deltas: list[Delta] = []
    for i in (0, 1):
        deltas.append(tool_delta(id=call_id(i), name=ctx.tools[i], args="", typed=True))
        deltas += [tool_delta(args=f) for f in ctx.split(tool_args(i))]
    return Reply(deltas, "tool_calls")


def repeated_id(ctx: Ctx) -> Reply:
    frags = ["", *ctx.split(tool_args(0))]
    deltas = [
        tool_delta(index=0, id=call_id(0), name=ctx.tools[0], args=f, typed=True) for f in frags
    ]
    return Reply(deltas, "tool_calls")


def late_name(ctx: Ctx) -> Reply:
    first, second, *rest = ctx.split_two(tool_args(0))
    deltas = [
        tool_delta(index=0, id=call_id(0), args=first, typed=True),
        tool_delta(index=0, name=ctx.tools[0], args=second),
        *(tool_delta(index=0, args=f) for f in rest),
    ]
    return Reply(deltas, "tool_calls")


def identity_change(ctx: Ctx) -> Reply:
    first, second, *rest = ctx.split_two(tool_args(0))
    deltas = [
        tool_delta(index=0, id=call_id(0), name=ctx.tools[0], args="", typed=True),
        tool_delta(index=0, args=first),
        tool_delta(index=0, id="call_sim_changed", args=second),
        *(tool_delta(index=0, args=f) for f in rest),
    ]
    return Reply(deltas, "tool_calls")


def empty_tool_array(ctx: Ctx) -> Reply:
    return Reply([{**d, "tool_calls": []} for d in content_deltas(ctx, TEXT)])


# -- round 2: what real servers send (see ../shared/PROTOCOLS.md, "Upstream variety") ----

THOUGHT_SIGNATURE = "CiQBVKhc7sim+signature/for==call0"
THINK_REASONING = "Let me think about Paris."
THINK_ANSWER = "It is sunny in Paris."


def object_arguments(ctx: Ctx) -> Reply:
    """llama.cpp: ``arguments`` as a JSON object, the whole call in one delta."""
    deltas = [
        {"tool_calls": [{"index": i, "id": call_id(i), "type": "function",
                         "function": {"name": ctx.tools[i], "arguments": dict(TOOL_ARGS[i])}}]}
        for i in (0, 1)
    ]
    return Reply(deltas, "tool_calls")


def _nulls(delta: Delta) -> Delta:
    """Every delta field present, absent ones as explicit nulls (llama-cpp-python)."""
    base: Delta = {"role": None, "content": None, "reasoning_content": None, "function_call": None,
                   "tool_calls": None, "refusal": None}
    return {**base, **delta}


def explicit_nulls(ctx: Ctx) -> Reply:
    text = [_nulls(d) for d in content_deltas(ctx, "Let me check. ")]
    calls = []
    for d in call_deltas(ctx, 0):
        entry = d["tool_calls"][0]
        fn = entry.setdefault("function", {})
        fn.setdefault("name", None)
        entry.setdefault("id", None)
        entry.setdefault("type", None)
        calls.append(_nulls(d))
    return Reply(text + calls, "tool_calls")


def legacy_function_call(ctx: Ctx) -> Reply:
    """llama-cpp-python's server: every call chunk carries the same content twice, as a
    legacy ``function_call`` and as ``tool_calls`` (name and id repeated), nulls elsewhere."""
    deltas: list[Delta] = []
    for i in (0, 1):
        for frag in ["", *ctx.split(tool_args(i))]:
            fn = {"name": ctx.tools[i], "arguments": frag}
            deltas.append(_nulls({
                "function_call": dict(fn),
                "tool_calls": [{"index": i, "id": call_id(i), "type": "function", "function": dict(fn)}],
            }))
    return Reply(deltas, "tool_calls")


def only_function_call(ctx: Ctx) -> Reply:
    """The oldest shape: ``function_call`` deltas and no ``tool_calls`` at all."""
    frags = ctx.split(tool_args(0))
    deltas = [{"function_call": {"name": ctx.tools[0], "arguments": ""}}]
    deltas += [{"function_call": {"arguments": f}} for f in frags]
    return Reply(deltas, "function_call")


def reasoning_after_text(ctx: Ctx) -> Reply:
    """DeepSeek V4 on vLLM: reasoning resumes after text."""
    return Reply(
        content_deltas(ctx, "First I think.", "reasoning_content") + content_deltas(ctx, "Here is a first part. ")
        + content_deltas(ctx, "Now I think again.", "reasoning_content") + content_deltas(ctx, "And the rest.")
    )


def reasoning_with_content(ctx: Ctx) -> Reply:
    """Reasoning and content in the same delta."""
    return Reply([{"reasoning_content": "Thinking.", "content": "Answer"},
                  {"reasoning_content": " More.", "content": " done."}])


def think_tags(ctx: Ctx) -> Reply:
    """A server without a reasoning parser: ``<think>`` inside content, cut anywhere."""
    return Reply(content_deltas(ctx, f"<think>{THINK_REASONING}</think>{THINK_ANSWER}"))


def think_close_only(ctx: Ctx) -> Reply:
    """The chat template opened the tag: only a closing ``</think>`` arrives."""
    return Reply(content_deltas(ctx, f"{THINK_REASONING}</think>{THINK_ANSWER}"))


def gemini_signature(ctx: Ctx) -> Reply:
    """Gemini: the first call's thought signature in a delta with nothing else, between its
    start and its arguments; the second call has none."""
    first, second = call_deltas(ctx, 0), call_deltas(ctx, 1)
    signature = {"tool_calls": [{"index": 0, "extra_content": {"google": {"thought_signature": THOUGHT_SIGNATURE}}}]}
    return Reply([first[0], signature, *first[1:], *second], "tool_calls")


def usage_placed(where: str) -> Callable[[Ctx], Reply]:
    def scenario(ctx: Ctx) -> Reply:
        return Reply(content_deltas(ctx, TEXT), usage_at=where)
    return scenario
