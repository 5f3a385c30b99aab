"""What a call's engine legs said so far (issue #35), fed one chat chunk at a time: the
reasoning, text and tool calls, the token ids when the engine sent them, and whether the
last leg ended in an abort the gateway continues. Pure; the shell is
:mod:`gateway.engines.continuation`.

From it, the next leg's request: with token ids (``--capture-tokens vllm``), the prompt
ids plus the completion ids so far for the engine's token-in endpoint (exactly what was
sampled: nothing re-tokenized); without, the call's chat request with the answer so far as
an assistant prefill (vLLM ``continue_final_message``). A text answer is prefilled as its
text; a cut reasoning or tool call as the Hermes / Qwen markup the model wrote it in
(``<think>`` + the reasoning so far; the calls before, then ``<tool_call>\\n{"name": ...,
"arguments": `` + the arguments so far), so the engine goes on inside it and
:class:`~gateway.engines.seam.CutTail` reads what comes back.
"""

from __future__ import annotations

import json
from typing import Any

from gateway.engines.seam import REASONING, TEXT, TOOL_CALL, CutTail

ABORT = "abort"
#: Continuations of one call at most (each after an abort): a bound on a flapping engine.
MAX_CONTINUATIONS = 8


def _choice(chunk: dict[str, Any]) -> dict[str, Any]:
    choices = chunk.get("choices") if isinstance(chunk.get("choices"), list) else []
    return choices[0] if choices and isinstance(choices[0], dict) else {}


