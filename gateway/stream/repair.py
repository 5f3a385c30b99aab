"""Compatible-mode tool-call repair: first locally where provably safe, then by asking
the upstream again (the relay does that I/O; this module builds the request).

Local repair (json-repair for the structure, jsonschema for the meaning) is accepted only
when it invents nothing: markdown fences and prose around the object are stripped,
missing closing brackets and stray commas are fixed, but arguments cut off inside a
string or right after a key are *not* repaired (a value would have to be guessed), and
the result must validate against the tool's declared parameters schema.
"""

from __future__ import annotations

import copy
import re
from typing import Any

import json_repair
import jsonschema
import orjson

from gateway.errors import GatewayError
from gateway.stream.accumulator import ToolSlot, parse_arguments

REPAIR_MARKER = "[codebuddy2api repair]"
_FENCE = re.compile(r"^\s*```[a-zA-Z0-9_-]*\s*\n?(.*?)\n?\s*```\s*$", re.DOTALL)

#: Errors a regeneration can cure; anything else (budget, upstream failure) is final.
REPAIRABLE_CODES = frozenset({"tool_call_invalid", "tool_identity_changed"})


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


def repair_arguments(arguments: str, schema: dict[str, Any] | None) -> str | None:
    """Repaired arguments as compact JSON, or None when no safe repair exists."""
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
    if schema:
        try:
            jsonschema.validate(value, schema)
        except (jsonschema.ValidationError, jsonschema.SchemaError):
            return None
    return orjson.dumps(value).decode()


def repair_slots_locally(slots: list[ToolSlot], schemas: dict[str, dict[str, Any]]) -> list[int]:
    """Patch every slot whose arguments are not a JSON object, if all can be repaired.

    Returns the ordinals repaired (empty when nothing needed or something could not be).
    """
    broken = [s for s in slots if parse_arguments(s.arguments) is None]
    fixes: list[tuple[ToolSlot, str]] = []
    for slot in broken:
        fixed = repair_arguments(slot.arguments, schemas.get(slot.name or ""))
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
