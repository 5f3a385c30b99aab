"""Compatible mode: collect the whole answer, validate it, then replay it.

Collecting is :class:`gateway.stream.answer.CompatibleAnswer` (fed by the generation
loop, which owns the I/O and the keepalive timer); this module turns a validated
:class:`Completion` back into canonical block events: reasoning and text runs in the
upstream's order (thinking, text, thinking, text stay four blocks), then the tool calls.

The replay is lazy: one event at a time, as the client's writes take them, each delta a
slice of the completion's own strings. A client that does not read holds the answer once
(the completion) and a piece, never the whole answer again as events.
"""

from __future__ import annotations

from collections.abc import Iterator

from gateway.stream.events import (
    BlockDelta,
    BlockKind,
    BlockStart,
    BlockStop,
    Completion,
    Event,
    Finish,
    TokenLogprobs,
)

#: Replayed text is cut into deltas of at most this many characters, so that a client's
#: incremental parser never has to hold one huge frame.
REPLAY_PIECE_CHARS = 16384


def _block(index: int, kind: BlockKind, source: str, start: int, end: int) -> Iterator[Event]:
    """One block's deltas, sliced from ``source[start:end]`` a piece at a time; its stop
    carries the run (``source`` itself when the run is all of it)."""
    for at in range(start, end, REPLAY_PIECE_CHARS):
        yield BlockDelta(index, kind, source[at : min(at + REPLAY_PIECE_CHARS, end)])
    yield BlockStop(index, kind, source[start:end])


def replay(completion: Completion) -> Iterator[Event]:
    """The events of a validated answer, block indexes from 0 in replay order."""
    index = 0
    logprobs = completion.token_data.logprobs if completion.token_data is not None else []
    for kind, source, start, end in completion.run_ranges():
        if logprobs and kind == "text":  # as realtime sends them: before the output they score
            yield TokenLogprobs(tuple(logprobs))
            logprobs = []
        yield BlockStart(index, kind)
        yield from _block(index, kind, source, start, end)
        index += 1
    for call in completion.tool_calls:
        yield BlockStart(index, "tool", call.id, call.name)
        yield from _block(index, "tool", call.arguments, 0, len(call.arguments))
        index += 1
    if logprobs:  # no text block (a refusal, tool calls only): Chat still shows them
        yield TokenLogprobs(tuple(logprobs))
    yield Finish(completion.finish_reason, completion.usage, completion.stop_sequence)
