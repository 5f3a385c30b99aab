"""Compatible-mode tool-call repair: first locally where provably safe, then by asking
the upstream again. :class:`RepairPolicy` decides each step (pure); the generation loop
does the I/O of a regeneration; this module builds its request.

Local repair (json-repair for the structure, jsonschema for the meaning) is accepted only
when it invents nothing: markdown fences and prose around the object are stripped,
missing closing brackets and stray commas are fixed, but arguments cut off inside a
string or right after a key are *not* repaired (a value would have to be guessed), and
the result must validate against the tool's declared parameters schema, applied by
:func:`gateway.stream.schema_guard.validates` (no reference fetched, re2 patterns, bounded
work); a schema that cannot be decided within those bounds means no local repair.
"""

from __future__ import annotations

import copy
import re
import time
from typing import Any

import json_repair
import orjson

from gateway.errors import ErrorCode, GatewayError
from gateway.stream.accumulator import ChatSSEAccumulator, ToolSlot, parse_arguments
from gateway.stream.events import Completion
from gateway.stream.schema_guard import VALIDATION_SECONDS, validates

#: Seconds all of one answer's schema validations may take together.
REPAIR_SECONDS = 3 * VALIDATION_SECONDS

REPAIR_MARKER = "[codebuddy2api repair]"
_FENCE = re.compile(r"^\s*```[a-zA-Z0-9_-]*\s*\n?(.*?)\n?\s*```\s*$", re.DOTALL)

#: Errors a regeneration can cure; anything else (budget, upstream failure) is final.
REPAIRABLE_CODES = frozenset({ErrorCode.TOOL_CALL_INVALID, ErrorCode.TOOL_IDENTITY_CHANGED})


