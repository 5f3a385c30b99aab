"""ToolCallMerger: the upstream's ``delta.tool_calls`` merged into one slot per call.

The accumulator hands it only the deltas that carry tool calls (text never comes here).
Tool slots are keyed by the upstream ``index``; where an upstream omits ``index``, by
``id``; a delta with neither continues the last slot. A slot is *identified* once it has a
name and an id (an id may also be synthesized at the terminal, :meth:`seal_identities`).
``id`` and ``name`` are whole values: a repeat is ignored, a different value is an
identity change and rejected.

What real servers send differently about calls is normalised here:

- ``arguments`` as a JSON *object* (llama.cpp) is serialised once, as one fragment (a
  repeat of the same object is ignored);
- some upstreams reuse index 0 for every parallel call: a new id with a name after a
  finished argument object starts a new slot;
- a legacy ``function_call`` delta is a call only when the stream sends no ``tool_calls``
  (llama-cpp-python sends both on every chunk: the call is counted once);
- Gemini's ``extra_content.google.thought_signature`` on a call is kept on its slot.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass, field

import orjson

from gateway.errors import GatewayError
from gateway.stream.signatures import Seal, client_call_id


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
    seal: Seal | None = None  # seals the signature into the id (the request's tenant's)
    _sealed: tuple[str, str | None, str] | None = None  # (id, signature, client id) last built

    @property
    def client_id(self) -> str | None:
        """The id clients see: the upstream's, carrying its sealed thought signature (once
        shown, it never changes; a signature arriving after that is not carried). Built
        once per (id, signature): sealing is randomised, the id must not be."""
        if self.shown_id is not None or self.id is None:
            return self.shown_id or self.id
        if self._sealed is None or self._sealed[:2] != (self.id, self.thought_signature):
            self._sealed = (self.id, self.thought_signature, client_call_id(self.id, self.thought_signature, self.seal))
        return self._sealed[2]

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
class ToolIdentified:
    slot: ToolSlot


@dataclass(frozen=True, slots=True)
class ToolArgs:
    slot: ToolSlot
    fragment: str


ToolPiece = ToolIdentified | ToolArgs


class ToolCallMerger:
    """Fed each upstream delta that carries tool calls (``feed``): merges them into
    :class:`ToolSlot`\\ s, in the order the calls began, and returns what a scheduler may
    release. No I/O. ``retain`` (per call, so the merger holds no reference back to its
    accumulator) is told of every argument fragment before it is kept: the output-byte
    budget, which raises to refuse one."""

    def __init__(self, seal: Seal | None = None) -> None:
        self.seal = seal  # thought signatures into ids; None: not carried (unit uses)
        self.slots: list[ToolSlot] = []
        self._slot_by_key: dict[tuple[str, object], ToolSlot] = {}
        self._saw_tool_calls = False  # legacy function_call deltas are ignored from then on

    def feed(self, delta: dict, retain: Callable[[str], None]) -> list[ToolPiece]:
        """Merge one delta's ``tool_calls`` (or its legacy ``function_call``)."""
        tool_calls = [t for t in delta.get("tool_calls") or () if isinstance(t, dict)]
        if tool_calls:
            self._saw_tool_calls = True
        elif isinstance(delta.get("function_call"), dict) and not self._saw_tool_calls:
            tool_calls = [{"index": 0, "function": delta["function_call"]}]  # legacy shape
        pieces: list[ToolPiece] = []
        for tool_delta in tool_calls:
            self.merge(tool_delta, retain, pieces)
        return pieces

    def merge(self, tool_delta: dict, retain: Callable[[str], None], pieces: list[ToolPiece]) -> None:
        """Merge one ``delta.tool_calls[]`` item into its slot; append what is released."""
        slot = self._slot_for(tool_delta)
        call_id = tool_delta.get("id") or None
        function = object_or_empty(tool_delta.get("function"))
        name = function.get("name") or None
        if call_id is not None and call_id != slot.id:
            if slot.id is not None:
                raise identity_changed(slot, "id", slot.id, call_id)
            slot.id = call_id
        if name is not None and name != slot.name:
            if slot.name is not None:
                raise identity_changed(slot, "name", slot.name, name)
            slot.name = name
        google = object_or_empty(object_or_empty(tool_delta.get("extra_content")).get("google"))
        signature = google.get("thought_signature")
        if isinstance(signature, str) and signature:
            slot.thought_signature = signature
        fragment = function.get("arguments")
        if isinstance(fragment, dict):
            # an object, not a string (llama.cpp): one fragment, once
            if slot.parts and parse_arguments(slot.arguments) == fragment:
                fragment = None
            else:
                fragment = orjson.dumps(fragment).decode()
        if fragment and isinstance(fragment, str):
            retain(fragment)
            slot.parts.append(fragment)
            if slot.announced:
                pieces.append(ToolArgs(slot, fragment))
        # announced once identified and its arguments (or a signature) have begun: a
        # thought signature sent in its own delta after the call's start still makes it
        # into the id clients see
        if not slot.announced and slot.identified and (slot.parts or slot.thought_signature):
            slot.announced = True
            pieces.append(ToolIdentified(slot))

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
            name = object_or_empty(tool_delta.get("function")).get("name")
            if name and slot.arguments_complete():
                # Some upstreams reuse index 0 for every parallel call: a new id with a
                # name after a finished argument object is a new call, not a change.
                key = (key[0], (key[1], len(self.slots)))
                slot = None
        if slot is None:
            slot = ToolSlot(ordinal=len(self.slots), seal=self.seal)
            self.slots.append(slot)
            self._slot_by_key[key] = slot
        return slot

    def seal_identities(self) -> list[ToolSlot]:
        """At the terminal: give id-less named slots a gateway id; return the named slots
        not announced before (id synthesized now, or no arguments ever came)."""
        sealed = []
        for slot in self.slots:
            if slot.id is None and slot.name is not None:
                slot.id = "call_" + secrets.token_hex(12)
            if slot.name is not None and not slot.announced:
                slot.announced = True
                sealed.append(slot)
        return sealed


def object_or_empty(value: object) -> dict:
    """``value`` if it is an object, else ``{}`` (an explicit ``null`` is no field)."""
    return value if isinstance(value, dict) else {}


def identity_changed(slot: ToolSlot, what: str, old: str, new: str) -> GatewayError:
    return GatewayError(
        "upstream",
        "tool_identity_changed",
        f"tool call #{slot.ordinal} changed its {what} from {old!r} to {new!r} mid-stream",
    )
