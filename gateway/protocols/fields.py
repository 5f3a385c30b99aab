"""Bounds every request value obeys, and the field types the rooms' request models share.

Strict validation before anything goes upstream ("fail closed, named error"): a request
is refused with a 400 naming the field when any value nests deeper than
:data:`MAX_DEPTH`, any string is longer than :data:`MAX_TEXT_CHARS` (keys:
:data:`MAX_KEY_CHARS`), any number is not finite, or a known field has the wrong type or
range. The limits are sized so real traffic never meets them (a 2 M-character prompt, a
70 KB Claude Code body, pydantic-generated tool schemas), and so nothing downstream can
fail on what was accepted: orjson serialises up to 255 levels, the tokenizer is fed in
pieces, and tool schemas are checked here so that validating arguments against them
later cannot raise.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Annotated, Any

from pydantic import AfterValidator, Field, StrictBool, StrictInt, StrictStr
from pydantic_core import PydanticCustomError

from gateway.errors import invalid_request
from gateway.stream.schema_guard import schema_hazard

#: Levels of objects/lists below the body (the body's own keys are level 1).
MAX_DEPTH = 64
#: Characters in any one string (8 Mi characters: about 2 M tokens, the largest context offered).
MAX_TEXT_CHARS = 8 * 1024 * 1024
#: Characters in any object key.
MAX_KEY_CHARS = 1024
#: Characters in a model name, tool name or schema name.
MAX_NAME_CHARS = 256
#: The largest ``max_tokens`` (and its relatives) the gateway passes on.
MAX_OUTPUT_TOKENS = 1_048_576
_INT64 = 2**63
#: Items a body may multiply, per list (Anthropic's own cap on messages is 100,000; real
#: agent sessions send a few thousand). Each past its bound is a named 400 with ``param``.
MAX_MESSAGES = 50_000
MAX_TOOLS = 2_000
MAX_STOP_SEQUENCES = 64
MAX_CONTENT_PARTS = 4_096
#: Objects and lists in a whole body (what parsing and validating it costs).
MAX_CONTAINERS = 500_000


def _join(path: str, key: str | int) -> str:
    return f"{path}.{key}" if path else str(key)


def _too_many(param: str, count: int, limit: int, code: str, what: str) -> None:
    if count > limit:
        raise invalid_request(f"{param} has {count} {what}; at most {limit} are accepted", param=param, code=code)


def check_item_limits(body: dict[str, Any]) -> None:
    """Refuse a body that multiplies items past the bounds (``len`` only: it runs before the
    body is walked or validated, so a million messages cost no more than their parse):
    ``messages``/``input`` items (``too_many_messages``/``too_many_input_items``),
    ``tools`` (also a namespace's; ``too_many_tools``), ``stop``/``stop_sequences``
    (``too_many_stop_sequences``), content parts of ``system`` and of each message or input
    item (``too_many_content_parts``) and tool calls of each message (``too_many_tool_calls``)."""
    for key, code, what in (("messages", "too_many_messages", "messages"),
                            ("input", "too_many_input_items", "input items")):
        items = body.get(key)
        if isinstance(items, list):
            _too_many(key, len(items), MAX_MESSAGES, code, what)
            for i, item in enumerate(items):
                if isinstance(item, dict):
                    for inner, limit, inner_code, inner_what in (
                        ("content", MAX_CONTENT_PARTS, "too_many_content_parts", "content parts"),
                        ("tool_calls", MAX_TOOLS, "too_many_tool_calls", "tool calls"),
                    ):
                        if isinstance(item.get(inner), list):
                            _too_many(f"{key}.{i}.{inner}", len(item[inner]), limit, inner_code, inner_what)
    tools = body.get("tools")
    if isinstance(tools, list):
        nested = sum(len(t["tools"]) for t in tools if isinstance(t, dict) and isinstance(t.get("tools"), list))
        _too_many("tools", len(tools) + nested, MAX_TOOLS, "too_many_tools", "tools")
    for key in ("stop", "stop_sequences"):
        if isinstance(body.get(key), list):
            _too_many(key, len(body[key]), MAX_STOP_SEQUENCES, "too_many_stop_sequences", "stop sequences")
    if isinstance(body.get("system"), list):
        _too_many("system", len(body["system"]), MAX_CONTENT_PARTS, "too_many_content_parts", "content parts")


def check_value_limits(body: Any) -> None:
    """Walk the whole request (iteratively: no recursion however deep) and refuse the first
    value past a limit with a 400 whose ``param`` is its path (``messages.0.content``), or a
    body of more than :data:`MAX_CONTAINERS` objects and lists (``too_many_values``)."""
    stack: list[tuple[str, Any, int]] = [("", body, 0)]
    containers = 0
    while stack:
        path, value, depth = stack.pop()
        if isinstance(value, str):
            if len(value) > MAX_TEXT_CHARS:
                raise invalid_request(
                    f"{path or 'the body'} is longer than {MAX_TEXT_CHARS} characters",
                    param=path or None,
                    code="string_too_long",
                )
        elif isinstance(value, float):
            if not math.isfinite(value):
                raise invalid_request(f"{path} must be a finite number", param=path or None, code="invalid_value")
        elif isinstance(value, (dict, list)):
            containers += 1
            if containers > MAX_CONTAINERS:
                raise invalid_request(
                    f"the body holds more than {MAX_CONTAINERS} objects and lists", code="too_many_values"
                )
            if depth >= MAX_DEPTH:
                raise invalid_request(
                    f"{path} nests deeper than {MAX_DEPTH} levels",
                    param=path or None,
                    code="nesting_too_deep",
                )
            if isinstance(value, dict):
                for key, child in value.items():
                    if len(key) > MAX_KEY_CHARS:
                        raise invalid_request(
                            f"a key of {path or 'the body'} is longer than {MAX_KEY_CHARS} characters",
                            param=path or None,
                            code="string_too_long",
                        )
                    stack.append((_join(path, key), child, depth + 1))
            else:
                stack.extend((_join(path, i), child, depth + 1) for i, child in enumerate(value))


# -- tool and response-format schemas ----------------------------------------------------------

_TYPES = frozenset({"object", "array", "string", "number", "integer", "boolean", "null"})
_SUBSCHEMA = ("items", "not", "additionalProperties", "additionalItems", "contains", "propertyNames",
              "if", "then", "else", "unevaluatedProperties", "unevaluatedItems")
_SUBSCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_NUMBERS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")


def schema_problem(schema: Any) -> tuple[str, str] | None:
    """(where, what) for the first keyword of a JSON schema whose value cannot be what
    JSON Schema means by it, else None. Only the keywords that validating arguments
    against the schema relies on (types, sub-schemas, ``required``, ``pattern``, bounds)
    are checked; any other keyword is the upstream's business. Linear in the schema's size
    (a full meta-schema check costs ~7 ms a schema)."""
    stack: list[tuple[str, Any]] = [("", schema)]
    while stack:
        where, node = stack.pop()
        if isinstance(node, bool):
            continue
        if not isinstance(node, dict):
            return where, "a schema must be an object or a boolean"
        kind = node.get("type")
        if kind is not None:
            kinds = kind if isinstance(kind, list) else [kind]
            if not kinds or not all(isinstance(k, str) and k in _TYPES for k in kinds):
                return _join(where, "type"), f"must be one of {sorted(_TYPES)} or a list of them"
        for key in _SUBSCHEMA:
            if key in node:
                child = node[key]
                if key in ("items", "additionalItems") and isinstance(child, list):  # draft 4-7 tuples
                    stack.extend((_join(_join(where, key), i), c) for i, c in enumerate(child))
                else:
                    stack.append((_join(where, key), child))
        for key in _SUBSCHEMA_LISTS:
            if key in node:
                if not isinstance(node[key], list) or not node[key]:
                    return _join(where, key), "must be a non-empty list of schemas"
                stack.extend((_join(_join(where, key), i), c) for i, c in enumerate(node[key]))
        for key in _SUBSCHEMA_MAPS:
            if key in node:
                if not isinstance(node[key], dict):
                    return _join(where, key), "must be an object of schemas"
                stack.extend((_join(_join(where, key), k), c) for k, c in node[key].items())
        required = node.get("required")
        if required is not None and not (
            isinstance(required, list) and all(isinstance(r, str) for r in required)
        ):
            return _join(where, "required"), "must be a list of strings"
        for key in ("pattern", "$ref"):
            if key in node and not isinstance(node[key], str):
                return _join(where, key), "must be a string"
        patterns = [node["pattern"]] if "pattern" in node else []
        if isinstance(node.get("patternProperties"), dict):
            patterns += list(node["patternProperties"])
        for pattern in patterns:
            try:
                re.compile(pattern)
            except (re.error, RecursionError, OverflowError):
                return _join(where, "pattern"), f"{pattern[:80]!r} is not a regular expression"
        for key in _NUMBERS:
            if key in node and (isinstance(node[key], bool) or not isinstance(node[key], (int, float))):
                if key.startswith("exclusive") and isinstance(node[key], bool):
                    continue  # draft 4 booleans
                return _join(where, key), "must be a number"
        for key in _COUNTS:
            value = node.get(key)
            if key in node and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                return _join(where, key), "must be a non-negative integer"
        if "enum" in node and not isinstance(node["enum"], list):
            return _join(where, "enum"), "must be a list"
    return None


def object_schema_problem(schema: Any) -> tuple[str, str] | None:
    """As :func:`schema_problem`, for a tool's ``parameters``/``input_schema``: it must also
    describe an object (tool arguments are JSON objects)."""
    if not isinstance(schema, dict):
        return "", "must be a JSON schema object"
    kind = schema.get("type")
    if kind is not None and kind != "object" and not (isinstance(kind, list) and "object" in kind):
        return "type", f"must describe an object (type 'object'), not {kind!r}"
    return schema_problem(schema)


def check_object_schema(schema: Any, param: str) -> None:
    """A tool's schema, else a 400 naming the keyword (``tools.0.input_schema.properties.a.type``):
    ``invalid_schema`` for a keyword that cannot mean what JSON Schema says, then
    ``invalid_tool_schema`` for one unsafe to evaluate (a non-local ``$ref``, too large, a
    reference fan-out: ``stream.schema_guard``)."""
    _refuse_schema(object_schema_problem(schema), param)
    _refuse_schema(schema_hazard(schema), param, "invalid_tool_schema")


def check_schema(schema: Any, param: str) -> None:
    """A structured-output schema, else a 400 naming the keyword."""
    _refuse_schema(schema_problem(schema), param)


def _refuse_schema(problem: tuple[str, str] | None, param: str, code: str = "invalid_schema") -> None:
    if problem is not None:
        where, what = problem
        at = _join(param, where) if where else param
        raise invalid_request(f"{at}: {what}", param=at, code=code)


def _tool_schema(value: Any) -> Any:
    """The request models' check of a tool's parameters (Chat): as :func:`check_object_schema`."""
    problem = object_schema_problem(value)
    if problem is None:
        hazard = schema_hazard(value)
        if hazard is not None:
            where, what = hazard
            raise PydanticCustomError("invalid_tool_schema", "{what}", {"what": f"{where}: {what}" if where else what})
        return value
    where, what = problem
    raise ValueError(f"{where}: {what}" if where else what)


def _validator(problem_of: Callable[[Any], tuple[str, str] | None]) -> Callable[[Any], Any]:
    def validate(value: Any) -> Any:
        problem = problem_of(value)
        if problem is not None:
            where, what = problem
            raise ValueError(f"{where}: {what}" if where else what)
        return value

    return validate


# -- field types for the request models --------------------------------------------------------

Name = Annotated[StrictStr, Field(min_length=1, max_length=MAX_NAME_CHARS)]
OutputTokens = Annotated[StrictInt, Field(ge=1, le=MAX_OUTPUT_TOKENS)]
Int64 = Annotated[StrictInt, Field(ge=-_INT64, lt=_INT64)]
Count = Annotated[StrictInt, Field(ge=0, le=MAX_OUTPUT_TOKENS)]
Flag = StrictBool
#: A tool's parameters: a JSON schema object describing an object.
ObjectSchema = Annotated[dict[str, Any], AfterValidator(_tool_schema)]
#: A JSON schema (structured output).
Schema = Annotated[dict[str, Any], AfterValidator(_validator(schema_problem))]


def number(ge: float | None = None, le: float | None = None, gt: float | None = None) -> Any:
    """A finite JSON number (int or float, never a boolean) within the bounds."""
    return Annotated[float, Field(strict=True, ge=ge, le=le, gt=gt, allow_inf_nan=False)]


Probability = number(0, 1)
Temperature = number(0, 2)
Penalty = number(-2, 2)
TokenBias = number(-100, 100)
#: vLLM's repetition_penalty and the like: a positive factor.
PositiveFactor = number(gt=0, le=100)
#: vLLM's top_k: -1 (and 0) mean "off".
TopK = Annotated[StrictInt, Field(ge=-1, le=MAX_OUTPUT_TOKENS)]
TokenId = Annotated[StrictInt, Field(ge=0, lt=2**31)]
StopSequences = StrictStr | list[StrictStr]
