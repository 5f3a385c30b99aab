"""ChatSSEAccumulator: merges upstream Chat Completions chunks into one answer.

Fed one parsed chunk at a time (no I/O), it returns the *pieces* a realtime scheduler may
release at once, and at the end :meth:`ChatSSEAccumulator.seal` validates the terminal and
returns the :class:`~gateway.stream.events.Completion`.

Tool-call deltas are merged into slots by :class:`~gateway.stream.tool_calls.ToolCallMerger`
(keying, identity, object-valued arguments, legacy ``function_call``, thought signatures),
which the accumulator feeds and whose slots it validates at the terminal.

What real servers send differently is normalised here, once for every room:

- usage is read wherever it appears (top level, ``choices[i].usage``, ``x_groq.usage``,
  on the finish chunk); each report is a running total, so the last one wins;
- finish reasons outside the enum: ``eos``/``eos_token``/``end_turn`` -> ``stop``,
  ``tool_call``/``function_call``/``tool_use`` -> ``tool_calls``, ``max_tokens`` ->
  ``length``; ``""`` is "not yet" (a stream that then ends with ``[DONE]`` is complete);
  ``error`` is a failure;
- an explicit ``null`` is the same as an absent field, everywhere.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from gateway.errors import GatewayError
from gateway.stream.events import (
    Completion,
    FinishReason,
    TokenData,
    ToolCall,
    Usage,
    routed_experts_of,
)
from gateway.stream.signatures import Seal
from gateway.stream.text_log import AnswerText
from gateway.stream.think_tags import Start, ThinkTagSplitter
from gateway.stream.tool_calls import (
    ToolArgs,
    ToolCallMerger,
    ToolIdentified,
    ToolSlot,
    object_or_empty,
    parse_arguments,
)

__all__ = [  # the tool-call names are re-exported: the rooms and the scheduler import them from here
    "ChatSSEAccumulator", "FINISH_MAP", "LogprobsPiece", "Piece", "TextPiece", "ToolArgs", "ToolIdentified", "ToolRules",
    "ToolSlot", "UsageEstimator", "parse_arguments", "stream_error",
]

#: Upstream finish reasons (lower-cased) -> the canonical terminal. Anything else not
#: listed here is a normal end (``stop``); ``error`` is handled as a failure.
FINISH_MAP: dict[str, FinishReason] = {
    "stop": "stop",
    "eos": "stop",
    "eos_token": "stop",
    "end_turn": "stop",
    "stop_sequence": "stop",
    "length": "length",
    "max_tokens": "length",
    "tool_calls": "tool_calls",
    "tool_call": "tool_calls",
    "function_call": "tool_calls",
    "tool_use": "tool_calls",
    "content_filter": "content_filter",
}

UsageEstimator = Callable[[Completion], Usage]


def stream_error(code: str, message: str) -> GatewayError:
    """An upstream answer that cannot be relayed as a success (HTTP 502 before commit)."""
    return GatewayError("upstream", code, message)


@dataclass(frozen=True, slots=True)
class TextPiece:
    kind: Literal["text", "reasoning", "refusal"]
    text: str


@dataclass(frozen=True, slots=True)
class LogprobsPiece:
    """One chunk's ``logprobs.content`` entries, released just before that chunk's output."""

    entries: tuple[dict, ...]


Piece = TextPiece | ToolIdentified | ToolArgs | LogprobsPiece


@dataclass(frozen=True, slots=True)
class ToolRules:
    """What the client declared about tools; checked at the terminal."""

    declared: frozenset[str] = frozenset()
    choice: Literal["auto", "none", "required"] | str = "auto"  # or a tool name
    parallel: bool = True


def validated_terminal(finish_reason: str | None, slots: list[ToolSlot], rules: ToolRules,
                       has_output: bool) -> tuple[FinishReason, list[ToolCall]]:
    """The answer's finish and its validated tool calls, or the GatewayError that says why
    the terminal is not a complete answer (no finish_reason, a tool call that is not one,
    ``tool_calls`` without any, nothing at all)."""
    if finish_reason is None:
        raise stream_error("upstream_incomplete", "the upstream ended without a finish_reason")
    finish = FINISH_MAP.get(finish_reason, "stop")
    calls = [validate_tool_slot(slot, rules) for slot in slots]
    check_tool_rules(calls, rules)
    if calls and finish == "stop":
        finish = "tool_calls"
    if finish == "tool_calls" and not calls:
        raise stream_error("tool_call_invalid", "finish_reason tool_calls without any tool call")
    if finish == "stop" and not calls and not has_output:
        raise stream_error("empty_response", "the upstream finished without any output")
    return finish, calls


class ChatSSEAccumulator:
    """Fed the upstream's Chat Completions stream one parsed SSE chunk dict at a time
    (``feed``; the SSE framing and JSON parsing happen in the upstream client): merges the
    deltas, enforces the output-byte budget, validates the terminal (``seal``).

    ``reasoning_tags`` (opt-in per model) splits ``<think>`` tags out of content;
    ``estimate_usage`` gives the usage of an answer whose upstream reported none (the
    one rule for every room, see docs/upstreams.md).
    """

    def __init__(
        self,
        max_collect_bytes: int = 0,
        rules: ToolRules | None = None,
        reasoning_tags: Start | None = None,
        estimate_usage: UsageEstimator | None = None,
        seal_signature: Seal | None = None,
    ) -> None:
        self.max_collect_bytes = max_collect_bytes
        self.rules = rules or ToolRules()
        # the output so far, held compactly (a token-sized piece is not an object of its own)
        self.output = AnswerText()
        #: the answer once :meth:`seal` validated it; the raw pieces are released then (the
        #: completion holds the answer once: ``text`` and ``reasoning`` read it from there)
        self.sealed: Completion | None = None
        self.tools = ToolCallMerger(seal_signature)
        self.finish_reason: str | None = None
        self._empty_finish = False  # saw finish_reason "" (some servers' "not yet")
        self.usage: Usage | None = None
        self.usage_estimated = False
        self.saw_done = False
        self.retained_bytes = 0
        self.chunks = 0
        self.sealed_slots: list[ToolSlot] = []  # slots whose id was synthesized at the terminal
        self.token_data: TokenData | None = None  # only when the upstream sent any
        self.stop_sequence: str | None = None  # the matched stop string, when the upstream names it
        self._splitter = ThinkTagSplitter(reasoning_tags) if reasoning_tags else None
        self._estimate_usage = estimate_usage

    # -- feeding -----------------------------------------------------------------------

    def feed(self, chunk: dict) -> list[Piece]:
        """Merge one upstream chunk; return what may be released now."""
        self.chunks += 1
        if chunk.get("error"):
            raise upstream_error_frame(chunk["error"])
        self._take_usage(chunk.get("usage"))
        self._take_usage(object_or_empty(chunk.get("x_groq")).get("usage"))
        pieces: list[Piece] = []
        for choice in chunk.get("choices") or ():
            if not isinstance(choice, dict) or (choice.get("index") or 0) != 0:
                continue  # n > 1 is refused at the door; ignore strays
            self._take_usage(choice.get("usage"))
            if (choice.get("logprobs") or choice.get("token_ids") is not None or chunk.get("prompt_token_ids") is not None
                    or routed_experts_of(chunk, choice) is not None):
                if self.token_data is None:
                    self.token_data = TokenData()
                self.token_data.absorb(chunk, choice)
            logprobs = object_or_empty(choice.get("logprobs")).get("content")
            if logprobs and isinstance(logprobs, list):  # before the output they score: a room
                pieces.append(LogprobsPiece(tuple(e for e in logprobs if isinstance(e, dict))))  # attaches them to it
            delta = object_or_empty(choice.get("delta"))
            # reasoning first when one delta carries both (it was thought before it was said)
            reasoning = delta.get("reasoning_content") or delta.get("reasoning")
            if reasoning and isinstance(reasoning, str):
                self._add_text("reasoning", reasoning, pieces)
            content = delta.get("content")
            if content and isinstance(content, str):
                if self._splitter is not None:
                    for kind, text in self._splitter.feed(content):
                        self._add_text(kind, text, pieces)
                else:
                    self._add_text("text", content, pieces)
            refusal = delta.get("refusal")
            if refusal and isinstance(refusal, str):
                self._add_text("refusal", refusal, pieces)
            if delta.get("tool_calls") or delta.get("function_call") is not None:
                pieces.extend(self.tools.feed(delta, self._retain))
            finish = choice.get("finish_reason")
            if isinstance(finish, str):
                self._take_finish(finish)
                self._take_stop_sequence(choice)
                if self.finish_reason is not None:
                    pieces.extend(self._flush_splitter())
        return pieces

    def feed_done(self) -> None:
        self.saw_done = True

    def _take_usage(self, raw: object) -> None:
        if isinstance(raw, dict) and raw:
            self.usage = Usage.from_upstream(raw)

    def _take_stop_sequence(self, choice: dict) -> None:
        """vLLM's ``stop_reason`` and SGLang's ``matched_stop`` name the stop string that
        ended the answer (an integer there is a stop *token*, not a client sequence)."""
        for key in ("stop_reason", "matched_stop"):
            value = choice.get(key)
            if isinstance(value, str) and value:
                self.stop_sequence = value
                return

    def _take_finish(self, finish: str) -> None:
        value = finish.strip().lower()
        if not value:
            self._empty_finish = True
            return
        if value == "error":
            raise stream_error("upstream_error", "the upstream finished with finish_reason 'error'")
        self.finish_reason = value

    def _add_text(self, kind: Literal["text", "reasoning", "refusal"], text: str, pieces: list[Piece]) -> None:
        self._retain(text)
        self.output.add(kind, text)
        pieces.append(TextPiece(kind, text))

    def _flush_splitter(self) -> list[Piece]:
        """Release what the ``<think>`` splitter still holds (the content has ended)."""
        pieces: list[Piece] = []
        if self._splitter is not None:
            for kind, text in self._splitter.finish():
                self._add_text(kind, text, pieces)
            self._splitter = None
        return pieces

    def _retain(self, text: str) -> None:
        self.retained_bytes += len(text.encode("utf-8"))
        if self.max_collect_bytes and self.retained_bytes > self.max_collect_bytes:
            raise GatewayError(
                "upstream",
                "response_too_large",
                f"the answer exceeded the output budget of {self.max_collect_bytes} bytes",
            )

    # -- the terminal ------------------------------------------------------------------

    @property
    def text(self) -> str:
        return self.sealed.text if self.sealed is not None else self.output.text("text")

    @property
    def reasoning(self) -> str:
        return self.sealed.reasoning if self.sealed is not None else self.output.text("reasoning")

    def text_range(self, kind: str, start: int, end: int) -> str:
        """Characters ``start`` to ``end`` of the output of ``kind`` (``text``, ``reasoning``,
        ``refusal``): the very string when that is all of it once sealed, else a copy of
        the range only."""
        if self.sealed is not None:
            whole = {"reasoning": self.sealed.reasoning, "refusal": self.sealed.refusal}.get(kind, self.sealed.text)
            return whole[start:end]
        return self.output.range(kind, start, end)

    def arrived(self) -> tuple[list[str], ...]:
        """What the upstream produced so far, as text, reasoning and tool-argument parts not
        yet joined (references, no copy: the raw pieces, or once sealed the answer's own
        strings); a request that ends without usage is charged their count."""
        if self.sealed is not None:
            c = self.sealed
            return ([c.text], [c.reasoning], *([call.arguments] for call in c.tool_calls))
        logs = self.output.logs
        return (logs["text"].chunks(), logs["reasoning"].chunks(), *(s.parts for s in self.tools.slots))

    @property
    def slots(self) -> list[ToolSlot]:
        """The tool calls so far, in the order they began."""
        return self.tools.slots

    def seal(self) -> Completion:
        """Validate the terminal and return the answer, or raise a GatewayError. Once valid,
        the raw pieces are released: the answer is held once, as the completion's strings."""
        if self.sealed is not None:
            return self.sealed
        self._flush_splitter()  # realtime released it on the finish chunk already
        if self.finish_reason is None and self._empty_finish and self.saw_done:
            self.finish_reason = "stop"  # "" all along, then [DONE]: a complete answer
        self.sealed_slots = self.tools.seal_identities()
        finish, calls = validated_terminal(self.finish_reason, self.tools.slots, self.rules,
                                           bool(self.output.logs["text"] or self.output.logs["refusal"]))
        completion = Completion(
            reasoning=self.reasoning,
            text=self.text,
            tool_calls=calls,
            finish_reason=finish,
            usage=self.usage,
            token_data=self.token_data,
            spans=tuple((kind, start, end) for kind, start, end in self.output.spans),
            stop_sequence=self.stop_sequence if finish == "stop" else None,
            refusal=self.output.text("refusal"),
        )
        if completion.usage is None and self._estimate_usage is not None:
            completion.usage = self._estimate_usage(completion)
            self.usage_estimated = True
        self.sealed = completion
        self.output = AnswerText()
        return completion


