"""Compatible mode: collect the whole answer, validate it, then replay it.

Collecting is :class:`gateway.stream.answer.CompatibleAnswer` (fed by the generation
loop, which owns the I/O and the keepalive timer); this module turns a validated
:class:`Completion` back into canonical block events: reasoning and text runs in the
upstream's order (thinking, text, thinking, text stay four blocks), then the tool calls.
"""

from __future__ import annotations

from gateway.stream.events import BlockDelta, BlockStart, BlockStop, Completion, Event, Finish, TokenLogprobs

#: Replayed text is cut into deltas of at most this many characters, so that a client's
#: incremental parser never has to hold one huge frame.
REPLAY_PIECE_CHARS = 16384


def _pieces(text: str) -> list[str]:
    return [text[i : i + REPLAY_PIECE_CHARS] for i in range(0, len(text), REPLAY_PIECE_CHARS)]


def replay(completion: Completion) -> list[Event]:
    """The events of a validated answer, block indexes from 0 in replay order."""
    events: list[Event] = []
    index = 0
    logprobs = completion.token_data.logprobs if completion.token_data is not None else []
    for run in completion.runs():
        kind, text = run.kind, run.text
        if logprobs and kind == "text":  # as realtime sends them: before the output they score
            events.append(TokenLogprobs(tuple(logprobs)))
            logprobs = []
        events.append(BlockStart(index, kind))  # type: ignore[arg-type]
        events.extend(BlockDelta(index, kind, piece) for piece in _pieces(text))  # type: ignore[arg-type]
        events.append(BlockStop(index, kind, text))  # type: ignore[arg-type]
        index += 1
    for call in completion.tool_calls:
        events.append(BlockStart(index, "tool", call.id, call.name))
        events.extend(BlockDelta(index, "tool", piece) for piece in _pieces(call.arguments))
        events.append(BlockStop(index, "tool", call.arguments))
        index += 1
    if logprobs:  # no text block (a refusal, tool calls only): Chat still shows them
        events.append(TokenLogprobs(tuple(logprobs)))
    events.append(Finish(completion.finish_reason, completion.usage, completion.stop_sequence))
    return events
