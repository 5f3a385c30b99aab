"""Client JSON Schemas made safe to evaluate: what a tool's schema may contain, and the one
validator local tool-call repair applies them with.

A tool schema comes from the client, and ``jsonschema`` left alone fetches any ``$ref``
URL (urllib, no timeout; ``file://`` too), matches ``pattern`` with Python's backtracking
``re`` and follows ``$ref``/``allOf`` fan-out without limit. So:

- at parse time :func:`schema_hazard` refuses (400 ``invalid_tool_schema``) a schema
  whose references are not local (``#…`` resolving inside the document, to a subschema),
  that re-bases itself with a nested ``$id``, that has more than :data:`MAX_SCHEMA_NODES`
  subschemas, or whose references expand to more than :data:`MAX_EXPANSION` subschema
  visits (``allOf`` fan-out doubles per level);
- at repair time :func:`validates` builds the validator on a ``referencing.Registry``
  with no retrieve function (a reference it cannot resolve is an error, never a fetch),
  matches ``pattern``/``patternProperties``/``additionalProperties`` with google-re2
  (linear time; a pattern re2 cannot take means "cannot validate"), and counts keyword
  evaluations against :data:`MAX_EVALUATIONS` and a deadline. Anything it cannot decide
  within those is ``None``: the caller treats the repair as not possible.

Pure (no I/O): the caller decides where it runs (off the event loop: gateway/generation/offload.py).
"""

from __future__ import annotations

import functools
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import unquote

import jsonschema
import orjson
import re2
from jsonschema import validators as _validators
from jsonschema.exceptions import ValidationError
from referencing import Registry
from referencing.exceptions import Unresolvable

#: Subschemas (objects) in one tool schema; pydantic's largest real ones have a few hundred.
MAX_SCHEMA_NODES = 10_000
#: Subschema visits one instance node can cost when every ``$ref`` is followed (a DAG's
#: expanded size; a reference back to an ancestor counts once).
MAX_EXPANSION = 20_000
#: Keyword evaluations one validation may make (the bound for what the static count cannot
#: see: recursive references walked once per instance level).
MAX_EVALUATIONS = 50_000
#: Seconds one validation may take.
VALIDATION_SECONDS = 0.1

_SUBSCHEMA = ("items", "not", "additionalProperties", "additionalItems", "contains", "propertyNames",
              "if", "then", "else", "unevaluatedProperties", "unevaluatedItems")
_SUBSCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies")
_REFS = ("$ref", "$dynamicRef", "$recursiveRef")


def _join(path: str, key: str | int) -> str:
    return f"{path}.{key}" if path else str(key)


