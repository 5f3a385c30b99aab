"""The engine's raw completion text -> Chat Completions deltas: text, and tool calls in the
Hermes / Qwen format (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``), pure.

Fed the text one engine delta at a time (:meth:`HermesParser.feed`), it returns the deltas
to emit: ``{"content": ...}`` for text (``<think>`` tags stay in it: the accumulator splits
them per the reasoning-tags setting, as for any upstream), ``{"tool_calls": [...]}`` for a
call once its closing tag arrived (one delta per call, with its id, name and arguments as a
JSON string). Text that may be the start of a tag is held until it is not. A call whose
JSON cannot be read keeps its raw text as the arguments when a name can still be found
(repair and validation judge it as any other answer's), else it is text.
"""

from __future__ import annotations

import json
import re
import secrets
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_NAME = re.compile(r'"name"\s*:\s*"([^"]+)"')
_ARGUMENTS = re.compile(r'"(?:arguments|parameters)"\s*:\s*')


def tag_start_held(text: str, tag: str) -> int:
    """How many trailing characters of ``text`` may begin ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class HermesParser:
    def __init__(self, first_index: int = 0) -> None:
        """``first_index``: the index of the first call (after calls said before: a
        continuation of a cut answer)."""
        self._buffer = ""
        self._in_call = False
        self._calls = first_index
        self._pending_space = ""  # white space between tool calls, emitted only before text

    @property
    def calls(self) -> int:
        return self._calls

    def feed(self, text: str) -> list[dict[str, Any]]:
        self._buffer += text
        out: list[dict[str, Any]] = []
        while True:
            if self._in_call:
                end = self._buffer.find(CLOSE)
                if end < 0:
                    return out
                out.append(self._call(self._buffer[:end]))
                self._buffer = self._buffer[end + len(CLOSE) :]
                self._in_call = False
                continue
            start = self._buffer.find(OPEN)
            if start >= 0:
                self._text(self._buffer[:start], out, before_call=True)
                self._buffer = self._buffer[start + len(OPEN) :]
                self._in_call = True
                continue
            keep = tag_start_held(self._buffer, OPEN)
            self._text(self._buffer[: len(self._buffer) - keep], out)
            self._buffer = self._buffer[len(self._buffer) - keep :]
            return out

    def finish(self) -> list[dict[str, Any]]:
        """What is left at the end of the completion: held text, or an unclosed call
        (a completion cut by its length: its JSON decides whether it is a call)."""
        out: list[dict[str, Any]] = []
        rest, self._buffer = self._buffer, ""
        if self._in_call:
            self._in_call = False
            delta = self._call(rest, closed=False)
            if delta is not None:
                out.append(delta)
            else:
                self._text(OPEN + rest, out)
        else:
            self._text(rest, out)
        return out

    def _text(self, text: str, out: list[dict[str, Any]], before_call: bool = False) -> None:
        if not text:
            return
        if self._calls and not text.strip():  # between or after calls: the template's layout
            self._pending_space += text
            return
        if before_call and not text.strip():
            return
        text, self._pending_space = self._pending_space + text, ""
        out.append({"content": text})

    def _call(self, raw: str, closed: bool = True) -> Any:
        name, arguments = None, None
        try:
            value = json.loads(raw)
        except ValueError:
            value = None
        if isinstance(value, dict) and isinstance(value.get("name"), str):
            name = value["name"]
            args = value.get("arguments", value.get("parameters", {}))
            arguments = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        elif closed:
            found = _NAME.search(raw)
            start = _ARGUMENTS.search(raw)
            if found and start:  # unreadable JSON: the raw arguments, for repair to judge
                rest = raw[start.end() :].rstrip()
                name, arguments = found.group(1), rest[:-1].rstrip() if rest.endswith("}") else rest
        if name is None:
            if closed:
                return {"content": OPEN + raw + CLOSE}
            return None
        index, self._calls = self._calls, self._calls + 1
        return {"tool_calls": [{"index": index, "id": "call_" + secrets.token_hex(12), "type": "function",
                                "function": {"name": name, "arguments": arguments}}]}
