"""The gateway's output cap held while reading (pure: no I/O).

A key with token limits sends its granted cap upstream in every engine's length field
(gateway/keys/output_cap.py), but an engine may ignore them all. So the chunks of such a
request pass through an :class:`OutputCap` on their way in: it counts the answer's output
(text, reasoning, refusal, tool names and arguments) and, once the count reaches the cap,
trims the chunk that crosses it to what fits, says :attr:`OutputCap.reached`, and hands out
the chunk that ends the answer as ``length``. The reader then stops reading and closes
the upstream; what was read is what the key is charged (the answer's usage is counted
from its text, as for any upstream that reports none).

Counting is cheap until it matters: a token is at least one UTF-8 byte, so while the
answer's bytes stay within the cap no tokenizer runs. Past that, each piece is counted
alone with ``count`` (o200k_base: the counter that charges an answer without usage); the
sum of per-piece counts is at least the count of the joined text (a word cut across two
pieces only costs more), so only when that sum passes the cap is the whole output
counted again, exactly; the piece that crosses is trimmed to the longest prefix that
keeps the joined output within the cap. The answer kept counts exactly the cap, or a
token less when the next character would have started two.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gateway.stream.text_log import TextLog

#: The delta fields whose text is generated output, in the order the accumulator reads
#: them (``reasoning`` only when ``reasoning_content`` is absent, as it reads them).
_TEXT_FIELDS = ("reasoning_content", "reasoning", "content", "refusal")


class OutputCap:
    """Fed each upstream chunk of one answer, in order; see the module docstring."""

    def __init__(self, cap: int, count: Callable[[str], int]) -> None:
        self.cap = cap
        self.count = count
        self.reached = False
        self.tokens = 0  # counted output so far (exact per piece once counting started)
        self._bytes = 0  # UTF-8 bytes of output so far: an upper bound of its tokens
        self._seen = TextLog()  # the output so far (compact: pieces are about a token each)
        self._since = 0  # per-piece counts since ``tokens`` was counted exactly (>= their joined count)
        self._counting = False
        self._last: dict[str, Any] = {}

    @property
    def will_count(self) -> bool:
        """True once the tokenizer is (or may next be) needed: the answer's bytes are near
        the cap. The reader loads the tokenizer off the loop before then."""
        return self._counting or self._bytes * 2 > self.cap

    def feed(self, chunk: dict[str, Any]) -> dict[str, Any]:
        """The chunk as it may pass (trimmed when it crosses the cap; its finish reason
        dropped then, :meth:`finish_chunk` ends the answer)."""
        if self.reached:
            return {}
        self._last = chunk
        choices = chunk.get("choices")
        if not isinstance(choices, list):
            return chunk
        for choice in choices:
            if not isinstance(choice, dict) or (choice.get("index") or 0) != 0:
                continue
            delta = choice.get("delta")
            if isinstance(delta, dict) and self._take_delta(delta):
                out = dict(chunk)
                out["choices"] = [dict(choice, delta=delta, finish_reason=None)]
                return out
        return chunk

    def finish_chunk(self) -> dict[str, Any]:
        """The chunk that ends a cut answer: ``finish_reason: "length"``."""
        head = {k: self._last[k] for k in ("id", "object", "created", "model") if k in self._last}
        return {**head, "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}

    # -- counting ---------------------------------------------------------------------------

    def _take_delta(self, delta: dict[str, Any]) -> bool:
        """Count a delta's pieces, trimming it in place from the one that crosses the cap
        on (the rest of it dropped); True when it did."""
        for name in _TEXT_FIELDS:
            text = delta.get(name)
            if name == "reasoning" and delta.get("reasoning_content"):
                continue  # the same reasoning under two names: the accumulator reads one
            if isinstance(text, str) and text:
                kept = self._take(text)
                if kept is not None:
                    _cut_after(delta, name, kept)
                    return True
        calls = delta.get("tool_calls")
        if isinstance(calls, list):
            for i, call in enumerate(calls):
                function = call.get("function") if isinstance(call, dict) else None
                if isinstance(function, dict) and self._take_function(function):
                    delta["tool_calls"] = [*calls[:i], dict(call, function=function)]
                    delta.pop("function_call", None)
                    return True
        legacy = delta.get("function_call")
        if isinstance(legacy, dict):
            legacy = dict(legacy)
            if self._take_function(legacy):
                delta["function_call"] = legacy
                return True
        return False

    def _take_function(self, function: dict[str, Any]) -> bool:
        """A tool call's name and arguments (an object counted as its JSON); trimmed in
        place when they cross the cap."""
        for name in ("name", "arguments"):
            value = function.get(name)
            if value is None or value == "":
                continue
            text = value if isinstance(value, str) else str(value)
            kept = self._take(text)
            if kept is not None:
                function[name] = kept if isinstance(value, str) else value
                if name == "name":
                    function.pop("arguments", None)
                return True
        return False

    def _take(self, text: str) -> str | None:
        """Count one piece; None when it fits whole, else the prefix of it that fits."""
        if not self._counting:
            self._bytes += len(text.encode("utf-8", "surrogatepass"))
            if self._bytes <= self.cap:
                self._seen.append(text)
                return None
            self._counting = True
            self.tokens = self.count(self._seen.text() + text)
            self._since = 0
            if self.tokens <= self.cap:
                self._seen.append(text)
                return None
        else:
            self._since += self.count(text)
            if self.tokens + self._since <= self.cap:  # an upper bound: no exact count needed
                self._seen.append(text)
                return None
            self.tokens, self._since = self.count(self._seen.text() + text), 0
            if self.tokens <= self.cap:
                self._seen.append(text)
                return None
        before = self._seen.text()
        kept = self._prefix_within(before, text)
        self.tokens = self.count(before + kept)
        self.reached = True
        return kept

    def _prefix_within(self, before: str, text: str) -> str:
        """The longest prefix of ``text`` that keeps ``before`` + it within the cap."""
        low, high = 0, len(text)  # count(before + text[:low]) <= cap < count(before + text[:high + 1])
        while low < high:
            mid = (low + high + 1) // 2
            if self.count(before + text[:mid]) <= self.cap:
                low = mid
            else:
                high = mid - 1
        return text[:low]


def _cut_after(delta: dict[str, Any], name: str, kept: str) -> None:
    """Keep ``kept`` in field ``name`` and drop every output field after it in the delta."""
    delta[name] = kept
    if name == "reasoning_content" and isinstance(delta.get("reasoning"), str):
        delta["reasoning"] = kept
    after = _TEXT_FIELDS[_TEXT_FIELDS.index(name) + 1:]
    after = tuple(f for f in after if f != "reasoning")
    for later in (*after, "tool_calls", "function_call"):
        delta.pop(later, None)