def tool_schemas(upstream_body: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Declared parameter schemas by tool name, from the translated upstream body."""
    schemas: dict[str, dict[str, Any]] = {}
    for tool in upstream_body.get("tools") or ():
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            params = function.get("parameters")
            schemas[function["name"]] = params if isinstance(params, dict) else {}
    return schemas


def _ends_inside_string_or_after_key(text: str) -> bool:
    in_string = escaped = False
    last = ""
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
                last = '"'
        elif ch == '"':
            in_string = True
        elif not ch.isspace():
            last = ch
    return in_string or last == ":"


def repair_arguments(
    arguments: str, schema: dict[str, Any] | None, seconds: float = VALIDATION_SECONDS
) -> str | None:
    """Repaired arguments as compact JSON, or None when no safe repair exists (``seconds``:
    the schema validation's time budget)."""
    text = arguments.strip()
    fenced = _FENCE.match(text)
    if fenced:
        text = fenced.group(1).strip()
    value: Any = parse_arguments(text) if text.startswith("{") else None
    if value is None:
        if _ends_inside_string_or_after_key(text):
            return None
        try:
            value = json_repair.loads(text)
        except Exception:  # the library's own failure modes are not ours to classify
            return None
    if not isinstance(value, dict) or (not value and text.strip() not in ("", "{}")):
        return None
    if schema and validates(value, schema, seconds) is not True:
        return None  # invalid, or a schema that cannot be applied safely: no safe repair
    return orjson.dumps(value).decode()


def repair_slots_locally(slots: list[ToolSlot], schemas: dict[str, dict[str, Any]]) -> list[int]:
    """Patch every slot whose arguments are not a JSON object, if all can be repaired.

    Returns the ordinals repaired (empty when nothing needed or something could not be,
    also when the validations together would take longer than :data:`REPAIR_SECONDS`).
    """
    broken = [s for s in slots if parse_arguments(s.arguments) is None]
    fixes: list[tuple[ToolSlot, str]] = []
    deadline = time.monotonic() + REPAIR_SECONDS
    for slot in broken:
        left = min(VALIDATION_SECONDS, deadline - time.monotonic())
        if left <= 0:
            return []
        fixed = repair_arguments(slot.arguments, schemas.get(slot.name or ""), left)
        if fixed is None:
            return []
        fixes.append((slot, fixed))
    for slot, fixed in fixes:
        slot.parts[:] = [fixed]
    return [slot.ordinal for slot, _ in fixes]


def regeneration_body(upstream_body: dict[str, Any], error: GatewayError) -> dict[str, Any]:
    """The same request, plus a note telling the model what was wrong with its answer."""
    body = copy.deepcopy(upstream_body)
    body["messages"] = [
        *body.get("messages", []),
        {
            "role": "user",
            "content": (
                f"{REPAIR_MARKER} Your previous reply was rejected: {error.message}. "
                "Reply again from the start. Every tool call must name a declared tool and its "
                "arguments must be one complete JSON object matching that tool's parameters."
            ),
        },
    ]
    return body


def usage_dict(acc: ChatSSEAccumulator) -> dict[str, int]:
    u = acc.usage
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens} if u else {}


class RepairPolicy:
    """Decides, for each collected answer, whether it stands, is repaired locally, is
    regenerated (returns the next upstream body) or fails. No I/O.

    Once repair is involved, every attempt is logged in :attr:`log` (kind, attempt,
    outcome, reason, usage) for the audit record.
    """

    def __init__(self, upstream_body: dict[str, Any], max_regenerations: int) -> None:
        self.upstream_body = upstream_body
        self.max_regenerations = max_regenerations
        self.schemas = tool_schemas(upstream_body)
        #: False when the validation could not get a worker: no local repair then
        self.allow_local = True
        self.log: list[dict[str, Any]] = []

    def may_validate(self, acc: ChatSSEAccumulator) -> bool:
        """Whether deciding ``acc`` may run a schema validation (some call's arguments are
        not a JSON object and a tool declares a schema): the caller runs :meth:`decide`
        off the event loop then."""
        return any(self.schemas.values()) and any(parse_arguments(s.arguments) is None for s in acc.slots)

    def time_since(self, logged: int, began: float, ended: float) -> None:
        """When the steps logged after the first ``logged`` ran (the trace's repair spans,
        wall clock): an answer's read (``began`` .. ``ended``) for ``original`` and
        ``regenerate``, an instant at its end for ``local``."""
        for entry in self.log[logged:]:
            local = entry.get("kind") == "local"
            entry.setdefault("started_at", ended if local else began)
            entry.setdefault("duration_ms", 0.0 if local else round((ended - began) * 1000, 1))

    def decide(self, acc: ChatSSEAccumulator, attempt: int) -> Completion | dict[str, Any]:
        """The validated answer of ``attempt`` (0 = original), or the body of the next
        regeneration; raises the final GatewayError when neither is possible."""
        kind = "original" if attempt == 0 else "regenerate"
        usage = usage_dict(acc)
        try:
            completion = acc.seal()
        except GatewayError as err:
            if err.code not in REPAIRABLE_CODES:
                raise
            error = err
        else:
            if attempt:
                self.log.append({"kind": kind, "attempt": attempt, "outcome": "valid", "usage": usage})
            return completion
        if (
            error.code == ErrorCode.TOOL_CALL_INVALID
            and self.allow_local
            and repair_slots_locally(acc.slots, self.schemas)
        ):
            try:
                completion = acc.seal()
            except GatewayError:
                pass
            else:
                self.log.append(
                    {"kind": "local", "attempt": attempt, "outcome": "repaired", "reason": error.message, "usage": usage}
                )
                return completion
        self.log.append({"kind": kind, "attempt": attempt, "outcome": "invalid", "reason": error.message, "usage": usage})
        if attempt >= self.max_regenerations:
            raise GatewayError(
                error.kind, error.code, f"{error.message} (still invalid after {attempt} regeneration attempt(s))"
            )
        return regeneration_body(self.upstream_body, error)