def _children(where: str, node: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    """The subschemas directly under ``node`` (schema positions only, never data such as
    ``enum``/``const``/``default``)."""
    for key in _SUBSCHEMA:
        child = node.get(key)
        if isinstance(child, (dict, bool)):
            yield _join(where, key), child
    for key in _SUBSCHEMA_LISTS:
        child = node.get(key)
        if isinstance(child, list):
            for i, c in enumerate(child):
                if isinstance(c, (dict, bool)):
                    yield _join(_join(where, key), i), c
    for key in _SUBSCHEMA_MAPS:
        child = node.get(key)
        if isinstance(child, dict):
            for k, c in child.items():
                if isinstance(c, (dict, bool)):  # draft 7 ``dependencies`` may hold lists of names
                    yield _join(_join(where, key), k), c


def _pointer(root: Any, fragment: str) -> Any:
    """The value at a JSON pointer fragment (``/a/b~1c``), or a sentinel when absent."""
    node = root
    for raw in fragment.split("/")[1:]:
        segment = unquote(raw).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and segment in node:
            node = node[segment]
        elif isinstance(node, list) and segment.isdigit() and int(segment) < len(node):
            node = node[int(segment)]
        else:
            return _MISSING
    return node


_MISSING = object()


#: Verdicts by the schema's JSON bytes: agents send the same tools every turn, so the walk
#: runs once per distinct schema (bounded; a schema over :data:`_CACHED_BYTES` is walked each time).
_VERDICTS: OrderedDict[bytes, tuple[str, str] | None] = OrderedDict()
_VERDICTS_MAX = 2048
_CACHED_BYTES = 64 * 1024
_VERDICTS_LOCK = threading.Lock()


def schema_hazard(schema: Any) -> tuple[str, str] | None:
    """(where, what) for the first thing in ``schema`` that makes it unsafe to evaluate,
    else None. Linear in the schema's size, iterative (no recursion however deep); cached."""
    if not isinstance(schema, dict):
        return None
    try:
        key = orjson.dumps(schema)
    except (TypeError, orjson.JSONEncodeError):
        return _walk(schema)
    if len(key) > _CACHED_BYTES:
        return _walk(schema)
    with _VERDICTS_LOCK:
        if key in _VERDICTS:
            _VERDICTS.move_to_end(key)
            return _VERDICTS[key]
    verdict = _walk(schema)
    with _VERDICTS_LOCK:
        _VERDICTS[key] = verdict
        while len(_VERDICTS) > _VERDICTS_MAX:
            _VERDICTS.popitem(last=False)
    return verdict


def _walk(schema: dict[str, Any]) -> tuple[str, str] | None:
    nodes: dict[int, dict[str, Any]] = {}
    edges: dict[int, list[Any]] = {}
    anchors: dict[str, dict[str, Any]] = {}
    refs: list[tuple[str, int, str, str]] = []  # (where, node id, keyword, reference)
    stack: list[tuple[str, Any]] = [("", schema)]
    while stack:
        where, node = stack.pop()
        if not isinstance(node, dict) or id(node) in nodes:
            continue
        nodes[id(node)] = node
        if len(nodes) > MAX_SCHEMA_NODES:
            return where, f"has more than {MAX_SCHEMA_NODES} subschemas"
        for key in ("$anchor", "$dynamicAnchor"):
            if isinstance(node.get(key), str):
                anchors[node[key]] = node
        ident = node.get("$id")
        if node is not schema and ident is not None:
            if not (isinstance(ident, str) and ident.startswith("#")):
                return _join(where, "$id"), "a nested $id that changes the base URI is not supported"
            anchors[ident[1:]] = node  # drafts 6/7: "$id": "#name" is an anchor
        for key in _REFS:
            if key in node:
                ref = node[key]
                if not isinstance(ref, str) or not ref.startswith("#"):
                    return _join(where, key), (
                        f"only local references ('#/...') are allowed, not {str(ref)[:80]!r}"
                    )
                refs.append((_join(where, key), id(node), key, ref))
        kids = list(_children(where, node))
        edges[id(node)] = [c for _, c in kids if isinstance(c, dict)]
        stack.extend(reversed(kids))
    for where, owner, _key, ref in refs:
        fragment = unquote(ref[1:])
        if fragment == "" or fragment.startswith("/"):
            target = _pointer(schema, fragment)
        else:
            target = anchors.get(fragment, _MISSING)
        if target is _MISSING:
            return where, f"{ref[:80]!r} does not resolve inside the schema"
        if isinstance(target, bool):
            continue
        if not isinstance(target, dict) or id(target) not in nodes:
            return where, f"{ref[:80]!r} does not point at a subschema"
        edges[owner].append(target)
    if refs and _expansion(schema, edges) > MAX_EXPANSION:  # without references: the node count
        return "", f"its references expand to more than {MAX_EXPANSION} subschemas"
    return None


def _expansion(root: dict[str, Any], edges: dict[int, list[Any]]) -> int:
    """The tree size of the schema graph unfolded along children and references (saturating
    past the cap); an edge back to a node being unfolded counts 1."""
    size: dict[int, int] = {}
    open_: set[int] = set()
    stack: list[tuple[dict[str, Any], bool]] = [(root, False)]
    while stack:
        node, closing = stack.pop()
        nid = id(node)
        if closing:
            total = 1 + sum(size.get(id(c), 1) for c in edges.get(nid, ()))
            size[nid] = min(total, MAX_EXPANSION + 1)
            open_.discard(nid)
            continue
        if nid in size or nid in open_:
            continue
        open_.add(nid)
        stack.append((node, True))
        stack.extend((c, False) for c in edges.get(nid, ()) if id(c) not in size and id(c) not in open_)
    return size.get(id(root), 1)


# -- the validator -------------------------------------------------------------------------------


class Undecidable(Exception):
    """The schema cannot be applied within the bounds (a pattern re2 refuses, the budget)."""


class _Budget(threading.local):
    left = MAX_EVALUATIONS
    deadline = 0.0


_BUDGET = _Budget()


_RE2_OPTIONS = re2.Options()
_RE2_OPTIONS.log_errors = False  # a refused pattern is an answer here, not a log line


@functools.lru_cache(maxsize=512)
def _regex(pattern: str) -> Any:
    try:
        return re2.compile(pattern, options=_RE2_OPTIONS)
    except Exception as exc:  # re2.error and friends: lookarounds, backreferences
        raise Undecidable(f"pattern {pattern[:80]!r} needs a backtracking engine") from exc


def _pattern(validator: Any, pattern: str, instance: Any, schema: Any) -> Iterator[ValidationError]:
    if validator.is_type(instance, "string") and not _regex(pattern).search(instance):
        yield ValidationError(f"{instance[:80]!r} does not match {pattern[:80]!r}")


def _pattern_properties(validator: Any, patterns: dict[str, Any], instance: Any, schema: Any) -> Iterator[ValidationError]:
    if not validator.is_type(instance, "object"):
        return
    for pattern, subschema in patterns.items():
        regex = _regex(pattern)
        for key, value in instance.items():
            if regex.search(key):
                yield from validator.descend(value, subschema, path=key, schema_path=pattern)


def _additional_properties(validator: Any, extra: Any, instance: Any, schema: Any) -> Iterator[ValidationError]:
    if not validator.is_type(instance, "object"):
        return
    known = schema.get("properties", {})
    regexes = [_regex(p) for p in schema.get("patternProperties", {})]
    additional = [k for k in instance if k not in known and not any(r.search(k) for r in regexes)]
    if validator.is_type(extra, "object"):
        for key in additional:
            yield from validator.descend(instance[key], extra, path=key)
    elif not extra and additional:
        yield ValidationError(f"additional properties are not allowed ({', '.join(map(repr, additional[:5]))})")


def _unique_items(validator: Any, unique: Any, instance: Any, schema: Any) -> Iterator[ValidationError]:
    """Linear (jsonschema's own falls back to comparing every pair for unhashable items)."""
    if not unique or not validator.is_type(instance, "array"):
        return
    seen: set[str] = set()
    for item in instance:
        key = _canonical(item)
        if key in seen:
            yield ValidationError(f"{str(instance)[:80]} has non-unique elements")
            return
        seen.add(key)


def _canonical(value: Any) -> str:
    def norm(v: Any) -> Any:
        if isinstance(v, bool) or v is None or isinstance(v, str):
            return v
        if isinstance(v, (int, float)):
            return float(v) if float(v) == v else v  # 1 and 1.0 are the same JSON number
        if isinstance(v, list):
            return [norm(x) for x in v]
        return {k: norm(x) for k, x in v.items()}

    return orjson.dumps(norm(value), option=orjson.OPT_SORT_KEYS).decode()


_OWN = {
    "pattern": _pattern,
    "patternProperties": _pattern_properties,
    "additionalProperties": _additional_properties,
    "uniqueItems": _unique_items,
}


def _counted(keyword: Callable[..., Any]) -> Callable[..., Any]:
    def evaluate(validator: Any, value: Any, instance: Any, schema: Any) -> Any:
        budget = _BUDGET
        budget.left -= 1
        if budget.left < 0:
            raise Undecidable(f"more than {MAX_EVALUATIONS} keyword evaluations")
        if budget.left % 64 == 0 and time.monotonic() > budget.deadline:
            raise Undecidable(f"validation took longer than {VALIDATION_SECONDS} s")
        return keyword(validator, value, instance, schema)

    return evaluate


_SUPPORTED = (
    _validators.Draft4Validator, _validators.Draft6Validator, _validators.Draft7Validator,
    _validators.Draft201909Validator, _validators.Draft202012Validator,
)


@functools.lru_cache(maxsize=None)
def _guarded(base: type) -> type:
    keywords = {name: _counted(_OWN.get(name, fn)) for name, fn in base.VALIDATORS.items()}
    return _validators.extend(base, keywords)


#: No retrieve function: a reference not in the schema itself is Unresolvable, never fetched.
_NO_RETRIEVAL: Registry[Any] = Registry()


def validates(instance: Any, schema: dict[str, Any], seconds: float = VALIDATION_SECONDS) -> bool | None:
    """True/False: ``instance`` does/does not validate against ``schema``; None: it cannot
    be decided safely (a hazard, an unresolvable reference, the budget, a pattern re2 cannot
    run, ``unevaluatedProperties`` next to ``patternProperties``)."""
    if schema_hazard(schema) is not None:
        return None
    base = _validators.validator_for(schema, default=_validators.Draft202012Validator)
    if base not in _SUPPORTED:
        return None
    if _mentions(schema, "unevaluatedProperties") and _mentions(schema, "patternProperties"):
        return None  # jsonschema matches those with Python's re internally
    budget = _BUDGET
    budget.left, budget.deadline = MAX_EVALUATIONS, time.monotonic() + seconds
    try:
        error = next(_guarded(base)(schema, registry=_NO_RETRIEVAL).iter_errors(instance), None)
    except (Undecidable, Unresolvable, RecursionError, jsonschema.SchemaError):
        return None
    except Exception:  # a keyword value the library cannot apply (e.g. a wrong type): undecided
        return None
    return error is None


def _mentions(schema: Any, keyword: str) -> bool:
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if keyword in node:
                return True
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return False
