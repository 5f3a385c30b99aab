"""The seam of a continued answer (issue #35): what the engine writes after a cut, as raw
text, turned into deltas that go on from where the cut answer stopped.

A continuation (through token-in, or through chat with a Hermes / Qwen markup prefill)
makes the engine write raw text from the cut on: the rest of the reasoning then
``</think>``, or the rest of a tool call's arguments then ``}`` and ``</tool_call>``, then
whatever follows. :class:`CutTail` is fed that text one engine delta at a time and
returns the deltas to emit: ``reasoning_content`` up to ``</think>``; the cut call's
``arguments`` (same ``index``, no new id or name) up to the end of its JSON value; after
that, everything through :class:`~gateway.upstream.hermes.HermesParser` (text, the next
tool calls, numbered after the ones said). So the client's tool call is one call whose
arguments are the arguments so far plus exactly what the engine wrote: valid JSON when
the engine writes it so. Pure; the same interface as ``HermesParser`` (``feed``,
``finish``, ``calls``), so :class:`~gateway.upstream.token_in.EngineStream` takes it.
"""

from __future__ import annotations

from typing import Any

from gateway.upstream.hermes import CLOSE, HermesParser, tag_start_held

THINK_CLOSE = "</think>"
TEXT, REASONING, TOOL_CALL = "text", "reasoning", "tool_call"


class JsonValueEnd:
    """Where a JSON value written piece by piece ends (string-aware brace depth)."""

    def __init__(self) -> None:
        self.depth = 0
        self.started = False
        self.in_string = False
        self.escaped = False

    def feed(self, text: str) -> int | None:
        """The offset in ``text`` just past the value's end, None while it goes on."""
        for at, ch in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
                    if self.depth == 0:
                        return at + 1  # a string value
                continue
            if ch == '"':
                self.in_string, self.started = True, True
            elif ch in "{[":
                self.depth, self.started = self.depth + 1, True
            elif ch in "}]":
                self.depth -= 1
                if self.depth <= 0:
                    return at + 1
            elif not ch.isspace():
                self.started = True
        return None


class CutTail:
    """A cut answer's continuation: raw engine text -> the deltas that follow the cut."""

    def __init__(self, kind: str, calls_said: int = 0, arguments_so_far: str = "") -> None:
        """``kind``: what the cut was inside (``text``, ``reasoning``, ``tool_call``);
        ``calls_said``: tool calls the answer began before the cut (the cut one included);
        ``arguments_so_far``: the cut call's arguments as sent."""
        self.state = kind
        self.cut_index = calls_said - 1
        self.rest = HermesParser(first_index=calls_said)
        self._held = ""
        self._value = JsonValueEnd()
        if kind == TOOL_CALL and self._value.feed(arguments_so_far) is not None:
            self.state = "closing"  # the arguments were whole already: only the tags are left
        self._after_think = False

    @property
    def calls(self) -> int:
        return self.rest.calls

    def parsed_upstream(self) -> None:
        """The engine sent reasoning parsed (its reasoning parser reads a prefill's open
        ``<think>`` as reasoning on its own): its text is then the answer's text."""
        if self.state == REASONING:
            self.state, self._held = TEXT, ""

    def feed(self, text: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        text = self._held + text
        self._held = ""
        while text:
            if self.state == REASONING:
                end = text.find(THINK_CLOSE)
                if end < 0:
                    keep = tag_start_held(text, THINK_CLOSE)
                    text, self._held = text[: len(text) - keep], text[len(text) - keep :]
                    if text:
                        out.append({"reasoning_content": text})
                    return out
                if end:
                    out.append({"reasoning_content": text[:end]})
                text, self.state, self._after_think = text[end + len(THINK_CLOSE) :], TEXT, True
            elif self.state == TOOL_CALL:
                end = self._value.feed(text)
                piece = text if end is None else text[:end]
                if piece:
                    out.append({"tool_calls": [{"index": self.cut_index, "function": {"arguments": piece}}]})
                if end is None:
                    return out
                text, self.state = text[end:], "closing"
            elif self.state == "closing":  # the call object's "}" and </tool_call>: not said
                end = text.find(CLOSE)
                if end < 0:
                    keep = tag_start_held(text, CLOSE)
                    self._held = text[len(text) - keep :] if keep else ""
                    return out
                text, self.state = text[end + len(CLOSE) :], TEXT
            else:
                if self._after_think:  # the template's blank line after </think>
                    text = text.lstrip("\n")
                    if not text:
                        return out
                    self._after_think = False
                out += self.rest.feed(text)
                return out
        return out

    def finish(self) -> list[dict[str, Any]]:
        """What is left at the end: held text (a tag that never closed is dropped)."""
        held, self._held = self._held, ""
        if self.state == REASONING and held:
            return [{"reasoning_content": held}]
        if self.state == TEXT:
            return self.rest.feed(held) + self.rest.finish() if held else self.rest.finish()
        return []