class PartialAnswer:
    """One call's answer over its engine legs (see the module)."""

    def __init__(self) -> None:
        # pieces, joined only when a continuation needs them (a str grown by += per chunk
        # is copied whole each time: quadratic in a long answer)
        self._reasoning: list[str] = []
        self._text: list[str] = []
        self.calls: dict[int, dict[str, str]] = {}  # index -> id, name, arguments
        self.kind: str | None = None  # what the answer was inside at its last output
        self.blocked: str | None = None  # why this answer cannot be continued
        self.aborted = False  # the current leg ended in an abort that will be continued
        self.legs = 0  # continuations sent so far
        self.earlier_usage: dict[str, Any] | None = None  # the aborted legs' usage, summed
        self.prompt_ids: list[int] | None = None  # the first leg's, when the engine sent them
        self.completion_ids: list[int] | None = []  # None once output came without ids

    def feed(self, chunk: dict[str, Any]) -> dict[str, Any] | None:
        """The chunk to pass on (None: held back): an abort to continue is taken out of its
        chunk; a continuation leg's role and prompt token ids are dropped (the client and
        the record have them from the first leg); its usage counts every leg."""
        if self.aborted:  # after a continued abort: its usage is kept, nothing else passes
            self._keep_usage(chunk.get("usage"))
            return None
        choice = _choice(chunk)
        delta = choice.get("delta") if isinstance(choice.get("delta"), dict) else {}
        self._note(chunk, choice, delta)
        if choice.get("finish_reason") == ABORT and self.blocked is None and self.legs < MAX_CONTINUATIONS:
            self.aborted = True
            self._keep_usage(chunk.get("usage"))
            kept = {k: v for k, v in delta.items() if v}
            if not kept or set(kept) == {"role"}:
                return None
            rest = {k: v for k, v in chunk.items() if k != "usage"}
            return {**rest, "choices": [{**choice, "finish_reason": None}]}
        if self.legs:
            chunk = self._as_continued(chunk, choice, delta)
        return chunk

    def _note(self, chunk: dict[str, Any], choice: dict[str, Any], delta: dict[str, Any]) -> None:
        if not self.legs and self.prompt_ids is None and isinstance(chunk.get("prompt_token_ids"), list):
            self.prompt_ids = [int(t) for t in chunk["prompt_token_ids"]]
        if choice.get("index", 0) != 0:
            self.blocked = "choices"  # n > 1: one answer per call is continued
        said = False
        for key, value in delta.items():  # one pass: a delta has one or two keys
            if not value or key == "role":
                continue
            if key == "content" and isinstance(value, str):
                self._text.append(value)
                self._into(TEXT)
            elif key in ("reasoning_content", "reasoning") and isinstance(value, str):
                self._reasoning.append(value)
                self._into(REASONING)
            elif key == "tool_calls" and isinstance(value, list):
                for call in value:
                    if isinstance(call, dict):
                        self._call(call)
            else:
                continue
            said = True
        ids = choice.get("token_ids")
        if isinstance(ids, list):
            if self.completion_ids is not None:
                self.completion_ids += [int(t) for t in ids]
        elif said:
            self.completion_ids = None

    @property
    def text(self) -> str:
        """The answer's text so far."""
        return "".join(self._text)

    @property
    def reasoning(self) -> str:
        """The answer's reasoning so far."""
        return "".join(self._reasoning)

    def _into(self, kind: str) -> None:
        if kind == self.kind:
            return
        if kind != TOOL_CALL and self.calls:
            self.blocked = self.blocked or "text_after_tool_call"
        if kind == REASONING and self._text:
            self.blocked = self.blocked or "reasoning_after_text"
        self.kind = kind

    def _call(self, call: dict[str, Any]) -> None:
        index = call.get("index") if isinstance(call.get("index"), int) else len(self.calls)
        slot = self.calls.setdefault(index, {"id": "", "name": "", "arguments": ""})
        function = call.get("function") if isinstance(call.get("function"), dict) else {}
        slot["id"] = slot["id"] or str(call.get("id") or "")
        slot["name"] += str(function.get("name") or "")
        slot["arguments"] += str(function.get("arguments") or "")
        if index != max(self.calls):
            self.blocked = self.blocked or "interleaved_tool_calls"
        self.kind = TOOL_CALL

    def _keep_usage(self, usage: Any) -> None:
        if isinstance(usage, dict):
            self.earlier_usage = summed(self.earlier_usage, usage)

    def _as_continued(self, chunk: dict[str, Any], choice: dict[str, Any], delta: dict[str, Any]) -> dict[str, Any]:
        out = {k: v for k, v in chunk.items() if k != "prompt_token_ids"}
        if "role" in delta:
            out["choices"] = [{**choice, "delta": {k: v for k, v in delta.items() if k != "role"}}]
        if isinstance(chunk.get("usage"), dict) and self.earlier_usage is not None:
            out["usage"] = summed(self.earlier_usage, chunk["usage"])
        return out

    # -- the next leg ---------------------------------------------------------------------

    def next_leg(self) -> None:
        self.aborted, self.legs = False, self.legs + 1

    def token_prompt(self) -> list[int] | None:
        """The next leg's token-in prompt: the prompt ids plus every completion id so far
        (None: the engine did not send them all)."""
        if self.prompt_ids is None or not self.completion_ids:
            return None  # nothing sampled yet: the same request again
        return self.prompt_ids + list(self.completion_ids or [])

    def tail(self) -> CutTail:
        """The reader of the next leg's raw text (token-in, or a markup prefill)."""
        if self.kind == TOOL_CALL:
            cut = self.calls[max(self.calls)]
            return CutTail(TOOL_CALL, len(self.calls), cut["arguments"])
        return CutTail(REASONING if self.kind == REASONING else TEXT, len(self.calls))

    def markup(self) -> str:
        """The answer so far as the model wrote it (Hermes / Qwen): reasoning in
        ``<think>``, the text, each call; the cut part left open."""
        out = ""
        if self.reasoning:
            out += "<think>" + self.reasoning + ("" if self.kind == REASONING else "</think>")
        out += self.text
        for index in sorted(self.calls):
            call = self.calls[index]
            out += "<tool_call>\n{\"name\": " + json.dumps(call["name"]) + ", \"arguments\": " + call["arguments"]
            if index != max(self.calls) or self.kind != TOOL_CALL:
                out += "}\n</tool_call>"
        return out

    def continuation_body(self, body: dict[str, Any]) -> dict[str, Any]:
        """The next leg's chat request: the call's own, with the answer so far as an
        assistant prefill the engine continues (a client's own prefill grows by it)."""
        if self.kind is None:  # nothing said yet: the same request again
            return body
        prefill = self.text if self.kind == TEXT and not self._reasoning and not self.calls else self.markup()
        messages = list(body.get("messages") or [])
        last = messages[-1] if messages and isinstance(messages[-1], dict) else None
        if last is not None and last.get("role") == "assistant" and isinstance(last.get("content"), str):
            messages[-1] = {**last, "content": last["content"] + prefill}
        else:
            messages.append({"role": "assistant", "content": prefill})
        return {**body, "messages": messages, "continue_final_message": True, "add_generation_prompt": False}

    def needs_tail(self) -> bool:
        """Whether a chat continuation's text must be read through :meth:`tail` (a markup
        prefill: the engine's parsers never saw its opening tag)."""
        return self.kind is not None and (self.kind != TEXT or bool(self._reasoning) or bool(self.calls))


def summed(first: dict[str, Any] | None, then: dict[str, Any]) -> dict[str, Any]:
    """Usage over legs: the first leg's prompt, every leg's completion."""
    if first is None:
        return dict(then)
    prompt = first.get("prompt_tokens", 0)
    completion = int(first.get("completion_tokens") or 0) + int(then.get("completion_tokens") or 0)
    return {**then, "prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": int(prompt or 0) + completion}
