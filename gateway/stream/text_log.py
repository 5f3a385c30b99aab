"""TextLog: text kept a piece at a time, held compactly.

A streamed answer arrives in pieces of about one token (a few characters each); kept as a
list of those strings, every piece costs a str object (~50 bytes) and a list slot on top
of its characters: ~17 times the text for 4-character pieces, per holder. A stalled client
makes a realtime stream hold what it has relayed so far, so that was the cost of a slow
reader. A :class:`TextLog` joins small pieces into chunks as they come (amortised linear:
each character is copied once more) and keeps a large piece as it is (the same string
object its other holders have: no copy). :class:`AnswerText` is what the accumulator keeps
of an answer: a log per kind and the runs as ranges of them. Pure, no I/O.
"""

from __future__ import annotations

from typing import Any

#: A piece at least this long is kept as it is (shared, not copied).
SHARED_CHARS = 1024
#: Small pieces are joined into one chunk once they hold this many characters ...
CHUNK_CHARS = 1024
#: ... or this many pieces (the per-piece cost of what waits is bounded too).
CHUNK_PIECES = 256


class TextLog:
    """Text appended in pieces; read whole (:meth:`text`) or as a few chunks (:meth:`chunks`)."""

    __slots__ = ("_chunks", "_small", "_small_chars", "chars")

    def __init__(self) -> None:
        self._chunks: list[str] = []
        self._small: list[str] = []  # the small pieces not yet joined
        self._small_chars = 0
        self.chars = 0  # characters appended so far

    def append(self, piece: str) -> None:
        if not piece:
            return
        self.chars += len(piece)
        if len(piece) >= SHARED_CHARS:
            self._join_small()
            self._chunks.append(piece)
            return
        self._small.append(piece)
        self._small_chars += len(piece)
        if self._small_chars >= CHUNK_CHARS or len(self._small) >= CHUNK_PIECES:
            self._join_small()

    def _join_small(self) -> None:
        if self._small:
            self._chunks.append("".join(self._small))
            self._small = []
            self._small_chars = 0

    def chunks(self) -> list[str]:
        """The text as the few strings it is held in (references: no copy of the text)."""
        self._join_small()
        return self._chunks

    def text(self) -> str:
        """The whole text (the very string when it is held as one)."""
        return "".join(self.chunks())

    def slice(self, start: int, end: int) -> str:
        """Characters ``start`` to ``end`` (a copy of that range only)."""
        out: list[str] = []
        at = 0
        for chunk in self.chunks():
            if at >= end:
                break
            stop = at + len(chunk)
            if stop > start:
                out.append(chunk[max(start - at, 0) : end - at])
            at = stop
        return "".join(out)

    def __bool__(self) -> bool:
        return self.chars > 0

    def __len__(self) -> int:
        return self.chars


class AnswerText:
    """An answer's text as it arrives: one :class:`TextLog` per kind (``reasoning``,
    ``text``, ``refusal``) and its runs in the upstream's order as (kind, start, end)
    ranges of those (thinking, text, thinking, text are four runs, no text of their own)."""

    __slots__ = ("logs", "spans")

    def __init__(self) -> None:
        self.logs: dict[str, TextLog] = {"reasoning": TextLog(), "text": TextLog(), "refusal": TextLog()}
        self.spans: list[list[Any]] = []  # [kind, start, end], the last one growing

    def add(self, kind: str, text: str) -> None:
        log = self.logs[kind]
        start = len(log)
        log.append(text)
        if self.spans and self.spans[-1][0] == kind:
            self.spans[-1][2] = len(log)
        else:
            self.spans.append([kind, start, len(log)])

    def text(self, kind: str) -> str:
        return self.logs[kind].text()

    def range(self, kind: str, start: int, end: int) -> str:
        return self.logs[kind].slice(start, end)
