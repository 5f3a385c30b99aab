"""ChatSSEAccumulator: merges upstream Chat Completions chunks into one answer.

Fed one parsed chunk at a time (no I/O), it returns the *pieces* a realtime scheduler may
release at once, and at the end :meth:`ChatSSEAccumulator.seal` validates the terminal and
returns the :class:`~gateway.stream.events.Completion`.

Tool slots are keyed by the upstream ``index``; where an upstream omits ``index``, by
``id``; a delta with neither continues the last slot. A slot is *identified* once it has a
name and an id (an id may also be synthesized at the terminal). ``id`` and ``name`` are
whole values: a repeat is ignored, a different value is an identity change and rejected.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Literal

import orjson

from gateway.errors import GatewayError
from gateway.stream.events import Completion, FinishReason, TokenData, ToolCall, Usage

_FINISH_MAP: dict[str, FinishReason] = {
    "stop": "stop",
    "length": "length",
    "tool_calls": "tool_calls",
    "function_call": "tool_calls",
    "content_filter": "content_filter",
}


def stream_error(code: str, message: str) -> GatewayError:
    """An upstream answer that cannot be relayed as a success (HTTP 502 before commit)."""
    return GatewayError("upstream", code, message)


@dataclass(slots=True)
class ToolSlot:
    """One tool call being assembled."""

    ordinal: int
    id: str | None = None
    name: str | None = None
    parts: list[str] = field(default_factory=list)
    emitted: int = 0  # how many of ``parts`` a scheduler has released

    @property
    def arguments(self) -> str:
        return "".join(self.parts)

    def take_unreleased(self) -> str:
        """The argument text not yet released, marking it released."""
        if self.emitted >= len(self.parts):
            return ""
        text = "".join(self.parts[self.emitted :])
        self.emitted = len(self.parts)
        return text

    @property
    def identified(self) -> bool:
        return self.id is not None and self.name is not None

    def arguments_complete(self) -> bool:
        """True when the arguments already form a JSON object (nothing can follow)."""
        args = self.arguments.rstrip()
        if not args.endswith("}"):
            return False
        return parse_arguments(args) is not None


def parse_arguments(arguments: str) -> dict | None:
    """The arguments as a JSON object, ``{}`` for empty, or None when not an object."""
    if not arguments.strip():
        return {}
    try:
        value = orjson.loads(arguments)
    except orjson.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


@dataclass(frozen=True, slots=True)
class TextPiece:
    kind: Literal["text", "reasoning"]
    text: str


@dataclass(frozen=True, slots=True)
class ToolIdentified:
    slot: ToolSlot


@dataclass(frozen=True, slots=True)
class ToolArgs:
    slot: ToolSlot
    fragment: str


Piece = TextPiece | ToolIdentified | ToolArgs


@dataclass(frozen=True, slots=True)
class ToolRules:
    """What the client declared about tools; checked at the terminal."""

    declared: frozenset[str] = frozenset()
    choice: Literal["auto", "none", "required"] | str = "auto"  # or a tool name
    parallel: bool = True


class ChatSSEAccumulator:
    """Fed the upstream's Chat Completions stream one parsed SSE chunk dict at a time
    (``feed``; the SSE framing and JSON parsing happen in the upstream client): merges the
    deltas, enforces the output-byte budget, validates the terminal (``seal``)."""

    def __init__(self, max_collect_bytes: int = 0, rules: ToolRules | None = None) -> None:
        self.max_collect_bytes = max_collect_bytes
        self.rules = rules or ToolRules()
        self.text_parts: list[str] = []
        self.reasoning_parts: list[str] = []
        self.slots: list[ToolSlot] = []
        self._slot_by_key: dict[tuple[str, object], ToolSlot] = {}
        self.finish_reason: str | None = None
        self.usage: Usage | None = None
        self.saw_done = False
        self.retained_bytes = 0
        self.chunks = 0
        self.sealed_slots: list[ToolSlot] = []  # slots whose id was synthesized at the terminal
        self.token_data: TokenData | None = None  # only when the upstream sent any

    # -- feeding -----------------------------------------------------------------------

    def feed(self, chunk: dict) -> list[Piece]:
        """Merge one upstream chunk; return what may be released now."""
        self.chunks += 1
        if "error" in chunk and chunk["error"]:
            raise upstream_error_frame(chunk["error"])
        usage = chunk.get("usage")
        if usage:
            self.usage = Usage.from_upstream(usage)
        pieces: list[Piece] = []
        for choice in chunk.get("choices") or ():
            if choice.get("index", 0) != 0:
                continue  # n > 1 is refused at the door; ignore strays
            if choice.get("logprobs") or choice.get("token_ids") is not None or chunk.get("prompt_token_ids") is not None:
                if self.token_data is None:
                    self.token_data = TokenData()
                self.token_data.absorb(chunk, choice)
            delta = choice.get("delta") or {}
            reasoning = delta.get("reasoning_content") or delta.get("reasoning")
            if reasoning and isinstance(reasoning, str):
                self._retain(reasoning)
                self.reasoning_parts.append(reasoning)
                pieces.append(TextPiece("reasoning", reasoning))
            content = delta.get("content")
            if content and isinstance(content, str):
                self._retain(content)
                self.text_parts.append(content)
                pieces.append(TextPiece("text", content))
            refusal = delta.get("refusal")
            if refusal and isinstance(refusal, str):
                self._retain(refusal)
                self.text_parts.append(refusal)
                pieces.append(TextPiece("text", refusal))
            for tool_delta in delta.get("tool_calls") or ():
                pieces.extend(self.merge_tool_call_delta(tool_delta))
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return pieces

    def feed_done(self) -> None:
        self.saw_done = True

    def _retain(self, text: str) -> None:
        self.retained_bytes += len(text.encode("utf-8"))
        if self.max_collect_bytes and self.retained_bytes > self.max_collect_bytes:
            raise GatewayError(
                "upstream",
                "response_too_large",
                f"the answer exceeded the output budget of {self.max_collect_bytes} bytes",
            )

    def _slot_for(self, tool_delta: dict) -> ToolSlot:
        index = tool_delta.get("index")
        call_id = tool_delta.get("id") or None
        if index is not None:
            key: tuple[str, object] = ("index", index)
        elif call_id is not None:
            key = ("id", call_id)
        elif self.slots:
            return self.slots[-1]
        else:
            key = ("anonymous", 0)
        slot = self._slot_by_key.get(key)
        if slot is not None and call_id and slot.id and call_id != slot.id:
            name = (tool_delta.get("function") or {}).get("name")
            if name and slot.arguments_complete():
                # Some upstreams reuse index 0 for every parallel call: a new id with a
                # name after a finished argument object is a new call, not a change.
                key = (key[0], (key[1], len(self.slots)))
                slot = None
        if slot is None:
            slot = ToolSlot(ordinal=len(self.slots))
            self.slots.append(slot)
            self._slot_by_key[key] = slot
        return slot

    def merge_tool_call_delta(self, tool_delta: dict) -> list[Piece]:
        """Merge one ``delta.tool_calls[]`` item into its slot."""
        slot = self._slot_for(tool_delta)
        was_identified = slot.identified
        call_id = tool_delta.get("id") or None
        function = tool_delta.get("function") or {}
        name = function.get("name") or None
        if call_id is not None and call_id != slot.id:
            if slot.id is not None:
                raise identity_changed(slot, "id", slot.id, call_id)
            slot.id = call_id
        if name is not None and name != slot.name:
            if slot.name is not None:
                raise identity_changed(slot, "name", slot.name, name)
            slot.name = name
        pieces: list[Piece] = []
        if slot.identified and not was_identified:
            pieces.append(ToolIdentified(slot))
        fragment = function.get("arguments")
        if fragment and isinstance(fragment, str):
            self._retain(fragment)
            slot.parts.append(fragment)
            if was_identified:
                pieces.append(ToolArgs(slot, fragment))
        return pieces

    # -- the terminal ------------------------------------------------------------------

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    @property
    def reasoning(self) -> str:
        return "".join(self.reasoning_parts)

    def seal_tool_identities(self) -> list[ToolSlot]:
        """Give id-less named slots a gateway id; return slots that became identified."""
        sealed = []
        for slot in self.slots:
            if slot.id is None and slot.name is not None:
                slot.id = "call_" + secrets.token_hex(12)
                sealed.append(slot)
        return sealed

    def seal(self) -> Completion:
        """Validate the terminal and return the answer, or raise a GatewayError."""
        if self.finish_reason is None:
            raise stream_error("upstream_incomplete", "the upstream ended without a finish_reason")
        finish = _FINISH_MAP.get(self.finish_reason, "stop")
        self.sealed_slots = self.seal_tool_identities()
        calls = [validate_tool_slot(slot, self.rules) for slot in self.slots]
        check_tool_rules(calls, self.rules)
        if calls and finish == "stop":
            finish = "tool_calls"
        if finish == "tool_calls" and not calls:
            raise stream_error("tool_call_invalid", "finish_reason tool_calls without any tool call")
        if finish == "stop" and not calls and not self.text_parts:
            raise stream_error("empty_response", "the upstream finished without any output")
        return Completion(
            reasoning=self.reasoning,
            text=self.text,
            tool_calls=calls,
            finish_reason=finish,
            usage=self.usage,
            token_data=self.token_data,
        )


def upstream_error_frame(error: object) -> GatewayError:
    message = error.get("message") if isinstance(error, dict) else str(error)
    return stream_error("upstream_error", f"the upstream reported an error: {message}")


def identity_changed(slot: ToolSlot, what: str, old: str, new: str) -> GatewayError:
    return stream_error(
        "tool_identity_changed",
        f"tool call #{slot.ordinal} changed its {what} from {old!r} to {new!r} mid-stream",
    )


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
    assert slot.id is not None
    return ToolCall(id=slot.id, name=slot.name, arguments=slot.arguments)


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