def upstream_error_frame(error: object) -> GatewayError:
    message = error.get("message") if isinstance(error, dict) else str(error)
    return stream_error("upstream_error", f"the upstream reported an error: {message}")


def validate_tool_slot(slot: ToolSlot, rules: ToolRules) -> ToolCall:
    """One slot as a valid ToolCall, or a ``tool_call_invalid`` error naming the fault."""
    if slot.name is None:
        raise stream_error("tool_call_invalid", f"tool call #{slot.ordinal} has no name")
    if rules.declared and slot.name not in rules.declared:
        raise stream_error(
            "tool_call_invalid", f"tool call #{slot.ordinal} names undeclared tool {slot.name!r}"
        )
    if parse_arguments(slot.arguments) is None:
        raise stream_error(
            "tool_call_invalid",
            f"arguments of tool call #{slot.ordinal} ({slot.name}) are not a JSON object",
        )
    assert slot.client_id is not None
    return ToolCall(id=slot.client_id, name=slot.name, arguments=slot.arguments, thought_signature=slot.thought_signature)


def check_tool_rules(calls: list[ToolCall], rules: ToolRules) -> None:
    """Unique ids, tool_choice and parallel_tool_calls honoured."""
    ids = [c.id for c in calls]
    if len(set(ids)) != len(ids):
        raise stream_error("tool_call_invalid", "two tool calls share one id")
    if rules.choice == "none" and calls:
        raise stream_error("tool_call_invalid", "tool_choice is none but the model called a tool")
    if rules.choice == "required" and not calls:
        raise stream_error("tool_call_invalid", "tool_choice requires a tool call but none came")
    if rules.choice not in ("auto", "none", "required"):
        wrong = [c.name for c in calls if c.name != rules.choice]
        if not calls or wrong:
            raise stream_error(
                "tool_call_invalid", f"tool_choice names {rules.choice!r} but the model did not call it"
            )
    if not rules.parallel and len(calls) > 1:
        raise stream_error(
            "tool_call_invalid", f"parallel tool calls are disabled but the model made {len(calls)}"
        )
