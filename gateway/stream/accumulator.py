"""ChatSSEAccumulator: merges upstream Chat Completions chunks into one answer.

Fed one parsed chunk at a time (no I/O), it returns the *pieces* a realtime scheduler may
release at once, and at the end :meth:`ChatSSEAccumulator.seal` validates the terminal and
returns the :class:`~gateway.stream.events.Completion`.

Tool slots are keyed by the upstream ``index``; where an upstream omits ``index``, by
``id``; a delta with neither continues the last slot. A slot is *identified* once it has a
name and an id (an id may also be synthesized at the terminal). ``id`` and ``name`` are
whole values: a repeat is ignored, a different value is an identity change and rejected.

What real servers send differently is normalised here, once for every room:

- ``arguments`` as a JSON *object* (llama.cpp) is serialised once, as one fragment (a
  repeat of the same object is ignored);
- usage is read wherever it appears (top level, ``choices[i].usage``, ``x_groq.usage``,
  on the finish chunk); each report is a running total, so the last one wins;
- finish reasons outside the enum: ``eos``/``eos_token``/``end_turn`` -> ``stop``,
  ``tool_call``/``function_call``/``tool_use`` -> ``tool_calls``, ``max_tokens`` ->
  ``length``; ``""`` is "not yet" (a stream that then ends with ``[DONE]`` is complete);
  ``error`` is a failure;
- a legacy ``function_call`` delta is a call only when the stream sends no ``tool_calls``
  (llama-cpp-python sends both on every chunk: the call is counted once);
- an explicit ``null`` is the same as an absent field, everywhere;
- Gemini's ``extra_content.google.thought_signature`` on a call is kept on its slot.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import orjson

from gateway.errors import GatewayError
from gateway.stream.events import Completion, FinishReason, Segment, TokenData, ToolCall, Usage
from gateway.stream.signatures import client_call_id
from gateway.stream.think_tags import Start, ThinkTagSplitter

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


@dataclass(slots=True)
class ToolSlot:
    """One tool call being assembled."""

    ordinal: int
    id: str | None = None
    name: str | None = None
    parts: list[str] = field(default_factory=list)
    emitted: int = 0  # how many of ``parts`` a scheduler has released
    thought_signature: str | None = None  # Gemini's, sent back with this call next turn
    shown_id: str | None = None  # the id a client has already been shown (realtime)
    announced: bool = False  # handed to the scheduler (ToolIdentified)

    @property
    def client_id(self) -> str | None:
        """The id clients see: the upstream's, carrying its thought signature (once shown,
        it never changes; a signature arriving after that is not carried)."""
        if self.shown_id is not None or self.id is None:
            return self.shown_id or self.id
        return client_call_id(self.id, self.thought_signature)

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
    ) -> None:
        self.max_collect_bytes = max_collect_bytes
        self.rules = rules or ToolRules()
        self.text_parts: list[str] = []
        self.reasoning_parts: list[str] = []
        self.segments: list[Segment] = []  # reasoning/text runs in the upstream's order
        self.slots: list[ToolSlot] = []
        self._slot_by_key: dict[tuple[str, object], ToolSlot] = {}
        self.finish_reason: str | None = None
        self._empty_finish = False  # saw finish_reason "" (some servers' "not yet")
        self._saw_tool_calls = False  # legacy function_call deltas are ignored from then on
        self.usage: Usage | None = None
        self.usage_estimated = False
        self.saw_done = False
        self.retained_bytes = 0
        self.chunks = 0
        self.sealed_slots: list[ToolSlot] = []  # slots whose id was synthesized at the terminal
        self.token_data: TokenData | None = None  # only when the upstream sent any
        self._splitter = ThinkTagSplitter(reasoning_tags) if reasoning_tags else None
        self._estimate_usage = estimate_usage

    # -- feeding -----------------------------------------------------------------------

    def feed(self, chunk: dict) -> list[Piece]:
        """Merge one upstream chunk; return what may be released now."""
        self.chunks += 1
        if chunk.get("error"):
            raise upstream_error_frame(chunk["error"])
        self._take_usage(chunk.get("usage"))
        self._take_usage(_dict(chunk.get("x_groq")).get("usage"))
        pieces: list[Piece] = []
        for choice in chunk.get("choices") or ():
            if not isinstance(choice, dict) or (choice.get("index") or 0) != 0:
                continue  # n > 1 is refused at the door; ignore strays
            self._take_usage(choice.get("usage"))
            if choice.get("logprobs") or choice.get("token_ids") is not None or chunk.get("prompt_token_ids") is not None:
                if self.token_data is None:
                    self.token_data = TokenData()
                self.token_data.absorb(chunk, choice)
            delta = _dict(choice.get("delta"))
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
                self._add_text("text", refusal, pieces)
            tool_calls = [t for t in delta.get("tool_calls") or () if isinstance(t, dict)]
            if tool_calls:
                self._saw_tool_calls = True
            elif isinstance(delta.get("function_call"), dict) and not self._saw_tool_calls:
                tool_calls = [{"index": 0, "function": delta["function_call"]}]  # legacy shape
            for tool_delta in tool_calls:
                pieces.extend(self.merge_tool_call_delta(tool_delta))
            finish = choice.get("finish_reason")
            if isinstance(finish, str):
                self._take_finish(finish)
                if self.finish_reason is not None:
                    pieces.extend(self._flush_splitter())
        return pieces

    def feed_done(self) -> None:
        self.saw_done = True

    def _take_usage(self, raw: object) -> None:
        if isinstance(raw, dict) and raw:
            self.usage = Usage.from_upstream(raw)

    def _take_finish(self, finish: str) -> None:
        value = finish.strip().lower()
        if not value:
            self._empty_finish = True
            return
        if value == "error":
            raise stream_error("upstream_error", "the upstream finished with finish_reason 'error'")
        self.finish_reason = value

    def _add_text(self, kind: Literal["text", "reasoning"], text: str, pieces: list[Piece]) -> None:
        self._retain(text)
        (self.reasoning_parts if kind == "reasoning" else self.text_parts).append(text)
        if self.segments and self.segments[-1].kind == kind:
            self.segments[-1].parts.append(text)
        else:
            self.segments.append(Segment(kind, [text]))
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
            name = _dict(tool_delta.get("function")).get("name")
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
        call_id = tool_delta.get("id") or None
        function = _dict(tool_delta.get("function"))
        name = function.get("name") or None
        if call_id is not None and call_id != slot.id:
            if slot.id is not None:
                raise identity_changed(slot, "id", slot.id, call_id)
            slot.id = call_id
        if name is not None and name != slot.name:
            if slot.name is not None:
                raise identity_changed(slot, "name", slot.name, name)
            slot.name = name
        signature = _dict(_dict(tool_delta.get("extra_content")).get("google")).get("thought_signature")
        if isinstance(signature, str) and signature:
            slot.thought_signature = signature
        fragment = function.get("arguments")
        if isinstance(fragment, dict):
            # an object, not a string (llama.cpp): one fragment, once
            if slot.parts and parse_arguments(slot.arguments) == fragment:
                fragment = None
            else:
                fragment = orjson.dumps(fragment).decode()
        pieces: list[Piece] = []
        if fragment and isinstance(fragment, str):
            self._retain(fragment)
            slot.parts.append(fragment)
            if slot.announced:
                pieces.append(ToolArgs(slot, fragment))
        # announced once identified and its arguments (or a signature) have begun: a
        # thought signature sent in its own delta after the call's start still makes it
        # into the id clients see
        if not slot.announced and slot.identified and (slot.parts or slot.thought_signature):
            slot.announced = True
            pieces.append(ToolIdentified(slot))
        return pieces

    # -- the terminal ------------------------------------------------------------------

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    @property
    def reasoning(self) -> str:
        return "".join(self.reasoning_parts)

    def seal_tool_identities(self) -> list[ToolSlot]:
        """Give id-less named slots a gateway id; return the named slots not announced
        before (id synthesized now, or no arguments ever came)."""
        sealed = []
        for slot in self.slots:
            if slot.id is None and slot.name is not None:
                slot.id = "call_" + secrets.token_hex(12)
            if slot.name is not None and not slot.announced:
                slot.announced = True
                sealed.append(slot)
        return sealed

    def seal(self) -> Completion:
        """Validate the terminal and return the answer, or raise a GatewayError."""
        self._flush_splitter()  # realtime released it on the finish chunk already
        if self.finish_reason is None and self._empty_finish and self.saw_done:
            self.finish_reason = "stop"  # "" all along, then [DONE]: a complete answer
        if self.finish_reason is None:
            raise stream_error("upstream_incomplete", "the upstream ended without a finish_reason")
        finish = FINISH_MAP.get(self.finish_reason, "stop")
        self.sealed_slots = self.seal_tool_identities()
        calls = [validate_tool_slot(slot, self.rules) for slot in self.slots]
        check_tool_rules(calls, self.rules)
        if calls and finish == "stop":
            finish = "tool_calls"
        if finish == "tool_calls" and not calls:
            raise stream_error("tool_call_invalid", "finish_reason tool_calls without any tool call")
        if finish == "stop" and not calls and not self.text_parts:
            raise stream_error("empty_response", "the upstream finished without any output")
        completion = Completion(
            reasoning=self.reasoning,
            text=self.text,
            tool_calls=calls,
            finish_reason=finish,
            usage=self.usage,
            token_data=self.token_data,
            segments=[Segment(s.kind, ["".join(s.parts)]) for s in self.segments],
        )
        if completion.usage is None and self._estimate_usage is not None:
            completion.usage = self._estimate_usage(completion)
            self.usage_estimated = True
        return completion


def _dict(value: object) -> dict:
    """``value`` if it is an object, else ``{}`` (an explicit ``null`` is no field)."""
    return value if isinstance(value, dict) else {}


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
