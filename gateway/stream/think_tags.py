"""Splitting ``<think>...</think>`` out of content into reasoning (opt-in per model).

Servers without a reasoning parser (R1 distills, Qwen3, MiniMax behind a plain
OpenAI-compatible server) put the model's thinking inside ``content`` between tags.
:class:`ThinkTagSplitter` is fed one content fragment at a time and returns
``(kind, text)`` runs; a tag split across fragments is recognised because a possible tag
prefix at the end of a fragment is held until the next one decides it.

Two ways a stream may start (``starts``):

- ``"auto"``: the model writes both tags. Content before the first tag is held until the
  first tag decides what it was: an opening ``<think>`` makes it text; a closing
  ``</think>`` with no opener (the chat template opened the tag in the prompt) makes it
  reasoning; no tag at all by the end makes it text. After the first tag, output streams.
- ``"open"``: the template always opens the tag, so output starts as reasoning and
  streams at once; a leading ``<think>`` is dropped too.
"""

from __future__ import annotations

from typing import Literal

Kind = Literal["text", "reasoning"]
Start = Literal["auto", "open"]

OPEN_TAG = "<think>"
CLOSE_TAG = "</think>"


def _partial_tag_suffix(text: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a tag."""
    longest = 0
    for tag in (OPEN_TAG, CLOSE_TAG):
        for n in range(min(len(tag) - 1, len(text)), 0, -1):
            if text.endswith(tag[:n]):
                longest = max(longest, n)
                break
    return longest


class ThinkTagSplitter:
    """Content fragments in, ``(kind, text)`` runs out; no I/O."""

    def __init__(self, starts: Start = "auto") -> None:
        self._kind: Kind | None = "reasoning" if starts == "open" else None  # None: undecided
        self._drop_leading_open = starts == "open"
        self._pending = ""  # a possible tag prefix carried to the next fragment
        self._undecided: list[str] = []  # auto: content before the first tag

    def feed(self, fragment: str) -> list[tuple[Kind, str]]:
        out: list[tuple[Kind, str]] = []
        text = self._pending + fragment
        self._pending = ""
        while text:
            if self._drop_leading_open:
                stripped = text.lstrip()
                if OPEN_TAG.startswith(stripped) and len(stripped) < len(OPEN_TAG):
                    self._pending = text  # might still become "<think>"
                    return out
                if stripped.startswith(OPEN_TAG):
                    text = stripped[len(OPEN_TAG):]
                self._drop_leading_open = False
                continue
            tag, at = self._next_tag(text)
            if tag is None:
                keep = _partial_tag_suffix(text)
                body, self._pending = (text[:-keep], text[-keep:]) if keep else (text, "")
                self._emit(body, out)
                return out
            self._emit(text[:at], out)
            self._switch(tag, out)
            text = text[at + len(tag):]
        return out

    def finish(self) -> list[tuple[Kind, str]]:
        """The end of the content: release whatever is still held."""
        out: list[tuple[Kind, str]] = []
        pending, self._pending = self._pending, ""
        if self._kind is None:
            self._kind = "text"
            self._release_undecided(out)
        self._emit(pending, out)
        return out

    # -- internals ---------------------------------------------------------------------

    def _next_tag(self, text: str) -> tuple[str | None, int]:
        """The tag that changes state next (the other tag is ordinary text)."""
        if self._kind is None:
            found = [(text.find(t), t) for t in (OPEN_TAG, CLOSE_TAG) if t in text]
            if not found:
                return None, -1
            at, tag = min(found)
            return tag, at
        tag = CLOSE_TAG if self._kind == "reasoning" else OPEN_TAG
        at = text.find(tag)
        return (tag, at) if at >= 0 else (None, -1)

    def _switch(self, tag: str, out: list[tuple[Kind, str]]) -> None:
        if self._kind is None:
            self._kind = "text" if tag == OPEN_TAG else "reasoning"
            self._release_undecided(out)
        self._kind = "reasoning" if tag == OPEN_TAG else "text"

    def _release_undecided(self, out: list[tuple[Kind, str]]) -> None:
        held, self._undecided = "".join(self._undecided), []
        self._emit(held, out)

    def _emit(self, text: str, out: list[tuple[Kind, str]]) -> None:
        if not text:
            return
        if self._kind is None:
            self._undecided.append(text)
        elif out and out[-1][0] == self._kind:
            out[-1] = (self._kind, out[-1][1] + text)
        else:
            out.append((self._kind, text))
