"""Realtime mode: release output as soon as the client's protocol allows.

:class:`RealtimeScheduler` turns the accumulator's pieces into canonical block events.
Client-facing block indexes are assigned in order of release and never change. A tool
call is released only once identified (id and name known); text never waits for it.

``sequential=True`` is for protocols where a block must close before the next opens
(Anthropic Messages, OpenAI Responses). There, while a tool block is open and its
arguments are not yet a complete JSON object, anything else is held back in order; it
is released as soon as the open tool's arguments complete, or at the terminal.

``sequential=False`` (Chat Completions) lets text, reasoning and one tool call stream
side by side, but never two tool calls: the openai SDK finalises (and for ``strict``
tools parses) a call when a delta for the next index arrives, so a call identified while
another's arguments are incomplete waits, and is released when they complete. Text
never waits for a tool.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import jiter

from gateway.stream.accumulator import (
    LogprobsPiece,
    Piece,
    TextPiece,
    ToolArgs,
    ToolIdentified,
    ToolSlot,
)
from gateway.stream.events import (
    BlockDelta,
    BlockKind,
    BlockStart,
    BlockStop,
    Event,
    Finish,
    FinishReason,
    TokenLogprobs,
    Usage,
)
from gateway.stream.text_log import TextLog

#: Beyond this many characters of arguments the prefix check is skipped (it reparses the
#: whole prefix each time); malformed arguments show up at their start in practice.
PREFIX_CHECK_LIMIT = 32768


def viable_object_prefix(arguments: str) -> bool:
    """Could ``arguments`` still grow into a JSON object? Clients such as the anthropic
    SDK parse tool input after every fragment and raise on anything else, so realtime
    releases only such prefixes (jiter, the SDKs' own partial parser, decides)."""
    stripped = arguments.lstrip()
    if not stripped or len(stripped) > PREFIX_CHECK_LIMIT:
        return True
    if stripped[0] != "{":
        return False
    data = stripped.encode()
    try:
        jiter.from_json(data)
        return True  # already a complete object
    except ValueError as exc:
        if str(exc).startswith("trailing characters"):
            return False  # an object with more after it can never parse
    try:
        jiter.from_json(data, partial_mode="trailing-strings")
    except ValueError:
        return False
    return True


@dataclass(slots=True)
class _Block:
    kind: BlockKind
    slot: ToolSlot | None = None
    index: int = -1  # assigned when started
    parts: TextLog = field(default_factory=TextLog)  # text blocks, without a text source: what was sent
    held: list[str] = field(default_factory=list)  # text of a held block, not yet sent
    start: int = -1  # text blocks: the range of their kind's text they carry (start, end)
    end: int = 0
    blocked: bool = False  # tool arguments stopped being a JSON object prefix: send no more
    stopped: bool = False


#: (kind, start, end) -> those characters of the answer's text of that kind
TextSource = Callable[[str, int, int], str]


class RealtimeScheduler:
    """Pieces in, block events out; no I/O.

    A text block's stop carries its whole text. With ``text_of`` (the accumulator that
    keeps the answer anyway) the scheduler keeps only each block's range of its kind's
    text, not a second copy of what it sent; without, it keeps the text itself."""

    def __init__(self, sequential: bool, text_of: TextSource | None = None) -> None:
        self.sequential = sequential
        self.text_of = text_of
        self._chars: dict[str, int] = {}  # per kind: characters of text pushed so far
        self._next_index = 0
        self._open: list[_Block] = []  # started, not stopped (at most one when sequential)
        self._held: list[_Block] = []  # sequential only: waiting for the open tool to finish
        self._block_of_slot: dict[int, _Block] = {}

    # -- input -------------------------------------------------------------------------

    def push(self, pieces: list[Piece]) -> list[Event]:
        out: list[Event] = []
        for piece in pieces:
            if isinstance(piece, TextPiece):
                self._text(piece, out)
            elif isinstance(piece, ToolIdentified):
                self._tool_identified(piece.slot, out)
            elif isinstance(piece, ToolArgs):
                self._tool_args(piece.slot, out)
            elif isinstance(piece, LogprobsPiece):
                out.append(TokenLogprobs(piece.entries))
        return out

    def finish(
        self, sealed: list[ToolSlot], finish_reason: FinishReason, usage: Usage | None, stop_sequence: str | None = None
    ) -> list[Event]:
        """Release slots identified only at the terminal, close everything, then Finish."""
        out: list[Event] = []
        for slot in sealed:
            self._tool_identified(slot, out)
        for block in list(self._open):
            self._stop(block, out)
        while self._held:
            block = self._held.pop(0)
            self._start(block, out)
            self._stop(block, out)
        out.append(Finish(finish_reason, usage, stop_sequence))
        return out

    # -- cases -------------------------------------------------------------------------

    def _text(self, piece: TextPiece, out: list[Event]) -> None:
        start = self._chars.get(piece.kind, 0)
        end = self._chars[piece.kind] = start + len(piece.text)
        block, now = self._text_block(piece.kind, out)
        if block.start < 0:
            block.start = start
        block.end = end  # a kind's pieces go to its blocks in order: each block is one range
        if now:
            self._send(block, piece.text, out)
        else:
            block.held.append(piece.text)

    def _text_block(self, kind: BlockKind, out: list[Event]) -> tuple[_Block, bool]:
        """The block a text piece of ``kind`` goes to (started if need be), and whether it
        is sent now (else held)."""
        if not self.sequential:
            block = next((b for b in self._open if b.kind == kind), None)
            if block is None:
                block = _Block(kind)
                self._start(block, out)
            return block, True
        if self._held:
            last = self._held[-1]
            if last.kind != kind:
                last = _Block(kind)
                self._held.append(last)
            return last, False
        active = self._open[0] if self._open else None
        if active is not None and active.kind == kind:
            return active, True
        if active is not None and active.kind == "tool" and not self._tool_done(active):
            block = _Block(kind)
            self._held.append(block)
            return block, False
        if active is not None:
            self._stop(active, out)
        block = _Block(kind)
        self._start(block, out)
        return block, True

    def _tool_identified(self, slot: ToolSlot, out: list[Event]) -> None:
        block = _Block("tool", slot=slot)
        self._block_of_slot[id(slot)] = block
        if not self.sequential:
            if self._held or any(b.kind == "tool" and not self._tool_done(b) for b in self._open):
                self._held.append(block)  # one call's fragments at a time
                return
            for tool in [b for b in self._open if b.kind == "tool"]:
                self._stop(tool, out)
        if self.sequential:
            active = self._open[0] if self._open else None
            if self._held or (active is not None and active.kind == "tool" and not self._tool_done(active)):
                self._held.append(block)
                return
            if active is not None:
                self._stop(active, out)
        self._start(block, out)
        self._send_args(block, out)

    def _tool_args(self, slot: ToolSlot, out: list[Event]) -> None:
        block = self._block_of_slot.get(id(slot))
        if block is None or block.index < 0 or block.stopped:
            return  # held (arguments are taken from the slot when it starts), or closed
            # after its object completed: more text can only make it invalid, which the
            # terminal validation reports
        self._send_args(block, out)
        if self._held and self._tool_done(block):
            if self.sequential:
                self._release_held(out)
            else:
                self._release_held_tools(block, out)

    def _release_held_tools(self, done: _Block, out: list[Event]) -> None:
        """Chat: the open call finished; release waiting calls until one stays open."""
        self._stop(done, out)
        while self._held:
            block = self._held.pop(0)
            self._start(block, out)
            self._send_args(block, out)
            if not self._tool_done(block):
                return
            self._stop(block, out)

    def _release_held(self, out: list[Event]) -> None:
        """The open tool finished: release held blocks until one must stay open."""
        for block in list(self._open):
            self._stop(block, out)
        while self._held:
            block = self._held.pop(0)
            self._start(block, out)
            if block.kind == "tool":
                self._send_args(block, out)
                if not self._tool_done(block):
                    return
            else:
                for text in block.held:
                    self._send(block, text, out)
                block.held.clear()
                if not self._held:
                    return  # the newest text block stays open for more
            self._stop(block, out)

    # -- primitives --------------------------------------------------------------------

    @staticmethod
    def _tool_done(block: _Block) -> bool:
        assert block.slot is not None
        return block.slot.arguments_complete()

    def _start(self, block: _Block, out: list[Event]) -> None:
        block.index = self._next_index
        self._next_index += 1
        self._open.append(block)
        slot = block.slot
        if slot is not None:
            slot.shown_id = slot.client_id
        out.append(
            BlockStart(block.index, block.kind, slot.client_id if slot else None, slot.name if slot else None)
        )

    def _send(self, block: _Block, text: str, out: list[Event]) -> None:
        if self.text_of is None:
            block.parts.append(text)
        out.append(BlockDelta(block.index, block.kind, text))

    def _send_args(self, block: _Block, out: list[Event]) -> None:
        assert block.slot is not None
        if block.blocked:
            return
        if not viable_object_prefix(block.slot.arguments):
            block.blocked = True  # the terminal will reject the call; clients never see it
            return
        text = block.slot.take_unreleased()
        if text:
            out.append(BlockDelta(block.index, "tool", text))

    def _stop(self, block: _Block, out: list[Event]) -> None:
        self._open.remove(block)
        block.stopped = True
        if block.kind == "tool":
            assert block.slot is not None
            self._send_args(block, out)
            content = block.slot.arguments
        else:
            for text in block.held:
                self._send(block, text, out)
            block.held.clear()
            if self.text_of is None or block.start < 0:
                content = block.parts.text()
            else:
                content = self.text_of(block.kind, block.start, block.end)
        out.append(BlockStop(block.index, block.kind, content))
